"""Benchmark: per-rank peak memory of loading a Hugging Face checkpoint into a parallelized model (CPU, gloo).

A random-weight model is saved once with ``save_pretrained`` in bfloat16 (sharded safetensors), as
models ship: a Llama of about 1 GB (``--model llama``), or a Qwen3-MoE of about 0.5 GB whose experts
hold most of the weights (``--model moe``; one tensor per expert and projection on disk, as the hub
ships them, packed into ``experts.gate_up_proj`` / ``experts.down_proj`` in the model). Then, in
freshly spawned ranks for every case, the model is made on every rank and parallelized over all ranks,
each decoder layer one FSDP2 unit:

* ``from_pretrained (float32)``: what the docs used to show, ``from_pretrained(dir, dtype=float32)``
  (float32 weights, as FSDP2 keeps them under mixed precision), sharded with FSDP2: every rank
  converts, so holds, the whole model before sharding it.
* ``from_pretrained (as stored)`` (Llama): ``dtype="auto"``, bfloat16 weights: transformers maps the
  files, and a rank's memory grows only by the pages its shards touch (training then runs on
  bfloat16 weights).
* ``meta + load (fsdp)``: built on the meta device in float32, sharded with FSDP2 over all ranks,
  then ``lightning_ndclip.load_hf_checkpoint``: each rank reads the slices its shards hold.
* ``meta + load (fsdp x tp)``: the same on ``dp_shard = W/2 x tp = 2`` with the model's own plan
  (MoE: every expert split over ``tp`` along its intermediate width, each rank reading its rows of
  the gate and of the up projection of every expert, and its columns of the down projection).
* ``meta + load (fsdp x ep)`` (MoE): ``dp_shard = W x ep = 2``, whole experts over ``ep``, FSDP2
  over ``edp``: each rank reads its own experts' tensors only.

``--model wan``: a diffusers ``WanTransformer3DModel`` (Wan 2.1 1.3B's widths, fewer blocks), each block one
FSDP2 unit, loaded with ``lightning_ndclip.load_diffusers_checkpoint``:

* ``whole model (float32)``: built in float32 on every rank, the checkpoint loaded into it, then sharded
  (what diffusers' ``from_pretrained`` then ``fully_shard`` costs each rank).
* ``meta + load (fsdp)`` / ``meta + load (fsdp x cp)``: built on the meta device, sharded with FSDP2 over
  all ranks (``dp_shard = W``, or ``dp_shard = W/2 x cp = 2``: FSDP2 shards over both), then loaded.

How memory is measured: once torch, transformers and the process group are up, each rank resets its
peak resident set size (``/proc/self/clear_refs``) and reads it (``VmHWM``), and reads it again after
the model is built, parallelized and loaded; the difference is what building and loading needed.
File pages that the loader maps count in it. Reported: the max over ranks, and its ratio to the
rank's shard (the bytes of its own local parameters and buffers, measured; max over ranks) and to
the whole model. Wall time: building, parallelizing and loading, max over ranks.

Run by hand (see README.md)::

    python benchmarks/bench_hf_load.py                     # 4 ranks, ~1 GB Llama, ~3 min
    python benchmarks/bench_hf_load.py --model moe         # 4 ranks, ~0.5 GB Qwen3-MoE, ~2 min
    python benchmarks/bench_hf_load.py --model wan         # 4 ranks, ~0.7 GB diffusers Wan
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import spawn_and_report  # benchmarks/_common.py
from torch.distributed.tensor import DTensor

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = {
    "llama": ("from_pretrained (float32)", "from_pretrained (as stored)", "meta + load (fsdp)", "meta + load (fsdp x tp)"),
    "moe": ("from_pretrained (float32)", "meta + load (fsdp)", "meta + load (fsdp x ep)", "meta + load (fsdp x tp)"),
    "wan": ("whole model (float32)", "meta + load (fsdp)", "meta + load (fsdp x cp)"),
}
NAMES = {"llama": "Llama", "moe": "Qwen3-MoE (per-expert)", "wan": "Wan (diffusers)"}
DEFAULTS = {  # --hidden, --intermediate (the MoE's: per expert) of each model
    "llama": {"hidden": 2048, "intermediate": 5632},
    "moe": {"hidden": 1024, "intermediate": 512},
    "wan": {"hidden": 1536, "intermediate": 8960},
}


def config(args):
    if args.model == "wan":  # the keyword arguments of WanTransformer3DModel
        return dict(
            patch_size=(1, 2, 2), num_attention_heads=args.hidden // 128, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=args.intermediate, num_layers=args.layers,
            cross_attn_norm=True,
        )  # fmt: skip
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
        tie_word_embeddings=False,
    )  # fmt: skip
    if args.model == "llama":
        kv_heads = args.hidden // 128
        return LlamaConfig(vocab_size=32000, intermediate_size=args.intermediate, num_key_value_heads=kv_heads, **common)
    return Qwen3MoeConfig(
        vocab_size=8000, moe_intermediate_size=args.intermediate, num_experts=args.experts, num_experts_per_tok=2,
        num_key_value_heads=args.hidden // 256, head_dim=128, **common,
    )  # fmt: skip


def model_class(args):
    if args.model == "wan":
        from diffusers import WanTransformer3DModel

        return lambda cfg: WanTransformer3DModel(**cfg)
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    return LlamaForCausalLM if args.model == "llama" else Qwen3MoeForCausalLM


def peak_mb() -> float:
    """This address space's peak RSS (``VmHWM``; ``ru_maxrss`` would carry the launcher's peak across exec)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def reset_peak() -> None:
    """Make the peak the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def shard_mb(model: torch.nn.Module) -> float:
    """The bytes of this rank's own parameters and buffers (local shards of DTensors), each tensor once."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def build_and_load(method: str, directory: str, args):
    import lightning_ndclip as nd

    world = dist.get_world_size()
    layout = method[method.index("(") + 1 : -1]
    tp, ep, cp = (2 if layout == "fsdp x tp" else 1), (2 if layout == "fsdp x ep" else 1), (2 if layout == "fsdp x cp" else 1)
    meshes = nd.ParallelDims(world_size=world, dp_shard=world // (tp * cp), tp=tp, ep=ep, cp=cp).build_mesh("cpu")
    if args.model == "wan":
        if method.startswith("whole"):
            model = model_class(args)(config(args))
            nd.load_diffusers_checkpoint(model, directory)
            nd.parallelize(model, meshes, fsdp_units=[type(model.blocks[0])])
            return model
        with torch.device("meta"):
            model = model_class(args)(config(args))
        nd.ParallelPlan(fsdp_units=[type(model.blocks[0])]).apply(model, meshes)
        nd.load_diffusers_checkpoint(model, directory)
        return model
    if method.startswith("from_pretrained"):
        model = model_class(args).from_pretrained(directory, dtype=torch.float32 if "float32" in method else "auto")
        nd.parallelize(model, meshes, fsdp_units=[type(model.model.layers[0])])
        return model
    with torch.device("meta"):
        model = model_class(args)(config(args))
    plan = nd.ParallelPlan(tp_plan="auto" if tp > 1 or ep > 1 else None, fsdp_units=[type(model.model.layers[0])])
    plan.apply(model, meshes)
    nd.load_hf_checkpoint(model, directory)
    return model


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    __import__("diffusers" if args.model == "wan" else "transformers")  # imported before the baseline

    import lightning_ndclip  # noqa: F401

    config(args)
    dist.barrier()
    reset_peak()
    baseline = peak_mb()
    t0 = time.perf_counter()
    model = build_and_load(args.method, args.directory, args)
    dist.barrier()
    mine = {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "s": time.perf_counter() - t0, "shard_mb": shard_mb(model)}
    del model
    gathered: list = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    row = {"method": args.method, **{key: max(r[key] for r in gathered) for key in mine}, "per_rank": gathered}
    if rank == 0:
        peak, shard = row["peak_mb"], row["shard_mb"]
        print(f"{args.method:24s} peak +{peak:.0f} MB per rank, shard {shard:.0f} MB, {row['s']:.1f} s", flush=True)
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))
    dist.destroy_process_group()


