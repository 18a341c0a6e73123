"""The world-wide counting plan: which rank counts which gradient, agreed by every rank.

The exact global norm treats the gradients of one logical model as one flat vector. The plan makes
every logical element count **exactly once worldwide**, so that a single all-reduce of the local
sums (a max for the inf norm) yields the exact total:

* inside a mesh instance, ``Shard`` / ``_StridedShard`` dims are disjoint pieces (all count) and
  ``Replicate`` dims are copies (only coordinate 0 counts): :func:`describe`, which needs no other rank;
* ranks of a stage outside a tensor's mesh instance hold copies of it (a dense layer's FSDP mesh
  seen from another tp coordinate; a plain tensor): only the instance of the stage's lowest rank counts;
* pipeline stages hold disjoint parameters, each counts its own; a tie across stages counts in the
  lowest stage holding it.

Building a plan costs one ``all_gather_object`` (two with several stages or disagreeing ranks), in
which ranks check that they agree; any problem is raised on **every** rank with the same message,
so no rank is left waiting in a later collective.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_ndclip._compat import StridedShard, dtensor_spec, root_mesh
from lightning_ndclip.core.parallel.mesh import mesh_ranks

PP_DIM_NAME = "pp"
"""Mesh dim name taken to be the pipeline dim when no ``pp_mesh`` is given."""


class NormPlanError(ValueError):
    """The ranks' gradient layouts cannot be normed exactly; raised identically on every rank."""


@dataclass(frozen=True)
class TensorLayout:
    """How one rank holds a logical gradient tensor; one object is shared by every tensor of the same
    kind (the same DTensor spec and dtype, or the same shape and dtype for plain tensors).

    """

    signature: tuple  # the stage-wide logical description, equal on every rank of a pipeline stage
    mesh_ranks: tuple[int, ...]  # global ranks of the mesh instance holding it; ``(rank,)`` if plain
    counted_in_mesh: bool  # this rank is the one member of its replica set in the mesh instance
    replicated_everywhere: bool  # every mesh dim is Replicate (or the tensor is plain)
    problem: tuple[str, str, str] | None = None  # (kind, placement, mesh dim) if it cannot be normed


def _placement_kind(placement: object) -> str:
    if isinstance(placement, (Shard, StridedShard)):
        return "shard"
    if isinstance(placement, Replicate):
        return "replicate"
    return "partial" if isinstance(placement, Partial) else "unknown"


def _in_mesh(mesh: DeviceMesh, placements: tuple, rank: int) -> TensorLayout:
    """How this rank holds any tensor of ``placements`` on ``mesh``; its signature holds the placements
    and the mesh's shape and dim names."""
    kinds = [_placement_kind(p) for p in placements]
    coordinate = mesh.get_coordinate()
    names = mesh.mesh_dim_names
    bad = [d for d, k in enumerate(kinds) if k in ("partial", "unknown")]
    problem = (kinds[bad[0]], str(placements[bad[0]]), repr(names[bad[0]]) if names else str(bad[0])) if bad else None
    if problem is None and coordinate is None:
        problem = ("outside", "", "")
    return TensorLayout(
        signature=(tuple(str(p) for p in placements), tuple(mesh.shape), names),
        mesh_ranks=mesh_ranks(mesh) if coordinate is not None else (rank,),
        counted_in_mesh=coordinate is not None and all(c == 0 for c, k in zip(coordinate, kinds) if k == "replicate"),
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
            f"gradient of {name} has placement {placement} on mesh dim {dim}, "
            "which lightning_ndclip does not know how to count."
        )
    return f"this rank ({rank}) is not part of the device mesh of {name}."


