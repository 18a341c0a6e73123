"""``NDParallelStrategy``: a Lightning strategy over ``pp x dp_replicate x dp_shard x cp x tp``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

from lightning_ndclip.mesh import ParallelDims, ParallelMeshes
from lightning_ndclip.reduce import use_sum_reduction

__all__ = ["NDParallelStrategy"]


class NDParallelStrategy(ModelParallelStrategy):
    """N-D parallel training: FSDP2 / HSDP, tensor, context and pipeline parallel dims on one mesh.

    The strategy builds the mesh (:class:`~lightning_ndclip.mesh.ParallelDims`) and hands it to the
    LightningModule as ``self.device_mesh`` (the world mesh, dims ``pp``, ``dp_replicate``,
    ``dp_shard``, ``cp``, ``tp``); the flattened views ``dp`` (batch dims), ``dp_shard_cp`` (FSDP)
    and ``dp_cp`` (loss dims) are ``trainer.strategy.meshes[name]``. Apply ``fully_shard`` /
    ``parallelize_module`` in ``configure_model`` with those meshes.

    Data: each rank of ``dp`` gets its own shard (a ``DistributedSampler`` over the batch dims);
    tp, cp and pp peers get the same batch. ``self.log(..., sync_dist=True)`` reduces over the loss
    dims ``dp_cp``, not over tp or pp copies. Checkpoints are distributed checkpoints, as in
    Lightning's ``ModelParallelStrategy``.

    Args:
        dp_replicate: data-parallel replicas (HSDP's replicate dim).
        dp_shard: FSDP2 sharding degree; ``-1`` (default) takes the ranks the other dims leave.
        cp: context-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        ep: expert-parallel degree, carved out of ``dp_shard x cp`` (must divide it).
        sum_reduction: make every FSDP2 gradient reduction a plain SUM after ``configure_model``
            (:func:`lightning_ndclip.use_sum_reduction`). Use it when ``training_step`` returns a loss
            already normalized by the *global* count (:mod:`lightning_ndclip.loss`); leave it off
            for the usual per-rank mean loss, which FSDP then averages.
        save_distributed_checkpoint: save one shard per rank (``True``) or a full checkpoint on rank 0.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: from the accelerator.
        timeout: process-group timeout.

    All sizes are validated in ``__init__`` against each other and, once the world size is known
    and before any collective, against it: a mismatch is a ``ValueError`` stating the arithmetic.
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
        sum_reduction: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        sizes = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep)
        # every check that needs no world size (dp_shard=-1 resolves to ep here, which ep divides)
        known = dp_replicate * cp * tp * pp * (ep if dp_shard == -1 else dp_shard)
        ParallelDims(world_size=known, **sizes)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._sizes = sizes
        self._sum_reduction = sum_reduction
        self._dims: ParallelDims | None = None
        self._meshes: ParallelMeshes | None = None

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then injects samplers and honours ``sync_dist``."""
        return True

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

    def setup_environment(self) -> None:
        self.set_world_ranks()
        self._dims = ParallelDims(world_size=self.world_size, **self._sizes)  # before any collective
        self._setup_distributed()
        self._meshes = self._dims.build_mesh(self.root_device.type)
        self._device_mesh = self._meshes.world
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self._sum_reduction:
            assert self.model is not None
            if use_sum_reduction(self.model) == 0:
                raise ValueError(
                    "NDParallelStrategy(sum_reduction=True) found no fully_shard unit in the model after "
                    "configure_model(); apply fully_shard there, or leave sum_reduction off"
                )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        batch = self.meshes["dp"]
        return {"num_replicas": batch.size(), "rank": batch.get_local_rank()}

    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor | Any:
        """Reduce over the loss dims ``dp_cp`` by default (tp and pp peers hold copies)."""
        if isinstance(tensor, torch.Tensor):
            group = group if group is not None else self.meshes["dp_cp"].get_group()
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "nd_parallel", cls, description="N-D parallel (FSDP2 x TP x CP x PP) with exact norms and losses"
        )


NDParallelStrategy.register_strategies(StrategyRegistry)
