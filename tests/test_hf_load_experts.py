"""MoE checkpoints as the hub ships them (one tensor per expert, as ``save_pretrained`` writes them) loaded into
packed experts built on the meta device and sharded over ``ep``, ``tp``, FSDP2 alone or HSDP, and saved back from there,
against ``from_pretrained`` on one process: every tensor equal bit for bit, each rank reading only the blocks its own
shards hold, and the files written those ``save_pretrained`` writes."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from harness import run_on_ranks
from hf_families import tiny_causal_lm, with_experts_over_tp
from test_hf_load import TOKENS, checkpoint_on_meta, strategy_case
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_ndclip as nd

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "ep_plan"), reason="this transformers release has no model.ep_plan"
)

LAYOUTS = {
    "ep": {"dp_shard": 4, "ep": 2},
    "tp": {"dp_shard": 2, "tp": 2},
    "fsdp": {"dp_shard": 4},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
}
PLACEMENTS = {  # the packed gate_up_proj's on each layout
    "ep": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",  # FSDP2 over edp, then whole experts over ep
    "tp": "(Shard(dim=0), _StridedShard(dim=1, sf=2))",  # FSDP2 over the experts, each one's gate and up rows over tp
    "fsdp": "(Shard(dim=0),)",
    "hsdp": "(Replicate(), Shard(dim=0))",  # two copies of each shard: one is written
}
EXPERTS_HERE = {"ep": 1, "tp": 2, "fsdp": 1, "hsdp": 2}
CASES = [  # GPT-OSS ships its experts packed (no conversion), with biases that tp does not split
    *((family, layout) for family in ("Mixtral", "Qwen3-MoE", "DeepSeek-V3") for layout in ("ep", "tp", "fsdp")),
    ("GPT-OSS", "ep"),
    ("GPT-OSS", "fsdp"),
    ("Mixtral", "hsdp"),
]


def _parallelized(directory: str, layout: str) -> nn.Module:
    """Built on meta and parallelized as NDParallelStrategy(plan=ParallelPlan(...)) does: the model's own plans, each
    decoder layer one FSDP2 unit (the experts their own, over edp, under ep)."""
    model = checkpoint_on_meta(directory)
    if layout == "tp":  # split over tp as the plans of transformers 5.5-5.24 do (later ones leave them whole)
        with_experts_over_tp(model)
    meshes = nd.ParallelDims(world_size=4, **LAYOUTS[layout]).build_mesh("cpu")
    own_plans = "ep" in LAYOUTS[layout] or "tp" in LAYOUTS[layout]
    plan = nd.ParallelPlan(tp_plan="auto" if own_plans else None, fsdp_units=[type(model.model.layers[0])])
    return plan.apply(model, meshes)


@contextmanager
def _recorded_reads():
    """``{stored name: elements}`` read through ``safetensors.safe_open(...).get_slice(name)[...]`` meanwhile (by
    torch's dcp too)."""
    import safetensors

    real, reads = safetensors.safe_open, {}

    class Slice:
        def __init__(self, stored, name: str) -> None:
            self.stored, self.name = stored, name

        def __getitem__(self, index):
            value = self.stored[index]
            reads[self.name] = reads.get(self.name, 0) + value.numel()
            return value

        def __getattr__(self, attribute):
            return getattr(self.stored, attribute)

    class File:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.file.get_slice(name), name)

        def __getattr__(self, attribute):
            return getattr(self.file, attribute)

    with mock.patch.object(safetensors, "safe_open", File):
        yield reads


