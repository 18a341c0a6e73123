"""Benchmark: global gradient norm + clip on FSDP2 / FSDP2 x TP models (CPU, gloo).

Compares ``lightning_ndclip.clip_grad_norm_`` with ``torch.nn.utils.clip_grad_norm_``, torchtitan's
``clip_grad_norm_`` (if importable) and a memory-bandwidth floor. Run by hand (see README.md)::

    python benchmarks/bench_norm.py            # 4 ranks, N = 100 1000 3000 10000, both layouts
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import spawn_and_report  # benchmarks/_common.py
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd
from lightning_ndclip._compat import foreach_mul_, foreach_norm
from lightning_ndclip.core.norm._runs import RunFinder, Runs, dim0_paddings

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH_FACTORS = (1.0, 0.8, 1.25, 0.9)  # unit widths d0 -> d1 -> d2 -> d3 -> d0 (relative)
METHODS = ("ndclip", "ndclip_norm", "torch", "torchtitan", "ndclip_uncoalesced")
BUDGET_S = 1.5  # wall time per timed method; repetitions are reduced below --reps to fit it
MIN_REPS = 5

try:
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip
    TITAN_MISSING = None
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    titan_clip, TITAN_MISSING = None, f"n/a (not installed: {type(e).__name__})"


class Unit(nn.Module):
    """A residual block of ``linears`` linears (a multiple of 4) cycling through ``widths``: x + net(x)."""

    def __init__(self, widths: list[int], linears: int) -> None:
        super().__init__()
        cycle = [widths[k % len(widths)] for k in range(linears)]
        layers: list[nn.Module] = []
        for k, (i, o) in enumerate(zip(cycle, cycle[1:] + cycle[:1])):
            layers += [nn.Linear(i, o)] + ([nn.ReLU()] if k < linears - 1 else [])
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def unit_widths(elems_per_tensor: int, world: int, padded: bool = True) -> list[int]:
    """Widths such that a tensor holds ~``elems_per_tensor`` local elements on average once sharded
    ``world`` ways. Widths are multiples of 4, except d2 when ``padded``: odd, so the 2nd linear's
    weight and bias (dim 0 = d2) shard unevenly over the FSDP ranks and FSDP pads them (d1, cut by
    TP, stays even)."""
    f = WIDTH_FACTORS
    mean_product = sum(a * b for a, b in zip(f, f[1:] + f[:1])) / len(f)
    s = math.sqrt(2 * elems_per_tensor * world / mean_product)
    return [4 * round(s * x / 4) + (1 if k == 2 and padded else 0) for k, x in enumerate(f)]


def build_model(layout: str, n_tensors: int, elems_per_tensor: int, world: int, tensors_per_unit: int = 8) -> nn.Module:
    """A stack of ``fully_shard`` units of ``tensors_per_unit`` parameters each (a multiple of 8),
    ~``n_tensors`` parameters in all, and one backward done.

    ``fsdp``: 1-D mesh (dp_shard=world). ``fsdp_even``: the same with every width a multiple of 4
    (no FSDP padding). ``fsdp_tp``: (dp_shard=world/2, tp=2); in every group of four linears the
    first two are Colwise/Rowwise parallel (half the linears), the others live on the dp mesh only.
    """
    torch.manual_seed(0)
    widths = unit_widths(elems_per_tensor, world, padded=layout != "fsdp_even")
    linears = tensors_per_unit // 2
    units = max(1, round(n_tensors / tensors_per_unit))
    model = nn.Sequential(*(Unit(widths, linears) for _ in range(units)))
    if layout in ("fsdp", "fsdp_even"):
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh = mesh["dp_shard"]
        styles = ((0, ColwiseParallel()), (2, RowwiseParallel()))  # net[0], net[2]: the first two linears of four
        plan = {str(8 * j + k): style for j in range(linears // 4) for k, style in styles}
        for unit in model:
            parallelize_module(unit.net, mesh["tp"], plan)
    for unit in model:  # reshard_after_forward=False only makes the one backward cheaper
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    x = torch.randn(2, widths[0], generator=torch.Generator().manual_seed(dp_mesh.get_local_rank()))
    model(x).square().mean().backward()
    return model


def local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]


def find_runs(params: list[nn.Parameter], plans: nd.NormPlans) -> Runs:
    """The runs that ndclip's RunFinder makes of this rank's gradients, counting the tensors that the
    plan ``plans`` used last counts (all of them if that plan is for other tensors)."""
    locals_ = local_grads(params)
    counted = plans.counted()
    if counted is None or len(counted) != len(locals_):
        counted = (True,) * len(locals_)
    return RunFinder().runs(locals_, counted, dim0_paddings([p.grad for p in params]))


def count_runs(params: list[nn.Parameter], plans: nd.NormPlans) -> tuple[int, int]:
    """(#runs to norm, #runs to scale): see :func:`find_runs`."""
    runs = find_runs(params, plans)
    return len(runs.to_norm), len(runs.to_scale)


def agree_reps(round_s: float, n_methods: int, reps: int) -> int:
    """Rounds fitting ``BUDGET_S`` per method given the slowest rank's time for one round."""
    t = torch.tensor([round_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(MIN_REPS, min(reps, int(BUDGET_S * n_methods / max(t.item(), 1e-9))))


def warm_up(fn, warmup: int = 2) -> tuple[dict, float]:
    """Warm-up calls, then one call under ``CommDebugMode``: (collectives per call and seconds taken
    by the first call (one-time setup: ndclip's plan, DTensor's sharding propagation), or the error
    raised on any rank; seconds of the last warm-up call)."""
    dist.barrier()
    try:
        for k in range(warmup):
            t0 = time.perf_counter()
            fn()
            if k == 0:
                first_s = time.perf_counter() - t0
        last = time.perf_counter() - t0
        err = None
    except Exception as e:  # noqa: BLE001 - recording what a method does
        err, last = (f"raises {type(e).__name__}", str(e)[:300]), 0.0
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    if any(errs):
        error, detail = next(e for e in errs if e)
        return {"error": error, "detail": detail}, 0.0
    with CommDebugMode() as comm:
        fn()
    return {"collectives": comm.get_total_counts(), "first_s": first_s}, last


def time_methods(fns: dict, reps: int) -> dict[str, dict]:
    """Every method warmed up, then timed in interleaved rounds (each round calls every working
    method once, each call after a barrier), so that the machine's drifts hit all methods alike and
    their ratios hold. Per method: median ms per call, collectives, first-call seconds, or the error."""
    out, last = {}, {}
    for name, fn in fns.items():
        out[name], last_s = warm_up(fn)
        if "error" not in out[name]:
            last[name] = last_s
    times: dict[str, list[float]] = {name: [] for name in last}
    n = agree_reps(sum(last.values()), len(last), reps)
    gc.collect()
    gc.disable()  # as timeit does: a full collection over the model's objects is not the method's cost
    try:
        for _ in range(n):
            for name in last:
                dist.barrier()
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    for name, ts in times.items():
        out[name].update(ms=1e3 * statistics.median(ts), reps=len(ts))
    return out


def bench_case(layout: str, n_tensors: int, tensors_per_unit: int, args) -> dict:
    """Time every method on one model; returns this rank's numbers."""
    t0 = time.perf_counter()
    model = build_model(layout, n_tensors, args.elems_per_tensor, args.world_size, tensors_per_unit)
    build_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.grad is not None]
    numel = sum(g.numel() for g in local_grads(params))
    plans = nd.NormPlans()  # this model's plans only, dropped with it
    uncoalesced = each_tensor_a_run(params)
    methods = {
        "ndclip": lambda: nd.clip_grad_norm_(params, max_norm=1e9, plans=plans),
        "ndclip_uncoalesced": lambda: nd.clip_grad_norm_(params, max_norm=1e9, plans=uncoalesced),
        "ndclip_norm": lambda: nd.get_total_norm([p.grad for p in params], plans=plans),
        "torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),
        "torchtitan": (lambda: titan_clip(params, 1e9)) if titan_clip else TITAN_MISSING,
    }
    if len(params) > args.torch_max_n:  # DTensor's first foreach call is O(N^2): minutes at N=10000
        methods["torch"] = methods["torchtitan"] = "skipped (--torch-max-n)"
    flat = torch.randn(numel)
    scalar = torch.zeros(1, dtype=torch.float64)  # latency of the one all-reduce every method needs
    references = {
        "floor_r": lambda: torch.linalg.vector_norm(flat),
        "floor_rw": lambda: flat.mul_(1.0),
        "allreduce": lambda: dist.all_reduce(scalar),
        "flat_clip": flat_clip(flat, args.world_size),
        "read_grads": lambda: [p.grad for p in params],
        "ndclip_kernels": ndclip_kernels(params),
    }
    timed = time_methods({**{k: f for k, f in methods.items() if callable(f)}, **references}, args.reps)
    out = {"layout": layout, "per_unit": tensors_per_unit, "n_tensors": len(params), "local_mb": numel * 4 / 2**20,
           "build_s": build_s}
    out.update({name: timed[name] if callable(fn) else {"error": fn} for name, fn in methods.items()})
    out.update({name: timed[name] for name in references})
    # correctness: ndclip's norm against torch's where torch works (coef is 1.0: grads unchanged)
    ours = float(nd.clip_grad_norm_(params, max_norm=1e9, plans=plans))
    out["norm"] = ours
    if "ms" in out["torch"]:
        ref = torch.nn.utils.clip_grad_norm_(params, 1e9)
        ref = float(ref.full_tensor() if isinstance(ref, DTensor) else ref)
        out["rel_err_vs_torch"] = abs(ours - ref) / max(abs(ref), 1e-30)
    out["runs_norm"], out["runs_scale"] = count_runs(params, plans)
    methods.clear()  # the lambdas hold the model
    gc.collect()
    return out


class _EachTensorARun:
    """A run finder that coalesces nothing: every local gradient its own run (ndclip with run coalescing off)."""

    def runs(self, locals_, counted, padding=None) -> Runs:
        return Runs([t for t, c in zip(locals_, counted) if c and t.numel()], [t for t in locals_ if t.numel()],
                    [t for t, c in zip(locals_, counted) if not c and t.numel()])


def each_tensor_a_run(params: list[nn.Parameter]) -> nd.NormPlans:
    """Plans for ``params`` whose runs are the tensors themselves (collective: builds the plan)."""
    plans = nd.NormPlans()
    nd.get_total_norm([p.grad for p in params], plans=plans)
    for entry in plans.plans.values():
        entry.finder = _EachTensorARun()
    return plans


def ndclip_kernels(params: list[nn.Parameter]):
    """ndclip's device work alone: its norm and scale kernels on the runs its plan makes of this
    rank's gradients, found once here (no reading of ``p.grad``, no check of the layout)."""
    plans = nd.NormPlans()
    nd.get_total_norm([p.grad for p in params], plans=plans)  # collective: every rank builds its plan
    runs = find_runs(params, plans)
    one = torch.ones((), dtype=torch.float32)

    def fn() -> None:
        torch.stack(foreach_norm(runs.to_norm, 2.0, dtype=torch.float32)).pow(2).sum()
        foreach_mul_(runs.to_scale, one)

    return fn


def flat_clip(flat: torch.Tensor, world: int):
    """The distributed floor: a whole clip of one flat buffer (norm, the one all-reduce when world >
    1, as ndclip, and the scale)."""

    def fn() -> None:
        sq = torch.linalg.vector_norm(flat).to(torch.float64).square().reshape(1)
        if world > 1:
            dist.all_reduce(sq)
        flat.mul_(torch.clamp(1e9 / (sq.sqrt() + 1e-6), max=1.0).to(flat.dtype))

    return fn


def reduce_ranks(per_rank: list[dict]) -> dict:
    """Max over ranks of every median time, local size and run count."""
    row = dict(per_rank[0])
    for key in ("local_mb", "build_s", "runs_norm", "runs_scale"):
        row[key] = max(r[key] for r in per_rank)
    row["runs_norm_per_rank"] = [r["runs_norm"] for r in per_rank]
    for key in METHODS + ("floor_r", "floor_rw", "allreduce", "flat_clip", "read_grads", "ndclip_kernels"):
        if "ms" in row[key]:
            row[key] = dict(row[key], **{k: max(r[key][k] for r in per_rank) for k in ("ms", "first_s")})
    row["rel_err_vs_torch"] = max((r.get("rel_err_vs_torch", 0.0) for r in per_rank), default=0.0)
    row["floor_ms"] = row["floor_r"]["ms"] + row["floor_rw"]["ms"]
    return row


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    rows = []
    cases = [(layout, n, u) for layout in args.layouts for u in args.tensors_per_unit for n in args.sizes]
    for layout, n, per_unit in cases:
        mine = bench_case(layout, n, per_unit, args)
        gathered: list = [None] * args.world_size
        dist.all_gather_object(gathered, mine)
        rows.append(reduce_ranks(gathered))
        if rank == 0:
            r = rows[-1]
            print(f"{layout:8s} N={r['n_tensors']:6d} ({per_unit}/unit) built in {r['build_s']:.1f}s  ndclip "
                  f"{r['ndclip'].get('ms', float('nan')):.2f} ms", flush=True)
    if rank == 0:
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "args": vars(args), "rows": rows}, indent=1))
    dist.destroy_process_group()


