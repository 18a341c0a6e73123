"""The world-wide counting plan: which rank counts which gradient, agreed by every rank.

The exact global norm treats the gradients of one logical model as one flat vector. The plan makes
every logical element count **exactly once worldwide**, so that a single all-reduce of the local
sums (a max for the inf norm) yields the exact total:

* inside a mesh instance, ``Shard`` / ``_StridedShard`` dims are disjoint pieces (all count) and
  ``Replicate`` dims are copies (only coordinate 0 counts): :func:`describe`, which needs no other rank;
* ranks of one pipeline stage that are *not* in a tensor's mesh instance hold further copies of the
  instance (a dense layer's FSDP mesh seen from another tp or ep coordinate; a DDP-style plain
  tensor on every rank): only the instance that contains the stage's lowest rank counts;
* pipeline stages hold disjoint parameters: every stage counts its own;
* a parameter tied across stages (input and output embedding) counts only in the lowest stage
  that holds it.

Building a plan costs one ``all_gather_object`` over the group, in which ranks also check that they
agree (same tensors per stage, consistent meshes, no unsupported placement): of a summary whose size
does not grow with the number of tensors when all ranks are in one stage and agree, and of every
rank's whole view otherwise (then a second one). Any problem is raised on **every** rank with the
same message, so no rank is left waiting in a later collective.
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

_SIGNATURE = operator.attrgetter("signature")
_MESH_RANKS = operator.attrgetter("mesh_ranks")

PP_DIM_NAME = "pp"
"""Mesh dim name taken to be the pipeline dim when no ``pp_mesh`` is given."""


class NormPlanError(ValueError):
    """The ranks' gradient layouts cannot be normed exactly; raised identically on every rank."""


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


def _in_mesh(mesh: DeviceMesh, placements: tuple, rank: int) -> TensorLayout:
    """How this rank holds any tensor of ``placements`` on ``mesh``; its signature holds the placements
    and the mesh's shape and dim names."""
    kinds = [_placement_kind(p) for p in placements]
    coordinate = mesh.get_coordinate()
    problem = next(
        ((k, str(p), _dim_label(mesh, d)) for d, (k, p) in enumerate(zip(kinds, placements)) if k in ("partial", "unknown")),
        None if coordinate is not None else ("outside", "", ""),
    )
    return TensorLayout(
        signature=(tuple(str(p) for p in placements), tuple(mesh.shape), mesh.mesh_dim_names),
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
            f"gradient of {name} has placement {placement} on mesh dim {dim}, which lightning_ndclip does not "
            "know how to count."
        )
    return f"this rank ({rank}) is not part of the device mesh of {name}."


def describe(tensors: Sequence[torch.Tensor], rank: int) -> list[TensorLayout]:
    """Describe how this rank holds each of ``tensors`` (gradients, or parameters standing for them).

    Worked out once per DTensor spec and dtype (a spec shared by several DTensors need not record
    their dtype) and, for plain tensors, once per shape and dtype: the tensors of one kind share one
    :class:`TensorLayout`. The mesh part is worked out once per (mesh, placements).
    """
    layouts: dict[tuple, TensorLayout] = {}
    in_mesh: dict[tuple, TensorLayout] = {}
    found = []
    for tensor in tensors:
        key = (dtensor_spec(tensor) if isinstance(tensor, DTensor) else tensor.shape, tensor.dtype)
        if key not in layouts:
            layouts[key] = _describe(tensor, rank, in_mesh)
        found.append(layouts[key])
    return found


def _describe(tensor: torch.Tensor, rank: int, in_mesh: dict[tuple, TensorLayout]) -> TensorLayout:
    logical = (tuple(tensor.shape), str(tensor.dtype))
    if not isinstance(tensor, DTensor):
        return TensorLayout(("plain", *logical), (rank,), True, True)
    spec = dtensor_spec(tensor)
    key = (spec.mesh, spec.placements)
    if key not in in_mesh:
        in_mesh[key] = _in_mesh(spec.mesh, spec.placements, rank)
    return replace(in_mesh[key], signature=("dtensor", *logical, *in_mesh[key].signature))


