"""Parallel dimensions: validation and the device mesh.

The world is laid out as ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first, so tensor
parallel peers are neighbouring ranks). Flattened views name what each part of the code needs:

========== ============================ ===================================================
view        dims                         used for
========== ============================ ===================================================
``dp``      dp_replicate, dp_shard       the batch dims: each rank of it loads its own data
``dp_shard_cp`` dp_shard, cp             FSDP2 sharding (context-parallel ranks shard too)
``dp_cp``   dp_replicate, dp_shard, cp   the loss dims: token and sample counts, ``sync_dist``
``fsdp``    dp_replicate x dp_shard_cp   ``fully_shard``'s mesh: 2-D (HSDP) when dp_replicate > 1
``ep``      (part of dp_shard_cp)        experts sharded over it (:mod:`lightning_ndclip.core.experts`)
``edp``     (dp_shard_cp / ep)           expert data parallel: ranks holding the same experts
========== ============================ ===================================================

Expert parallelism is carved out of ``dp_shard x cp``: ``ep`` must divide it, and ``dp_shard_cp``
unflattens into ``edp x ep`` (experts sharded over ``ep`` and FSDP-sharded over ``edp``; dense
weights stay on the dims above).

The world mesh answers to the views' names (``mesh["dp_cp"]``) and to the names Lightning's
``ModelParallelStrategy`` gives its two dims (:data:`LIGHTNING_DIM_NAMES`), so a LightningModule
written for it finds ``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip._compat import concatenate_meshes, flatten_mesh, unflatten_mesh

__all__ = ["LIGHTNING_DIM_NAMES", "MESH_DIM_NAMES", "ParallelDims", "ParallelMeshes"]

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Names of the world mesh dims, outermost first."""

LIGHTNING_DIM_NAMES = {"data_parallel": "fsdp", "tensor_parallel": "tp"}
"""``ModelParallelStrategy``'s dim names and the view each one is: ``"data_parallel"`` is the mesh to
``fully_shard`` over (every data rank; 2-D, replicate x shard, when ``dp_replicate > 1``)."""

_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class _WorldMesh(DeviceMesh):
    """The world mesh, also answering to the names of its flattened views and Lightning's dim names.

    The views are kept here, not sliced from the root by name: PyTorch deprecates that."""

    views: dict[str, DeviceMesh]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            name = LIGHTNING_DIM_NAMES.get(names, names)
            views = self.__dict__.get("views", {})
            if name in views:
                return views[name]
            names = name
        return super().__getitem__(names)


V = TypeVar("V")


class PerProcessGroup(Generic[V]):
    """A value kept for the default process group of the moment: made by ``make()`` on first use, and made
    again once that group has been re-created (``dist.destroy_process_group()``, then ``init_process_group``),
    so that nothing made for the old group (meshes, their process groups, plans agreed over them) is used with
    the new one. :meth:`cache_clear` drops it at once (until then it keeps the old group's meshes, and each of
    their gloo groups its threads)."""

    def __init__(self, make: Callable[[], V]) -> None:
        self._make = make
        self._kept: tuple[Any, V] | None = None  # (the default process group, the value made for it)

    def get(self) -> V:
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if self._kept is None or self._kept[0] is not world:
            self._kept = (world, self._make())
        return self._kept[1]

    def cache_clear(self) -> None:
        self._kept = None


_built: PerProcessGroup[dict[tuple, ParallelMeshes]] = PerProcessGroup(dict)
"""The meshes built in this process for the default process group, by (device type, shape, ep)."""


class _SizeMismatchError(ValueError, RuntimeError):
    """The sizes do not multiply to the world size (a ``RuntimeError`` too, as Lightning raises it)."""


