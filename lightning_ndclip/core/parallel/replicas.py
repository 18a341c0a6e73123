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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_ndclip._compat import StridedShard, local_tensors

__all__ = ["broadcast_replicas_", "check_peers_fed_alike", "check_replica_gradients"]


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


def _replicated_over_tp(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds the same values of ``param`` (not a ``Shard`` or
    ``_StridedShard``, which is no ``Shard``, over ``tp``)."""
    if not isinstance(param, DTensor):
        return True
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" not in names or not isinstance(param.placements[names.index("tp")], (Shard, StridedShard))


def check_replica_gradients(module: nn.Module, tp_mesh: DeviceMesh, rtol: float = 1e-5) -> None:
    """Raise ``ValueError`` on every rank if a parameter that the tensor-parallel ranks hold as copies
    has a different gradient on some of them: its copies would drift apart, silently.

    That happens when a plan leaves a module whole (replicated over ``tp``) while its input is split
    over ``tp``: each rank's gradient is a partial sum (e.g. Qwen3's ``q_norm`` / ``k_norm`` on split
    heads, under a ``transformers`` plan without ``replicated_with_grad_allreduce``). Compares a
    float64 sum and sum of squares of each such gradient over ``tp`` (one all-reduce), then agrees on
    the verdict over the world (one more; an ``all_gather_object`` only on failure). Call it on every
    rank, after backward, once (e.g. at the first optimizer step); gradients left ``None`` count as zero.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad and _replicated_over_tp(p)]
    if tp_mesh.size() == 1 or not named:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
    local = local_tensors(grads)
    sums = torch.stack([torch.stack([g.double().sum(), g.double().square().sum()]) for g in local])
    extremes = torch.cat([sums, -sums])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    high, low = extremes[: len(sums)], -extremes[len(sums) :]
    scale = torch.maximum(high.abs(), low.abs()).clamp(min=1e-30)
    differ = ((high - low) > rtol * scale).any(dim=1)
    mine = [name for (name, _), bad in zip(named, differ.tolist()) if bad]
    flag = torch.tensor([len(mine)], dtype=torch.int64, device=sums.device)
    dist.all_reduce(flag)
    if not int(flag):
        return
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    names = sorted({name for found in gathered if found for name in found})
    raise ValueError(
        f"the gradients of {names[:6]}{' ...' if len(names) > 6 else ''} differ between tensor-parallel ranks that "
        "hold them as copies: each rank's is a partial sum, and the copies would drift apart. A module the tp plan "
        "leaves whole is fed tp-split activations (e.g. Qwen3 / Gemma3 q_norm / k_norm under a transformers plan "
        "without 'replicated_with_grad_allreduce'); give it a style that sums its gradient over tp, e.g. "
        "SequenceParallel(sequence_dim=<the split dim>, use_local_output=True). Or randomness differs between the tp "
        "ranks (dropout drawn from unequal seeds): seed every rank alike (lightning.seed_everything)"
    )


def _tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors in ``batch`` (nested mappings, lists and tuples), in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for key in sorted(batch, key=str) for t in _tensors_of(batch[key])]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for item in batch for t in _tensors_of(item)]
    return []


def _digest(batch: Any) -> list[tuple]:
    """Per tensor of ``batch``: its shape, dtype, and float64 sum and position-weighted sum, exactly (equal batches
    give equal digests, NaNs included; a reordering or another draw almost surely another)."""
    digest = []
    for t in _tensors_of(batch):
        flat = t.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        sums = (float(flat.sum()), float((flat * weights).sum()))
        digest.append((tuple(t.shape), str(t.dtype), *(x.hex() for x in sums)))  # hex: a NaN equals a NaN
    return digest


def check_peers_fed_alike(batch: Any, world: DeviceMesh, dims: Sequence[str] = ("pp", "cp", "tp")) -> None:
    """Raise ``ValueError`` on every rank if ranks that must train on the same batch (the peers along each of
    ``dims`` of the ``world`` mesh: tensor-parallel ranks compute one layer together, context-parallel ranks cut one
    sequence, pipeline stages pass one micro-batch on) received different ones, naming the dim and the ranks.

    Peers fed differently train on a mix of batches no one device would see, and the first sign of it would come
    later and blame something else (the tp copies' gradients differ, as a plan that leaves a module whole on split
    activations makes them). Collective over the world (one ``all_gather_object`` of a small digest per rank); call
    it on every rank with its batch, once, at the first step: it reads the batch on the host."""
    names = list(world.mesh_dim_names or ())
    peered = [d for d in dims if d in names and world.mesh.shape[names.index(d)] > 1]
    if not peered:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _digest(batch))
    for dim in peered:
        axis = names.index(dim)
        for peers in world.mesh.movedim(axis, -1).reshape(-1, world.mesh.shape[axis]).tolist():
            apart = [rank for rank in peers if everyone[rank] != everyone[peers[0]]]
            if apart:
                raise ValueError(
                    f"ranks {peers} are {dim} peers and must train on the same batch, and at the first step rank "
                    f"{apart[0]} received another batch than rank {peers[0]}: build the dataset alike on every rank "
                    "(seed it, e.g. lightning.seed_everything(0) before making it, or make it in the LightningModule's "
                    "setup from a seed) and let the strategy's sampler give the data ranks their parts"
                )
