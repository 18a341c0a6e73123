"""Pipeline parallelism inside :class:`~lightning_ndclip.NDParallelStrategy`: the Lightning side of
:mod:`lightning_ndclip.core.pipeline`.

With ``pp > 1`` the strategy owns one :class:`PipelineRunner`. In the strategy's ``setup`` it cuts
the model into this rank's stages (or schedules the stages the user's own ``configure_model``
built); it runs the schedule when ``training_step`` calls ``strategy.run_pipeline``, scales each
micro-batch's loss as the accumulation window needs, keeps the gradients the schedule computed
inside ``training_step`` aside until Lightning calls ``backward`` (Lightning zeroes gradients in
between), and sums the gradients of parameters tied across stages once a window is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ndclip._compat import tree_leaves
from lightning_ndclip.core import libraries
from lightning_ndclip.core.agree import AgreedError, raise_agreed
from lightning_ndclip.core.loss import MicroBatchShare
from lightning_ndclip.core.parallel.mesh import ParallelMeshes
from lightning_ndclip.core.parallel.plan import ParallelPlan
from lightning_ndclip.core.parallel.tensor_parallel import tied_parameters
from lightning_ndclip.core.pipeline import (
    PipelineOptions,
    build_pipeline,
    model_split,
    model_units,
    schedule_stages,
    split_points_of,
    stage_units_of,
    sync_tied_parameters,
    tie_gradients,
)
from lightning_ndclip.lightning._pipeline_checkpoint import StageNames

__all__ = ["PipelineRunner"]


class _PipelineStages(nn.ModuleList):
    """This rank's stage modules, in the place of the model they were cut from; they remember their
    global stage indices, the model's units and the split (the options' split points and ties, with a
    model's own defaults filled in), so a later Trainer can schedule them again."""

    def __init__(
        self, stages: Sequence[nn.Module], indices: Sequence[int], units: Sequence[str], config: PipelineOptions
    ) -> None:
        super().__init__(stages)
        self.indices = list(indices)
        self.units = list(units)
        self.split_points, self.tied_parameters = config.split_points, config.tied_parameters


def _own_ties(model: nn.Module, config: PipelineOptions, num_stages: int) -> tuple[tuple[str, ...], ...]:
    """The ties of a model that splits itself which the cut puts in several stages and ``config`` does
    not declare: declared for the user (each stage would train its own copy otherwise)."""
    stage_units = stage_units_of(model_units(model), config.split_points, num_stages)
    declared = {n for tie in config.tied_parameters for n in tie}
    return tuple(
        tuple(tie) for tie in tied_parameters(model)
        if len(_stages_holding(tie, stage_units)) > 1 and not declared.intersection(tie)
    )  # fmt: skip


