"""What a Lightning user combines with NDParallelStrategy every day, on 4 gloo ranks (FSDP2 x TP,
``dp_shard=2, tp=2``, float64): the fit / validate / test / predict lifecycle and checkpoint resume
(with a declarative plan, a hand-written ``configure_model`` and a pipeline), every hook signature
Lightning accepts, and the stock callbacks and Trainer options.

Trained parameters are checked against single-device SGD replayed on the rows each step actually
read (every training batch carries its dataset row ids), so the checks hold whatever order Lightning
feeds the data in; logged values are checked against the same replayed models.
"""

from __future__ import annotations

import inspect
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from test_callbacks import Recorder, _data, _mlp, use_existing_process_group
from test_pipeline import VOCAB, TinyLM
from test_strategy import _token_reference, _TokenModule
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan, PipelineOptions

WORLD = 4
ROWS = 2  # rows per rank and batch
LR, MOMENTUM = 0.1, 0.9
PP_MICRO = 2  # pipeline micro-batches per batch (one row each)
VAL_ROWS = (range(0, 8), range(8, 16))  # two evaluation sets
TIMEOUT = 600.0  # a hang guard only: several Trainers run per call on 2 loaded cores

# --- data, models and the single-device replay ---


def _mlp_rows() -> TensorDataset:
    x, y = _data().tensors  # 64 rows
    return TensorDataset(torch.arange(len(x)), x, y)


def _lm_rows() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (32, 6), generator=g)
    labels = torch.randint(0, VOCAB, (32, 6), generator=g)  # every token valid: micro-batch means average exactly
    return TensorDataset(torch.arange(32), tokens, labels)


def _rows(kind: str) -> TensorDataset:
    return _mlp_rows() if kind == "mlp" else _lm_rows()


def _subset(data: TensorDataset, rows: range) -> TensorDataset:
    return TensorDataset(*(t[list(rows)] for t in data.tensors))


def _loader(kind: str, rows: range | None = None) -> DataLoader:
    data = _rows(kind)
    return DataLoader(data if rows is None else _subset(data, rows), batch_size=ROWS)


def _model(kind: str, params: dict[str, torch.Tensor] | None = None) -> nn.Module:
    model = _mlp() if kind == "mlp" else TinyLM()
    if params is not None:
        model.load_state_dict(params)
    return model


def _mean_loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.mse_loss(out, y) if kind == "mlp" else F.cross_entropy(out.flatten(0, 1), y.flatten())


