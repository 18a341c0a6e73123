"""Benchmark: one Muon optimizer step on sharded matrices, lightning_ndclip's Muon against torch.optim.Muon on the same
DTensors and against AdamW (CPU, gloo).

``--matrices`` bias-free ``nn.Linear(D, D)`` layers (float32), tensor parallel over ``tp`` (alternately colwise and
rowwise: two layouts; ``--tp 1``: none) and FSDP2 over ``dp_shard`` (over tp: ``_StridedShard`` on the colwise ones),
on ``--world-size`` spawned ranks; gradients set once (the same values in every arm). Arms, each in fresh processes:

* ``ndclip``: ``lightning_ndclip.Muon``: each group of same-shaped matrices of one layout stacked, redistributed so
  every rank holds whole matrices, orthogonalized there (bfloat16 Newton-Schulz, torch's), redistributed back;
* ``torch_muon``: ``torch.optim.Muon`` on the same DTensor parameters: its Newton-Schulz runs on DTensors, which
  redistribute inside its matrix products;
* ``adamw``: ``torch.optim.AdamW`` (torch's default implementation for these tensors): elementwise, no
  communication.

Measured per step: wall time (median of ``--repeat`` steps after one warm-up step), the collectives DTensor issued
(``CommDebugMode``) and the growth of the process's peak RSS during one step (reset through ``/proc/self/clear_refs``
first), max over ranks. Run by hand (see README.md)::

    python benchmarks/bench_muon.py                     # 4 ranks (dp_shard=2 x tp=2), 100 and 1,000 matrices
    python benchmarks/bench_muon.py --tp 1 --out benchmarks/results/muon_4ranks_fsdp   # FSDP2 alone (dp_shard=4)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import machine, spawn_and_report  # benchmarks/_common.py
from bench_cp_memory import peak_mb, reset_peak_mb

ARMS = ("ndclip", "torch_muon", "adamw")
LABELS = {
    "ndclip": "lightning_ndclip.Muon",
    "torch_muon": "torch.optim.Muon on the DTensors",
    "adamw": "torch.optim.AdamW (no communication)",
}
RESULTS = Path(__file__).resolve().parent / "results"


def build(args):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (args.world_size // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.matrices)])
    if args.tp > 1:
        styles = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(args.matrices)}
        parallelize_module(model, mesh["tp"], styles)
    fully_shard(model, mesh=mesh["dp_shard"])
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.distributed.tensor.distribute_tensor(
            torch.randn(p.shape, generator=generator), p.device_mesh, p.placements
        )
    return model


def optimizer(arm: str, model):
    import lightning_ndclip as nd

    if arm == "ndclip":
        return nd.Muon(model.parameters(), lr=0.02)
    if arm == "torch_muon":
        return torch.optim.Muon(model.parameters(), lr=0.02)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def case(args) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model = build(args)
    opt = optimizer(args.arm, model)
    opt.step()  # warm-up: the optimizer's state exists before anything is measured
    dist.barrier()
    baseline = reset_peak_mb()
    with CommDebugMode() as comm:
        opt.step()
    grown = peak_mb() - baseline
    seconds = []
    for _ in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return {"s": statistics.median(seconds), "peak_mb": grown, "collectives": sum(counts.values()), "by_op": counts}


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    mine = case(args)
    gathered: list = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    if rank:
        return
    row = {"arm": args.arm, "matrices": args.matrices, "dim": args.dim, "s": max(r["s"] for r in gathered),
           "peak_mb": max(r["peak_mb"] for r in gathered), "collectives": gathered[0]["collectives"],
           "by_op": gathered[0]["by_op"]}  # fmt: skip
    print(f"{args.matrices:5d} matrices {args.arm:10s} {row['s'] * 1e3:9.1f} ms {row['collectives']:6d} collectives "
          f"peak +{row['peak_mb']:.0f} MB", flush=True)  # fmt: skip
    Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))


def write_markdown(data: dict, path: Path) -> None:
    a, world = argparse.Namespace(**data["args"]), data["world_size"]
    m = a.machine
    rows = {(r["matrices"], r["arm"]): r for r in data["rows"]}
    lines = [
        f"# One Muon step on sharded matrices, {world} ranks (dp_shard={world // a.tp} x tp={a.tp}, CPU, gloo, a thread each)",
        "",
        f"Bias-free `nn.Linear({a.dim}, {a.dim})` layers, float32, "
        + ("tensor parallel (alternately colwise and rowwise) and FSDP2 over tp" if a.tp > 1 else "FSDP2 alone")
        + "; gradients given. **s**: median wall time of a step over "
        f"{a.repeat} steps after a warm-up, max over ranks. **collectives**: what DTensor issued in one step "
        "(`CommDebugMode`). **peak MB**: the growth of the process's peak RSS during one step, max over ranks. "
        f"Measured {m['date']} on {m['cpus']} CPU cores ({m['cpu']}), torch {m['torch']}; {world} ranks share the "
        "cores. "
        + ("gloo has no all-to-all for DTensor, which falls back to all-gathers there (NCCL: all-to-all). " if a.tp > 1
           else "On one mesh dim lightning_ndclip.Muon exchanges by two all-to-alls of its own (c10d, which gloo has). ")
        + "See benchmarks/README.md.",
        "",
        "| matrices | optimizer | s per step | x AdamW | collectives | peak MB per rank |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted({r["matrices"] for r in data["rows"]}):
        floor = rows.get((n, "adamw"))
        for arm in ARMS:
            row = rows.get((n, arm))
            if row is None:
                continue
            ratio = f"{row['s'] / floor['s']:.1f}" if floor else "-"
            lines.append(f"| {n} | {LABELS[arm]} | {row['s']:.3f} | {ratio} | {row['collectives']} | {row['peak_mb']:.0f} |")
    ours, theirs = rows.get((max(r["matrices"] for r in data["rows"]), "ndclip")), None
    theirs = rows.get((ours["matrices"], "torch_muon")) if ours else None
    if ours and theirs:
        lines += ["", f"At {ours['matrices']} matrices, torch.optim.Muon on the DTensors takes "
                  f"{theirs['s'] / ours['s']:.1f}x the time of lightning_ndclip.Muon and issues "
                  f"{theirs['collectives'] / max(ours['collectives'], 1):.0f}x its collectives."]  # fmt: skip
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall, comm) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, arm in enumerate(ARMS):
        pts = sorted((r["matrices"], r["s"], r["collectives"]) for r in data["rows"] if r["arm"] == arm)
        if pts:
            n, sec, count = zip(*pts)
            wall.plot(n, sec, marker="o", color=f"C{k}", label=LABELS[arm])
            comm.plot(n, [max(c, 0.5) for c in count], marker="o", color=f"C{k}", label=LABELS[arm])
    wall.set(ylabel="s per optimizer step")
    comm.set(ylabel="collectives per step (AdamW: none, drawn at 0.5)")
    for ax in (wall, comm):
        ax.set(xscale="log", yscale="log", xlabel="matrices", title=f"Muon, {data['world_size']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--matrices", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "muon_4ranks"))
    args = p.parse_args()
    args.machine = machine()
    cases = [{"matrices": n, "arm": arm} for n in args.matrices for arm in args.arms]
    spawn_and_report(worker, args, Path(args.out), write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
