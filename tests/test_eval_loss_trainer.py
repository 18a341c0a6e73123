"""Validation and test losses under ``loss_normalization``: the exact global token mean, the same on every mesh
(``val_loss`` / ``test_loss``, logged by the strategy from the loss ``validation_step`` returns), against the
plain model on one process in float64; the Lightning way (each rank's mean, ``sync_dist=True``) is shown to
miss it and to change with the mesh. Logging the strategy's name yourself is a clear error."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_loss import TokenModel, _token_losses
from test_strategy import ROWS_PER_RANK, _token_rows, _TokenModule
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from lightning_ndclip import NDParallelStrategy, count_valid_tokens


class _EvalModule(_TokenModule):
    def __init__(self, lightning_way: bool = False) -> None:
        super().__init__("mean")
        self.lightning_way = lightning_way

    def configure_model(self) -> None:
        if not isinstance(self.model.embed, FSDPModule):  # validate, then test: parallelize once
            super().configure_model()

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
        if self.lightning_way:
            self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def val_dataloader(self):
        return DataLoader(_token_rows(), batch_size=ROWS_PER_RANK)

    test_dataloader = val_dataloader


def _eval_case(dp: int, lightning_way: bool) -> dict:
    use_existing_process_group()
    strategy = NDParallelStrategy(dp_shard=dp, loss_normalization="token_mean", log_eval_loss=not lightning_way)
    trainer = L.Trainer(accelerator="cpu", devices=dp, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    module = _EvalModule(lightning_way)
    val = trainer.validate(module)[0]["val_loss"]
    test = None if lightning_way else trainer.test(module)[0]["test_loss"]
    return {"val": float(val), "test": test}


def _reference() -> float:
    model = TokenModel()
    tokens, labels = _token_rows().tensors
    batch = {"tokens": tokens, "labels": labels}
    with torch.no_grad():
        return float(_token_losses(model, batch).sum() / count_valid_tokens(labels))


@pytest.mark.parametrize("dp", [2, 4])
def test_the_eval_loss_is_the_exact_global_token_mean_on_every_mesh(dp):
    reference = _reference()
    for result in run_on_ranks(dp, _eval_case, dp, False):
        assert abs(result["val"] - reference) <= 1e-6 * reference  # logged in float32 by Lightning
        assert abs(result["test"] - reference) <= 1e-6 * reference


def test_the_lightning_way_misses_it_and_changes_with_the_mesh():
    reference = _reference()
    two, four = (run_on_ranks(dp, _eval_case, dp, True)[0]["val"] for dp in (2, 4))
    assert abs(two - reference) > 1e-4 * reference and abs(four - reference) > 1e-4 * reference
    assert abs(two - four) > 1e-5 * reference


class _LogsTrainLoss(_TokenModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _collision_case(stage: str) -> str:
    use_existing_process_group()
    strategy = NDParallelStrategy(dp_shard=2, loss_normalization="token_mean")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, max_steps=1)  # fmt: skip
    try:
        if stage == "train":
            trainer.fit(_LogsTrainLoss())
        else:
            trainer.validate(_EvalModule(lightning_way=True))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.faults
@pytest.mark.parametrize(
    "stage, name, switch", [("train", "train_loss", "log_loss=None"), ("val", "val_loss", "log_eval_loss=False")]
)
def test_logging_the_strategys_own_name_is_a_clear_error(stage, name, switch):
    """It was Lightning's 'You called self.log(train_loss, ...) twice ... with different arguments', or, with the
    same arguments, one value silently replacing the other."""
    messages = run_on_ranks(2, _collision_case, stage)
    assert messages[0] == messages[1] and f"logs {name!r}, and NDParallelStrategy" in messages[0] and switch in messages[0]


class _SampleEvalModule(_EvalModule):
    """Two packed samples per row (its halves); per-token losses, as sample_mean trains."""

    def sample_ids(self, batch):
        labels = batch[1]
        rows, length = labels.shape
        ids = torch.arange(2 * rows).repeat_interleave(length // 2).reshape(rows, length)
        return ids, 2 * rows, labels != -100

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.model(tokens).flatten(0, 1)
        losses = nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="none")
        return losses.view_as(labels)


def _sample_eval_case(dp: int) -> float:
    use_existing_process_group()
    strategy = NDParallelStrategy(dp_shard=dp, loss_normalization="sample_mean")
    trainer = L.Trainer(accelerator="cpu", devices=dp, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    return float(trainer.validate(_SampleEvalModule())[0]["val_loss"])


def test_the_eval_loss_under_sample_mean_is_the_exact_per_sample_mean():
    tokens, labels = _token_rows().tensors
    with torch.no_grad():
        losses = _token_losses(TokenModel(), {"tokens": tokens, "labels": labels})
    half = labels.shape[1] // 2
    means = []
    for row in range(len(labels)):
        for part in (slice(0, half), slice(half, None)):
            valid = labels[row, part] != -100
            if valid.any():
                means.append(losses[row, part][valid].mean())
    reference = float(torch.stack(means).mean())
    for value in run_on_ranks(2, _sample_eval_case, 2):
        assert abs(value - reference) <= 1e-6 * reference, (value, reference)