def _replay(kind: str, windows: list[list[int]], lrs: list[float], momentum: float = 0.0,
            fresh_optimizer_at: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """Single-device SGD, one step per window of row ids (all micro-batches of all dp ranks: equal
    sizes, so the mean loss of the rows is the mean of the per-rank, per-micro-batch means); a new
    optimizer (momentum lost) where Lightning calls ``configure_optimizers`` again. The parameters
    after each step."""
    model = _model(kind)
    _, x, y = _rows(kind).tensors
    history, opt = [], None
    for step, rows in enumerate(windows):
        if opt is None or step in fresh_optimizer_at:
            opt = torch.optim.SGD(model.parameters(), lr=lrs[step], momentum=momentum)
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.zero_grad()
        _mean_loss(kind, model, x[rows], y[rows]).backward()
        opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def _eval_reference(kind: str, params: dict[str, torch.Tensor], rows: range) -> float:
    """The value a validation / test step logs, reduced over batches and dp ranks: the mean loss of
    the rows; with the pipeline, ``run_pipeline`` returns the sum of its micro-batch means."""
    _, x, y = _rows(kind).tensors
    with torch.no_grad():
        loss = float(_mean_loss(kind, _model(kind, params), x[list(rows)], y[list(rows)]))
    return loss * (PP_MICRO if kind == "lm" else 1)


def _predict_reference(kind: str, params: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    _, x, y = _rows(kind).tensors
    model = _model(kind, params)
    with torch.no_grad():
        if kind == "mlp":
            return model(x[ids])
        return sum(_mean_loss(kind, model, x[[i]], y[[i]]) for i in ids)  # one row per micro-batch


def _windows(results: list[dict], key: str, accumulate: int = 1) -> list[list[int]]:
    """Per optimizer step, the row ids every dp rank read; checks that the ranks of one dp rank
    (tp and pp peers) read the same batches and the dp ranks different rows."""
    by_dp: dict[int, list[list[int]]] = {}
    for r in results:
        assert r[key] == by_dp.setdefault(r["dp"], r[key]), "tp / pp peers must read the same batches"
    seqs = [by_dp[d] for d in sorted(by_dp)]
    assert len(seqs) == 2 and len(seqs[0]) % accumulate == 0, seqs
    windows = [
        [row for m in range(s * accumulate, (s + 1) * accumulate) for seq in seqs for row in seq[m]]
        for s in range(len(seqs[0]) // accumulate)
    ]
    for rows in windows:
        assert len(set(rows)) == len(rows) == 2 * ROWS * accumulate, windows
    return windows


def _assert_params(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str = "") -> None:
    assert ours, "no parameters"
    for name, value in ours.items():
        assert torch.allclose(value, reference[name], rtol=1e-12, atol=1e-14), (what, name)


def _checkpoint_steps(files: list[str]) -> list[int | str]:
    """``["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]`` -> ``[2, 4, "last"]`` (the epoch
    in a name is Lightning's count, which a ``fit`` that stopped at ``max_steps`` also advances)."""
    steps: list[int | str] = []
    for name in files:
        match = re.fullmatch(r"epoch=\d+-step=(\d+)\.ckpt", name)
        steps.append(int(match.group(1)) if match else name.removesuffix(".ckpt"))
    return sorted(steps, key=lambda s: (isinstance(s, str), str(s) if isinstance(s, str) else s))


def _close(ours: float, reference: float) -> bool:
    return abs(ours - reference) <= 1e-12 * abs(reference)


# --- inside the workers ---


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def _dp_rank(module: L.LightningModule) -> int:
    return module.trainer.strategy.meshes["dp"].get_local_rank()


def _probe(module: L.LightningModule, offset: float = 0.0) -> torch.Tensor:
    """A rank-dependent value, 10 x dp rank + tp rank: its mean over the dp ranks (5 + tp rank)
    differs from its mean over all ranks (5.5), though tp peers hold copies of everything else."""
    meshes = module.trainer.strategy.meshes
    return torch.tensor(10.0 * meshes["dp"].get_local_rank() + meshes["tp"].get_local_rank() + offset, dtype=torch.float64)


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=WORLD, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1,
    )  # fmt: skip
    kwargs = {**defaults, **kwargs}
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in kwargs.get("callbacks", [])))
    return L.Trainer(strategy=strategy, **kwargs)


_HOOK_NAMES = frozenset(
    name
    for cls in L.LightningModule.__mro__
    for name, value in vars(cls).items()
    if inspect.isfunction(value) and not name.startswith("__")
) | {"configure_model", "optimizer_zero_grad", "training_step", "validation_step", "test_step", "predict_step"}


def _snapshot(module: L.LightningModule) -> dict[str, Any]:
    """What patching the module would change: its class, the namespaces of its classes, and the
    callables in its instance ``__dict__``."""
    return {
        "type": type(module),
        "classes": {cls: {k: id(v) for k, v in vars(cls).items()} for cls in type(module).__mro__ if cls is not object},
        "instance": {k: id(v) for k, v in vars(module).items() if callable(v)},
    }


def _patches(module: L.LightningModule, before: dict[str, Any]) -> list[str]:
    """Every way ``module`` differs from its snapshot ``before`` (empty when it was not patched)."""
    after, found = _snapshot(module), []
    if after["type"] is not before["type"]:
        found.append(f"class swapped: {before['type'].__qualname__} -> {after['type'].__qualname__}")
    for cls, attrs in before["classes"].items():
        now = {k: id(v) for k, v in vars(cls).items()}
        changed = sorted(k for k in attrs.keys() | now.keys() if attrs.get(k) != now.get(k))
        if changed:
            found.append(f"class {cls.__qualname__} changed: {changed}")
    if after["instance"] != before["instance"]:
        found.append(f"instance callables changed: {sorted(before['instance'])} -> {sorted(after['instance'])}")
    hooks = sorted(_HOOK_NAMES & vars(module).keys())
    if hooks:
        found.append(f"hook-named attributes in the instance __dict__: {hooks}")
    return found


