"""The fused-projection trap under tensor parallelism, named at the first forward.

``ColwiseParallel`` gives each tensor-parallel rank a contiguous block of a linear layer's output
features: rank ``r`` of ``tp`` holds features ``[r N / tp, (r + 1) N / tp)``. A fused projection whose
output the model splits into its parts, ``q, k, v = self.qkv(h).chunk(3, -1)`` or
``gate, up = self.gate_up(h).chunk(2, -1)``, then splits each rank's block instead of the whole
output: with ``tp = 2`` rank 0's "q", "k" and "v" are the two halves of q and the first half of k. Every
rank computes, consistently, another function from the same weights: the run trains without an
error, and only a comparison with one device shows it.

:func:`refuse_chunked_colwise_outputs` watches one forward (the first step's): a ``ValueError``
names the layer whose local output is chunked or split along the dim ``ColwiseParallel`` splits,
before any gradient is computed. Every rank runs the same code, so every rank raises it at the same
point. A head-major layout split with ``view`` (each rank's block holds whole heads' q, k and v) is
not a chunk and is not refused. Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_ndclip import _compat

__all__ = ["refuse_chunked_colwise_outputs"]

_SPLITS = {torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split, torch.Tensor.tensor_split, torch.tensor_split}
"""Ops that cut a tensor into parts along one dim (``dim`` their third argument or keyword)."""


def _colwise(module: nn.Module, tp_dim: str) -> bool:
    """Whether ``module`` is a linear layer whose weight's output features are split over ``tp_dim``."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    if tp_dim not in names:
        return False
    placement = weight.placements[names.index(tp_dim)]
    return isinstance(placement, (Shard, _compat.StridedShard)) and placement.dim == 0


class _Watch(TorchFunctionMode):
    """Raises when an op of :data:`_SPLITS` cuts a watched tensor (a colwise layer's local output) along
    its last dim."""

    def __init__(self, outputs: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.outputs = outputs  # by id, each kept alive while watched (an id is not reused)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SPLITS and args and id(args[0]) in self.outputs:
            tensor = args[0]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if dim % tensor.dim() == tensor.dim() - 1:
                name = self.outputs[id(tensor)][0]
                parts = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
                raise ValueError(
                    f"{name} is ColwiseParallel (each tensor-parallel rank holds a contiguous block of its output "
                    f"features) and its output is cut into parts along those features ({func.__name__}({parts}, "
                    "dim=-1)): each rank cuts its own block, not the whole output, so a fused projection's parts "
                    "(q, k, v or gate, up) are mixed and the model computes another function. Lay the fused rows out "
                    "per head and split them with view (each rank's block then holds whole heads' q, k and v), or use "
                    "separate projections, each ColwiseParallel (docs: 'A fused qkv projection under tensor "
                    "parallel')"
                )
        return func(*args, **kwargs)


@contextmanager
def refuse_chunked_colwise_outputs(model: nn.Module, tp_dim: str = "tp") -> Iterator[None]:
    """Inside: a ``ValueError`` naming the layer when the local output of a linear layer split by
    ``ColwiseParallel`` over the mesh dim ``tp_dim`` is chunked or split along its last dim (see the
    module docstring). Watch one forward (it costs a Python check per op)."""
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if _colwise(module, tp_dim):

            def record(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                local = isinstance(output, torch.Tensor) and not isinstance(output, DTensor)
                if local and output.shape[-1] < cast(nn.Linear, module).out_features:  # this rank's block, not gathered
                    outputs[id(output)] = (name, output)

            handles.append(module.register_forward_hook(record))
    try:
        if not handles:
            yield
            return
        with _Watch(outputs):
            yield
    finally:
        for handle in handles:
            handle.remove()