def _described(a: dict) -> str:
    if a["model"] == "llama":
        return f"Random-weight Llama, {a['params'] / 1e6:.0f}M parameters"
    if a["model"] == "wan":
        return f"Random-weight diffusers Wan ({a['layers']} blocks of width {a['hidden']}), {a['params'] / 1e6:.0f}M parameters"
    share = a["expert_params"] / a["params"]
    return (
        f"Random-weight Qwen3-MoE, {a['params'] / 1e6:.0f}M parameters, {a['expert_params'] / 1e6:.0f}M of them "
        f"({share:.0%}) in {a['experts']} experts per layer x {a['layers']} layers, stored one tensor per expert and "
        "projection (as the hub ships them) and packed in the model"
    )


def write_markdown(data: dict, path: Path) -> None:
    a, world = data["args"], data["world_size"]
    as_stored = " except 'as stored'" if any("as stored" in row["method"] for row in data["rows"]) else ""
    lines = [f"# Loading a {a['checkpoint_mb']:.0f} MB Hugging Face checkpoint, {world} ranks (CPU, gloo)", "",
             f"{_described(a)}, saved in bfloat16 with `save_pretrained` ({a['files']} safetensors files); weights "
             f"made in float32{as_stored}. **peak MB**: growth of the rank's peak RSS while building, "
             "sharding and loading the model (max over ranks; mapped file pages count); fresh ranks per case. "
             "**shard MB**: the rank's own parameters and buffers (its local shards; max over ranks). **model**: "
             "the whole model in the weights' dtype. See README.md.", "",
             "| method | peak MB per rank | shard MB | / shard | / model | s |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in data["rows"]:
        model_mb = a["params"] * (2 if "as stored" in row["method"] else 4) / 2**20
        lines.append(f"| {row['method']} | {row['peak_mb']:.0f} | {row['shard_mb']:.0f} | "
                     f"{row['peak_mb'] / row['shard_mb']:.2f} | {row['peak_mb'] / model_mb:.2f} | {row['s']:.1f} |")  # fmt: skip
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = data["rows"]
    ax.barh([r["method"] for r in rows], [r["peak_mb"] for r in rows], label="peak MB per rank")
    ax.scatter([r["shard_mb"] for r in rows], [r["method"] for r in rows], color="g", marker="|", s=300, label="shard MB")
    ax.axvline(data["args"]["params"] * 4 / 2**20, color="k", linestyle=":", label="float32 model")
    title = f"{NAMES[data['args']['model']]} checkpoint into the shards, {data['world_size']} ranks"
    ax.set(xlabel="peak MB per rank (build + parallelize + load)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(METHODS), default="llama")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--hidden", type=int, help="default: 2048 (llama), 1024 (moe)")
    p.add_argument("--intermediate", type=int, help="default: 5632 (llama), 512 per expert (moe)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16, help="moe: experts per layer")
    p.add_argument("--methods", nargs="+", choices=sorted({m for ms in METHODS.values() for m in ms}))
    args = p.parse_args()
    for key, value in DEFAULTS[args.model].items():
        setattr(args, key, getattr(args, key) if getattr(args, key) is not None else value)
    args.methods = args.methods or list(METHODS[args.model])
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model = model_class(args)(config(args)).to(torch.bfloat16)
        model.save_pretrained(directory, max_shard_size="300MB")
        files = sorted(Path(directory).glob("*.safetensors"))
        args.params = sum(p.numel() for p in model.parameters())
        args.expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        args.checkpoint_mb = sum(f.stat().st_size for f in files) / 2**20
        args.files = len(files)
        del model
        args.directory = directory
        cases = [{"method": m} for m in args.methods]
        stem = f"hf_load_{args.world_size}ranks" if args.model == "llama" else f"hf_load_{args.model}_{args.world_size}ranks"
        spawn_and_report(worker, args, RESULTS / stem, write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
