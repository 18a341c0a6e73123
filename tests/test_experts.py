"""Expert parallelism: an MoE model with experts sharded over ep (and FSDP over the expert-dp ranks)
has the single-device gradients, global norm and parameters after clipped steps. The same in
``Trainer.fit``: test_experts_trainer.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from test_norm_dtensor import assert_close
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_ndclip as nd
from lightning_ndclip.core.experts import MoE, shard_experts

TOKENS_PER_RANK, WORLD, LR, MAX_NORM = 6, 4, 0.2, 0.05


class MoEModel(nn.Module):
    def __init__(self, skew_router: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.moe = MoE(8, 16, num_experts=4, top_k=2)
        self.head = nn.Linear(8, 3)
        self.double()
        if skew_router:  # every token picks experts 0 and 1: the ranks owning 2 and 3 get no token
            self.moe.router = nn.Linear(8, 4).double()
            with torch.no_grad():
                self.moe.router.weight.mul_(0.01)
                self.moe.router.bias.copy_(torch.tensor([5.0, 5.0, -50.0, -50.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.moe(h))


def _data(rank: int | None = None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * TOKENS_PER_RANK, 6, generator=g, dtype=torch.float64)
    y = torch.randn(WORLD * TOKENS_PER_RANK, 3, generator=g, dtype=torch.float64)
    if rank is None:
        return x, y
    return x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]


def _reference(steps: int, skew: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MoEModel(skew)
    x, y = _data()
    if skew:
        chosen = model.moe.router(torch.tanh(model.inp(x))).topk(2, dim=-1).indices
        assert set(chosen.unique().tolist()) == {0, 1}
    norms = []
    for _ in range(steps):
        model.zero_grad()
        (((model(x) - y) ** 2).sum() / x.shape[0]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _ep_case(ep: int, steps: int, skew: bool) -> dict:
    dense_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    expert_mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("edp", "ep"))
    model = MoEModel(skew)
    shard_experts(model.moe, expert_mesh["ep"])
    fully_shard(model.moe.experts, mesh=expert_mesh["edp"])  # expert grads summed over expert-dp
    for layer in (model.inp, model.head):
        fully_shard(layer, mesh=dense_mesh)
    fully_shard(model, mesh=dense_mesh)  # the router: dense, summed over every data rank
    nd.use_sum_reduction(model)
    x, y = _data(dist.get_rank())
    norms = []
    for _ in range(steps):
        model.zero_grad()
        (((model(x) - y) ** 2).sum() / (WORLD * TOKENS_PER_RANK)).backward()
        norms.append(float(nd.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    expert_split = nd.grad_norms(model).as_dict()
    return {"norms": norms, "params": params, "expert_norm_names": sorted(k for k in expert_split if "experts" in k)}


def _ep_warnings_case() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ep_case(2, 1, False)
    return [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]


def test_the_token_exchange_uses_no_deprecated_pytorch_api():
    """torch.distributed.nn.functional.all_to_all_single warned FutureWarning on every call."""
    assert run_on_ranks(WORLD, _ep_warnings_case) == [[]] * WORLD


@pytest.mark.parametrize("ep,skew", [(4, False), (2, False), (4, True)], ids=["ep4", "ep2xedp2", "ep4-idle-ranks"])
def test_expert_parallel_matches_single_device(ep, skew):
    ref_norms, ref_params = _reference(2, skew)
    results = run_on_ranks(WORLD, _ep_case, ep, 2, skew)
    for r in results:
        for ours, ref in zip(r["norms"], ref_norms):
            assert_close(torch.tensor(ours), torch.tensor(ref))
        for name, value in r["params"].items():
            err = float((value - ref_params[name]).norm() / ref_params[name].norm())
            assert err < 1e-10, (name, err)
        assert r["expert_norm_names"] == ["moe.experts.w_in", "moe.experts.w_out"]
    assert max(ref_norms) > MAX_NORM, "clipping should be active"
