"""Hugging Face ``transformers`` models' own tensor- and expert-parallel plans, as PyTorch ``ParallelStyle``\\ s.

A ``transformers`` model ships its plan as strings: ``model.tp_plan``, e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}``.
:func:`hf_tp_plan` turns the plans of the models inside a module into the
``{module name: ParallelStyle}`` that :func:`torch.distributed.tensor.parallel.parallelize_module`
(and :func:`lightning_ndclip.core.parallel.plan.parallelize`, ``ParallelPlan(tp_plan="auto")``) take.

Only the styles plain PyTorch expresses are mapped, each to the layouts ``transformers`` gives it:

========================================= ====================================================
``transformers`` style                      PyTorch style
========================================= ====================================================
``colwise``                                ``ColwiseParallel()`` (output sharded on the last dim)
``rowwise``                                ``RowwiseParallel()`` (input sharded, output replicated)
``colwise_gather_output``, ``colwise_rep`` ``ColwiseParallel(output_layouts=Replicate())``
``rowwise_split_input``, ``rowwise_rep``   ``RowwiseParallel(input_layouts=Replicate())``
``embedding_rowwise``                      ``RowwiseParallel(input_layouts=Replicate())`` (vocab split)
``embedding_colwise``                      ``ColwiseParallel(output_layouts=Replicate())`` (width split)
``replicated_with_grad_allreduce``         ``SequenceParallel(sequence_dim=-2)`` on the heads tp splits:
                                           weights replicated, gradient summed over tp (Qwen3 / Gemma3
                                           ``q_norm`` / ``k_norm``)
``moe_tp_experts`` (with ``packed_colwise`` :class:`~lightning_ndclip.core.parallel.expert_tensor_parallel.PackedExpertsParallel`:
and ``rowwise`` on its two weights)        every expert split along its intermediate width (Mixtral,
                                           Qwen3-MoE, DeepSeek-V2)
``mla_kv_a_proj``                          :class:`LatentKeyParallel`: the weight replicated, the
                                           gradient of the output's rotary part summed over tp
                                           (DeepSeek-V2's multi-head latent attention)
``replicate``                              none: left whole, as a module the plan does not name
========================================= ====================================================

Under loss parallel (``ParallelPlan(loss_parallel=True)``,
:func:`~lightning_ndclip.core.parallel.loss_parallel.loss_parallel_plan`) a causal LM's head
(``colwise_gather_output`` / ``colwise_rep``) keeps its logits sharded along the vocabulary instead, and its own
loss becomes :func:`vocab_parallel_causal_lm_loss`.

:func:`hf_ep_plan` reads ``model.ep_plan`` the same way, for ``ep > 1``: an ``ep_dispatch_experts`` module (with
its ``grouped_gemm`` weights) becomes :class:`~lightning_ndclip.core.parallel.expert_parallel.ExpertParallel`,
whole experts per ``ep`` rank (each split over ``tp`` too when ``tp > 1``, in place of its ``moe_tp_experts``
entry).

An entry for modules the model does not have (the dense MLP of a model whose layers are all sparse)
is skipped. Any other style (``sequence_parallel``, ``ep_router``, ...) is a ``ValueError`` naming
it and the entry, as is a mapped style on a module PyTorch's style cannot shard (not an
``nn.Linear`` / ``nn.Embedding``) and a weight-level entry outside a ``moe_tp_experts`` module:
never a silently different function.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_ndclip import _compat
from lightning_ndclip.core.libraries import ExpertRouting, outermost
from lightning_ndclip.core.parallel.expert_parallel import ExpertParallel
from lightning_ndclip.core.parallel.expert_tensor_parallel import PackedExpertsParallel
from lightning_ndclip.core.parallel.loss_parallel import vocab_parallel_cross_entropy
from lightning_ndclip.core.parallel.tensor_parallel import OWN_OUTPUT_GRADIENT, gradient_summed_over, matches_plan_key

__all__ = ["HF_STYLES", "LatentKeyParallel", "hf_ep_plan", "hf_tp_plan", "vocab_parallel_causal_lm_loss"]


def _gathered_colwise() -> ParallelStyle:
    return ColwiseParallel(output_layouts=Replicate())


def _replicated_rowwise() -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate())


def _replicated_on_split_heads() -> ParallelStyle:
    """``replicated_with_grad_allreduce``: the weights replicated over tp, the input taken as
    ``Shard(-2)`` (the heads tp splits) of the whole activation, so DTensor computes the weights'
    gradient as a ``Partial`` sum over tp (made ``Replicate`` by :func:`tensor_parallelize`'s hook or
    by FSDP2). Exact for a module that normalizes within a head, as ``q_norm`` / ``k_norm`` do."""
    return SequenceParallel(sequence_dim=-2, use_local_output=True)


class LatentKeyParallel(_compat.ModuleStyle):
    """``mla_kv_a_proj``: the joint key-value down-projection of multi-head latent attention (DeepSeek-V2's
    ``kv_a_proj_with_mqa``), kept whole on every tp rank. Its output is ``[latent, rotary key]``: the
    latent part feeds ``kv_b_proj`` (colwise, which sums its input's gradient over tp), but the last
    ``rope_dim`` columns, the rotary key shared by all heads, go straight to this rank's heads, so each
    rank's gradient for them is a partial sum over tp: summed here in backward. Forward is unchanged;
    the weight's gradient is then the same whole gradient on every tp rank, as one device computes it.

    Raises:
        ValueError: at ``parallelize_module``, naming the module, when it is not an ``nn.Linear`` with
            more than ``rope_dim`` outputs.
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or module.out_features <= self.rope_dim:
            raise ValueError(
                f"LatentKeyParallel: {type(module).__name__} is not an nn.Linear with more than rope_dim={self.rope_dim} "
                "outputs (a latent part, then the rotary key)"
            )
        module.register_forward_hook(_RotaryGradientSummed(device_mesh, self.rope_dim))
        OWN_OUTPUT_GRADIENT.add(module)
        return module


class _RotaryGradientSummed:
    """Forward hook: the output's last ``rope_dim`` columns with their gradient summed over ``mesh``."""

    def __init__(self, mesh: DeviceMesh, rope_dim: int) -> None:
        self.mesh, self.rope_dim = mesh, rope_dim

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        latent, rotary = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, gradient_summed_over(rotary, self.mesh)], dim=-1)


