"""Distributed checkpoints of pipeline stages that resume on another pipeline layout.

The stages the strategy cuts are copies of the model, each holding some of its units under the model's own
names, kept in a list in place of the model: a rank's parameter ``lm.<k>.<name>`` (``k``, the stage's place in
this rank's list) is the unsplit model's ``lm.<name>``. A checkpoint stores every parameter and its optimizer
state under the unsplit name (:class:`StageNames`), so a run on any layout (``pp = 1``, other split points,
other stage counts) finds what each of its tensors needs:

* Model tensors: every layout holds each name once (``pp = 1`` holds a tied weight under all its names).
* Optimizer states, flattened per parameter (``state.<name>.<key>``, ``param_groups.<name>.<key>``): a pipeline
  saves them so (each stage holds other parameters); ``pp = 1`` saves Lightning's format, whose parameter
  groups list their parameters' names, read here into the same per-parameter form.
* A parameter tied across stages (the embedding and the head) has one optimizer state on ``pp = 1``, under one
  of its names, and a copy on each stage holding it: a name the checkpoint lacks is read from its tie's other
  name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_ndclip import _compat

__all__ = ["CheckpointRead", "PipelineLayout", "StageNames", "load_distributed_checkpoint", "read_plan"]

_OPTIMIZER_PARTS = ("state.", "param_groups.")
"""The two kinds of keys of a flattened optimizer state: ``<part><parameter name>.<key>``."""


@dataclass(frozen=True)
class StageNames:
    """How this rank's names differ from the unsplit model's: ``prefixes`` pairs each stage's own prefix
    (``lm.0.``) with the model's (``lm.``); ``ties`` are the unsplit names of each tied parameter."""

    prefixes: tuple[tuple[str, str], ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()

    def unsplit(self, name: str) -> str:
        """The unsplit model's name of this rank's parameter (or buffer) ``name``."""
        for local, model in self.prefixes:
            if name.startswith(local):
                return model + name[len(local) :]
        return name

    def model_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A model state dict under the unsplit names."""
        return {self.unsplit(key): value for key, value in state.items()}

    def optimizer_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A flattened optimizer state dict under the unsplit names."""
        return {_rename(key, self.unsplit): value for key, value in state.items()}

    def partners(self, name: str) -> list[str]:
        """The other unsplit names of ``name``'s tie (none when it is not tied)."""
        return [other for tie in self.ties if name in tie for other in tie if other != name]


@dataclass(frozen=True)
class PipelineLayout:
    """A run's pipeline layout, as its checkpoints record it (in Lightning's ``meta.pt``, under :data:`KEY`), and how
    its tensors are named there: ``names`` maps this rank's names to the unsplit model's (stages the strategy cut, or
    ``pp = 1``: any such layout resumes from the checkpoint), ``None`` for stages built in configure_model, which keep
    their own names (only the same layout resumes)."""

    pp: int
    stages_per_rank: int
    split_points: tuple[str, ...]
    names: StageNames | None

    KEY = "lightning_ndclip_pipeline"

    def record(self) -> dict[str, Any]:
        """What a checkpoint stores under :data:`KEY`."""
        if self.pp == 1:
            return {"pp": 1}
        return {
            "pp": self.pp, "stages_per_rank": self.stages_per_rank, "split_points": list(self.split_points),
            "names": "unsplit" if self.names is not None else "stages",
        }  # fmt: skip

    def stamped(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with this layout recorded, its tensors under the unsplit names where stages were cut."""
        checkpoint = {**checkpoint, self.KEY: self.record()}
        if self.names is not None and self.pp > 1:
            checkpoint["state_dict"] = self.names.model_state(checkpoint["state_dict"])
            checkpoint["optimizer_states"] = [self.names.optimizer_state(s) for s in checkpoint.get("optimizer_states", [])]
        return checkpoint

    def names_in(self, path: Path, weights_only: bool | None) -> StageNames | None:
        """How to read the distributed checkpoint at ``path``: ``None`` for Lightning's own loading (saved and
        resumed with ``pp = 1``), else the names of this rank's tensors in it (the same on every rank: they read the
        same file). A checkpoint saved before names were unsplit (``names`` absent) or by stages built in
        configure_model resumes on the same layout only.

        Raises:
            ValueError: naming both layouts, where this run cannot find its tensors in the checkpoint."""
        meta = path / _compat.metadata_filename()
        saved = torch.load(meta, weights_only=weights_only).get(self.KEY) if meta.is_file() else None
        saved, here = saved or {"pp": 1}, self.record()
        if saved["pp"] == 1 and here["pp"] == 1:
            return None
        if (saved["pp"] == 1 or saved.get("names") == "unsplit") and self.names is not None:
            return self.names
        if saved["pp"] > 1 and saved.get("names") != "unsplit" and _without_names(saved) == _without_names(here):
            return StageNames()  # the same stages, under this rank's own names
        raise ValueError(
            f"the checkpoint {str(path)!r} was saved with the pipeline layout {saved} and this run has {here}: "
            "stages built in configure_model (and checkpoints of lightning_ndclip 0.1.0 with pp > 1) save each "
            "stage's tensors under that stage's own names. Resume with the same pp, stages_per_rank and "
            "split_points (dp_replicate, dp_shard, cp and tp may change), or let the strategy cut the stages "
            "(PipelineOptions(module=...)): those checkpoints resume on any pipeline layout"
        )


def _without_names(layout: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in layout.items() if k != "names"}


def _parts(key: str) -> tuple[str, str, str]:
    """A flattened optimizer key ``<part><parameter name>.<attribute>`` in its three pieces."""
    part = next(p for p in _OPTIMIZER_PARTS if key.startswith(p))
    name, _, attribute = key[len(part) :].rpartition(".")
    return part, name, attribute


def _rename(key: str, rename: Callable[[str], str]) -> str:
    part, name, attribute = _parts(key)
    return f"{part}{rename(name)}.{attribute}"


@dataclass(frozen=True)
class _Groups:
    """The parameter groups of an optimizer state saved in Lightning's format: ``<prefix>param_groups.<g>.<key>``,
    one entry per group and hyperparameter, ``params`` listing the group's parameter names."""

    prefix: str
    count: int
    keys: tuple[str, ...]

    @staticmethod
    def of(stored: Mapping[str, Any], prefix: str) -> _Groups | None:
        """The groups of ``prefix``'s optimizer if the checkpoint holds them in Lightning's format, else ``None``."""
        head = f"{prefix}param_groups."
        keys = tuple(k for k in stored if k.startswith(head) and k[len(head) :].split(".", 1)[0].isdigit())
        if f"{head}0.params" not in keys:
            return None
        return _Groups(prefix, 1 + max(int(k[len(head) :].split(".", 1)[0]) for k in keys), keys)

    def fill(self, state: dict[str, Any], loaded: Mapping[str, Any], names: StageNames) -> None:
        """Set each ``param_groups.<name>.<attribute>`` of the flattened ``state`` from the group listing
        ``name`` (or its tie's other name)."""
        group_of: dict[str, int] = {}
        for g in range(self.count):
            group_of.update(dict.fromkeys(loaded[f"{self.prefix}param_groups.{g}.params"], g))
        for key in [k for k in state if k.startswith("param_groups.")]:
            _, name, attribute = _parts(_rename(key, names.unsplit))
            group = next((group_of[n] for n in (name, *names.partners(name)) if n in group_of), None)
            if group is None:
                raise ValueError(f"the checkpoint's parameter groups list no parameter named {name!r}")
            state[key] = loaded[f"{self.prefix}param_groups.{group}.{attribute}"]


