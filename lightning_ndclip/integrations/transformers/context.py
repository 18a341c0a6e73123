r"""Context parallelism for Hugging Face ``transformers`` models: their batches cut along the sequence,
their attention routed to ring attention, their loss kept exact.

A ``transformers`` model is not written for a cut sequence: it numbers positions from 0, masks within the
tokens it is given, and shifts its labels by one inside its loss. Three pieces make it exact on the ``cp``
ranks without changing the user's code:

* :func:`shard_batch` cuts every ``[rows, seq, ...]`` tensor of a batch (``input_ids``, ``labels``,
  ``attention_mask``, ``position_ids``, ...) into this rank's load-balanced chunks
  (:func:`~lightning_ndclip.core.context.attention.shard_sequence`) and returns them with a
  :class:`SequenceShard`: the global positions of the local tokens and the mask ``transformers`` would
  build from the *whole* batch, as document ids. Its rule is ``transformers``' own (``masking_utils``): a 2-D
  ``attention_mask`` masks padding *keys*; without one, ``position_ids`` that do not step by 1 start a new
  document (packed sequences); causal by index; the sliding window of each layer's mask (else its ``sliding_window``).
* :func:`context_parallelize` switches a model to an attention function registered with ``transformers``'
  ``AttentionInterface`` that runs :func:`~lightning_ndclip.core.context.ring_attention.ring_attention`
  (or the all-gather variant) with the active shard's positions and documents, and the layer's own
  scale, window, soft-cap and sinks; outside an active shard it is the model's original attention. Its
  forward pre-hooks give the model the global ``position_ids`` (rotary embeddings of every variant then
  see the positions one device sees) and ``use_cache=False``.
* The model's own loss (``labels=``): the labels are shifted over the *whole* sequence (a cut chunk's
  last token predicts the first token of the next chunk, on another rank) and passed as ``shift_labels``,
  with ``num_items_in_batch`` the micro-batch's count over all cp ranks. So ``.loss`` is this rank's part
  of the micro-batch's token mean: summed over the cp ranks it is the one-device ``.loss``
  (:attr:`SequenceShard.model_losses` records it, for a loss scaling that must know).

Each layer's ``attention_dropout`` must be 0 in training (a ring cannot replay one device's dropout);
``output_attentions``, a cache and 4-D masks are refused, naming them.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip import _compat
from lightning_ndclip.core.context.attention import context_parallel_attention, shard_sequence
from lightning_ndclip.core.context.ring_attention import ring_attention

__all__ = ["SequenceShard", "context_parallelize", "shard_batch"]

IGNORE_INDEX = -100
"""``transformers``' label for a token that is not predicted."""

_PREFIX = "ndclip_cp_"
_ACTIVE: contextvars.ContextVar[SequenceShard | None] = contextvars.ContextVar("ndclip_sequence_shard", default=None)
_CALL: contextvars.ContextVar[_RingMask | None] = contextvars.ContextVar("ndclip_ring_mask", default=None)
"""The running base model call's mask, from its pre-hook to its end (what the mask functions return)."""


