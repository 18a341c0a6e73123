"""``fsdp_units`` whose classes nest (a block holding expert matrices, as transformers' ``_no_split_modules`` lists
Aria's decoder layer and its grouped expert GEMM): each nested module becomes its own FSDP2 unit before the one
around it, whatever order the classes are given in, and the step equals the plain model on one process in float64
on dp_shard=2 and tp=2. Wrapped outer unit first, the inner unit's parameters would already be the outer unit's
shards (torch then refuses to concatenate the meshes, or the forward meets a DTensor)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ndclip.core.parallel.mesh import ParallelDims
from lightning_ndclip.core.parallel.plan import parallelize

WIDTH, EXPERTS = 4, 2


class GroupedGemm(nn.Module):
    """A stack of matrices, one per expert, read by index (as grouped-GEMM fallbacks read them)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(torch.matmul(x, self.weight[e]) for e in range(EXPERTS))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.experts = GroupedGemm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) + torch.tanh(self.experts(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.randn(6, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model(x).square().mean()


def _sharded(tp: int, units: list[type]) -> dict:
    meshes = ParallelDims(world_size=dist.get_world_size(), tp=tp, dp_shard=2 // tp).build_mesh("cpu")
    model = _model()
    plan = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()} if tp > 1 else None
    parallelize(model, meshes, tp_plan=plan, fsdp_units=units)
    _loss(model).backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return {"grads": grads, "units": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("units", [[Block, GroupedGemm], [GroupedGemm, Block]], ids=["outer-first", "inner-first"])
def test_nested_units_are_each_a_unit_and_the_gradients_equal_one_device(tp, units):
    reference = _model()
    _loss(reference).backward()
    for result in run_on_ranks(2, _sharded, tp, units):
        assert result["units"] == ["", "layers.0", "layers.0.experts", "layers.1", "layers.1.experts"]
        for name, p in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], p.grad, rtol=1e-12, atol=1e-12, msg=name)
