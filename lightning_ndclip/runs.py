"""Coalescing local gradients into contiguous runs of memory.

FSDP2 writes the sharded gradients of one ``fully_shard`` unit as views of a single flat
reduce-scatter buffer. Norming or scaling a thousand small views costs a thousand kernel launches;
norming the handful of contiguous stretches they tile costs a handful. This module finds those
stretches exactly:

* views of one contiguous base, laid end to end with no gap and no overlap, form a run;
* a run never crosses a gap (FSDP pads uneven shards) or a change of the counted flag (a
  tensor-parallel ``Replicate`` parameter inside a unit of ``Shard`` ones), so norming a run equals
  norming its members, and scaling a run touches no byte that is not a gradient;
* anything else (plain tensors, overlapping or non-contiguous views) is its own run.

The grouping is cached and re-validated each call with a few attribute reads per tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class _Group:
    members: tuple[int, ...]
    norm_runs: tuple[tuple[int, int], ...]
    scale_runs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Runs:
    """The tensors to norm (counted pieces only) and to scale (every local gradient)."""

    to_norm: list[torch.Tensor]
    to_scale: list[torch.Tensor]


def _spans(members: list[int], locals_: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Maximal ``[start, end)`` storage spans covered by adjacent ``members`` (sorted by offset)."""
    spans: list[tuple[int, int]] = []
    for m in members:
        start = locals_[m].storage_offset()
        end = start + locals_[m].numel()
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


class RunFinder:
    """Finds, caches and re-validates the contiguous runs of one list of local gradients."""

    def __init__(self) -> None:
        self._groups: tuple[_Group, ...] = ()
        self._singles: tuple[int, ...] = ()
        self._count = -1
        # every grouped member, group after group; the index of its group; its storage offset
        self._members: list[int] = []
        self._group_of: list[int] = []
        self._offsets: list[int] = []
        self._starts: list[int] = []  # position of each group's first member in _members

    def runs(self, locals_: Sequence[torch.Tensor], counted: Sequence[bool]) -> Runs:
        """Split ``locals_`` into runs; ``counted`` marks the tensors whose elements this rank adds
        to the norm (it must not change between calls of one finder)."""
        if not self._still_valid(locals_):
            self._rebuild(locals_, counted)
        to_norm: list[torch.Tensor] = []
        to_scale: list[torch.Tensor] = []
        for group in self._groups:
            base = locals_[group.members[0]]._base
            flat = base.view(-1)
            origin = base.storage_offset()
            scale = [flat[a - origin : b - origin] for a, b in group.scale_runs]
            to_scale.extend(scale)
            if group.norm_runs == group.scale_runs:  # every member counted: the same slices
                to_norm.extend(scale)
            else:
                to_norm.extend(flat[a - origin : b - origin] for a, b in group.norm_runs)
        for i in self._singles:
            to_scale.append(locals_[i])
            if counted[i]:
                to_norm.append(locals_[i])
        return Runs(to_norm, to_scale)

    def _still_valid(self, locals_: Sequence[torch.Tensor]) -> bool:
        """Same count, and every grouped view still a contiguous view of its group's base at the
        same offset (one pass over the members, no per-group Python loop)."""
        if len(locals_) != self._count:
            return False
        members = [locals_[m] for m in self._members]
        bases = [t._base for t in members]
        heads = [bases[k] for k in self._starts]
        if not all([b is not None and b.is_contiguous() for b in heads]):
            return False
        return (
            all(map(operator.is_, bases, [heads[g] for g in self._group_of]))
            and [t.storage_offset() for t in members] == self._offsets
            and all([t.is_contiguous() for t in members])
        )

    def _rebuild(self, locals_: Sequence[torch.Tensor], counted: Sequence[bool]) -> None:
        by_base: dict[int, list[int]] = {}
        singles: list[int] = []
        for i, t in enumerate(locals_):
            if t.numel() == 0:
                continue
            base = t._base
            if (
                base is not None
                and base.is_contiguous()
                and t.is_contiguous()
                and base.dtype == t.dtype
                and base.device == t.device
            ):
                by_base.setdefault(id(base), []).append(i)
            else:
                singles.append(i)
        groups = []
        for members in by_base.values():
            members.sort(key=lambda m: locals_[m].storage_offset())
            ends = [locals_[m].storage_offset() + locals_[m].numel() for m in members]
            overlapping = any(ends[k] > locals_[members[k + 1]].storage_offset() for k in range(len(members) - 1))
            if len(members) == 1 or overlapping:
                singles.extend(members)
                continue
            groups.append(
                _Group(
                    members=tuple(members),
                    norm_runs=tuple(_spans([m for m in members if counted[m]], locals_)),
                    scale_runs=tuple(_spans(members, locals_)),
                )
            )
        self._groups = tuple(groups)
        self._members = [m for g in groups for m in g.members]
        self._group_of = [k for k, g in enumerate(groups) for _ in g.members]
        self._offsets = [locals_[m].storage_offset() for m in self._members]
        self._starts = [0, *accumulate(len(g.members) for g in groups)][: len(groups)]
        self._singles = tuple(sorted(singles))
        self._count = len(locals_)
