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
    python benchmarks/bench_cp_memory.py --model llama    # a transformers Llama, 4 ranks, S = 4k .. 32k

``--model llama``: the same measurement around one forward + backward of a whole ``transformers``
``LlamaForCausalLM`` (fp32, built from a ``LlamaConfig``, no download) made context parallel by
``lightning_ndclip.integrations.transformers.context`` (``context_parallelize`` + ``shard_batch(...,
kv_exchange=method)``; its own ``.loss`` on ``labels=input_ids``), and, as the reference, the plain
model on the whole sequence in one process (``"one_process"``: transformers' own ``sdpa`` attention,
causal without a mask). The warm-up is one forward + backward at a tiny length, so the parameters'
gradients exist before the baseline. All-gather and one-process cases whose estimate
(:func:`llama_estimate_gib`) exceeds ``--budget-gib`` per process are not run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
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
LLAMA_METHODS = ("ring", "all_gather", "one_process")
LLAMA_FLOATS_PER_TOKEN = {"hidden": 12, "intermediate": 4, "vocab": 4}
"""``--model llama`` estimate: float32 values one forward + backward holds per token, per layer and unit of
``hidden_size`` / ``intermediate_size``, and once per unit of the vocabulary (logits, their log-softmax and
gradient). Fits the one-process cases within 5 % (57 KB per token at the defaults)."""
LLAMA_MASK_BYTES_PER_PAIR = MASK_BYTES_PER_PAIR = 5
"""All-gather estimate, per (local query, key) pair: the ``[S/cp, S]`` boolean mask (1 byte) and the additive float32
mask SDPA makes of it (4 bytes); PyTorch's CPU kernel tiles the scores themselves. Fits the measured cases (see the
table's estimate column). ``--model llama``: in the layer running; each layer before it keeps its float32 mask (4
more bytes per layer) for its backward."""
ATTENTION_DEFAULTS = {"sizes": [4096, 8192, 16384, 32768, 65536], "heads": 2}
LLAMA_DEFAULTS = {"sizes": [4096, 8192, 16384, 32768], "heads": 4}


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
        out = context_parallel_attention(q, k, v, group=dist.group.WORLD, positions=positions, is_causal=True, kv_exchange=method)
        out.backward(dout)

    return [q, k, v, dout, positions], call


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak_mb() -> float:
    """Reset the process's peak RSS to its RSS now (``/proc/self/clear_refs``, Linux) and return it, so that the peak
    after a call minus this is the call's own growth even where the process's RSS had fallen below an earlier peak
    (other processes' memory pressure evicting its library pages). Where that file is not writable: :func:`peak_mb`."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return peak_mb()


def mem_available_mb() -> float:
    """The machine's ``MemAvailable``, recorded per case: little of it means other processes pressed on this one."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(method: str, seq_len: int, args, rank: int) -> dict:
    attend(method, 16 * args.world_size, args, rank)[1]()  # the first transfers, at a tiny length
    _, call = attend(method, seq_len, args, rank)
    dist.barrier()
    baseline = peak_mb()
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    return {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "s": seconds}


# --- --model llama: a whole transformers Llama, context parallel -------------------------------------------------


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.sizes),
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def llama_activation_bytes_per_token(args) -> float:
    """What one forward + backward of the model holds per token, attention's scores and masks aside."""
    per = LLAMA_FLOATS_PER_TOKEN
    return 4 * (args.layers * (per["hidden"] * args.hidden + per["intermediate"] * args.intermediate) + per["vocab"] * args.vocab)


def llama_estimate_gib(method: str, seq_len: int, args) -> float:
    """Estimated peak per process of one forward + backward. ``one_process``: the activations of all S tokens
    (PyTorch's CPU flash kernel tiles the causal scores; transformers passes no mask). ``ring``: the activations
    of S/cp tokens and three ``[heads, S/cp, 1024]`` float32 score tiles (as the attention-only table).
    ``all_gather``: the activations of S/cp tokens, the masks (:data:`LLAMA_MASK_BYTES_PER_PAIR` plus 4 bytes per
    earlier layer, per pair) and the gathered K/V (repeated to every head) every layer keeps, with their
    gradients in the backward."""
    tokens = seq_len if method == "one_process" else seq_len // args.world_size
    total = llama_activation_bytes_per_token(args) * tokens
    if method == "ring":
        total += 3 * args.heads * tokens * 1024 * 4
    elif method == "all_gather":
        total += (LLAMA_MASK_BYTES_PER_PAIR + 4 * (args.layers - 1)) * tokens * seq_len
        total += (2 * args.layers + 2) * seq_len * args.hidden * 4
    return total / 2**30


