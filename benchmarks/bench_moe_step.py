"""One training step of a transformers MoE on 4 CPU ranks: experts over ``ep``, ``tp``, both, or FSDP2 alone.

The same random-weight Qwen3-MoE (``--experts`` experts, top-2) and the same global batch in every layout; a step
is forward, cross-entropy, backward, ``lightning_ndclip.clip_grad_norm_`` and AdamW. Per layout: the median step
time (max over ranks), the peak RSS growth per rank from before the model is built (max over ranks), and the
share of the step spent in the token exchange of expert parallelism (``TokenRoute``: the count and id
all-to-alls, and the row all-to-alls there and back, forward and backward; max over ranks).

    python benchmarks/bench_moe_step.py                 # the committed table, ~3 min on 2 cores
    python benchmarks/bench_moe_step.py --layers 1 --steps 2 --warmup 1 --hidden 64   # a quick check

Writes ``benchmarks/results/moe_step_4ranks.{md,png,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import spawn_and_report

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = {  # name: (dp_shard, tp, ep)
    "FSDP2 alone (dp_shard=4)": (4, 1, 1),
    "experts over tp (dp_shard=2 x tp=2)": (2, 2, 1),
    "experts over ep (dp_shard=4 x ep=2)": (4, 1, 2),
    "experts over ep (dp_shard=4 x ep=4)": (4, 1, 4),
    "experts over ep x tp (dp_shard=2 x tp=2 x ep=2)": (2, 2, 2),
}


def peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class _ExchangeClock:
    """Wall time inside ``TokenRoute`` (forward calls, and the backward of its two differentiable all-to-alls,
    from the gradient reaching the exchange's output to its input's)."""

    def __init__(self) -> None:
        from lightning_ndclip.core.parallel import expert_parallel

        self.seconds = 0.0
        route = expert_parallel.TokenRoute
        init, send, receive = route.__init__, route.send, route.receive
        clock = self

        def timed_init(self, *args, **kwargs):
            t0 = time.perf_counter()
            init(self, *args, **kwargs)
            clock.seconds += time.perf_counter() - t0

        def timed(method):
            def call(self, rows):
                t0 = time.perf_counter()
                out = method(self, rows)
                clock.seconds += time.perf_counter() - t0
                if out.requires_grad:
                    started: list[float] = []
                    out.register_hook(lambda g: started.append(time.perf_counter()))
                    rows.register_hook(lambda g: clock.add_since(started))
                return out

            return call

        route.__init__, route.send, route.receive = timed_init, timed(send), timed(receive)

    def add_since(self, started: list[float]) -> None:
        if started:
            self.seconds += time.perf_counter() - started.pop()


def build(args, dp_shard: int, tp: int, ep: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import lightning_ndclip as nd

    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 2, moe_intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        num_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    meshes = nd.ParallelDims(world_size=dist.get_world_size(), dp_shard=dp_shard, tp=tp, ep=ep).build_mesh("cpu")
    auto = "auto" if tp > 1 or ep > 1 else None
    nd.parallelize(model, meshes, tp_plan=auto, fsdp_units=[type(model.model.layers[0])])
    return model, meshes


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    import transformers  # noqa: F401  (imported before the baseline)

    import lightning_ndclip as nd

    clock = _ExchangeClock()
    dp_shard, tp, ep = LAYOUTS[args.layout]
    dist.barrier()
    reset_peak()
    baseline = peak_mb()
    model, meshes = build(args, dp_shard, tp, ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_rank = args.global_batch // dp_shard
    g = torch.Generator().manual_seed(meshes["dp"].get_local_rank())
    times, exchange = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 4096, (per_rank, args.seq), generator=g)
        clock.seconds = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        nd.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            exchange.append(clock.seconds)
    mine = {"step_s": statistics.median(times), "exchange_s": statistics.median(exchange), "peak_mb": peak_mb() - baseline}
    gathered: list = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    row = {"layout": args.layout, **{k: max(r[k] for r in gathered) for k in mine}, "per_rank": gathered}
    if rank == 0:
        print(f"{args.layout:40s} {row['step_s'] * 1e3:7.0f} ms  exchange {row['exchange_s'] * 1e3:5.0f} ms  "
              f"peak +{row['peak_mb']:.0f} MB", flush=True)  # fmt: skip
        data = {"world_size": args.world_size, "params": params, "expert_params": expert_params, "rows": [row]}
        Path(out_json).write_text(json.dumps(data, indent=1))
    dist.destroy_process_group()


def write_markdown(data: dict, path: Path) -> None:
    a = data["args"]
    lines = [
        f"# One MoE training step, {data['world_size']} ranks (CPU, gloo)", "",
        f"Qwen3-MoE, {data['params'] / 1e6:.1f}M parameters ({data['expert_params'] / 1e6:.1f}M in experts): "
        f"{a['layers']} layers, hidden {a['hidden']}, {a['experts']} experts of width {2 * a['hidden']}, top-2; "
        f"{a['global_batch']} sequences of {a['seq']} tokens per step. Step = forward, cross-entropy, backward, "
        "`clip_grad_norm_`, AdamW; median over the timed steps, max over ranks. **exchange**: wall time in the "
        "token exchange (all-to-alls forward and backward). **peak MB**: peak RSS growth per rank from before the "
        "model is built. See benchmarks/README.md.", "",
        "| layout | step ms | exchange ms | exchange share | peak MB per rank |", "|---|---|---|---|---|",
    ]  # fmt: skip
    for row in data["rows"]:
        share = row["exchange_s"] / row["step_s"]
        lines.append(f"| {row['layout']} | {row['step_s'] * 1e3:.0f} | {row['exchange_s'] * 1e3:.0f} | {share:.0%} | "
                     f"{row['peak_mb']:.0f} |")  # fmt: skip
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    names = [r["layout"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    left.barh(names, [r["step_s"] * 1e3 for r in rows], label="step")
    left.barh(names, [r["exchange_s"] * 1e3 for r in rows], label="token exchange")
    left.set(xlabel="ms per step (max over ranks)")
    left.legend()
    right.barh(names, [r["peak_mb"] for r in rows])
    right.set(xlabel="peak MB per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    stem = RESULTS / f"moe_step_{args.world_size}ranks{'_' + args.tag if args.tag else ''}"
    spawn_and_report(worker, args, stem, write_markdown, write_plot, cases=[{"layout": name} for name in args.layouts])


if __name__ == "__main__":
    main()
