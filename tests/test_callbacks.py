"""GlobalNormClip inside ``Trainer.fit`` with Lightning's own ModelParallelStrategy (FSDP2 x TP):
logged norms and trained parameters equal single-device training of the same global batches."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group  # also imported from here by other modules
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy

STEPS, LOCAL_BATCH, LR = 4, 2, 0.5


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    n = 64
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64) * 3,
                         torch.randn(n, 3, generator=g, dtype=torch.float64))


class Recorder(Logger):
    """Keeps every logged value as a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class MlpModule(L.LightningModule):
    def __init__(self, tp: bool, nonfinite_step: int | None = None) -> None:
        super().__init__()
        self.net = _mlp()
        self.tp = tp
        self.nonfinite_step = nonfinite_step

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, NDParallelStrategy):
            tp_mesh, dp_mesh = self.device_mesh["tp"], strategy.meshes["dp_shard_cp"]
        else:
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if self.tp:
            parallelize_module(self.net, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nonfinite_step:
            loss = loss * math.inf
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=LOCAL_BATCH, shuffle=False)


def _reference(
    dp: int, max_norm: float, nonfinite_step: int | None = None, accumulate: int = 1, steps: int = STEPS
) -> tuple[list[float], dict]:
    """One device: the same global batches, in the order of the DistributedSampler Lightning injects
    for training (shuffled with seed 0, epoch 0; rank r takes every dp-th index from r)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).tolist()
    norms = []
    for step in range(steps):
        micro = range(step * accumulate, (step + 1) * accumulate)  # equal sizes: mean of means = mean
        idx = [order[(m * LOCAL_BATCH + j) * dp + r] for m in micro for r in range(dp) for j in range(LOCAL_BATCH)]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norms.append(float(norm))
        if step != nonfinite_step:
            opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_case(dp: int, tp: int, max_norm: float, tmp: str, nonfinite_step: int | None = None) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = MlpModule(tp=tp > 1, nonfinite_step=nonfinite_step)
    clip = GlobalNormClip(max_norm, log_module_depth=2, expert_pattern=r"^net\.4\.")
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * tp, strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        max_steps=STEPS, callbacks=[clip], logger=[recorder, TensorBoardLogger(tmp, name="tb")],
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    nonfinite = [w for w in caught if "non-finite" in str(w.message)]
    expected = 1 if nonfinite_step is not None and dist.get_rank() == 0 else 0  # one warning per job, rank 0's
    assert len(nonfinite) == expected, [str(w.message) for w in nonfinite]
    params = {n: p.full_tensor() for n, p in module.net.named_parameters()}
    return {"rows": recorder.rows, "params": params, "skipped": clip.skipped_steps}


@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 1)], ids=["fsdp2xtp2", "fsdp4"])
def test_logged_norms_and_parameters_match_single_device(dp, tp, tmp_path):
    ref_norms, ref_params = _reference(dp, max_norm=0.3)
    assert max(ref_norms) > 0.3, "clipping should be active in this test"
    results = run_on_ranks(dp * tp, _fit_case, dp, tp, 0.3, str(tmp_path))
    rows = results[0]["rows"]
    totals = [m["grad_norm/total"] for _, m in rows if "grad_norm/total" in m]
    assert len(totals) == STEPS, rows
    for ours, ref in zip(totals, ref_norms):
        assert abs(ours - ref) <= 1e-12 * ref
    clipped = [m["grad_norm/clipped"] for _, m in rows if "grad_norm/clipped" in m]
    for ours, ref in zip(clipped, ref_norms):
        assert abs(ours - min(ref, 0.3 * ref / (ref + 1e-6))) <= 1e-12 * ref
    module_norms = [m for _, m in rows if "grad_norm/net.0" in m]  # depth 2: net.0, net.2, net.4
    assert len(module_norms) == STEPS and {"grad_norm/net.2", "grad_norm/net.4"} <= set(module_norms[0])
    for m, ref in zip(module_norms, ref_norms):  # modules and the dense/expert split add up exactly
        assert abs(sum(m[f"grad_norm/net.{i}"] ** 2 for i in (0, 2, 4)) - ref**2) <= 1e-12 * ref**2
        assert m["grad_norm/expert"] == m["grad_norm/net.4"]
        assert abs(m["grad_norm/expert"] ** 2 + m["grad_norm/dense"] ** 2 - ref**2) <= 1e-12 * ref**2
    for r in results:
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(Path(tmp_path).glob("tb/version_*")))).Reload()
    assert {"grad_norm/total", "grad_norm/clipped", "grad_norm/clip_coef", "grad_norm/skipped_steps"} <= set(
        events.Tags()["scalars"]
    )


@pytest.mark.faults
def test_nonfinite_step_is_skipped_on_every_rank(tmp_path):
    _, ref_params = _reference(2, max_norm=0.3, nonfinite_step=1)  # step 1 skipped
    results = run_on_ranks(2, _fit_case, 2, 1, 0.3, str(tmp_path), 1)
    assert [r["skipped"] for r in results] == [1, 1]
    for r in results:
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name
    totals = [m["grad_norm/total"] for _, m in results[0]["rows"] if "grad_norm/total" in m]
    skipped = [m["grad_norm/skipped_steps"] for _, m in results[0]["rows"] if "grad_norm/skipped_steps" in m]
    assert not math.isfinite(totals[1]) and skipped == [0.0, 1.0, 1.0, 1.0]


def _conflict_case() -> str:
    use_existing_process_group()
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[GlobalNormClip(1.0)], gradient_clip_val=1.0,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(MlpModule(tp=False))
    return str(info.value)


def test_gradient_clip_val_conflict_is_a_clear_error():
    (message,) = run_on_ranks(1, _conflict_case)
    assert "gradient_clip_val=1.0" in message and "GlobalNormClip" in message


@pytest.mark.parametrize(
    "kwargs,match",
    [({"max_norm": 0.0}, "max_norm"), ({"max_norm": 1.0, "nonfinite": "ignore"}, "nonfinite"),
     ({"max_norm": 1.0, "norm_type": -1.0}, "norm_type"), ({"max_norm": 1.0, "log_module_depth": 0}, "log_module_depth")],
)
def test_bad_arguments_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GlobalNormClip(**kwargs)


class _ManualModule(MlpModule):
    def __init__(self) -> None:
        super().__init__(tp=False)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()  # GlobalNormClip clips in on_before_optimizer_step, inside this call


def _strategy_case(kind: str) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _ManualModule() if kind == "manual" else _DDPModule(tp=False)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if kind == "manual" else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                        callbacks=[GlobalNormClip(0.3)], logger=recorder, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.net.named_parameters()}
    return {"norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m], "params": full}


class _DDPModule(MlpModule):
    def configure_model(self) -> None:  # plain replicas: DDP wraps the module itself
        pass


@pytest.mark.parametrize("kind", ["manual", "ddp"])
def test_manual_optimization_and_lightning_ddp_match_single_device(kind):
    ref_norms, ref_params = _reference(2, max_norm=0.3)
    results = run_on_ranks(2, _strategy_case, kind)
    for ours, ref in zip(results[0]["norms"], ref_norms):
        assert abs(ours - ref) <= 1e-12 * ref
    assert len(results[0]["norms"]) == STEPS
    for r in results:
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name


def _counter_case(max_norm: float, nonfinite_step: int) -> dict:
    use_existing_process_group()
    clip = GlobalNormClip(max_norm)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS, callbacks=[clip], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-finite", category=RuntimeWarning)
        trainer.fit(MlpModule(tp=False, nonfinite_step=nonfinite_step))
    return {"state": clip.state_dict(), "clipped": clip.clipped_steps, "rate": clip.clip_rate, "seen": clip.seen_steps}


def test_clip_counters_count_clipped_unclipped_and_skipped_steps():
    max_norm, nonfinite_step = 2.0, 1
    ref_norms, _ = _reference(2, max_norm, nonfinite_step=nonfinite_step)
    clipped = [n > max_norm for step, n in enumerate(ref_norms) if step != nonfinite_step]
    assert any(clipped) and not all(clipped), ref_norms  # steps that clip and steps that do not
    results = run_on_ranks(2, _counter_case, max_norm, nonfinite_step)
    for r in results:
        assert (r["clipped"], r["seen"]) == (sum(clipped), STEPS)  # the skipped step: seen, not clipped
        assert r["rate"] == sum(clipped) / STEPS
        assert r["state"] == {"skipped_steps": 1, "seen_steps": STEPS, "clipped_steps": sum(clipped)}
    fresh, resumed = GlobalNormClip(max_norm), GlobalNormClip(max_norm)
    assert (fresh.clipped_steps, fresh.seen_steps, fresh.clip_rate) == (0, 0, 0.0)
    resumed.load_state_dict(results[0]["state"])  # counters survive a checkpoint
    assert (resumed.clipped_steps, resumed.seen_steps, resumed.skipped_steps) == (sum(clipped), STEPS, 1)


def _cadence_case(every: int, steps: int) -> list[tuple[int, float]]:
    use_existing_process_group()
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=steps, callbacks=[GlobalNormClip(0.3)], logger=recorder, log_every_n_steps=every,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MlpModule(tp=False))
    return [(step, m["grad_norm/total"]) for step, m in recorder.rows if "grad_norm/total" in m]


def test_each_logged_norm_is_the_norm_of_the_step_it_is_logged_at():
    """With log_every_n_steps=2 Lightning writes steps 1, 3, ...: the norm logged there is that step's."""
    ref_norms, _ = _reference(2, max_norm=0.3, steps=5)
    logged = run_on_ranks(2, _cadence_case, 2, 5)[0]
    assert [s for s, _ in logged][:2] == [1, 3], logged
    for step, value in logged:
        assert abs(value - ref_norms[step]) <= 1e-12 * ref_norms[step], (step, value, ref_norms)


