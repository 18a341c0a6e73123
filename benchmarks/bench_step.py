"""Benchmark: wall time per optimizer step of a Lightning FSDP2 (x TP) training run (CPU, gloo).

Compares, on one model, data, optimizer and world size:

* ``lightning_clip``: Lightning's ``ModelParallelStrategy`` + ``Trainer(gradient_clip_val=1.0)``;
* ``ndclip``: ``NDParallelStrategy`` + ``GlobalNormClip(1.0)`` (no per-module logs);
* ``ndclip_modules``: the same with ``GlobalNormClip(1.0, log_module_depth=...)``;
* ``noclip``: ``ModelParallelStrategy`` without clipping (the step itself, as a reference);
* ``ndclip_nofold``: (b) with ``GlobalNormClip(fold_into_optimizer=False)``: with ``--optimizer
  adamw_fused``, the clip's own scaling pass instead of the fused optimizer applying the coefficient
  (the fold on and off).

Timed per rank: the whole step, and its clipping segment (``on_before_optimizer_step`` to the
update). On the FSDP2 x TP layout Lightning's clipping raises; the error is recorded instead.

Run by hand (see README.md)::

    python benchmarks/bench_step.py            # 4 ranks, --layers 6 20 60, fsdp and fsdp_tp
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from _common import join_as_trainer_rank, spawn_and_report  # benchmarks/_common.py
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("lightning_clip", "ndclip", "ndclip_modules", "noclip", "nd_noclip", "ndclip_nofold")
DEFAULT_METHODS = METHODS[:4]
LABELS = {
    "lightning_clip": "(a) ModelParallel + gradient_clip_val",
    "ndclip": "(b) NDParallel + GlobalNormClip",
    "ndclip_modules": "(c) (b) + log_module_depth",
    "noclip": "(d) ModelParallel, no clipping",
    "nd_noclip": "(e) NDParallel, no clipping",
    "ndclip_nofold": "(f) (b) with fold_into_optimizer=False",
}
WIDTH, HEADS, HIDDEN, SEQ, IN_DIM, OUT_DIM = 64, 4, 256, 16, 32, 8
TENSORS_PER_BLOCK = 16  # ln1 (2) + q, k, v, o (8) + ln2 (2) + fc1, fc2 (4)
EXTRA_TENSORS = 6  # embed (2) + final norm (2) + head (2)
BATCH_PER_DP_RANK = 4


class Block(nn.Module):
    """Pre-norm transformer-ish block: causal attention (q, k, v, o) and an MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


