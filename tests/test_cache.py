"""The plan cache: a least-recently-used cache that grows when dropped keys come back."""

from __future__ import annotations

from lightning_ndclip.core.norm._cache import GrowingLRU


def _round(cache: GrowingLRU, keys) -> int:
    made = []
    for k in keys:
        cache.get(k, lambda k=k: made.append(k) or k)
    return len(made)


def test_a_cycle_longer_than_the_capacity_settles_after_the_capacity_has_grown():
    cache: GrowingLRU[int] = GrowingLRU(capacity=4, max_capacity=64)
    makes = [_round(cache, range(40)) for _ in range(5)]
    assert makes[0] == 40 and makes[-1] == 0, makes
    assert 40 <= cache.capacity <= 64


def test_a_fixed_capacity_misses_on_every_call_of_such_a_cycle():
    cache: GrowingLRU[int] = GrowingLRU(capacity=4, max_capacity=4)
    assert [_round(cache, range(40)) for _ in range(3)] == [40, 40, 40]


def test_keys_that_never_come_back_do_not_grow_it():
    cache: GrowingLRU[int] = GrowingLRU(capacity=4, max_capacity=64)
    _round(cache, range(1000))
    assert cache.capacity == 4 and len(cache) == 4


def test_recent_entries_are_kept_and_put_replaces():
    cache: GrowingLRU[str] = GrowingLRU(capacity=2)
    cache.get("a", lambda: "A")
    cache.get("b", lambda: "B")
    cache.get("a", lambda: "never")  # "a" is now the most recent
    cache.get("c", lambda: "C")  # drops "b"
    assert cache.values() == ["A", "C"]
    cache.put("a", "A2")
    assert cache.values() == ["C", "A2"]


def test_the_previous_key_is_found_by_comparison_and_stays_the_most_recent():
    """get() compares with the previous call's key first (no hashing): the same answers as the plain LRU, and the
    entry it returns is the most recently used, so the order of drops is unchanged."""
    cache: GrowingLRU[str] = GrowingLRU(capacity=2)
    made = []
    for key in ["a", "a", "b", "a", "c", "b"]:  # "c" drops "b" (the least recent); its return doubles the capacity
        cache.get((key, 1), lambda key=key: made.append(key) or key.upper())
    assert made == ["a", "b", "c", "b"] and cache.values() == ["A", "C", "B"] and cache.capacity == 4
    cache.clear()
    assert cache.get(("c", 1), lambda: "new") == "new"  # nothing stale after clear