class _Mlp(L.LightningModule):
    """The float64 MLP of test_callbacks on batches ``(row ids, x, y)``; remembers each training
    batch's rows. No ``configure_model``: parallelized by a declarative plan."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.net = _mlp()
        self.momentum = momentum
        self.seen: list[list[int]] = []
        self.train_starts: list[int] = []

    def loss(self, batch) -> torch.Tensor:
        _, x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        self.train_starts.append(self.trainer.global_step)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        return self.loss(batch)

    def validation_step(self, batch):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch):
        return batch[0], self.net(batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)

    def train_dataloader(self):
        return _loader("mlp")

    def val_dataloader(self):
        return _loader("mlp", VAL_ROWS[0])

    test_dataloader = predict_dataloader = val_dataloader


class _HandMlp(_Mlp):
    """The same, parallelized by hand with ``ModelParallelStrategy``'s mesh names."""

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # called again by validate / test / predict / a second fit
            return
        dp_mesh = self.device_mesh["data_parallel"]
        parallelize_module(self.net, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)


class _PipeLM(L.LightningModule):
    """TinyLM cut into 2 pipeline stages by the strategy; ``training_step(self, batch)``."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.model = TinyLM()
        self.momentum = momentum
        self.seen: list[list[int]] = []
        self.train_starts: list[int] = []

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def _run(self, batch) -> torch.Tensor:
        return self.trainer.strategy.run_pipeline(batch[1], batch[2])

    def on_train_start(self) -> None:
        self.train_starts.append(self.trainer.global_step)

    def training_step(self, batch):
        self.seen.append(batch[0].tolist())
        return self._run(batch)

    def validation_step(self, batch):
        self.log("val_loss", self._run(batch), sync_dist=True)

    def test_step(self, batch):
        self.log("test_loss", self._run(batch), sync_dist=True)

    def predict_step(self, batch):
        return batch[0], self._run(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)

    def train_dataloader(self):
        return _loader("lm")

    def val_dataloader(self):
        return _loader("lm", VAL_ROWS[0])

    test_dataloader = predict_dataloader = val_dataloader


def _stage_params(module: _PipeLM) -> dict[str, torch.Tensor]:
    return {n: p for stage in module.model for n, p in _full(stage).items()}  # names as in the unsplit model


LIFECYCLE: dict[str, tuple[str, type[L.LightningModule], Callable[[], NDParallelStrategy]]] = {
    "declarative-plan": ("mlp", _Mlp, lambda: NDParallelStrategy(
        dp_shard=2, tp=2,
        plan=ParallelPlan(tp_plan={"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}, fsdp_units=(nn.Linear,)))),
    "configure_model": ("mlp", _HandMlp, lambda: NDParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)),
    "pp2xdp2": ("lm", _PipeLM, lambda: NDParallelStrategy(
        pp=2, dp_shard=2, pipeline=PipelineOptions(split_points=["layers.2"], microbatches=PP_MICRO),
        plan=ParallelPlan(fsdp_units=(nn.Linear,)))),
}


def _lifecycle_case(mode: str, directory: str) -> dict:
    use_existing_process_group()
    kind, cls, strategy = LIFECYCLE[mode]
    params = _full if kind == "mlp" else _stage_params
    part = (lambda m: m.net) if kind == "mlp" else (lambda m: m)
    ckpts = Path(directory)

    def trainer(max_steps: int) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=ckpts, save_last=True, every_n_train_steps=2, save_top_k=-1)
        return _trainer(strategy(), max_steps=max_steps, callbacks=[checkpoint])

    module = cls(momentum=MOMENTUM)
    before = _snapshot(module)
    first = trainer(2)
    first.fit(module)
    out: dict[str, Any] = {"dp": _dp_rank(module), "steps": [first.global_step], "params_2": params(part(module))}
    out["val"] = first.validate(module)[0]["val_loss"]
    out["test"] = first.test(module)[0]["test_loss"]
    out["predictions"] = [(ids.tolist(), value.detach().clone()) for ids, value in first.predict(module)]
    first.fit_loop.epoch_loop.max_steps = 4  # the same Trainer fits on
    first.fit(module)
    out["steps"].append(first.global_step)
    out["params_4"], out["seen"] = params(part(module)), module.seen
    out["files"] = sorted(os.listdir(ckpts))
    out["patches"] = _patches(module, before)

    resumed = cls(momentum=MOMENTUM)
    before = _snapshot(resumed)
    second = trainer(6)
    second.fit(resumed, ckpt_path="last")
    out["steps"].append(second.global_step)
    out["resumed_from"], out["seen_resumed"], out["params_6"] = resumed.train_starts, resumed.seen, params(part(resumed))
    out["patches"] += _patches(resumed, before)

    fresh = cls(momentum=MOMENTUM)
    before = _snapshot(fresh)
    (step_2,) = ckpts.glob("epoch=*-step=2.ckpt")
    out["val_fresh"] = _trainer(strategy()).validate(fresh, ckpt_path=str(step_2))[0]["val_loss"]
    out["patches"] += _patches(fresh, before)
    return out


@pytest.mark.parametrize("mode", list(LIFECYCLE))
def test_lifecycle_resume_and_the_module_is_never_patched(mode, tmp_path):
    """fit (2 steps) -> validate -> test -> predict -> fit on to step 4 with the same Trainer; a new
    Trainer resumes from ``ckpt_path="last"`` to step 6 (SGD momentum restored); a fresh Trainer and
    module validate the step-2 checkpoint. Parameters equal single-device SGD throughout."""
    kind = LIFECYCLE[mode][0]
    results = run_on_ranks(WORLD, _lifecycle_case, mode, str(tmp_path), timeout=TIMEOUT)
    windows = _windows(results, "seen") + _windows(results, "seen_resumed")
    # Lightning calls configure_optimizers in each fit: a new optimizer at step 2, restored from the checkpoint at 4
    history = _replay(kind, windows, [LR] * 6, MOMENTUM, fresh_optimizer_at=(2,))
    val_ref = _eval_reference(kind, history[1], VAL_ROWS[0])
    for rank, r in enumerate(results):
        assert r["patches"] == [], (rank, r["patches"])
        assert r["steps"] == [2, 4, 6] and r["resumed_from"] == [4], (r["steps"], r["resumed_from"])
        assert _checkpoint_steps(r["files"]) == [2, 4, "last"], r["files"]
        for key, step in (("params_2", 2), ("params_4", 4), ("params_6", 6)):
            _assert_params(r[key], history[step - 1], key)
        assert _close(r["val"], val_ref), (r["val"], val_ref)
        assert _close(r["test"], val_ref), (r["test"], val_ref)
        assert abs(r["val_fresh"] - r["val"]) <= 1e-13 * abs(r["val"]), (r["val_fresh"], r["val"])
        predicted = sorted(i for ids, _ in r["predictions"] for i in ids)
        assert len(predicted) == len(VAL_ROWS[0]) // 2, predicted  # this dp rank's half
        for ids, value in r["predictions"]:
            assert torch.allclose(value, _predict_reference(kind, history[1], ids), rtol=1e-12, atol=1e-14), ids
    predicted = {i for r in results for ids, _ in r["predictions"] for i in ids}
    assert predicted == set(VAL_ROWS[0]), "predict should cover every row over the dp ranks"


# --- hook signatures ---

STEPS = 4


class _BatchOnlyTwoValMlp(_HandMlp):
    """``training_step(self, batch)``; ``validation_step(self, batch, batch_idx, dataloader_idx=0)``
    over two validation sets."""

    def __init__(self) -> None:
        super().__init__()
        self.val_calls: list[tuple[int, int]] = []

    def training_step(self, batch):
        self.seen.append(batch[0].tolist())
        return self.loss(batch)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.val_calls.append((dataloader_idx, batch_idx))
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def val_dataloader(self):
        return [_loader("mlp", rows) for rows in VAL_ROWS]


class _KeywordMlp(_HandMlp):
    """``training_step(self, batch, batch_idx=0)``: Lightning passes the index."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_idxs: list[int] = []

    def training_step(self, batch, batch_idx=0):
        self.batch_idxs.append(batch_idx)
        return super().training_step(batch, batch_idx)


