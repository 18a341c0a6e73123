"""Benchmark: whole training steps of a 1B-class Llama on one GPU, Lightning + NDParallelStrategy against a plain loop.

One process, one device, one model (a ``transformers`` ``LlamaForCausalLM`` built from a config,
random weights, bfloat16 parameters, every decoder layer's ``forward`` compiled with
``torch.compile``), trained in turn by (same weights, a fresh optimizer each):

* ``plain``: a plain PyTorch loop: logits -> ``cross_entropy`` (float32, mean over valid tokens)
  -> backward -> ``torch.nn.utils.clip_grad_norm_(max_norm=1.0)`` -> ``AdamW(fused=True)`` step ->
  ``zero_grad``. Run twice (``plain`` first, ``plain (again)`` between the Lightning arms): their
  difference is the noise of this table.
* ``nd (no fsdp)``: ``L.Trainer`` with ``NDParallelStrategy(loss_normalization="token_mean")`` and
  ``GlobalNormClip(1.0, nonfinite="clip")`` (folded into the fused AdamW), the model left whole
  (a ``configure_model`` that parallelizes nothing: at world size 1 there is nothing to shard).
* ``nd (fsdp units)``: the same with the declarative plan ``ParallelPlan(fsdp_units=[LlamaDecoderLayer])``
  (FSDP2 over a 1-rank mesh: the layout the docs give for several GPUs, run on one).

Every arm: the same pinned-memory DataLoader of random tokens (3 % of the labels ``-100``),
``--warmup`` steps (the first compiles), then ``--steps`` timed steps between two
``torch.cuda.synchronize()`` (wall clock; CUDA events per step for the median), then
``--sync-steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` counting host
synchronizations (the batch's copy to the device, made before Lightning's ``on_train_batch_start``,
is outside them in the Lightning arms; the plain loop's is inside). After the first plain arm,
the norm of the model's real bf16 gradients is timed against one read of the same bytes (the
bandwidth floor). Run by hand (see README.md)::

    python benchmarks/bench_gpu_step.py                   # a GPU: 22 layers, hidden 2048, 1.1B parameters
    python benchmarks/bench_gpu_step.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --seq 32 --batch 2 --steps 3 --warmup 2 --out /tmp/res   # a dry run

Writes ``results/gpu_step_<card>.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"

# dense bf16 peak FLOP/s by device name (datasheet, without sparsity): the MFU denominator
PEAKS = [("h100 pcie", 756e12), ("h100 nvl", 835e12), ("h100", 989e12), ("h200", 989e12), ("gh200", 989e12),
         ("a100", 312e12), ("l40s", 362e12)]  # fmt: skip


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def peak_flops(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, value in PEAKS:
        if key in name.lower():
            return value
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048), tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def compile_layers(model, args: argparse.Namespace) -> str:
    """Compile every decoder layer's ``forward`` (the torchtitan way: per block, here without
    ``fullgraph``), as an instance attribute: module hooks (FSDP2's) stay outside the compiled code."""
    if not args.compile:
        return "off"
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # identical layers: one graph, but never fall back
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    if hasattr(dynamo_config, "accumulated_cache_size_limit"):
        dynamo_config.accumulated_cache_size_limit = max(512, dynamo_config.accumulated_cache_size_limit)
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, fullgraph=args.fullgraph)
    return f"per decoder layer (torch.compile, fullgraph={args.fullgraph})"


def uncompile_layers(model) -> None:
    for layer in model.model.layers:
        layer.__dict__.pop("forward", None)


def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames_ok": counters["frames"]["ok"],
        "recompiles": sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else None,
    }


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def make_loader(args: argparse.Namespace, batches: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (batches * args.batch, args.seq), generator=g)
    labels = torch.where(torch.rand(tokens.shape, generator=g) < 0.03, -100, tokens.roll(-1, 1))
    dataset = torch.utils.data.TensorDataset(tokens, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch, pin_memory=args.device == "cuda")


