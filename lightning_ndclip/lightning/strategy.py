"""``NDParallelStrategy``: a Lightning strategy over ``pp x dp_replicate x dp_shard x cp x tp``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from typing_extensions import override

from lightning_ndclip import _compat
from lightning_ndclip.core import libraries
from lightning_ndclip.core.agree import run_agreed
from lightning_ndclip.core.loss import MicroBatchShare
from lightning_ndclip.core.parallel.coverage import check_data_parallel_reduction
from lightning_ndclip.core.parallel.mesh import ParallelDims, ParallelMeshes, _SizeMismatchError, check_sizes
from lightning_ndclip.core.parallel.plan import ParallelPlan
from lightning_ndclip.core.parallel.reduce import use_sum_reduction
from lightning_ndclip.core.parallel.replicas import broadcast_replicas_
from lightning_ndclip.core.parallel.summary import ParallelSummary, summarize
from lightning_ndclip.core.parallel.tensor_parallel import check_ties, tied_parameters
from lightning_ndclip.core.parallel.unused import UnusedParameters, UnusedParametersCheck
from lightning_ndclip.core.pipeline import PipelineOptions
from lightning_ndclip.core.random import RandomStreams, fork_forward
from lightning_ndclip.lightning._arguments import (
    check_choice,
    check_plan_and_pipeline,
    lightning_sizes,
    refuse_unexpected,
    resolve_sizes,
)
from lightning_ndclip.lightning._checkpoint import (
    file_system_path,
    refuse_incomplete_checkpoint,
    save_distributed_checkpoint_atomically,
)
from lightning_ndclip.lightning._cut_steps import CutSteps
from lightning_ndclip.lightning._first_step import FirstStepChecks
from lightning_ndclip.lightning._logged_losses import LoggedLosses
from lightning_ndclip.lightning._normalization import check_module_for, normalized, refuse_load_balancing
from lightning_ndclip.lightning._pipeline import PipelineRunner
from lightning_ndclip.lightning._pipeline_checkpoint import (
    PipelineLayout,
    StageNames,
    load_distributed_checkpoint,
    read_plan,
)
from lightning_ndclip.lightning._summary import training_notes
from lightning_ndclip.lightning._windows import LossWindows
from lightning_ndclip.lightning._wrapping import whole_module_unit, wrap

__all__ = ["NDParallelStrategy"]


def _refuse_fsdp1(model: nn.Module, strategy: str) -> None:
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`."
            f" The `{strategy}` only supports the new FSDP2 APIs in PyTorch >= 2.4."
        )


class NDParallelStrategy(ModelParallelStrategy):
    """N-D parallel training: FSDP2 / HSDP, tensor, context, pipeline and expert parallel dims on one mesh.

    The strategy builds the mesh (:class:`~lightning_ndclip.core.parallel.mesh.ParallelDims`) and hands it to
    the LightningModule as ``self.device_mesh`` (dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
    ``tp``; views ``dp``, ``dp_shard_cp``, ``fsdp``, ``dp_cp``; and ``ModelParallelStrategy``'s names
    ``"data_parallel"`` = ``fsdp`` and ``"tensor_parallel"`` = ``tp``), so a LightningModule written
    for Lightning's strategy runs unchanged. Parallelize in ``configure_model`` with those meshes, or
    give a ``plan`` instead. Each ``dp`` rank reads its own data shard; tp, cp and pp peers read the
    same batch; ``self.log(..., sync_dist=True)`` reduces over ``dp_cp``. Checkpoints and precision
    plugins are those of ``ModelParallelStrategy``. With no size given, every rank is an FSDP2 rank
    (``ModelParallelStrategy()`` instead puts tp over a node: pass its two sizes for its layout).

    Args:
        dp_replicate: data-parallel replicas (HSDP's replicate dim).
        dp_shard: FSDP2 sharding degree; ``-1`` (default) takes the ranks the other dims leave.
        cp: context-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        ep: expert-parallel degree, carved out of ``dp_shard x cp`` (must divide it).
        data_parallel_size: ``ModelParallelStrategy``'s name for ``dp_shard`` (an int, or ``"auto"``:
            the number of nodes). Giving it or ``tensor_parallel_size`` selects Lightning's sizes (the
            other defaults to ``"auto"``); ``dp_replicate`` / ``dp_shard`` / ``tp`` may then not be given.
        tensor_parallel_size: ``ModelParallelStrategy``'s name for ``tp`` (an int, or ``"auto"``: the
            devices per node).
        plan: a declarative plan (:class:`~lightning_ndclip.core.parallel.plan.ParallelPlan`:
            ``tp_plan``, ``fsdp_units``, ``activation_checkpointing``, ``mp_policy``) for a
            LightningModule with no parallel code and no ``configure_model``.
        pipeline: with ``pp > 1``, how the pipeline is built and run
            (:class:`~lightning_ndclip.core.pipeline.PipelineOptions`). ``training_step`` then calls
            ``trainer.strategy.run_pipeline(inputs, target)`` (forward and backward; returns the loss)
            and the module defines ``pipeline_loss(output, target)`` (``docs/howto/pipeline.md``).
        loss_normalization: ``None`` (default): Lightning's per-rank mean loss, averaged by the
            data-parallel reduction. ``"token_mean"``: the exact global token mean; the module defines
            ``count_tokens(batch) -> Tensor`` and ``training_step`` returns its usual loss (a mean over
            the micro-batch's valid tokens; per-token losses under ``cp > 1`` or ``pp > 1``).
            ``"sample_mean"``: the exact per-sample mean; the module defines ``sample_ids(batch) ->
            (ids, num_samples[, valid])`` for this rank's tokens and ``training_step`` returns per-token
            losses shaped like ``ids``. The counts of a whole accumulation window are synchronized
            before its first backward, every loss becomes its share of the global mean
            (:func:`~lightning_ndclip.core.loss.loss_share`), every FSDP2 reduction a SUM, issued on
            the window's last micro-batch. Bad counts raise the same ``ValueError`` on every rank.
        loss_reduction: what a scalar ``"token_mean"`` loss is: ``"mean"`` (default, the Lightning
            habit) or ``"sum"``.
        log_loss: with ``loss_normalization``, the name under which the exact global mean loss of each
            optimizer step is logged (on step, progress bar); ``None`` logs nothing.
        log_eval_loss: with ``loss_normalization``, a ``validation_step`` /
            ``test_step`` that returns its loss, as ``training_step`` does, has the exact global mean
            of the epoch (tokens or samples, the same on every mesh) logged as ``val_loss`` /
            ``test_loss`` (with ``pp > 1``: ``"token_mean"`` without ``cp``, the loss that
            ``run_pipeline`` returns). ``False`` logs nothing. Logging the same name yourself is an error.
        find_unused_parameters: for models whose graph changes from batch to batch (a vision tower on a
            text-only batch, a branch some batches skip): parameters used on some ranks only get the exact
            sum of their gradients, and ones no rank used none, as on one device
            (:class:`~lightning_ndclip.core.parallel.unused.UnusedParameters`); a module some ranks run and
            others skip must not be an FSDP2 unit of its own (a ``ValueError`` on every rank names it). Costs
            one host-side collective per FSDP2 unit forward and one per backward, a walk of the autograd
            graph, and a gradient reduction at every micro-batch (none deferred to the window's end).
            Without it, a backward that some ranks reducing a unit together would enter with gradients of
            different parameters raises ``ValueError`` on every rank first, naming them and this option
            (:class:`~lightning_ndclip.core.parallel.unused.UnusedParametersCheck`: a graph walk per backward
            and a host-side all-gather per window). Not with ``pp > 1``.
        sum_reduction: make every FSDP2 gradient reduction a plain SUM, for a ``training_step`` that
            normalizes its loss by global counts itself. Implied by ``loss_normalization``.
        init_sync: after ``configure_model``, give every replica of a parameter or buffer (its
            ``Replicate`` mesh dims; tied pipeline copies) the value of its copy at coordinate 0, as
            DDP does (:func:`~lightning_ndclip.core.parallel.replicas.broadcast_replicas_`).
        summary: when training starts, print on rank zero what was parallelized how
            (:func:`~lightning_ndclip.core.parallel.summary.summarize`) and what the first step counts.
        save_distributed_checkpoint: one shard per rank (``True``), or a full checkpoint on rank 0.
        hf_checkpoint: a Hugging Face checkpoint directory (``*.safetensors``) to load into the
            LightningModule's ``transformers`` or ``diffusers`` model once it is parallelized, each rank reading only
            its shards (:func:`~lightning_ndclip.integrations.transformers.checkpoint.load_hf_checkpoint`,
            :func:`~lightning_ndclip.integrations.diffusers.checkpoint.load_diffusers_checkpoint`). Build the model on
            the meta device (``with torch.device("meta")``, or ``Trainer.init_module(empty_init=True)``)
            and no rank ever holds all of it. With ``pp > 1``, each rank loads its stages' tensors.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: from the accelerator.
        timeout: process-group timeout.

    Every argument is validated here, the sizes against each other and, once the world size is known
    and before any collective, against it: a mismatch is a ``ValueError`` stating the arithmetic.
    0.1.0's flat ``tp_plan`` / ``fsdp_units`` / ... and ``pp_*`` keywords are a ``TypeError`` naming
    their place in ``plan`` / ``pipeline``.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        *,
        data_parallel_size: int | Literal["auto"] | None = None,
        tensor_parallel_size: int | Literal["auto"] | None = None,
        loss_normalization: Literal["token_mean", "sample_mean"] | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        log_loss: str | None = "train_loss",
        log_eval_loss: bool = True,
        plan: ParallelPlan | None = None,
        pipeline: PipelineOptions | None = None,
        find_unused_parameters: bool = False,
        sum_reduction: bool = False,
        init_sync: bool = True,
        summary: bool = True,
        save_distributed_checkpoint: bool = True,
        hf_checkpoint: str | os.PathLike[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **unexpected: Any,
    ) -> None:
        refuse_unexpected(unexpected)
        sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
        self._lightning_sizes = lightning_sizes(data_parallel_size, tensor_parallel_size, sizes)
        # "auto" sizes are unknown until the processes start: data parallel as dp_shard=-1, tensor as 1
        check_sizes(**resolve_sizes(sizes, self._lightning_sizes, num_nodes=-1, devices_per_node=1))
        check_choice("loss_normalization", loss_normalization, (None, "token_mean", "sample_mean"))
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        self._plan = plan or ParallelPlan()
        self._pp = pipeline or PipelineOptions()
        check_plan_and_pipeline(self._plan, self._pp, sizes)
        if find_unused_parameters and pp > 1:
            raise ValueError(
                "NDParallelStrategy(find_unused_parameters=True, pp > 1): the pipeline schedule runs backward inside "
                "its stages, where parameters unused on some ranks are not handled yet; use pp=1"
            )
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._sizes = sizes
        self._loss_normalization = loss_normalization
        self._loss_reduction = loss_reduction
        self._logged = LoggedLosses(log_loss, log_eval_loss, loss_normalization, loss_reduction)
        self._sum_reduction = sum_reduction or loss_normalization is not None
        self._find_unused_parameters = find_unused_parameters
        self._init_sync = init_sync
        self._summary = summary
        self._hf_checkpoint = hf_checkpoint
        self._microbatches = self._pp.microbatches or pp * self._pp.stages_per_rank
        # set as training runs
        self._counts_told = not summary
        self._pipeline: PipelineRunner | None = None
        self._windows: LossWindows | None = None
        self._dims: ParallelDims | None = None
        self._meshes: ParallelMeshes | None = None
        self._ties: list[tuple[str, ...]] = []
        self._first_step = FirstStepChecks()
        self._unused: UnusedParameters | UnusedParametersCheck | None = None
        self._gradient_sync = True
        self._random_streams: RandomStreams | None = None
        self._undo_forks: list[Callable[[], None]] = []  # the random forks of fit's library models, undone at teardown
        self._cut_steps: CutSteps | None = None

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then injects samplers and honours ``sync_dist``."""
        return True

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("NDParallelStrategy has no LightningModule attached yet")
        return module

    @property
    def _wrapped_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("NDParallelStrategy has no model set up yet")
        return self.model

    @property
    def loss_normalization(self) -> Literal["token_mean", "sample_mean"] | None:
        """The ``loss_normalization`` the strategy was given."""
        return self._loss_normalization

    @property
    def adds_load_balancing_loss(self) -> bool:
        """Whether a ``training_step`` dict's ``"load_balancing_loss"`` (this rank's share of a load-balancing loss of
        the global micro-batch, :func:`~lightning_ndclip.lightning.expert_load.router_aux_loss`) is added to the loss
        as the mean over the window's micro-batches, unscaled by tokens: with ``loss_normalization`` and ``pp=1``."""
        return self._loss_normalization is not None and (self._dims is None or self._dims.pp == 1)

    @property
    def loss_reduction(self) -> Literal["mean", "sum"]:
        """The ``loss_reduction`` the strategy was given."""
        return self._loss_reduction

    @property
    def _cut(self) -> CutSteps:
        if self._cut_steps is None:
            raise RuntimeError("NDParallelStrategy cuts batches only after the processes start")
        return self._cut_steps

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved sizes (available once the processes are initialized)."""
        if self._dims is None:
            raise RuntimeError("NDParallelStrategy.parallel_dims is known only after the processes start")
        return self._dims

    @property
    def meshes(self) -> ParallelMeshes:
        """The world mesh and its flattened views ``dp``, ``dp_shard_cp``, ``dp_cp``."""
        if self._meshes is None:
            raise RuntimeError("NDParallelStrategy.meshes is available only after the processes start")
        return self._meshes

    @override
    def setup_environment(self) -> None:
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)
        world_size = self.num_nodes * self.num_processes  # what _setup_distributed gives the cluster environment
        sizes = resolve_sizes(self._sizes, self._lightning_sizes, self.num_nodes, self.num_processes)
        product = sizes["dp_shard"] * sizes["tp"] * sizes["cp"] * sizes["pp"]
        if self._lightning_sizes is not None and product != world_size:
            raise _SizeMismatchError(
                f"data_parallel_size={sizes['dp_shard']} x tensor_parallel_size={sizes['tp']} = {product}: the sizes "
                f"multiplied should equal the world size, {world_size} ({self.num_nodes} node(s) x "
                f"{self.num_processes} devices)"
            )
        self._dims = ParallelDims(world_size=world_size, **sizes)  # before any collective
        if self._dims.pp > 1 and not _compat.save_distributed_checkpoint(self):
            raise ValueError(
                "NDParallelStrategy(pp > 1, save_distributed_checkpoint=False): a full checkpoint is written by "
                "rank 0, which holds only its own pipeline stages; the others' parameters would be missing. Use "
                "save_distributed_checkpoint=True (one shard per rank)"
            )
        module = self._module
        if self._dims.pp > 1:
            self._pipeline = PipelineRunner(self._pp, self._microbatches, self.root_device)
            self._pipeline.check(module, self._plan, self._dims.pp)
        elif self._plan and is_overridden("configure_model", module):
            raise ValueError(
                f"{type(module).__name__} overrides configure_model() and NDParallelStrategy was given a "
                "plan (ParallelPlan): use one"
            )
        _compat.setup_distributed(self)
        self._meshes = self._dims.build_mesh(self.root_device.type)
        _compat.set_device_mesh(self, self._meshes.world)  # what self.device_mesh and module.device_mesh return
        _compat.set_device_mesh(module, self._meshes.world)
        self._cut_steps = CutSteps(module, self._plan, self._meshes["cp"])

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning's context around ``configure_model``: the model's tied parameters are recorded on
        entry, and checked after it in :meth:`setup`."""
        self._ties = tied_parameters(self._module)
        with super().model_sharded_context():
            yield

    @property
    def pipeline_mesh(self) -> DeviceMesh | None:
        """The ``pp`` mesh dim when ``pp > 1`` (``GlobalNormClip`` sums the norm over it), else ``None``."""
        return self.meshes["pp"] if self._dims is not None and self._dims.pp > 1 else None

    @property
    def pipeline_options(self) -> PipelineOptions:
        """The ``pipeline`` options, with ``microbatches`` resolved (its default: the number of stages) and,
        for a model that splits itself (a ``transformers`` model), its default split points and ties."""
        options = self._pipeline.config if self._pipeline is not None else self._pp
        return dataclasses.replace(options, microbatches=self._microbatches)

    @property
    def tied_parameters(self) -> dict[str, torch.Tensor] | None:
        """``{key: this rank's copy}`` of the parameters tied across pipeline stages (for the norm)."""
        return None if self._pipeline is None else self._pipeline.tied_parameters

    def run_pipeline(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        """Run the pipeline schedule on one batch and return the batch's loss, detached, on every rank
        (broadcast from the last stage). Give ``inputs`` and ``target`` on every rank; each stage uses
        what it needs.

        In training: forward and backward of every micro-batch, the loss scaled as the gradients are.
        In validation / testing (call it from ``validation_step``): forward only, and the loss is the
        plain sum of ``pipeline_loss`` over the micro-batches (of its elements, if it is per-token).

        An error in ``pipeline_loss`` is raised once the schedule is through, on every rank of every
        pipeline: the same :class:`~lightning_ndclip.core.agree.AgreedError` naming the rank and the
        error (chained to it on that rank)."""
        if self._pipeline is None:
            raise RuntimeError("run_pipeline needs NDParallelStrategy(pp > 1)")
        return self._pipeline.run(inputs, target, training=self._module.trainer.training)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """As Lightning's; at the first step of a run with ``tp > 1``, once the window's gradients exist and
        before any callback sees them, checks that parameters the tensor-parallel ranks hold as copies got
        the same gradient on each (:func:`~lightning_ndclip.core.parallel.replicas.check_replica_gradients`)."""
        if self._dims is not None:
            closure = self._first_step.closure(closure, self._wrapped_model, self.meshes["tp"])
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """With ``pp > 1`` the schedule has already run backward inside ``training_step``: add the
        gradients it set aside back (after Lightning zeroed the previous ones), and once a window is
        complete sum the copies of tied parameters."""
        if self._pipeline is not None:
            self._pipeline.gradients_back(self._module)
            return closure_loss
        if self._unused is not None:
            closure_loss = self._unused.prepare_backward(closure_loss, reduces=self._gradient_sync)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """As ``ModelParallelStrategy.setup``, with the declarative plan or the pipeline split applied first (they take
        the place of ``configure_model``); then SUM reduction, equal replicas and the step's random streams."""
        module, model = self._module, self._wrapped_model
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.accelerator is not None:
            self.accelerator.setup(trainer)
        check_module_for(self._loss_normalization, module)
        if not is_overridden("configure_model", module):  # else recorded before configure_model ran
            self._ties = tied_parameters(module)
        wrap(module, self._plan, lambda: self.meshes, self._sizes, self._pipeline, type(self).__name__)
        _refuse_fsdp1(model, type(self).__name__)
        self._load_library_checkpoint(module)
        _compat.materialize_distributed_module(model, self.root_device)
        check_ties(module, self._ties)
        self.model = self.precision_plugin.convert_module(model)
        self.model_to_device()
        if fitting:  # exact mode: a parameter nothing reduces is an error
            check_data_parallel_reduction(model, self.meshes, unreduced="raise" if self._sum_reduction else "warn")
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self._set_up_gradient_reduction(module)
        if self._init_sync:
            broadcast_replicas_(module)
            if self._pipeline is not None:
                self._pipeline.sync_ties()
        if fitting:  # after every weight is made: to teardown
            self._seed_random_streams(module)

    def _load_library_checkpoint(self, module: pl.LightningModule) -> None:
        """``hf_checkpoint=``: into the pipeline's stages, or into the module's one library model."""
        if self._hf_checkpoint is None:
            return
        if self._pipeline is not None:
            self._pipeline.load_hf_checkpoint(module, self._hf_checkpoint, self.root_device)
            return
        found = libraries.the_model(
            module, "NDParallelStrategy(hf_checkpoint=...)",
            instead="Call lightning_ndclip.load_hf_checkpoint(model, directory) for each in on_fit_start instead",
        )  # fmt: skip
        found.library.load_checkpoint(found.model, self._hf_checkpoint, device=self.root_device)

    def _set_up_gradient_reduction(self, module: pl.LightningModule) -> None:
        """Every FSDP2 reduction a SUM (``sum_reduction``, implied by ``loss_normalization``); parameters some ranks
        leave unused handled (``find_unused_parameters``) or refused by name, before FSDP2's reduction."""
        if self._sum_reduction:
            use_sum_reduction(self._wrapped_model)
        if self._unused is None and self._pipeline is None and any(isinstance(m, FSDPModule) for m in module.modules()):
            host = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")  # checks read on the host
            unused = UnusedParameters if self._find_unused_parameters else UnusedParametersCheck
            self._unused = unused(self._wrapped_model, group=host if isinstance(host, dist.ProcessGroup) else None)

    def _seed_random_streams(self, module: pl.LightningModule) -> None:
        """The step's random draws: alike on tp and cp peers, apart over data ranks and stages (rank 0's seed); the
        library models' dropout forked where their activations are split (this cp rank's tokens, this tp rank's
        heads). Undone at teardown."""
        seed = [torch.initial_seed()]
        dist.broadcast_object_list(seed, src=0)
        self._random_streams = streams = RandomStreams(self.meshes, seed[0], self.root_device)
        streams.seed_shared()
        if self._cut.cuts:  # every activation of the library models is this cp rank's tokens
            for found in libraries.models(module):
                self._undo_forks += [handle.remove for handle in fork_forward(found.model, streams, "cp")]
        elif self.parallel_dims.tp > 1:  # each tp rank's attention heads draw their own dropout masks
            tp_rank = self.meshes["tp"].get_local_rank()
            for found in libraries.models(module):
                if found.library.attention_dropout(found.model) > 0:
                    self._undo_forks.append(found.library.fork_split_head_dropout(found.model, tp_rank))

    @override
    def teardown(self) -> None:
        """As Lightning's, and the random generators given back as they were before ``fit`` seeded the step's streams
        (so a model built after ``fit`` starts equal on every rank, as one built before it)."""
        if self._windows is not None:  # no count's all-reduce left in flight
            self._windows.close()
        if self._random_streams is not None:
            self._random_streams.restore()
        for undo in self._undo_forks:
            undo()
        self._undo_forks = []
        super().teardown()

    @property
    def random_streams(self) -> RandomStreams:
        """This rank's random streams (:class:`~lightning_ndclip.core.random.RandomStreams`), seeded at ``setup`` of
        ``fit`` from rank 0's ``torch.initial_seed()`` (what ``lightning.seed_everything`` sets): the step's random
        numbers are the same on tp and cp peers and differ between data ranks and pipeline stages; draw what must
        differ over the ranks splitting a tensor (noise for this cp rank's tokens) inside
        ``self.trainer.strategy.random_streams.fork("cp")``."""
        if self._random_streams is None:
            raise RuntimeError("NDParallelStrategy.random_streams exists once fit's setup has run")
        return self._random_streams

    def parallel_summary(self) -> ParallelSummary:
        """What was parallelized how, and the data side (see the ``summary`` argument); ``str()`` of it
        is the table printed when training starts. Collective over ``pp`` when ``pp > 1``."""
        stages = {self._pp.module: self._pipeline.local_stages(self._module)} if self._pipeline is not None else None
        summary = summarize(self._module, self.meshes, stages)
        trainer, dims = self._module.trainer, self.parallel_dims
        summary.notes += training_notes(
            batch_size=getattr(getattr(trainer, "train_dataloader", None), "batch_size", None),
            data_ranks=dims.batch_size, accumulate=trainer.accumulate_grad_batches,
            whole_module_unit=not self._plan and whole_module_unit(self._module, self._sizes),
            pipeline=None if self._pipeline is None else (self._pp, self._microbatches, dims.pp),
            context=self._cut.context_summary(),
            normalization=self._loss_normalization, sum_reduction=self._sum_reduction,
        )  # fmt: skip
        return summary

    @override
    def on_train_start(self) -> None:
        """Prints the summary; and applies a ``GradientAccumulationScheduler``'s factor for the current
        epoch, which Lightning leaves unset when it resumes mid-epoch (it skips ``on_train_epoch_start``
        there, and the resumed epoch accumulated 1 micro-batch where the uninterrupted run accumulated k)."""
        trainer = self._module.trainer
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, GradientAccumulationScheduler):
                trainer.accumulate_grad_batches = callback.get_accumulate_grad_batches(trainer.current_epoch)
        if self._summary:
            summary = self.parallel_summary()
            rank_zero_info(str(summary))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._loss_normalization is None or self.lightning_module is None:
            return dataloader
        trainer = self.lightning_module.trainer
        if trainer.training:
            self._windows = LossWindows(dataloader, self, trainer)
            return self._windows
        return dataloader

    def _set_gradient_sync(self, enabled: bool) -> None:
        self._gradient_sync = enabled
        for unit in self._wrapped_model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_requires_gradient_sync(enabled, recurse=False)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx  # training_step(batch) alone is a valid signature: keep the index here

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs ``training_step`` with FSDP2 reducing only on the last micro-batch of an accumulation
        window and, with ``loss_normalization``, scales its loss to its share of the global mean."""
        self._first_step.check_batch(args[0] if args else kwargs.get("batch"), self.meshes.world)
        share = self._micro_batch_share()
        self._set_gradient_sync(share.ends_window or (self._unused is not None and self._unused.reduces_every_backward))
        watching = partial(
            self._first_step.watching, self._wrapped_model, self.meshes, streams=self._random_streams,
            module_name=type(self._module).__name__, device=self.root_device,
        )  # fmt: skip
        refused = partial(refuse_load_balancing, mode=self._loss_normalization, pp=self.parallel_dims.pp)
        if self._pipeline is not None:  # the pipeline scales each of its micro-batches' losses: Lightning divides by 1
            with watching(watch_forward=False):
                step = partial(super().training_step, *args, **kwargs)
                output = refused(self._pipeline.training_step(step, share, self._module))
            k = 1
        else:
            with watching(watch_forward=True):
                output, own = self._run_step(super().training_step, args, kwargs)
            if self._windows is None:  # Lightning's mean of micro-batch means: Lightning divides by k itself
                return refused(output)
            k = self._module.trainer.accumulate_grad_batches
            own = own or self.parallel_dims.cp == 1
            output = normalized(output, share, k, mode=self._loss_normalization, own=own, cuts=self._cut.cuts)
        if self._windows is not None:
            self._logged.add_window_share(self._module, self.meshes["dp_cp"].get_group(), output, k, share.ends_window)
            if share.ends_window:  # the next window's counts: their all-reduce overlaps this backward and optimizer step
                self._windows.read_next_window()
        return output

    def _run_step(self, hook: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """A step hook on this cp rank's part of the batch (:class:`CutSteps`) and whether its loss is a library
        model's own; with ``find_unused_parameters``, each FSDP2 unit's forward agreed with the other ranks'."""
        with self._unused.forward() if self._unused is not None else nullcontext():
            return self._cut.run(hook, args, kwargs)

    def _micro_batch_share(self) -> MicroBatchShare:
        """This micro-batch's share of its window: from the loss windows, or without loss normalization
        a mean of micro-batch means (``1 / k``; for a pipeline, of its ``m`` micro-batches: ``1 / (m k)``)."""
        module = self._module
        trainer = module.trainer
        if self._windows is None:
            last = not (module.automatic_optimization and _compat.should_accumulate(trainer))
            return MicroBatchShare(1.0 / (self._microbatches * trainer.accumulate_grad_batches), ends_window=last)
        share = self._windows.window_of(self._batch_idx)
        if not self._counts_told and self._windows.first_window is not None:
            self._counts_told = True
            count, kind, batches = self._windows.first_window  # read to the host once, only when told
            rank_zero_info(
                f"lightning_ndclip: the first optimizer step counts {int(count)} {kind} in {batches} "
                "micro-batch(es) of every data rank"
            )
        return share

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output, own = self._run_step(super().validation_step, args, kwargs)
        self._log_eval_loss("validation_step", "val_loss", output, args[0] if args else kwargs.get("batch"), own)
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._unused.forward() if self._unused is not None else nullcontext():
            return super().predict_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output, own = self._run_step(super().test_step, args, kwargs)
        self._log_eval_loss("test_step", "test_loss", output, args[0] if args else kwargs.get("batch"), own)
        return output

    def _log_eval_loss(self, hook: str, name: str, output: Any, batch: Any, own: bool) -> None:
        self._logged.add_eval(self._module, hook, name, output, batch, own=own, meshes=self.meshes, device=self.root_device)

    def _optimizer_options(self) -> StateDictOptions:
        # flattened keys (one per parameter): pipeline stages hold different parameters, and a single
        # shared "param_groups" entry would be written once for all of them
        return StateDictOptions(
            full_state_dict=not _compat.save_distributed_checkpoint(self),
            cpu_offload=True,
            flatten_optimizer_state_dict=True,
        )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._dims is None or self._dims.pp == 1:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self._wrapped_model, optimizer, options=self._optimizer_options())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """As Lightning's ModelParallelStrategy, but a distributed checkpoint is never written in place: the
        ranks write a fresh sibling directory that rank 0 completes and swaps in, so a fault leaves the old or
        the new checkpoint at ``filepath``, never a mix (:mod:`lightning_ndclip.lightning._checkpoint`). A full
        checkpoint (``save_distributed_checkpoint=False``) is Lightning's, written atomically by rank 0; an
        error there is raised on rank 0 and, as an :class:`~lightning_ndclip.core.agree.AgreedError`
        naming it, on every other rank. A URL
        (``s3://...``) raises ``ValueError`` on every rank: Lightning would write it to a local directory."""
        if storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        path = file_system_path(self.broadcast(filepath))
        if not _compat.save_distributed_checkpoint(self):
            # rank 0 saves as Lightning does; the others only join its broadcast of the path: Lightning's
            # removal of a distributed checkpoint there ran on every rank at once (they raced), and an
            # error on rank 0 left the others going on
            save = partial(super().save_checkpoint, checkpoint, path) if self.global_rank == 0 else partial(self.broadcast, path)
            run_agreed(f"saving the full checkpoint {str(path)!r}", save)
            return None
        save_distributed_checkpoint_atomically(self, self._pipeline_layout().stamped(checkpoint), path)
        return None

    def _pipeline_layout(self) -> PipelineLayout:
        """This run's pipeline layout, as its checkpoints record it."""
        pp = self._dims.pp if self._dims is not None else 1
        names = StageNames() if self._pipeline is None else self._pipeline.stage_names(self._module)
        return PipelineLayout(pp, self._pp.stages_per_rank, tuple(self._pp.split_points or ()), names)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """As Lightning's ModelParallelStrategy. A distributed checkpoint saved or resumed with ``pp > 1`` is
        read by the unsplit model's names (:mod:`lightning_ndclip.lightning._pipeline_checkpoint`): it resumes on
        another pipeline layout (``pp``, ``stages_per_rank``, ``split_points``, or ``pp = 1``) as on another
        mesh. An incomplete distributed checkpoint directory (no ``meta.pt`` or ``.metadata``, or a shard
        missing) is refused with the same ``ValueError`` on every rank, saying what is missing; so is a URL
        (``s3://...``), a checkpoint lacking a tensor of this run (naming it), and one saved by stages built in
        configure_model on another pipeline layout."""
        path = file_system_path(self.broadcast(checkpoint_path))
        refuse_incomplete_checkpoint(self, path)
        names_in = partial(self._pipeline_layout().names_in, path, weights_only)
        names = run_agreed(f"checking the pipeline layout of {str(path)!r}", names_in)
        if names is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        if not path.is_dir():
            raise ValueError(f"with pp > 1, resume from a distributed (sharded) checkpoint directory, got {path}")
        model, optimizers = self._wrapped_model, list(self.optimizers)
        plan = partial(read_plan, path, model, optimizers, names, self._module.strict_loading)
        load_distributed_checkpoint(model, run_agreed(f"reading the names in {str(path)!r}", plan))
        return torch.load(path / _compat.metadata_filename(), weights_only=weights_only)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        batch = self.meshes["dp"]
        return {"num_replicas": batch.size(), "rank": batch.get_local_rank()}

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the loss dims ``dp_cp`` by default (tp and pp peers hold copies)."""
        if isinstance(tensor, torch.Tensor):
            group = group if group is not None else self.meshes["dp_cp"].get_group()
            return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "nd_parallel", cls, description="N-D parallel (FSDP2 x TP x CP x PP) with exact norms and losses"
        )


NDParallelStrategy.register_strategies(StrategyRegistry)
