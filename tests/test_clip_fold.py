"""GlobalNormClip handing the clip to a fused optimizer (``grad_scale`` / ``found_inf``, the protocol of
``GradScaler``), and under an fp16 ``GradScaler``: trained parameters, logged norms and the gradients
the optimizer saw equal one float64 device running ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from test_callbacks import Recorder, _data
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_ndclip import GlobalNormClip

STEPS, LOCAL_BATCH, LR, MAX_NORM = 4, 2, 0.05, 0.3


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def _optimizer(name: str, params, **kwargs) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, **kwargs)
    return torch.optim.SGD(params, lr=LR, momentum=0.9, **kwargs)  # "sgd_momentum"


class _Module(L.LightningModule):
    def __init__(self, fused: bool, nonfinite_step: int | None = None, fsdp: bool = False, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = _mlp(torch.float32)
        self.fused, self.nonfinite_step, self.fsdp, self.optimizer = fused, nonfinite_step, fsdp, optimizer

    def configure_model(self) -> None:
        if self.fsdp:
            for i in (0, 2, 4):
                fully_shard(self.net[i], mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = (t.float() for t in batch)
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * math.inf if batch_idx == self.nonfinite_step else loss

    def configure_optimizers(self):
        return _optimizer(self.optimizer, self.parameters(), fused=self.fused, foreach=False if not self.fused else None)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=LOCAL_BATCH, shuffle=False)


class _Spy(Callback):
    """Runs after GlobalNormClip: what it left on the optimizer, and (after the step) whether it was
    removed and the gradients the optimizer wrote back."""

    def __init__(self) -> None:
        self.folded: list[dict[str, float]] = []
        self.left_over: list[bool] = []
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.folded.append({k: float(getattr(optimizer, k)) for k in ("grad_scale", "found_inf") if hasattr(optimizer, k)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        self.left_over.append(hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"))
        grads = [p.grad for p in pl_module.net.parameters()]
        if all(g is not None for g in grads):
            full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
            self.grads.append(torch.cat([g.reshape(-1) for g in full]).double())


def _reference(dp: int, nonfinite_step: int | None = None, optimizer: str = "adamw") -> dict:
    """One float64 device, the same global batches (in the order of the DistributedSampler Lightning
    injects: shuffled with seed 0; rank r takes every dp-th index from r), torch's clip, the optimizer."""
    model = _mlp(torch.float64)
    opt = _optimizer(optimizer, model.parameters(), foreach=False)
    x, y = _data().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).tolist() if dp > 1 else range(len(x))
    norms, grads = [], []
    for step in range(STEPS):
        idx = [order[(step * LOCAL_BATCH + j) * dp + r] for r in range(dp) for j in range(LOCAL_BATCH)]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if step != nonfinite_step:
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
    return {"norms": norms, "grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _fit(
    devices: int, fused: bool, fold: bool | None = None, nonfinite_step: int | None = None, optimizer: str = "adamw"
) -> dict:
    use_existing_process_group()
    recorder, spy = Recorder(), _Spy()
    module = _Module(fused, nonfinite_step, fsdp=devices > 1, optimizer=optimizer)
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=recorder, log_every_n_steps=1,
        callbacks=[GlobalNormClip(MAX_NORM, fold_into_optimizer=fold), spy], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-finite", category=RuntimeWarning)
        trainer.fit(module)
    opt = trainer.optimizers[0]
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "folded": spy.folded,
        "left_over": spy.left_over,
        "grads": spy.grads,
        "steps": sorted({int(s["step"]) for s in opt.state.values() if "step" in s}),
        "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.net.named_parameters()},
    }


