"""Benchmark: per-rank memory of the LM head and its cross-entropy, gathered logits vs loss parallel (CPU, gloo).

One forward + backward of ``head(hidden)`` and its token-mean cross-entropy on ``--tp`` tensor-parallel ranks, at a
large vocabulary (``--vocab``, default Qwen2.5's 151,936) and sequence lengths S (batch 1, float32):

* ``gathered``: what ``tp_plan="auto"`` gives a ``transformers`` LM head without loss parallel,
  ``ColwiseParallel(output_layouts=Replicate())``, then the loss as ``transformers``' ``ForCausalLMLoss`` computes
  it: ``cross_entropy(logits.float(), labels, reduction="sum") / N``. Every tp rank holds the whole ``[S, vocab]``.
* ``loss_parallel``: ``vocab_parallel_head()`` (``Shard(-1)`` DTensor logits, ``[S, vocab / tp]`` per rank) and
  ``vocab_parallel_cross_entropy(logits, labels, reduction="sum") / N``.

How memory is measured: every (tp, S, method) case runs in freshly spawned ranks. After a warm-up call at a tiny
length, the measured call runs under ``torch.profiler.profile(profile_memory=True)``, whose CPU allocator reports
each allocation and free with the running total of what was allocated since profiling began and is still live
("Total Allocated" of the trace's ``[memory]`` events). **peak MB** is that total's maximum over the call: every
tensor the forward and backward allocated (logits, gathered copies, softmax, gradients, the weight gradient),
counted while alive, none of the inputs (hidden states, labels, weights) that existed before. It is the
allocator's own count, not RSS: no allocator caching or page effects; gloo's internal buffers are not in it.
Reported: the max over ranks. Gathered cases whose estimate (3 ``[S, vocab]`` float32 tensors per rank, summed over
ranks) exceeds ``--budget-gib`` are not run.

Run by hand (see README.md)::

    python benchmarks/bench_loss_parallel.py     # tp = 2 and 4, S = 1k .. 4k, ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.profiler import ProfilerActivity, profile

from lightning_ndclip.core.parallel.loss_parallel import vocab_parallel_cross_entropy, vocab_parallel_head
from lightning_ndclip.core.parallel.tensor_parallel import tensor_parallelize

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("gathered", "loss_parallel")
GATHERED_COPIES = 3
"""Estimate of the gathered method's peak, in ``[S, vocab]`` float32 tensors per rank: the gathered logits, their
log-softmax (saved for backward) and its gradient. Checked against the measured cases in the table."""


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seq_len: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(seq_len, args.hidden, generator=g).requires_grad_()
    labels = torch.randint(0, args.vocab, (seq_len,), generator=g)
    labels[torch.rand(seq_len, generator=g) < 0.1] = -100
    return hidden, labels


def _call(model: nn.Module, method: str, hidden: torch.Tensor, labels: torch.Tensor) -> float:
    """Forward and backward of the head and the token-mean loss; the loss's value."""
    count = (labels != -100).sum()
    logits = model(hidden)
    if method == "gathered":
        loss = nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / count
    else:
        loss = vocab_parallel_cross_entropy(logits, labels, reduction="sum") / count
    del logits  # as a training step does: backward runs after the step returned its loss
    loss.backward()
    return float(loss)


def _peak_bytes(trace: Path) -> int:
    """The largest "Total Allocated" of the trace's memory events over the total before the first of them (the least
    total minus that event's bytes: the trace lists events out of order, and the total counts only blocks allocated
    while profiling, so it never falls below where it started)."""
    events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    start = min(e["Total Allocated"] - e["Bytes"] for e in events)
    return max(e["Total Allocated"] for e in events) - start