def _check_ties(model: nn.Module, config: PipelineOptions, num_stages: int) -> None:
    """Refuse a declared tie of parameters that are not one tensor in ``model`` (keeping them equal would
    train another model), and a tie of ``model`` that the cut puts in several stages undeclared (each
    stage would train its own copy)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for tie in config.tied_parameters:
        if len({id(params[n]) for n in tie}) > 1:
            raise ValueError(
                f"PipelineOptions(tied_parameters) entry {list(tie)}: these are different tensors in {config.module}; "
                "a declared tie keeps one tensor that several stages hold one parameter, it does not make one. Tie "
                "them in the model (e.g. head.weight = embed.weight) or leave the entry out"
            )
    stage_units = stage_units_of(model_units(model), config.split_points, num_stages)
    declared = {n for tie in config.tied_parameters for n in tie}
    for tie in tied_parameters(model):
        stages = _stages_holding(tie, stage_units)
        if len(stages) > 1 and not declared.intersection(tie):
            raise ValueError(
                f"{list(tie)} are one tensor in {config.module}, and split_points {list(config.split_points)} put them "
                f"in stages {sorted(stages)}: each stage would train its own copy. Declare the tie: "
                f"PipelineOptions(tied_parameters=[{tuple(tie)!r}])"
            )


def _layout(parameter: torch.Tensor) -> str:
    """How a copy of a tied parameter is held on this rank: its placements and local shape (a plain tensor: whole)."""
    if not isinstance(parameter, DTensor):
        return f"('whole',) {list(parameter.shape)}"
    return f"{tuple(parameter.placements)} {list(parameter.to_local().shape)} of {list(parameter.shape)}"


def _stages_holding(names: Sequence[str], stage_units: list[list[str]]) -> set[int]:
    """The stages (indices into ``stage_units``, each stage's units) whose units hold a parameter of ``names``."""
    return {s for s, units in enumerate(stage_units) for n in names if any(n.startswith(f"{u}.") for u in units)}


class PipelineRunner:
    """Builds, schedules and runs this rank's pipeline stages for the strategy."""

    def __init__(self, config: PipelineOptions, microbatches: int, device: torch.device) -> None:
        self.config = config
        self.microbatches = microbatches  # config.microbatches, or its default: the number of stages
        self.device = device
        self.meshes: ParallelMeshes | None = None
        self.schedule: Any = None  # a torch.distributed.pipelining schedule, once set up
        self._training_share = MicroBatchShare(1.0)  # the training batch's share of its window
        self._share = self._training_share  # what this batch's schedule scales by (evaluation: a plain sum)
        self._target: torch.Tensor | None = None  # the batch's target, indexed by the row ids the schedule splits
        self._module: Any = None  # the LightningModule (it defines pipeline_loss)
        self._loss_error: Exception | None = None  # the first pipeline_loss error of this batch
        self._ties: list[tuple[list[torch.Tensor], dist.ProcessGroup | None]] = []
        self._aside: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, gradient) until backward
        self._window_ends = False

    @property
    def pp(self) -> int:
        return self._meshes["pp"].size()

    @property
    def _meshes(self) -> ParallelMeshes:
        if self.meshes is None:
            raise RuntimeError("the pipeline is not set up yet")
        return self.meshes

    def check(self, module: pl.LightningModule, plan: ParallelPlan, pp: int) -> None:
        """Before any collective: the pipeline arguments and ``module`` fit one of the two ways (the
        strategy splits ``config.module`` into ``pp`` x ``stages_per_rank`` stages, or the module's
        ``configure_model`` builds the stages), and the declared ties are the model's."""
        config = self.config
        if is_overridden("configure_model", module):
            if config.split_points or config.tied_parameters or plan:
                raise ValueError(
                    f"{type(module).__name__} overrides configure_model() (building its own stages) and "
                    "NDParallelStrategy got PipelineOptions(split_points / tied_parameters) or a plan: use one way"
                )
            return
        model = getattr(module, config.module, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"PipelineOptions(module={config.module!r}): the LightningModule has no submodule of that name")
        if isinstance(model, _PipelineStages):  # an earlier Trainer's cut, checked then: its split
            if not config.split_points:
                self.config = replace(config, split_points=model.split_points, tied_parameters=model.tied_parameters)
            return
        num_stages = pp * config.stages_per_rank
        if model_split(model) is not None:  # a model that splits itself: its default split points and its ties
            config = replace(config, split_points=split_points_of(model, config.split_points, num_stages))
            ties = (*config.tied_parameters, *_own_ties(model, config, num_stages))
            config = self.config = replace(config, tied_parameters=ties)
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for tie in config.tied_parameters:
            if unknown := [n for n in tie if n not in names]:
                raise ValueError(
                    f"PipelineOptions(tied_parameters) entry {list(tie)}: {unknown} is not a parameter name of "
                    f"{config.module} (names are relative to it, e.g. {sorted(names)[:3]})"
                )
        _check_ties(model, config, num_stages)
        plan.for_stage(model, model)  # its entries name modules of the model: checked before any collective

    def setup(self, module: pl.LightningModule, meshes: ParallelMeshes, plan: ParallelPlan) -> None:
        """Cut ``module``'s ``config.module`` into this rank's stages, parallelize each (``plan``: the
        strategy's declarative plan, else the module's ``parallelize_stage(stage)``, else one
        ``fully_shard`` per stage) and build the schedule; or schedule the stages the module's own
        ``configure_model`` built. Once per runner: a later ``validate`` / ``test`` reuses it, and a new
        runner reschedules stages an earlier one cut."""
        if self.schedule is not None:
            return
        self.meshes, self._module = meshes, module
        config = self.config
        if is_overridden("configure_model", module):
            self._schedule_user_stages()
            return
        model = getattr(module, config.module)
        if isinstance(model, _PipelineStages):  # cut by an earlier Trainer's strategy
            stages: list[nn.Module] = list(model)
            self.schedule = self._schedule(dict(zip(model.indices, stages)))
            self._ties = [self._tie_group(names, stages, model.units) for names in config.tied_parameters]
            self._check_tie_layouts()
            return
        units = model_units(model)
        hook = getattr(module, "parallelize_stage", None)

        def parallelize_stage(stage: nn.Module) -> None:
            if callable(hook) and not plan:
                hook(stage)
            else:  # the plan, or at least one FSDP2 unit per stage (DTensor parameters: checkpoints)
                plan.for_stage(model, stage).apply(stage, meshes)

        self.schedule, stages = build_pipeline(
            model, meshes["pp"], config.split_points, n_microbatches=self.microbatches,
            loss_fn=self._loss, schedule=config.schedule, stages_per_rank=config.stages_per_rank,
            parallelize_fn=parallelize_stage, device=self.device,
        )  # fmt: skip
        rank = meshes["pp"].get_local_rank()
        indices = [rank + k * self.pp for k in range(config.stages_per_rank)]
        setattr(module, config.module, _PipelineStages(stages, indices, units, config))
        self._ties = [self._tie_group(names, stages, units) for names in config.tied_parameters]
        self._check_tie_layouts()

    def load_hf_checkpoint(self, module: nn.Module, directory: Any, device: torch.device) -> None:
        """Load a Hugging Face checkpoint into this rank's stages of a ``transformers`` model, each reading the
        tensors of the units it holds (its library's :meth:`~lightning_ndclip.core.libraries.ModelLibrary.load_checkpoint`)."""
        stages = getattr(module, self.config.module)
        if not isinstance(stages, _PipelineStages):
            raise ValueError(
                "NDParallelStrategy(hf_checkpoint=..., pp > 1) loads into the stages the strategy cuts from a transformers "
                "model (PipelineOptions(module=...)); load stages built in configure_model with load_hf_checkpoint"
            )
        per_stage = stage_units_of(stages.units, stages.split_points, self.pp * self.config.stages_per_rank)
        for index, stage in zip(stages.indices, stages):
            library = libraries.library_of(stage)  # a stage is a copy of the model, holding some of its units
            if library is None:
                raise ValueError(
                    f"NDParallelStrategy(hf_checkpoint=..., pp > 1): the stages are cut from a {type(stage).__name__}, "
                    "which is no model of a library whose checkpoints the strategy loads (transformers, ...)"
                )
            elsewhere = [unit for unit in stages.units if unit not in per_stage[index]]
            library.load_checkpoint(stage, directory, device=device, held_elsewhere=elsewhere)

    def _schedule(self, stages: dict[int, nn.Module]) -> Any:
        config = self.config
        return schedule_stages(
            stages, self.pp * config.stages_per_rank, self._meshes["pp"], n_microbatches=self.microbatches,
            loss_fn=self._loss, schedule=config.schedule, device=self.device,
        )  # fmt: skip

    def _schedule_user_stages(self) -> None:
        """After the user's ``configure_model``: ``config.module`` is an ``nn.ModuleDict``
        ``{str(global stage index): stage}`` of this rank's parallelized stages; schedule them."""
        name = self.config.module
        stages = getattr(self._module, name, None)
        if not isinstance(stages, nn.ModuleDict):
            raise ValueError(
                f"with pp > 1 and a configure_model(), set self.{name} = nn.ModuleDict({{str(stage_index): "
                f"stage_module}}) of this rank's stages; got {type(stages).__name__}"
            )
        self.schedule = self._schedule({int(i): m for i, m in stages.items()})

    def _columns(self) -> tuple[torch.Tensor, int]:
        """The world's ranks as ``[pp, columns]`` (a column: the ranks of one data / tp / cp coordinate, one per
        pipeline rank) and this rank's column."""
        columns = self._meshes.world.mesh.reshape(self.pp, -1)
        return columns, int((columns == dist.get_rank()).nonzero()[0, 1])

    def _tie_group(
        self, names: Sequence[str], stages: list[nn.Module], units: list[str]
    ) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        """This rank's copies of one tied parameter and the process group of the ranks (in this rank's
        pp column) whose stages hold a copy. Collective: every rank creates every column's group."""
        pp, config = self.pp, self.config
        per_stage = stage_units_of(units, config.split_points, pp * config.stages_per_rank)
        owners = sorted({s % pp for s in _stages_holding(names, per_stage)})
        if len(owners) < 2:
            raise ValueError(f"PipelineOptions(tied_parameters) {list(names)}: held by fewer than two pipeline ranks")
        columns, mine = self._columns()
        group = None
        for c in range(columns.shape[1]):
            g = dist.new_group([int(columns[o, c]) for o in owners])
            if c == mine and isinstance(g, dist.ProcessGroup):  # not a member: no copy here, no group
                group = g
        holders: list[torch.Tensor] = [p for stage in stages for n, p in stage.named_parameters() if n in names]
        return holders, group

    def _check_tie_layouts(self) -> None:
        """Refuse, on every rank, copies of a tied parameter that their stages shard differently (one exchange over
        the world): the tie's gradient sum and broadcast add up local shards, which would mix different slices of
        the parameter, or fail inside the collective when their sizes differ."""
        if not self._ties:
            return
        columns, mine = self._columns()
        layouts = [sorted({_layout(p) for p in holders}) for holders, _ in self._ties]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, self._meshes["pp"].get_local_rank(), layouts))
        for index, names in enumerate(self.config.tied_parameters):
            for column in range(columns.shape[1]):
                seen = {(pp_rank, layout) for c, pp_rank, held in everyone if c == column for layout in held[index]}
                if len({layout for _, layout in seen}) > 1:
                    described = "; ".join(f"pp rank {r}: {layout}" for r, layout in sorted(seen))
                    raise ValueError(
                        f"the tied parameters {list(names)} are one parameter, and the pipeline stages holding them "
                        f"shard it differently ({described}): their gradients would be summed over different slices. "
                        "Give their modules styles that shard the shared weight alike (a vocabulary-sharded head, as "
                        "loss parallel makes it, needs the tied embedding vocabulary-sharded too: an "
                        "'embedding_rowwise' entry in a transformers model's tp_plan)"
                    )

    def stage_names(self, module: nn.Module) -> StageNames | None:
        """How this rank's parameter names map to the unsplit model's (:class:`StageNames`), for stages the
        strategy cut; ``None`` for stages built in ``configure_model`` (their names are their own)."""
        stages, name = getattr(module, self.config.module), self.config.module
        if not isinstance(stages, _PipelineStages):
            return None
        prefixes = tuple((f"{name}.{k}.", f"{name}.") for k in range(len(stages)))
        return StageNames(prefixes, tuple(tuple(f"{name}.{n}" for n in tie) for tie in self.config.tied_parameters))

    def local_stages(self, module: nn.Module) -> dict[int, nn.Module]:
        """``{global stage index: stage module}`` of this rank's stages, as set up on ``module``."""
        stages = getattr(module, self.config.module)
        if isinstance(stages, _PipelineStages):
            return dict(zip(stages.indices, stages))
        return {int(i): m for i, m in stages.items()}

    @property
    def tied_parameters(self) -> dict[str, torch.Tensor] | None:
        """``{key: this rank's copy}`` of the parameters tied across stages (for the norm)."""
        ties = {names[0]: holders[0] for names, (holders, _) in zip(self.config.tied_parameters, self._ties) if holders}
        return ties or None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function. An error in ``pipeline_loss`` is kept for :meth:`run` to
        raise on every stage once the schedule is through; meanwhile the micro-batch gets a zero loss
        connected to ``output``, so its backward (and the stages waiting for it) still run."""
        try:
            return self._scaled_loss(output, target)
        except Exception as error:
            if self._loss_error is None:
                self._loss_error = error
            leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            return sum((t.sum() * 0.0 for t in leaves), torch.zeros((), device=self.device))

    def _scaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        share, rows = self._share, None
        if share.weights is not None and self._target is not None:  # the schedule split row ids: look them up
            rows, target = target, self._target[target]
        return share.of_rows(rows).apply(self._module.pipeline_loss(output, target), source="pipeline_loss (pp > 1)")

    def training_step(self, step: Callable[[], Any], share: MicroBatchShare, module: pl.LightningModule) -> Any:
        """``step()`` (the module's ``training_step``, which calls :meth:`run`: forward and backward), each pipeline
        micro-batch's loss scaled by ``share``; with automatic optimization Lightning zeroes the gradients after
        ``training_step`` and then calls backward, so the step's gradients wait aside until
        :meth:`gradients_back` adds them."""
        self._training_share = share
        if module.automatic_optimization:
            with self.gradients_aside(module, window_ends=share.ends_window):
                return step()
        output = step()
        if share.ends_window:
            self.window_complete()
        return output

    @contextmanager
    def gradients_aside(self, module: nn.Module, window_ends: bool) -> Iterator[None]:
        """Around ``training_step``: the schedule's backward starts from no gradients; what it computes
        is set aside for :meth:`gradients_back`, and the gradients from before are put back (for
        Lightning to zero at a window's start, or to keep accumulating into)."""
        parameters = list(module.parameters())
        before = [p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        self._window_ends = window_ends
        try:
            yield
        finally:
            self._aside = [(p, p.grad) for p in parameters if p.grad is not None]
            for p, grad in zip(parameters, before):
                p.grad = grad

    def gradients_back(self, module: nn.Module) -> None:
        """In ``backward``: add the set-aside gradients; at a window's end, sum the tied copies."""
        aside, self._aside = self._aside, []
        for p, grad in aside:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad
        if self._window_ends:
            self._window_ends = False
            self.window_complete()

    def sync_ties(self) -> None:
        """Give every copy of a tied parameter the value of the lowest holding stage's copy."""
        for holders, group in self._ties:
            sync_tied_parameters(holders, group)

    def window_complete(self) -> None:
        """The window's gradients are complete: sum the tied copies over their stages."""
        for holders, group in self._ties:
            tie_gradients(holders, group)

    def run(self, inputs: Any, target: Any, training: bool) -> torch.Tensor:
        """One batch through the schedule; the loss, float64, broadcast from the last stage."""
        pp_mesh = self._meshes["pp"]
        rank, size = pp_mesh.get_local_rank(), pp_mesh.size()
        run = self.schedule.step if training else self.schedule.eval
        # evaluation: the plain sum of pipeline_loss over micro-batches
        self._share = self._training_share if training else MicroBatchShare(1.0)
        self._target, self._loss_error = None, None
        weights = self._share.weights
        if weights is not None:  # checked on every rank (all get the target): none is left waiting
            if not isinstance(target, torch.Tensor) or target.shape[0] != weights.shape[0]:
                raise ValueError(
                    "with loss_normalization='sample_mean', run_pipeline needs a target tensor with one row "
                    f"per row of sample ids ({weights.shape[0]}), got "
                    f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}"
                )
            if rank == size - 1:
                self._target, target = target, torch.arange(target.shape[0], device=target.device)
        self._check_rows(inputs, target)
        losses: list[torch.Tensor] = []
        if rank == 0:
            run(inputs, target=target if rank == size - 1 else None, losses=losses)
        elif rank == size - 1:
            run(target=target, losses=losses)
        else:
            run()
        # per pipeline (each a row): [loss, failed], float64, summed over the world: every rank gets its
        # pipeline's loss from its last stage, and learns of an error in any pipeline (one collective)
        world = self._meshes.world
        pipelines = world.size() // size
        pipeline = 0
        for name, coordinate, extent in zip(world.mesh_dim_names or (), world.get_coordinate() or (), world.shape):
            pipeline = pipeline if name == "pp" else pipeline * extent + coordinate
        result = torch.zeros(pipelines, 2, dtype=torch.float64, device=self.device)
        if rank == size - 1:
            if losses:
                result[pipeline, 0] = torch.stack(losses).sum().detach()
            result[pipeline, 1] = float(self._loss_error is not None)
        dist.all_reduce(result)
        if result[:, 1].any():  # one host read per batch: every rank raises, none is left waiting
            self._raise_loss_error()
        return result[pipeline, 0]

    def _check_rows(self, inputs: Any, target: Any) -> None:
        """Refuse a batch the schedule cannot split into ``microbatches`` equal micro-batches; every rank
        of a pipeline gets the same batch, and the sampler gives every data rank as many rows, so all
        raise alike (the schedule failed on some stages only, with torch's shape errors)."""
        rows = {t.shape[0] for t in tree_leaves((inputs, target)) if isinstance(t, torch.Tensor) and t.dim()}
        for n in sorted(rows):
            if n % self.microbatches:
                raise ValueError(
                    f"run_pipeline: a batch of {n} rows does not split into PipelineOptions(microbatches="
                    f"{self.microbatches}) equal micro-batches. Use a batch size that {self.microbatches} divides, "
                    "and DataLoader(drop_last=True) unless the dataset's size is a multiple of the batch size "
                    "times the data-parallel size (an epoch's last batch is shorter otherwise)"
                )

    def _raise_loss_error(self) -> None:
        error, self._loss_error = self._loss_error, None
        problem = None if error is None else f"pipeline_loss raised {type(error).__name__}: {error}"
        try:
            raise_agreed(1, problem)
        except AgreedError as agreed:
            raise agreed from error
