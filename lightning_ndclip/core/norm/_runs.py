"""Coalescing local gradients into contiguous runs of memory.

FSDP2 writes the sharded gradients of one ``fully_shard`` unit as views of one flat buffer; norming
or scaling the few contiguous stretches they tile costs a few kernels instead of one per view. This
module finds those stretches exactly:

* contiguous views of one contiguous base, laid end to end with no gap and no overlap, form a run;
  when they tile the whole base, the run is the base itself;
* a run to norm never crosses a gap or a change of the counted flag (a tensor-parallel
  ``Replicate`` parameter inside a unit of ``Shard`` ones), so norming a run equals norming its
  members, whatever the gaps hold;
* a run to scale crosses a gap only when the caller declares it padding of the tensor before it
  (FSDP2 pads uneven dim-0 shards: :func:`dim0_paddings`) and the gap has exactly that size: nothing
  lives there or reads it, so scaling it is harmless. Other gaps are never written;
* anything else (plain tensors, overlapping or non-contiguous views) is its own run.

The grouping is cached, and checked on every call (FSDP2 allocates fresh buffers every step): every
grouped tensor must still be contiguous and start exactly where the grouping expects it in its
group's base (of the same size and dtype as when grouped), so the runs cover exactly the same
elements as the tensors. One plain loop reads each tensor once: C-level maps, one pass per
attribute, were no faster (``docs/benchmarks.md#run-finding-parts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_ndclip._compat import StridedShard, dtensor_spec, local_tensors, view_base


def dim0_paddings(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """How many elements of padding follow each tensor's local piece when its dim 0 is split into
    equal padded chunks, as FSDP2 lays out the sharded gradients of a unit in one buffer.

    Non-zero only for a DTensor whose dim 0 is split by a single plain ``Shard(0)`` and whose local
    chunk is short but not empty: ``(ceil(D / W) - rows) * row_numel`` for dim-0 size ``D`` over
    ``W`` ranks. Worked out once per DTensor spec and local shape.
    """
    paddings: dict[tuple, int] = {}
    found = []
    for tensor, local in zip(tensors, local_tensors(tensors)):
        key = (dtensor_spec(tensor), local.shape) if isinstance(tensor, DTensor) else None
        if key is not None and key not in paddings:
            paddings[key] = _dim0_padding(key[0], local.shape)
        found.append(0 if key is None else paddings[key])
    return tuple(found)


def _dim0_padding(spec: Any, local_shape: torch.Size) -> int:
    placements = spec.placements
    on_dim0 = [d for d, p in enumerate(placements) if isinstance(p, (Shard, StridedShard)) and p.dim == 0]
    if len(on_dim0) != 1 or type(placements[on_dim0[0]]) is not Shard:
        return 0
    rows = local_shape[0] if local_shape else 0
    padded_rows = -(-spec.shape[0] // spec.mesh.size(on_dim0[0]))
    return (padded_rows - rows) * (local_shape.numel() // rows) if 0 < rows < padded_rows else 0


@dataclass(frozen=True)
class Runs:
    """The tensors to norm (counted pieces), to scale (every local gradient) and to check (the pieces
    this rank holds but does not count: copies counted on another rank, which must stay finite)."""

    to_norm: list[torch.Tensor]
    to_scale: list[torch.Tensor]
    to_check: list[torch.Tensor]


@dataclass(frozen=True)
class _Cut:
    """The runs of one buffer, made in one of three ways: the buffer itself, when it is the one run;
    the members as they are, when each run is one member (no new view, and no padding after a member
    scaled); or the sections of one ``split_with_sizes`` of the flat buffer (one call for every section, which
    costs less than one view per run), picking the runs among them."""

    whole: bool
    members: tuple[int, ...]  # when each run is one member
    sizes: tuple[int, ...]  # else: of the sections, runs and gaps in order
    picks: tuple[int, ...]  # the sections that are runs

    @staticmethod
    def of(spans: Sequence[tuple[int, int, list[int]]], numel: int) -> _Cut:
        if all(len(members) == 1 for _, _, members in spans):
            return _Cut(False, tuple(members[0] for _, _, members in spans), (), ())
        sizes: list[int] = []
        picks: list[int] = []
        position = 0
        for start, end, _ in spans:
            if start > position:
                sizes.append(start - position)
            picks.append(len(sizes))
            sizes.append(end - start)
            position = end
        if position < numel:
            sizes.append(numel - position)
        return _Cut(len(sizes) == 1, (), tuple(sizes), tuple(picks))

    def pieces(self, buffer: torch.Tensor, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.whole:
            return [buffer]
        if not self.sizes:
            return [locals_[m] for m in self.members]
        sections = (buffer if buffer.dim() == 1 else buffer.view(-1)).split_with_sizes(self.sizes)
        return [sections[k] for k in self.picks]


@dataclass(frozen=True)
class _Group:
    """Views of one buffer that form runs: their indices (by address) and byte offsets in the buffer."""

    members: tuple[int, ...]
    byte_offsets: tuple[int, ...]
    numel: int  # of the buffer
    dtype: torch.dtype
    to_norm: _Cut | None  # None: the same runs as to scale
    to_scale: _Cut
    to_check: _Cut | None  # None: every member is counted


def _spans(
    members: Sequence[int],
    numels: Mapping[int, int],
    offsets: Mapping[int, int],
    padding: Sequence[int] | None = None,
    buffer_numel: int = 0,
) -> list[tuple[int, int, list[int]]]:
    """Maximal ``[start, end)`` spans covered by adjacent ``members`` (tensors of ``numels`` elements
    at ``offsets`` inside their buffer, sorted by offset), with the members in each. With
    ``padding``, a member also covers the padding declared after it when that padding ends exactly
    where the next member (or the buffer) starts."""
    starts = [offsets[m] for m in members] + [buffer_numel]
    spans: list[tuple[int, int, list[int]]] = []
    for k, m in enumerate(members):
        start, end = starts[k], starts[k] + numels[m]
        if padding and padding[m] and end + padding[m] == starts[k + 1]:
            end = starts[k + 1]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end, [*spans[-1][2], m])
        else:
            spans.append((start, end, [m]))
    return spans


def _group(
    locals_: Sequence[torch.Tensor], members: list[int], counted: Sequence[bool], padding: Sequence[int] | None
) -> _Group | None:
    """The runs of ``members``, contiguous views of one contiguous buffer of their dtype, or ``None``
    when they cannot form runs (a single view, or views that overlap)."""
    buffer = view_base(locals_[members[0]])
    assert buffer is not None
    origin = int(buffer.storage_offset())
    offsets = {m: int(locals_[m].storage_offset()) - origin for m in members}
    numels = {m: int(locals_[m].numel()) for m in members}
    members.sort(key=offsets.__getitem__)
    if len(members) == 1 or any(offsets[a] + numels[a] > offsets[b] for a, b in zip(members, members[1:])):
        return None
    numel = int(buffer.numel())
    to_scale = _Cut.of(_spans(members, numels, offsets, padding, numel), numel)
    to_norm = _Cut.of(_spans([m for m in members if counted[m]], numels, offsets), numel)
    uncounted = [m for m in members if not counted[m]]
    return _Group(
        members=tuple(members),
        byte_offsets=tuple(offsets[m] * buffer.element_size() for m in members),
        numel=numel,
        dtype=buffer.dtype,
        to_norm=None if to_norm == to_scale else to_norm,
        to_scale=to_scale,
        to_check=_Cut.of(_spans(uncounted, numels, offsets), numel) if uncounted else None,
    )


class RunFinder:
    """Finds, caches and checks the contiguous runs of one list of local gradients."""

    def __init__(self) -> None:
        self._count = -1  # the number of tensors grouped
        self._groups: tuple[_Group, ...] = ()
        self._singles: tuple[int, ...] = ()  # the tensors in no group
        self._counted_singles: tuple[int, ...] = ()
        self._uncounted_singles: tuple[int, ...] = ()

    def runs(
        self, locals_: Sequence[torch.Tensor], counted: Sequence[bool], padding: Sequence[int] | None = None
    ) -> Runs:
        """Split ``locals_`` into runs; ``counted`` marks the tensors whose elements this rank adds
        to the norm, ``padding`` the number of padding elements after each tensor that scaling may
        cover (neither may change between calls of one finder)."""
        buffers = self._checked_buffers(locals_)
        if buffers is None:
            self._rebuild(locals_, counted, padding)
            buffers = [cast(torch.Tensor, view_base(locals_[g.members[0]])) for g in self._groups]
        to_norm: list[torch.Tensor] = []
        to_scale: list[torch.Tensor] = []
        to_check: list[torch.Tensor] = []
        for group, buffer in zip(self._groups, buffers):
            scale = group.to_scale.pieces(buffer, locals_)
            to_scale += scale
            to_norm += scale if group.to_norm is None else group.to_norm.pieces(buffer, locals_)
            if group.to_check is not None:
                to_check += group.to_check.pieces(buffer, locals_)
        to_norm += [locals_[i] for i in self._counted_singles]
        to_scale += [locals_[i] for i in self._singles]
        to_check += [locals_[i] for i in self._uncounted_singles]
        return Runs(to_norm, to_scale, to_check)

    def _checked_buffers(self, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The groups' buffers if the cached grouping still holds for ``locals_``, else ``None``."""
        if len(locals_) != self._count:
            return None
        buffers = []
        for group in self._groups:
            buffer = view_base(locals_[group.members[0]])
            if buffer is None or buffer.numel() != group.numel or buffer.dtype != group.dtype or not buffer.is_contiguous():
                return None
            address = buffer.data_ptr()
            for i, offset in zip(group.members, group.byte_offsets):
                view = locals_[i]
                if view.data_ptr() != address + offset or not view.is_contiguous():
                    return None
            buffers.append(buffer)
        return buffers

    def _rebuild(self, locals_: Sequence[torch.Tensor], counted: Sequence[bool], padding: Sequence[int] | None) -> None:
        by_buffer: dict[int, list[int]] = {}  # the non-empty contiguous views of one contiguous buffer, of its dtype
        singles: list[int] = []
        for i, t in enumerate(locals_):
            buffer = view_base(t)
            if t.numel() == 0:
                continue
            if buffer is None or not (buffer.is_contiguous() and t.is_contiguous() and t.dtype == buffer.dtype):
                singles.append(i)
            else:
                by_buffer.setdefault(id(buffer), []).append(i)
        groups = []
        for members in by_buffer.values():  # in the order of the tensors, not of addresses: the same every run
            group = _group(locals_, members, counted, padding)
            if group is None:
                singles.extend(members)
            else:
                groups.append(group)
        singles.sort()
        self._count = len(locals_)
        self._groups = tuple(groups)
        self._singles = tuple(singles)
        self._counted_singles = tuple(i for i in singles if counted[i])
        self._uncounted_singles = tuple(i for i in singles if not counted[i])