class _TwoOptimizerModule(MlpModule):
    """Manual optimization stepping two optimizers (the first layer, the rest) in every batch."""

    def __init__(self) -> None:
        super().__init__(tp=False)
        self.automatic_optimization = False
        self.true_norms: list[tuple[float, float]] = []

    def configure_model(self) -> None:
        pass

    def training_step(self, batch, batch_idx):
        first, rest = self.optimizers()
        first.zero_grad()
        rest.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        groups = (list(self.net[0].parameters()), list(self.net[2:].parameters()))
        self.true_norms.append(tuple(float(torch.nn.utils.get_total_norm([p.grad for p in g])) for g in groups))
        first.step()
        rest.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[0].parameters(), lr=LR), torch.optim.SGD(self.net[2:].parameters(), lr=LR)


def _two_optimizers_case() -> dict:
    use_existing_process_group()
    recorder, module = Recorder(), _TwoOptimizerModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[GlobalNormClip(1e9)],
                        logger=recorder, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    logged = [(m["grad_norm/opt0/total"], m["grad_norm/opt1/total"]) for _, m in recorder.rows if "grad_norm/opt0/total" in m]
    return {"logged": logged, "true": module.true_norms, "unprefixed": any("grad_norm/total" in m for _, m in recorder.rows)}


def test_each_of_several_optimizers_logs_its_own_norms():
    # under one key, both optimizers' values in one batch kept only the second's
    (result,) = run_on_ranks(1, _two_optimizers_case)
    assert len(result["logged"]) == len(result["true"]) > 0 and not result["unprefixed"]
    for logged, true in zip(result["logged"], result["true"]):
        assert logged == pytest.approx(true, rel=1e-6)
        assert abs(true[0] - true[1]) > 1e-3 * true[1]  # distinct values, so one cannot stand for the other