def describe(tensors: Sequence[torch.Tensor], rank: int) -> list[TensorLayout]:
    """Describe how this rank holds each of ``tensors`` (gradients, or parameters standing for them).

    Worked out once per DTensor spec and dtype (tensors may share a spec but not their dtype) and,
    for plain tensors, once per shape and dtype; the mesh part once per (mesh, placements).
    """
    layouts: dict[tuple, TensorLayout] = {}
    in_mesh: dict[tuple, TensorLayout] = {}
    found = []
    for tensor in tensors:
        spec = dtensor_spec(tensor) if isinstance(tensor, DTensor) else None
        key = (spec or tensor.shape, tensor.dtype)
        if key not in layouts:
            logical = (tuple(tensor.shape), str(tensor.dtype))
            if spec is None:
                layouts[key] = TensorLayout(("plain", *logical), (rank,), True, True)
            else:
                mesh_key = (spec.mesh, spec.placements)
                if mesh_key not in in_mesh:
                    in_mesh[mesh_key] = _in_mesh(spec.mesh, spec.placements, rank)
                layouts[key] = replace(in_mesh[mesh_key], signature=("dtensor", *logical, *in_mesh[mesh_key].signature))
        found.append(layouts[key])
    return found


@dataclass(frozen=True)
class NormPlan:
    """What this rank contributes to the global norm, agreed with every other rank. ``fingerprint``,
    hashed from every rank's view, lets a later call check that all ranks still use the same plan; it
    is at most ``2**52 / world_size``, so that its sum over the ranks is exact in float64."""

    counted: tuple[bool, ...]  # per tensor: this rank adds its local piece to the global sum
    slots: Sequence[int]  # per tensor: its index in the world-wide per-tensor norms
    slot_names: tuple[str, ...]  # world-wide (all stages), in slot order
    needs_collective: bool  # False: every rank holds every element, the local norm is the global one
    group: dist.ProcessGroup | None
    accumulate_dtype: torch.dtype  # float64 if any rank holds a float64 tensor, else float32
    fingerprint: int


def pipeline_stage(tensors: Sequence[torch.Tensor], pp_mesh: DeviceMesh | None) -> int:
    """This rank's pipeline coordinate: from ``pp_mesh``, else from a ``"pp"`` dim of the root mesh
    of any DTensor in ``tensors``, else 0."""
    if pp_mesh is not None:
        if pp_mesh.ndim != 1:
            raise ValueError(f"pp_mesh must be a 1-D DeviceMesh, got {pp_mesh.ndim} dims")
        return pp_mesh.get_local_rank()
    seen: set[int] = set()
    for t in tensors:
        if isinstance(t, DTensor) and id(mesh := dtensor_spec(t).mesh) not in seen:
            seen.add(id(mesh))
            root = root_mesh(mesh)
            if root.mesh_dim_names and PP_DIM_NAME in root.mesh_dim_names:
                return root.get_local_rank(PP_DIM_NAME)
    return 0


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size(group)


def _digest(*parts: object, size: int = 16) -> bytes:
    """A hash of ``parts`` (pickling is several times faster than ``repr`` on ten thousand signatures)."""
    return hashlib.blake2b(pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL), digest_size=size).digest()


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _stage_problem(v: dict, lead: dict) -> str | None:
    """How rank ``v`` differs from the lowest rank of its pipeline stage, ``lead``, if it does."""
    where = f"of pipeline stage {v['stage']}"
    mine, theirs = v["signatures"], lead["signatures"]
    if len(mine) != len(theirs):
        return (
            f"rank {v['rank']} holds {len(mine)} gradient tensors but rank {lead['rank']} of the same "
            f"pipeline stage {v['stage']} holds {len(theirs)}"
        )
    if mine != theirs:
        i = _first_difference(mine, theirs)
        return (
            f"tensor #{i} ({v['names'][i]}) differs between rank {lead['rank']} {theirs[i]} "
            f"and rank {v['rank']} {mine[i]} {where}"
        )
    if v["tie_keys"] != lead["tie_keys"]:
        i = _first_difference(v["tie_keys"], lead["tie_keys"])
        return (
            f"tensor #{i} ({v['names'][i]}) is tied as {lead['tie_keys'][i]!r} on rank {lead['rank']} but as "
            f"{v['tie_keys'][i]!r} on rank {v['rank']} {where}"
        )
    if v["names"] != lead["names"]:  # same layouts in another order: norms would be matched by position
        i = _first_difference(v["names"], lead["names"])
        return (
            f"tensor #{i} is {lead['names'][i]!r} on rank {lead['rank']} but {v['names'][i]!r} on rank {v['rank']} "
            f"{where}: pass the tensors in the same order, with the same names, on every rank"
        )
    return None


