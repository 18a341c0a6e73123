"""Resuming a checkpoint written mid-epoch, at an optimizer step, with ``loss_normalization``: the
resumed run ends equal to the uninterrupted one (parameters, ``grad_norm/total``, ``train_loss``).

The accumulation windows read ahead by :class:`~lightning_ndclip.lightning._windows.LossWindows` must number
their batches from Lightning's restored batch index and start at the data the uninterrupted run
read there: a plain DataLoader replays the epoch from its first batch (the windows skip what was
consumed), a stateful one restores its own position (nothing to skip)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_on_ranks
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from test_callbacks import Recorder, use_existing_process_group
from test_strategy import ROWS_PER_RANK, TOKEN_LR, _token_rows, _TokenModule, _trainer
from torch.utils.data import DataLoader

from lightning_ndclip import GlobalNormClip, NDParallelStrategy

DP, MOMENTUM, MAX_NORM = 2, 0.9, 0.05

pytestmark = pytest.mark.faults


class _ResumableLoader(DataLoader):
    """A DataLoader that restores its position within the epoch, as torchdata's StatefulDataLoader."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.yielded, self.skip = 0, 0

    def __iter__(self):
        skip, self.skip, self.yielded = self.skip, 0, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.yielded = index + 1
                yield batch

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["yielded"]


class _ResumeModule(_TokenModule):
    """SGD with momentum: a resume that lost the optimizer state would not end equal."""

    def __init__(self, normalization: str, stateful: bool) -> None:
        super().__init__("mean" if normalization == "token_mean" else "per_token")
        self.stateful = stateful

    def sample_ids(self, batch):  # two packed samples per row, numbered over the micro-batch
        labels = batch[1]
        rows, length = labels.shape
        ids = torch.arange(2 * rows).repeat_interleave(length // 2).reshape(rows, length)
        return ids, 2 * rows, labels != -100

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=TOKEN_LR, momentum=MOMENTUM)

    def train_dataloader(self):
        cls = _ResumableLoader if self.stateful else DataLoader
        return cls(_token_rows(), batch_size=ROWS_PER_RANK, shuffle=True)


def _fit(
    normalization: str,
    stateful: bool,
    accumulate: int,
    batches: int,
    epochs: int,
    checkpoint: ModelCheckpoint | None,
    ckpt_path: str | None,
    scheduled: bool = False,
) -> dict:
    recorder = Recorder()
    module = _ResumeModule(normalization, stateful)
    if ckpt_path is not None:
        with torch.no_grad():  # only a real restore of the weights can undo this
            for p in module.parameters():
                p.add_(1.0)
    trainer = _trainer(
        NDParallelStrategy(dp_shard=DP, loss_normalization=normalization),
        devices=DP,
        max_steps=-1,
        max_epochs=epochs,
        limit_train_batches=batches,
        accumulate_grad_batches=1 if scheduled else accumulate,
        logger=recorder,
        enable_checkpointing=checkpoint is not None,
        callbacks=[GlobalNormClip(MAX_NORM)]
        + ([checkpoint] if checkpoint is not None else [])
        + ([GradientAccumulationScheduler({0: accumulate})] if scheduled else []),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    logged = {key: {step: m[key] for step, m in recorder.rows if key in m} for key in ("grad_norm/total", "train_loss")}
    params = {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}
    return {"params": params, "global_step": trainer.global_step, **logged}


def _resume_case(
    directory: str, normalization: str, stateful: bool, accumulate: int, batches: int, epochs: int, step: int,
    scheduled: bool = False,
) -> dict:  # fmt: skip
    use_existing_process_group()
    checkpoint = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=step, save_top_k=-1)
    straight = _fit(normalization, stateful, accumulate, batches, epochs, checkpoint, None, scheduled)
    path = str(Path(directory) / f"step={step}.ckpt")
    resumed = _fit(normalization, stateful, accumulate, batches, epochs, None, path, scheduled)
    return {"straight": straight, "resumed": resumed}


CASES = {  # normalization, stateful loader, accumulate_grad_batches, limit_train_batches, epochs, checkpoint step
    "token_mean-accumulate2": ("token_mean", False, 2, 7, 1, 2),  # windows 2 2 | 2 1: resume at batch 4
    "token_mean-accumulate3-into-epoch2": ("token_mean", False, 3, 5, 2, 1),  # 3 | 2, then 3 2: resume at batch 3
    "sample_mean-accumulate2": ("sample_mean", False, 2, 5, 1, 1),  # 2 | 2 1: resume at batch 2
    "token_mean-stateful-loader": ("token_mean", True, 3, 5, 2, 1),  # the loader itself resumes at batch 3
    # GradientAccumulationScheduler({0: 3}): Lightning skips on_train_epoch_start on a mid-epoch resume, so the
    # factor was 1 in the resumed epoch (each micro-batch its own step) until the strategy applied it
    "token_mean-accumulation-scheduler": ("token_mean", False, 3, 5, 1, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mid_epoch_resume_ends_equal_to_the_uninterrupted_run(case, tmp_path):
    normalization, stateful, accumulate, batches, epochs, step = CASES[case][:6]
    steps = epochs * -(-batches // accumulate)
    for r in run_on_ranks(DP, _resume_case, str(tmp_path), *CASES[case], timeout=120):
        straight, resumed = r["straight"], r["resumed"]
        assert straight["global_step"] == resumed["global_step"] == steps
        for name, value in straight["params"].items():
            assert torch.allclose(resumed["params"][name], value, rtol=1e-12, atol=1e-14), name
        for key in ("grad_norm/total", "train_loss"):
            assert sorted(straight[key]) == list(range(steps)), (key, straight[key])
            assert sorted(resumed[key]) == list(range(step, steps)), (key, resumed[key])
            for at, value in resumed[key].items():
                assert abs(value - straight[key][at]) <= 1e-12 * abs(straight[key][at]), (key, at)


class _Seen(_ResumeModule):
    """Records, per batch Lightning trains on, its index, the rows it holds, and the optimizer steps so far."""

    def __init__(self, stateful: bool) -> None:
        super().__init__("token_mean", stateful)
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch_idx, int(batch[0].sum()), self.trainer.global_step))
        return super().training_step(batch, batch_idx)


class _SaveAt(Callback):
    def __init__(self, path: str, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def _mid_window_case(directory: str, stateful: bool) -> dict:
    use_existing_process_group()
    path = str(Path(directory) / "mid.ckpt")
    out = {}
    for key, callbacks, ckpt_path in (("straight", [_SaveAt(path, 1)], None), ("resumed", [], path)):
        module = _Seen(stateful)
        trainer = _trainer(
            NDParallelStrategy(dp_shard=DP, loss_normalization="token_mean"),
            devices=DP,
            max_steps=-1,
            max_epochs=1,
            limit_train_batches=7,
            accumulate_grad_batches=3,
            logger=False,
            callbacks=callbacks,
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        out[key] = module.seen
    return out


@pytest.mark.parametrize("stateful", [False, True], ids=["plain-loader", "stateful-loader"])
def test_a_checkpoint_mid_window_resumes_on_the_same_batches_and_window_boundaries(stateful, tmp_path):
    """Saved after batch 1 of the window 0 1 2: what a resume can reproduce (the gradients accumulated
    before the checkpoint are lost, in Lightning as without the strategy) is the data and the steps."""
    for r in run_on_ranks(DP, _mid_window_case, str(tmp_path), stateful, timeout=120):
        assert [i for i, _, _ in r["straight"]] == list(range(7))
        assert r["resumed"] == r["straight"][2:], (r["resumed"], r["straight"])
