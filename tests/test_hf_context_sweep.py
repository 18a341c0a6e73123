"""Context parallelism over every causal-LM family of the installed ``transformers``
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``): each family, built tiny and random in float64, is made context parallel
(``hf_context``) on 2 ranks, and its logits and the gradients of ``(logits * fixed random weights).sum()`` (summed over
the ranks) are compared with the same model on one process on the whole batch. Each family ends

* EXACT: the worst error relative to the largest entry is below 1e-10 (float64), or 1e-5 where the one-device
  reference itself rounds to float32 (an eager attention's float32 softmax, soft-capping that sdpa skips);
* REFUSED: ``context_parallelize`` or the first forward raises lightning_ndclip's ValueError, naming the cause;
* NOT BUILT: no tiny config, no float64 model, or the plain one-device forward fails (skipped, counted).

Anything else is a FAILURE: a context-parallel result that differs from one device without a refusal is a silent
wrong number; one that crashes outside a refusal is an unnamed limit. ``pytest -s`` prints the table."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import Float32Ops, refused_by_us
from torch.distributed.device_mesh import init_device_mesh

transformers = pytest.importorskip("transformers")

from lightning_ndclip.integrations.transformers.context import context_parallelize, shard_batch  # noqa: E402

ROWS, SEQ, VOCAB = 2, 16, 32
MAX_PARAMETERS = 200_000
"""A config whose tiny overrides still leave more parameters is not built (vision towers, huge vocabularies, ...)."""

GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, max_position_embeddings=64, sliding_window=5, attention_dropout=0.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=4, is_decoder=True,
    # GPT-2 style names, encoder-decoder decoders
    n_embd=16, n_layer=2, n_head=4, n_positions=64, n_inner=24, d_model=16, num_layers=2, num_heads=4, ffn_dim=24,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=24,
    # experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    n_shared_experts=1, shared_expert_intermediate_size=8, n_group=1, topk_group=1,
    # latent attention
    q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=4,
    # state-space layers
    router_jitter_noise=0.0, input_jitter_noise=0.0,
    mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8, mamba_expand=2,
)  # fmt: skip
"""Applied to every config that has the field (and to its sub-configs)."""

PER_FAMILY: dict[str, dict[str, Any]] = {
    "mamba2": {"head_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 5},
    "bert (is_decoder=False)": {"is_decoder": False},  # bidirectional: refused
    # sliding window in the mask only (the attention passes no sliding_window): exact
    "qwen2_moe (use_sliding_window)": {"use_sliding_window": True, "max_window_layers": 2},
    # rotary scale chosen by the call's largest position: refused
    "phimoe (short/long mscale)": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                       "short_mscale": 1.0, "long_mscale": 1.5,
                                                       "original_max_position_embeddings": 14}},
}
VARIANTS = {
    "bert (is_decoder=False)": "BertLMHeadModel",
    "qwen2_moe (use_sliding_window)": "Qwen2MoeForCausalLM",
    "phimoe (short/long mscale)": "PhimoeForCausalLM",
}
"""Families beyond the mapping's, as variants of a config: a refusal or an exact case the sweep checks."""
"""Overrides beyond GENERIC where a family's own validation needs them."""

KNOWN_WRONG: dict[str, str] = {}
"""family -> why its context-parallel result differs from one device (or crashes) without a refusal; empty: those the
sweep found (Doge and GIT crashing) are refused by name in hf_context. A new family here fails the test."""

MIN_EXACT = 55
"""The sweep must find at least this many EXACT families (measured: 96 on transformers 5.24, 61 on 5.0, the floor)."""


def _overrides(config_class: type, family: str) -> dict[str, Any]:
    default = config_class()
    wanted = {**GENERIC, **PER_FAMILY.get(family, {})}
    kwargs: dict[str, Any] = {}
    for key, value in wanted.items():
        if isinstance(getattr(config_class, key, None), property):
            continue
        try:
            present = hasattr(default, key)
        except Exception:  # per-layer attributes of the newest configs raise on global access
            present = False
        if present or key in PER_FAMILY.get(family, {}):
            kwargs[key] = value
    for key, value in vars(default).items():
        if isinstance(value, float) and value and ("dropout" in key or "pdrop" in key):
            kwargs[key] = 0.0
    for key in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, key, None)
        if sub is not None and not isinstance(sub, dict):
            kwargs[key] = type(sub)(**_overrides(type(sub), family))
    return kwargs


def _build(family: str, architecture: str) -> torch.nn.Module:
    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**_overrides(model_class.config_class, family))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"{parameters} parameters at the tiny overrides")
    torch.manual_seed(0)
    model = model_class(config).double()
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")  # the grouped matmul kernels have no float64
        except Exception:
            pass
    model.eval()  # no train-time randomness (router jitter, sparse mixers); gradients flow all the same
    return model


def _tolerance(model: torch.nn.Module, float32_ops: set[str]) -> float:
    """float64's where one device computes in float64 throughout (and does not skip a soft-cap, as sdpa does), else
    float32's."""
    config = model.config
    softcap = getattr(config, "attn_logit_softcapping", None) or getattr(config, "attention_logit_softcapping", None)
    return 1e-10 if not float32_ops and softcap is None else 1e-5


