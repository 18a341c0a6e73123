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
    if not isinstance(tensor, DTensor):
        return 0
    spec = dtensor_spec(tensor)
    on_dim0 = [d for d, p in enumerate(spec.placements) if isinstance(p, (Shard, StridedShard)) and p.dim == 0]
    if len(on_dim0) != 1 or type(spec.placements[on_dim0[0]]) is not Shard:
        return 0
    local = local_tensors([tensor])[0]
    rows = local.shape[0] if local.dim() else 0
    padded_rows = -(-spec.shape[0] // spec.mesh.size(on_dim0[0]))
    if rows == 0 or rows >= padded_rows:
        return 0
    return (padded_rows - rows) * (local.numel() // rows)


def describe(
    tensor: torch.Tensor, name: str, rank: int, mesh_cache: dict[int, tuple[int, ...]] | None = None
) -> TensorLayout:
    """Describe how this rank holds ``tensor`` (a gradient, or a parameter standing for it).

    ``mesh_cache`` memoizes :func:`mesh_ranks` across the tensors of one analysis; the meshes it
    is keyed on must stay alive while it is in use.
    """
    if not isinstance(tensor, DTensor):
        signature: tuple = ("plain", tuple(tensor.shape), str(tensor.dtype))
        return TensorLayout(name, signature, (rank,), True, True)

    spec = dtensor_spec(tensor)
    mesh = spec.mesh
    kinds = [_placement_kind(p) for p in spec.placements]
    coordinate = mesh.get_coordinate()
    signature = (
        "dtensor",
        tuple(tensor.shape),
        str(tensor.dtype),
        tuple(str(p) for p in spec.placements),
        tuple(mesh.shape),
        mesh.mesh_dim_names,
    )
    error = None
    for dim, kind in enumerate(kinds):
        if kind == "partial":
            error = (
                f"gradient of {name} is Partial on mesh dim {_dim_label(mesh, dim)} "
                f"({spec.placements[dim]}): its local values are unreduced pieces of a sum, and the "
                "norm of the pieces is not the norm of the sum. Reduce it first, e.g. "
                "grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in "
                "grad.placements])."
            )
            break
        if kind == "unknown":
            error = (
                f"gradient of {name} has placement {spec.placements[dim]} on mesh dim "
                f"{_dim_label(mesh, dim)}, which lightning_ndclip does not know how to count."
            )
            break
    if coordinate is None:
        error = error or f"this rank ({rank}) is not part of the device mesh of {name}."
        counted = False
    else:
        counted = all(c == 0 for c, k in zip(coordinate, kinds) if k == "replicate")
    return TensorLayout(
        name=name,
        signature=signature,
        mesh_ranks=mesh_ranks(mesh, mesh_cache) if coordinate is not None else (rank,),
        counted_in_mesh=counted,
        replicated_everywhere=all(k == "replicate" for k in kinds),
        error=error,
    )
