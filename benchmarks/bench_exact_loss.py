"""Benchmark: what the exact global token mean costs in a training step (CPU, gloo).

``NDParallelStrategy(loss_normalization="token_mean")`` adds to a step: per accumulation window, the
LightningModule's ``count_tokens`` on each micro-batch of the next window and one all-reduce of its
counts, issued after this window's last forward and waited for before the next window's first one;
per micro-batch, its loss share (a few scalar ops); per window, one all-reduce of the window's loss
to log its exact mean (``log_loss``). This script times those four segments inside the steps of
one fit, by wrapping the strategy's methods that do them, so their share of the step is measured
on the same steps (a shared 2-core machine varies by 10-30 % from fit to fit); and it times the
whole step with and without ``loss_normalization``, fits interleaved A/B/A/B.

The model, data and timing are ``bench_step.py``'s (FSDP2 over 4 ranks, AdamW, no accumulation,
GlobalNormClip). Per step, a segment counts the least any rank spent in it (the time the others
spent waiting in its all-reduce would be spent waiting in the next collective anyway).

Run by hand::

    python benchmarks/bench_exact_loss.py          # 4 ranks, 4 blocks, 30 steps, 2 runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from _common import join_as_trainer_rank, spawn_and_report, time_method
from bench_step import BATCH_PER_DP_RANK, SEQ, NullLogger, StepModel, StepTimer

from lightning_ndclip import GlobalNormClip, NDParallelStrategy

RESULTS = Path(__file__).resolve().parent / "results"
SEGMENTS = {  # the strategy's (and its loss windows') methods that do the exact mean's work, and what they do
    "read_next_window": "counts issued: the next window read, its count_tokens, its count all-reduce issued",
    "_micro_batch_share": "counts waited: for the window's count all-reduce, issued during the step before",
    "_normalized": "share: the loss scaled to its share of the global mean",
    "_log_window_loss": "logged loss: the window loss's all-reduce and self.log",
}


class CountingStepModel(StepModel):
    def count_tokens(self, batch) -> int:  # every position is a token
        return batch[0].shape[0] * batch[0].shape[1]


class SegmentSteps(L.Callback):
    """A new slot per segment at every step start (after ``StepTimer``'s warm-up, as its times)."""

    def __init__(self, warmup: int, spent: dict[str, list[float]]) -> None:
        self.warmup, self.spent = warmup, spent

    def on_train_start(self, trainer, pl_module) -> None:
        windows = getattr(trainer.strategy, "_windows", None)  # the loss windows, made with the train dataloader
        if windows is not None:
            time_method(windows, "read_next_window", self.spent)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            for times in self.spent.values():
                times.append(0.0)


def run_fit(normalized: bool, args) -> dict:
    n_samples = (args.warmup + args.steps + 2) * BATCH_PER_DP_RANK * args.world_size
    module = CountingStepModel(args.layers, n_samples, "adamw", args.fsdp_units)
    strategy = NDParallelStrategy(dp_shard=args.world_size, loss_normalization="token_mean" if normalized else None)
    spent: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    if normalized:
        for name in SEGMENTS:
            if hasattr(strategy, name):
                time_method(strategy, name, spent)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.world_size, strategy=strategy, logger=NullLogger(), log_every_n_steps=1,
        callbacks=[timer, SegmentSteps(args.warmup, spent), GlobalNormClip(1.0)], max_steps=args.warmup + args.steps + 1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module)
    steps = len(timer.times)
    return {"step_ms": [1e3 * t for t in timer.times], **{k: [1e3 * t for t in v[:steps]] for k, v in spent.items()}}


def worker(rank: int, args, port: int, out_json: str) -> None:
    join_as_trainer_rank(rank, args.world_size, port, "bench_exact_loss")
    rows = []
    for run in range(args.runs):
        row: dict[str, Any] = {"run": run + 1}
        for normalized in (False, True):
            mine = run_fit(normalized, args)
            gathered: list = [None] * args.world_size
            dist.all_gather_object(gathered, mine)
            key = "token_mean" if normalized else "none"
            row[f"{key}_step_ms"] = max(statistics.median(r["step_ms"]) for r in gathered)
            if normalized:
                for name in SEGMENTS:  # per step the least any rank spent, then the median over steps
                    row[name] = statistics.median(min(per_rank) for per_rank in zip(*(r[name] for r in gathered)))
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def write_markdown(data: dict, path: Path) -> None:
    a, rows = data["args"], data["rows"]
    lines = [
        f"# The exact token mean's cost in a step, {data['world_size']} ranks (CPU, gloo, 1 thread per rank)",
        "",
        (
            f"`bench_step.py`'s model ({a['layers']} blocks, FSDP2 over {data['world_size']} ranks, AdamW, batch "
            f"{BATCH_PER_DP_RANK} x {SEQ} tokens per rank, no accumulation) with `GlobalNormClip(1.0)`; median over "
            f"{a['steps']} steps after {a['warmup']} warm-up steps. Segments: the least any rank spent per step, "
            "median over steps, timed inside the `token_mean` fit; steps: the max over ranks of the per-rank "
            "medians, fits interleaved."
        ),
        "",
        *(f"* **{name.strip('_').replace('_', ' ')}**: {what}" for name, what in SEGMENTS.items()),
        "",
        "| run | step ms, `None` | step ms, `token_mean` | counts issued ms | counts waited ms | share ms | "
        "logged loss ms | all four ms | all four / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = sum(r[name] for name in SEGMENTS)
        lines.append(
            f"| {r['run']} | {r['none_step_ms']:.1f} | {r['token_mean_step_ms']:.1f} | "
            + " | ".join(f"{r[name]:.2f}" for name in SEGMENTS)
            + f" | {total:.2f} | {100 * total / r['token_mean_step_ms']:.1f} % |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(rows)
    labels = [f"run {r['run']}" for r in rows]
    for name in SEGMENTS:
        values = [r[name] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=name.strip("_").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step")
    ax.set_title("exact token mean: its segments of a step")
    for i, r in enumerate(rows):
        ax.annotate(f"step {r['token_mean_step_ms']:.0f} ms", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
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
    spawn_and_report(worker, args, RESULTS / f"exact_loss_{args.world_size}ranks", write_markdown, write_plot)


if __name__ == "__main__":
    main()
