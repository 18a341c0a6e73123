"""A least-recently-used cache whose capacity grows when the keys it dropped come back.

The norm caches one plan per gradient layout. A model may use more layouts than a fixed capacity in
a cycle (an optimizer per layer, optimizer-in-backward, alternating sub-models): a fixed LRU then
misses on every call and rebuilds each plan with a collective exchange. Here a miss on a key dropped
earlier doubles the capacity (up to ``max_capacity``), so a cycle of any length up to that settles
after one round; layouts that never recur (nothing comes back) stay bounded by the capacity.

Keys may hold ``id()`` s of objects that their entries keep alive (the norm keys layouts by the ids of
DTensor specs). A dropped key must keep those objects alive too (``pin``): otherwise a new object could
take a freed id on one rank only, that rank would take a fresh layout for a dropped one and grow alone,
and from then on its hits and misses would differ from the other ranks'.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class GrowingLRU(Generic[V]):
    """``cache.get(key, make)``: the entry, made on a miss; least recently used entries beyond the
    capacity are dropped. Every rank that makes the same calls makes the same hits and misses.

    ``pin(entry)``: what of a dropped entry its key needs alive (the objects whose ids it holds);
    kept with the key while the key is remembered (at most ``max_capacity`` keys)."""

    def __init__(
        self, capacity: int = 16, max_capacity: int = 4096, pin: Callable[[V], object] | None = None
    ) -> None:
        self.capacity = capacity
        self.max_capacity = max_capacity
        self._pin = pin
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._dropped: OrderedDict[Hashable, object] = OrderedDict()  # key -> its pinned objects

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        entry = self._entries.get(key)
        if entry is None:
            if key in self._dropped:
                self.capacity = min(2 * self.capacity, self.max_capacity)
            return self.put(key, make())
        self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, entry: V) -> V:
        """Store ``entry`` as the most recently used."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._dropped.pop(key, None)
        while len(self._entries) > self.capacity:
            dropped, old = self._entries.popitem(last=False)
            self._dropped[dropped] = None if self._pin is None else self._pin(old)
        while len(self._dropped) > self.max_capacity:
            self._dropped.popitem(last=False)
        return entry

    def values(self) -> list[V]:
        """The entries, least recently used first."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
        self._dropped.clear()

    def __len__(self) -> int:
        return len(self._entries)
