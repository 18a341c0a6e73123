"""Benchmark: what ``find_unused_parameters=True``, and the check that runs without it, cost in a training step (CPU, gloo).

``NDParallelStrategy(find_unused_parameters=True)`` adds to a step (``core/parallel/unused.py``): per
FSDP2 unit forward, one host-side all-gather of an int (``UnusedParameters._agree``, from the unit's
forward pre-hook) and one more when the forward ends; per backward, a walk of the loss's autograd
graph and one all-reduce of a uint8 flag per parameter and unit (``prepare_backward``); and FSDP2
reduces the gradients at every micro-batch instead of once per accumulation window. This script
times the whole optimizer step with the option off and on, fits interleaved A/B/A/B (a shared 2-core
machine varies by 10-30 % from fit to fit), with ``accumulate_grad_batches`` 1 and 2 (2 adds the
reduction of every micro-batch); and inside the "on" fit, the time spent in ``_agree`` and in
``prepare_backward``, by wrapping those methods of the strategy's ``UnusedParameters`` once set up. Without
the option the strategy runs ``UnusedParametersCheck`` (a graph walk per backward, one host-side
all-gather of a byte per parameter per window): its ``prepare_backward`` is timed inside the "off" fit.

The model, data and timing are ``bench_step.py``'s (FSDP2 over 4 ranks, AdamW, GlobalNormClip);
every rank runs every unit, so no zero gradient is added: the option's overhead alone. A step is an
optimizer step (its micro-batches' times summed). Per step, a segment counts the least any rank
spent in it (the time the others spent waiting in its collective would be spent waiting in the next
one anyway).

Run by hand::

    python benchmarks/bench_unused.py          # 4 ranks, 4 blocks, 30 steps, 2 runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from _common import join_as_trainer_rank, spawn_and_report, time_method
from bench_step import BATCH_PER_DP_RANK, SEQ, NullLogger, StepModel, StepTimer

from lightning_ndclip import GlobalNormClip, NDParallelStrategy

RESULTS = Path(__file__).resolve().parent / "results"
SEGMENTS = {  # the UnusedParameters methods timed inside the "on" fit, and what they do
    "_agree": "checks: one int all-gather per FSDP2 unit forward and one at the forward's end",
    "prepare_backward": "prepare backward: the autograd graph walk and the flags' all-reduce",
}
CHECK = "check"  # the off fit's segment: UnusedParametersCheck.prepare_backward
ACCUMULATE = (1, 2)


class UnusedSegments(L.Callback):
    """Wraps the strategy's ``UnusedParameters`` (or, off, its ``UnusedParametersCheck``) once set up, and opens a
    new slot per segment at every micro-batch start from ``warmup`` on (as ``StepTimer``'s times)."""

    def __init__(self, warmup: int, spent: dict[str, list[float]]) -> None:
        self.warmup, self.spent = warmup, spent
        self.units = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        unused = trainer.strategy._unused
        self.units = len(unused.units)
        for name in self.spent:
            time_method(unused, name, self.spent)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            for times in self.spent.values():
                times.append(0.0)


def _per_step(times: list[float], k: int) -> list[float]:
    """Micro-batch times summed per optimizer step (whole windows of ``k`` only), in ms."""
    return [1e3 * sum(times[i : i + k]) for i in range(0, len(times) - k + 1, k)]


def run_fit(on: bool, k: int, args: argparse.Namespace) -> dict:
    n_samples = (args.warmup + args.steps + 2) * k * BATCH_PER_DP_RANK * args.world_size
    module = StepModel(args.layers, n_samples, "adamw", args.fsdp_units)
    strategy = NDParallelStrategy(dp_shard=args.world_size, find_unused_parameters=on)
    timer = StepTimer(args.warmup * k)  # micro-batches: the timed ones start a window
    spent: dict[str, list[float]] = {name: [] for name in (SEGMENTS if on else ("prepare_backward",))}
    segments = UnusedSegments(args.warmup * k, spent)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.world_size, strategy=strategy, logger=NullLogger(), log_every_n_steps=1,
        callbacks=[timer, GlobalNormClip(1.0), segments], accumulate_grad_batches=k,
        max_steps=args.warmup + args.steps + 1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module)
    steps = _per_step(timer.times, k)
    times = {n if on else CHECK: _per_step(t, k)[: len(steps)] for n, t in spent.items()}
    return {"step_ms": steps, "units": segments.units, **times}