def _assert_matches(result: dict, ref: dict, skipped: int | None = None, tol: float = 1e-5) -> None:
    """Norms, gradients after each step (clipped) and parameters; at step ``skipped`` the norm is
    not finite and the step is not compared."""
    assert len(result["norms"]) == STEPS
    for step, (ours, theirs) in enumerate(zip(result["norms"], ref["norms"])):
        assert not math.isfinite(ours) if step == skipped else abs(ours - theirs) <= tol * theirs
    grads = [g for g in result["grads"] if g.isfinite().all()]
    assert len(grads) == len(ref["grads"]) == STEPS - (skipped is not None)
    for ours, theirs in zip(grads, ref["grads"]):  # p.grad after the step: clipped
        assert (ours - theirs).abs().max() <= tol * theirs.abs().max()
    for name, value in result["params"].items():
        assert torch.allclose(value.double(), ref["params"][name], rtol=tol, atol=tol), name


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "fsdp2"])
def test_folded_clip_matches_one_float64_device(devices):
    ref = _reference(devices)
    assert max(ref["norms"]) > MAX_NORM, "clipping should be active"
    folded = run_on_ranks(devices, _fit, devices, True)
    scaled = run_on_ranks(devices, _fit, devices, False)
    for result in folded:
        _assert_matches(result, ref)
        coefs = [1 / f["grad_scale"] for f in result["folded"]]
        assert [set(f) for f in result["folded"]] == [{"grad_scale"}] * STEPS
        assert coefs == pytest.approx([min(1.0, MAX_NORM / (n + 1e-6)) for n in ref["norms"]], rel=1e-6)
        assert result["left_over"] == [False] * STEPS  # removed after each step
    for result in scaled:  # a foreach AdamW: the callback scales the gradients itself
        _assert_matches(result, ref)
        assert result["folded"] == [{}] * STEPS
    # the folded step is the unfolded one, up to float32 rounding
    for a, b in zip(folded[0]["params"].values(), scaled[0]["params"].values()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _fit_after_garbage(*args) -> dict:
    # freed memory full of large values, where the optimizer's first torch.empty_like may land
    garbage = [torch.full((n,), 1e3) for n in (96, 16, 6, 18, 3) for _ in range(20)]
    del garbage
    return _fit(*args)


@pytest.mark.parametrize(("optimizer", "devices"), [("adamw", 2), ("sgd_momentum", 1)])  # no fused SGD on DTensors
def test_a_skipped_first_step_drops_the_gradients_of_a_fused_optimizer(optimizer, devices):
    """Not left to the fused kernel through found_inf: its first step makes the state (SGD's momentum
    from torch.empty_like) before skipping, and SGD kept that uninitialised memory as momentum."""
    ref = _reference(devices, nonfinite_step=0, optimizer=optimizer)
    for result in run_on_ranks(devices, _fit_after_garbage, devices, True, None, 0, optimizer):
        _assert_matches(result, ref, skipped=0)
        assert result["folded"][0] == {}  # gradients dropped: the optimizer skips every parameter
        assert [set(f) for f in result["folded"][1:]] == [{"grad_scale"}] * (STEPS - 1)
        if optimizer == "adamw":
            assert result["steps"] == [STEPS - 1]  # the skipped step does not count in Adam's state


def _required_without_fused() -> str:
    with pytest.raises(ValueError) as info:
        _fit(1, fused=False, fold=True)
    return str(info.value)


def test_fold_can_be_required_or_refused():
    (message,) = run_on_ranks(1, _required_without_fused)
    assert "fold_into_optimizer=True" in message and "['AdamW']" in message and "fused=True" in message
    (result,) = run_on_ranks(1, _fit, 1, True, False)
    assert result["folded"] == [{}] * STEPS
    _assert_matches(result, _reference(1))


class _ScaledModule(_Module):
    def __init__(self, fused: bool) -> None:
        super().__init__(fused)
        self.seen: list[float] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # after the step: the gradients it applied
        self.seen.append(float(torch.cat([p.grad.reshape(-1) for p in self.parameters()]).norm()))


def _fit_with_scaler(fused: bool) -> dict:
    use_existing_process_group()
    recorder, module = Recorder(), _ScaledModule(fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_steps=STEPS,
        logger=recorder, log_every_n_steps=1, callbacks=[GlobalNormClip(MAX_NORM)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    norms = [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m]
    return {"norms": norms, "seen": module.seen, "params": [p.detach().clone() for p in module.parameters()]}


def test_fused_optimizer_under_grad_scaler_is_normed_unscaled():
    """Lightning does not unscale a fused optimizer's gradients before the callbacks (its step does):
    the norm would be 2**10 times too large. The callback unscales them, so both optimizers see the
    same norms and make the same steps."""
    (fused,), (plain,) = run_on_ranks(1, _fit_with_scaler, True), run_on_ranks(1, _fit_with_scaler, False)
    assert len(fused["norms"]) == STEPS and all(math.isfinite(n) for n in fused["norms"])
    assert fused["norms"] == pytest.approx(plain["norms"], rel=1e-6)
    assert max(plain["norms"]) > MAX_NORM and max(plain["norms"]) < 100  # true, unscaled norms that clip
    assert fused["seen"] == pytest.approx([min(n, MAX_NORM) for n in plain["norms"]], rel=1e-5)
    for a, b in zip(fused["params"], plain["params"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _overflowing_scaler(fused: bool) -> dict:
    use_existing_process_group()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # fp16 gradients overflow in the first steps
    clip = GlobalNormClip(MAX_NORM, nonfinite="raise")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_steps=STEPS,
        logger=False, callbacks=[clip], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Module(fused))
    return {"skipped": clip.skipped_steps, "scale": scaler.get_scale(),
            "warned": [str(w.message) for w in caught if "non-finite" in str(w.message)]}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_grad_scaler_overflow_is_counted_not_raised(fused):
    """A GradScaler's overflow steps (routine while it finds its scale) are skipped by the scaler; the
    callback counts them and neither raises (nonfinite='raise') nor warns."""
    (result,) = run_on_ranks(1, _overflowing_scaler, fused)
    assert result["skipped"] >= 1, "the scale should have overflowed at first"
    assert result["scale"] == 2.0**24 * 0.5 ** result["skipped"]  # one backoff per step the callback counted
    assert result["warned"] == []


def _disabled_scaler() -> dict:
    use_existing_process_group()
    clip = GlobalNormClip(MAX_NORM)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # neither unscales nor skips a step
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_steps=STEPS,
        logger=False, callbacks=[clip], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = _Module(fused=False, nonfinite_step=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-finite", category=RuntimeWarning)
        trainer.fit(module)
    return {"skipped": clip.skipped_steps, "finite": all(bool(p.isfinite().all()) for p in module.parameters())}


def test_a_disabled_grad_scaler_leaves_the_skip_to_the_callback():
    (result,) = run_on_ranks(1, _disabled_scaler)
    assert result == {"skipped": 1, "finite": True}


class _SkippingModule(_ScaledModule):
    """``training_step`` returns ``None`` on the last micro-batch of the first accumulation window."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def _fit_skipping_a_window(fused: bool) -> dict:
    use_existing_process_group()
    recorder, module, clip = Recorder(), _SkippingModule(fused), GlobalNormClip(MAX_NORM)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_epochs=1,
        accumulate_grad_batches=2, logger=recorder, log_every_n_steps=1, callbacks=[clip],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    norms = [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m]
    return {"norms": norms, "seen": clip.seen_steps, "params": [p.detach().clone() for p in module.parameters()]}


@pytest.mark.faults
def test_a_window_ending_in_none_under_a_grad_scaler_is_left_alone():
    """Under a GradScaler, Lightning neither unscales nor steps when the window's last training_step returns
    None. The callback used to unscale a fused optimizer there anyway, and the next step failed with torch's
    "unscale_() has already been called on this optimizer since the last update()". It now does nothing for such
    a step: fused and for-loop optimizers see the same norms and make the same steps."""
    (fused,), (plain,) = run_on_ranks(1, _fit_skipping_a_window, True), run_on_ranks(1, _fit_skipping_a_window, False)
    windows = math.ceil(len(_data()) / LOCAL_BATCH / 2)
    assert fused["seen"] == plain["seen"] == windows - 1  # every window but the skipped one
    assert len(fused["norms"]) == windows - 1 and all(math.isfinite(n) for n in fused["norms"])
    assert fused["norms"] == pytest.approx(plain["norms"], rel=1e-6)
    for a, b in zip(fused["params"], plain["params"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