def _mesh_problem(v: dict, ranks: tuple[int, ...], by_rank: dict[int, dict]) -> str | None:
    """What is wrong with a mesh over ``ranks`` that rank ``v`` holds a tensor on, if anything."""
    for q in ranks:
        other = by_rank.get(q)
        if other is None:
            return f"rank {v['rank']} has a mesh over ranks {list(ranks)}, but rank {q} is not in the norm's process group"
        if other["stage"] != v["stage"]:
            return (
                f"a mesh over ranks {list(ranks)} spans pipeline stages {v['stage']} (rank {v['rank']}) and "
                f"{other['stage']} (rank {q}); a parameter's mesh must lie within one stage"
            )
        if ranks not in other["mesh_ranks"]:
            return f"rank {v['rank']} holds a tensor on a mesh over ranks {list(ranks)} but rank {q} holds no tensor on that mesh"
    return None


def _check_agreement(views: list[dict]) -> list[str]:
    """Problems in the gathered per-rank views, as messages naming ranks and tensors."""
    problems = [f"rank {v['rank']}: {e}" for v in views for e in v["errors"]]
    if problems:
        return problems
    leaders: dict[int, dict] = {}
    for v in views:
        problem = _stage_problem(v, leaders.setdefault(v["stage"], v))
        problems += [problem] if problem else []
    by_rank = {v["rank"]: v for v in views}
    for v in views:
        for ranks in set(v["mesh_ranks"]):
            problem = _mesh_problem(v, ranks, by_rank)
            if problem:
                return [*problems, problem]
    return problems


def _gather_views(view: dict, world_size: int, group: dist.ProcessGroup | None) -> list[dict]:
    """Every rank's view. Every rank sends a summary first, of a size that does not grow with the
    tensors (a hash of their names, signatures and tie keys); when all ranks are in one stage with
    no error and equal hashes, that suffices. Otherwise every rank sends its whole view (a second
    exchange, decided alike by every rank from the same summaries)."""
    per_tensor = ("names", "signatures", "tie_keys")
    summary = {k: view[k] for k in ("rank", "stage", "errors", "float64", "digest")}
    summary.update(mesh_ranks=set(view["mesh_ranks"]), logical=_digest(*(view[k] for k in per_tensor)))
    summaries: list[dict] = [{}] * world_size
    dist.all_gather_object(summaries, summary, group=group)
    if len({(s["stage"], s["logical"]) for s in summaries}) == 1 and not any(s["errors"] for s in summaries):
        return [{**s, **{k: view[k] for k in per_tensor}} for s in summaries]
    views: list[dict] = [{}] * world_size
    dist.all_gather_object(views, view, group=group)
    return views


def _agreed_views(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    tie_keys: Sequence[str | None],
    layouts: list[TensorLayout],
    rank: int,
    stage: int,
    group: dist.ProcessGroup | None,
) -> list[dict]:
    """Every rank's view of the tensors (exchanged), once every rank has checked that they agree."""
    view: dict[str, Any] = {
        "rank": rank,
        "stage": stage,
        "names": list(names),
        "signatures": [lay.signature for lay in layouts],
        "tie_keys": list(tie_keys),
        "mesh_ranks": [lay.mesh_ranks for lay in layouts],
        "errors": [_message(lay.problem, name, rank) for lay, name in zip(layouts, names) if lay.problem],
        "float64": torch.float64 in set(map(operator.attrgetter("dtype"), tensors)),
    }
    view["digest"] = _digest(view)
    world_size = _world(group)[1]
    views = [view] if world_size == 1 else _gather_views(view, world_size, group)
    problems = _check_agreement(views)
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise NormPlanError("cannot compute an exact global gradient norm:\n  " + "\n  ".join(problems[:8]) + more)
    return views


