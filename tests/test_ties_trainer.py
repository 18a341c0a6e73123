"""Tied parameters in ``Trainer.fit``: a ``configure_model`` that unties them (plain ``parallelize_module``) is
refused at setup on every rank, naming both; with ``tensor_parallelize`` the same module trains exactly as the
plain model on one process in float64 (dp_shard=2 x tp=2)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_tensor_parallel import PLAN, TiedLM, _data, _model
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import lightning_ndclip as nd

STEPS, LR = 2, 0.5


class _TiedModule(L.LightningModule):
    def __init__(self, keep_ties: bool) -> None:
        super().__init__()
        self.keep_ties = keep_ties
        self.lm: TiedLM = _model()

    def configure_model(self) -> None:
        meshes = self.trainer.strategy.meshes
        apply_tp = nd.tensor_parallelize if self.keep_ties else parallelize_module
        apply_tp(self.lm, meshes["tp"], PLAN)
        fully_shard(self.lm, mesh=meshes["fsdp"])

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return nn.functional.cross_entropy(self.lm(tokens).flatten(0, 1), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        tokens, labels = _data()
        rows = torch.arange(4) % len(tokens)  # 4 rows: one per data rank per step, 2 steps
        return DataLoader(TensorDataset(tokens[rows], labels[rows]), batch_size=1)


def _fit_case(keep_ties: bool) -> dict | str:
    use_existing_process_group()
    module = _TiedModule(keep_ties)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=nd.NDParallelStrategy(dp_shard=2, tp=2, summary=False),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module)
    except ValueError as error:
        return str(error)
    return {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()}


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    tokens, labels = _data()
    rows = torch.arange(4) % len(tokens)
    # Lightning's DistributedSampler shuffles the rows (seed 0); step s covers order[2s : 2s + 2]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        batch = rows[order[2 * step : 2 * step + 2]]
        model.zero_grad()
        nn.functional.cross_entropy(model(tokens[batch]).flatten(0, 1), labels[batch].flatten()).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_configure_model_with_tensor_parallelize_trains_the_tied_model_exactly():
    params = run_on_ranks(4, _fit_case, True)[0]
    reference = _reference()
    assert params.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.faults
def test_configure_model_that_unties_is_refused_on_every_rank_naming_both():
    messages = run_on_ranks(4, _fit_case, False)
    assert all(isinstance(m, str) and m == messages[0] for m in messages), messages
    assert "parameters ['lm.embed.weight', 'lm.head.weight'] were one tensor (tied)" in messages[0]