class _TokenBatchOnly(_TokenModule):
    def training_step(self, batch):
        return super().training_step(batch, None)  # the parent ignores the index


def _signatures_case() -> dict:
    use_existing_process_group()
    out: dict[str, Any] = {}
    for name, module in (("reference", _HandMlp()), ("batch_only", _BatchOnlyTwoValMlp()), ("keyword", _KeywordMlp())):
        trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2), max_steps=STEPS,
                           val_check_interval=STEPS, limit_val_batches=0 if name == "keyword" else None)
        trainer.fit(module)  # validation runs after the 4th batch
        out[name] = {
            "seen": module.seen, "params": _full(module.net),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "val_calls": getattr(module, "val_calls", None), "batch_idxs": getattr(module, "batch_idxs", None),
        }
        out["dp"] = _dp_rank(module)
        if name == "reference":
            out[name]["test"] = trainer.test(module)[0]["test_loss"]
            out[name]["predictions"] = [(ids.tolist(), value.detach().clone()) for ids, value in trainer.predict(module)]
    recorder = Recorder()
    trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean"), max_epochs=1,
                       limit_train_batches=5, accumulate_grad_batches=3, callbacks=[GlobalNormClip(0.05)],
                       logger=recorder)  # as test_strategy's token_mean test: windows of 3 and 2 micro-batches
    module = _TokenBatchOnly()
    trainer.fit(module)
    out["token_mean"] = {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": _full(module.model),
    }
    return out