def _round_trip_case(directory: str, layout: str, export_to: str) -> dict:
    model = _parallelized(directory, layout)
    with _recorded_reads() as reads:
        nd.load_hf_checkpoint(model, directory)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    nd.save_hf_checkpoint(model, export_to, max_shard_bytes=8192)  # several files
    return {
        "state": {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()},
        "placements": {str(p.placements) for n, p in experts.items() if n.endswith("gate_up_proj")},
        "experts_here": {p.to_local().shape[0] for p in experts.values()},
        "expert_elements_held": sum(p.to_local().numel() for p in experts.values()),
        "expert_elements_read": sum(count for name, count in reads.items() if ".experts." in name),
    }


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_a_hub_moe_checkpoint_loads_into_each_layout_and_saves_back_bit_for_bit(family, layout, tmp_path):
    """Loaded from save_pretrained's files (per-expert, except GPT-OSS) into each layout: every tensor equals
    from_pretrained's; each rank reads exactly the expert elements its shards hold (its own experts under ep, its
    gate and up rows under tp); written back with save_hf_checkpoint: the same names and tensors as save_pretrained,
    which from_pretrained loads bit for bit."""
    hub, exported = tmp_path / "hub", tmp_path / "exported"
    tiny_causal_lm(family).save_pretrained(hub, max_shard_size="20KB")
    expected = transformers.AutoModelForCausalLM.from_pretrained(hub).state_dict()
    results = run_on_ranks(4, _round_trip_case, str(hub), layout, str(exported))
    assert results[0]["placements"] == {PLACEMENTS[layout]}
    assert {n for r in results for n in r["experts_here"]} == {EXPERTS_HERE[layout]}
    for result in results:
        assert result["expert_elements_read"] == result["expert_elements_held"]
        assert result["state"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["state"][name], value), name
    written, shipped = _stored(exported), _stored(hub)
    assert len(list(exported.glob("model-*-of-*.safetensors"))) > 1
    assert written.keys() == shipped.keys()
    assert any(".experts.0." in name for name in written) == (family != "GPT-OSS")
    for name, value in shipped.items():
        assert torch.equal(written[name], value), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    for name, value in expected.items():
        assert torch.equal(reloaded[name], value), name


def _packed_case(directory: str) -> dict[str, torch.Tensor]:
    model = _parallelized(directory, "tp")
    nd.load_hf_checkpoint(model, directory)
    return {n: t.full_tensor() for n, t in model.state_dict().items() if ".experts." in n}


def test_a_packed_checkpoint_loads_each_tp_ranks_gate_and_up_rows(tmp_path):
    """Experts stored packed (the model's own layout) into tp's _StridedShard: a rank's rows of the gate and of the up
    projection are no box of gate_up_proj, which torch's dcp would read as one (rows 12-35 instead of 12-23 and 36-47);
    read block by block, they are exact."""
    from safetensors.torch import save_file

    reference = tiny_causal_lm("Mixtral")
    reference.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "model.safetensors")
    result = run_on_ranks(4, _packed_case, str(tmp_path))[0]
    assert len(result) == 4
    for name, value in result.items():
        assert torch.equal(value, reference.state_dict()[name]), name


@pytest.mark.faults
def test_a_missing_a_surplus_or_a_misshapen_expert_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    reference = tiny_causal_lm("Mixtral")
    reference.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    extra = "model.layers.1.block_sparse_moe.experts.4.w1.weight"
    for change, expected in [
        (lambda s: s.pop(expert), rf"missing from the checkpoint: \['{expert}'\]"),
        (lambda s: s.update({extra: s[expert].clone()}), rf"in the checkpoint, not in MixtralForCausalLM: \['{extra}'\]"),
        (
            lambda s: s.update({expert: torch.zeros(3, 16)}),
            rf"shapes differ: \['{expert}: checkpoint \(3, 16\), model model.layers.1.mlp.experts.gate_up_proj"
            r"\[3, 0:24, 0:16\] \(24, 16\)'\]",
        ),
    ]:
        edited = dict(stored)
        change(edited)
        save_file(edited, tmp_path / "model.safetensors", metadata={"format": "pt"})
        model = checkpoint_on_meta(str(tmp_path))
        with pytest.raises(ValueError, match=expected):
            nd.load_hf_checkpoint(model, tmp_path)
        assert all(p.is_meta for p in model.parameters()), "refused before anything is allocated"


def test_the_strategy_loads_a_hub_moe_checkpoint_with_its_experts_over_ep(tmp_path):
    """NDParallelStrategy(hf_checkpoint=...) on dp_shard=4 x ep=2, from Qwen3-MoE's per-expert files: one SGD step
    from the loaded weights equals one step of from_pretrained's model on one process."""
    tiny_causal_lm("Qwen3-MoE").save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    logits = reference(input_ids=TOKENS[:, :-1]).logits
    nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    trained = run_on_ranks(4, strategy_case, str(tmp_path), 4, 1, 2)[0]  # dp_shard=4 x ep=2
    expected = dict(reference.named_parameters())
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