def worker(rank: int, args: argparse.Namespace, port: int, out_json: str) -> None:
    cores = join_as_trainer_rank(rank, args.world_size, port, "bench_unused")
    rows = []
    for run in range(args.runs):
        for k in ACCUMULATE:
            row: dict[str, Any] = {"run": run + 1, "accumulate": k}
            for on in (False, True):
                mine = run_fit(on, k, args)
                gathered: list = [None] * args.world_size
                dist.all_gather_object(gathered, mine)
                row[f"{'on' if on else 'off'}_step_ms"] = max(statistics.median(r["step_ms"]) for r in gathered)
                row["units"] = mine["units"]
                for name in SEGMENTS if on else (CHECK,):  # per step the least any rank spent, then the median
                    row[name] = statistics.median(min(per_rank) for per_rank in zip(*(r[name] for r in gathered)))
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
    if rank == 0:
        data = {"world_size": args.world_size, "cores": len(cores) or os.cpu_count(), "rows": rows}
        Path(out_json).write_text(json.dumps(data, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def write_markdown(data: dict, path: Path) -> None:
    a, rows = data["args"], data["rows"]
    lines = [
        f"# `find_unused_parameters`' cost in a step, {data['world_size']} ranks (CPU, gloo, 1 thread per rank)",
        "",
        (
            f"`bench_step.py`'s model ({a['layers']} blocks in {rows[0]['units']} FSDP2 units with the root, over "
            f"{data['world_size']} gloo ranks on a {data['cores']}-core CPU, 1 thread per rank; AdamW, batch "
            f"{BATCH_PER_DP_RANK} x {SEQ} tokens per rank and micro-batch) with `GlobalNormClip(1.0)`; every rank runs "
            f"every unit. k: `accumulate_grad_batches`; a step is an optimizer step (k micro-batches). Median over "
            f"{a['steps']} steps after {a['warmup']} warm-up steps. Steps: the max over ranks of the per-rank medians, "
            "fits interleaved off/on; segments: the least any rank spent per step, median over steps, timed inside the "
            "`find_unused_parameters=True` fit (the check: inside the off fit)."
        ),
        "",
        *(f"* **`UnusedParameters.{name}`**: {what}" for name, what in SEGMENTS.items()),
        "* **check (off)**: `UnusedParametersCheck.prepare_backward`, the graph walk per backward and one all-gather of "
        "the flags per window, what runs without the option",
        "",
        "| run | k | step ms, off | check ms (off) | check / step | step ms, on | on / off | checks ms | "
        "prepare backward ms | both / step (on) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        both = sum(r[name] for name in SEGMENTS)
        lines.append(
            f"| {r['run']} | {r['accumulate']} | {r['off_step_ms']:.1f} | {r[CHECK]:.2f} | "
            f"{100 * r[CHECK] / r['off_step_ms']:.1f} % | {r['on_step_ms']:.1f} | "
            f"{r['on_step_ms'] / r['off_step_ms']:.2f} | "
            + " | ".join(f"{r[name]:.2f}" for name in SEGMENTS)
            + f" | {100 * both / r['on_step_ms']:.1f} % |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["off_step_ms"] for r in rows], 0.4, label="off: step")
    ax.bar([x - 0.2 for x in xs], [r[CHECK] for r in rows], 0.4, label="off: in the check")
    ax.bar([x + 0.2 for x in xs], [r["on_step_ms"] for r in rows], 0.4, label="on: step")
    bottom = [0.0] * len(rows)
    for name in SEGMENTS:  # the on fit's segments, inside its bar
        values = [r[name] for r in rows]
        ax.bar([x + 0.2 for x in xs], values, 0.4, bottom=bottom, label=f"on: in {name}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(xs), [f"run {r['run']}, k={r['accumulate']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per optimizer step")
    ax.set_title("find_unused_parameters off / on")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fsdp-units", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    spawn_and_report(worker, args, RESULTS / f"unused_{args.world_size}ranks", write_markdown, write_plot)


if __name__ == "__main__":
    main()
