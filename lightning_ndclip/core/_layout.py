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

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_ndclip._compat import StridedShard, dtensor_spec, local_tensors


@dataclass(frozen=True)
class TensorLayout:
    """How one rank holds one logical gradient tensor.

    Attributes:
        name: the name used in messages (a parameter name, or ``tensor[i]``).
        signature: the stage-wide logical description, equal on every rank of a pipeline stage.
        mesh_ranks: global ranks of the mesh instance holding the tensor, ``(rank,)`` for a plain one.
        counted_in_mesh: this rank is the one member of its replica set inside the mesh instance.
        replicated_everywhere: every mesh dim is ``Replicate`` (or the tensor is plain): every rank
            of the instance holds the whole tensor.
        error: why the tensor cannot be normed exactly, or ``None``.
    """

    name: str
    signature: tuple
    mesh_ranks: tuple[int, ...]
    counted_in_mesh: bool
    replicated_everywhere: bool
    error: str | None = None


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
    """:func:`dim0_padding` of every tensor (what depends on the placements worked out once per
    mesh and placements)."""
    ranks_of_dim0: dict[tuple, int] = {}  # (mesh id, placements) -> ranks splitting dim 0, or 0: no padding
    paddings = []
    for tensor, local in zip(tensors, local_tensors(tensors)):
        if not isinstance(tensor, DTensor):
            paddings.append(0)
            continue
        spec = dtensor_spec(tensor)
        key = (id(spec.mesh), spec.placements)
        if key not in ranks_of_dim0:
            on_dim0 = [d for d, p in enumerate(spec.placements) if isinstance(p, (Shard, StridedShard)) and p.dim == 0]
            plain = len(on_dim0) == 1 and type(spec.placements[on_dim0[0]]) is Shard
            ranks_of_dim0[key] = spec.mesh.size(on_dim0[0]) if plain else 0
        rows = local.shape[0] if local.dim() else 0
        padded_rows = -(-spec.shape[0] // ranks_of_dim0[key]) if ranks_of_dim0[key] else 0
        paddings.append((padded_rows - rows) * (local.numel() // rows) if 0 < rows < padded_rows else 0)
    return tuple(paddings)


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


def describe(tensor: torch.Tensor, name: str, rank: int, cache: dict[tuple, _Sharding] | None = None) -> TensorLayout:
    """Describe how this rank holds ``tensor`` (a gradient, or a parameter standing for it).

    ``cache`` memoizes what depends only on the mesh and the placements across the tensors of one
    analysis (keyed by the mesh's ``id``: the meshes must stay alive while it is in use).
    """
    if not isinstance(tensor, DTensor):
        signature: tuple = ("plain", tuple(tensor.shape), str(tensor.dtype))
        return TensorLayout(name, signature, (rank,), True, True)

    spec = dtensor_spec(tensor)
    key = (id(spec.mesh), spec.placements)
    sharding = None if cache is None else cache.get(key)
    if sharding is None:
        sharding = _sharding(spec.mesh, spec.placements, rank)
        if cache is not None:
            cache[key] = sharding
    signature = (
        "dtensor",
        tuple(tensor.shape),
        str(tensor.dtype),
        sharding.placements,
        sharding.mesh_shape,
        sharding.mesh_dim_names,
    )
    return TensorLayout(
        name=name,
        signature=signature,
        mesh_ranks=sharding.mesh_ranks,
        counted_in_mesh=sharding.counted,
        replicated_everywhere=sharding.replicated_everywhere,
        error=None if sharding.problem is None else _message(sharding.problem, name, rank),
    )