def test_every_hook_signature_trains_and_evaluates_alike():
    results = run_on_ranks(WORLD, _signatures_case, timeout=TIMEOUT)
    for name in ("reference", "batch_only", "keyword"):
        for r in results:
            r["seen_" + name] = r[name]["seen"]
    windows = _windows(results, "seen_reference")
    assert _windows(results, "seen_batch_only") == _windows(results, "seen_keyword") == windows
    params = _replay("mlp", windows, [LR] * STEPS)[-1]
    val_refs = [_eval_reference("mlp", params, rows) for rows in VAL_ROWS]
    ref_norms, ref_token_params, _ = _token_reference(2)
    for r in results:
        for name in ("reference", "batch_only", "keyword"):
            _assert_params(r[name]["params"], params, name)
            assert all(torch.equal(v, r["reference"]["params"][n]) for n, v in r[name]["params"].items()), name
        reference, batch_only = r["reference"], r["batch_only"]
        assert _close(reference["metrics"]["val_loss"], val_refs[0]), reference["metrics"]  # validation_step(batch)
        assert _close(reference["test"], val_refs[0])  # test_step(batch)
        for ids, value in reference["predictions"]:  # predict_step(batch)
            assert torch.allclose(value, _predict_reference("mlp", params, ids), rtol=1e-12, atol=1e-14), ids
        for i, ref in enumerate(val_refs):  # validation_step(batch, batch_idx, dataloader_idx=0)
            assert _close(batch_only["metrics"][f"val_loss/dataloader_idx_{i}"], ref), batch_only["metrics"]
        assert batch_only["val_calls"] == [(0, 0), (0, 1), (1, 0), (1, 1)], batch_only["val_calls"]
        assert r["keyword"]["batch_idxs"] == list(range(STEPS))  # (batch, batch_idx=0) gets the real index
        token = r["token_mean"]  # token_mean with training_step(self, batch)
        assert len(token["norms"]) == 2
        for ours, ref in zip(token["norms"], ref_norms):
            assert abs(ours - ref) <= 1e-10 * ref
        for name, value in token["params"].items():
            assert float((value - ref_token_params[name]).norm() / ref_token_params[name].norm()) < 1e-10, name