def worker(rank: int, args, port: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    mesh = init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Head(args.hidden, args.vocab)
    style = ColwiseParallel(output_layouts=Replicate()) if args.method == "gathered" else vocab_parallel_head()
    tensor_parallelize(model, mesh, {"head": style})
    _call(model, args.method, *_inputs(16, args))  # the first transfers and kernels, at a tiny length
    model.zero_grad(set_to_none=True)
    hidden, labels = _inputs(args.seq_len, args)
    gc.collect()
    dist.barrier()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = _call(model, args.method, hidden, labels)
        seconds = time.perf_counter() - t0
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        peak = _peak_bytes(trace)
    rows: list = [None] * args.tp
    dist.all_gather_object(rows, {"peak_bytes": peak, "s": seconds, "loss": loss})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def gathered_estimate_gib(seq_len: int, args) -> float:
    return GATHERED_COPIES * seq_len * args.vocab * 4 / 2**30


def run_case(args, tp: int, seq_len: int, method: str) -> dict:
    row = {
        "tp": tp,
        "seq_len": seq_len,
        "method": method,
        "logits_mb": seq_len * args.vocab * 4 / (1 if method == "gathered" else tp) / 2**20,
    }
    if method == "gathered":
        row["est_mb"] = gathered_estimate_gib(seq_len, args) * 1024
        if tp * gathered_estimate_gib(seq_len, args) > args.budget_gib:
            return {**row, "skipped": f"est. {tp * gathered_estimate_gib(seq_len, args):.1f} GiB over {tp} ranks"}
    case = argparse.Namespace(**{**vars(args), "tp": tp, "seq_len": seq_len, "method": method})
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(worker, args=(case, _free_port(), out), nprocs=tp, join=True)
        ranks = json.loads(Path(out).read_text())
    print(
        f"tp={tp} S={seq_len} {method}: {[round(r['peak_bytes'] / 2**20) for r in ranks]} MB, {max(r['s'] for r in ranks):.1f} s"
    )
    peak = max(r["peak_bytes"] for r in ranks) / 2**20
    return {**row, "peak_mb": peak, "s": max(r["s"] for r in ranks), "loss": ranks[0]["loss"], "ranks": ranks}


def _cells(row: dict | None) -> tuple[str, str, str]:
    """A method's logits MB, peak MB and seconds, as table cells."""
    if row is None:
        return "-", "-", "-"
    if "peak_mb" not in row:
        return f"{row['logits_mb']:.0f}", f"skipped ({row['skipped']})", "-"
    return f"{row['logits_mb']:.0f}", f"{row['peak_mb']:.0f}", f"{row['s']:.1f}"


def write_markdown(data: dict, path: Path) -> None:
    a = argparse.Namespace(**data["args"])
    rows = {(r["tp"], r["seq_len"], r["method"]): r for r in data["rows"]}
    lines = [
        "# Loss parallel: LM head + cross-entropy memory per rank (CPU, gloo, 1 thread per rank)",
        "",
        f"vocab {a.vocab:,}, hidden {a.hidden}, batch 1, float32, ~10% of labels -100; one forward + backward of the "
        "head and the token-mean loss. **peak MB**: the most memory the call's own tensors held at once (the CPU "
        "allocator's live total under `torch.profiler(profile_memory=True)`, inputs and weights excluded, the "
        "weight gradient included), max over ranks; fresh ranks per case. **logits MB**: the logits tensor one "
        "rank holds. **est. MB**: 3 whole `[S, vocab]` float32 tensors (gathered logits, log-softmax, its gradient). "
        "**s**: wall time of the call, max over ranks (the ranks share 2 cores). **loss**: both methods' value. "
        f"Gathered cases estimated above {a.budget_gib:g} GiB over all ranks are not run. See README.md.",
        "",
        "| tp | S | logits MB gathered | logits MB loss parallel | peak MB gathered | est. MB gathered "
        "| peak MB loss parallel | gathered / loss parallel | s gathered | s loss parallel | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp, s in sorted({(r["tp"], r["seq_len"]) for r in data["rows"]}):
        gathered, lp = rows.get((tp, s, "gathered")), rows.get((tp, s, "loss_parallel"))
        (g_logits, g_peak, g_s), (l_logits, l_peak, l_s) = _cells(gathered), _cells(lp)
        measured = gathered is not None and lp is not None and "peak_mb" in gathered and "peak_mb" in lp
        ratio = f"{gathered['peak_mb'] / lp['peak_mb']:.1f}" if measured else "-"  # type: ignore[index]
        est = f"{gathered['est_mb']:.0f}" if gathered else "-"
        losses = " / ".join(sorted({f"{r['loss']:.6f}" for r in (gathered, lp) if r and "loss" in r}))
        lines.append(
            f"| {tp} | {s} | {g_logits} | {l_logits} | {g_peak} | {est} | {l_peak} | {ratio} | {g_s} | {l_s} | {losses} |"
        )
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tp, color in zip(sorted({r["tp"] for r in data["rows"]}), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for method, style in zip(METHODS, ("s", "o-")):
            rows = [r for r in data["rows"] if r["tp"] == tp and r["method"] == method]
            pts = sorted((r["seq_len"], r["peak_mb"]) for r in rows if "peak_mb" in r)
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{method}, tp={tp}")
            est = sorted((r["seq_len"], r["est_mb"]) for r in rows if "est_mb" in r)
            if est and tp == min(r["tp"] for r in data["rows"]):
                ax.plot(*zip(*est), ":", color="gray", label="gathered estimate (any tp)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length S",
        ylabel="peak MB per rank (head + loss, fwd + bwd)",
        title=f"LM head + cross-entropy, vocab {data['args']['vocab']:,}",
    )
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="sequence lengths S")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=128, help="the head's input width (logits memory does not depend on it)")
    p.add_argument("--budget-gib", type=float, default=8.0, help="skip gathered cases estimated above this, summed over ranks")
    p.add_argument("--out", default=str(RESULTS / "loss_parallel_cpu"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    rows = [run_case(args, tp, s, m) for tp in args.tp for s in args.sizes for m in METHODS]
    data = {"args": vars(args), "rows": rows, "machine": platform.platform(), "torch": torch.__version__}
    stem = Path(args.out)
    stem.parent.mkdir(exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    write_markdown(data, Path(f"{stem}.md"))
    write_plot(data, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {stem}.md/.png/.json")


if __name__ == "__main__":
    main()
