"""Tensor parallelism over every causal-LM family of the installed ``transformers`` that ships a plan
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class, or a sub-config of it, has a non-empty
``base_model_tp_plan``): each family, built tiny and random in float64 as in the context-parallel sweep
(``test_hf_context_sweep``), is parallelized on 2 ranks the way ``ParallelPlan(tp_plan="auto")`` does it
(``parallelize(model, meshes, tp_plan="auto")`` on a tp=2 mesh, its first forward watched by
``watch_split_activations`` as the strategy watches it), and its logits and the gradients of
``(logits * fixed random weights).sum()`` (DTensors gathered whole) are compared with the same model on one process
on the same input. Each family ends

* EXACT: the worst error relative to the largest entry is below 1e-10 (float64), or 1e-5 where the one-device
  reference itself rounds to float32;
* REFUSED: ``parallelize`` or the first forward raises lightning_ndclip's ValueError, naming the cause;
* WRONG: it ran and the numbers differ from one device (a silent wrong number: the worst outcome);
* CRASH: any other exception (a raw shape error from torch or transformers: an unclear error);
* NOT BUILT: no tiny config, no float64 model, or the plain one-device forward fails (skipped, counted).

A WRONG or CRASH family outside :data:`KNOWN` fails the test. ``pytest -s`` prints the table."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import test_hf_context_sweep as cp_sweep
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import refused_by_us
from test_hf_context_sweep import Reference, one_device
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

from lightning_ndclip import _compat  # noqa: E402
from lightning_ndclip.core.parallel.mesh import ParallelDims  # noqa: E402
from lightning_ndclip.core.parallel.plan import parallelize  # noqa: E402
from lightning_ndclip.core.parallel.split_activations import watch_split_activations  # noqa: E402

# fmt: off
_LATENT = {"head_dim": 2, "num_key_value_heads": 4}  # multi-head latent attention: head_dim is the rotary part
_INDEXER = {"index_n_heads": 4, "index_head_dim": 4, "index_topk": 8}
_MOE_SECOND = {"first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"]}  # a dense layer, then experts
_GATED_DELTA = {"linear_key_head_dim": 4, "linear_value_head_dim": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2}
_QWEN3_5 = {**_GATED_DELTA, "layer_types": ["linear_attention", "full_attention"]}
_QWEN4 = {**_GATED_DELTA, "layer_types": ["linear_attention", "indexed_attention"], "hc_lowrank": 4, "ple_embed_dim": 4,
          "ngram_vocab_size_base": 64, "make_ngram_vocab_size_divisible_by": 4, "split_ngram_parts": 2, "heads_per_ngram": 2,
          "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 4, "indexer_budget": 8,
          "indexer_compress_ratio": 2}
_GEMMA4 = {"vocab_size_per_layer_input": 32, "hidden_size_per_layer_input": 4,
           "layer_types": ["sliding_attention", "full_attention"], "enable_moe_block": True,
           "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8}
PER_FAMILY: dict[str, dict[str, Any]] = {
    **dict.fromkeys(["axk1", "longcat_flash", "youtu", "glm4_moe_lite"], {"head_dim": 2}),
    **dict.fromkeys(["deepseek_v3", "sarvam_mla"], {"head_dim": 2, "first_k_dense_replace": 1}),
    **dict.fromkeys(["axk2", "glm_moe_dsa", "deepseek_v32"], {**_LATENT, **_INDEXER, **_MOE_SECOND}),
    "deepseek_v4": {**_INDEXER, "o_lora_rank": 8, "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
                    "mlp_layer_types": ["hash_moe", "moe"]},
    "kimi_linear": {**_LATENT, "linear_head_dim": 4, "linear_num_heads": 4, "layer_types": ["linear_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse"]},
    "bailing_hybrid": {**_LATENT, "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                       "linear_head_dim": 4, "linear_num_heads": 4, "num_expert_group": 1, "topk_group": 1,
                       "num_experts_per_token": 2, "layer_group_size": 2, "first_k_dense_replace": 1},
    "beam": {"mlp_layer_types": ["dense", "sparse"]},
    "flint": {"mlp_only_layers": [0]},
    "doge": {"is_moe": True, "num_experts": 4, "num_experts_per_tok": 2},
    **dict.fromkeys(["qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"], _QWEN3_5),
    **dict.fromkeys(["qwen4_exp", "qwen4_exp_text"], _QWEN4),
    **dict.fromkeys(["gemma4", "gemma4_text"], _GEMMA4),
    "gemma4_text (dense)": {k: v for k, v in _GEMMA4.items() if k not in ("enable_moe_block", "num_experts", "top_k_experts",
                                                                          "moe_intermediate_size")},
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "chunk_size": 8, "n_groups": 1,
                   "moe_shared_expert_intermediate_size": 8},
    "gemma3n_text": {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"], "laurel_rank": 4,
                     "intermediate_size": [24, 24], "activation_sparsity_pattern": [0.0, 0.0],
                     "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 32},
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "inkling_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 4, "sliding_window_size": 5,
                     "rel_extent": 8, "d_rel": 4, "layer_types": ["hybrid_sliding", "hybrid"]},
    "minimax_m3_vl_text": {"shared_intermediate_size": 8, "dense_intermediate_size": 24, "rotary_dim": 2, "index_head_dim": 4,
                           "index_block_size": 4},
}
# fmt: on
"""Config overrides beyond the cp sweep's (``test_hf_context_sweep.PER_FAMILY``), for families with a plan whose tiny
config does not build (or exceeds its ``MAX_PARAMETERS``) with those alone, or has no layer of the kind its plan is
for (experts: a first dense layer, then experts): applied on top of them for this sweep."""

VARIANTS = {"gemma4_text (dense)": "Gemma4ForCausalLM"}
"""Families beyond the mapping's, as variants of a config: Gemma 4 as its dense checkpoints ship (no expert layer, while
its plan names the experts' weights)."""

