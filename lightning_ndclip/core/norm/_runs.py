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
  (FSDP2 pads uneven dim-0 shards; see :func:`dim0_padding`) and the gap
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, groupby, repeat
from typing import Any, TypeVar, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_ndclip._compat import StridedShard, dtensor_spec, local_tensors, view_base

T = TypeVar("T")
_DTYPE = operator.attrgetter("dtype")


def dim0_padding(tensor: torch.Tensor) -> int:
    """How many elements of padding follow this rank's local piece of ``tensor`` when its dim 0 is
    split into equal padded chunks, as FSDP2 lays out the sharded gradients of a unit in one buffer.

    Non-zero only for a DTensor whose dim 0 is split by a single plain ``Shard(0)`` (other mesh dims
    ``Replicate`` or sharding other dims) and whose local chunk is short but not empty:
    ``(ceil(D / W) - rows) * row_numel`` for global dim-0 size ``D`` over ``W`` ranks.
    """
    return dim0_paddings([tensor])[0]


def dim0_paddings(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """:func:`dim0_padding` of every tensor, worked out once per DTensor spec and local shape."""
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
    numels: Sequence[int],
    offsets: Sequence[int],
    origin: int,
    padding: Sequence[int] | None = None,
    buffer_numel: int = 0,
) -> tuple[tuple[int, int], ...]:
    """Maximal ``[start, end)`` spans (relative to ``origin``) covered by adjacent ``members``
    (tensors of ``numels`` elements at storage ``offsets``), which are sorted by offset. With
    ``padding``, a member also covers the padding declared after it when that padding ends exactly
    where the next member (or the buffer) starts."""
    starts = [offsets[m] - origin for m in members] + [buffer_numel]
    spans: list[tuple[int, int]] = []
    for k, m in enumerate(members):
        start = starts[k]
        end = start + numels[m]
        if padding and padding[m] and end + padding[m] == starts[k + 1]:
            end = starts[k + 1]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return tuple(spans)


def _buffer(view: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, view_base(view))


def _items_at(indices: Sequence[int]) -> Callable[[Sequence[T]], tuple[T, ...]]:
    """``lambda xs: tuple(xs[i] for i in indices)``, in C (``itemgetter`` returns a bare item for one
    index)."""
    if not indices:
        return lambda _: ()
    if len(indices) == 1:
        get = operator.itemgetter(indices[0])
        return lambda xs: (get(xs),)
    return operator.itemgetter(*indices)


def _sections(runs: tuple[tuple[int, int], ...], numel: int) -> tuple[list[int], list[int]]:
    """Sizes that split a buffer of ``numel`` elements at every run boundary, and the indices of the
    sections that are runs (the others are gaps)."""
    sizes: list[int] = []
    wanted: list[int] = []
    position = 0
    for start, end in runs:
        if start > position:
            sizes.append(start - position)
        wanted.append(len(sizes))
        sizes.append(end - start)
        position = end
    if position < numel:
        sizes.append(numel - position)
    return sizes, wanted


