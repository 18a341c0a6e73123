"""No rank raises alone: problems found on some ranks become the same error on every rank.

A rank that raises while the others go on into a collective leaves them waiting (a hang, or a
"connection closed" far from the cause). So user code whose result feeds a collective
(``count_tokens``, ``sample_ids``, ...) runs through :func:`call_hook`, which turns an exception,
or a value the caller cannot use, into a *problem*: a message, not a raise. The caller then
sends one flag per rank (1 for a problem) in the collective that follows anyway (the count
all-reduce carries it beside the counts: no extra collective in steady state), and
:func:`raise_agreed` reads the summed flag: when it is non-zero, every rank gathers the messages
(one ``all_gather_object``, only then) and raises the same error naming each failing rank.

Reading a flag on the host is free on the CPU and a device sync elsewhere, so the core reads only
where :func:`host_reads_are_free`; elsewhere a problem poisons the step's values with NaN instead.
:func:`reads_as_on_accelerators` makes the CPU take the accelerators' path, which the test suite
runs under a mode that fails on any host read, to prove the steady-state step reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "AgreedError", "call_hook", "host_reads_are_free", "raise_agreed", "reads_as_on_accelerators", "run_agreed", "some",
]  # fmt: skip

T = TypeVar("T")
_as_on_accelerators = False


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a value of a tensor on ``device`` costs no device synchronization: on the CPU,
    except inside :func:`reads_as_on_accelerators`."""
    return device.type == "cpu" and not _as_on_accelerators


@contextmanager
def reads_as_on_accelerators() -> Iterator[None]:
    """Within it, the core takes on the CPU the paths it takes on accelerators, where it reads no tensor
    value on the host in steady state (a bad count or a plan disagreement makes the step NaN instead of
    raising). For tests that prove, on the CPU, that the accelerator path never makes the host wait."""
    global _as_on_accelerators
    before, _as_on_accelerators = _as_on_accelerators, True
    try:
        yield
    finally:
        _as_on_accelerators = before


class AgreedError(ValueError):
    """Raised on every rank of a group when some of its ranks met a problem (see the module)."""


def call_hook(what: str, hook: Callable[[], T], check: Callable[[T], Any] | None = None) -> tuple[T | None, str | None]:
    """``(hook(), None)``, or ``(None, problem)`` when ``hook`` raises or ``check(result)`` does
    (``check`` converts or validates the result and returns what the caller uses). ``what`` names the
    call in the message, e.g. ``"count_tokens(batch) of micro-batch 2"``."""
    try:
        value = hook()
        return (value if check is None else check(value)), None
    except Exception as error:  # noqa: BLE001 - every error becomes an agreed one
        return None, f"{what} raised {type(error).__name__}: {error}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(problem: str | None, groups: tuple[dist.ProcessGroup | None, ...]) -> list[tuple[int, str]]:
    """Every rank's problem over ``groups`` (in turn, so all their ranks' reach all of them), by rank."""
    found: list[tuple[int, str]] = [(_rank(), problem)] if problem else []
    for group in groups or (None,):
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, found, group=group)
            found = sorted({entry for entries in gathered for entry in entries})
    return found


def _message(found: list[tuple[int, str]]) -> str:
    return "; ".join(f"rank {rank}: {text}" for rank, text in found)


def raise_agreed(failed: torch.Tensor | int, problem: str | None, *groups: dist.ProcessGroup | None) -> None:
    """After collectives over ``groups`` that summed each rank's problem flag into ``failed``: if it is
    non-zero, raise :class:`AgreedError` on every rank with every rank's problem, by rank (one
    ``all_gather_object`` per group, in turn, so the messages of all their ranks reach all of them;
    no group: the world). Reads ``failed`` on the host: call it where a host read is acceptable."""
    if not int(failed):
        return
    found = _gather(problem, groups)
    outside = "a rank outside this group (a context-parallel peer) met a problem; its own error names it"
    raise AgreedError(_message(found) or outside)


def run_agreed(what: str, fn: Callable[[], T], *groups: dist.ProcessGroup | None) -> T:
    """``fn()`` on every rank of ``groups`` (default: the world), then one exchange of the outcome: if it
    raised on any rank, every rank raises: those where it raised their own exception (its type is part
    of the contract, e.g. Lightning's ``IsADirectoryError``), the others an :class:`AgreedError` naming
    each failing rank and its error. For work outside the steady state (checkpoints): it always costs
    one ``all_gather_object`` per group."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - every error becomes an agreed one
        result, error = None, exc
    found = _gather(None if error is None else f"{what} raised {type(error).__name__}: {error}", groups)
    if error is not None:
        raise error
    if found:
        raise AgreedError(_message(found))
    return result  # type: ignore[return-value]


def some(names: Sequence[str]) -> str:
    """The first five of ``names`` and how many more: the names an error lists."""
    return f"{list(names[:5])}" + (f" (+{len(names) - 5})" if len(names) > 5 else "")