# ------------------------------------------------------------------------------------------ syncs


class SyncCounter:
    """Counts the host synchronizations ``torch.cuda.set_sync_debug_mode("warn")`` reports while on."""

    def __init__(self) -> None:
        self.on, self.count, self.where = False, 0, {}
        self._show = warnings.showwarning
        warnings.filterwarnings("always", message=".*synchroniz")
        warnings.showwarning = self._record

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" in str(message):
            if self.on:
                self.count += 1
                stack = [f for f in traceback.extract_stack()[:-2] if "torch" not in f.filename] or traceback.extract_stack()
                frame = stack[-1]
                key = f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
                self.where[key] = self.where.get(key, 0) + 1
            return
        self._show(message, category, filename, lineno, file, line)

    def start(self) -> None:
        self.on = True
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self.on = False

    def take(self) -> tuple[int, dict]:
        out = (self.count, dict(self.where))
        self.count, self.where = 0, {}
        return out


# ------------------------------------------------------------------------------------------ timing


class Timeline:
    """Per-step marks: a CUDA event (or the host clock on CPU) at the start of every timed step and
    after the last; wall clock between a synchronize before the first and after the last."""

    def __init__(self, device: str, warmup: int, steps: int) -> None:
        self.device, self.warmup, self.steps = device, warmup, steps
        self.events: list = []
        self.t0 = self.t1 = None

    def step_start(self, i: int) -> None:
        if i == self.warmup:
            synchronize(self.device)
            self.t0 = time.perf_counter()
        if self.warmup <= i <= self.warmup + self.steps:
            self.mark()

    def step_end(self, i: int) -> None:
        if i == self.warmup + self.steps - 1:
            self.mark()
            synchronize(self.device)
            self.t1 = time.perf_counter()

    def mark(self) -> None:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.events.append(time.perf_counter())

    def result(self, tokens_per_step: int) -> dict:
        marks = self.events[: self.steps + 1]
        if self.device == "cuda":
            per_step = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        else:
            per_step = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        wall = self.t1 - self.t0
        return {
            "wall_s": wall,
            "step_ms_wall": 1e3 * wall / self.steps,
            "step_ms_median": statistics.median(per_step),
            "step_ms_min": min(per_step),
            "step_ms_max": max(per_step),
            "tokens_per_s": tokens_per_step * self.steps / wall,
        }


# ------------------------------------------------------------------------------------------ arms


