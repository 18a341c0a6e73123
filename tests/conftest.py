"""Pytest wiring for the multi-rank harness (see ``harness.py``)."""

from collections.abc import Iterator

import harness
import pytest


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools() -> Iterator[None]:
    """Kill the harness's worker pools when the test session ends."""
    yield
    harness.shutdown_all()
