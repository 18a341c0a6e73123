"""What the norm functions keep between calls: the plan of each gradient layout, and its runs.

A plan (:mod:`lightning_ndclip.core.norm._plan`) costs a collective exchange to agree on; a layout's
contiguous runs (:mod:`lightning_ndclip.core.norm._runs`) a walk over its tensors. Both are kept, per
layout, in a :class:`NormPlans`.

**The invariant.** Every rank of a process group that makes the same norm calls with its
``NormPlans``, in the same order, with gradients of the same layouts, finds or misses each plan
together with the others: the keys are values (a DTensor's spec compares by mesh, placements, shape,
stride and dtype; a plain tensor by shape and dtype; a mesh by its ranks and dim names; a process
group by identity), and the caches' decisions depend on nothing but the sequence of keys. A rank
whose own layout changed while the others' did not is the one exception: it misses alone, and joins
the others' all-reduce with a marker that makes them see it (``clip_grad._probe``).

The caches grow when a dropped layout comes back (:class:`GrowingLRU`), so that a model cycling
through more layouts than the capacity (an optimizer per layer) settles after one round.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Generic, TypeVar, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_ndclip._compat import dtensor_spec
from lightning_ndclip.core.norm._plan import NormPlan
from lightning_ndclip.core.norm._runs import RunFinder

V = TypeVar("V")


class GrowingLRU(Generic[V]):
    """``cache.get(key, make)``: the entry, made on a miss; the least recently used entries beyond the
    capacity are dropped, and a miss on a key dropped before doubles the capacity (up to
    ``max_capacity``). Its hits and misses depend only on the sequence of keys."""

    def __init__(self, capacity: int = 16, max_capacity: int = 4096) -> None:
        self.capacity = capacity
        self.max_capacity = max_capacity
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._dropped: OrderedDict[Hashable, None] = OrderedDict()  # at most max_capacity keys
        self._last: tuple[Hashable, V] | None = None  # the most recently used key and entry

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        last = self._last
        if last is not None and last[0] == key:  # the previous call's key, compared without hashing (see layout_key)
            return last[1]
        entry = self._entries.get(key)
        if entry is None:
            if key in self._dropped:
                self.capacity = min(2 * self.capacity, self.max_capacity)
            return self.put(key, make())
        self._entries.move_to_end(key)
        self._last = (key, entry)
        return entry

    def put(self, key: Hashable, entry: V) -> V:
        """Store ``entry`` as the most recently used."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._dropped.pop(key, None)
        self._last = (key, entry)  # the most recently used: never the one dropped below
        while len(self._entries) > self.capacity:
            self._dropped[self._entries.popitem(last=False)[0]] = None
        while len(self._dropped) > self.max_capacity:
            self._dropped.popitem(last=False)
        return entry

    def values(self) -> list[V]:
        """The entries, least recently used first."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
        self._dropped.clear()
        self._last = None

    def __len__(self) -> int:
        return len(self._entries)


def layout_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """A layout as a value: each DTensor's spec, each plain tensor's shape and dtype. Hashing it calls a
    Python ``__hash__`` per spec (cached by PyTorch, still about 0.3 us each); comparing it with the
    previous call's key, which :meth:`GrowingLRU.get` tries first, finds the same spec objects by
    identity, in C."""
    if all(map(isinstance, tensors, repeat(DTensor))):  # the usual case, without a Python line per tensor
        return tuple(map(dtensor_spec, cast("Sequence[DTensor]", tensors)))
    return tuple([dtensor_spec(t) if isinstance(t, DTensor) else (t.shape, t.dtype) for t in tensors])


@dataclass
class PlanEntry:
    """A layout's agreed plan, with what is derived from it once: the FSDP2 padding after each local
    piece (see :mod:`lightning_ndclip.core.norm._runs`), the mesh the total is returned replicated on,
    the run finder, and small device constants."""

    plan: NormPlan
    padding: tuple[int, ...]
    mesh: DeviceMesh | None = None  # of the first DTensor among the tensors: the total's replica mesh
    finder: RunFinder = field(default_factory=RunFinder)
    constants: dict = field(default_factory=dict)

    def constant(self, key: tuple, device: torch.device, dtype: torch.dtype, make: Callable[[], list]) -> torch.Tensor:
        """``torch.tensor(make())`` on ``device``, made on first use (no copy to the device per call)."""
        full_key = (key, device, dtype)
        if full_key not in self.constants:
            self.constants[full_key] = torch.tensor(make(), dtype=dtype, device=device)
        return self.constants[full_key]


class NormPlans:
    """The caches of the norm functions, for as long as this object lives: per gradient layout, the
    plan every rank agreed on (a collective exchange on first use) and the contiguous runs of the
    gradients; per pipeline mesh, process group and kind of norm, the size of the last all-reduce.

    Entries last until :meth:`clear`, until their layout is among the least recently used beyond
    ``capacity``, or until this object is garbage. Every rank of the process group must make the
    same norm calls with its instance, in the same order (the invariant of :mod:`._cache`). The
    functions of :mod:`lightning_ndclip.core.norm.clip_grad` take one as ``plans=``; with ``None``
    they share a default instance that lives as long as the process. ``len(plans)``: the plans kept.

    Args:
        capacity: how many layouts are kept at first; it doubles, up to ``max_capacity``, whenever
            a dropped layout comes back (a cycle of more layouts than it holds).
        max_capacity: the most layouts kept.
    """

    def __init__(self, capacity: int = 16, max_capacity: int = 4096) -> None:
        self.plans: GrowingLRU[PlanEntry] = GrowingLRU(capacity, max_capacity)
        self.scale_runs: GrowingLRU[tuple[RunFinder, tuple[int, ...]]] = GrowingLRU(capacity, max_capacity)
        # per (pp mesh, group, inf norm, per-tensor): the size of its last all-reduce, which a rank that
        # misses alone joins (probe); keyed by the mesh and the group themselves, as the plans are
        self.last_size: dict[tuple, int] = {}

    @property
    def capacity(self) -> int:
        """How many layouts' plans are kept now."""
        return self.plans.capacity

    @property
    def max_capacity(self) -> int:
        """The most layouts' plans ever kept."""
        return self.plans.max_capacity

    def counted(self) -> tuple[bool, ...] | None:
        """For diagnostics: per tensor of the most recently used plan, in the order they were
        passed, whether this rank adds its local piece to the global norm (a piece held by several
        ranks counts on one of them only); ``None`` when no plan is kept."""
        entries = self.plans.values()
        return entries[-1].plan.counted if entries else None

    def clear(self) -> None:
        """Drop every entry."""
        self.plans.clear()
        self.scale_runs.clear()
        self.last_size.clear()

    def __len__(self) -> int:
        """The number of plans kept."""
        return len(self.plans)
