"""``PackedExpertsParallel``: a packed-experts MoE block (``transformers``' layout, written here without
``transformers``) split over tp equals the plain block on one process in float64: output, the gradients of
the input, of the router and of every expert weight. A plain ``Shard(1)`` of the packed weight, the naive
split, computes a different function; a module the style cannot split is refused naming it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import lightning_ndclip as nd
from lightning_ndclip import _compat

E, H, I, TOP_K = 4, 6, 8, 2  # noqa: E741


class PackedExperts(nn.Module):
    """As ``transformers``' MixtralExperts: every expert's gate rows then up rows in one weight."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g, dtype=torch.float64))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(E):
            token, choice = torch.where(top_k_index == expert)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            rows = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, rows * top_k_weights[token, choice, None])
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False, dtype=torch.float64)
        nn.init.normal_(self.router.weight, generator=torch.Generator().manual_seed(1))
        self.experts = PackedExperts()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(self.router(hidden).softmax(-1), TOP_K, dim=-1)
        return self.experts(hidden, index, weights / weights.sum(-1, keepdim=True))


def _run(block: nn.Module) -> dict:
    x = torch.randn(10, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = block(x)
    out.pow(2).sum().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in block.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


def _split_case(naive: bool) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plain, split = Block(), Block()
    if naive:  # the packed weight split as a plain Shard(1): one rank all gate rows, the other all up rows
        original, _compat.StridedShard = _compat.StridedShard, lambda dim, split_factor: Shard(dim)
    try:
        parallelize_module(split.experts, mesh, nd.PackedExpertsParallel())
    finally:
        if naive:
            _compat.StridedShard = original
    placements = {n: tuple(p.placements) for n, p in split.experts.named_parameters()}
    expected, got = _run(plain), _run(copy.copy(split))
    return {"error": {k: float((got[k] - v).abs().max() / v.abs().max()) for k, v in expected.items()}, "placements": placements}


def test_packed_experts_split_over_tp_equal_the_plain_block():
    for result in run_on_ranks(2, _split_case, False):
        assert max(result["error"].values()) < 1e-12, result["error"]
        assert [type(p).__name__ for p in result["placements"]["gate_up_proj"]] == ["_StridedShard"]
        assert result["placements"]["down_proj"] == (Shard(2),)


def test_the_naive_split_of_the_packed_weight_is_a_different_function():
    for result in run_on_ranks(2, _split_case, True):
        assert result["error"]["out"] > 1e-2, result["error"]


class _WithBias(PackedExperts):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I, dtype=torch.float64))


class _Odd(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * width, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, width))


def _refusal_case(kind: str) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    module = {"bias": _WithBias, "odd": lambda: _Odd(3), "shape": lambda: _Swapped()}[kind]()
    try:
        parallelize_module(module, mesh, nd.PackedExpertsParallel())
    except ValueError as error:
        return str(error)
    return "split"


class _Swapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))  # transposed
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("bias", "holds ['down_proj', 'gate_up_proj', 'gate_up_proj_bias']"),
        ("odd", "intermediate width 3 is not a multiple of tp=2"),
        ("shape", "are not [experts, 2 x intermediate, hidden] and [experts, hidden, intermediate]"),
    ],
)
def test_a_module_the_style_cannot_split_is_refused_naming_it(kind, expected):
    for message in run_on_ranks(2, _refusal_case, kind):
        assert expected in message, message
