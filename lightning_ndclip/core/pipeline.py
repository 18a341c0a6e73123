"""Pipeline parallelism: split a model into stages, run a ``torch.distributed.pipelining`` schedule
without its gradient division, and keep parameters tied across stages exact.

Stages are cut from the model's *units*, in order: each top-level child, except that a
``ModuleList`` / ``ModuleDict`` child contributes each of its entries (``layers.0``, ``layers.1``,
...). A stage keeps its units; every other top-level child is set to ``None`` and every other
list/dict entry is deleted, so the model's ``forward`` must skip ``None`` children and iterate over
whatever entries remain (torchtitan's convention), e.g.::

    h = self.embed(tokens) if self.embed is not None else tokens
    for layer in self.layers.values():
        h = layer(h)
    return self.head(h) if self.head is not None else h

A model may know how to split itself instead (:class:`ModelSplit`, :func:`model_split`): a method
``pipeline_split()`` returning its split, or a Hugging Face ``transformers`` model, cut where its own
pipeline plan says (:class:`lightning_ndclip.integrations.transformers.pipeline.HFPipelineSplit`). Its units
and stages are its own, ``split_points`` may be left out (its default split), and its ties across
stages are declared by the strategy without being named.

Schedules are built with ``scale_grads=False``: the loss function passed in must already be the
micro-batch's share of the *global* mean (e.g. ``loss_sum / N`` with ``N`` from
:func:`lightning_ndclip.sync_token_count` over every micro-batch and data-parallel rank), so nothing
divides twice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from lightning_ndclip.core import libraries
from lightning_ndclip.core.agree import run_agreed

__all__ = [
    "SCHEDULES",
    "ModelSplit",
    "PipelineOptions",
    "build_pipeline",
    "model_split",
    "model_units",
    "schedule_stages",
    "split_model",
    "split_points_of",
    "stage_units_of",
    "sync_tied_parameters",
    "tie_gradients",
    "unsplit_output",
]

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}
"""Schedule names accepted by :func:`build_pipeline` (the last two run several stages per rank)."""


@dataclass(frozen=True)
class PipelineOptions:
    """How ``NDParallelStrategy(pp > 1, pipeline=PipelineOptions(...))`` builds and runs its pipeline.

    Attributes:
        split_points: the units (see :func:`model_units`) that start stages 1, 2, ...:
            ``pp x stages_per_rank - 1`` of them. Empty: the LightningModule's ``configure_model``
            builds the stages itself, setting ``module`` to an ``nn.ModuleDict`` ``{str(global stage
            index): parallelized stage}`` of this rank's stages.
        schedule: a name of :data:`SCHEDULES`.
        microbatches: micro-batches per batch; ``None``: the number of stages.
        stages_per_rank: virtual stages per rank (for the interleaved / looped schedules).
        module: the LightningModule attribute holding the model to split.
        tied_parameters: groups of parameter names (as in the unsplit model) that are one parameter
            held by several stages, e.g. ``[("embed.weight", "head.weight")]``: their gradients are
            summed over the holding stages after each window and counted once by the norm.
    """

    split_points: Sequence[str] = ()
    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int = 1
    module: str = "model"
    tied_parameters: Sequence[Sequence[str]] = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineOptions(schedule={self.schedule!r}): choose one of {sorted(SCHEDULES)}")
        for name in ("stages_per_rank", "microbatches"):
            value = getattr(self, name)
            if not (value is None and name == "microbatches") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"PipelineOptions({name}={value!r}): must be a positive int")
        object.__setattr__(self, "split_points", tuple(self.split_points))
        object.__setattr__(self, "tied_parameters", tuple(tuple(group) for group in self.tied_parameters))


class ModelSplit(Protocol):
    """How a model that knows how to split itself is cut into stages (see :func:`model_split`)."""

    @property
    def units(self) -> Sequence[str]:
        """Its ordered units, named as its parameters are (a parameter ``u.x`` belongs to unit ``u``)."""
        ...

    def split_points(self, num_stages: int) -> list[str]:
        """The units starting stages 1, 2, ... when ``PipelineOptions(split_points)`` is empty (or a
        ``ValueError`` naming the model and why it has no default)."""
        ...

    def check_split_points(self, split_points: Sequence[str]) -> None:
        """Raise ``ValueError`` for split points its stages cannot start at."""
        ...

    def stage(self, keep: Sequence[str]) -> nn.Module:
        """A stage holding the units ``keep`` (its parameters named as in the model): its forward takes
        the previous stage's output (the first stage: the pipeline's inputs)."""
        ...

    def output(self, inputs: Any) -> Any:
        """The unsplit model's output on ``inputs``, as its last stage returns it (one-device replays)."""
        ...


