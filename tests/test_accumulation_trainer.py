"""Accumulation that changes during training, under ``loss_normalization="token_mean"``: Lightning's
``GradientAccumulationScheduler`` (3 micro-batches per step in epoch 0, 2 in epoch 1) with a sized train
loader cut by ``limit_train_batches`` and an unsized (iterable) one that ends the epoch itself, each epoch
ending on a short window, against the plain model trained on one process in float64 with the same windows.

Lightning reads an unsized loader's first batch before ``on_train_epoch_start``, where the scheduler sets
the epoch's factor: windows sized at that read normalized windows of 1 while Lightning accumulated 3."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from test_callbacks import Recorder
from test_loss import TokenModel, _token_losses
from test_strategy import TOKEN_LR, _token_rows, _TokenModule
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, count_valid_tokens

DP, ROWS, BATCHES, MAX_NORM = 2, 2, 5, 0.05
SCHEDULE = {0: 3, 1: 2}  # epoch -> micro-batches per optimizer step
WINDOWS = {3: ([0, 1, 2], [3, 4]), 2: ([0, 1], [2, 3], [4])}  # the last window of each epoch is short


def _rows(rank: int, j: int) -> list[int]:
    """The dataset rows of data rank ``rank``'s micro-batch ``j``."""
    return [(j * ROWS + t) * DP + rank for t in range(ROWS)]


def _batch(rank: int, j: int) -> list[torch.Tensor]:
    tokens, labels = _token_rows().tensors
    return [tokens[_rows(rank, j)], labels[_rows(rank, j)]]


class _Sized(Dataset):
    def __len__(self) -> int:
        return BATCHES + 1  # limit_train_batches=BATCHES leaves the last one out

    def __getitem__(self, j: int) -> list[torch.Tensor]:
        return _batch(dist.get_rank(), j)


class _Unsized(IterableDataset):
    def __iter__(self):
        return (_batch(dist.get_rank(), j) for j in range(BATCHES))


class _ScheduledModule(_TokenModule):
    def __init__(self, sized: bool) -> None:
        super().__init__("mean")
        self.sized = sized

    def train_dataloader(self):
        return DataLoader(_Sized() if self.sized else _Unsized(), batch_size=None)


def _fit_case(sized: bool) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _ScheduledModule(sized)
    trainer = L.Trainer(
        accelerator="cpu", devices=DP, strategy=NDParallelStrategy(dp_shard=DP, loss_normalization="token_mean"),
        max_epochs=len(SCHEDULE), limit_train_batches=BATCHES if sized else None, use_distributed_sampler=False,
        callbacks=[GradientAccumulationScheduler(SCHEDULE), GlobalNormClip(MAX_NORM)], logger=recorder,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.model.named_parameters()},
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=TOKEN_LR)
    norms = []
    for epoch in sorted(SCHEDULE):
        for window in WINDOWS[SCHEDULE[epoch]]:
            parts = [_batch(rank, j) for j in window for rank in range(DP)]
            batch = {"tokens": torch.cat([p[0] for p in parts]), "labels": torch.cat([p[1] for p in parts])}
            opt.zero_grad()
            (_token_losses(model, batch).sum() / count_valid_tokens(batch["labels"])).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_a_scheduled_accumulation_equals_one_device(sized):
    ref_norms, ref_params = _reference()
    for result in run_on_ranks(DP, _fit_case, sized):
        assert len(result["norms"]) == len(ref_norms) == 5
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=1e-10, atol=0)
        for name, expected in ref_params.items():
            torch.testing.assert_close(result["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)
