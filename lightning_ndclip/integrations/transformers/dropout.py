"""Attention dropout over tensor-parallel heads of ``transformers`` models: each tp rank draws its own heads' masks.

One device draws the dropout mask of the attention probabilities ``[batch, heads, S, S]`` at once: every head its own
numbers. Under tensor parallelism each tp rank holds ``heads / tp`` of them, and its peers draw from the same stream
(they must, for the dropout on activations every tp rank holds whole): without more, head ``h`` on tp rank 0 and head
``h + heads / tp`` on tp rank 1 get the same mask, which no one-device step does (``VerifyOneDevice`` replays it
exactly: it replays the draws the ranks made). :func:`fork_split_head_dropout` routes a model's attention through a
function registered with ``transformers``' ``AttentionInterface`` (as ``ndclip_tp_<implementation>``) that calls the
model's own one (its ``eager_attention_forward``, or the registered ``sdpa``...) with the random generators seeded, for
the call, from where the shared stream is and this rank's tp coordinate
(:func:`~lightning_ndclip.core.random.seeded_from_state`), when the call drops out (``dropout > 0``) on
an attention module whose weights tensor parallelism splits; every other call is the model's own. The shared stream
then moves on to a state seeded from where it was, alike on the tp peers. Both depend on the generators' state alone,
so a recomputation in backward (activation checkpointing restores that state) draws the same masks. Only the
attention probabilities' draws are per rank: a dropout after the output projection (an output every tp rank holds
whole) stays on the shared stream.

Pure PyTorch and ``transformers``; the strategy installs it at ``fit``'s setup for every ``transformers`` model with
``config.attention_dropout > 0`` and ``tp > 1``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ndclip import _compat
from lightning_ndclip.core.random import seeded_from_state
from lightning_ndclip.integrations.transformers.context import original_attention, switch_attention

__all__ = ["fork_split_head_dropout"]

_PREFIX = "ndclip_tp_"
_RANKS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
"""Module of a model :func:`fork_split_head_dropout` set up -> this rank's tp coordinate."""
_SPLIT: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
"""Attention module -> whether tensor parallelism splits its weights (its heads), once per module."""


def _split_over_tp(parameter: torch.Tensor) -> bool:
    if not isinstance(parameter, DTensor):
        return False
    return any(dim == "tp" and p.is_shard() for dim, p in zip(parameter.device_mesh.mesh_dim_names or (), parameter.placements))


def _splits_heads(module: nn.Module) -> bool:
    if module not in _SPLIT:
        _SPLIT[module] = any(_split_over_tp(p) for p in module.parameters())
    return _SPLIT[module]


def _forked(original: str) -> Callable[..., Any]:
    """``original``'s attention with this rank's own dropout numbers where tensor parallelism splits its heads."""

    def attention(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        own = original_attention(module, original)
        rank = _RANKS.get(module)
        if rank is None or not kwargs.get("dropout") or not _splits_heads(module):
            return own(module, query, *args, **kwargs)
        with seeded_from_state(query.device, "heads", rank):  # this rank's heads: numbers of their own
            return own(module, query, *args, **kwargs)

    return attention


def fork_split_head_dropout(model: nn.Module, tp_rank: int) -> Callable[[], None]:
    """Draw the attention dropout of ``model`` (a ``transformers`` model, tensor-parallelized) per tp rank on its
    attention modules whose heads tensor parallelism splits (see the module docstring); ``tp_rank``: this rank's
    coordinate on the tp mesh dim. The tp peers' generators must be alike (as the strategy seeds them:
    :meth:`~lightning_ndclip.core.random.RandomStreams.seed_shared`). Returns what undoes it (the model's attention
    implementation back).

    Raises:
        ValueError: the model's attention is not looked up by name in ``AttentionInterface`` (its dropout could not be
            routed); before any change.
    """
    config = model.config
    original = _compat.attention_implementation(config)
    if original.startswith(_PREFIX):
        raise ValueError(f"fork_split_head_dropout: {type(model).__name__}'s attention is forked already")
    if not switch_attention(model, _PREFIX + original, original, _forked(original)):
        raise ValueError(
            f"tp > 1 with attention dropout: {type(model).__name__} does not take its attention from transformers' "
            "AttentionInterface, so each tp rank's heads cannot draw their own dropout masks; set "
            "config.attention_dropout = 0.0, or train this model without tp"
        )
    modules = list(model.modules())
    for module in modules:
        _RANKS[module] = tp_rank

    def undo() -> None:
        for module in modules:
            _RANKS.pop(module, None)
        model.set_attn_implementation(original)  # type: ignore[operator]

    return undo


def attention_dropout(model: nn.Module) -> float:
    """``model``'s ``config.attention_dropout`` (0 without one)."""
    value = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    return float(value) if isinstance(value, (int, float, torch.Tensor)) else 0.0