def fmt(cell: dict) -> str:
    return f"{cell['ms']:.2f}" if "ms" in cell else cell["error"]


def ratio(a: dict, b: dict | float) -> str:
    b_ms = b if isinstance(b, float) else b.get("ms")
    return f"{a['ms'] / b_ms:.2f}" if "ms" in a and b_ms else "-"


def bound(row: dict) -> str:
    """The least ratio to the flat clip of any clip that reads every ``p.grad`` once per call: the
    flat clip plus that read (measured alone, in the same rounds)."""
    flat, read = row["flat_clip"].get("ms"), row["read_grads"].get("ms")
    return f"{(flat + read) / flat:.2f}" if flat and read is not None else "-"


def to_bound(row: dict) -> str:
    """ndclip against the exact-clip bound: its own kernels on its coalesced runs plus one read of every
    ``p.grad`` (both measured alone, in the same rounds); what is above 1 is its host work."""
    kernels, read = row["ndclip_kernels"].get("ms"), row["read_grads"].get("ms")
    return f"{row['ndclip']['ms'] / (kernels + read):.2f}" if "ms" in row["ndclip"] and kernels and read else "-"


def write_markdown(data: dict, path: Path) -> None:
    head = ("| layout | tensors/unit | N tensors | local MB | runs norm/scale | ndclip ms | ndclip_norm ms | torch ms | "
            "torchtitan ms | floor ms (r + rw) | 1 all-reduce ms | flat clip ms | collectives ndclip/torch/titan | "
            "1st call s ndclip/torch | ndclip/floor | ndclip/flat clip | ndclip/torch | ndclip/torchtitan | "
            "read p.grad ms | ndclip kernels ms | (flat clip + read p.grad)/flat clip | "
            "ndclip/bound (kernels + read p.grad) | ndclip without coalescing ms | without/with coalescing |")
    lines = [f"# Gradient norm + clip, {data['world_size']} ranks (CPU, gloo, 1 thread per rank)", "",
             "Times: median per call, max over ranks. Runs: max over ranks. See README.md.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in data["rows"]:
        coll = "/".join(str(r[m].get("collectives", "-")) for m in ("ndclip", "torch", "torchtitan"))
        first = "/".join(f"{r[m]['first_s']:.2f}" if "ms" in r[m] else "-" for m in ("ndclip", "torch"))
        lines.append(
            f"| {r['layout']} | {r.get('per_unit', 8)} | {r['n_tensors']} | {r['local_mb']:.1f} | "
            f"{r['runs_norm']}/{r['runs_scale']} | "
            f"{fmt(r['ndclip'])} | {fmt(r['ndclip_norm'])} | {fmt(r['torch'])} | {fmt(r['torchtitan'])} | "
            f"{r['floor_ms']:.2f} ({r['floor_r']['ms']:.2f} + {r['floor_rw']['ms']:.2f}) | {fmt(r['allreduce'])} | "
            f"{fmt(r['flat_clip'])} | {coll} | {first} | "
            f"{ratio(r['ndclip'], r['floor_ms'])} | {ratio(r['ndclip'], r['flat_clip'])} | {ratio(r['ndclip'], r['torch'])} | "
            f"{ratio(r['ndclip'], r['torchtitan'])} | {fmt(r['read_grads'])} | {fmt(r['ndclip_kernels'])} | "
            f"{bound(r)} | {to_bound(r)} | {fmt(r['ndclip_uncoalesced'])} | {ratio(r['ndclip_uncoalesced'], r['ndclip'])} |")
    errs = ", ".join(f"{r['layout']} {r.get('per_unit', 8)}/unit N={r['n_tensors']}: {r['rel_err_vs_torch']:.1e}"
                     for r in data["rows"] if "ms" in r["torch"])
    ok = all(r["rel_err_vs_torch"] <= 1e-5 for r in data["rows"])
    lines += ["", f"Relative difference ndclip vs torch norm ({'OK' if ok else 'MISMATCH'}, tolerance 1e-5): "
              f"{errs or 'n/a'}", ""]
    path.write_text("\n".join(lines))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["layout"], r.get("per_unit", 8)) for r in data["rows"]))
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8), squeeze=False)
    for ax, (layout, per_unit) in zip(axes[1], panels):  # below: the ratios the tables quote
        rows = [r for r in data["rows"] if (r["layout"], r.get("per_unit", 8)) == (layout, per_unit)]
        for label, of in (("ndclip / bound", to_bound), ("ndclip / flat clip", lambda r: ratio(r["ndclip"], r["flat_clip"])),
                          ("ndclip / torch", lambda r: ratio(r["ndclip"], r["torch"]))):
            pts = [(r["n_tensors"], float(of(r))) for r in rows if of(r) != "-"]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.2, color="grey", linestyle="--", linewidth=0.8, label="1.2 (the goal against the bound)")
        ax.set(xscale="log", yscale="log", xlabel="gradient tensors per rank", ylabel="time ratio",
               title=f"{layout}, {per_unit} tensors/unit: ratios")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax, (layout, per_unit) in zip(axes[0], panels):
        rows = [r for r in data["rows"] if (r["layout"], r.get("per_unit", 8)) == (layout, per_unit)]
        for m in METHODS:
            pts = [(r["n_tensors"], r[m]["ms"]) for r in rows if "ms" in r[m]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.plot([r["n_tensors"] for r in rows], [r["floor_ms"] for r in rows], "k--", label="floor (r + rw)")
        ax.plot([r["n_tensors"] for r in rows], [r["flat_clip"]["ms"] for r in rows], "k:", label="flat clip")
        ax.set(xscale="log", yscale="log", xlabel="gradient tensors per rank", ylabel="ms per call",
               title=f"{layout}, {per_unit} tensors/unit, {data['world_size']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 3000, 10000], help="gradient tensors")
    p.add_argument("--tensors-per-unit", type=int, nargs="+", default=[8],
                   help="gradient tensors per fully_shard unit (multiples of 8): 8 = many small units")
    p.add_argument("--elems-per-tensor", type=int, default=2000, help="mean local float32 elements per tensor (fsdp)")
    p.add_argument("--layouts", nargs="+", choices=["fsdp", "fsdp_even", "fsdp_tp"], default=["fsdp", "fsdp_even", "fsdp_tp"])
    p.add_argument("--reps", type=int, default=20, help="timed calls per method (fewer if slow)")
    p.add_argument("--torch-max-n", type=int, default=3000,
                   help="skip torch/torchtitan above this many tensors (their first call is O(N^2) in DTensor)")
    p.add_argument("--tag", default="", help="results in norm_<world>ranks_<tag>.* (keeps the default tables)")
    args = p.parse_args()
    if "fsdp_tp" in args.layouts and args.world_size % 2:
        p.error("fsdp_tp needs an even --world-size")
    # Fresh ranks per case: after a larger model in the same process, ndclip ran slower on
    # N = 1,000 (ndclip 4.0 -> 5.1-6.0 ms at 2 ranks), its objects scattered over a bigger heap.
    if any(u % 8 for u in args.tensors_per_unit):
        p.error("--tensors-per-unit takes multiples of 8")
    cases = [{"layouts": [layout], "sizes": [n], "tensors_per_unit": [u]}
             for layout in args.layouts for u in args.tensors_per_unit for n in args.sizes]
    stem = f"norm_{args.world_size}ranks" + (f"_{args.tag}" if args.tag else "")
    spawn_and_report(worker, args, RESULTS / stem, write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