# the MLP only: 2 TP all-reduces per block and step (attention too would triple them; on 2 cores the
# step is latency-bound). Attention, layer norms, embed and head stay on the dp mesh: two meshes.
TP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class StepModel(L.LightningModule):
    """``embed -> blocks -> norm -> head`` with an MSE loss. Top-level children ``embed``, ``blocks``,
    ``norm``, ``head``, so ``log_module_depth=1`` logs 4 module norms and ``2`` one per block.

    FSDP2 layout (identical for every method): ``fsdp_units`` units of consecutive blocks (``0``: one
    per block), and the LightningModule itself as the root unit (embed, norm, head); with ``tp > 1``
    every block's MLP is Colwise/Rowwise parallel first (``TP_PLAN``)."""

    def __init__(self, layers: int, n_samples: int, optimizer: str = "sgd", fsdp_units: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(IN_DIM, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, OUT_DIM)
        self.n_samples = n_samples
        self.optimizer = optimizer
        self.fsdp_units = fsdp_units

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, NDParallelStrategy):
            tp_mesh, dp_mesh = strategy.meshes["tp"], strategy.meshes["fsdp"]
        else:
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            for block in self.blocks:
                parallelize_module(block, tp_mesh, TP_PLAN)
        blocks = list(self.blocks)
        per_unit = 1 if self.fsdp_units == 0 else -(-len(blocks) // self.fsdp_units)
        for i in range(0, len(blocks), per_unit):  # one unit of consecutive blocks (FSDP2 takes a list)
            group = blocks[i:i + per_unit]
            fully_shard(group if len(group) > 1 else group[0], mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        # for-loop implementations (PyTorch's CPU default): one DTensor op per parameter and update
        # op (AdamW: ~11, SGD: 1); foreach=True would pay DTensor's O(N^2) first-call propagation
        if self.optimizer == "adamw":
            return TimedAdamW(self.parameters(), lr=1e-3)
        if self.optimizer == "adamw_fused":  # one kernel for all tensors; GlobalNormClip folds the clip into it
            return TimedAdamW(self.parameters(), lr=1e-3, fused=True)
        return TimedSGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n_samples, SEQ, IN_DIM, generator=g)
        y = torch.randn(self.n_samples, SEQ, OUT_DIM, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH_PER_DP_RANK)


class _ClipEnd:
    """An optimizer whose ``step(closure)`` notes when the closure returns: Lightning's closure runs
    forward, backward, the ``on_before_optimizer_step`` hooks (GlobalNormClip) and then its own
    clipping; the update that follows is the parent class's, unchanged."""

    clip_end = 0.0

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clip_end = time.perf_counter()
        super().step()
        return loss


class TimedSGD(_ClipEnd, torch.optim.SGD):
    pass


class TimedAdamW(_ClipEnd, torch.optim.AdamW):
    pass


class NullLogger(Logger):
    """A logger that drops everything: Lightning still gathers and converts the logged values (the
    cost a real logger adds on top depends on the logger), and GlobalNormClip logs only with a logger."""

    @property
    def name(self) -> str:
        return "null"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class StepTimer(Callback):
    """Per-rank wall time of each training step: from a barrier at ``on_train_batch_start`` to the
    next ``on_train_batch_start`` (before its barrier), so the logger work Lightning does after
    ``on_train_batch_end`` is included. Steps before ``warmup`` are not timed (except the first, kept
    as ``first_s``); Python's GC is off during the timed steps.

    Also the clipping segment: from ``on_before_optimizer_step`` (this callback comes first, before
    GlobalNormClip's hook) to the end of the optimizer's closure, just before the update
    (``_ClipEnd``), which covers GlobalNormClip's hook or Lightning's ``gradient_clip_val``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0: float | None = None
        self.times: list[float] = []
        self.clip_times: list[float] = []
        self.first_s = 0.0
        self.clip_start = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.clip_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.clip_times.append(trainer.optimizers[0].clip_end - self.clip_start)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.t0 is not None:
            if batch_idx - 1 >= self.warmup:
                self.times.append(now - self.t0)
            elif batch_idx == 1:
                self.first_s = now - self.t0
        if batch_idx == self.warmup:
            gc.collect()
            gc.disable()
        dist.barrier()
        self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        gc.enable()

    def on_exception(self, trainer, pl_module, exception) -> None:
        gc.enable()


def make_trainer(method: str, layout: str, args, timer: StepTimer) -> L.Trainer:
    world = args.world_size
    tp = 2 if layout == "fsdp_tp" else 1
    callbacks: list[Callback] = [timer]
    kwargs = {}
    if method in ("lightning_clip", "noclip"):
        strategy = ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp)
        if method == "lightning_clip":
            kwargs["gradient_clip_val"] = 1.0
    else:
        strategy = NDParallelStrategy(dp_shard=world // tp, tp=tp)
        if method != "nd_noclip":
            depth = args.log_module_depth if method == "ndclip_modules" else None
            fold = False if method == "ndclip_nofold" else None
            callbacks.append(GlobalNormClip(1.0, log_module_depth=depth, fold_into_optimizer=fold))
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, callbacks=callbacks, logger=NullLogger(),
        log_every_n_steps=1, max_steps=args.warmup + args.steps + 1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )


def run_case(method: str, layout: str, layers: int, args) -> tuple[dict, torch.Tensor | None]:
    """One fit: this rank's step times (or the error raised) and the final parameters, gathered."""
    tp = 2 if layout == "fsdp_tp" else 1
    n_samples = (args.warmup + args.steps + 2) * BATCH_PER_DP_RANK * (args.world_size // tp)
    module = StepModel(layers, n_samples, args.optimizer, args.fsdp_units)
    timer = StepTimer(args.warmup)
    trainer = make_trainer(method, layout, args, timer)
    t0 = time.perf_counter()
    err = None
    try:
        trainer.fit(module)
    except Exception as e:  # noqa: BLE001 - recording what a method does
        err = f"raises {type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
    fit_s = time.perf_counter() - t0
    params = list(module.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    out = {"n_tensors": len(params), "local_mb": sum(t.numel() for t in local) * 4 / 2**20, "fit_s": fit_s,
           "first_s": timer.first_s}
    final = None
    if err is None:
        out.update(ms=1e3 * statistics.median(timer.times), steps=len(timer.times),
                   p90_ms=1e3 * sorted(timer.times)[int(0.9 * (len(timer.times) - 1))],
                   clip_steps_ms=[1e3 * t for t in timer.clip_times[:len(timer.times)]])
        if "grad_norm/total" in trainer.callback_metrics:  # pre-clip norm of the last step (GlobalNormClip)
            out["last_norm"] = float(trainer.callback_metrics["grad_norm/total"])
        # same seed, data and optimizer: (a) and (b) must end equal up to rounding (collective on every rank)
        final = torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in params])
    else:
        out["error"] = err
    del trainer, module, params, local
    gc.collect()
    return out, final


def reduce_ranks(per_rank: list[dict]) -> dict:
    """Max over ranks of the per-rank medians; the first error if any rank raised."""
    errors = [r["error"] for r in per_rank if "error" in r]
    cell = {k: max(r[k] for r in per_rank) for k in ("local_mb", "fit_s", "first_s")}
    cell["n_tensors"] = per_rank[0]["n_tensors"]
    if errors:
        cell["error"] = errors[0]
        cell["ranks_raising"] = len(errors)
    else:
        cell.update(ms=max(r["ms"] for r in per_rank), p90_ms=max(r["p90_ms"] for r in per_rank),
                    ms_per_rank=[r["ms"] for r in per_rank], steps=per_rank[0]["steps"])
        # clipping segment: per step the least any rank spent (the rank that arrived last at the
        # all-reduce did not wait for the others), then the median over steps; and, as for the step,
        # the max over ranks of the per-rank medians (includes waiting for slower ranks)
        per_step = list(zip(*(r["clip_steps_ms"] for r in per_rank)))
        cell.update(clip_ms=statistics.median(min(s) for s in per_step),
                    clip_ms_max_rank=max(statistics.median(r["clip_steps_ms"]) for r in per_rank))
        if "last_norm" in per_rank[0]:
            cell["last_norm"] = per_rank[0]["last_norm"]
    return cell


def worker(rank: int, args, port: int, out_json: str) -> None:
    join_as_trainer_rank(rank, args.world_size, port, "bench_step", pin=args.pin)
    rows = []
    for layout in args.layouts:
        for layers in args.layers:
            row = {"layout": layout, "layers": layers}
            finals = {}
            for method in args.methods if layout == "fsdp" else args.tp_methods:
                mine, finals[method] = run_case(method, layout, layers, args)
                gathered: list = [None] * args.world_size
                dist.all_gather_object(gathered, mine)
                row[method] = reduce_ranks(gathered)
                row["n_tensors"] = row[method]["n_tensors"]
                if rank == 0:
                    c = row[method]
                    print(f"{layout:8s} layers={layers:3d} N={c['n_tensors']:5d} {method:15s} "
                          + (f"step {c['ms']:.1f} ms, clip {c['clip_ms']:.2f} ms" if "ms" in c else c["error"][:80])
                          + f"  (fit {c['fit_s']:.1f} s)",
                          flush=True)
            row["max_param_diff"] = {  # max |difference| of the final parameters (same on every rank)
                f"{x}_vs_{y}": float((finals[x] - finals[y]).abs().max())
                for x, y in (("ndclip", "lightning_clip"), ("ndclip", "noclip"), ("ndclip_modules", "ndclip"),
                             ("lightning_clip", "noclip"), ("nd_noclip", "noclip"))
                if finals.get(x) is not None and finals.get(y) is not None}
            rows.append(row)
    if rank == 0:
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "args": vars(args), "rows": rows},
                                             indent=1))
    dist.barrier()
    dist.destroy_process_group()