class _Pieces:
    """How to cut the groups' buffers into runs with one ``split`` per buffer and pick the runs out
    of all the sections with one ``itemgetter``: no Python line per run."""

    def __init__(self, groups: Sequence[_Group], which: str) -> None:
        self.sections: list[list[int]] = []
        wanted: list[int] = []
        offset = 0
        for group in groups:
            sizes, runs = _sections(getattr(group, which), group.numel)
            self.sections.append(sizes)
            wanted.extend(offset + r for r in runs)
            offset += len(sizes)
        self.pick = _items_at(wanted)
        # every buffer is one run: the buffers themselves
        self.whole_buffers = len(wanted) == len(groups) and all(len(sizes) == 1 for sizes in self.sections)

    def of(self, bases: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        if self.whole_buffers:
            return bases
        return self.pick(list(chain.from_iterable(map(torch.Tensor.split, bases, self.sections))))


class RunFinder:
    """Finds, caches and re-validates the contiguous runs of one list of local gradients."""

    def __init__(self) -> None:
        self._count = -1
        self._groups: tuple[_Group, ...] = ()
        self._pick_heads = _items_at(())  # the member of each group whose ``_base`` is its buffer
        self._pick_members = _items_at(())  # every grouped tensor, group after group
        self._pick_singles = _items_at(())  # the tensors in no group, and the counted ones among them
        self._pick_counted_singles = _items_at(())
        self._scale_pieces: _Pieces | None = None
        self._norm_pieces: _Pieces | None = None  # None: the same runs as to scale
        self._numels: list[int] = []  # of the buffers
        self._dtypes: list[torch.dtype] = []
        self._group_of: list[int] = []  # the group of each grouped tensor
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
            bases = list(map(_buffer, self._pick_heads(locals_)))
        if self._bases_are_runs:
            return Runs(bases, bases)
        scale = self._scale_pieces.of(bases) if self._scale_pieces else ()
        norm = self._norm_pieces.of(bases) if self._norm_pieces else scale
        return Runs(
            [*norm, *self._pick_counted_singles(locals_)],
            [*scale, *self._pick_singles(locals_)],
        )

    def _validated_bases(self, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The groups' buffers if the cached grouping still holds for ``locals_``, else ``None``."""
        if len(locals_) != self._count:
            return None
        if not self._groups:
            return []
        maybe_bases = list(map(view_base, self._pick_heads(locals_)))
        if any(map(operator.is_, maybe_bases, repeat(None))):
            return None
        bases = cast("list[torch.Tensor]", maybe_bases)
        if (
            list(map(torch.Tensor.numel, bases)) != self._numels
            or list(map(_DTYPE, bases)) != self._dtypes
            or not all(map(torch.Tensor.is_contiguous, bases))
        ):
            return None
        base_ptrs = list(map(torch.Tensor.data_ptr, bases))
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
        numels = list(map(torch.Tensor.numel, locals_))
        offsets = cast("list[int]", list(map(torch.Tensor.storage_offset, locals_)))
        contiguous = list(map(torch.Tensor.is_contiguous, locals_))
        dtypes = list(map(_DTYPE, locals_))  # a view has its base's device; its dtype may differ (``view(dtype)``)
        bases = list(map(view_base, locals_))
        base_ids = list(map(id, bases))
        singles: list[int] = []
        by_base: list[list[int]] = []  # the non-empty contiguous views of one contiguous buffer, of its dtype
        for _, same_base in groupby(sorted(range(len(locals_)), key=base_ids.__getitem__), key=base_ids.__getitem__):
            indices = list(same_base)
            base = bases[indices[0]]
            if base is None or not base.is_contiguous():
                singles.extend(i for i in indices if numels[i])
                continue
            dtype = base.dtype
            members = [i for i in indices if numels[i] and contiguous[i] and dtypes[i] == dtype]
            if len(members) < len(indices):
                singles.extend(i for i in indices if numels[i] and not (contiguous[i] and dtypes[i] == dtype))
            if members:
                by_base.append(members)
        groups: list[_Group] = []
        members_all: list[int] = []
        self._group_of, self._byte_offsets = [], []
        by_base.sort(key=operator.itemgetter(0))  # in the order of the tensors, not of addresses: the same every run
        for members in by_base:
            members.sort(key=offsets.__getitem__)
            overlapping = any(offsets[a] + numels[a] > offsets[b] for a, b in zip(members, members[1:]))
            if len(members) == 1 or overlapping:
                singles.extend(members)
                continue
            base = _buffer(locals_[members[0]])
            origin = int(base.storage_offset())
            self._group_of.extend([len(groups)] * len(members))
            self._byte_offsets.extend([(offsets[m] - origin) * base.element_size() for m in members])
            members_all.extend(members)
            numel = int(base.numel())
            scale_runs = _spans(members, numels, offsets, origin, padding, numel)
            groups.append(
                _Group(
                    head=members[0],
                    numel=numel,
                    dtype=base.dtype,
                    norm_runs=_spans([m for m in members if counted[m]], numels, offsets, origin),
                    scale_runs=scale_runs,
                    tiles_buffer=scale_runs == ((0, numel),),
                )
            )
        self._groups = tuple(groups)
        singles.sort()
        self._count = len(locals_)
        self._pick_heads = _items_at([g.head for g in groups])
        self._pick_members = _items_at(members_all)
        self._pick_singles = _items_at(singles)
        self._pick_counted_singles = _items_at([i for i in singles if counted[i]])
        self._numels = [g.numel for g in groups]
        self._dtypes = [g.dtype for g in groups]
        self._scale_pieces = _Pieces(groups, "scale_runs") if groups else None
        same = all(g.norm_runs == g.scale_runs for g in groups)
        self._norm_pieces = None if same else _Pieces(groups, "norm_runs")
        self._base_ptrs, self._ptrs = [], []
        self._bases_are_runs = not singles and same and all(g.tiles_buffer for g in groups)
