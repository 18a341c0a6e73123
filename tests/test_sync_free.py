"""Sync-free by proof, on the CPU: the steady-state training steps of every layout read no tensor value on the
host (``host_reads.no_host_reads``, with the core on its accelerator paths): the loss windows and their counts,
the loss scaling, SUM reductions, the norm, the clip, the per-parameter norms and their logging (until the logger
writes). The first optimizer step is left out: it agrees the norm plan and checks replicas and counts once."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from host_reads import HostRead, no_host_reads
from lightning.pytorch.callbacks import Callback
from test_context import _video_batch
from test_context_trainer import DIT_ROWS, _CausalLMModule, _DiTModule
from test_experts_trainer import _MoEModule
from test_loss_parallel_trainer import _LlamaModule
from test_pipeline_trainer import _PipelinedLM
from test_verify import TP_PLAN, Block, CountingLM, SampleLM
from torch import nn

import lightning_ndclip as nd
from lightning_ndclip.core.context import shard_sequence

STEPS = 3


class NoHostReadsAfterTheFirstStep(Callback):
    """Fails the run at the first host read inside a micro-batch (from its start to its end, the optimizer step
    included) once the first optimizer step is done."""

    def __init__(self) -> None:
        self._modes = ExitStack()
        self.checked = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= 1:
            self._modes.enter_context(no_host_reads())
            self.checked += 1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._modes.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._modes.close()


class _SyncFreeDiT(_DiTModule):
    """Its sample_ids reads nothing: the batch's own sample ids (numbered over the whole batch), their count a
    host int. (_DiTModule renumbers each micro-batch's samples with unique(), a host read of its own.)"""

    NUM_SAMPLES = int(_video_batch(DIT_ROWS)["num_samples"])

    def sample_ids(self, batch):
        rank, size, _ = self._cp()
        return shard_sequence(batch[2], rank, size, dim=1)[0], self.NUM_SAMPLES


def _fit(module: L.LightningModule, strategy: Any, devices: int, per_parameter: bool = False) -> int:
    use_existing_process_group()
    proof = NoHostReadsAfterTheFirstStep()
    # nonfinite="skip" (the default) and "raise" read one flag per step by design (documented); "clip" reads none
    clip = nd.GlobalNormClip(1.0, nonfinite="clip", log_module_depth=1 if per_parameter else None)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=2,
        callbacks=[clip, proof], log_every_n_steps=50, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=L.pytorch.loggers.CSVLogger("/tmp/lightning_ndclip_sync_free"),
    )  # fmt: skip
    trainer.fit(module)
    return proof.checked


def _case(layout: str) -> int:
    plan = nd.ParallelPlan(fsdp_units=[Block])
    if layout == "fsdp_tp":
        strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean", summary=False,
                                         plan=nd.ParallelPlan(tp_plan=TP_PLAN, fsdp_units=[Block]))  # fmt: skip
        return _fit(CountingLM(tied=True), strategy, 4, per_parameter=True)
    if layout == "hsdp_sample_mean":
        strategy = nd.NDParallelStrategy(dp_replicate=2, dp_shard=2, loss_normalization="sample_mean", summary=False, plan=plan)
        return _fit(SampleLM(), strategy, 4)
    if layout == "cp":
        return _fit(_CausalLMModule(), nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="token_mean", summary=False), 4)
    if layout == "cp_sample_mean":
        return _fit(_SyncFreeDiT(), nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="sample_mean", summary=False), 4)
    if layout == "pp":
        module = _PipelinedLM()
        module.dp = 2
        strategy = nd.NDParallelStrategy(
            pp=2, dp_shard=2, loss_normalization="token_mean", summary=False, plan=nd.ParallelPlan(fsdp_units=(nn.Linear,)),
            pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2),
        )  # fmt: skip
        return _fit(module, strategy, 4)
    if layout == "loss_parallel":
        module = _LlamaModule()
        plan = nd.ParallelPlan(tp_plan="auto", loss_parallel=True, fsdp_units=[type(module.lm.model.layers[0])])
        return _fit(module, nd.NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean", summary=False, plan=plan), 4)
    if layout == "ep":
        return _fit(_MoEModule(), nd.NDParallelStrategy(dp_shard=4, ep=2, sum_reduction=True, summary=False), 4)
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp_sample_mean", "cp", "cp_sample_mean", "pp", "ep", "loss_parallel"])
def test_steady_state_steps_read_nothing_on_the_host(layout):
    checked = run_on_ranks(4, _case, layout)
    assert len(set(checked)) == 1 and checked[0] >= STEPS - 1, checked  # every micro-batch after the first step


def test_the_mode_catches_each_kind_of_host_read():
    t = torch.tensor([1.0, 2.0])
    for read in (lambda: t.sum().item(), lambda: bool(t[0] > 0), lambda: t.tolist(), lambda: t.nonzero(),
                 lambda: t[t > 1], lambda: float(t[0]), lambda: t.numpy()):  # fmt: skip
        with pytest.raises(HostRead), no_host_reads():
            read()
    with no_host_reads():  # device work that only queues kernels passes
        torch.where(t > 1, t, 0.0).sum().clamp(max=1.0)
