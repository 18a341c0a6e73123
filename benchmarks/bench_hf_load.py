"""Benchmark: per-rank peak memory of loading a Hugging Face checkpoint into a parallelized model (CPU, gloo).

A random-weight Llama of about 1 GB is saved once with ``save_pretrained`` in bfloat16 (sharded
safetensors), as models ship. Then, in freshly spawned ranks for every case, the model is made on
every rank and sharded with FSDP2 over all ranks:

* ``from_pretrained (float32)``: what the docs used to show, ``from_pretrained(dir, dtype=float32)``
  (float32 weights, as FSDP2 keeps them under mixed precision): every rank converts, so holds, the
  whole model before sharding it.
* ``from_pretrained (as stored)``: ``dtype="auto"``, bfloat16 weights: transformers maps the files,
  and a rank's memory grows only by the pages its shards touch (training then runs on bfloat16
  weights).
* ``meta + load (fsdp)``: built on the meta device in float32, sharded, then
  ``lightning_ndclip.load_hf_checkpoint``: each rank reads the slices its shards hold.
* ``meta + load (fsdp x tp)``: the same on ``dp_shard = W/2 x tp = 2`` with the model's own plan.

How memory is measured: once torch, transformers and the process group are up, each rank resets its
peak resident set size (``/proc/self/clear_refs``) and reads it (``VmHWM``), and reads it again after
the model is built, parallelized and loaded; the difference is what building and loading needed.
File pages that the loader maps count in it. Reported: the max over ranks, and the ratio to the
checkpoint's size. Wall time: building, parallelizing and loading, max over ranks.

Run by hand (see README.md)::

    python benchmarks/bench_hf_load.py                     # 4 ranks, ~1 GB model, ~3 min
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

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("from_pretrained (float32)", "from_pretrained (as stored)", "meta + load (fsdp)", "meta + load (fsdp x tp)")


def config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128, tie_word_embeddings=False,
    )  # fmt: skip


def peak_mb() -> float:
    """This address space's peak RSS (``VmHWM``; ``ru_maxrss`` would carry the launcher's peak across exec)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def reset_peak() -> None:
    """Make the peak the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_and_load(method: str, directory: str, args):
    from transformers import LlamaForCausalLM

    import lightning_ndclip as nd

    world = dist.get_world_size()
    tp = 2 if method.endswith("x tp)") else 1
    meshes = nd.ParallelDims(world_size=world, dp_shard=world // tp, tp=tp).build_mesh("cpu")
    units = ["LlamaDecoderLayer"]
    if method.startswith("from_pretrained"):
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32 if "float32" in method else "auto")
        nd.parallelize(model, meshes, fsdp_units=[type(model.model.layers[0])])
        return model
    with torch.device("meta"):
        model = LlamaForCausalLM(config(args))
    unit = [type(m) for m in model.modules() if type(m).__name__ in units]
    nd.parallelize(model, meshes, tp_plan="auto" if tp > 1 else None, fsdp_units=unit[:1])
    nd.load_hf_checkpoint(model, directory)
    return model


def worker(rank: int, args, port: int, out_json: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    import transformers  # noqa: F401  (imported before the baseline)

    import lightning_ndclip  # noqa: F401

    config(args)
    dist.barrier()
    reset_peak()
    baseline = peak_mb()
    t0 = time.perf_counter()
    model = build_and_load(args.method, args.directory, args)
    dist.barrier()
    mine = {"peak_mb": peak_mb() - baseline, "baseline_mb": baseline, "s": time.perf_counter() - t0}
    del model
    gathered: list = [None] * args.world_size
    dist.all_gather_object(gathered, mine)
    row = {"method": args.method, **{key: max(r[key] for r in gathered) for key in mine}, "per_rank": gathered}
    if rank == 0:
        print(f"{args.method:24s} peak +{row['peak_mb']:.0f} MB per rank, {row['s']:.1f} s", flush=True)
        Path(out_json).write_text(json.dumps({"world_size": args.world_size, "rows": [row]}, indent=1))
    dist.destroy_process_group()


def write_markdown(data: dict, path: Path) -> None:
    a, world = data["args"], data["world_size"]
    lines = [f"# Loading a {a['checkpoint_mb']:.0f} MB Hugging Face checkpoint, {world} ranks (CPU, gloo)", "",
             f"Random-weight Llama, {a['params'] / 1e6:.0f}M parameters, saved in bfloat16 with `save_pretrained` "
             f"({a['files']} safetensors files); weights made in float32 except 'as stored'. **peak MB**: growth of "
             "the rank's peak RSS while building, sharding and loading the model (max over ranks; mapped file pages "
             "count); fresh ranks per case. **model**: the whole model in the weights' dtype; **shard**: model / "
             "ranks, what FSDP2 leaves each rank. See README.md.", "",
             "| method | peak MB per rank | / model | / shard | s |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        model_mb = a["params"] * (2 if "as stored" in row["method"] else 4) / 2**20
        lines.append(f"| {row['method']} | {row['peak_mb']:.0f} | {row['peak_mb'] / model_mb:.2f} | "
                     f"{row['peak_mb'] / (model_mb / world):.2f} | {row['s']:.1f} |")
    path.write_text("\n".join(lines + [""]))


def write_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = data["rows"]
    ax.barh([r["method"] for r in rows], [r["peak_mb"] for r in rows])
    model_mb = data["args"]["params"] * 4 / 2**20
    ax.axvline(model_mb, color="k", linestyle=":", label="float32 model")
    ax.axvline(model_mb / data["world_size"], color="g", linestyle=":", label="float32 model / ranks")
    ax.set(xlabel="peak MB per rank (build + parallelize + load)", title=f"{data['world_size']} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args = p.parse_args()
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config(args)).to(torch.bfloat16)
        model.save_pretrained(directory, max_shard_size="300MB")
        files = sorted(Path(directory).glob("*.safetensors"))
        args.params = sum(p.numel() for p in model.parameters())
        args.checkpoint_mb = sum(f.stat().st_size for f in files) / 2**20
        args.files = len(files)
        del model
        args.directory = directory
        cases = [{"method": m} for m in args.methods]
        spawn_and_report(worker, args, RESULTS / f"hf_load_{args.world_size}ranks", write_markdown, write_plot, cases)


if __name__ == "__main__":
    main()