KNOWN: dict[str, tuple[str, str]] = {}
"""family -> (pattern, why): the families whose tensor-parallel result differs from one device (WRONG: every wrong
gradient's parameter name, layer numbers as '*', must match the pattern, and the logits must be right) or that fail
with an unnamed error (CRASH: the pattern is searched in the error) on the releases measured (transformers 5.24 and
5.0); a family the installed release lacks, or gets right, is not held to its entry. A WRONG or CRASH family not here,
or unlike its entry, fails the test."""

MIN_EXACT = {"5.0": 32, "5.24": 103}
"""The sweep must find at least this many EXACT families, by the newest of these releases not newer than the installed
one (measured: 107 EXACT and 13 REFUSED of 126 on transformers 5.24: 125 families with a plan and a variant; 34 EXACT
and 16 REFUSED of 57 on 5.0)."""


def _known(family: str, detail: str) -> bool:
    """Whether a WRONG or CRASH ``detail`` is ``family``'s known problem (:data:`KNOWN`)."""
    if family not in KNOWN:
        return False
    pattern = KNOWN[family][0]
    if detail.startswith("logits "):  # WRONG: "logits <error>; wrong: <names>" (the logits among them if wrong)
        return all(re.fullmatch(pattern, name) for name in detail.partition("; wrong: ")[2].split(", "))
    return re.search(pattern, detail) is not None


