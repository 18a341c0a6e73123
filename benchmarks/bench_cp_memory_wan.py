"""Benchmark: memory per rank of a diffusers Wan video transformer at long latent token counts, context parallel
(ring) vs the whole sequence on one process (CPU, gloo).

A ``WanTransformer3DModel`` built from its constructor (no download; ``--hidden`` = heads x head_dim, Wan's
head_dim 128 by default), float32, batch 1, one forward + backward of a flow-matching loss (the mean squared error
of the predicted velocity) on latents ``[1, 16, frames, 64, 64]``: ``frames x 32 x 32`` tokens after the
``(1, 2, 2)`` patch embedding, 4k to 32k by default. Arms:

* ``ring``: the model made context parallel over ``--world-size`` spawned ranks by the package's diffusers
  integration (``lightning_ndclip.integrations.diffusers.context.context_parallelize``): its own ``_cp_plan`` cuts
  the tokens after the patch embedding (each rank 1/cp of them), self-attention runs the package's ring attention,
  the output is gathered whole on every rank (the loss as one device computes it);
* ``one_process``: the plain model on the whole sequence in one process (diffusers' native attention, PyTorch's
  SDPA, no mask).

Memory is measured as in ``bench_cp_memory.py``: fresh processes per case, a warm-up forward + backward at 1
frame (the parameters' gradients exist before the baseline), the process's peak RSS reset right before the
measured call; reported, the growth of the peak during the call, max over ranks.

Run by hand (see README.md)::

    python benchmarks/bench_cp_memory_wan.py               # 4 ranks, 4 / 8 / 16 / 32 frames (4k .. 32k tokens)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import spawn_and_report  # benchmarks/_common.py
from bench_cp_memory import cell, mem_available_mb, peak_mb, reset_peak_mb

METHODS = ("ring", "one_process")
LABELS = {"ring": "ring (cp)", "one_process": "one process (whole sequence)"}
RESULTS = Path(__file__).resolve().parent / "results"
SIDE, CHANNELS, TEXT_TOKENS = 64, 16, 32
"""Latent frames of ``SIDE x SIDE`` (32 x 32 tokens each after the patch), ``CHANNELS`` latent channels, a prompt of
``TEXT_TOKENS`` embeddings."""


def wan_config(args) -> dict:
    return {
        "patch_size": (1, 2, 2), "num_attention_heads": args.hidden // args.head_dim, "attention_head_dim": args.head_dim,
        "in_channels": CHANNELS, "out_channels": CHANNELS, "text_dim": args.hidden, "freq_dim": 256,
        "ffn_dim": args.ffn, "num_layers": args.layers, "rope_max_seq_len": 1024,
    }  # fmt: skip


def tokens(frames: int) -> int:
    return frames * (SIDE // 2) ** 2


def case(method: str, frames: int, args) -> dict:
    """Build the model (context parallel unless ``one_process``), warm it up at one frame, then measure one forward +
    backward of the flow-matching loss at ``frames``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**wan_config(args))
    if method == "ring":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_ndclip.integrations.diffusers.context import context_parallelize

        context_parallelize(model, init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("cp",))["cp"])

    def inputs(length: int) -> dict:
        g = torch.Generator().manual_seed(length)
        return {
            "hidden_states": torch.randn(1, CHANNELS, length, SIDE, SIDE, generator=g),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, args.hidden, generator=g),
            "target": torch.randn(1, CHANNELS, length, SIDE, SIDE, generator=g),
        }

    def call(batch: dict) -> None:
        target = batch.pop("target")
        out = model(**batch, return_dict=False)[0]
        torch.nn.functional.mse_loss(out, target).backward()

    call(inputs(1))
    batch = inputs(frames)
    if method == "ring":
        dist.barrier()
    available_mb = mem_available_mb()
    baseline = reset_peak_mb()
    t0 = time.perf_counter()
    call(batch)
    seconds = time.perf_counter() - t0
    return {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "available_mb": available_mb, "s": seconds}


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    row = {"method": args.method, "frames": args.frames, "tokens": tokens(args.frames)}
    if args.method == "one_process":
        if rank:
            return
        row.update(case(args.method, args.frames, args))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
        mine = case(args.method, args.frames, args)
        gathered: list = [None] * args.world_size
        dist.all_gather_object(gathered, mine)
        row.update({key: max(r[key] for r in gathered) for key in mine}, per_rank=gathered)
        row["available_mb"] = min(r["available_mb"] for r in gathered)
        dist.destroy_process_group()
    if rank == 0:
        print(f"{row['tokens']:6d} tokens {args.method:11s} peak +{row['peak_mb']:.0f} MB, {row['s']:.1f} s", flush=True)
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))