@dataclass
class SequenceShard:
    """One micro-batch cut along the sequence, as one cp rank holds it.

    Attributes:
        group: the cp process group.
        positions: ``[local_seq]`` global positions of this rank's tokens.
        length: the whole sequence's length.
        kv_exchange: ``"ring"`` or ``"all_gather"``.
        model_losses: the ``.loss`` each context-parallel model returned while this shard was active.
    """

    group: dist.ProcessGroup
    positions: torch.Tensor
    length: int
    kv_exchange: Literal["ring", "all_gather"] = "ring"
    model_losses: list[torch.Tensor] = field(default_factory=list)

    @contextmanager
    def active(self) -> Iterator[SequenceShard]:
        """Within this block the context-parallel models attend, number positions and shift labels by
        this shard."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def unshard(self, local: torch.Tensor) -> torch.Tensor:
        """The whole ``[rows, length, ...]`` tensor from every rank's ``[rows, local_seq, ...]`` part
        (an all-gather over the group; no gradient)."""
        size = dist.get_world_size(self.group)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        whole = local.new_empty((local.shape[0], self.length, *local.shape[2:]))
        for r, part in enumerate(parts):
            whole[:, _positions(self.length, r, size, self.positions.device)] = part
        return whole


def _positions(length: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    return shard_sequence(torch.empty(length, device=device), rank, size, dim=0, load_balance=True)[1]


def shard_batch(
    batch: Mapping[str, Any], cp: DeviceMesh, *, kv_exchange: Literal["ring", "all_gather"] = "ring"
) -> tuple[dict[str, Any], SequenceShard]:
    """This cp rank's part of a ``transformers`` batch and the :class:`SequenceShard` describing it.

    Every tensor shaped ``[rows, seq, ...]`` like ``input_ids`` (or ``inputs_embeds``) is cut along dim 1
    into the load-balanced chunks of :func:`~lightning_ndclip.core.context.attention.shard_sequence`
    (rank ``r`` of ``cp`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``); other values are kept.

    Raises:
        ValueError: naming the key, for a batch that is not a mapping with ``input_ids`` or
            ``inputs_embeds``, a sequence length ``2 cp`` does not divide, or an ``attention_mask`` that
            is not 2-D.
    """
    if not isinstance(batch, Mapping) or not ("input_ids" in batch or "inputs_embeds" in batch):
        raise ValueError(
            "with cp > 1 and tp_plan='auto' the batch is cut along the sequence: it must be a dict holding "
            f"'input_ids' (or 'inputs_embeds'), as transformers' collators make; got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    anchor = batch["input_ids"] if "input_ids" in batch else batch["inputs_embeds"]
    rows, length = anchor.shape[:2]
    size, rank = cp.size(), cp.get_local_rank()
    if length % (2 * size):
        raise ValueError(
            f"with cp={size} each sequence is cut into 2 x cp = {2 * size} chunks, and the batch's sequence length "
            f"{length} is not a multiple of {2 * size}: pad the batch to a multiple of {2 * size} (e.g. the collator's "
            "pad_to_multiple_of)"
        )
    if batch.get("attention_mask") is not None and getattr(batch["attention_mask"], "dim", lambda: 0)() != 2:
        raise ValueError(
            "with cp > 1 the attention mask is cut along the sequence with the batch: 'attention_mask' must be the 2-D "
            f"[rows, seq] padding mask, got {getattr(batch['attention_mask'], 'shape', type(batch['attention_mask']))}; "
            "pass packed sequences as position_ids restarting at 0 instead"
        )
    local = {
        key: shard_sequence(value, rank, size, dim=1, load_balance=True)[0]
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, length)
        else value
        for key, value in batch.items()
    }
    return local, SequenceShard(cp.get_group(), _positions(length, rank, size, anchor.device), length, kv_exchange)


@dataclass(frozen=True)
class _RingMask:
    """What the model's mask function returns under an active shard, and ``transformers`` hands every layer's
    attention as its ``attention_mask`` (so a layer recomputed in backward by activation checkpointing gets it
    again, after the shard's block has ended)."""

    group: dist.ProcessGroup
    positions: torch.Tensor
    query_docs: torch.Tensor | None
    key_docs: torch.Tensor | None
    kv_exchange: Literal["ring", "all_gather"]
    window: int | None = None
    """The sliding window of the mask ``transformers`` asked for (its ``local_size``): one device's sdpa and eager
    attention apply a window through the mask alone, whether or not the layer also passes ``sliding_window``."""
    used: list[str] = field(default_factory=list, compare=False)
    """The attention modules that ran through the ring in this call."""


def _documents(
    shard: SequenceShard, attention_mask: Any, position_ids: torch.Tensor | None, packing: bool, rows: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This call's ``(query ids, key ids)`` of the local tokens, by ``transformers``' rule (``masking_utils``): a
    2-D ``attention_mask`` masks padding keys (``-1``); without one, when ``transformers`` looks for packed
    sequences (no cache: ``packing``), ``position_ids`` that do not step by 1 over the *whole* row start a new
    document (``find_packed_sequence_indices``); else ``None``, one causal sequence per row."""
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError(
                "cp > 1: the model was given an attention_mask of shape "
                f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}; under cp only the 2-D [rows, seq] "
                "padding mask is rebuilt across the ranks. Pass packed sequences as position_ids restarting at 0"
            )
        query = torch.zeros(attention_mask.shape, dtype=torch.int64, device=attention_mask.device)
        return query, torch.where(attention_mask.bool(), query, -1)
    if position_ids is None or not packing:
        return None, None
    whole = shard.unshard(position_ids.expand(rows, -1))
    step = torch.diff(whole, prepend=whole[:, :1] - 1, dim=-1)
    docs = (step != 1).cumsum(-1)[:, shard.positions]
    return docs, docs


def context_parallelize(model: Any, cp: DeviceMesh) -> None:
    """Make a ``transformers`` model context parallel over ``cp`` (see the module docstring): its attention
    implementation becomes the registered ring attention, and two forward pre-hooks give it global
    positions and globally shifted labels while a :class:`SequenceShard` is active.

    Raises:
        ValueError: naming the model and the config field, for an ``attention_dropout`` above 0 or an
            attention implementation other than ``sdpa`` / ``eager`` / ring attention.
    """
    name = type(model).__name__
    config = model.config
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(
            f"cp > 1: {name}'s config.attention_dropout is {dropout}; ring attention computes no dropout, so the step would "
            "not be one device's. Set config.attention_dropout = 0.0 (the usual setting for fine-tuning)"
        )
    for field_name, unlike in _MASKS_THE_RING_DOES_NOT_BUILD.items():
        if getattr(config, field_name, None) not in (None, unlike):
            raise ValueError(
                f"cp > 1: {name}'s config.{field_name} is {getattr(config, field_name)!r}, an attention mask the ring "
                "attention does not build; train this model without cp"
            )
    original = _compat.attention_implementation(config)
    if not original.startswith(_PREFIX):
        if original not in ("sdpa", "eager"):
            raise ValueError(
                f"cp > 1: {name} uses attn_implementation={original!r}; context parallelism replaces it with ring "
                "attention and keeps 'sdpa' or 'eager' for calls outside training: load the model with one of those"
            )
        if not switch_attention(model, _PREFIX + original, original, _attention_for(original), _ring_mask_for(original)):
            raise ValueError(
                f"cp > 1: {name} does not take an attention implementation from transformers' AttentionInterface, "
                "so its attention cannot be routed to ring attention; train this model without cp"
            )
    if getattr(config, "is_decoder", None) is False and any(getattr(m, "is_causal", None) is False for m in model.modules()):
        raise ValueError(  # BERT-style: bidirectional attention unless config.is_decoder
            f"cp > 1: {name}'s config.is_decoder is False: its attention is bidirectional, an attention mask the ring "
            "attention does not build; set config.is_decoder = True for a causal LM, or train this model without cp"
        )
    layer_types = [kind for kind in getattr(config, "layer_types", None) or () if kind not in _RING_LAYER_TYPES]
    if layer_types:
        raise ValueError(
            f"cp > 1: {name}'s config.layer_types holds {layer_types[0]!r} layers, which mix the sequence other than "
            "by the attention ring attention replaces; train this model without cp"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    dynamic = sorted(_rope_types(rope) & _DYNAMIC_ROPE)
    if dynamic:
        raise ValueError(
            f"cp > 1: {name}'s rotary embedding is {dynamic[0]!r}, whose frequencies depend on the largest position of the "
            "call, which differs between the cp ranks; train this model without cp, or with a static rope_type"
        )
    if isinstance(rope, Mapping) and _rope_types(rope) - {"default"} and rope.get("short_mscale") != rope.get("long_mscale"):
        raise ValueError(  # PhiMoE: short_mscale up to original_max_position_embeddings, long_mscale beyond
            f"cp > 1: {name}'s rotary embedding scales by config.rope_parameters['short_mscale'] or ['long_mscale'], "
            "whichever the call's largest position picks, which differs between the cp ranks; train this model without "
            "cp, or with equal short_mscale and long_mscale"
        )
    if getattr(config, "model_type", None) in _NOT_EXACT:
        raise ValueError(f"cp > 1: {name} {_NOT_EXACT[config.model_type]}; train this model without cp")
    base = getattr(model, "base_model", model)
    numbering = next((type(m).__name__ for m in model.modules() if hasattr(m, "create_position_ids_from_input_ids")), None)
    base.register_forward_pre_hook(functools.partial(_global_positions, own_numbering=numbering), with_kwargs=True)
    base.register_forward_hook(_end_of_call)
    if base is not model:
        model.register_forward_pre_hook(_shifted_labels, with_kwargs=True)
    model.register_forward_hook(_record_loss)


_MASKS_THE_RING_DOES_NOT_BUILD = {"attention_chunk_size": None, "is_causal": True, "use_bidirectional_attention": False}
"""Config fields that change transformers' mask beyond causal, window, padding and packing, and their plain value."""
_RING_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "moe", "dense"}
"""``config.layer_types`` the ring computes (chunked: refused by ``attention_chunk_size``) or that mix no tokens."""


_DYNAMIC_ROPE = {"dynamic", "longrope"}
"""Rope types whose frequencies ``transformers`` updates from the call's largest position (``dynamic_rope_update``)."""
_NOT_EXACT = {
    "doge": "reads its attention mask as a tensor, which under cp it is not",
    "git": "adds its own mask to the attention mask, which under cp is built by the ring",
}
"""Families (``config.model_type``) the sweep over every causal LM finds wrong or failing under cp, refused by name."""


def _rope_types(parameters: Any) -> set[str]:
    """Every ``rope_type`` of a config's rope parameters (Gemma 3 nests one dict per layer type)."""
    if not isinstance(parameters, Mapping):
        return set()
    found = {parameters[key] for key in ("rope_type", "type") if isinstance(parameters.get(key), str)}
    return found.union(*(_rope_types(value) for value in parameters.values()))


def _ring_mask_for(original: str) -> Callable[..., Any]:
    """The mask function registered beside the ring attention: the step's ring mask inside an active shard (with the
    sliding window a layer asks for), ``original``'s outside one."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    original_mask = ALL_MASK_ATTENTION_FUNCTIONS[original]

    def mask(*args: Any, **kwargs: Any) -> Any:
        ring = _CALL.get()
        if ring is None:
            return original_mask(*args, **kwargs)
        window = kwargs.get("local_size")  # create_sliding_window_causal_mask's window (chunked masks are refused)
        return ring if window is None else replace(ring, window=window)

    return mask


def switch_attention(
    model: nn.Module, name: str, original: str, attention: Callable[..., Any], mask: Callable[..., Any] | None = None
) -> bool:
    """Register ``attention`` (and ``mask``, else ``original``'s mask function) with transformers'
    ``AttentionInterface`` under ``name`` and switch ``model`` to it; whether it took it. A model whose attention is
    not looked up by name keeps ``original``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask or ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)  # type: ignore[operator]
    if _compat.attention_implementation(model.config) == name:
        return True
    model.set_attn_implementation(original)  # type: ignore[operator]
    return False


def _attention_for(original: str) -> Callable[..., tuple[torch.Tensor, None]]:
    """The attention function registered as ``ndclip_cp_<original>``."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        if not isinstance(attention_mask, _RingMask):
            if _ACTIVE.get() is not None:  # inside a cut step, a mask transformers' mask functions did not make
                raise ValueError(
                    f"cp > 1: {type(module).__name__} was given an attention mask its model built itself "
                    f"({type(attention_mask).__name__}), which does not see the other cp ranks' tokens; train this model "
                    "without cp"
                )
            return original_attention(module, original)(module, query, key, value, attention_mask, **kwargs)
        attention_mask.used.append(type(module).__name__)
        return _sharded_attention(attention_mask, module, query, key, value, **kwargs), None

    return attention


def original_attention(module: nn.Module, original: str) -> Callable[..., Any]:
    """The attention function ``module`` (an attention module of a ``transformers`` model) calls under the
    implementation named ``original``."""
    if original == "eager":  # each family's own eager function (soft-capping, sinks, ...)
        found: Callable[..., Any] = sys.modules[type(module).__module__].eager_attention_forward
        return found
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return cast("Callable[..., Any]", ALL_ATTENTION_FUNCTIONS[original])


def _sharded_attention(
    ring: _RingMask,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    if dropout:
        raise ValueError(f"cp > 1: {type(module).__name__} attends with dropout {dropout}; ring attention computes none")
    if kwargs.get("output_attentions"):
        raise ValueError("cp > 1: output_attentions=True is not available: no rank ever holds a whole attention matrix")
    biases = [key for key in ("position_bias", "alibi", "attention_bias") if kwargs.get(key) is not None]
    if biases:
        raise ValueError(f"cp > 1: {type(module).__name__} adds {biases[0]} to its scores, which ring attention does not")
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: each key-value head serves `groups` heads
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    common: dict[str, Any] = {
        "group": ring.group, "positions": ring.positions, "is_causal": is_causal, "sample_ids": ring.query_docs,
        "kv_sample_ids": ring.key_docs, "window": ring.window if ring.window is not None else sliding_window,
        "scale": scaling,
    }  # fmt: skip
    if ring.kv_exchange == "ring":
        out = ring_attention(query, key, value, softcap=softcap, sinks=s_aux, **common)
    elif softcap is not None or s_aux is not None:
        raise ValueError(
            f"cp > 1: {type(module).__name__} uses {'soft-capping' if softcap is not None else 'attention sinks'}, which "
            "kv_exchange='all_gather' does not compute; use kv_exchange='ring' (the default)"
        )
    else:
        out = context_parallel_attention(query, key, value, kv_exchange="all_gather", **common)
    return out.transpose(1, 2).contiguous()


class _Call:
    """A forward's arguments by name, whether given by position or by keyword; changed ones go back where they came."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.names = list(inspect.signature(module.forward).parameters)
        self.args, self.kwargs = list(args), dict(kwargs)

    def get(self, name: str) -> Any:
        index = self.names.index(name) if name in self.names else len(self.args)
        return self.args[index] if index < len(self.args) else self.kwargs.get(name)

    def set(self, name: str, value: Any) -> None:
        index = self.names.index(name) if name in self.names else len(self.args)
        if index < len(self.args):
            self.args[index] = value
        else:
            self.kwargs[name] = value

    def hook_result(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(self.args), self.kwargs


def _global_positions(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, own_numbering: str | None
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The base model's pre-hook: this call's mask, and global ``position_ids`` where none are given (refused for a
    model that numbers positions its own way: ``own_numbering``, the module that does)."""
    shard = _ACTIVE.get()
    if shard is None:
        return None
    call = _Call(module, args, kwargs)
    for refused in ("past_key_values", "cache"):
        if call.get(refused) is not None:
            raise ValueError(f"cp > 1: {type(module).__name__} was given {refused}; a cache is not cut along the sequence")
    anchor = call.get("input_ids")
    anchor = call.get("inputs_embeds") if anchor is None else anchor
    rows, local = anchor.shape[:2]
    if local != shard.positions.numel():
        raise ValueError(
            f"cp > 1: {type(module).__name__} was given {local} tokens per row, and this rank's part of the batch holds "
            f"{shard.positions.numel()}: call the model on the batch the strategy cut (training_step's batch)"
        )
    position_ids = call.get("position_ids")
    if position_ids is None and own_numbering is not None:
        raise ValueError(
            f"cp > 1: {own_numbering} numbers positions from its padding_idx (create_position_ids_from_input_ids), not "
            "0, 1, ...; pass the position_ids the model should see in the batch"
        )
    docs = _documents(shard, call.get("attention_mask"), position_ids, not _uses_cache(module, call), rows)
    _CALL.set(_RingMask(shard.group, shard.positions, *docs, shard.kv_exchange))
    if position_ids is None:
        call.set("position_ids", shard.positions.expand(rows, -1))
    return call.hook_result()


def _uses_cache(module: nn.Module, call: _Call) -> bool:
    """Whether ``transformers`` builds a cache for this call (then it looks for no packed sequences): ``use_cache``,
    else the config's, off under gradient checkpointing in training."""
    use_cache = call.get("use_cache")
    use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
    checkpointing = getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled()
    return bool(use_cache) and not checkpointing


def _end_of_call(module: nn.Module, args: Any, output: Any) -> None:
    ring = _CALL.get()
    _CALL.set(None)
    if ring is not None and not ring.used:
        raise ValueError(
            f"cp > 1: no attention of {type(module).__name__} ran through the ring attention: it mixes the sequence "
            "some other way (state-space or recurrent layers), which a cut sequence does not compute; train this "
            "model without cp"
        )


def _shifted_labels(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The causal LM's pre-hook: ``labels`` shifted over the whole sequence, as ``shift_labels``, and the
    micro-batch's count as ``num_items_in_batch``."""
    shard = _ACTIVE.get()
    if shard is None:
        return None
    call = _Call(module, args, kwargs)
    labels = call.get("labels")
    if labels is None or "shift_labels" in kwargs:
        return None
    if "num_items_in_batch" in kwargs:
        raise ValueError(
            f"cp > 1: {type(module).__name__} was given num_items_in_batch; under cp it is the micro-batch's count of "
            "predicted tokens over every cp rank, which the model computes itself: drop the argument"
        )
    whole = shard.unshard(labels)
    shifted = torch.cat([whole[:, 1:], whole.new_full((whole.shape[0], 1), IGNORE_INDEX)], dim=1)
    call.set("shift_labels", shifted[:, shard.positions])
    call.set("num_items_in_batch", (shifted != IGNORE_INDEX).sum())
    return call.hook_result()


def _record_loss(module: nn.Module, args: Any, output: Any) -> None:
    shard = _ACTIVE.get()
    loss = getattr(output, "loss", None)
    if shard is not None and isinstance(loss, torch.Tensor):
        shard.model_losses.append(loss)