@dataclass
class Reference:
    """A family built tiny in float64 and run on one process: its input, its logits, the fixed weights of the loss
    ``(logits * weights).sum()``, the gradients that loss gives (then cleared from the model) and the tolerance."""

    model: Any
    input_ids: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    expected: dict[str, torch.Tensor]
    tolerance: float
    scale: torch.Tensor  # the largest entry of any expected gradient

    def logits_error(self, logits: torch.Tensor) -> float:
        """The largest error of parallel ``logits``, relative to the largest one-device logit."""
        return float((logits - self.logits).abs().max() / self.logits.abs().max())

    def gradient_error(self, name: str, grad: torch.Tensor | None) -> float:
        """The largest error of parameter ``name``'s parallel gradient (``None``, or a name without a one-device
        gradient: zeros), relative to its largest entry; a gradient that is 0 in exact arithmetic (a key bias: softmax
        ignores it) is rounding noise on both sides, measured against 1e-3 of the largest gradient of the model."""
        reference = self.expected.get(name)
        if reference is None:
            reference = torch.zeros_like(grad)
        if grad is None:
            grad = torch.zeros_like(reference)
        return float((grad - reference).abs().max() / torch.maximum(reference.abs().max(), 1e-3 * self.scale))


def one_device(family: str, architecture: str) -> Reference | tuple[str, str, float, float]:
    """The family's :class:`Reference`, or its NOT BUILT outcome."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    try:
        model = _build(family, architecture)
        with Float32Ops() as float32_ops:
            logits = model(input_ids=input_ids).logits
        weights = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
        (logits * weights).sum().backward()
    except Exception as error:
        return "NOT BUILT", f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}", 0.0, 0.0
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    scale = max((g.abs().max() for g in expected.values()), default=torch.tensor(1.0))
    return Reference(model, input_ids, logits.detach(), weights, expected, _tolerance(model, float32_ops.found), scale)


def _one(family: str, architecture: str, cp: Any) -> tuple[str, str, float, float]:
    """``(outcome, detail, error, tolerance)`` of one family."""
    ref = one_device(family, architecture)
    if not isinstance(ref, Reference):
        return ref
    model, tolerance = ref.model, ref.tolerance
    try:
        context_parallelize(model, cp)
        local, shard = shard_batch({"input_ids": ref.input_ids}, cp)
        with shard.active():
            local_logits = model(**local).logits
    except Exception as error:
        if refused_by_us(error):
            return "REFUSED", str(error), 0.0, tolerance
        return "CRASHED", f"{type(error).__name__}: {str(error)[:200]}", 0.0, tolerance
    (local_logits * ref.weights[:, shard.positions]).sum().backward()
    errors = [ref.logits_error(shard.unshard(local_logits.detach()))]
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        errors.append(ref.gradient_error(name, grad))
    error = max(errors)
    names = ["logits", *(name for name, _ in model.named_parameters())]
    worst = names[errors.index(error)]
    return ("EXACT", "", error, tolerance) if error < tolerance else ("WRONG", f"worst: {worst}", error, tolerance)


def _sweep(families: dict[str, str]) -> dict[str, tuple[str, str, float, float]]:
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        for family, architecture in families.items():
            results[family] = _one(family, architecture, cp)
    return results


def _families() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {**MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **VARIANTS}


def print_outcomes(outcomes: dict[str, tuple[str, str, float, float]]) -> dict[str, int]:
    """Print a sweep's table (``pytest -s`` shows it), one family a line, by outcome; the count of each outcome."""
    print()
    for family, (outcome, detail, error, tolerance) in sorted(outcomes.items(), key=lambda item: (item[1][0], item[0])):
        print(f"{outcome:9s} {family:28s} {error:9.2e} / {tolerance:.0e}  {detail[:200]}")
    counts: dict[str, int] = {}
    for outcome, *_ in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(counts, f"transformers {transformers.__version__}")
    return counts


def test_every_causal_lm_family_is_exact_or_refused():
    results = run_on_ranks(2, _sweep, _families(), timeout=300)
    assert results[0] == results[1] or {f: r[0] for f, r in results[0].items()} == {f: r[0] for f, r in results[1].items()}
    outcomes = results[0]
    counts = print_outcomes(outcomes)
    failures = {f: r for f, r in outcomes.items() if r[0] in ("WRONG", "CRASHED") and f not in KNOWN_WRONG}
    assert not failures
    assert counts.get("EXACT", 0) >= MIN_EXACT
    for family, (outcome, detail, *_) in outcomes.items():  # a refusal names the config field or the feature
        if outcome == "REFUSED":
            assert detail.startswith("cp > 1: ") and any(cause in detail for cause in _CAUSES), (family, detail)


_CAUSES = (
    "config.",
    "AttentionInterface",
    "attention mask its model built itself",
    "padding_idx",
    "ring attention",
    "rotary embedding",
    "under cp",
)
