"""Faults in ``Trainer.fit`` that other test files do not cover: a rank killed mid-training, a checkpoint
resumed on another mesh. Each asserts the right numbers or an error on the waiting ranks within a bounded
time, never a wait until gloo's 30-minute default (the faults without Lightning: test_faults.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import harness
import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_callbacks import MlpModule
from test_strategy import _AdamModule, _trainer

from lightning_ndclip import NDParallelStrategy

pytestmark = pytest.mark.faults


class _DyingModule(MlpModule):
    """Rank 1 exits (as if killed) at its second training step; rank 0 notes when it got there."""

    def __init__(self, directory: str) -> None:
        super().__init__(tp=False)
        self.directory = directory

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            Path(self.directory, f"step1_rank{dist.get_rank()}").write_text(str(time.time()))
            if dist.get_rank() == 1:
                os._exit(1)
        return super().training_step(batch, batch_idx)


def _killed_rank_case(directory: str) -> None:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(dp_shard=2), devices=2, max_steps=4, logger=False)
    try:
        trainer.fit(_DyingModule(directory))
    except BaseException as error:  # noqa: BLE001 - whatever the survivor gets is the observation
        Path(directory, "survivor").write_text(f"{time.time()}\n{type(error).__name__}: {error}")
        raise


def test_a_rank_killed_mid_training_makes_the_survivor_raise_promptly(tmp_path):
    with pytest.raises(harness.RankFailure):
        run_on_ranks(2, _killed_rank_case, str(tmp_path), timeout=100)
    died_at = float((tmp_path / "step1_rank1").read_text())
    raised_at, error = (tmp_path / "survivor").read_text().split("\n", 1)
    assert float(raised_at) - died_at < 30, f"the survivor raised {float(raised_at) - died_at:.0f} s later: {error}"


def _full_state(module: L.LightningModule, trainer: L.Trainer) -> dict:
    """Full parameters and Adam moments by parameter name."""
    names = {p: n for n, p in module.net.named_parameters()}
    state = {f"param/{n}": p.detach().full_tensor() for p, n in names.items()}
    for p, s in trainer.optimizers[0].state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}/{names[p]}"] = s[key].full_tensor()
    return state


def _cross_mesh_case(directory: str) -> dict:
    """Train an epoch with Adam on dp_shard=2 x tp=2 and save; restore on dp_shard=4 (no tp)."""
    use_existing_process_group()

    def trainer(strategy: NDParallelStrategy, epochs: int) -> L.Trainer:
        return _trainer(strategy, devices=4, max_steps=-1, max_epochs=epochs, limit_train_batches=2, logger=False)

    saved_module = _AdamModule(tp=True)
    first = trainer(NDParallelStrategy(dp_shard=2, tp=2), 1)
    first.fit(saved_module)
    first.save_checkpoint(f"{directory}/epoch1.ckpt")
    saved = _full_state(saved_module, first)
    restored_module = _AdamModule(tp=False)
    with torch.no_grad():  # only a real restore can undo this
        for p in restored_module.net.parameters():
            p.add_(1.0)
    second = trainer(NDParallelStrategy(dp_shard=4), 1)  # epoch 1 is done: restore, no step
    second.fit(restored_module, ckpt_path=f"{directory}/epoch1.ckpt")
    return {"saved": saved, "restored": _full_state(restored_module, second)}


def test_a_checkpoint_saved_on_one_mesh_restores_exactly_on_another(tmp_path):
    for r in run_on_ranks(4, _cross_mesh_case, str(tmp_path)):
        assert set(r["saved"]) == set(r["restored"]) and any(k.startswith("exp_avg/") for k in r["saved"])
        for key, value in r["saved"].items():
            assert torch.equal(value, r["restored"][key]), key
