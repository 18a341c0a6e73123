"""Helpers shared by test modules that must not import Lightning (CI's core-only run collects them
without it; see ``conftest.py``)."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_ndclip import _compat


def use_existing_process_group() -> None:
    """Let a Trainer in a harness worker join the worker's process group, as under torchrun."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", TORCHELASTIC_RUN_ID="harness", MASTER_PORT=os.environ.get("MASTER_PORT", "29999"),
    )


@contextlib.contextmanager
def not_installed(*roots: str) -> Iterator[None]:
    """Inside, the packages ``roots`` (``"transformers"``) are as if not installed: importing them or any of their
    modules raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` finds none of them (a ``None`` in
    ``sys.modules``, Python's own mark for a module that is not there); those imported before are out of
    ``sys.modules`` (put back after)."""
    hidden = {name: module for name, module in sys.modules.items() if name.split(".")[0] in roots}
    for name in hidden:
        del sys.modules[name]
    sys.modules.update(dict.fromkeys(roots))
    try:
        yield
    finally:
        for root in roots:
            sys.modules.pop(root, None)
        sys.modules.update(hidden)


class Float32Ops(_compat.DispatchMode):
    """Records the ops of a float64 model that compute in a lower precision (an eager float32 softmax, a norm or a
    router taken in float32): the one-device reference then carries float32 rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a.dtype for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            low = isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)
            if low and torch.float64 in inputs:  # a float64 activation rounded down
                self.found.add(str(func.overloadpacket.__name__))
        return out


def refused_by_us(error: BaseException) -> bool:
    """Whether ``error`` is lightning_ndclip's refusal (a ValueError raised from inside the package)."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, ValueError) and bool(frames) and "lightning_ndclip" in frames[-1].filename
