"""Loading a Hugging Face checkpoint into a model built on the meta device and parallelized
(``load_hf_checkpoint``, ``NDParallelStrategy(hf_checkpoint=...)``), against ``save_pretrained``'s own
model on one process: every weight equal bit for bit (the MoE families' per-expert tensors packed as
``transformers`` packs them), the logits equal, ties kept, the buffers a checkpoint does not store
recomputed; and a checkpoint that does not fit refused, naming the tensors. The MoE checkpoints on ep, tp
and FSDP2 meshes: test_hf_load_experts.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import COMMON, EXPERT_FAMILIES, FAMILIES, tiny_causal_lm
from torch import nn

import lightning_ndclip as nd

transformers = pytest.importorskip("transformers")

ALL_FAMILIES = list({**FAMILIES, **EXPERT_FAMILIES})
TOKENS = torch.randint(3, 32, (2, 8), generator=torch.Generator().manual_seed(0))


def _skip_unread_conversions(family: str) -> None:
    """transformers 5.0 converts GPT-OSS's packed experts by Force16BytesAlignment, which the loader does not read
    (it refuses them by name); later releases read them as stored."""
    from transformers import core_model_loading

    if family == "GPT-OSS" and hasattr(core_model_loading, "Force16BytesAlignment"):
        pytest.skip("this transformers release converts GPT-OSS's experts by Force16BytesAlignment")


def _on_meta(reference: nn.Module) -> nn.Module:
    """The reference's class and config, built on the meta device as a big model must be."""
    with torch.device("meta"):
        model = type(reference)(reference.config)
    model.tie_weights()  # transformers 5.0 skips it on the meta device; later releases tie already
    return model


def _saved(family: str, directory, max_shard_size: str = "5GB") -> nn.Module:
    reference = tiny_causal_lm(family)
    reference.save_pretrained(directory, max_shard_size=max_shard_size)
    return reference


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_model_built_on_meta_loads_to_the_same_model(family, tmp_path):
    _skip_unread_conversions(family)
    reference = _saved(family, tmp_path)
    model = _on_meta(reference)
    nd.load_hf_checkpoint(model, tmp_path)
    assert dict(model.state_dict()).keys() == dict(reference.state_dict()).keys()
    for name, value in reference.state_dict().items():  # parameters and buffers, bit for bit
        assert torch.equal(model.state_dict()[name], value), name
    assert nd.tied_parameters(model) == nd.tied_parameters(reference)
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)


def _stored(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_save_hf_checkpoint_writes_what_save_pretrained_writes(family, tmp_path):
    """The same names (transformers' renamings reversed; one tensor per expert where transformers packs the experts,
    GPT-OSS's packed as the hub ships them) and the same tensors, bit for bit."""
    reference = _saved(family, tmp_path / "pretrained")
    nd.save_hf_checkpoint(reference, tmp_path / "exported")
    written, expected = _stored(tmp_path / "exported"), _stored(tmp_path / "pretrained")
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(written[name], value), name


@pytest.mark.skipif(not hasattr(transformers, "OlmoHybridForCausalLM"), reason="this transformers release has no OLMo-Hybrid")
def test_a_concatenation_without_experts_loads_and_saves_back(tmp_path):
    """OLMo-Hybrid's checkpoints store q/k/v convolutions that transformers concatenates into one (Concatenate without
    MergeModulelist): read into it, and written back as three."""
    reference = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**COMMON))
    reference.save_pretrained(tmp_path / "pretrained")
    assert "model.layers.0.linear_attn.q_conv1d.weight" in _stored(tmp_path / "pretrained")
    model = _on_meta(reference)
    nd.load_hf_checkpoint(model, tmp_path / "pretrained")
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    nd.save_hf_checkpoint(model, tmp_path / "exported")
    assert _stored(tmp_path / "exported").keys() == _stored(tmp_path / "pretrained").keys()


def test_to_empty_alone_leaves_the_rotary_frequencies_unset(tmp_path):
    """What the loader guards against: moved off meta and given the weights, the model still differs (its
    ``inv_freq`` is never stored), and the tie is broken."""
    reference = _saved("Llama (tied)", tmp_path)
    model = _on_meta(reference)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    model.load_state_dict(reference.state_dict(), strict=False)
    assert not torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


