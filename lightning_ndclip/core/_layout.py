"""Local layout analysis: what one rank holds of each gradient, and whether it must count it.

Nothing here communicates. For every tensor the rank describes

* its **logical** signature (global shape, dtype, placements, mesh shape and dim names), which every
  rank of the same pipeline stage must agree on;
* the ranks of the device-mesh **instance** that holds it (plain tensors: the rank alone);
* whether this rank is the representative of its replicas *inside* that instance: a ``Replicate``
  mesh dim is counted only at coordinate 0, a ``Shard`` / ``_StridedShard`` dim at every coordinate.

Which instance counts among several copies of a mesh, and which pipeline stage counts a tied
parameter, needs the other ranks' view and is decided in :mod:`lightning_ndclip.core._norm_plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_ndclip._compat import StridedShard, dtensor_spec, local_tensors


@dataclass(frozen=True)
class TensorLayout:
    """How one rank holds a logical gradient tensor; one object is shared by every tensor of the same
    kind (the same DTensor spec and dtype, or the same shape and dtype for plain tensors).

    Attributes:
        signature: the stage-wide logical description, equal on every rank of a pipeline stage.
        mesh_ranks: global ranks of the mesh instance holding the tensor, ``(rank,)`` for a plain one.
        counted_in_mesh: this rank is the one member of its replica set inside the mesh instance.
        replicated_everywhere: every mesh dim is ``Replicate`` (or the tensor is plain): every rank
            of the instance holds the whole tensor.
        problem: ``(kind, placement, mesh dim)`` when the tensor cannot be normed exactly (see
            :meth:`error`), else ``None``.
    """

    signature: tuple
    mesh_ranks: tuple[int, ...]
    counted_in_mesh: bool
    replicated_everywhere: bool
    problem: tuple[str, str, str] | None = None

    def error(self, name: str, rank: int) -> str | None:
        """Why the tensor called ``name`` cannot be normed exactly, or ``None``."""
        return None if self.problem is None else _message(self.problem, name, rank)


def _placement_kind(placement: object) -> str:
    if isinstance(placement, (Shard, StridedShard)):
        return "shard"
    if isinstance(placement, Replicate):
        return "replicate"
    if isinstance(placement, Partial):
        return "partial"
    return "unknown"


def _dim_label(mesh: DeviceMesh, dim: int) -> str:
    names = mesh.mesh_dim_names
    return f"'{names[dim]}'" if names else str(dim)


def mesh_ranks(mesh: DeviceMesh, cache: dict[int, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """The global ranks of the mesh instance this rank belongs to, in row-major mesh order."""
    if cache is not None and id(mesh) in cache:
        return cache[id(mesh)]
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if cache is not None:
        cache[id(mesh)] = ranks
    return ranks


def dim0_padding(tensor: torch.Tensor) -> int:
    """How many elements of padding follow this rank's local piece of ``tensor`` when its dim 0 is
    split into equal padded chunks, as FSDP2 lays out the sharded gradients of a unit in one buffer.

    Non-zero only for a DTensor whose dim 0 is split by a single plain ``Shard(0)`` (other mesh dims
    ``Replicate`` or sharding other dims) and whose local chunk is short but not empty:
    ``(ceil(D / W) - rows) * row_numel`` for global dim-0 size ``D`` over ``W`` ranks.
    """
    return dim0_paddings([tensor])[0]


def dim0_paddings(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """:func:`dim0_padding` of every tensor, worked out once per DTensor spec and local shape."""
    paddings: dict[tuple, int] = {}

    def padding(tensor: torch.Tensor, local: torch.Tensor) -> int:
        if not isinstance(tensor, DTensor):
            return 0
        spec = dtensor_spec(tensor)
        key = (id(spec), local.shape)  # the spec is alive as long as the tensor: its id is not reused meanwhile
        if key not in paddings:
            paddings[key] = _dim0_padding(spec, local.shape)
        return paddings[key]

    return tuple(map(padding, tensors, local_tensors(tensors)))


def _dim0_padding(spec: Any, local_shape: torch.Size) -> int:
    placements = spec.placements
    on_dim0 = [d for d, p in enumerate(placements) if isinstance(p, (Shard, StridedShard)) and p.dim == 0]
    if len(on_dim0) != 1 or type(placements[on_dim0[0]]) is not Shard:
        return 0
    rows = local_shape[0] if local_shape else 0
    padded_rows = -(-spec.shape[0] // spec.mesh.size(on_dim0[0]))
    return (padded_rows - rows) * (local_shape.numel() // rows) if 0 < rows < padded_rows else 0


@dataclass(frozen=True)
class _Sharding:
    """What :func:`describe` derives from a (mesh, placements) pair, the same for all its tensors."""

    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    mesh_ranks: tuple[int, ...]
    counted: bool
    replicated_everywhere: bool
    problem: tuple[str, str, str] | None  # (kind, placement, mesh dim) that cannot be counted, or not in the mesh


def _sharding(mesh: DeviceMesh, placements: tuple, rank: int) -> _Sharding:
    kinds = [_placement_kind(p) for p in placements]
    coordinate = mesh.get_coordinate()
    problem = next(
        ((k, str(p), _dim_label(mesh, d)) for d, (k, p) in enumerate(zip(kinds, placements)) if k in ("partial", "unknown")),
        None if coordinate is not None else ("outside", "", ""),
    )
    return _Sharding(
        placements=tuple(str(p) for p in placements),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=mesh.mesh_dim_names,
        mesh_ranks=mesh_ranks(mesh) if coordinate is not None else (rank,),
        counted=coordinate is not None and all(c == 0 for c, k in zip(coordinate, kinds) if k == "replicate"),
        replicated_everywhere=all(k == "replicate" for k in kinds),
        problem=problem,
    )


def _message(problem: tuple[str, str, str], name: str, rank: int) -> str:
    kind, placement, dim = problem
    if kind == "partial":
        return (
            f"gradient of {name} is Partial on mesh dim {dim} ({placement}): its local values are unreduced "
            "pieces of a sum, and the norm of the pieces is not the norm of the sum. Reduce it first, e.g. "
            "grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])."
        )
    if kind == "unknown":
        return (
            f"gradient of {name} has placement {placement} on mesh dim {dim}, which lightning_ndclip does not "
            "know how to count."
        )
    return f"this rank ({rank}) is not part of the device mesh of {name}."


def describe(tensors: Sequence[torch.Tensor], rank: int) -> list[TensorLayout]:
    """Describe how this rank holds each of ``tensors`` (gradients, or parameters standing for them).

    Worked out once per DTensor spec and dtype (FSDP2 and tensor parallelism share one spec among
    the parameters of a shape), and for plain tensors once per shape and dtype; the tensors of one
    kind share one :class:`TensorLayout`.
    """
    # by (spec id, dtype): the specs live as long as the tensors, and a DTensor's dtype is its local tensor's,
    # which a spec shared by several DTensors need not record; plain tensors by (shape, dtype)
    layouts: dict[tuple, TensorLayout] = {}
    shardings: dict[tuple, _Sharding] = {}  # by (mesh id, placements)

    def layout_of(tensor: torch.Tensor) -> TensorLayout:
        key = (id(dtensor_spec(tensor)) if isinstance(tensor, DTensor) else tensor.shape, tensor.dtype)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _describe(tensor, rank, shardings)
        return layout

    return list(map(layout_of, tensors))


def _describe(tensor: torch.Tensor, rank: int, shardings: dict[tuple, _Sharding]) -> TensorLayout:
    if not isinstance(tensor, DTensor):
        return TensorLayout(("plain", tuple(tensor.shape), str(tensor.dtype)), (rank,), True, True)
    spec = dtensor_spec(tensor)
    key = (id(spec.mesh), spec.placements)
    if key not in shardings:
        shardings[key] = _sharding(spec.mesh, spec.placements, rank)
    sharding = shardings[key]
    signature = (
        "dtensor",
        tuple(tensor.shape),
        str(tensor.dtype),
        sharding.placements,
        sharding.mesh_shape,
        sharding.mesh_dim_names,
    )
    return TensorLayout(
        signature=signature,
        mesh_ranks=sharding.mesh_ranks,
        counted_in_mesh=sharding.counted,
        replicated_everywhere=sharding.replicated_everywhere,
        problem=sharding.problem,
    )