@dataclass(frozen=True)
class NormPlan:
    """What this rank contributes to the global norm, agreed with every other rank.

    Attributes:
        layouts: the local description of each tensor, in call order.
        counted: per tensor, whether this rank adds its local piece to the global sum.
        slots: per tensor, its index in the world-wide per-tensor norm vector.
        slot_names: the name of every slot, world-wide (all stages), in slot order.
        needs_collective: ``False`` when every rank already holds every element (one process,
            or only replicated tensors on a single stage): the local norm is the global one.
        group: the process group of the single all-reduce.
        stage: this rank's pipeline stage (0 without pipeline parallelism).
        accumulate_dtype: the default dtype of local sums and of the result, the same on every rank:
            ``float64`` if any rank holds a ``float64`` tensor, else ``float32``.
        fingerprint: a whole number hashed from every rank's view, equal on all ranks that agreed
            on this plan, so a later call can check they still use the same one; at most
            ``2**52 / world_size``, so that its sum over the ranks is exact in float64.
    """

    layouts: tuple[TensorLayout, ...]
    counted: tuple[bool, ...]
    slots: tuple[int, ...]
    slot_names: tuple[str, ...]
    needs_collective: bool
    group: dist.ProcessGroup | None
    stage: int
    accumulate_dtype: torch.dtype
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


