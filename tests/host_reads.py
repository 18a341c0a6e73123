"""A mode that fails on any read of a tensor's value by the host, for proving on the CPU that a training step
would not make the host wait for an accelerator.

On an accelerator, the host reading a value (``item``, ``float``/``int``/``bool`` of a tensor, ``tolist``,
``numpy``, ``nonzero``, a boolean-mask index, any op whose output shape depends on values) waits for every
kernel queued before it. On the CPU the same read is free, so the code reads there by design
(``lightning_ndclip.core.agree.host_reads_are_free``); :func:`no_host_reads` turns that off
(``reads_as_on_accelerators``) and raises :class:`HostRead` at the first read, naming the op and where it
happened in our code.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_ndclip._compat import VALUE_READ_OPS, DispatchMode
from lightning_ndclip.core.agree import reads_as_on_accelerators

aten = torch.ops.aten

_VALUE_READS = VALUE_READ_OPS | {  # item(), float(), int(), bool(), a tensor in an `if`; unique()
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
}
"""Ops that return a value to the host, or whose output shape depends on values (the host must read it)."""

_HOST_COPIES = {"tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "item"}


DOCUMENTED_READS = {
    ("ring_attention.py", "_tiles"): "which key tiles of a block are entirely masked (causal or packed), one read per "
    "block, to skip their work",
    ("_pipeline.py", "run"): "whether any stage's pipeline_loss raised, one flag per batch, so that every rank raises",
    ("expert_parallel.py", "__init__"): "how many rows go to each expert-parallel rank: the all-to-all's split sizes "
    "(TokenRoute)",
    ("experts.py", "forward"): "which rows are routed to each local expert (MoE's plain loop)",
    ("unused.py", "_refuse_differences"): "whether the ranks of one FSDP2 reduction reached the same parameters, once "
    "per window: flags made on the host, gathered over a gloo group (UnusedParametersCheck)",
}
"""The host reads the product makes by design in steady state, by (file, function), and why (docs/concepts.md)."""

_HOST_METADATA = ("torch/distributed/device_mesh.py", "torch/distributed/_mesh_layout.py")
"""PyTorch's device meshes keep their ranks in CPU tensors, on every device: reading those waits for no kernel."""


def _allowed() -> bool:
    """A read of a mesh's ranks, or one of the product's documented reads (the innermost frame of ours)."""
    stack = traceback.extract_stack()
    if any(f.filename.endswith(_HOST_METADATA) for f in stack):
        return True
    ours = [f for f in stack if "/lightning_ndclip/" in f.filename]
    return bool(ours) and (ours[-1].filename.rsplit("/", 1)[-1], ours[-1].name) in DOCUMENTED_READS


class HostRead(AssertionError):
    """A tensor's value was read by the host where no read may happen."""


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "lightning_ndclip" in f.filename or "/tests/" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("host_reads.py")]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


class _DispatchReads(DispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        boolean_index = func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        )
        if (func in _VALUE_READS or boolean_index) and not _allowed():
            raise HostRead(f"{func} reads a tensor's value on the host, at {_where()}")
        return func(*args, **kwargs)


class _FunctionReads(TorchFunctionMode):
    """What no dispatch op shows: ``tolist`` and ``numpy`` copy the values out directly."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_COPIES and args and isinstance(args[0], torch.Tensor) and not _allowed():
            raise HostRead(f"Tensor.{name} reads a tensor's value on the host, at {_where()}")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail on any host read inside; the core takes its accelerator paths meanwhile."""
    with reads_as_on_accelerators(), _FunctionReads(), _DispatchReads():
        yield