def model_split(model: nn.Module) -> ModelSplit | None:
    """``model``'s own split: what its ``pipeline_split()`` returns, for a ``transformers`` model its
    pipeline plan's (:class:`~lightning_ndclip.integrations.transformers.pipeline.HFPipelineSplit`), else ``None``
    (stages are cut from its top-level children, see the module docstring)."""
    hook = getattr(model, "pipeline_split", None)
    if callable(hook):
        split: ModelSplit = hook()
        return split
    library = libraries.library_of(model)
    return None if library is None else library.pipeline_split(model)


def split_points_of(model: nn.Module, split_points: Sequence[str], num_stages: int) -> list[str]:
    """``split_points``, or, left empty, the default of a model that splits itself (else as given: empty)."""
    split = model_split(model)
    if split is None:
        return list(split_points)
    if not split_points:
        return split.split_points(num_stages)
    split.check_split_points(split_points)
    return list(split_points)


def unsplit_output(model: nn.Module, inputs: Any) -> Any:
    """What the unsplit ``model`` computes from a pipeline's ``inputs``, as its last stage returns it:
    ``model(inputs)``, or its own split's output (a ``transformers`` model's logits)."""
    split = model_split(model)
    return model(inputs) if split is None else split.output(inputs)


def model_units(model: nn.Module) -> list[str]:
    """The ordered units stages are cut from (see the module docstring)."""
    split = model_split(model)
    if split is not None:
        return list(split.units)
    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units.extend(f"{name}.{key}" for key, _ in child.named_children())
        else:
            units.append(name)
    return units


def stage_units_of(units: list[str], split_points: Sequence[str], num_stages: int) -> list[list[str]]:
    """The units of each of ``num_stages`` stages, given the units that start stages 1, 2, ..."""
    if len(split_points) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} split points, got {list(split_points)}")
    cuts = []
    for point in split_points:
        if point not in units:
            raise ValueError(f"split point {point!r} is not a unit of the model; units are {units}")
        cuts.append(units.index(point))
    if cuts != sorted(cuts) or len(set(cuts)) != len(cuts) or (cuts and cuts[0] == 0):
        raise ValueError(f"split points {list(split_points)} must be increasing units after the first one")
    bounds = [0, *cuts, len(units)]  # the units of each stage, in stage order
    return [units[bounds[s] : bounds[s + 1]] for s in range(num_stages)]


