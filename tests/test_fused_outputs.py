"""The fused-projection trap (``core.parallel.fused_outputs``), pure PyTorch on 2 tp ranks: a ColwiseParallel
projection whose output the model chunks into q, k, v (or gate, up) is named at the first forward; the head-major
layout split with ``view`` and a colwise layer whose output is gathered are not refused. In the Trainer, with the
rest of a real training setup: test_fused_outputs_trainer.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ndclip.core.parallel.fused_outputs import refuse_chunked_colwise_outputs

WIDTH, HEADS = 16, 4


class Attention(nn.Module):
    def __init__(self, split: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.split = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), split

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        qkv = self.qkv(h)
        if self.split == "head-major view":
            q, k, v = qkv.view(b, s, -1, 3, WIDTH // HEADS).permute(3, 0, 2, 1, 4)
        else:  # q, then k, then v: chunk / split along the features
            parts = qkv.chunk(3, -1) if self.split == "chunk" else torch.split(qkv, WIDTH, dim=-1)
            q, k, v = (t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for t in parts)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


def _case(split: str, gathered: bool) -> str:
    model = Attention(split)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    qkv = ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
    proj = RowwiseParallel(input_layouts=Replicate()) if gathered else RowwiseParallel()
    parallelize_module(model, mesh, {"qkv": qkv, "proj": proj})
    try:
        with refuse_chunked_colwise_outputs(model):
            model(torch.randn(2, 5, WIDTH)).sum().backward()
    except ValueError as error:
        return str(error)
    return "ran"


@pytest.mark.parametrize("split", ["chunk", "split"])
def test_a_colwise_output_cut_into_q_k_v_is_named_on_every_rank(split):
    name = "chunk(3, dim=-1)" if split == "chunk" else "split(16, dim=-1)"
    for message in run_on_ranks(2, _case, split, False):
        assert message.startswith("qkv is ColwiseParallel (each tensor-parallel rank holds a contiguous block"), message
        assert name in message and "Lay the fused rows out per head" in message


def test_the_head_major_view_and_a_gathered_output_are_not_refused():
    assert run_on_ranks(2, _case, "head-major view", False) == ["ran", "ran"]
    assert run_on_ranks(2, _case, "chunk", True) == ["ran", "ran"]  # the whole output on every rank: chunk is right