HF_STYLES: dict[str, tuple[Callable[..., ParallelStyle], tuple[type[nn.Module], ...]]] = {
    "colwise": (ColwiseParallel, (nn.Linear,)),
    "rowwise": (RowwiseParallel, (nn.Linear,)),
    "colwise_gather_output": (_gathered_colwise, (nn.Linear,)),
    "colwise_rep": (_gathered_colwise, (nn.Linear,)),
    "rowwise_split_input": (_replicated_rowwise, (nn.Linear,)),
    "rowwise_rep": (_replicated_rowwise, (nn.Linear,)),
    "embedding_rowwise": (_replicated_rowwise, (nn.Embedding,)),
    "embedding_colwise": (_gathered_colwise, (nn.Embedding,)),
    "replicated_with_grad_allreduce": (_replicated_on_split_heads, (nn.Module,)),
    "moe_tp_experts": (PackedExpertsParallel, (nn.Module,)),
    "mla_kv_a_proj": (LatentKeyParallel, (nn.Linear,)),
}
"""``transformers`` style -> (a PyTorch style for it, the module classes it applies to). Each is made with
no argument, except ``LatentKeyParallel(rope_dim)``, given the model's ``qk_rope_head_dim``."""

_LEFT_WHOLE = {"replicate"}
"""Styles that ask for no parallelism: their modules stay whole on every tp rank, as modules a plan does not name."""

_EXPERT_WEIGHTS = {"packed_colwise": "gate_up", "rowwise": "down"}
"""The styles ``transformers`` gives the two weights of a ``moe_tp_experts`` module, and which they are."""

_INSTALL = "pip install 'lightning_ndclip[hf]'"


def transformers_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``transformers`` models inside ``module`` (itself included), with their names; none where
    ``transformers`` is not installed, or not imported (no model of it can exist before its model classes are)."""
    return outermost(module, "transformers.modeling_utils:PreTrainedModel")


def require_transformers(feature: str) -> None:
    """Raise the ``ImportError`` that names the extra to install, where ``feature`` needs ``transformers`` and it
    is not installed."""
    try:
        importlib.import_module("transformers")
    except ModuleNotFoundError:
        raise ImportError(
            f"{feature} needs Hugging Face transformers, which is not installed: {_INSTALL}"
        ) from None


def _check_heads(name: str, model: nn.Module, tp: int) -> None:
    """Refuse a head count that ``tp`` does not divide: the plan's column split would cut heads apart,
    which transformers' attention reports as a shape error deep in the first forward."""
    text = _text_config(model)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, field, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"tp_plan='auto': {name}'s config.{field} is {heads}, which tp={tp} does not divide: each "
                f"tensor-parallel rank must hold whole heads; choose a tp that divides {heads}"
            )