def run_plain(model, args: argparse.Namespace, syncs: SyncCounter, norm_check: bool) -> dict:
    device = args.device
    total = args.warmup + args.steps + args.sync_steps
    loader = make_loader(args, total)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    timeline = Timeline(device, args.warmup, args.steps)
    first_step_s = None
    for i, (tokens, labels) in enumerate(loader):
        if i == args.warmup + args.steps:
            syncs.start()
        t = time.perf_counter()
        timeline.step_start(i)
        tokens = tokens.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = loss_fn(logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timeline.step_end(i)
        if i == 0:
            synchronize(device)
            first_step_s = time.perf_counter() - t
    syncs.stop()
    out = timeline.result(args.batch * args.seq)
    count, where = syncs.take()
    out.update(first_step_s=first_step_s, syncs_per_step=count / max(args.sync_steps, 1), sync_sites=where,
               final_loss=float(loss.detach()))  # fmt: skip
    if norm_check:
        out["local_norm"] = local_norm_check(model, loader, args)
    del optimizer
    return out


def local_norm_check(model, loader, args: argparse.Namespace) -> dict:
    """The norm of this model's real gradients (one more backward, no step): ndclip's local norm and
    torch's against one read of the same bytes in one flat buffer (the bandwidth floor)."""
    from bench_local_norm import timed

    import lightning_ndclip as nd

    tokens, labels = next(iter(loader))
    loss_fn(model(input_ids=tokens.to(args.device), use_cache=False).logits, labels.to(args.device)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    nbytes = flat.numel() * flat.element_size()
    reps = 20 if args.device == "cuda" else 3
    row = {
        "reps": reps,
        "tensors": len(grads),
        "dtype": str(flat.dtype),
        "GB": nbytes / 1e9,
        "floor_ms": timed(lambda: torch.linalg.vector_norm(flat), reps, args.device),
        "ndclip_ms": timed(lambda: nd.get_total_norm(grads), reps, args.device),
        "torch_ms": timed(lambda: torch.nn.utils.get_total_norm(grads), reps, args.device),
    }
    row["floor_GBps"] = nbytes / 1e6 / row["floor_ms"]
    row["ndclip_pct_of_floor"] = 100 * row["floor_ms"] / row["ndclip_ms"]
    row["torch_pct_of_floor"] = 100 * row["floor_ms"] / row["torch_ms"]
    flat = grads = None  # free before the next arm
    model.zero_grad(set_to_none=True)
    return row


def run_lightning(model, args: argparse.Namespace, syncs: SyncCounter, fsdp: bool) -> dict:
    import lightning as L
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import lightning_ndclip as nd

    total = args.warmup + args.steps + args.sync_steps
    loader = make_loader(args, total)
    timeline = Timeline(args.device, args.warmup, args.steps)
    lr = args.lr
    state: dict = {}

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = model

        def count_tokens(self, batch) -> torch.Tensor:
            return (batch[1] != -100).sum()

        def training_step(self, batch, batch_idx):
            tokens, labels = batch
            loss = loss_fn(self.llama(input_ids=tokens, use_cache=False).logits, labels)
            state["loss"] = loss
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0, fused=True)

        def train_dataloader(self):
            return loader

    class Whole(LM):
        def configure_model(self) -> None:  # world size 1: nothing to shard
            pass

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:
                state["t_first"] = time.perf_counter()
            if batch_idx == args.warmup + args.steps:
                syncs.start()
            timeline.step_start(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            timeline.step_end(batch_idx)
            if batch_idx == 0:
                synchronize(args.device)
                state["first_step_s"] = time.perf_counter() - state["t_first"]
            syncs.stop()

    plan = nd.ParallelPlan(fsdp_units=[LlamaDecoderLayer]) if fsdp else None
    strategy = nd.NDParallelStrategy(plan=plan, loss_normalization="token_mean", summary=False)
    clip = nd.GlobalNormClip(1.0, nonfinite=args.nonfinite)
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, strategy=strategy,
        precision=args.precision, max_steps=total, callbacks=[clip, Timer()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(LM() if fsdp else Whole())
    out = timeline.result(args.batch * args.seq)
    count, where = syncs.take()
    out.update(first_step_s=state.get("first_step_s"), syncs_per_step=count / max(args.sync_steps, 1),
               sync_sites=where, final_loss=float(state["loss"].detach()), clipped_steps=clip.clipped_steps,
               seen_steps=clip.seen_steps)  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ report


def write_markdown(data: dict, path: Path) -> None:
    a = data["args"]
    p = data["params"]
    peak = data["peak_flops"]
    lines = [
        f"# Whole training step on {data['device']}: Lightning + NDParallelStrategy against a plain loop",
        "",
        f"torch {data['versions']['torch']}, Lightning {data['versions']['lightning']}, transformers "
        f"{data['versions']['transformers']}, Python {data['versions']['python']}. `LlamaForCausalLM` from a config: "
        f"{a['layers']} layers, hidden {a['hidden']}, intermediate {a['intermediate']}, {a['heads']} heads "
        f"({a['kv_heads']} key/value), vocab {a['vocab']}: {p['total'] / 1e9:.3f}B parameters in bfloat16 "
        f"(SDPA attention); batch {a['batch']} x {a['seq']} tokens per step; compile: {data['compile']}; "
        f"AdamW(fused=True, lr={a['lr']}); Lightning precision {a['precision']!r}, "
        f"GlobalNormClip(1.0, nonfinite={a['nonfinite']!r}). {a['warmup']} warm-up steps, {a['steps']} timed "
        f"steps, {a['sync_steps']} steps counting host syncs. `python benchmarks/bench_gpu_step.py` "
        f"(see benchmarks/README.md).",
        "",
        "| arm | tokens/s | step ms (wall) | step ms (median, events) | MFU (6N) | MFU (6N' + attn) | "
        "vs plain | host syncs/step | first step s | peak GB | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = data["plain_tokens_per_s"]
    for name, r in data["arms"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} |" + " |" * 10)
            continue
        mfu = f"{100 * r['mfu_6n']:.1f} %" if r.get("mfu_6n") is not None else "n/a"
        mfu2 = f"{100 * r['mfu_attn']:.1f} %" if r.get("mfu_attn") is not None else "n/a"
        ratio = f"{r['tokens_per_s'] / ref:.3f}x" if ref else "n/a"
        peak_gb = f"{r['peak_GB']:.1f}" if r.get("peak_GB") is not None else "n/a"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "n/a"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms_wall']:.1f} | {r['step_ms_median']:.1f} | {mfu} | {mfu2} "
            f"| {ratio} | {r['syncs_per_step']:g} | {first} | {peak_gb} | {r['final_loss']:.4f} |"
        )
    lines += [
        "",
        f"MFU (6N): 6 x {p['total'] / 1e9:.3f}B x tokens/s over the card's dense bf16 peak "
        + (f"({peak / 1e12:.0f} TFLOP/s, datasheet)" if peak else "(unknown card: n/a)")
        + f"; (6N' + attn): N' without the input embedding ({p['non_embedding'] / 1e9:.3f}B), plus causal attention "
        f"6 x layers x seq x hidden per token. 'vs plain': tokens/s over the mean of the plain arms' "
        f"({ref:,.0f} tokens/s); the two plain runs' difference is this table's noise. Host syncs: from "
        "`torch.cuda.set_sync_debug_mode('warn')` over the sync steps (Lightning arms: from "
        "`on_train_batch_start`, after the batch's copy to the device; plain: the whole step).",
    ]
    if data.get("local_norm"):
        n = data["local_norm"]
        lines += [
            "",
            f"Local norm of this model's bf16 gradients ({n['tensors']} tensors, {n['GB']:.2f} GB), median of {n['reps']}: "
            f"floor (one `vector_norm` over one flat buffer) {n['floor_ms']:.3f} ms ({n['floor_GBps']:.0f} GB/s); "
            f"`nd.get_total_norm` {n['ndclip_ms']:.3f} ms = {n['ndclip_pct_of_floor']:.0f} % of the floor's bandwidth; "
            f"`torch.nn.utils.get_total_norm` {n['torch_ms']:.3f} ms = {n['torch_pct_of_floor']:.0f} %.",
        ]
    lines += ["", "Compile counters (torch._dynamo, cumulative after each arm): "
              + "; ".join(f"{k}: {v.get('dynamo')}" for k, v in data["arms"].items()), ""]  # fmt: skip
    sites = {k: v["sync_sites"] for k, v in data["arms"].items() if v.get("sync_sites")}
    if sites:
        lines += ["Sync sites: " + "; ".join(f"{k}: {v}" for k, v in sites.items()), ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per arm (the first compiles)")
    parser.add_argument("--sync-steps", type=int, default=2, help="steps after the timed ones counting host syncs")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile every decoder layer (default: on CUDA only)")  # fmt: skip
    parser.add_argument("--fullgraph", action="store_true")
    parser.add_argument("--precision", default="bf16-true", help="the Lightning arms' (the model is bf16 already)")
    parser.add_argument("--nonfinite", default="clip", choices=["clip", "skip", "raise"], help="GlobalNormClip's")
    parser.add_argument("--arms", nargs="+", default=["plain", "nd_whole", "plain_again", "nd_fsdp"],
                        choices=["plain", "nd_whole", "plain_again", "nd_fsdp"])  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (default: from its name)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.compile is None:
        args.compile = args.device == "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import lightning
    import transformers

    t_start = time.perf_counter()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    peak = peak_flops(device_name, args.peak_tflops) if args.device == "cuda" else None
    model = build_model(args)
    params = count_params(model)
    print(f"{device_name}: {params['total'] / 1e9:.3f}B parameters, build {time.perf_counter() - t_start:.1f} s", flush=True)
    compiled = compile_layers(model, args)
    syncs = SyncCounter()
    tokens_per_step = args.batch * args.seq
    flops_6n = 6 * params["total"]
    flops_attn = 6 * params["non_embedding"] + 6 * args.layers * args.seq * args.hidden
    data: dict = {
        "device": device_name, "peak_flops": peak, "compile": compiled, "params": params,
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "arms": {}, "local_norm": None, "tokens_per_step": tokens_per_step,
    }  # fmt: skip
    names = {"plain": "plain", "plain_again": "plain (again)", "nd_whole": "nd (no fsdp)", "nd_fsdp": "nd (fsdp units)"}
    for arm in args.arms:
        name = names[arm]
        print(f"--- {name} ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        r = run_arm(arm, model, args, syncs)
        if "error" in r and args.compile and r.get("compile_failed"):  # once: the rest of the run in eager mode
            data["compile"] += f"; failed in {name} ({r['error'][:300]}): eager from then on"
            args.compile = False
            uncompile_layers(model)
            torch._dynamo.reset()
            r = run_arm(arm, model, args, syncs)
        r["arm_s"] = time.perf_counter() - t
        r["dynamo"] = dynamo_counts() if args.compile else None
        if args.device == "cuda":
            r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        if "tokens_per_s" in r:
            r["mfu_6n"] = flops_6n * r["tokens_per_s"] / peak if peak else None
            r["mfu_attn"] = flops_attn * r["tokens_per_s"] / peak if peak else None
            if r.get("local_norm"):
                data["local_norm"] = r.pop("local_norm")
        data["arms"][name] = r
        print(json.dumps({k: v for k, v in r.items() if k != "sync_sites"}, default=str), flush=True)
        gc.collect()
        report(data, args, t_start)  # after every arm: a run cut short keeps the arms it finished
    print(Path(report(data, args, t_start)).read_text())


def run_arm(arm: str, model, args: argparse.Namespace, syncs: SyncCounter) -> dict:
    """One arm; an exception is recorded (and the next arm runs), flagged when compiling raised it."""
    try:
        if arm.startswith("plain"):
            model.to(args.device)  # a Lightning arm's teardown moved it to the CPU
            return run_plain(model, args, syncs, norm_check=arm == "plain")
        return run_lightning(model, args, syncs, fsdp=arm == "nd_fsdp")
    except Exception as error:  # noqa: BLE001
        syncs.stop()
        text = traceback.format_exc()
        print(text, flush=True)
        compile_failed = any(k in text for k in ("torch/_dynamo", "torch/_inductor", "BackendCompilerFailed"))
        return {"error": f"{type(error).__name__}: {error}", "compile_failed": compile_failed}


def report(data: dict, args: argparse.Namespace, t_start: float) -> str:
    plain = [r["tokens_per_s"] for k, r in data["arms"].items() if k.startswith("plain") and "tokens_per_s" in r]
    data["plain_tokens_per_s"] = statistics.mean(plain) if plain else None
    data["total_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"gpu_step_{slug(data['device'])}"
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    write_markdown(data, Path(f"{stem}.md"))
    print(f"{data['total_s']:.0f} s; wrote {stem}.md/.json", flush=True)
    return f"{stem}.md"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_local_norm's timer
    main()
