"""Hugging Face transformers' tensor-parallel styles map to the plain PyTorch styles with transformers' own
layouts (``hf_tp_plan``), and a style or module they cannot express is an error naming it; skipped without
transformers. Every family in ``Trainer.fit`` with its own plan: test_hf_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ndclip.integrations.transformers.plans import hf_tp_plan

transformers = pytest.importorskip("transformers")


def _llama(tied: bool = False) -> nn.Module:
    """A tiny Llama built from a config (random weights, nothing downloaded): 4 heads and 2 key/value heads, so
    tp=2 splits both; ``tied``: the LM head shares the input embedding's weight (as Llama-3.2-1B ships)."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


# transformers' definition of each style (distributed/tensor_parallel.py): (class, input layout, output layout)
STYLES = {
    "colwise": (ColwiseParallel, "replicate", "shard"),
    "rowwise": (RowwiseParallel, "shard", "replicate"),
    "colwise_gather_output": (ColwiseParallel, "replicate", "replicate"),
    "colwise_rep": (ColwiseParallel, "replicate", "replicate"),
    "rowwise_split_input": (RowwiseParallel, "replicate", "replicate"),
    "rowwise_rep": (RowwiseParallel, "replicate", "replicate"),
    "embedding_rowwise": (RowwiseParallel, "replicate", "replicate"),  # vocab rows split, output all-reduced
    "embedding_colwise": (ColwiseParallel, "replicate", "replicate"),  # width split, output gathered
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_each_style_maps_to_the_pytorch_style_with_its_layouts(style):
    model = _llama()
    target = "model.embed_tokens" if style.startswith("embedding") else "lm_head"
    try:
        model.tp_plan = {target: style}
    except ValueError as unknown:  # transformers checks the names: older releases lack some styles
        pytest.skip(f"transformers {transformers.__version__} has no style {style!r}: {unknown}")
    (key, mapped), = hf_tp_plan(model).items()
    kind, inputs, outputs = STYLES[style]
    layouts = [layout.is_replicate() and "replicate" or layout.is_shard() and "shard"
               for layout in (mapped.input_layouts[0], mapped.output_layouts[0])]  # fmt: skip
    assert (key, type(mapped), layouts) == (target, kind, [inputs, outputs])


def test_a_style_pytorch_cannot_express_is_an_error_naming_it_and_the_module():
    model = _llama()
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj": "sequence_parallel"}
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.mlp.gate_proj'\] = 'sequence_parallel'.*no plain PyTorch"):
        hf_tp_plan(model)


def test_a_module_the_style_cannot_shard_is_an_error_naming_it():
    model = _llama()
    model.tp_plan = {**model.tp_plan, "model.layers.*.input_layernorm": "colwise"}
    with pytest.raises(ValueError, match=r"shards Linear modules, not \['model.layers.0.input_layernorm \(LlamaRMSNorm\)"):
        hf_tp_plan(model)


def test_a_head_count_tp_does_not_divide_is_an_error_naming_the_config_field():
    """4 heads and 2 key/value heads: tp=2 holds whole heads; tp=4 would cut each key/value head in two, which
    transformers' attention met as a shape error ('shape [2, 8, -1, 8] is invalid') in the first forward."""
    holder = nn.ModuleDict({"lm": _llama()})
    assert hf_tp_plan(holder, tp=2) and hf_tp_plan(holder, tp=1)
    with pytest.raises(ValueError, match=r"lm's config.num_key_value_heads is 2, which tp=4 does not divide"):
        hf_tp_plan(holder, tp=4)
    with pytest.raises(ValueError, match=r"config.num_attention_heads is 4, which tp=3 does not divide"):
        hf_tp_plan(holder, tp=3)


def test_a_per_head_norm_the_plan_leaves_whole_is_an_error_naming_it():
    """Cohere's use_qk_norm: q_norm's weight is [heads, head_dim], and its plan splits the heads but names no norm
    (it failed in the first forward: 'The size of tensor a (4) must match the size of tensor b (2)')."""
    config = transformers.CohereConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, use_qk_norm=True,
    )  # fmt: skip
    model = transformers.CohereForCausalLM(config)
    per_head = r"model.layers.0.self_attn.q_norm \(CohereLayerNorm\) holds one weight row per attention head \(\[4, 4\]\)"
    with pytest.raises(ValueError, match=per_head):
        hf_tp_plan(model)
    config.use_qk_norm = False
    assert hf_tp_plan(transformers.CohereForCausalLM(config))  # without the per-head norms, its plan applies


def test_no_transformers_model_is_an_error_saying_so():
    with pytest.raises(ValueError, match="found no Hugging Face transformers model"):
        hf_tp_plan(nn.Sequential(nn.Linear(2, 2)))


def _qwen3_tp_only_case() -> dict:
    from hf_families import tiny_causal_lm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import lightning_ndclip as nd

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = tiny_causal_lm("Qwen3").double()
    make, _ = nd.HF_STYLES["replicated_with_grad_allreduce"]  # releases before the style leave them out of the plan
    norms = {f"model.layers.*.self_attn.{n}": make() for n in ("q_norm", "k_norm")}
    nd.tensor_parallelize(model, mesh, {**hf_tp_plan(model), **norms})
    tokens = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens).logits.pow(2).mean().backward()
    norms = {n: p.grad for n, p in model.named_parameters() if "_norm" in n and "self_attn" in n}
    return {
        "placements": sorted({str(g.placements) for g in norms.values()}),
        "grads": {n: g.full_tensor() for n, g in norms.items() if isinstance(g, DTensor)},
        "total": float(nd.get_total_norm([p.grad for p in model.parameters()])),
    }


def test_replicated_with_grad_allreduce_sums_the_norm_weights_gradient_over_tp():
    """Qwen3's q_norm / k_norm on tp=2 without FSDP2: each rank's gradient covers its own heads only; the
    gradient, summed over tp, is Replicate (a Partial gradient would be refused by the norm) and equals one
    float64 device, as does the total norm."""
    from harness import run_on_ranks
    from hf_families import tiny_causal_lm

    model = tiny_causal_lm("Qwen3").double()
    tokens = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens).logits.pow(2).mean().backward()
    result = run_on_ranks(2, _qwen3_tp_only_case)[0]
    assert result["placements"] == ["(Replicate(),)"]
    reference = dict(model.named_parameters())
    assert len(result["grads"]) == 4  # q_norm and k_norm of 2 layers
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, reference[name].grad, rtol=1e-10, atol=1e-14, msg=name)
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert abs(result["total"] - expected) <= 1e-10 * expected
