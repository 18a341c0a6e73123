"""Benchmark: per-rank memory and wall time of context-parallel attention, ring vs all-gather (CPU, gloo).

``context_parallel_attention(..., kv_exchange="ring" | "all_gather")``: causal, load-balanced, batch 1,
fp32, one forward + backward on ``--world-size`` cp ranks, for growing sequence lengths S.

How memory is measured: every (S, method) case runs in freshly spawned ranks. Each rank builds its
local q, k, v and output gradient, runs the attention once at a tiny length (the first gloo
transfers and kernels), and then reads its peak resident set size (``resource.getrusage(RUSAGE_SELF)
.ru_maxrss``, a high-water mark) right before the measured call; the peak after the call minus that
baseline is the memory the call (forward, backward, everything they allocate and free) needed on
top of its inputs. Reported: the max over ranks. Fresh processes make the baseline the process's
high-water mark just before the call, so nothing left over from an earlier, larger case hides the
call's own peak. An all-gather case whose estimate (below) exceeds ``--budget-gib`` per rank is
not run.

Run by hand (see README.md)::

    python benchmarks/bench_cp_memory.py                  # 4 ranks, S = 4k .. 64k
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import spawn_and_report  # benchmarks/_common.py

from lightning_ndclip.core.context.attention import context_parallel_attention, shard_sequence

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("ring", "all_gather")
MASK_BYTES_PER_PAIR = 5
"""All-gather estimate, per (local query, key) pair: the ``[S/cp, S]`` boolean mask (1 byte) and the
additive float32 mask SDPA makes of it (4 bytes); PyTorch's CPU kernel tiles the scores themselves.
Fits the measured cases (see the table's estimate column)."""


def all_gather_estimate_gib(seq_len: int, args) -> float:
    local = seq_len // args.world_size
    gathered_kv = 4 * args.heads * seq_len * args.head_dim * 4  # k, v and their gradients, whole sequence
    return (MASK_BYTES_PER_PAIR * local * seq_len + gathered_kv) / 2**30


def attend(method: str, seq_len: int, args, rank: int) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Inputs of this rank's shard and the call (forward + backward) on them."""
    g = torch.Generator().manual_seed(rank)
    positions = shard_sequence(torch.empty(seq_len), rank, args.world_size, dim=0, load_balance=True)[1]
    shape = (1, args.heads, positions.numel(), args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=g)

    def call() -> None:
        out = context_parallel_attention(q, k, v, group=dist.group.WORLD, positions=positions, is_causal=True,
                                         kv_exchange=method)
        out.backward(dout)

    return [q, k, v, dout, positions], call


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(method: str, seq_len: int, args, rank: int) -> dict:
    attend(method, 16 * args.world_size, args, rank)[1]()  # the first transfers, at a tiny length
    _, call = attend(method, seq_len, args, rank)
    dist.barrier()
    baseline = peak_mb()
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    return {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "s": seconds}


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    row = {"method": args.method, "seq_len": args.seq_len, "local": args.seq_len // args.world_size}
    if args.method == "all_gather":
        row["est_gib"] = all_gather_estimate_gib(args.seq_len, args)
    if row.get("est_gib", 0.0) > args.budget_gib:
        row["skipped"] = True
    else:
        mine = measure(args.method, args.seq_len, args, rank)
        gathered: list = [None] * args.world_size
        dist.all_gather_object(gathered, mine)
        row.update({key: max(r[key] for r in gathered) for key in mine}, per_rank=gathered)
    if rank == 0:
        print(f"S={args.seq_len:6d} {args.method:10s} " + ("skipped" if "skipped" in row else
              f"peak +{row['peak_mb']:.0f} MB, {row['s']:.1f} s"), flush=True)
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))
    dist.destroy_process_group()


def cell(row: dict | None) -> tuple[str, str]:
    if row is None:
        return "-", "-"
    if row.get("skipped"):
        return f"skipped (est. {row['est_gib']:.1f} GiB)", "-"
    return f"{row['peak_mb']:.0f}", f"{row['s']:.2f}"


def write_markdown(data: dict, path: Path) -> None:
    a = argparse.Namespace(**data["args"])
    rows = {(r["seq_len"], r["method"]): r for r in data["rows"]}
    lines = [f"# Context-parallel attention memory, {data['world_size']} ranks (CPU, gloo, 1 thread per rank)", "",
             f"Causal, load-balanced; batch 1, {a.heads} heads, head_dim {a.head_dim}, float32; one forward + "
             f"backward. **peak MB**: growth of the rank's peak RSS during the call over its peak just before "
             f"(inputs excluded), max over ranks; fresh ranks per case. **s**: wall time of that call, max over "
             f"ranks (one call: 4 ranks share 2 cores). Ring: key tiles of 1024. All-gather cases estimated above "
             f"{a.budget_gib:g} GiB per rank are not run. See README.md.", "",
             "| S | tokens per rank | ring peak MB | ring s | all_gather peak MB | all_gather s | all_gather est. MB "
             "| all_gather / ring memory |",
             "|---|---|---|---|---|---|---|---|"]
    for s in sorted({r["seq_len"] for r in data["rows"]}):
        ring, gather = rows.get((s, "ring")), rows.get((s, "all_gather"))
        ratio = (f"{gather['peak_mb'] / ring['peak_mb']:.1f}" if ring and gather and "peak_mb" in ring
                 and "peak_mb" in gather else "-")
        est = f"{gather['est_gib'] * 1024:.0f}" if gather else "-"
        lines.append(f"| {s} | {s // data['world_size']} | {' | '.join(cell(ring))} | {' | '.join(cell(gather))} | "
                     f"{est} | {ratio} |")
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, wall) = plt.subplots(1, 2, figsize=(11, 4.5))
    for method in METHODS:
        pts = sorted((r["seq_len"], r["peak_mb"], r["s"]) for r in data["rows"] if r["method"] == method and "peak_mb" in r)
        if pts:
            s, mb, sec = zip(*pts)
            mem.plot(s, mb, marker="o", label=method)
            wall.plot(s, sec, marker="o", label=method)
    est = sorted((r["seq_len"], r["est_gib"] * 1024) for r in data["rows"] if "est_gib" in r)
    if est:
        mem.plot(*zip(*est), "k:", label="all_gather estimate")
    mem.set(ylabel="peak MB per rank (call, over its inputs)")
    wall.set(ylabel="s per forward + backward")
    for ax in (mem, wall):
        ax.set(xscale="log", yscale="log", xlabel="sequence length S",
               title=f"causal cp attention, {data['world_size']} ranks")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536], help="sequence lengths")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--budget-gib", type=float, default=4.0, help="skip all_gather cases estimated above this, per rank")
    args = p.parse_args()
    cases = [{"seq_len": s, "method": m} for s in args.sizes for m in args.methods]
    spawn_and_report(worker, args, RESULTS / f"cp_memory_{args.world_size}ranks", write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