@pytest.mark.skipif(not hasattr(transformers, "LaraMiniForCausalLM"), reason="this transformers release has no LaraMini")
def test_a_checkpoint_that_transformers_splits_is_refused_naming_the_tensors_and_the_family(tmp_path):
    """Stacked and concatenated tensors (the MoE experts) are read into shards; LaraMini's fused ``in_proj``, which
    transformers splits into four model tensors, is not: refused before anything is allocated, naming it."""
    reference = transformers.LaraMiniForCausalLM(transformers.LaraMiniConfig(**COMMON))
    reference.save_pretrained(tmp_path)
    model = _on_meta(reference)
    names = r"\['model.layers.0.linear_attn.in_proj.weight'\] into \['model.layers.0.linear_attn.in_proj_qkv.weight', "
    with pytest.raises(ValueError, match=rf"transformers converts {names}.* for lara_mini by \[Split\(dim=0\)\]") as e:
        nd.load_hf_checkpoint(model, tmp_path)
    assert "missing" not in str(e.value)  # the four tensors it splits into are named once, not as missing
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.faults
def test_a_missing_a_surplus_or_a_misshapen_tensor_is_refused_before_reading(tmp_path):
    from safetensors.torch import load_file, save_file

    reference = _saved("Llama", tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    norm = "model.norm.weight"
    for change, expected in [
        (lambda s: s.pop(norm), rf"missing from the checkpoint: \['{norm}'\]"),
        (lambda s: s.update(extra=torch.zeros(2)), r"in the checkpoint, not in LlamaForCausalLM: \['extra'\]"),
        (lambda s: s.update({norm: torch.ones(3)}), rf"shapes differ: \['{norm}: checkpoint \(3,\), model \(16,\)'\]"),
    ]:
        edited = dict(stored)
        change(edited)
        save_file(edited, tmp_path / "model.safetensors", metadata={"format": "pt"})
        model = _on_meta(reference)
        with pytest.raises(ValueError, match=expected):
            nd.load_hf_checkpoint(model, tmp_path)
        assert all(p.is_meta for p in model.parameters()), "refused before anything is allocated"


def test_a_declared_tie_held_as_two_parameters_is_refused(tmp_path):
    reference = _saved("Llama (tied)", tmp_path)
    model = _on_meta(reference)
    model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # as 5.0 builds it on meta
    with pytest.raises(ValueError, match=r"declares \['lm_head.weight = model.embed_tokens.weight'\] tied"):
        nd.load_hf_checkpoint(model, tmp_path)


class _Cache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.register_buffer("scale", torch.full((2,), 3.0), persistent=False)


def test_a_buffer_no_initialization_recomputes_is_an_error_not_garbage(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2)}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        module = _Cache()
    with pytest.raises(ValueError, match=r"does not store the buffers \['scale'\]"):
        nd.load_hf_checkpoint(module, tmp_path, device="cpu")
    module = _Cache()  # built off meta, its buffer is kept as computed... only by its owner's init: refused too
    with pytest.raises(ValueError, match=r"does not store the buffers \['scale'\]"):
        nd.load_hf_checkpoint(module, tmp_path)


# --- on 4 ranks: dp_shard=2 x tp=2 --------------------------------------------------------------------------------


def _parallel_load_case(family: str, directory: str) -> dict:
    reference = tiny_causal_lm(family)
    model = _on_meta(reference)
    dims = nd.ParallelDims(world_size=4, dp_shard=2, tp=2)
    units = [type(model.model.layers[0])]  # the decoder layer, each one FSDP2 unit
    nd.parallelize(model, dims.build_mesh("cpu"), tp_plan="auto", fsdp_units=units)
    nd.load_hf_checkpoint(model, directory)
    with torch.no_grad():
        logits = model(TOKENS).logits
    return {
        "logits": logits.full_tensor() if isinstance(logits, torch.distributed.tensor.DTensor) else logits,
        "state": {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()},
        "ties": nd.tied_parameters(model),
        "sharded": sum(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()),
    }


