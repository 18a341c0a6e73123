"""Equal replicas from the first step: every copy of a parameter or buffer takes the value held at
mesh coordinate 0.

Data-parallel replicas must start equal, or they train different models while their gradients are
averaged, and a global norm counted on one replica describes none of the others. DDP broadcasts
module states from rank 0 when it wraps a model; ``fully_shard`` does not: each rank keeps its own
chunk of what its own process drew. With ``dp_replicate > 1`` (HSDP) a model built without a
common seed thus starts (and stays) different on every replica, silently. ``parallelize_module``
scatters from rank 0 of the ``tp`` dim, and parameters that ``fully_shard`` cuts along a ``Shard``
dim are disjoint pieces, not copies: only ``Replicate`` mesh dims carry copies to make equal (and
plain tensors, when the caller says over which ranks they are copies).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_ndclip._compat import local_tensors

__all__ = ["broadcast_replicas_"]


def _source(mesh: DeviceMesh, dim: int) -> int:
    """The global rank at coordinate 0 of mesh dim ``dim``, the other coordinates being this rank's."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # only called for meshes this rank belongs to
    index = list(coordinate)
    index[dim] = 0
    return int(mesh.mesh[tuple(index)])


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` (one dtype, one device) from global rank ``src`` in one collective."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_replicas_(
    tensors: nn.Module | Iterable[torch.Tensor], plain_mesh: DeviceMesh | None = None
) -> int:
    """Make every replica of ``tensors`` equal to its copy at mesh coordinate 0, in place.

    A DTensor is broadcast along each of its ``Replicate`` mesh dims from coordinate 0 (its local
    tensor; its ``Shard`` dims are left alone). A plain tensor is broadcast along every dim of
    ``plain_mesh`` when one is given (the ranks holding the same plain copy), and left alone
    otherwise: a plain tensor may hold rank-specific values by design (a context-parallel rank's
    positions, experts kept as local tensors). Collective: every rank holding the tensors calls it
    with the same tensors in the same order.

    Args:
        tensors: a module (its parameters and buffers), or tensors.
        plain_mesh: the mesh over which plain tensors are replicated, if they are.

    Returns:
        The number of broadcasts issued: one per (group of ranks, dtype, device).
    """
    tensors = [*tensors.parameters(), *tensors.buffers()] if isinstance(tensors, nn.Module) else list(tensors)
    buckets: dict[tuple, tuple[int, dist.ProcessGroup, list[torch.Tensor]]] = {}

    def add(local: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        src, group = _source(mesh, dim), mesh.get_group(dim)
        # by members, not identity: equal groups may be distinct objects, and every rank must
        # bucket alike
        key = (tuple(dist.get_process_group_ranks(group)), src, local.dtype, local.device)
        buckets.setdefault(key, (src, group, []))[2].append(local)

    for t, local in zip(tensors, local_tensors(tensors)):
        if local.numel() == 0 or local.is_meta:  # nothing to copy (meta: not materialized yet)
            continue
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            for dim, placement in enumerate(t.placements):
                if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                    add(local, mesh, dim)
        elif plain_mesh is not None:
            for dim in range(plain_mesh.ndim):
                if plain_mesh.size(dim) > 1:
                    add(t, plain_mesh, dim)
    for src, group, members in buckets.values():
        _broadcast_coalesced(members, src, group)
    return len(buckets)