# --- callbacks and Trainer options (FSDP2 x TP) ---

FEATURE_LR, TRAIN_BATCHES, ACCUMULATE = 0.5, 8, 2
LRS = [FEATURE_LR * 0.5**step for step in range(TRAIN_BATCHES // ACCUMULATE)]


class _FeatureMlp(_HandMlp):
    """StepLR per step, two validation sets, and a rank-dependent ``self.log(..., sync_dist=True)``
    in every hook."""

    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=FEATURE_LR)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"}}

    def training_step(self, batch, batch_idx):
        self.log("probe/training_step", _probe(self), sync_dist=True)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.log("probe/on_train_epoch_end", _probe(self, 1), sync_dist=True)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.loss(batch), sync_dist=True)
        self.log("probe/validation_step", _probe(self, 2), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.validated_at.append(self.trainer.global_step)
        self.log("probe/on_validation_epoch_end", _probe(self, 3), sync_dist=True)

    def test_step(self, batch):
        self.log("test_loss", self.loss(batch), sync_dist=True)
        self.log("probe/test_step", _probe(self, 4), sync_dist=True)

    def val_dataloader(self):
        return [_loader("mlp", rows) for rows in VAL_ROWS]


def _features_case(directory: str) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _FeatureMlp()
    early = EarlyStopping(monitor="val_loss/dataloader_idx_0", mode="min", min_delta=10.0, patience=1)  # no 2nd gain of 10
    callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=2, save_top_k=-1), early,
                 LearningRateMonitor(logging_interval="step")]
    trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2), max_epochs=3, limit_train_batches=TRAIN_BATCHES,
                       accumulate_grad_batches=ACCUMULATE, val_check_interval=0.5, callbacks=callbacks, logger=recorder)
    trainer.fit(module)
    out = {
        "dp": _dp_rank(module), "tp": trainer.strategy.meshes["tp"].get_local_rank(), "seen": module.seen,
        "params": _full(module.net), "global_step": trainer.global_step, "should_stop": trainer.should_stop,
        "stopped_epoch": early.stopped_epoch, "validated_at": module.validated_at, "rows": recorder.rows,
        "fit_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    trainer.test(module)
    out["test_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return out


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> tuple[Path, list[dict], list[dict[str, torch.Tensor]]]:
    """One fit (+ test) with ModelCheckpoint, EarlyStopping, LearningRateMonitor, a StepLR schedule,
    accumulate_grad_batches=2, val_check_interval=0.5 and two validation sets; the replayed history."""
    directory = tmp_path_factory.mktemp("features")
    results = run_on_ranks(WORLD, _features_case, str(directory), timeout=TIMEOUT)
    history = _replay("mlp", _windows(results, "seen", ACCUMULATE), LRS)
    return directory, results, history


def test_gradient_accumulation_with_a_step_scheduler_matches_single_device(features):
    _, results, history = features
    assert len(history) == 4
    for r in results:
        _assert_params(r["params"], history[-1])


def test_model_checkpoint_every_two_steps_and_last(features):
    directory, results, _ = features
    files = os.listdir(directory)
    assert _checkpoint_steps(files) == [2, 4, "last"], files
    for name in files:
        step = 4 if name == "last.ckpt" else _checkpoint_steps([name])[0]
        path = directory / name
        assert path.is_dir() and (path / ".metadata").is_file(), "a distributed checkpoint: one directory"
        assert torch.load(path / "meta.pt", weights_only=False)["global_step"] == step, name


def test_early_stopping_on_a_validation_metric_stops_training(features):
    for r in features[1]:
        # max_epochs=3 would be 12 steps; the second validation (end of epoch 0) brings no gain of 10
        assert r["should_stop"] and r["stopped_epoch"] == 0 and r["global_step"] == 4, r


def test_val_check_interval_validates_twice_per_epoch_on_two_dataloaders(features):
    _, results, history = features
    for r in results:
        assert r["validated_at"] == [2, 4], r["validated_at"]  # after micro-batches 4 and 8 of 8
    logged = [m for _, m in results[0]["rows"] if "val_loss/dataloader_idx_0" in m]
    assert len(logged) == 2, logged
    for metrics, params in zip(logged, (history[1], history[3])):
        for i, rows in enumerate(VAL_ROWS):
            assert _close(metrics[f"val_loss/dataloader_idx_{i}"], _eval_reference("mlp", params, rows)), metrics


def test_learning_rate_monitor_logs_the_scheduled_rates(features):
    logged = {(step, m["lr-SGD"]) for step, m in features[1][0]["rows"] if "lr-SGD" in m}
    assert logged == set(enumerate(LRS)), sorted(logged)


def test_sync_dist_in_every_hook_means_over_the_data_parallel_ranks(features):
    _, results, history = features
    for r in results:
        expected = 5.0 + r["tp"]  # mean over dp ranks 0, 1 of 10 x dp + tp (+ offset)
        fit, test = r["fit_metrics"], r["test_metrics"]
        assert fit["probe/training_step"] == expected, fit
        assert fit["probe/on_train_epoch_end"] == expected + 1, fit
        for i in (0, 1):
            assert fit[f"probe/validation_step/dataloader_idx_{i}"] == expected + 2, fit
        assert fit["probe/on_validation_epoch_end"] == expected + 3, fit
        assert test["probe/test_step"] == expected + 4, test
        assert _close(test["test_loss"], _eval_reference("mlp", history[-1], VAL_ROWS[0])), test


# --- manual optimization and the strategy's collectives ---


class _ManualMlp(_HandMlp):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _manual_case(directory: str) -> dict:
    use_existing_process_group()
    module = _ManualMlp()
    rich = _rich_available()
    callbacks = []
    if rich:
        from lightning.pytorch.callbacks import RichProgressBar

        callbacks.append(RichProgressBar())
    trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2), max_steps=STEPS, limit_val_batches=0,
                       enable_progress_bar=rich, callbacks=callbacks)
    trainer.fit(module)
    strategy, rank = trainer.strategy, dist.get_rank()
    marker = Path(directory) / "rank0-was-here"
    if rank == 0:
        time.sleep(1.0)  # the other ranks reach the barrier first
        marker.touch()
    strategy.barrier("after-marker")
    marker_seen = marker.exists()
    strategy.barrier("after-check")
    probe = _probe(module)
    return {
        "dp": _dp_rank(module), "tp": strategy.meshes["tp"].get_local_rank(), "seen": module.seen,
        "params": _full(module.net), "global_step": trainer.global_step, "marker_seen": marker_seen,
        "broadcast": strategy.broadcast({"from": rank, "payload": [rank] * 3}),
        "reduce_mean": float(strategy.reduce(probe)), "reduce_sum": float(strategy.reduce(probe, reduce_op="sum")),
        "progress_bar": type(trainer.progress_bar_callback).__name__ if trainer.progress_bar_callback else None,
    }


@pytest.fixture(scope="module")
def manual(tmp_path_factory) -> list[dict]:
    return run_on_ranks(WORLD, _manual_case, str(tmp_path_factory.mktemp("manual")), timeout=TIMEOUT)


def test_manual_optimization_matches_single_device(manual):
    params = _replay("mlp", _windows(manual, "seen"), [LR] * STEPS)[-1]
    for r in manual:
        assert r["global_step"] == STEPS
        _assert_params(r["params"], params)


def test_strategy_barrier_broadcast_and_reduce(manual):
    for r in manual:
        assert r["marker_seen"], "barrier() let a rank through before rank 0 reached it"
        assert r["broadcast"] == {"from": 0, "payload": [0, 0, 0]}
        # over dp x cp (tp peers hold copies): mean and sum over dp ranks 0, 1 of 10 x dp + tp
        assert r["reduce_mean"] == 5.0 + r["tp"] and r["reduce_sum"] == 10.0 + 2 * r["tp"], r


def test_rich_progress_bar(manual):
    pytest.importorskip("rich", reason="rich (installed with lightning[extra]) is not installed here")
    for r in manual:
        assert r["progress_bar"] == "RichProgressBar" and r["global_step"] == STEPS
