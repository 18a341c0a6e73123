"""Coalescing local gradients into contiguous runs of memory.

FSDP2 writes the sharded gradients of one ``fully_shard`` unit as views of a single flat
reduce-scatter buffer. Norming or scaling a thousand small views costs a thousand kernel launches;
norming the handful of contiguous stretches they tile costs a handful. This module finds those
stretches exactly:

* contiguous views of one contiguous base, laid end to end with no gap and no overlap, form a run;
  when they tile the whole base, the run is the base itself;
* a run to norm never crosses a gap or a change of the counted flag (a tensor-parallel
  ``Replicate`` parameter inside a unit of ``Shard`` ones), so norming a run equals norming its
  members, whatever the gaps hold;
* a run to scale crosses a gap only when the caller declares it padding of the tensor before it
  (FSDP2 pads uneven dim-0 shards; see :func:`lightning_ndclip.core._layout.dim0_padding`) and the gap
  has exactly that size: no other tensor lives there and nothing reads it, so scaling it is harmless.
  Other gaps are never written;
* anything else (plain tensors, overlapping or non-contiguous views) is its own run.

The grouping is cached. Each call re-validates it from addresses: every grouped tensor must still be
contiguous and start exactly where the grouping expects it inside its group's base (same size and
dtype as when grouped), which guarantees the runs cover exactly the same elements as the tensors.
FSDP2 allocates fresh buffers every step; the check costs two attribute reads per tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from lightning_ndclip._compat import view_base


@dataclass(frozen=True)
class _Group:
    head: int  # the member whose ``_base`` is the group's buffer
    numel: int  # of the buffer
    dtype: torch.dtype
    norm_runs: tuple[tuple[int, int], ...]  # [start, end) element offsets inside the buffer
    scale_runs: tuple[tuple[int, int], ...]
    tiles_buffer: bool  # the members cover the whole buffer: scale (and norm) the buffer itself


@dataclass(frozen=True)
class Runs:
    """The tensors to norm (counted pieces only) and to scale (every local gradient)."""

    to_norm: list[torch.Tensor]
    to_scale: list[torch.Tensor]


def _spans(
    members: list[int],
    locals_: Sequence[torch.Tensor],
    origin: int,
    padding: Sequence[int] | None = None,
    buffer_numel: int = 0,
) -> tuple[tuple[int, int], ...]:
    """Maximal ``[start, end)`` spans (relative to ``origin``) covered by adjacent ``members``,
    which are sorted by storage offset. With ``padding``, a member also covers the padding declared
    after it when that padding ends exactly where the next member (or the buffer) starts."""
    starts = [int(locals_[m].storage_offset()) - origin for m in members] + [buffer_numel]
    spans: list[tuple[int, int]] = []
    for k, m in enumerate(members):
        start = starts[k]
        end = start + int(locals_[m].numel())
        if padding and padding[m] and end + padding[m] == starts[k + 1]:
            end = starts[k + 1]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return tuple(spans)


def _buffer(view: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, view_base(view))


def _piece(base: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return base.as_strided((end - start,), (1,), base.storage_offset() + start)


class RunFinder:
    """Finds, caches and re-validates the contiguous runs of one list of local gradients."""

    def __init__(self) -> None:
        self._count = -1
        self._groups: tuple[_Group, ...] = ()
        self._singles: tuple[int, ...] = ()
        self._pick_members = operator.itemgetter(0, 0)  # every grouped tensor, group after group
        self._group_of: list[int] = []  # the group of each of them
        self._byte_offsets: list[int] = []  # and its byte offset inside the group's buffer
        self._base_ptrs: list[int] = []  # the buffers' addresses at the last successful check
        self._ptrs: list[int] = []  # the members' addresses then
        self._bases_are_runs = False  # every tensor is in a group that tiles its buffer and is counted

    def runs(
        self, locals_: Sequence[torch.Tensor], counted: Sequence[bool], padding: Sequence[int] | None = None
    ) -> Runs:
        """Split ``locals_`` into runs; ``counted`` marks the tensors whose elements this rank adds
        to the norm, ``padding`` the number of padding elements after each tensor that scaling may
        cover (neither may change between calls of one finder)."""
        bases = self._validated_bases(locals_)
        if bases is None:
            self._rebuild(locals_, counted, padding)
            bases = [_buffer(locals_[g.head]) for g in self._groups]
        if self._bases_are_runs:
            return Runs(bases, bases)
        to_norm: list[torch.Tensor] = []
        to_scale: list[torch.Tensor] = []
        for group, base in zip(self._groups, bases):
            if group.tiles_buffer:
                to_scale.append(base)
            else:
                to_scale.extend([_piece(base, a, b) for a, b in group.scale_runs])
            if group.norm_runs == group.scale_runs:
                to_norm.extend(to_scale[len(to_scale) - len(group.scale_runs) :])
            else:
                to_norm.extend([_piece(base, a, b) for a, b in group.norm_runs])
        for i in self._singles:
            to_scale.append(locals_[i])
            if counted[i]:
                to_norm.append(locals_[i])
        return Runs(to_norm, to_scale)

    def _validated_bases(self, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The groups' buffers if the cached grouping still holds for ``locals_``, else ``None``."""
        if len(locals_) != self._count:
            return None
        if not self._groups:
            return []
        maybe_bases = [view_base(locals_[g.head]) for g in self._groups]
        if not all(
            [
                b is not None and b.numel() == g.numel and b.dtype == g.dtype and b.is_contiguous()
                for g, b in zip(self._groups, maybe_bases)
            ]
        ):
            return None
        bases = cast("list[torch.Tensor]", maybe_bases)
        base_ptrs = [b.data_ptr() for b in bases]
        members = self._pick_members(locals_)
        if not all(map(torch.Tensor.is_contiguous, members)):
            return None
        ptrs = list(map(torch.Tensor.data_ptr, members))
        if base_ptrs != self._base_ptrs or ptrs != self._ptrs:
            expected = [base_ptrs[g] + off for g, off in zip(self._group_of, self._byte_offsets)]
            if ptrs != expected:
                return None
            self._base_ptrs, self._ptrs = base_ptrs, ptrs
        return bases

    def _rebuild(
        self, locals_: Sequence[torch.Tensor], counted: Sequence[bool], padding: Sequence[int] | None
    ) -> None:
        by_base: dict[int, list[int]] = {}
        singles: list[int] = []
        for i, t in enumerate(locals_):
            if t.numel() == 0:
                continue
            base = view_base(t)
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
        groups: list[_Group] = []
        members_all: list[int] = []
        self._group_of, self._byte_offsets = [], []
        for members in by_base.values():
            members.sort(key=lambda m: locals_[m].storage_offset())
            ends = [locals_[m].storage_offset() + locals_[m].numel() for m in members]
            overlapping = any(ends[k] > locals_[members[k + 1]].storage_offset() for k in range(len(members) - 1))
            if len(members) == 1 or overlapping:
                singles.extend(members)
                continue
            base = _buffer(locals_[members[0]])
            origin = int(base.storage_offset())
            self._group_of.extend([len(groups)] * len(members))
            self._byte_offsets.extend([(int(locals_[m].storage_offset()) - origin) * base.element_size() for m in members])
            members_all.extend(members)
            numel = int(base.numel())
            scale_runs = _spans(members, locals_, origin, padding, numel)
            groups.append(
                _Group(
                    head=members[0],
                    numel=numel,
                    dtype=base.dtype,
                    norm_runs=_spans([m for m in members if counted[m]], locals_, origin),
                    scale_runs=scale_runs,
                    tiles_buffer=scale_runs == ((0, numel),),
                )
            )
        self._groups = tuple(groups)
        self._singles = tuple(sorted(singles))
        self._count = len(locals_)
        # every group has two members or more, so the getter always returns a tuple
        self._pick_members = operator.itemgetter(*members_all) if members_all else operator.itemgetter(0, 0)
        self._base_ptrs, self._ptrs = [], []
        self._bases_are_runs = not singles and all(g.tiles_buffer and g.norm_runs == g.scale_runs for g in groups)