def split_model(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only the units in ``keep`` (others removed as documented), or
    the stage of a model that splits itself."""
    split = model_split(model)
    if split is not None:
        return split.stage(keep)
    stage = copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for key in [k for k, _ in child.named_children() if f"{name}.{k}" not in keep]:
                if isinstance(child, nn.ModuleDict):
                    del child[key]
                else:
                    raise ValueError(f"{name} is a ModuleList; use a ModuleDict so stages keep their indices")
        elif name not in keep:
            setattr(stage, name, None)
    return stage


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    split_points: Sequence[str],
    *,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    parallelize_fn: Callable[[nn.Module], object] | None = None,
    device: torch.device | None = None,
) -> tuple[PipelineScheduleSingle | PipelineScheduleMulti, list[nn.Module]]:
    """Cut ``model`` into ``pp x stages_per_rank`` stages and build the schedule for this rank.

    Rank ``r`` of ``pp_mesh`` holds stages ``r, r + pp, ...`` (the looped placement interleaved
    schedules expect).

    Args:
        model: the full model (on every rank; only this rank's stages are kept).
        pp_mesh: the 1-D pipeline mesh.
        split_points: the units that start stages 1, 2, ... (``len = stages - 1``); empty for a
            model that splits itself: its default split (:func:`split_points_of`).
        n_microbatches: micro-batches per step (the batch given to ``step`` is chunked on dim 0).
        loss_fn: ``(output, target) -> loss`` of one micro-batch, already normalized by the global
            count (the schedule does not divide: ``scale_grads=False``).
        schedule: one of :data:`SCHEDULES`.
        stages_per_rank: virtual stages per rank (> 1 needs ``"interleaved_1f1b"`` or ``"looped_bfs"``).
        parallelize_fn: applied to each stage module before its ``PipelineStage`` is built: where
            tensor parallelism and ``fully_shard`` go (over the dp/tp meshes of this pp coordinate).
        device: the stages' device (default: CPU, or the current CUDA device when available).

    Returns:
        ``(schedule, stage modules of this rank)``. Call ``schedule.step(inputs)`` on the first
        stage's rank, ``schedule.step(target=...)`` on the last one's, ``schedule.step()`` elsewhere
        (with ``losses=[]`` to collect the micro-batch losses on the last stage).

    Raises:
        ValueError: a schedule that does not fit ``stages_per_rank``, split points that are no increasing units.
        Exception: cutting or ``parallelize_fn`` failing on any rank, on every rank of the world (one exchange):
            that rank's own error there, an :class:`~lightning_ndclip.core.agree.AgreedError` naming each failing
            rank and stage elsewhere (a plan naming a module of another stage failed on that stage only, and left
            the other stages waiting).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
    multi = issubclass(SCHEDULES[schedule], PipelineScheduleMulti)
    if (stages_per_rank > 1) != multi:
        raise ValueError(
            f"schedule={schedule!r} runs {'several stages' if multi else 'one stage'} per rank, "
            f"but stages_per_rank={stages_per_rank}"
        )
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp * stages_per_rank
    split_points = split_points_of(model, split_points, num_stages)
    per_stage = stage_units_of(model_units(model), split_points, num_stages)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    indices = [rank + k * pp for k in range(stages_per_rank)]

    parallelize = parallelize_fn or (lambda module: None)

    def cut_and_parallelize() -> list[nn.Module]:
        modules = [split_model(model, per_stage[i]) for i in indices]
        for module in modules:
            parallelize(module)
        return modules

    # a plan or hook failing on some stages only (a key naming another stage's module) raises on every rank
    modules = run_agreed(f"cutting and parallelizing pipeline stage {' and '.join(map(str, indices))}", cut_and_parallelize)
    built = schedule_stages(
        dict(zip(indices, modules)), num_stages, pp_mesh, n_microbatches=n_microbatches, loss_fn=loss_fn,
        schedule=schedule, device=device,
    )
    return built, modules


def schedule_stages(
    stages: dict[int, nn.Module],
    num_stages: int,
    pp_mesh: DeviceMesh,
    *,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
    device: torch.device,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule (``scale_grads=False``) over stage modules built by the caller: ``{global stage
    index: module}`` for this rank's stages, already parallelized."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
    cls = SCHEDULES[schedule]
    multi = issubclass(cls, PipelineScheduleMulti)
    if not multi and len(stages) != 1:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank; this rank has {len(stages)}")
    bad = [i for i in stages if not 0 <= i < num_stages]
    if bad:
        raise ValueError(f"stage indices {bad} are outside 0..{num_stages - 1}")
    group = pp_mesh.get_group()
    built = [PipelineStage(m, i, num_stages, device, group=group) for i, m in sorted(stages.items())]
    return cls(built if multi else built[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def tie_gradients(parameters: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of parameters tied across stages over ``group`` (the ranks holding a copy),
    so every copy holds the gradient of the one logical parameter. Works on the local shards of
    DTensor gradients (the copies must be sharded alike). Pass the same parameters, in the same
    order, on every rank of ``group``; norm them with ``tied_parameters`` so they count once."""
    for p in parameters:
        if p.grad is None:
            raise ValueError("tie_gradients: a tied parameter has no gradient; run the step first")
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=group)


def sync_tied_parameters(parameters: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Give the copies of parameters tied across stages the value held by the lowest rank of
    ``group`` (the ranks holding a copy), so the one logical parameter starts equal everywhere.
    Works on the local shards of DTensors; call it as :func:`tie_gradients`."""
    src = min(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    with torch.no_grad():
        for p in parameters:
            local = p.to_local() if hasattr(p, "to_local") else p
            dist.broadcast(local, src=src, group=group)
