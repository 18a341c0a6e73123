"""Whether a step did context-parallel work: cut a sequence along cp
(:func:`~lightning_ndclip.core.context.attention.shard_sequence`) or attended over a cut one
(:func:`~lightning_ndclip.core.context.attention.context_parallel_attention`,
:func:`~lightning_ndclip.core.context.ring_attention.ring_attention`; a library's attention routed there).

A step under ``cp > 1`` that did neither computed the whole sequence on every cp rank: its numbers are right and
context parallelism was a silent no-op (twice the ranks for nothing). ``NDParallelStrategy`` watches its first
training step with :func:`watch` and refuses such a step on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["WorkSeen", "note", "watch"]


class WorkSeen:
    """What a :func:`watch` saw: how many sequence cuts and context-parallel attentions ran inside it."""

    def __init__(self) -> None:
        self.count = 0


_WATCHING: list[WorkSeen] = []


@contextmanager
def watch() -> Iterator[WorkSeen]:
    """Count the context-parallel work done inside the block (in this process)."""
    seen = WorkSeen()
    _WATCHING.append(seen)
    try:
        yield seen
    finally:
        _WATCHING.remove(seen)


def note() -> None:
    """Record one piece of context-parallel work (called by the functions that do it). Not inside code being
    compiled (a compiled block's attention): the step's cut, outside the blocks, is seen."""
    if torch.compiler.is_compiling():
        return
    for seen in _WATCHING:
        seen.count += 1