def _check_per_head_norms(prefix: str, model: nn.Module, entries: dict[str, str], submodules: dict[str, nn.Module]) -> None:
    """Refuse a ``q_norm`` / ``k_norm`` holding one weight row per head (Cohere's ``use_qk_norm``) that the
    plan leaves whole while it splits the heads: each rank's heads would meet every head's rows, which
    failed in the first forward with a shape error."""
    for name, child in submodules.items():
        weight = getattr(child, "weight", None)
        if name.rsplit(".", 1)[-1] not in ("q_norm", "k_norm") or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if not any(matches_plan_key(name, key) for key in entries):
            raise ValueError(
                f"tp_plan='auto': {f'{prefix}.' if prefix else ''}{name} ({type(child).__name__}) holds one weight row "
                f"per attention head ({list(weight.shape)}), which {type(model).__name__}'s plan leaves whole while "
                "it splits the heads over tp; give a tp_plan of your own, or train this model with tp=1"
            )


def _style_for(
    model: nn.Module, key: str, style: str, entries: dict[str, str], submodules: dict[str, nn.Module], params: list[str]
) -> ParallelStyle | None:
    """The PyTorch style for one plan entry of ``model`` (whose named submodules and parameter names are
    given); ``None`` for an entry that needs none (it matches nothing in this model, or is a weight of a
    ``moe_tp_experts`` module, which that module's style splits)."""
    where = f"{type(model).__name__}.tp_plan[{key!r}] = {style!r}"
    modules = {name: child for name, child in submodules.items() if matches_plan_key(name, key)}
    weights = [name for name in params if matches_plan_key(name, key)]
    if not modules and weights:  # an entry for weights, not modules
        holder = key.rpartition(".")[0]
        if style not in _EXPERT_WEIGHTS or entries.get(holder) != "moe_tp_experts":
            raise ValueError(
                f"{where} names weights ({weights[:3]}), which no plain PyTorch style shards one by one "
                f"(mapped: {_EXPERT_WEIGHTS} of a 'moe_tp_experts' module); give this model a tp_plan of "
                "ParallelStyles instead"
            )
        return None
    if style in _LEFT_WHOLE or not modules:  # not modules: layers this configuration does not have
        return None
    if style not in HF_STYLES:
        raise ValueError(
            f"{where}: no plain PyTorch ParallelStyle expresses {style!r} (mapped: {sorted(HF_STYLES)}); "
            "give this model a tp_plan of ParallelStyles instead"
        )
    make, classes = HF_STYLES[style]
    wrong = sorted(f"{n} ({type(m).__name__})" for n, m in modules.items() if not isinstance(m, classes))
    if wrong:
        raise ValueError(
            f"{where}: PyTorch's style for {style!r} shards {' / '.join(c.__name__ for c in classes)} modules, "
            f"not {wrong[:3]}"
        )
    if style == "moe_tp_experts":
        names = {
            _EXPERT_WEIGHTS[entries[f"{key}.{weight}"]]: weight
            for weight, _ in next(iter(modules.values())).named_parameters(recurse=False)
            if entries.get(f"{key}.{weight}") in _EXPERT_WEIGHTS
        }
        return PackedExpertsParallel(**names)
    if style == "mla_kv_a_proj":
        return LatentKeyParallel(rope_dim=_text_config(model).qk_rope_head_dim)
    return make()


