"""GlobalNormClip under each of Lightning's built-in strategies users have: the logged norms and the
trained parameters equal one device's (float64, 1e-12), or a clear error where the norm cannot be
exact. ``ModelParallelStrategy`` and ``NDParallelStrategy`` are covered in test_callbacks.py and
test_lightning_features.py (manual optimization with FSDP2 x TP too)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from test_callbacks import LOCAL_BATCH, LR, STEPS, MlpModule, Recorder, _data, _mlp, _reference, use_existing_process_group
from torch import nn

from lightning_ndclip import GlobalNormClip

MAX_NORM = 0.3


class _PlainMlp(MlpModule):
    """The test_callbacks MLP without parallel code: the strategy does the data parallelism."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__(tp=False)
        self.automatic_optimization = not manual

    def configure_model(self) -> None:
        pass

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()  # GlobalNormClip runs in on_before_optimizer_step, as with automatic optimization
        return loss


def _sequential_reference() -> tuple[list[float], dict]:
    """One device reading the data in order (no DistributedSampler is injected on a single device)."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data().tensors
    norms = []
    for step in range(STEPS):
        rows = slice(step * LOCAL_BATCH, (step + 1) * LOCAL_BATCH)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _strategy(name: str):
    return {"single": SingleDeviceStrategy(device="cpu"), "ddp": DDPStrategy(), "fsdp1": FSDPStrategy()}[name]


def _fit_case(name: str, devices: int, manual: bool) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _PlainMlp(manual)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=_strategy(name), max_steps=STEPS,
        callbacks=[GlobalNormClip(MAX_NORM)], logger=recorder, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
    }


@pytest.mark.parametrize(
    "name, devices, manual",
    [("single", 1, False), ("ddp", 2, False), ("ddp", 2, True)],
    ids=["single-device", "ddp", "ddp-manual-optimization"],
)
def test_global_norm_clip_under_lightning_strategies_matches_one_device(name, devices, manual):
    ref_norms, ref_params = _sequential_reference() if devices == 1 else _reference(devices, max_norm=MAX_NORM)
    assert max(ref_norms) > MAX_NORM, "clipping should be active in this test"
    for r in run_on_ranks(devices, _fit_case, name, devices, manual):
        assert len(r["norms"]) == STEPS, r["norms"]
        for ours, ref in zip(r["norms"], ref_norms):
            assert abs(ours - ref) <= 1e-12 * ref
        for n, value in r["params"].items():
            assert torch.allclose(value, ref_params[n], rtol=1e-12, atol=1e-14), n


def test_fsdp1_is_refused_with_the_reason_instead_of_a_wrong_norm():
    """FSDP1's flat parameters are plain tensors, each rank's a different shard: counted as replicas,
    the norm would be one shard's (silently wrong). Lightning runs FSDPStrategy on GPUs only, so the
    check is called here as the Trainer calls it, with that strategy in place."""
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(TypeError, match="does not support FSDP1.*fully_shard"):
        GlobalNormClip(1.0).on_fit_start(trainer, _PlainMlp())
