"""diffusers checkpoints into and out of the shards: a tiny Wan written by diffusers' own ``save_pretrained`` (sharded,
with its index) is loaded into a model built on the meta device and parallelized on dp_shard=2 x cp=2, bit for bit,
its rotary tables (buffers the checkpoint does not store) computed as its constructor computes them; written back from
the shards by ``save_diffusers_checkpoint``, diffusers' ``from_pretrained`` on one process reads it bit for bit; a
checkpoint of another configuration is refused on every rank, naming the tensors."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch.distributed.tensor import DTensor

diffusers = pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

import lightning_ndclip as nd  # noqa: E402

INDEX = "diffusion_pytorch_model.safetensors.index.json"

CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
)  # fmt: skip


def _wan(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**{**CONFIG, **changes}).double()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _load_and_save(source: str, target: str) -> dict:
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**CONFIG).double()
    meshes = nd.ParallelDims(world_size=dist.get_world_size(), dp_shard=2, cp=2).build_mesh("cpu")
    nd.parallelize(model, meshes, tp_plan="auto")  # cut over cp, each block an FSDP2 unit
    nd.load_diffusers_checkpoint(model, source)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    nd.save_diffusers_checkpoint(model, target, max_shard_bytes=20_000)
    return {"sharded": sharded, "state": {n: _whole(t) for n, t in model.state_dict().items()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}  # fmt: skip


def test_a_sharded_save_pretrained_directory_loads_into_the_shards_and_saves_back_for_from_pretrained(tmp_path):
    original = _wan()
    original.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    assert (tmp_path / "in" / INDEX).exists()  # several files
    results = run_on_ranks(4, _load_and_save, str(tmp_path / "in"), str(tmp_path / "out"))
    expected = original.state_dict()
    for result in results:
        assert result["sharded"]
        assert result["state"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
        for name, buffer in original.named_buffers():  # not in the checkpoint: computed, not left as memory
            assert torch.equal(result["buffers"][name], buffer), name
    ours, theirs = (json.loads((tmp_path / d / INDEX).read_text()) for d in ("out", "in"))
    assert len(set(ours["weight_map"].values())) > 1 and set(ours["weight_map"]) == set(theirs["weight_map"])
    assert all(re.fullmatch(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors", f) for f in ours["weight_map"].values())
    reloaded = {}  # what from_pretrained reads: the index's files (its own call needs accelerate for Wan's fp32 modules)
    for file in set(ours["weight_map"].values()):
        reloaded.update(load_file(tmp_path / "out" / file))
    assert reloaded.keys() == expected.keys() and all(torch.equal(reloaded[n], v) for n, v in expected.items())
    assert diffusers.WanTransformer3DModel.load_config(tmp_path / "out") == diffusers.WanTransformer3DModel.load_config(
        tmp_path / "in"
    )


def _load_mismatched(source: str) -> str:
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**CONFIG)
    meshes = nd.ParallelDims(world_size=dist.get_world_size(), dp_shard=2).build_mesh("cpu")
    nd.parallelize(model, meshes)
    with pytest.raises(ValueError) as error:
        nd.load_diffusers_checkpoint(model, source)
    return str(error.value)


def test_a_checkpoint_of_another_configuration_is_refused_on_every_rank_naming_the_tensors(tmp_path):
    _wan(num_layers=1).save_pretrained(tmp_path / "one-layer")
    for message in run_on_ranks(2, _load_mismatched, str(tmp_path / "one-layer")):
        assert "does not fit WanTransformer3DModel" in message and "missing from the checkpoint: ['blocks.1." in message