@dataclass(frozen=True)
class ParallelMeshes:
    """The world mesh and its flattened views, by name: ``meshes["tp"]``, ``meshes["dp_cp"]``.

    Attributes:
        world: the full mesh over :data:`MESH_DIM_NAMES`.
        flattened: the flattened views (kept here: PyTorch deprecates slicing them from the root).
    """

    world: DeviceMesh
    flattened: dict[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        name = LIGHTNING_DIM_NAMES.get(name, name)
        if name in self.flattened:
            return self.flattened[name]
        if name in MESH_DIM_NAMES:
            return self.world[name]
        names = MESH_DIM_NAMES + tuple(self.flattened) + tuple(LIGHTNING_DIM_NAMES)
        raise KeyError(f"no mesh dim or view named {name!r}; have {names}")


def check_sizes(*, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """The checks on the sizes that need no world size (:class:`ParallelDims` runs them first): each a
    positive int (``dp_shard`` also ``-1``, whatever the world leaves), and ``ep`` dividing
    ``dp_shard x cp`` once ``dp_shard`` is known. Raises ``TypeError`` / ``ValueError`` naming the size."""
    for name, value in {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1 and not (name == "dp_shard" and value == -1):
            raise ValueError(f"{name} must be {'a positive int or -1' if name == 'dp_shard' else 'a positive int'}, got {value}")
    if dp_shard != -1:
        _check_ep(dp_shard, cp, ep)


def _check_ep(dp_shard: int, cp: int, ep: int) -> None:
    if (dp_shard * cp) % ep:
        raise ValueError(
            f"ep={ep} must divide dp_shard x cp = {dp_shard} x {cp} = {dp_shard * cp}, the ranks experts are carved out of"
        )


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dims, checked against the world size before any collective.

    Attributes:
        world_size: the number of ranks.
        dp_replicate: data-parallel replicas (HSDP's replicate dim, or plain DDP-style replication).
        dp_shard: FSDP2 sharding degree; ``-1`` takes whatever the other dims leave.
        cp: context parallel (sequence sharding).
        tp: tensor parallel.
        pp: pipeline stages.
        ep: expert parallel, carved out of ``dp_shard x cp`` (must divide it).
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "world_size"}
        check_sizes(**sizes)
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool):
            raise TypeError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size}")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise _SizeMismatchError(
                    f"dp_shard=-1 cannot fill the world: pp={self.pp} x dp_replicate={self.dp_replicate} x "
                    f"cp={self.cp} x tp={self.tp} = {others} does not divide world_size={self.world_size}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
            _check_ep(self.dp_shard, self.cp, self.ep)
        product = others * self.dp_shard
        if product != self.world_size:
            raise _SizeMismatchError(
                f"the parallel sizes multiplied should equal the world size: pp={self.pp} x "
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} = "
                f"{product}, but world_size={self.world_size}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The world mesh shape, in :data:`MESH_DIM_NAMES` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def batch_size(self) -> int:
        """How many ranks load distinct data (``dp_replicate x dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> ParallelMeshes:
        """The world mesh with every dim of :data:`MESH_DIM_NAMES` (size-1 dims included, so names
        are stable) and the views ``dp``, ``dp_shard_cp``, ``dp_cp``, ``fsdp``, ``edp`` and ``ep``;
        the world mesh also answers to the views' names and to :data:`LIGHTNING_DIM_NAMES`.

        Built once per layout and default process group: a later call (a second Trainer in the same
        process) returns the same meshes, so no process groups pile up and DTensors made on them
        stay valid. Collective on the first call of a layout."""
        built = _built.get()
        key = (device_type, self.shape, self.ep)
        if key not in built:
            built[key] = self._new_mesh(device_type)
        return built[key]

    def _new_mesh(self, device_type: str, first: int = 0) -> ParallelMeshes:
        ranks = torch.arange(first, first + self.world_size, dtype=torch.int).reshape(self.shape)
        world = _WorldMesh(device_type, ranks, mesh_dim_names=MESH_DIM_NAMES)
        views = {name: flatten_mesh(world[dims], name) for name, dims in _FLATTENED.items()}
        experts = unflatten_mesh(views["dp_shard_cp"], 0, (self.dp_shard * self.cp // self.ep, self.ep), ("edp", "ep"))
        views["edp"], views["ep"] = experts["edp"], experts["ep"]
        views["fsdp"] = (
            concatenate_meshes([world["dp_replicate"], views["dp_shard_cp"]])
            if self.dp_replicate > 1
            else views["dp_shard_cp"]
        )
        world.views = views
        return ParallelMeshes(world, views)

    def describe(self) -> str:
        """``pp=1 x dp_replicate=1 x dp_shard=4 x cp=1 x tp=2 (ep=1)``, for logs and errors."""
        dims = " x ".join(f"{n}={s}" for n, s in zip(MESH_DIM_NAMES, self.shape))
        return f"{dims} (ep={self.ep}) = {math.prod(self.shape)} ranks"


def one_rank_meshes(device_type: str, rank: int = 0) -> ParallelMeshes:
    """Meshes of one rank of the default process group, every dim and view of size 1: what a step replayed
    on that rank alone reads (``meshes["cp"]`` of size 1). Collective: every rank calls it; the others get
    meshes they are not in."""
    return ParallelDims(world_size=1)._new_mesh(device_type, first=rank)


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of the mesh instance this rank belongs to, in row-major mesh order."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())

