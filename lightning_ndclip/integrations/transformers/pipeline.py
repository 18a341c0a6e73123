"""Pipeline stages of a Hugging Face ``transformers`` model, cut where its own pipeline plan says.

A ``transformers`` model names the pieces a pipeline cuts between in its config's
``base_model_pp_plan``: ``{"embed_tokens": ..., "layers": ..., "norm": ...}`` for the decoder-only
families, in the order its forward runs them, and the head in the model class's ``_pp_plan``
(``{"lm_head": ...}``). :class:`HFPipelineSplit` makes those pieces the units
:mod:`lightning_ndclip.core.pipeline` cuts stages from: ``model.embed_tokens``, ``model.layers.0``, ...,
``model.layers.{n-1}``, ``model.norm``, ``lm_head`` (names relative to the model, as its parameters
are named), by default ``pp x stages_per_rank`` stages of equally many decoder layers.

Each stage is a copy of the model holding only its units: the others are replaced by modules without
parameters that pass their input through, so the stage's parameters keep the names of the unsplit
model (ties, checkpoints and the norm's report use them) and its own ``tp_plan`` still applies. The
stage runs the model's own forward: the base model computes the positions, the attention masks (per
layer type: sliding and full) and the rotary position embeddings from the hidden states it receives,
on every stage, and calls its layers by their global index; the last stage runs the model class's
forward, which adds what it does after the base model (the LM head, Gemma's logit soft-capping) and
returns the logits. A stage after the first gives its hidden states to its first layer directly:
what the base model's forward does to its input before the layers (Gemma's embedding scale in
releases that apply it there, an embedding dropout) belongs to the first stage only.

The stages exchange hidden states only: the batch is ``input_ids``, with the default positions
``0..S-1`` and the causal mask (no ``attention_mask``, ``position_ids`` or packed documents).

Pure PyTorch and ``transformers``; the generic pipeline (:func:`lightning_ndclip.core.pipeline.model_split`)
uses this class for any ``transformers`` model.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.tensor_parallel import matches_plan_key, tied_parameters

__all__ = ["HFPipelineSplit"]


class _Absent(nn.Module):
    """A unit another stage holds: returns its first input unchanged (no parameters)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class _Incoming(nn.Module):
    """In place of the layer before a stage's first layer: returns the hidden states the previous stage
    sent (set by the stage's forward), whatever the base model computed before its layers on this stage."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("a pipeline stage of a transformers model was called other than by its own forward")
        return value


@dataclass(frozen=True)
class _Stage:
    """What a stage's forward needs to know: whether it embeds the tokens (else the index of its
    :class:`_Incoming` in the layers) and whether it returns the model class's output (the last stage)."""

    incoming: int | None
    last: bool


def _stage_forward(self: Any, spec: _Stage, inputs: torch.Tensor) -> torch.Tensor:
    """The forward of a stage (bound to it and its ``spec``): token ids on the first stage, hidden states on the
    others; the logits on the last stage (the base model's last hidden states for a model without a head)."""
    base = self.base_model
    if spec.incoming is None:
        arguments: dict[str, Any] = {"input_ids": inputs}
    else:
        base.layers[spec.incoming].value = inputs
        arguments = {"inputs_embeds": inputs}
    if base is self or spec.last:  # the model class's own forward (type(self): not this bound method)
        output = type(self).forward(self, **arguments, use_cache=False)
    else:
        output = base(**arguments, use_cache=False)
    if spec.last and base is not self:
        return output.logits
    hidden: torch.Tensor = output.last_hidden_state
    return hidden


_SHARD_DIMS = {
    (nn.Linear, "colwise"): 0, (nn.Linear, "colwise_gather_output"): 0, (nn.Linear, "colwise_rep"): 0,
    (nn.Linear, "rowwise"): 1, (nn.Linear, "rowwise_split_input"): 1, (nn.Linear, "rowwise_rep"): 1,
    (nn.Embedding, "embedding_rowwise"): 0, (nn.Embedding, "embedding_colwise"): 1,
}  # fmt: skip
"""The dim of the weight each ``transformers`` tensor-parallel style splits, for the module kinds of a tie."""

_PARTNERS = {(nn.Linear, 0): "colwise_gather_output", (nn.Linear, 1): "rowwise_split_input",
             (nn.Embedding, 0): "embedding_rowwise", (nn.Embedding, 1): "embedding_colwise"}  # fmt: skip
