"""The startup summary in ``Trainer.fit``: ``NDParallelStrategy`` prints it on rank zero only (or not at
all with ``summary=False``), with the data side and the first step's token count; pipeline stages show
their rows gathered from their ranks (the layouts' rows themselves: test_summary.py)."""

from __future__ import annotations

import logging

import lightning as L
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_pipeline import _batch
from test_pipeline_trainer import _PipelinedLM
from test_summary import TP_PLAN, Block, Net
from torch import nn

import lightning_ndclip as nd


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
        dp_shard=2, tp=2, plan=nd.ParallelPlan(tp_plan={f"model.{k}": v for k, v in TP_PLAN.items()}, fsdp_units=[Block]),
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
        pp=2, dp_shard=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2), loss_normalization="token_mean",
        plan=nd.ParallelPlan(fsdp_units=(nn.Linear,)),
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