def _slots(stages: list[int], leaders: dict[int, dict]) -> tuple[dict[int, Sequence[int]], list[str], dict[str, int]]:
    """Per stage, the world-wide slot of each of its tensors; the slots' names; and the stage that counts
    each tied key (the lowest holding it, where the key takes its one slot)."""
    first_stage_of_key: dict[str, int] = {}
    slot_of_key: dict[str, int] = {}
    slots_of_stage: dict[int, Sequence[int]] = {}
    slot_names: list[str] = []
    for s in stages:
        keys, stage_names = leaders[s]["tie_keys"], leaders[s]["names"]
        if all(key is None for key in keys):  # nothing tied: the stage's tensors take the next slots in order
            slots_of_stage[s] = range(len(slot_names), len(slot_names) + len(keys))
            slot_names.extend(stage_names)
            continue
        slots: list[int] = []
        for key, name in zip(keys, stage_names):
            if key is None or key not in slot_of_key:
                if key is not None:
                    first_stage_of_key[key], slot_of_key[key] = s, len(slot_names)
                slots.append(len(slot_names))
                slot_names.append(name)
            else:
                slots.append(slot_of_key[key])
        slots_of_stage[s] = slots
    return slots_of_stage, slot_names, first_stage_of_key


def build_plan(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    tie_keys: Sequence[str | None],
    *,
    pp_mesh: DeviceMesh | None = None,
    group: dist.ProcessGroup | None = None,
) -> NormPlan:
    """Analyse ``tensors`` on every rank of ``group`` and agree on who counts what (collective).

    Args:
        tensors: the gradients (or the parameters standing for them), in a fixed order.
        names: a name per tensor, for messages and per-tensor norms.
        tie_keys: per tensor, ``None`` or a key shared by the copies of one parameter held by several
            pipeline stages (its gradient already summed over them): counted once, in the lowest stage.
        pp_mesh: the pipeline mesh dim; inferred as in :func:`pipeline_stage` when ``None``.
        group: the process group spanning every rank that holds part of the model (default: world).

    Raises:
        NormPlanError: on every rank, when any rank found a layout it cannot count exactly or when
            ranks disagree.
    """
    rank = _world(group)[0]
    stage = pipeline_stage(tensors, pp_mesh)
    layouts = describe(tensors, rank)
    views = _agreed_views(tensors, names, tie_keys, layouts, rank, stage, group)
    stages = sorted({v["stage"] for v in views})
    leaders = {s: min((v for v in views if v["stage"] == s), key=operator.itemgetter("rank")) for s in stages}
    slots, slot_names, first_stage_of_key = _slots(stages, leaders)
    kinds = {id(lay): lay for lay in layouts}.values()  # the distinct layouts, by object (call-local)
    needs_collective = len(views) > 1 and (len(stages) > 1 or not all(lay.replicated_everywhere for lay in kinds))
    counted = (True,) * len(layouts)
    if needs_collective:
        counts = {id(lay): lay.counted_in_mesh and leaders[stage]["rank"] in lay.mesh_ranks for lay in kinds}
        counted = tuple(
            counts[id(lay)] and (key is None or first_stage_of_key[key] == stage) for lay, key in zip(layouts, tie_keys)
        )
    digest = hashlib.blake2b(b"".join(v["digest"] for v in views), digest_size=8).digest()
    return NormPlan(
        counted=counted,
        slots=slots[stage],
        slot_names=tuple(slot_names),
        needs_collective=needs_collective,
        group=group,
        accumulate_dtype=torch.float64 if any(v["float64"] for v in views) else torch.float32,
        fingerprint=int.from_bytes(digest, "little") % (1 << (52 - len(views).bit_length())) + 1,
    )