"""A style splitting the weight on that dim whose module computes what it computed whole."""


def _shard_dim(module: nn.Module, style: str | None) -> int | None:
    return next((d for (kind, s), d in _SHARD_DIMS.items() if s == style and isinstance(module, kind)), None)


def _partner(module: nn.Module, dim: int) -> str | None:
    return next((s for (kind, d), s in _PARTNERS.items() if d == dim and isinstance(module, kind)), None)


class HFPipelineSplit:
    """How a ``transformers`` model is cut into pipeline stages (the protocol of
    :class:`lightning_ndclip.core.pipeline.ModelSplit`).

    Attributes:
        units: the model's units in forward order: the base model's ``base_model_pp_plan`` entries before
            its layers, each decoder layer, the entries after them, then the head (``lm_head``).

    Raises:
        ValueError: naming the model class and what it lacks: a ``base_model_pp_plan`` with a ``layers``
            entry that is an ``nn.ModuleList``, or parameters outside the plan's units (which no stage
            would know to run once).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        name = type(model).__name__
        base = getattr(model, "base_model", None)
        config = getattr(base, "config", None)
        plan = dict(getattr(config, "base_model_pp_plan", None) or {})
        if not isinstance(base, nn.Module) or "layers" not in plan:
            raise ValueError(
                f"{name} cannot be cut into pipeline stages: its config has no base_model_pp_plan with a 'layers' entry "
                f"(got {sorted(plan) or 'none'}), which names the embeddings, decoder layers and final norm stages are "
                "cut between; build the stages yourself (PipelineOptions with configure_model)"
            )
        self.base = base
        self.prefix = "" if base is model else next(n for n, m in model.named_children() if m is base)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise ValueError(
                f"{name} cannot be cut into pipeline stages: its base model's 'layers' is a "
                f"{type(layers).__name__}, not an nn.ModuleList of decoder layers"
            )
        self.num_layers = len(layers)
        order = list(plan)
        missing = [n for n in order if not isinstance(getattr(base, n, None), nn.Module)]
        if missing:
            raise ValueError(f"{name} cannot be cut into pipeline stages: base_model_pp_plan names {missing}, which "
                             f"{type(base).__name__} does not have")  # fmt: skip
        head_plan = _compat.class_pp_plan(type(model)) if base is not model else {}
        heads = [n for n, _ in model.named_children() if n in head_plan]
        outside = [f"{self._name(n)}" for n, m in base.named_children() if n not in plan and _has_parameters(m)]
        if base is not model:
            outside += [n for n, m in model.named_children() if m is not base and n not in heads and _has_parameters(m)]
        if any(True for m in {model, base} for _ in m.parameters(recurse=False)):
            outside.append("(parameters of the model itself)")
        if outside:
            raise ValueError(
                f"{name} cannot be cut into pipeline stages: {outside} hold parameters and are in no entry of its "
                f"pipeline plans (base_model_pp_plan {order}, the head's {sorted(head_plan)}), so no stage would know "
                "where they run; build the stages yourself (PipelineOptions with configure_model)"
            )
        at = order.index("layers")
        self.units = [
            *(self._name(n) for n in order[:at]),
            *(self._name(f"layers.{i}") for i in range(self.num_layers)),
            *(self._name(n) for n in order[at + 1 :]),
            *heads,
        ]

    def _name(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def _layer_of(self, unit: str) -> int | None:
        head = self._name("layers.")
        return int(unit[len(head) :]) if unit.startswith(head) and unit[len(head) :].isdigit() else None

    def split_points(self, num_stages: int) -> list[str]:
        """The units starting stages 1, 2, ... of ``num_stages`` stages of equally many decoder layers.

        Raises:
            ValueError: naming the model class, when ``num_stages`` does not divide its layers."""
        if self.num_layers % num_stages:
            raise ValueError(
                f"{type(self.model).__name__} has {self.num_layers} decoder layers ({self._name('layers')}), which do not "
                f"split evenly into {num_stages} pipeline stages: give PipelineOptions(split_points=[...]), the "
                f"layers that start stages 1, 2, ... (e.g. {[self._name('layers.1')]})"
            )
        per = self.num_layers // num_stages
        return [self._name(f"layers.{s * per}") for s in range(1, num_stages)]

    def check_split_points(self, split_points: Sequence[str]) -> None:
        """Every stage must hold a decoder layer: a split point is a layer after the first.

        Raises:
            ValueError: naming the model class and the point."""
        for point in split_points:
            if not self._layer_of(point):  # None, or layer 0 (the first stage would hold no layer)
                raise ValueError(
                    f"PipelineOptions(split_points) {list(split_points)}: {point!r} is no decoder layer of "
                    f"{type(self.model).__name__} after the first; stages of a transformers model start at "
                    f"{self._name('layers.k')} (k >= 1), so each holds some of its layers"
                )

    def stage(self, keep: Sequence[str]) -> nn.Module:
        """A copy of the model holding only the units ``keep`` (one stage's: consecutive units, at least one
        decoder layer), its forward the stage's (token ids or hidden states in; hidden states, or the
        logits on the last stage, out) and its ``tp_plan`` the model's, less the entries of the units it
        does not hold, plus the style that splits a tied partner as its tie's other holder splits it."""
        kept = set(keep)
        if unknown := sorted(kept - set(self.units)):
            raise ValueError(f"{unknown} are no units of {type(self.model).__name__} (its units: {self.units})")
        layers = sorted(i for i in (self._layer_of(u) for u in kept) if i is not None)
        if not layers:
            raise ValueError(f"a pipeline stage of {type(self.model).__name__} must hold a decoder layer; got {sorted(kept)}")
        first = self.units[0] in kept
        incoming = None if first else layers[0] - 1
        memo: dict[int, Any] = {}
        for unit in self.units:
            if unit not in kept:
                is_incoming = incoming is not None and self._layer_of(unit) == incoming
                memo[id(self.model.get_submodule(unit))] = _in_place_of(
                    self.model.get_submodule(unit), _Incoming() if is_incoming else _Absent()
                )
        stage: Any = copy.deepcopy(self.model, memo)
        tp_plan = self._tp_plan([u for u in self.units if u not in kept])
        if tp_plan is not None:
            stage.tp_plan = tp_plan
        stage.forward = functools.partial(_stage_forward, stage, _Stage(incoming=incoming, last=self.units[-1] in kept))
        return stage

    def _tp_plan(self, absent: list[str]) -> dict[str, str] | None:
        """The model's ``tp_plan`` for a stage without the units ``absent`` (``None``: it has none)."""
        plan = dict(getattr(self.model, "tp_plan", None) or {})
        if not plan:
            return None
        for names in tied_parameters(self.model):  # a tied module the plan leaves whole: split as its partner
            owners = [(path, self.model.get_submodule(path)) for path in (n.rpartition(".")[0] for n in names)]
            styles = {path: next((s for k, s in plan.items() if matches_plan_key(path, k)), None) for path, _ in owners}
            dims = {_shard_dim(module, styles[path]) for path, module in owners if styles[path] not in (None, "replicate")}
            if len(dims) > 1 or None in dims:
                raise ValueError(
                    f"{type(self.model).__name__}'s tp_plan gives its tied parameters {list(names)} styles {styles} that "
                    "do not split the shared weight on one dim; pipeline stages would hold differently sharded copies"
                )
            for path, module in owners:
                dim = next(iter(dims), None)
                partner = _partner(module, dim) if dim is not None and styles[path] is None else None
                if partner is not None:
                    plan[path] = partner
        return {k: s for k, s in plan.items() if not any(k == u or k.startswith(f"{u}.") for u in absent)}

    def output(self, inputs: torch.Tensor) -> torch.Tensor:
        """The unsplit model's output as its last stage returns it: the logits of ``input_ids``."""
        output = self.model(input_ids=inputs, use_cache=False)
        return output.last_hidden_state if self.base is self.model else output.logits


def _in_place_of(unit: nn.Module, stand_in: nn.Module) -> nn.Module:
    """``stand_in`` with the plain attributes of the unit it replaces (a layer's ``attention_type``, which the
    base model's forward of some releases reads to pick the layer's mask)."""
    for name, value in vars(unit).items():
        if not name.startswith("_") and (value is None or isinstance(value, (str, int, float, bool))):
            setattr(stand_in, name, value)
    return stand_in


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
