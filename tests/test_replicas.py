"""broadcast_replicas_: replicas of parameters and buffers end equal to their copy at coordinate 0."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_ndclip import broadcast_replicas_


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).double()
    model.register_buffer("scale", torch.randn(3, dtype=torch.float64))  # a plain tensor on every rank
    return model


def _hsdp_case():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model(seed=dist.get_rank())  # no common seed: every rank draws its own values
    fully_shard(model, mesh=mesh)
    before = {n: p.full_tensor() for n, p in model.named_parameters()}  # this rank's replica, gathered
    scale = model.scale.clone()
    broadcasts = broadcast_replicas_(model, plain_mesh=mesh)
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    return before, scale, after, model.scale.clone(), broadcasts


def test_hsdp_replicas_and_plain_buffers_take_the_first_replicas_values():
    results = run_on_ranks(4, _hsdp_case)
    before0, scale0 = results[0][0], results[0][1]
    # the hazard: fully_shard alone leaves replica 1 (ranks 2, 3) different from replica 0
    assert all(not torch.equal(results[2][0][n], before0[n]) for n in before0)
    for _, _, after, scale, broadcasts in results:
        assert broadcasts == 2  # over dp_replicate (the parameters and the buffer), over dp_shard (the buffer)
        assert all(torch.equal(after[n], before0[n]) for n in before0)  # replica 0 kept its values
        assert torch.equal(scale, scale0)


def _fsdp_only_case() -> int:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.register_buffer("rank_specific", torch.full((2,), float(dist.get_rank())))
    fully_shard(model, mesh=mesh)
    broadcasts = broadcast_replicas_(model)
    assert model.rank_specific.tolist() == [float(dist.get_rank())] * 2
    return broadcasts


def test_sharded_pieces_are_not_copies_and_plain_tensors_are_left_alone_by_default():
    assert run_on_ranks(2, _fsdp_only_case) == [0, 0]