def _text_config(model: nn.Module) -> Any:
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def hf_tp_plan(module: nn.Module, tp: int | None = None) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of the ``transformers`` models in ``module`` (``module`` itself, or its
    submodules: names are relative to ``module``), as ``{module name pattern: ParallelStyle}``.

    Args:
        module: the model, or a module holding ``transformers`` models.
        tp: the tensor-parallel size the plan is for: every model's attention and key-value head
            counts must divide by it (each rank holds whole heads). ``None``: not checked.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: no ``transformers`` model in ``module`` has a plan; or a plan entry has a style
            without a PyTorch equivalent, or names a module of a class its style cannot shard, or
            weights outside a ``moe_tp_experts`` module (each naming the entry); or a head count
            that ``tp`` does not divide (naming the config field); or a per-head ``q_norm`` /
            ``k_norm`` weight that the plan leaves whole (Cohere's ``use_qk_norm``).
    """
    plan = tp_plan_of(module, tp)
    if not plan:
        _refuse_empty(module, "tp_plan='auto'", "a tensor-parallel plan", "give tp_plan as {module name: ParallelStyle}")
    return plan


def tp_plan_of(module: nn.Module, tp: int | None) -> dict[str, ParallelStyle]:
    """:func:`hf_tp_plan`, empty where no model inside ``module`` has a plan."""
    plan: dict[str, ParallelStyle] = {}
    for prefix, model in transformers_models(module):
        if tp is not None:
            _check_heads(prefix or type(model).__name__, model, tp)
        entries = dict(getattr(model, "tp_plan", None) or {})
        submodules = {name: child for name, child in model.named_modules() if name}
        params = [name for name, _ in model.named_parameters()]
        _check_per_head_norms(prefix, model, entries, submodules)
        for key, style in entries.items():
            made = _style_for(model, key, style, entries, submodules, params)
            if made is not None:
                plan[f"{prefix}.{key}" if prefix else key] = made
    return plan


def _refuse_empty(module: nn.Module, feature: str, plan: str, instead: str) -> None:
    """The error of ``feature`` finding no model with ``plan`` in ``module``: ``transformers`` is not installed, or
    the models found (named) have none."""
    require_transformers(f"{feature} on {type(module).__name__}")
    found = ", ".join(f"{name or '(the module)'}: {type(m).__name__}" for name, m in transformers_models(module)) or "none"
    raise ValueError(
        f"{feature} found no Hugging Face transformers model with {plan} in {type(module).__name__} (transformers "
        f"models found: {found}); {instead}"
    )


_EP_DISPATCH, _EP_WEIGHT = "ep_dispatch_experts", "grouped_gemm"
"""The styles of ``transformers``' expert-parallel plans (``model.ep_plan``) for a packed-experts module and for
its expert weights."""


def hf_ep_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """The expert-parallel plan of the ``transformers`` models in ``module``, as ``{experts module pattern:
    ExpertParallel}`` (names relative to ``module``), from each model's own ``ep_plan``: every
    ``ep_dispatch_experts`` module gets :class:`~lightning_ndclip.core.parallel.expert_parallel.ExpertParallel`
    over the weights its ``grouped_gemm`` entries name (whole experts per ``ep`` rank, tokens by all-to-all).

    Entries with tensor-parallel styles for dense modules (``colwise`` / ``rowwise`` MLPs: ``transformers``
    splits those over its ep ranks) are not applied: here dense weights are sharded by FSDP2 over every data
    rank, and split over ``tp`` by the tensor-parallel plan. Numerically the same function either way.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: no ``transformers`` model in ``module`` has an expert-parallel plan (a dense model, or a
            release without ``model.ep_plan``); or an entry inside an experts module is no ``grouped_gemm`` weight
            (a weight all experts share, such as a norm, would get a partial gradient on each ``ep`` rank), or an
            entry outside the experts modules has a style that is no tensor-parallel one (each naming the entry).
    """
    plan = ep_plan_of(module)
    if not plan:
        _refuse_empty(
            module,
            "ep > 1 with tp_plan='auto'",
            f"an expert-parallel plan (model.ep_plan, with {_EP_DISPATCH!r} modules)",
            "train with ep=1, or parallelize its experts yourself in configure_model",
        )
    return plan


def ep_plan_of(module: nn.Module) -> dict[str, ParallelStyle]:
    """:func:`hf_ep_plan`, empty where no model inside ``module`` has an expert-parallel plan."""
    plan: dict[str, ParallelStyle] = {}
    for prefix, model in transformers_models(module):
        entries = dict(getattr(model, "ep_plan", None) or {})
        dispatched = [key for key, style in entries.items() if style == _EP_DISPATCH]
        for key, style in entries.items():
            holder = next((d for d in dispatched if key.startswith(f"{d}.")), None)
            if holder is None and (style in HF_STYLES or style in _LEFT_WHOLE):
                continue  # a dense module split the tensor-parallel way: FSDP2 and the tp plan place it here
            if style != _EP_DISPATCH and (holder is None or style != _EP_WEIGHT):
                raise ValueError(
                    f"{type(model).__name__}.ep_plan[{key!r}] = {style!r}: expert parallelism here maps "
                    f"{_EP_DISPATCH!r} modules and the {_EP_WEIGHT!r} expert weights inside them (and leaves dense "
                    "modules to FSDP2 and the tp plan); train this model with ep=1"
                )
        for key in dispatched:
            weights = [k[len(key) + 1 :] for k, style in entries.items() if style == _EP_WEIGHT and k.startswith(f"{key}.")]
            plan[f"{prefix}.{key}" if prefix else key] = ExpertParallel(weights=weights or None)
    return plan


def expert_routing(source: Any) -> ExpertRouting | None:
    """How a ``transformers`` MoE model or config routes: the model's own ``num_experts`` and ``num_experts_per_tok``
    (what its ``aux_loss`` uses), else the config's ``num_experts`` / ``num_local_experts`` / ``n_routed_experts`` /
    ``moe_num_experts`` and ``num_experts_per_tok`` / ``moe_k`` (a multimodal config's ``text_config``), with its
    ``router_aux_loss_coef``; ``None`` without an expert count or a top-k."""
    sources = [source, getattr(source, "config", None)]
    sources += [getattr(s, "text_config", None) for s in list(sources) if s is not None]
    experts = _first(sources, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))
    top_k = _first(sources, ("num_experts_per_tok", "moe_k"))
    if experts is None or top_k is None:
        return None
    coefs = [getattr(s, "router_aux_loss_coef", None) for s in sources[:2] if s is not None]
    coef = next((float(c) for c in coefs if isinstance(c, (int, float)) and not isinstance(c, bool)), None)
    return ExpertRouting(experts, top_k, coef)


def _first(sources: list[Any], names: tuple[str, ...]) -> int | None:
    for source in sources:
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def output_heads(module: nn.Module) -> dict[str, nn.Module]:
    """``{name of the LM head: its model}`` for the ``transformers`` models inside ``module`` that have output
    embeddings (``get_output_embeddings()``: a causal LM's ``lm_head``); names relative to ``module``."""
    heads: dict[str, nn.Module] = {}
    for prefix, model in transformers_models(module):
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
        if name:
            heads[f"{prefix}.{name}" if prefix else name] = model
    return heads


def vocab_parallel_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``transformers``' ``ForCausalLMLoss`` on vocabulary-sharded logits (loss parallel), the ``loss_function`` that
    :func:`~lightning_ndclip.core.parallel.loss_parallel.loss_parallel_plan` gives a causal LM: the labels shifted
    by one (or ``shift_labels`` as given: context parallelism passes them), the cross-entropy of every token by
    :func:`~lightning_ndclip.core.parallel.loss_parallel.vocab_parallel_cross_entropy`, then their sum divided by
    ``num_items_in_batch`` when given, else their mean over the tokens that count. The same function on plain
    logits, in at least float32 (``ForCausalLMLoss`` rounds float64 logits to float32; this keeps float64).
    Further keyword arguments are ignored, as ``ForCausalLMLoss`` ignores them.

    Raises:
        ValueError: ``vocab_size`` is not the logits' last dim, or the logits are not one per label (e.g.
            ``logits_to_keep`` with ``labels``), or a label is out of range (see ``vocab_parallel_cross_entropy``).
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("vocab_parallel_causal_lm_loss needs labels or shift_labels")
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"the logits hold {logits.shape[-1]} classes, and the model's vocab_size is {vocab_size}")
    if shift_labels.numel() * vocab_size != logits.numel():
        raise ValueError(
            f"loss parallel: {tuple(logits.shape)} logits for {tuple(shift_labels.shape)} labels (logits_to_keep with "
            "labels?): the model's loss needs one logit row per label"
        )
    target = shift_labels.reshape(logits.shape[:-1])
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        count = num_items_in_batch.to(loss.device) if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch
        loss = loss / count
    return loss


class _LossWatch:
    """Forward hooks of a causal LM under loss parallel: a ``.loss`` it returned must come from its
    ``loss_function`` (:func:`vocab_parallel_causal_lm_loss`), not from code of its own on the sharded logits."""

    def __init__(self) -> None:
        self.called = False

    def loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.called = True
        return vocab_parallel_causal_lm_loss(*args, **kwargs)

    def enter(self, module: nn.Module, args: Any) -> None:
        self.called = False

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None and not self.called:
            raise ValueError(
                f"loss parallel: {type(module).__name__} returned a .loss without calling its loss_function, which "
                "computes it on the vocabulary shards; train this model without loss_parallel"
            )


def replay_loss_parallel(parallel: nn.Module, plain: nn.Module) -> None:
    """Give each ``transformers`` model in ``plain`` (an unparallelized copy, e.g. ``VerifyOneDevice``'s) whose
    same-named model in ``parallel`` computes its loss on vocabulary shards (:func:`use_vocab_parallel_loss`) that
    loss function too: on whole logits it is cross-entropy in the logits' precision, the function the parallel run
    computes, where ``transformers``' own rounds float64 logits to float32 (a one-process replay in float64 then
    differs by float32's rounding)."""
    models = dict(plain.named_modules())
    for name, model in parallel.named_modules():
        if isinstance(getattr(getattr(model, "loss_function", None), "__self__", None), _LossWatch) and name in models:
            setattr(models[name], "loss_function", vocab_parallel_causal_lm_loss)  # noqa: B010 (typed Tensor | Module)


def recompute_without_cache(module: nn.Module, recomputed: Collection[nn.Module]) -> None:
    """Make every ``transformers`` model in ``module`` holding a module of ``recomputed`` (layers whose activations are
    recomputed in backward) run its training forwards with ``use_cache=False``, as ``transformers``' own gradient
    checkpointing does: a recomputed layer would otherwise append its keys and values to the call's cache a second
    time and attend to twice the sequence (a shape error in backward). Forwards in eval mode (``generate``) keep their
    cache."""
    kept = {id(m) for m in recomputed}
    for _, model in transformers_models(module):
        takes = "use_cache" in inspect.signature(model.forward).parameters
        if takes and any(id(m) in kept for m in model.modules()):
            model.register_forward_pre_hook(_without_cache, with_kwargs=True)


def _without_cache(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    if not module.training:
        return None
    return args, {**kwargs, "use_cache": False}


def _computes_its_own_loss(model: nn.Module) -> bool:
    """Whether the forward of ``model``'s ``transformers`` class (the first in its MRO that defines one) never looks up
    ``loss_function``: it computes its loss itself (transformers 5.0's Gemma 3 causal LM: ``nn.CrossEntropyLoss``). A
    subclass of yours is watched at run time instead (:class:`_LossWatch`)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and "forward" in vars(cls):
            code = getattr(inspect.unwrap(vars(cls)["forward"]), "__code__", None)
            return code is not None and "loss_function" not in code.co_names
    return False


def use_vocab_parallel_loss(model: nn.Module) -> None:
    """Make ``model`` (a ``transformers`` causal LM whose head a loss-parallel plan shards) compute its ``.loss`` with
    :func:`vocab_parallel_causal_lm_loss` (once; a ``.loss`` not computed by it is then a ``ValueError``).

    Raises:
        ValueError: its loss is not ``transformers``' ``ForCausalLMLoss`` (another head type, or a custom
            ``loss_function``), or its class's forward computes the loss without it: no vocabulary-parallel
            version of it exists here.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    current = model.loss_function
    if isinstance(getattr(current, "__self__", None), _LossWatch):
        return
    if _computes_its_own_loss(model):
        raise ValueError(
            f"loss parallel: {type(model).__name__}'s forward computes its .loss with code of its own (not its "
            "loss_function, which loss parallel replaces), which cannot take vocabulary-sharded logits; train this "
            "model without loss_parallel"
        )
    if current is not ForCausalLMLoss:
        name = getattr(current, "__name__", type(current).__name__)
        raise ValueError(
            f"loss parallel: {type(model).__name__}'s loss_function is {name}, and loss parallel replaces "
            "transformers' ForCausalLMLoss only; train this model without loss_parallel"
        )
    watch = _LossWatch()
    setattr(model, "loss_function", watch.loss)  # noqa: B010 (an nn.Module attribute mypy types as Tensor | Module)
    model.register_forward_pre_hook(watch.enter)
    model.register_forward_hook(watch.leave)