def _min_exact() -> int:
    from packaging.version import Version

    installed = Version(transformers.__version__).release
    return max((Version(r).release, n) for r, n in MIN_EXACT.items() if Version(r).release <= installed)[1]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _one(family: str, architecture: str) -> tuple[str, str, float, float]:
    """``(outcome, detail, error, tolerance)`` of one family on this rank."""
    ref = one_device(family, architecture)
    if not isinstance(ref, Reference):
        return ref
    model, tolerance = ref.model, ref.tolerance
    try:
        meshes = ParallelDims(world_size=dist.get_world_size(), tp=2).build_mesh("cpu")
        parallelize(model, meshes, tp_plan="auto")
        with watch_split_activations(model, meshes["tp"]):  # as the strategy watches the first forward
            tp_logits = _whole(model(input_ids=ref.input_ids).logits)
    except Exception as error:
        if refused_by_us(error):
            return "REFUSED", str(error), 0.0, tolerance
        return "CRASH", f"{type(error).__name__}: {str(error)[:300]}", 0.0, tolerance
    try:
        (tp_logits * ref.weights).sum().backward()
        grads = {name: _whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    except Exception as error:
        return "CRASH", f"backward: {type(error).__name__}: {str(error)[:300]}", 0.0, tolerance
    names = ["logits", *dict.fromkeys([*ref.expected, *grads])]
    errors = [ref.logits_error(tp_logits.detach()), *(ref.gradient_error(name, grads.get(name)) for name in names[1:])]
    error = max(errors)
    if error < tolerance:
        return "EXACT", "", error, tolerance
    wrong = sorted({re.sub(r"\.\d+\.", ".*.", n) for n, e in zip(names, errors) if e >= tolerance})
    return "WRONG", f"logits {errors[0]:.0e}; wrong: {', '.join(wrong)}", error, tolerance


def _sweep(families: dict[str, str], one: Callable[[str, str], tuple[str, str, float, float]] | None = None) -> dict:
    """``one(family, architecture)`` (default: :func:`_one`) of every family on this rank, the tiny configs of both
    sweeps applied, warnings and DTensor's redistribution notes silenced."""
    one = one or _one
    results = {}
    redistribute = _compat.redistribute_logger()  # "2 sequential all_gather" notes
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), mock.patch.dict(cp_sweep.PER_FAMILY, PER_FAMILY):
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            for family, architecture in families.items():
                results[family] = one(family, architecture)
    finally:
        redistribute.setLevel(level)
    return results


def _has_plan(config_class: type) -> bool:
    if getattr(config_class, "base_model_tp_plan", None):
        return True
    subs = getattr(config_class, "sub_configs", {}) or {}
    return any(isinstance(sub, type) and getattr(sub, "base_model_tp_plan", None) for sub in subs.values())


def _families() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        family: architecture
        for family, architecture in {**MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **VARIANTS}.items()
        if hasattr(transformers, architecture) and _has_plan(getattr(transformers, architecture).config_class)
    }


def _merged(per_rank: list[dict[str, tuple[str, str, float, float]]]) -> dict[str, tuple[str, str, float, float]]:
    """One outcome per family: the worst error of the ranks (each compares its own gradients); ranks that disagree on
    the outcome are a CRASH."""
    merged = {}
    for family, first in per_rank[0].items():
        outcomes = [r[family] for r in per_rank]
        if len({o[0] for o in outcomes}) > 1:
            merged[family] = ("CRASH", f"ranks disagree: {[o[:2] for o in outcomes]}", 0.0, first[3])
        else:
            merged[family] = max(outcomes, key=lambda o: o[2])
    return merged


def test_every_causal_lm_family_with_a_plan_is_exact_or_refused_under_tp():
    outcomes = _merged(run_on_ranks(2, _sweep, _families(), timeout=600))
    counts = cp_sweep.print_outcomes(outcomes)
    fixed = [f for f in KNOWN if f in outcomes and outcomes[f][0] in ("EXACT", "REFUSED")]
    if fixed:
        print(f"in KNOWN, EXACT or REFUSED on this release: {fixed}")
    failures = {
        family: result for family, result in outcomes.items() if result[0] in ("WRONG", "CRASH") and not _known(family, result[1])
    }
    assert not failures
    assert counts.get("EXACT", 0) >= _min_exact()