def _digest(view: dict) -> bytes:
    """A hash of one rank's view, made before the exchange (pickling is several times faster than
    ``repr`` on ten thousand signatures)."""
    return hashlib.blake2b(pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()


def _fingerprint(views: list[dict]) -> int:
    digest = hashlib.blake2b(b"".join(v["digest"] for v in views), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << (52 - len(views).bit_length())) + 1


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _check_agreement(views: list[dict]) -> list[str]:
    """Problems in the gathered per-rank views, as messages naming ranks and tensors."""
    problems = [f"rank {v['rank']}: {e}" for v in views for e in v["errors"]]
    if problems:
        return problems
    by_rank = {v["rank"]: v for v in views}
    leaders: dict[int, dict] = {}
    for v in views:
        lead = leaders.setdefault(v["stage"], v)
        if v is lead:
            continue
        mine, theirs = v["signatures"], lead["signatures"]
        if len(mine) != len(theirs):
            problems.append(
                f"rank {v['rank']} holds {len(mine)} gradient tensors but rank {lead['rank']} of the "
                f"same pipeline stage {v['stage']} holds {len(theirs)}"
            )
        elif mine != theirs:
            i = _first_difference(mine, theirs)
            problems.append(
                f"tensor #{i} ({v['names'][i]}) differs between rank {lead['rank']} "
                f"{theirs[i]} and rank {v['rank']} {mine[i]} of pipeline stage {v['stage']}"
            )
        elif v["tie_keys"] != lead["tie_keys"]:
            i = _first_difference(v["tie_keys"], lead["tie_keys"])
            problems.append(
                f"tensor #{i} ({v['names'][i]}) is tied as {lead['tie_keys'][i]!r} on rank {lead['rank']} but as "
                f"{v['tie_keys'][i]!r} on rank {v['rank']} of pipeline stage {v['stage']}"
            )
        elif v["names"] != lead["names"]:  # same layouts in another order: norms would be matched by position
            i = _first_difference(v["names"], lead["names"])
            problems.append(
                f"tensor #{i} is {lead['names'][i]!r} on rank {lead['rank']} but {v['names'][i]!r} on rank "
                f"{v['rank']} of pipeline stage {v['stage']}: pass the tensors in the same order, with the same "
                "names, on every rank"
            )
    for v in views:
        for ranks in set(v["mesh_ranks"]):
            for q in ranks:
                other = by_rank.get(q)
                if other is None:
                    problems.append(
                        f"rank {v['rank']} has a mesh over ranks {list(ranks)}, but rank {q} is not "
                        "in the norm's process group"
                    )
                elif other["stage"] != v["stage"]:
                    problems.append(
                        f"a mesh over ranks {list(ranks)} spans pipeline stages {v['stage']} "
                        f"(rank {v['rank']}) and {other['stage']} (rank {q}); a parameter's mesh must "
                        "lie within one stage"
                    )
                elif ranks not in other["mesh_ranks"]:
                    problems.append(
                        f"rank {v['rank']} holds a tensor on a mesh over ranks {list(ranks)} but rank "
                        f"{q} holds no tensor on that mesh"
                    )
                if problems:
                    return problems
    return problems


def _gather_views(view: dict, world_size: int, group: dist.ProcessGroup | None) -> list[dict]:
    """Every rank's view. First every rank sends a summary: its stage, errors, meshes and a hash of
    its names, signatures and tie keys (small whatever the number of tensors). When all ranks are
    in one stage, with no error and equal hashes, every rank holds what this rank holds, and the
    summaries (with this rank's names, signatures and tie keys) are the views. Otherwise every rank
    sends its whole view (a second exchange, which every rank decides alike from the same
    summaries)."""
    logical = hashlib.blake2b(
        pickle.dumps((view["names"], view["signatures"], view["tie_keys"]), protocol=pickle.HIGHEST_PROTOCOL),
        digest_size=16,
    ).digest()
    summary = {k: view[k] for k in ("rank", "stage", "errors", "float64", "digest")}
    summary.update(mesh_ranks=set(view["mesh_ranks"]), logical=logical)
    summaries: list[dict] = [{}] * world_size
    dist.all_gather_object(summaries, summary, group=group)
    if len({(s["stage"], s["logical"]) for s in summaries}) == 1 and not any(s["errors"] for s in summaries):
        return [{**s, **{k: view[k] for k in ("names", "signatures", "tie_keys")}} for s in summaries]
    views: list[dict] = [{}] * world_size
    dist.all_gather_object(views, view, group=group)
    return views


def _agreed_views(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    tie_keys: Sequence[str | None],
    layouts: list[TensorLayout],
    kinds: list[TensorLayout],
    rank: int,
    stage: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> list[dict]:
    """Every rank's view of the tensors (exchanged), once every rank has checked that they agree."""
    errors = [] if all(lay.problem is None for lay in kinds) else [
        lay.error(name, rank) for lay, name in zip(layouts, names) if lay.problem is not None
    ]
    view: dict[str, Any] = {
        "rank": rank,
        "stage": stage,
        "names": list(names),
        "signatures": list(map(_SIGNATURE, layouts)),
        "tie_keys": list(tie_keys),
        "mesh_ranks": list(map(_MESH_RANKS, layouts)),
        "errors": errors,
        "float64": torch.float64 in set(map(operator.attrgetter("dtype"), tensors)),
    }
    view["digest"] = _digest(view)
    views = [view] if world_size == 1 else _gather_views(view, world_size, group)
    problems = _check_agreement(views)
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise NormPlanError(f"cannot compute an exact global gradient norm:\n  {shown}{more}")
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
    """Analyse ``tensors`` on every rank of ``group`` and agree on who counts what.

    Collective over ``group`` (one ``all_gather_object``, two with several pipeline stages or when
    ranks disagree) when more than one process runs.

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
    rank, world_size = _world(group)
    stage = pipeline_stage(tensors, pp_mesh)
    layouts = describe(tensors, rank)
    kinds = list({id(lay): lay for lay in layouts}.values())  # the distinct layouts, by object (call-local)
    views = _agreed_views(tensors, names, tie_keys, layouts, kinds, rank, stage, world_size, group)
    stages = sorted({v["stage"] for v in views})
    leaders = {s: min((v for v in views if v["stage"] == s), key=lambda v: v["rank"]) for s in stages}
    slots, slot_names, first_stage_of_key = _slots(stages, leaders)
    needs_collective = world_size > 1 and (len(stages) > 1 or not all(lay.replicated_everywhere for lay in kinds))
    if needs_collective:
        stage_min_rank = leaders[stage]["rank"]
        counts = {id(lay): lay.counted_in_mesh and stage_min_rank in lay.mesh_ranks for lay in kinds}
        counted = tuple(
            counts[id(lay)] and (key is None or first_stage_of_key[key] == stage) for lay, key in zip(layouts, tie_keys)
        )
    else:
        counted = (True,) * len(layouts)
    return NormPlan(
        layouts=tuple(layouts),
        counted=counted,
        slots=tuple(slots[stage]),
        slot_names=tuple(slot_names),
        needs_collective=needs_collective,
        group=group,
        stage=stage,
        accumulate_dtype=torch.float64 if any(v["float64"] for v in views) else torch.float32,
        fingerprint=_fingerprint(views),
    )