@dataclass
class _Reads:
    """What to read of a checkpoint (its keys: ``stored``): ``request``, the dict handed to ``dcp.load``
    (a tensor is read in place, any other value replaced); ``places``, where each read value goes."""

    stored: Mapping[str, Any]
    request: dict[str, Any] = field(default_factory=dict)
    places: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def add(self, key: str, into: dict[str, Any], local: str, fallbacks: Sequence[str] = (), required: bool = True) -> None:
        """Read ``into[local]`` from ``key``, or the first of ``fallbacks`` the checkpoint holds."""
        found = next((k for k in (key, *fallbacks) if k in self.stored), None)
        if found is None:
            self.missing += [key] if required else []
            return
        self.request.setdefault(found, into[local])
        self.places.append((found, into, local))

    def load(self, path: Path) -> None:
        dcp.load(self.request, checkpoint_id=path)
        with torch.no_grad():
            for key, into, local in self.places:
                value = self.request[key]
                if isinstance(into[local], torch.Tensor) and into[local] is not value:
                    into[local].copy_(value)  # a second place of one stored tensor (a tie's other copy)
                elif not isinstance(into[local], torch.Tensor):
                    into[local] = value


@dataclass
class CheckpointRead:
    """The plan of :func:`read_plan`, carried out by :func:`load_distributed_checkpoint`."""

    path: Path
    names: StageNames
    strict: bool
    reads: _Reads
    model_state: dict[str, Any]
    optimizers: list[tuple[torch.optim.Optimizer, dict[str, Any], _Groups | None]]


_OPTIONS = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def read_plan(
    path: Path, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], names: StageNames, strict: bool
) -> CheckpointRead:
    """Which stored tensor fills each of this rank's model and optimizer tensors (optimizer states flattened
    per parameter), by unsplit name (``names``), from a checkpoint saved by any pipeline layout or by
    ``pp = 1`` in Lightning's format. Optimizers the checkpoint holds no state of (a weights-only
    checkpoint) are left out. Reads the checkpoint's metadata only.

    Raises:
        ValueError: naming the tensors this rank holds that the checkpoint lacks.
    """
    reads = _Reads(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_state = get_model_state_dict(model)
    for key in model_state:
        reads.add(f"state_dict.{names.unsplit(key)}", model_state, key, required=strict)
    planned = []
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}."
        if not any(key.startswith(prefix) for key in reads.stored):
            continue
        state = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        groups = _Groups.of(reads.stored, prefix)
        for key in state:
            part, name, attribute = _parts(_rename(key, names.unsplit))
            if part == "param_groups." and groups is not None:
                continue  # filled from Lightning's list of groups once they are read
            fallbacks = [f"{prefix}{part}{other}.{attribute}" for other in names.partners(name)]
            reads.add(f"{prefix}{part}{name}.{attribute}", state, key, fallbacks)
        reads.request.update(dict.fromkeys(groups.keys if groups is not None else ()))
        planned.append((optimizer, state, groups))
    if reads.missing:
        raise ValueError(
            f"the checkpoint {str(path)!r} lacks {len(reads.missing)} tensors this rank holds, e.g. "
            f"{reads.missing[:3]} (named as in the unsplit model; stages built in configure_model keep their own names)"
        )
    return CheckpointRead(path, names, strict, reads, model_state, planned)


def load_distributed_checkpoint(model: nn.Module, plan: CheckpointRead) -> None:
    """Read the checkpoint as ``plan`` says and set the model's and the optimizers' states from it."""
    plan.reads.load(plan.path)
    set_model_state_dict(model, plan.model_state, options=StateDictOptions(strict=plan.strict))
    for optimizer, state, groups in plan.optimizers:
        if groups is not None:
            groups.fill(state, plan.reads.request, plan.names)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=_OPTIONS)