@pytest.mark.parametrize("family", ["Llama (tied)", "Phi3"])
def test_a_parallelized_model_loads_each_shard_from_a_sharded_checkpoint(family, tmp_path):
    reference = _saved(family, tmp_path, max_shard_size="2KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "several files"
    results = run_on_ranks(4, _parallel_load_case, family, str(tmp_path))
    for result in results:
        assert result["sharded"] == len(list(reference.parameters()))
        assert result["ties"] == nd.tied_parameters(reference)
        for name, value in reference.state_dict().items():
            assert torch.equal(result["state"][name], value), name
        with torch.no_grad():
            torch.testing.assert_close(result["logits"], reference(TOKENS).logits, rtol=1e-5, atol=1e-6)


def checkpoint_on_meta(directory: str) -> nn.Module:
    """The checkpoint's model, built from its config on the meta device, as a big model must be."""
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # transformers 5.0 skips it on the meta device; later releases tie already
    return model


class _MetaLM(L.LightningModule):
    """A checkpoint's model built on the meta device, for the strategy to load: one SGD step."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.lm = checkpoint_on_meta(directory)

    def count_tokens(self, batch) -> torch.Tensor:
        return torch.tensor(batch[0][:, 1:].numel())

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.lm(input_ids=tokens[:, :-1]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):  # one row per data rank on dp_shard=4 (TOKENS twice)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(TOKENS.repeat(2, 1)), batch_size=1)


def strategy_case(directory: str, dp_shard: int = 2, tp: int = 2, ep: int = 1) -> dict:
    """One step of the strategy loading ``directory`` (``hf_checkpoint=``) on 4 ranks: every parameter, whole."""
    use_existing_process_group()
    module = _MetaLM(directory)
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(module.lm.model.layers[0])])
    strategy = nd.NDParallelStrategy(dp_shard=dp_shard, tp=tp, ep=ep, plan=plan, loss_normalization="token_mean",
                                     summary=False, hf_checkpoint=directory)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()}


def test_the_strategy_loads_the_checkpoint_into_the_parallelized_model(tmp_path):
    """One SGD step from the loaded weights equals one step of the ``save_pretrained`` model on one process."""
    reference = _saved("Llama (tied)", tmp_path)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = TOKENS
    logits = reference(input_ids=tokens[:, :-1]).logits
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    trained = run_on_ranks(4, strategy_case, str(tmp_path))[0]
    expected = dict(reference.named_parameters())
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


class _PipelinedMetaLM(_MetaLM):
    """The checkpoint's model on the meta device, cut into pipeline stages by the strategy, which loads each."""

    def pipeline_loss(self, logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.trainer.strategy.run_pipeline(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self):  # both rows of TOKENS on each of the 2 data ranks: 2 pipeline micro-batches
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(TOKENS.repeat(2, 1)), batch_size=2)


def pipelined_case(directory: str, exported: str) -> dict:
    """One step of pp=2 x dp_shard=2 loading ``directory`` into the stages, then the stages exported to
    ``exported``: this rank's stage parameters, whole."""
    use_existing_process_group()
    module = _PipelinedMetaLM(directory)
    plan = nd.ParallelPlan(fsdp_units=[type(module.lm.model.layers[0])])
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=2, plan=plan, pipeline=nd.PipelineOptions(module="lm", microbatches=2),
        loss_normalization="token_mean", summary=False, hf_checkpoint=directory,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    nd.save_hf_checkpoint(module.lm, exported, max_shard_bytes=2**10)  # each stage's ranks write several files
    return {n: p.detach().full_tensor() for stage in module.lm for n, p in stage.named_parameters()}


@pytest.mark.parametrize("family", ["Qwen3-MoE", "Llama (tied)"])
def test_the_strategy_loads_the_checkpoint_into_pipeline_stages_and_exports_them(family, tmp_path):
    """Each stage reads its own units' tensors (a tied head on the last stage reads the stored embedding): one SGD
    step from them equals one step of the ``save_pretrained`` model on one process, under every name. Exported
    from the stages, the trained model is what ``save_pretrained`` writes of it: the same names (a tied head
    written once, as the embedding; the experts one tensor each, gathered from their FSDP shards), and
    ``from_pretrained`` reads back the stages' tensors bit for bit."""
    reference = _saved(family, tmp_path / "pretrained")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    logits = reference(input_ids=TOKENS[:, :-1]).logits
    nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    optimizer.step()
    trained: dict[str, torch.Tensor] = {}
    for stage in run_on_ranks(4, pipelined_case, str(tmp_path / "pretrained"), str(tmp_path / "exported")):
        trained.update(stage)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert _stored(tmp_path / "exported").keys() == _stored(tmp_path / "pretrained").keys()  # one tensor per expert
    assert len(list((tmp_path / "exported").glob("*.safetensors"))) > 2
    loaded = type(reference).from_pretrained(tmp_path / "exported")
    for name, value in loaded.named_parameters(remove_duplicate=False):
        assert torch.equal(value, trained[name]), name


def _pipelined_refusal_case(directory: str) -> str:
    try:
        pipelined_case(directory, directory + "-exported")
    except Exception as error:  # noqa: BLE001 - what each rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_tensor_missing_for_one_pipeline_stage_is_refused_on_every_rank(tmp_path):
    """The final norm (the last stage's) is not in the checkpoint: the last stage refuses it, and the first stage,
    whose tensors are all there, raises with it (it waited at the next collective before: a hang)."""
    from safetensors.torch import load_file, save_file

    _saved("Llama", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    first, _, last, _ = run_on_ranks(4, _pipelined_refusal_case, str(tmp_path))
    assert last.startswith("ValueError: load_hf_checkpoint") and "model.norm.weight" in last, last
    assert first.startswith("AgreedError: rank 2: load_hf_checkpoint raised ValueError") and "model.norm.weight" in first, first
