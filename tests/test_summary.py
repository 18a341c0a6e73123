"""The startup summary describes each layout as it is: rows checked against sizes worked out by hand
from the plan (parameter elements, which dims split or copy them, the tp styles, bytes per rank). What
the strategy prints in ``Trainer.fit``: test_summary_trainer.py."""

from __future__ import annotations

import pytest
import torch
from harness import run_on_ranks
from test_experts import MoEModel
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd
from lightning_ndclip.core.experts import shard_experts
from lightning_ndclip.core.parallel.summary import ModuleRow, summarize


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    """scale 8 (its own parameter); embed 16x8 = 128; blocks 2 x (up 8x16+16, down 16x8+8, norm 8+8) = 2 x 296 =
    592; head 8x16 = 128."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(8))
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


TP_PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "blocks.*.up": ColwiseParallel(),
    "blocks.*.down": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),
}


def _fields(row: ModuleRow) -> tuple:
    return (row.name, row.params, row.fsdp, row.sharded_over, row.replicated_over, row.tensor_parallel,
            row.stage, row.bytes_per_rank)  # fmt: skip


def _core_case(layout: str) -> list[tuple]:
    if layout == "ep":
        meshes = nd.ParallelDims(4, dp_shard=4, ep=2).build_mesh("cpu")
        model: nn.Module = MoEModel()
        shard_experts(model.moe, meshes["ep"])
        fully_shard(model.moe.experts, mesh=meshes["edp"])
        for layer in (model.inp, model.head):
            fully_shard(layer, mesh=meshes["fsdp"])
    else:
        sizes = {"fsdp_tp": {"dp_shard": 2, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2}}[layout]
        meshes = nd.ParallelDims(4, **sizes).build_mesh("cpu")
        model = Net()
        if layout == "fsdp_tp":
            parallelize_module(model, meshes["tp"], TP_PLAN)
        for block in model.blocks:
            fully_shard(block, mesh=meshes["fsdp"])
    fully_shard(model, mesh=meshes["fsdp"])
    return [_fields(row) for row in summarize(model, meshes).rows]


# (name, params, fsdp units, sharded over, replicated over, tp styles, stage, bytes on rank 0)
EXPECTED = {
    # 4 ranks = dp_shard 2 x tp 2, float32. embed: vocab rows split by tp (RowwiseParallel of an embedding) and
    # FSDP: 128 / 4 = 32 elements. Each block: up weight and bias split by tp and FSDP (128/4 + 16/4), down weight
    # split by tp (dim 1) and FSDP (128/4), down bias and norm only by FSDP (8/2 + 16/2): 80, two blocks 160.
    "fsdp_tp": [
        ("(own parameters)", 8, "root", "dp_shard_cp=2", "-", "replicated 1", None, 4 * 4),
        ("embed", 128, "root", "dp_shard_cp=2", "-", "rowwise 1", None, 32 * 4),
        ("blocks", 592, "2", "dp_shard_cp=2", "-", "colwise 4, rowwise 2, replicated 6", None, 160 * 4),
        ("head", 128, "root", "dp_shard_cp=2", "-", "colwise 1", None, 32 * 4),
    ],
    # dp_replicate 2 x dp_shard 2: every parameter split in two, each half held by both replicas
    "hsdp": [
        ("(own parameters)", 8, "root", "dp_shard_cp=2", "dp_replicate=2", "-", None, 4 * 4),
        ("embed", 128, "root", "dp_shard_cp=2", "dp_replicate=2", "-", None, 64 * 4),
        ("blocks", 592, "2", "dp_shard_cp=2", "dp_replicate=2", "-", None, 296 * 4),
        ("head", 128, "root", "dp_shard_cp=2", "dp_replicate=2", "-", None, 64 * 4),
    ],
    # dp_shard 4, ep 2, float64. inp 6x8+8 and head 8x3+3 their own units over 4 ranks (56/4, 27/4 rounded up
    # per row: inp 8 rows of 7 -> 2 rows = 14, head 3 rows of 9 -> rank 0 holds 1 row = 9). moe: router
    # 4x8 (no bias) = 32 in the root unit over 4 ranks (1 row of 8); experts 2 x 4x8x16 = 1024, split by
    # ep (2 experts each) and edp (1 each): 256.
    "ep": [
        ("inp", 56, "1", "dp_shard_cp=4", "-", "-", None, 14 * 8),
        ("moe", 1056, "1 + root", "dp_shard_cp=4, edp=2, ep=2", "-", "-", None, (8 + 256) * 8),
        ("head", 27, "1", "dp_shard_cp=4", "-", "-", None, 9 * 8),
    ],
}


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp", "ep"])
def test_summary_rows_describe_the_layout(layout):
    assert run_on_ranks(4, _core_case, layout)[0] == EXPECTED[layout]
