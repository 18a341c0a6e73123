"""Tensor parallelism for the experts of ``transformers``' MoE blocks (Mixtral, Qwen3-MoE, ...).

Those blocks keep all experts in two 3-D weights: ``gate_up_proj [E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``down_proj [E, H, I]``; a router replicated over ``tp`` picks each
token's experts. :class:`PackedExpertsParallel` splits every expert along its intermediate width
``I`` over ``tp``, which is what ``transformers``' ``packed_colwise`` / ``rowwise`` /
``moe_tp_experts`` plan entries ask for:

- ``gate_up_proj`` is ``_StridedShard(1, split_factor=2)``: rank ``r`` of ``tp`` holds rows
  ``[r I/tp, (r+1) I/tp)`` of the gate half *and* of the up half, so that ``chunk(2)`` of its local
  projection is its slice of the gate and the matching slice of the up projection (a plain
  ``Shard(1)`` would give rank 0 the whole gate and rank 1 the whole up: a different function);
- ``down_proj`` is ``Shard(2)``: the matching columns;
- the module runs on its local slices: each rank computes, for every routed token, its part of
  ``down(act(gate) * up)``, a partial sum over ``tp``; the output is summed over ``tp``, and the
  gradients of its floating-point inputs (the hidden states, the routing weights), partial sums
  over ``tp`` too, are summed in backward.

Exact for any top-k routing (every rank routes alike), up to the order of the sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.tensor_parallel import gradient_summed_over, sum_over

__all__ = ["PackedExpertsParallel"]


class PackedExpertsParallel(_compat.ModuleStyle):
    """Split a packed-experts module over ``tp`` along the experts' intermediate width (see the module
    docstring). ``gate_up`` and ``down`` name its two weights; any other parameter is refused.

    Raises:
        ValueError: at ``parallelize_module``, naming the module, when it lacks either weight, holds
            other parameters, has weights of other shapes than ``[E, 2I, H]`` / ``[E, H, I]``, or ``I``
            is not a multiple of the ``tp`` size.
    """

    def __init__(self, gate_up: str = "gate_up_proj", down: str = "down_proj") -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(module, device_mesh.size())
        placements = {self.gate_up: _compat.StridedShard(1, split_factor=2), self.down: Shard(2)}
        for name, placement in placements.items():
            param = getattr(module, name)
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.data, device_mesh, [placement]), param.requires_grad)
            )
        module.register_forward_pre_hook(_Localize(device_mesh, tuple(placements)), with_kwargs=True)
        module.register_forward_hook(_SumOutput(device_mesh, tuple(placements)), always_call=True)
        return module

    def check(self, module: nn.Module, tp: int) -> None:
        """Raise the ``ValueError`` of :meth:`apply` for ``module`` on ``tp`` ranks, if any, before changing anything."""
        kind = type(module).__name__
        own = dict(module.named_parameters(recurse=False))
        others = sorted(set(own) - {self.gate_up, self.down})
        if self.gate_up not in own or self.down not in own or others:
            raise ValueError(
                f"PackedExpertsParallel splits a module holding {self.gate_up!r} and {self.down!r} only; {kind} "
                f"holds {sorted(own)}: give its experts a style of your own"
            )
        gate_up, down = own[self.gate_up], own[self.down]
        experts, hidden, width = down.shape if down.dim() == 3 else (0, 0, 0)
        if tuple(gate_up.shape) != (experts, 2 * width, hidden) or not experts:
            raise ValueError(
                f"PackedExpertsParallel: {kind}.{self.gate_up} {tuple(gate_up.shape)} and {kind}.{self.down} "
                f"{tuple(down.shape)} are not [experts, 2 x intermediate, hidden] and [experts, hidden, intermediate]"
            )
        if width % tp:
            raise ValueError(
                f"PackedExpertsParallel: {kind}'s intermediate width {width} is not a multiple of tp={tp}; each "
                "rank must hold the same slice of the gate and of the up projection"
            )


class _Localize:
    """Forward pre-hook: the inputs' gradients summed over ``tp`` (``gradient_summed_over``), and the
    module's sharded weights seen by its ``forward`` as their local slices (an instance attribute over the
    registered parameter, removed by :class:`_SumOutput`; the parameters themselves stay the DTensors the
    optimizer and FSDP2 see)."""

    def __init__(self, mesh: DeviceMesh, names: tuple[str, ...]) -> None:
        self.mesh, self.names = mesh, names

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name in self.names:
            weight = getattr(module, name)
            object.__setattr__(module, name, weight.to_local() if isinstance(weight, DTensor) else weight)
        args = tuple(gradient_summed_over(a, self.mesh) for a in args)
        return args, {k: gradient_summed_over(v, self.mesh) for k, v in kwargs.items()}


class _SumOutput:
    """Forward hook (also when ``forward`` raised): the parameters back in view, the output (a partial sum
    over ``tp``) summed."""

    def __init__(self, mesh: DeviceMesh, names: tuple[str, ...]) -> None:
        self.mesh, self.names = mesh, names

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        for name in self.names:
            object.__delattr__(module, name)
        return sum_over(output, self.mesh)