def short_error(error: str) -> str:
    """The error's type and message up to its first detail (the full text is a footnote)."""
    return error.split(", but got")[0].split(" (")[0].replace("|", "\\|")


def fmt(cell: dict | None, notes: list[str] | None = None) -> str:
    if cell is None:
        return "-"
    if "ms" in cell:
        return f"{cell['ms']:.1f}"
    if notes is None:
        return short_error(cell["error"])
    if cell["error"] not in notes:
        notes.append(cell["error"])
    return f"{short_error(cell['error'])} [{notes.index(cell['error']) + 1}]"


def ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['ms'] / b['ms']:.2f}" if a and b and "ms" in a and "ms" in b else "-"


def clip(cell: dict | None) -> str:
    return f"{cell['clip_ms']:.1f}" if cell and "clip_ms" in cell else "-"


def clip_ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['clip_ms'] / b['clip_ms']:.2f}" if a and b and "clip_ms" in a and "clip_ms" in b else "-"


def write_markdown(data: dict, path: Path) -> None:
    a, world = data["args"], data["world_size"]
    extra = any("nd_noclip" in r for r in data["rows"])
    head = ("| layout | blocks | N grad tensors | local MB | step ms (a) lightning_clip | (b) ndclip | "
            "(c) ndclip_modules | (d) noclip | " + ("(e) nd_noclip | " if extra else "") +
            "step (b)/(a) | step (c)/(a) | step (b)/(d) | step (a)/(d) | " + ("step (b)/(e) | " if extra else "") +
            "clip ms (a) | clip ms (b) | "
            "clip ms (c) | clip (b)/(a) | clip (c)/(a) |")
    units = "one per block" if a["fsdp_units"] == 0 else f"{a['fsdp_units']} units of consecutive blocks"
    lines = [
        f"# Training-step time, {world} ranks (CPU, gloo, 1 thread per rank)", "",
        (f"Wall time per optimizer step of `Trainer.fit` ({a['optimizer']}, fp32, batch {BATCH_PER_DP_RANK} x "
         f"{SEQ} tokens per data-parallel rank): median over {a['steps']} steps after {a['warmup']} warm-up "
         "steps, per rank, then the max over ranks. Each step is timed from a barrier at "
         "`on_train_batch_start` to the next `on_train_batch_start` (so logging is included); every "
         "method has the same no-op logger and `log_every_n_steps=1`. **clip ms**: the clipping segment "
         "of the step, from `on_before_optimizer_step` to the parameter update (GlobalNormClip's hook, or "
         "Lightning's `gradient_clip_val`); per step the least any rank spent (the rank the all-reduce "
         "did not make wait), median over steps. Step times vary ~5-10 % from fit to fit on this "
         "machine; the clipping segment is the low-noise measure. See README.md."), "",
        ("* (a) `ModelParallelStrategy` + `Trainer(gradient_clip_val=1.0)`: Lightning's clipping, "
         "`torch.nn.utils.clip_grad_norm_`"),
        ("* (b) `NDParallelStrategy` + `GlobalNormClip(1.0)`: also logs total / clipped / clip_coef / "
         "skipped_steps every step"),
        (f"* (c) (b) with `GlobalNormClip(1.0, log_module_depth={a['log_module_depth']})`: per-tensor norms in "
         "the same all-reduce, grouped per module and logged"),
        "* (d) `ModelParallelStrategy` without clipping: the step itself",
        *(["* (e) `NDParallelStrategy` without clipping: (b)/(e) is GlobalNormClip's whole cost in the step"]
          if extra else []),
        (f"* one model and FSDP2 layout for all methods: {HEADS}-head attention + MLP blocks (width {WIDTH}, "
         f"{TENSORS_PER_BLOCK} gradient tensors each), FSDP2 {units} + the root; `fsdp`: dp_shard={world}; "
         f"`fsdp_tp`: dp_shard={world // 2} x tp=2, every block's MLP Colwise/Rowwise parallel, the rest "
         "on the dp mesh only (parameters on two meshes)"),
        "* ratios < 1: faster than the denominator", "",
        head, "|" + "---|" * (head.count("|") - 1)]
    notes: list[str] = []
    for r in data["rows"]:
        c = {m: r.get(m) for m in METHODS}
        local = max(x["local_mb"] for x in c.values() if x)
        lines.append(
            f"| {r['layout']} | {r['layers']} | {r['n_tensors']} | {local:.1f} | {fmt(c['lightning_clip'], notes)} | "
            f"{fmt(c['ndclip'], notes)} | {fmt(c['ndclip_modules'], notes)} | {fmt(c['noclip'], notes)} | "
            + (f"{fmt(c['nd_noclip'], notes)} | " if extra else "") +
            f"{ratio(c['ndclip'], c['lightning_clip'])} | {ratio(c['ndclip_modules'], c['lightning_clip'])} | "
            f"{ratio(c['ndclip'], c['noclip'])} | {ratio(c['lightning_clip'], c['noclip'])} | "
            + (f"{ratio(c['ndclip'], c['nd_noclip'])} | " if extra else "") +
            f"{clip(c['lightning_clip'])} | {clip(c['ndclip'])} | {clip(c['ndclip_modules'])} | "
            f"{clip_ratio(c['ndclip'], c['lightning_clip'])} | {clip_ratio(c['ndclip_modules'], c['lightning_clip'])} |")
    lines += [""] + [f"[{k + 1}] {n}" for k, n in enumerate(notes)] + [""]
    lines += [("Same result: max |difference| of the final parameters after all steps, and the last step's "
               "pre-clip global norm logged by (b) (> 1.0: clipping was active):"), ""]
    for r in data["rows"]:
        diffs = ", ".join(f"{k.replace('_vs_', ' vs ')} {v:.1e}" for k, v in r.get("max_param_diff", {}).items())
        norm = r.get("ndclip", {}).get("last_norm")
        lines.append(f"* {r['layout']} N={r['n_tensors']}: {diffs or '-'}; norm {norm:.3f}" if norm is not None
                     else f"* {r['layout']} N={r['n_tensors']}: {diffs or '-'}")
    lines += ["", ("First (untimed) step, s, max over ranks: one-time costs (FSDP2 lazy init; for (a), DTensor's "
                   "sharding propagation of `clip_grad_norm_`'s foreach ops over N DTensors; ndclip's plan)"
                   + (". With `fused=True` AdamW, DTensor's sharding propagation of the fused kernel over N "
                      "DTensors (3.8 s at N = 1000, one process, with or without `grad_scale`) falls on "
                      "whichever method runs first in the processes" if a["optimizer"] == "adamw_fused" else "")
                   + ":"), ""]
    for r in data["rows"]:
        firsts = ", ".join(f"{m} {r[m]['first_s']:.1f}" for m in METHODS if r.get(m) and "ms" in r[m])
        lines.append(f"* {r['layout']} N={r['n_tensors']}: {firsts}")
    if any(r.get("ndclip_nofold") for r in data["rows"]):
        lines += ["", "The fold on and off: (b) lets the fused optimizer apply the clip coefficient, (f) scales the "
                  "gradients itself first:", "", "| layout | N | step ms (b) | step ms (f) | clip ms (b) | clip ms (f) | "
                  "clip (f)/(b) |", "|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            b, f = r.get("ndclip"), r.get("ndclip_nofold")
            if b and f:
                lines.append(f"| {r['layout']} | {r['n_tensors']} | {fmt(b)} | {fmt(f)} | {clip(b)} | {clip(f)} | "
                             f"{clip_ratio(f, b)} |")
    lines.append("")
    path.write_text("\n".join(lines))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax, ax_c, ax_r) = plt.subplots(1, 3, figsize=(18, 5))
    styles = {"fsdp": "-", "fsdp_tp": "--"}
    for layout in dict.fromkeys(r["layout"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["layout"] == layout]
        for k, m in enumerate(METHODS):
            for axis, key in ((ax, "ms"), (ax_c, "clip_ms")):
                pts = [(r["n_tensors"], r[m][key]) for r in rows if r.get(m) and key in r[m]]
                if pts and not (key == "clip_ms" and m in ("noclip", "nd_noclip")):
                    axis.plot(*zip(*pts), styles[layout], marker="o", color=f"C{k}", label=f"{LABELS[m]} [{layout}]")
        for num, den, key, k in (("ndclip", "lightning_clip", "ms", 1), ("ndclip_modules", "lightning_clip", "ms", 2),
                                 ("ndclip", "noclip", "ms", 3), ("ndclip", "lightning_clip", "clip_ms", 4),
                                 ("ndclip_modules", "lightning_clip", "clip_ms", 5)):
             pts = [(r["n_tensors"], r[num][key] / r[den][key]) for r in rows
                    if r.get(num) and r.get(den) and key in r[num] and key in r[den]]
             if pts:
                 what = "step" if key == "ms" else "clip"
                 ax_r.plot(*zip(*pts), styles[layout], marker="o" if key == "ms" else "s", color=f"C{k}",
                           label=f"{what}: {num} / {den} [{layout}]")
    note = "\n(a) raises on fsdp_tp: not plotted" if any(
        r.get("lightning_clip") and "error" in r["lightning_clip"] for r in data["rows"]) else ""
    world = data["world_size"]
    ax.set(xscale="log", yscale="log", xlabel="gradient tensors", ylabel="ms per optimizer step",
           title=f"step time, {world} ranks (CPU, gloo){note}")
    ax_c.set(xscale="log", yscale="log", xlabel="gradient tensors", ylabel="ms per step",
             title=f"clipping segment (on_before_optimizer_step -> update){note}")
    for axis in (ax, ax_c):
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_r.axhline(1.0, color="k", lw=0.8)
    ax_r.set(xscale="log", xlabel="gradient tensors", ylabel="ratio", title="ratios (< 1: faster)")
    for a_ in (ax, ax_c, ax_r):
        a_.grid(True, which="both", alpha=0.3)
        a_.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--layers", type=int, nargs="+", default=[6, 20, 60],
                   help=f"blocks ({TENSORS_PER_BLOCK} gradient tensors each, + {EXTRA_TENSORS})")
    p.add_argument("--tp-methods", nargs="+", choices=METHODS, default=["lightning_clip", "ndclip", "noclip"],
                   help="methods on fsdp_tp (where lightning_clip raises)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per fit before the timed ones")
    p.add_argument("--layouts", nargs="+", choices=["fsdp", "fsdp_tp"], default=["fsdp", "fsdp_tp"])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    p.add_argument("--optimizer", choices=["sgd", "adamw", "adamw_fused"], default="sgd",
                   help="the same for every method (for-loop implementations: AdamW makes ~11 DTensor ops "
                        "per parameter and step, SGD one; adamw_fused: one fused kernel, into which "
                        "GlobalNormClip folds the clip)")
    p.add_argument("--fsdp-units", type=int, default=4,
                   help="fully_shard units the blocks are grouped into (consecutive blocks); 0: one per block")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r %% cores")
    p.add_argument("--log-module-depth", type=int, default=1, help="log_module_depth of (c)")
    p.add_argument("--tag", default="", help="results in step_<world>ranks[_<optimizer>]_<tag>.* (keeps the default tables)")
    args = p.parse_args()
    if "fsdp_tp" in args.layouts and args.world_size % 2:
        p.error("fsdp_tp needs an even --world-size")
    suffix = ("" if args.optimizer == "sgd" else f"_{args.optimizer}") + (f"_{args.tag}" if args.tag else "")
    spawn_and_report(worker, args, RESULTS / f"step_{args.world_size}ranks{suffix}", write_markdown, write_plot)


if __name__ == "__main__":
    main()