def llama_case(method: str, seq_len: int, args, rank: int) -> dict:
    """Build the model (context parallel unless ``one_process``), warm it up at a tiny length, then measure one
    forward + backward of its own loss at ``seq_len``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args))
    cp = None
    if method != "one_process":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_ndclip.integrations.transformers.context import context_parallelize

        cp = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("cp",))["cp"]
        context_parallelize(model, cp)

    def prepare(length: int) -> tuple[dict, contextlib.AbstractContextManager]:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
        batch = {"input_ids": ids, "labels": ids}
        if cp is None:
            return batch, contextlib.nullcontext()
        from lightning_ndclip.integrations.transformers.context import shard_batch

        local, shard = shard_batch(batch, cp, kv_exchange=method)
        return local, shard.active()

    def call(inputs: dict, scope: contextlib.AbstractContextManager) -> None:
        with scope:
            loss = model(**inputs).loss
        loss.backward()

    call(*prepare(16 * args.world_size))  # the first transfers and kernels; the parameters' gradients
    inputs, scope = prepare(seq_len)
    if cp is not None:
        dist.barrier()
    available_mb = mem_available_mb()
    baseline = reset_peak_mb()
    t0 = time.perf_counter()
    call(inputs, scope)
    seconds = time.perf_counter() - t0
    return {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "available_mb": available_mb, "s": seconds}


def llama_worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    one_process = args.method == "one_process"
    row = {"method": args.method, "seq_len": args.seq_len, "est_gib": llama_estimate_gib(args.method, args.seq_len, args)}
    skipped = args.method != "ring" and row["est_gib"] > args.budget_gib
    if one_process or skipped:  # rank 0 alone: one process on the whole sequence, or nothing to run
        if rank:
            return
        if skipped:
            row["skipped"] = True
        else:
            row.update(llama_case(args.method, args.seq_len, args, rank))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
        mine = llama_case(args.method, args.seq_len, args, rank)
        gathered: list = [None] * args.world_size
        dist.all_gather_object(gathered, mine)
        row.update({key: max(r[key] for r in gathered) for key in mine}, per_rank=gathered)
        row["available_mb"] = min(r["available_mb"] for r in gathered)
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"S={args.seq_len:6d} {args.method:11s} "
            + (
                "skipped"
                if "skipped" in row
                else f"peak +{row['peak_mb']:.0f} MB (est. {row['est_gib'] * 1024:.0f}), {row['s']:.1f} s"
            ),
            flush=True,
        )
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))


LLAMA_LABELS = {"ring": "ring (cp)", "all_gather": "all_gather (cp)", "one_process": "one process (whole sequence)"}


def llama_write_markdown(data: dict, path: Path) -> None:
    a = argparse.Namespace(**data["args"])
    world = data["world_size"]
    m = a.machine
    rows = {(r["seq_len"], r["method"]): r for r in data["rows"]}
    lines = [
        f"# A transformers Llama, context parallel: memory per rank, {world} ranks (CPU, gloo, 1 thread per rank)",
        "",
        f"`LlamaForCausalLM` built from a `LlamaConfig` (hidden {a.hidden}, {a.layers} layers, {a.heads} heads / "
        f"{a.kv_heads} key-value heads, head_dim {a.hidden // a.heads}, intermediate {a.intermediate}, vocab {a.vocab}, "
        f"{a.params / 1e6:.1f} M parameters), float32, batch 1; one forward + backward of its own `.loss` "
        "(`labels=input_ids`). **ring** / **all_gather (cp)**: the model made context parallel over "
        f"{world} spawned ranks (`context_parallelize` + `shard_batch(..., kv_exchange=...)`, causal, load-balanced; "
        "ring: key tiles of 1024). **one process**: the plain model on the whole sequence, one process, transformers' "
        "own `sdpa` attention (causal, no mask). **peak MB per rank**: the growth of the process's peak RSS "
        "(`ru_maxrss`) during the call over its RSS right before it (the peak reset there through "
        "`/proc/self/clear_refs`; the model, the batch and the parameters' gradients, from a warm-up call at a tiny "
        "length, already there), max over ranks; fresh processes per case. **s**: wall time of that call, max over "
        f"ranks ({world} ranks share the {m['cpus']} cores; one process: 1 thread). **est. MB**: "
        "`llama_estimate_gib` (activations per token, the ring's three score tiles, the all-gather's masks and K/V); "
        f"all-gather and one-process cases estimated above {a.budget_gib:g} GiB per process are not run. Measured "
        f"{m['date']} on {m['cpus']} CPU cores ({m['cpu']}), {m['ram_gib']:.0f} GiB RAM, torch {m['torch']}, "
        f"transformers {m['transformers']}. See benchmarks/README.md.",
        "",
        "| S | arm | tokens per process | peak MB per rank | s | est. MB | memory / ring |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sorted({r["seq_len"] for r in data["rows"]}):
        ring = rows.get((s, "ring"))
        for method in LLAMA_METHODS:
            row = rows.get((s, method))
            if row is None:
                continue
            tokens = s if method == "one_process" else s // world
            ratio = f"{row['peak_mb'] / ring['peak_mb']:.1f}" if ring and "peak_mb" in ring and "peak_mb" in row else "-"
            lines.append(
                f"| {s} | {LLAMA_LABELS[method]} | {tokens} | {' | '.join(cell(row))} | {row['est_gib'] * 1024:.0f} | {ratio} |"
            )
    available = [r["available_mb"] for r in data["rows"] if "available_mb" in r]
    if available:
        lines += ["", f"The machine's `MemAvailable` right before each call: at least {min(available) / 1024:.1f} GiB."]
    path.write_text("\n".join(lines + [""]))


def llama_write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, wall) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, method in enumerate(LLAMA_METHODS):
        pts = sorted((r["seq_len"], r["peak_mb"], r["s"]) for r in data["rows"] if r["method"] == method and "peak_mb" in r)
        if pts:
            s, mb, sec = zip(*pts)
            mem.plot(s, mb, marker="o", color=f"C{k}", label=LLAMA_LABELS[method])
            wall.plot(s, sec, marker="o", color=f"C{k}", label=LLAMA_LABELS[method])
        est = sorted((r["seq_len"], r["est_gib"] * 1024) for r in data["rows"] if r["method"] == method)
        if est:
            mem.plot(*zip(*est), ":", color=f"C{k}", label=f"{method} estimate")
    mem.set(ylabel="peak MB per rank (call, over its inputs)")
    wall.set(ylabel="s per forward + backward")
    for ax in (mem, wall):
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="sequence length S",
            title=f"transformers Llama, cp over {data['world_size']} ranks",
        )
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict:
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
    }


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
        print(
            f"S={args.seq_len:6d} {args.method:10s} "
            + ("skipped" if "skipped" in row else f"peak +{row['peak_mb']:.0f} MB, {row['s']:.1f} s"),
            flush=True,
        )
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
    lines = [
        f"# Context-parallel attention memory, {data['world_size']} ranks (CPU, gloo, 1 thread per rank)",
        "",
        f"Causal, load-balanced; batch 1, {a.heads} heads, head_dim {a.head_dim}, float32; one forward + "
        f"backward. **peak MB**: growth of the rank's peak RSS during the call over its peak just before "
        f"(inputs excluded), max over ranks; fresh ranks per case. **s**: wall time of that call, max over "
        f"ranks (one call: 4 ranks share 2 cores). Ring: key tiles of 1024. All-gather cases estimated above "
        f"{a.budget_gib:g} GiB per rank are not run. See README.md.",
        "",
        "| S | tokens per rank | ring peak MB | ring s | all_gather peak MB | all_gather s | all_gather est. MB "
        "| all_gather / ring memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted({r["seq_len"] for r in data["rows"]}):
        ring, gather = rows.get((s, "ring")), rows.get((s, "all_gather"))
        ratio = (
            f"{gather['peak_mb'] / ring['peak_mb']:.1f}" if ring and gather and "peak_mb" in ring and "peak_mb" in gather else "-"
        )
        est = f"{gather['est_gib'] * 1024:.0f}" if gather else "-"
        lines.append(
            f"| {s} | {s // data['world_size']} | {' | '.join(cell(ring))} | {' | '.join(cell(gather))} | {est} | {ratio} |"
        )
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
        ax.set(xscale="log", yscale="log", xlabel="sequence length S", title=f"causal cp attention, {data['world_size']} ranks")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        choices=["attention", "llama"],
        default="attention",
        help="attention: context_parallel_attention alone; llama: a whole transformers LlamaForCausalLM",
    )
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (attention: 4k .. 64k, llama: 4k .. 32k)")
    p.add_argument("--methods", nargs="+", choices=LLAMA_METHODS, help="one_process: llama only")
    p.add_argument("--heads", type=int, help="attention heads (attention: 2, llama: 4)")
    p.add_argument("--head-dim", type=int, default=16, help="attention only (llama: hidden / heads)")
    p.add_argument("--hidden", type=int, default=256, help="llama")
    p.add_argument("--layers", type=int, default=2, help="llama")
    p.add_argument("--kv-heads", type=int, default=2, help="llama")
    p.add_argument("--intermediate", type=int, default=512, help="llama")
    p.add_argument("--vocab", type=int, default=1024, help="llama")
    p.add_argument(
        "--budget-gib",
        type=float,
        default=4.0,
        help="skip all_gather (and llama's one_process) cases estimated above this, per process",
    )
    args = p.parse_args()
    defaults = LLAMA_DEFAULTS if args.model == "llama" else ATTENTION_DEFAULTS
    args.sizes = args.sizes or defaults["sizes"]
    args.heads = args.heads or defaults["heads"]
    args.methods = args.methods or list(LLAMA_METHODS if args.model == "llama" else METHODS)
    if args.model == "attention":
        if "one_process" in args.methods:
            p.error("--methods one_process: --model llama only")
        cases = [{"seq_len": s, "method": m} for s in args.sizes for m in args.methods]
        spawn_and_report(worker, args, RESULTS / f"cp_memory_{args.world_size}ranks", write_markdown, write_plot, cases)
        return
    from transformers import LlamaForCausalLM

    args.params = sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters())
    args.machine = machine()
    cases = [{"seq_len": s, "method": m} for s in args.sizes for m in args.methods]
    stem = RESULTS / f"cp_memory_hf_llama_{args.world_size}ranks"
    spawn_and_report(llama_worker, args, stem, llama_write_markdown, llama_write_plot, cases)


if __name__ == "__main__":
    main()