def machine() -> dict:
    import diffusers

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "cpus": os.cpu_count(), "cpu": cpu, "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "torch": torch.__version__, "diffusers": diffusers.__version__, "date": datetime.date.today().isoformat(),
    }  # fmt: skip


def write_markdown(data: dict, path: Path) -> None:
    a, world = argparse.Namespace(**data["args"]), data["world_size"]
    m = a.machine
    rows = {(r["frames"], r["method"]): r for r in data["rows"]}
    lines = [
        f"# A diffusers Wan video transformer, context parallel: memory per rank, {world} ranks (CPU, gloo, 1 thread per rank)",
        "",
        f"`WanTransformer3DModel` ({a.layers} blocks, hidden {a.hidden} = {a.hidden // a.head_dim} heads x head_dim "
        f"{a.head_dim}, ffn {a.ffn}, {a.params / 1e6:.1f} M parameters), float32, batch 1; one forward + backward of a "
        f"flow-matching loss on latents [1, {CHANNELS}, frames, {SIDE}, {SIDE}] ({(SIDE // 2) ** 2} tokens per frame "
        f"after the (1, 2, 2) patch) and a {TEXT_TOKENS}-token prompt. **ring (cp)**: cut by its own `_cp_plan` over "
        f"{world} spawned ranks (the package's diffusers integration: `context_parallelize`; full attention through "
        "the ring, key tiles of 1024; the output gathered whole on every rank). **one process**: the plain model on "
        "the whole sequence (diffusers' native SDPA attention, no mask). **peak MB per rank**: the growth of the "
        "process's peak RSS during the call over its RSS right before it (reset through `/proc/self/clear_refs`; "
        "model, batch and parameter gradients already there from a warm-up at one frame), max over ranks; fresh "
        f"processes per case. **s**: wall time of that call ({world} ranks share the {m['cpus']} cores; one process: "
        f"1 thread). Measured {m['date']} on {m['cpus']} CPU cores ({m['cpu']}), {m['ram_gib']:.0f} GiB RAM, torch "
        f"{m['torch']}, diffusers {m['diffusers']}. See benchmarks/README.md.",
        "",
        "| frames | latent tokens | arm | tokens per process | peak MB per rank | s | memory / ring |",
        "|---|---|---|---|---|---|---|",
    ]
    for frames in sorted({r["frames"] for r in data["rows"]}):
        ring = rows.get((frames, "ring"))
        for method in METHODS:
            row = rows.get((frames, method))
            if row is None:
                continue
            local = tokens(frames) // (world if method == "ring" else 1)
            ratio = f"{row['peak_mb'] / ring['peak_mb']:.1f}" if ring else "-"
            lines.append(f"| {frames} | {tokens(frames)} | {LABELS[method]} | {local} | {' | '.join(cell(row))} | {ratio} |")
    available = [r["available_mb"] for r in data["rows"]]
    lines += ["", f"The machine's `MemAvailable` right before each call: at least {min(available) / 1024:.1f} GiB."]
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, wall) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, method in enumerate(METHODS):
        pts = sorted((r["tokens"], r["peak_mb"], r["s"]) for r in data["rows"] if r["method"] == method)
        if pts:
            s, mb, sec = zip(*pts)
            mem.plot(s, mb, marker="o", color=f"C{k}", label=LABELS[method])
            wall.plot(s, sec, marker="o", color=f"C{k}", label=LABELS[method])
    mem.set(ylabel="peak MB per rank (call, over its inputs)")
    wall.set(ylabel="s per forward + backward")
    for ax in (mem, wall):
        ax.set(yscale="log", xlabel="latent tokens", title=f"diffusers Wan, cp over {data['world_size']} ranks")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--frames", type=int, nargs="+", default=[4, 8, 16, 32], help="latent frames (1,024 tokens each)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--hidden", type=int, default=256, help="heads x head_dim")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    if any(tokens(f) % args.world_size for f in args.frames):
        p.error(f"--frames: each token count ({(SIDE // 2) ** 2} per frame) must be divisible by --world-size")
    from diffusers import WanTransformer3DModel

    args.params = sum(p.numel() for p in WanTransformer3DModel(**wan_config(args)).parameters())
    args.machine = machine()
    cases = [{"frames": f, "method": m} for f in args.frames for m in args.methods]
    spawn_and_report(worker, args, RESULTS / f"cp_memory_wan_{args.world_size}ranks", write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
