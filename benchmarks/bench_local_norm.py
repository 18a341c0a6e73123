"""Benchmark: the local part of the norm on one device, float32 vs float64 accumulation.

The norm of a float32 or bfloat16 gradient overflows in float32 sums of squares once elements pass
about 1.8e19 (their squares pass float32's 3.4e38) although the norm itself is far below float32's
limit. Accumulating in float64 cannot overflow for finite inputs; this measures what it costs,
against a memory-bandwidth floor (one read of every gradient byte), on gradient sets shaped like a
transformer's. On CUDA it also checks that ``clip_grad_norm_`` never synchronizes with the host.
Run by hand (world size 1, no process group; CUDA if available, else the CPU)::

    python benchmarks/bench_local_norm.py                        # a GPU: 1e8, 1e9, 4e9 elements
    python benchmarks/bench_local_norm.py --params 1e7 1e8 --reps 5   # the CPU table in results/
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

import lightning_ndclip as nd
from lightning_ndclip._compat import foreach_norm

RESULTS = Path(__file__).resolve().parent / "results"


def gradient_set(params: float, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Tensors of one transformer-like model with ``params`` elements in all: per layer four
    d x d matrices, two d x 4d matrices and four d-vectors, d = 4096 (d = 1024 when small)."""
    d = 4096 if params >= 1e9 else 1024
    layer = [(d, d)] * 4 + [(d, 4 * d), (4 * d, d)] + [(d,)] * 4
    per_layer = sum(torch.Size(s).numel() for s in layer)
    layers = max(1, round(params / per_layer))
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(layers) for s in layer]


def timed(fn, reps: int, device: str) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls (CUDA events around each on CUDA)."""
    times = []
    for _ in range(2):
        fn()
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(params: float, dtype: torch.dtype, reps: int, device: str) -> dict:
    grads = gradient_set(params, dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in grads)
    flat = torch.cat([t.reshape(-1) for t in grads])
    methods = {
        "floor": lambda: torch.linalg.vector_norm(flat),
        "foreach fp32": lambda: foreach_norm(grads, 2.0, dtype=torch.float32),
        "foreach fp64": lambda: foreach_norm(grads, 2.0, dtype=torch.float64),
        "vector_norm each fp32": lambda: torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in grads]),
        "ndclip fp32": lambda: nd.get_total_norm(grads, accumulate_dtype=torch.float32),
        "ndclip fp64": lambda: nd.get_total_norm(grads, accumulate_dtype=torch.float64),
        "torch get_total_norm": lambda: torch.nn.utils.get_total_norm(grads),
    }
    row = {"params": sum(t.numel() for t in grads), "tensors": len(grads), "dtype": str(dtype), "GB": nbytes / 1e9}
    row.update({name: timed(fn, reps, device) for name, fn in methods.items()})
    row["floor GB/s"] = nbytes / 1e6 / row["floor"]
    return row


def overflow_check(device: str) -> dict:
    """Elements of 1e20 (finite in float32 and bfloat16): the norm in each accumulation dtype,
    against the float64 value of the same tensors."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.full((1000,), 1e20, device=device, dtype=dtype), torch.ones(10, device=device, dtype=dtype)]
        exact = torch.linalg.vector_norm(torch.cat([g.double() for g in grads]))
        for acc in (torch.float32, torch.float64):
            got = nd.get_total_norm(grads, accumulate_dtype=acc).double()
            out[f"{dtype} in {acc}"] = {"norm": float(got), "relative error": float((got - exact).abs() / exact)}
    return out


def host_sync_check() -> str:
    """``clip_grad_norm_`` under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""
    params = [torch.nn.Parameter(torch.randn(64, 64, device="cuda")) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    nd.clip_grad_norm_(params, 1.0)  # the first calls build and cache the plans and their index tensors
    nd.grad_norms(named, per_tensor=True).clip_(1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nd.clip_grad_norm_(params, 1.0)
        nd.grad_norms(named, per_tensor=True).clip_(1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "no host sync in clip_grad_norm_ / grad_norms(per_tensor=True).clip_"


def write_markdown(data: dict, path: Path) -> None:
    cols = ["floor", "foreach fp32", "foreach fp64", "vector_norm each fp32", "ndclip fp32", "ndclip fp64"]
    cols.append("torch get_total_norm")
    lines = [
        f"# Local norm on {data['device']} (torch {data['torch']}), median ms of {data['reps']} calls",
        "",
        "| dtype | params | tensors | GB | " + " | ".join(cols)
        + " | fp64/fp32 (ndclip) | ndclip fp64/floor | ndclip fp32: % of the floor's bandwidth |",
        "|---" * (len(cols) + 7) + "|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['dtype'].replace('torch.', '')} | {r['params'] / 1e6:.0f}M | {r['tensors']} | {r['GB']:.2f} | "
            + " | ".join(f"{r[c]:.3f}" for c in cols)
            + f" | {r['ndclip fp64'] / r['ndclip fp32']:.2f} | {r['ndclip fp64'] / r['floor']:.2f}"
            + f" | {100 * r['floor'] / r['ndclip fp32']:.0f} % |"
        )
    lines += [
        "",
        f"Floor: one `vector_norm` over the same bytes in one flat buffer "
        f"({data['rows'][-1]['floor GB/s']:.0f} GB/s at the largest size).",
        "",
    ]
    lines += ["Overflow check (elements of 1e20, finite in both dtypes):", ""]
    lines += [f"- {k}: norm {v['norm']:.6g}, relative error {v['relative error']:.1e}" for k, v in data["overflow"].items()]
    lines += ["", f"Host sync: {data['host_sync']}", ""]
    path.write_text("\n".join(lines))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, dtype in zip(axes, ("torch.float32", "torch.bfloat16")):
        rows = [r for r in data["rows"] if r["dtype"] == dtype]
        for col in ("floor", "ndclip fp32", "ndclip fp64", "torch get_total_norm"):
            ax.plot([r["params"] for r in rows], [r[col] for r in rows], marker="o", label=col)
        ax.set(xscale="log", yscale="log", xlabel="gradient elements", title=dtype.replace("torch.", ""))
    axes[0].set_ylabel("ms per call")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1e8, 1e9, 4e9])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [run_case(n, dtype, args.reps, device) for dtype in (torch.float32, torch.bfloat16) for n in args.params]
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    data = {"device": name, "torch": torch.__version__, "reps": args.reps, "rows": rows}
    data["overflow"] = overflow_check(device)
    data["host_sync"] = host_sync_check() if device == "cuda" else "not checked (no CUDA)"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"local_norm_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}"
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    write_markdown(data, Path(f"{stem}.md"))
    write_plot(data, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
