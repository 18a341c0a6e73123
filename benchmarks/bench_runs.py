"""Benchmark: the norm's run finding (coalescing FSDP2's gradient views), its speed-only parts on and off.

One process, one thread, no collective: gradients laid out as FSDP2 lays them out (the views of one
flat buffer per unit, padding after every fourth view), in fresh buffers every call, as FSDP2
allocates them every step. Each method finds the runs, norms them and scales them (one
``_foreach_norm`` and one ``_foreach_mul_``), so the table shows what the run finding costs and saves
end to end. Run by hand::

    python benchmarks/bench_runs.py                    # against the C-level run finder of 534bb63
    python benchmarks/bench_runs.py --against <git revision>
    python benchmarks/bench_runs.py --device cuda      # on a GPU: results/runs_1process_<gpu name>.*

Methods:

* ``ndclip``: :class:`~lightning_ndclip.core.norm._runs.RunFinder` as it is.
* ``at <rev>``: the ``_runs.py`` of an earlier revision (``git show``), the same calls.
* ``no padding``: scale runs do not absorb FSDP2's padding (a unit with padded views is several runs).
* ``uncoalesced``: every view its own run (norm and scale the views themselves).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_ndclip._compat import foreach_mul_, foreach_norm
from lightning_ndclip.core.norm._runs import RunFinder

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def layout(
    n: int, per_unit: int, elems: int, counted_every: int, device: str = "cpu"
) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    """``n`` views of ``n / per_unit`` fresh flat buffers, 3 padding elements after every fourth view;
    with ``counted_every`` > 0, every such view is not counted (a tensor-parallel ``Replicate``
    parameter among ``Shard`` ones)."""
    views, padding, counted = [], [], []
    for _ in range(n // per_unit):
        sizes = [elems + k % 3 for k in range(per_unit)]
        gaps = [3 if k % 4 == 1 else 0 for k in range(per_unit)]
        buffer = torch.randn(sum(sizes) + sum(gaps), device=device)
        at = 0
        for size, gap in zip(sizes, gaps):
            views.append(torch.as_strided(buffer, (size,), (1,), at))
            padding.append(gap)
            counted.append(not (counted_every and len(counted) % counted_every == counted_every - 1))
            at += size + gap
    return views, padding, counted


def finder_at(revision: str, source_file: Path | None = None) -> type | None:
    """``RunFinder`` as ``lightning_ndclip/core/norm/_runs.py`` was at ``revision`` (read from
    ``source_file`` when given, e.g. where the copy of the repository has no git history); ``None``
    when neither git nor the file has it (the column is then left out)."""
    if source_file is not None:
        source = source_file.read_text()
    else:
        try:
            source = subprocess.run(
                ["git", "show", f"{revision}:lightning_ndclip/core/norm/_runs.py"],
                cwd=ROOT, check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"warning: no _runs.py at {revision} ({error}); the 'at {revision}' column is left out")
            return None
    path = Path(tempfile.mkdtemp()) / "runs_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("runs_at_revision", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.RunFinder


def norm_and_scale(to_norm: list[torch.Tensor], to_scale: list[torch.Tensor]) -> None:
    foreach_norm(to_norm, 2.0)
    foreach_mul_(to_scale, 1.0)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_case(n: int, per_unit: int, counted_every: int, args: argparse.Namespace, old: type | None) -> dict:
    views, padding, counted = layout(n, per_unit, args.elems, counted_every, args.device)
    finders = {"ndclip": (RunFinder(), padding)}
    if old is not None:
        finders[f"at {args.against}"] = (old(), padding)
    finders["no padding"] = (RunFinder(), None)
    for finder, pad in finders.values():
        finder.runs(views, counted, pad)
    times: dict[str, list[float]] = {name: [] for name in [*finders, "uncoalesced"]}
    runs: dict[str, list[int]] = {}
    methods = [*finders, "uncoalesced"]
    for rep in range(args.reps):
        views, _, _ = layout(n, per_unit, args.elems, counted_every, args.device)
        synchronize(args.device)
        for name in methods[rep % len(methods) :] + methods[: rep % len(methods)]:  # each first in turn: fresh
            t0 = time.perf_counter()  # views are slower to read the first time, and the machine drifts
            if name == "uncoalesced":
                norm_and_scale([v for v, c in zip(views, counted) if c], views)
            else:
                finder, pad = finders[name]
                found = finder.runs(views, counted, pad)
                norm_and_scale(found.to_norm, found.to_scale)
                runs[name] = [len(found.to_norm), len(found.to_scale)]
            synchronize(args.device)
            times[name].append(time.perf_counter() - t0)
    return {
        "n": n,
        "per_unit": per_unit,
        "uncounted": f"1 in {counted_every}" if counted_every else "none",
        "ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "runs": runs,
    }


def write_markdown(data: dict, path: Path) -> None:
    names = list(data["rows"][0]["ms"])
    lines = [
        f"# Run finding + norm + scale, 1 process ({data['device']}), median ms of {data['args']['reps']} calls",
        "",
        f"`python benchmarks/bench_runs.py --against {data['args']['against']}`; torch {data['torch']}. "
        "Ratios: the method's time over `ndclip`'s.",
        "",
        "| N | views/unit | uncounted | " + " | ".join(names) + " | runs (norm/scale) |",
        "|" + "---|" * (len(names) + 4),
    ]
    for r in data["rows"]:
        base = r["ms"]["ndclip"]
        cells = [f"{base:.2f}"] + [f"{r['ms'][k]:.2f} ({r['ms'][k] / base:.2f}x)" for k in names[1:]]
        lines.append(f"| {r['n']} | {r['per_unit']} | {r['uncounted']} | " + " | ".join(cells) + f" | {r['runs']['ndclip']} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    names = [k for k in rows[0]["ms"] if k != "ndclip"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(rows))], [r["ms"][name] / r["ms"]["ndclip"] for r in rows], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"N={r['n']}\n{r['per_unit']}/unit\n{r['uncounted']}" for r in rows], fontsize=7)
    ax.set_ylabel("time / ndclip's")
    ax.set_title("run finding + norm + scale, relative to ndclip (1 process)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="534bb63", help="git revision whose _runs.py to compare with")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--tensors-per-unit", type=int, nargs="+", default=[8, 200])
    parser.add_argument("--elems", type=int, default=64, help="elements per view")
    parser.add_argument("--reps", type=int, default=24)
    parser.add_argument("--against-file", type=Path, help="that revision's _runs.py as a file (no git needed)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to time the kernels on a GPU")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = finder_at(args.against, args.against_file)
    device = "CPU, 1 thread" if args.device == "cpu" else torch.cuda.get_device_name()
    data = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "torch": torch.__version__, "device": device, "rows": []}  # fmt: skip
    stem = args.out / ("runs_1process" + ("" if args.device == "cpu" else "_" + device.lower().replace(" ", "_")))
    args.out.mkdir(parents=True, exist_ok=True)
    for n in args.sizes:
        for per_unit in args.tensors_per_unit:
            for counted_every in (0, 4):
                data["rows"].append(bench_case(n, per_unit, counted_every, args, old))
                print(f"N={n} views/unit={per_unit} uncounted={data['rows'][-1]['uncounted']}: "
                      + ", ".join(f"{k} {v:.2f} ms" for k, v in data["rows"][-1]["ms"].items()), flush=True)  # fmt: skip
                Path(f"{stem}.json").write_text(json.dumps(data, indent=1))  # after every case: a run cut
                write_markdown(data, Path(f"{stem}.md"))  # short keeps the cases it finished
    write_plot(data, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
