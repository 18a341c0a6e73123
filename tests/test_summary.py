"""The startup summary describes each layout as it is: rows checked against sizes worked out by hand
from the plan (parameter elements, which dims split or copy them, the tp styles, bytes per rank)."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from test_callbacks import use_existing_process_group
from test_experts import MoEModel
from test_pipeline import _batch, _PipelinedLM
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd
from lightning_ndclip.core.experts import shard_experts
from lightning_ndclip.core.summary import ModuleRow, summarize


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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("lightning_ndclip:"):
            self.lines.append(record.getMessage())


class _TokenNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 16, (8, 5), generator=g)
        labels = torch.randint(0, 16, (8, 5), generator=g)
        labels[:, -2:] = -100  # 3 valid tokens per sample
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=2)


def _fit(module: L.LightningModule, strategy: nd.NDParallelStrategy, devices: int) -> list[str]:
    """The package's messages through Lightning's rank-zero utilities during one optimizer step."""
    handler, logger = _Lines(), logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, accumulate_grad_batches=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module)
    finally:
        logger.removeHandler(handler)
    return handler.lines


def _trainer_fsdp_tp_case(summary: bool) -> list[str]:
    use_existing_process_group()
    strategy = nd.NDParallelStrategy(
        dp_shard=2, tp=2, tp_plan={f"model.{k}": v for k, v in TP_PLAN.items()}, fsdp_units=[Block],
        loss_normalization="token_mean", summary=summary,
    )  # fmt: skip
    return _fit(_TokenNet(), strategy, 4)


def test_the_trainer_prints_the_summary_and_the_data_side_on_rank_zero_only():
    printed = run_on_ranks(4, _trainer_fsdp_tp_case, True)
    assert printed[1:] == [[]] * 3
    table, counted = printed[0]
    lines = table.splitlines()
    assert lines[0] == "lightning_ndclip: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (ep=1) = 4 ranks"
    rows = {line.split("|")[0][3:].strip(): [c.strip() for c in line.split("|")] for line in lines[3:7]}
    assert list(rows) == ["model", "model.embed", "model.blocks", "model.head"]  # the single child `model` opened
    assert rows["model"][1:4] == ["Net", "8", "root"]  # Net's own parameter, not all of Net
    assert lines[7] == f"{8 + 128 + 592 + 128} parameters in all"
    assert rows["model.blocks"][1:] == ["ModuleList", "592", "2", "dp_shard_cp=2", "colwise 4, rowwise 2, replicated 6",
                                        "640 B"]  # fmt: skip
    assert "Data: samples per optimizer step: 2 per rank x dp=2 ranks x 2 accumulated = 8" in lines
    assert any(line.startswith("Loss: token_mean") for line in lines)
    # one step: 2 micro-batches of 2 samples on each of 2 data ranks, 3 valid tokens per sample
    assert counted == "lightning_ndclip: the first optimizer step counts 24 tokens in 2 micro-batch(es) of every data rank"


def test_summary_false_prints_nothing():
    assert run_on_ranks(4, _trainer_fsdp_tp_case, False) == [[]] * 4


def _trainer_pp_case() -> list[str]:
    use_existing_process_group()
    module = _PipelinedLM()
    module.dp = 2
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=2, pp_split_points=["layers.2"], pp_microbatches=2, loss_normalization="token_mean",
        fsdp_units=(nn.Linear,),
    )  # fmt: skip
    lines = _fit(module, strategy, 4)
    return [line for text in lines for line in text.splitlines()] if dist.get_rank() == 0 else lines


def test_pipeline_stages_each_show_their_rows_gathered_from_their_ranks():
    printed = run_on_ranks(4, _trainer_pp_case)
    assert printed[1:] == [[]] * 3
    lines = printed[0]
    rows = [[c.strip() for c in line[3:].split("|")] for line in lines[3:7]]
    # TinyLM in float64, stages cut before layers.2, every Linear its own unit, sharded over dp_shard 2 by rows:
    # embed and head weights have 11 rows of 8 (rank 0 holds 6: 48 elements), layers 8x8+8 (rank 0: 4 rows + 4)
    assert rows == [
        ["model.embed", "Embedding", "88", "root", "dp_shard_cp=2", "0", f"{48 * 8} B"],
        ["model.layers.{0,1}", "ModuleDict", "144", "2", "dp_shard_cp=2", "0", f"{2 * 36 * 8} B"],
        ["model.layers.{2,3}", "ModuleDict", "144", "2", "dp_shard_cp=2", "1", f"{2 * 36 * 8} B"],
        ["model.head", "Linear", "88", "1", "dp_shard_cp=2", "1", f"{48 * 8} B"],
    ]
    assert "Pipeline: schedule '1f1b', 2 micro-batches per batch, 2 stages (1 per rank)" in lines
    tokens = int((_batch()[1] != -100).sum())  # one step covers the whole batch
    assert lines[-1] == (
        f"lightning_ndclip: the first optimizer step counts {tokens} tokens in 2 micro-batch(es) of every data rank"
    )
