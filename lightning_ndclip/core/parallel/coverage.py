"""Every trainable parameter's gradient must be summed over all of its data-parallel ranks.

A parameter whose reduction covers only part of them trains silently wrong: e.g. ``fully_shard``
over ``meshes["dp_shard_cp"]`` while ``dp_replicate > 1`` makes one FSDP group per replica, whose
copies drift apart; a parameter outside every ``fully_shard`` unit is never reduced at all. The
check runs once, after the model is parallelized, and costs no collective per step.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_ndclip.core.parallel.mesh import ParallelMeshes, mesh_ranks

__all__ = ["check_data_parallel_reduction"]

DATA_DIMS = ("dp_replicate", "dp_shard", "cp")


def check_data_parallel_reduction(module: nn.Module, meshes: ParallelMeshes, *, unreduced: str = "raise") -> None:
    """Raise ``ValueError`` on every rank if some trainable parameter of ``module`` is reduced over
    fewer than all of its data ranks (``dp_replicate x dp_shard x cp`` of its pipeline stage and
    tensor-parallel coordinate; expert parameters count their ``ep`` ranks as covered by their
    ``Shard``), naming the rank, the parameter and the missing dims.

    A parameter's reduction is that of the ``fully_shard`` unit holding it (the ranks of its DTensor
    mesh) or of the ``DistributedDataParallel`` wrapping it (its process group's ranks). A parameter
    that nothing reduces raises too, or with ``unreduced="warn"`` gives a warning on rank 0 (the
    permissive mode Lightning's ``ModelParallelStrategy`` users may rely on). Collective (one
    ``all_gather_object``) unless every data dim has size 1.
    """
    dims = {name: set(mesh_ranks(meshes[name])) for name in DATA_DIMS if meshes[name].size() > 1}
    if not dims:
        return
    try:
        problem = _first_problem(module, dims)
    except Exception as error:  # every rank must reach the gather below, or the others would wait there
        problem = ("partial", f"checking the data-parallel reduction raised {type(error).__name__}: {error}")
    problems: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [(rank, kind, text) for rank, p in enumerate(problems) if p is not None for kind, text in [p]]
    for rank, kind, text in found:
        if kind == "partial" or unreduced == "raise":
            raise ValueError(f"rank {rank}: {text}")
    if found and dist.get_rank() == 0:
        rank, _, text = found[0]
        warnings.warn(f"rank {rank}: {text}", UserWarning, stacklevel=2)


def _first_problem(module: nn.Module, dims: dict[str, set[int]]) -> tuple[str, str] | None:
    """``("partial" | "unreduced", message)`` for the first parameter whose reduction misses a data dim."""
    reduced_over = _reduction_ranks(module)
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        ranks = reduced_over.get(param)
        if ranks is None:
            return "unreduced", (
                f"parameter {name!r} is in no fully_shard unit (nor DistributedDataParallel), so its gradient is "
                f"never summed over the data dims {sorted(dims)} and its replicas drift apart; make it part of a "
                "fully_shard unit"
            )
        missing = [dim for dim, members in dims.items() if not members <= ranks]
        if missing:
            return "partial", (
                f"parameter {name!r} has its gradient summed over ranks {sorted(ranks)} only, missing the data "
                f"dims {missing}: its replicas along them drift apart. fully_shard it over "
                "NDParallelStrategy.meshes['fsdp'] (2-D, replicate x shard, when dp_replicate > 1)"
            )
    return None


def _reduction_ranks(module: nn.Module) -> dict[nn.Parameter, set[int]]:
    """``{parameter: ranks its gradient is summed over}`` for the parameters an FSDP2 unit or DDP
    reduces. A unit reduces the parameters of its subtree that no nested unit holds."""
    found: dict[nn.Parameter, set[int]] = {}
    ranks_of_mesh: dict[DeviceMesh, tuple[int, ...]] = {}  # many parameters share a mesh: read each once

    def visit(m: nn.Module, owner: set[int] | None, fsdp: bool) -> None:
        if isinstance(m, nn.parallel.DistributedDataParallel):
            owner, fsdp = set(dist.get_process_group_ranks(m.process_group)), False
        elif isinstance(m, FSDPModule):
            owner, fsdp = set(), True
        for p in m.parameters(recurse=False):
            if fsdp and isinstance(p, DTensor):
                if p.device_mesh not in ranks_of_mesh:
                    ranks_of_mesh[p.device_mesh] = mesh_ranks(p.device_mesh)
                found[p] = set(ranks_of_mesh[p.device_mesh])
            elif owner is not None and not fsdp:
                found[p] = owner
        for child in m.children():
            visit(child, owner, fsdp)

    visit(module, None, False)
    return found
