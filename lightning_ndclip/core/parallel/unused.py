"""Parameters that some ranks use and others do not, under FSDP2: exact gradients, no hang.

FSDP2 gathers each unit's parameters with one collective when the unit's forward starts, and reduces
the gradients its parameters got on this rank with one reduce-scatter when the unit's backward ends.
A model whose graph changes from batch to batch (a vision tower on a text-only batch, a layer a
data-dependent branch skips, an adapter used for some tasks) breaks both where the ranks' batches
differ: ranks that used different parameters of a unit reduce-scatter different sizes (gloo aborts,
NCCL hangs or sums the wrong elements), a rank whose graph never reaches a unit's output skips that
unit's reduce-scatter (the others wait), and a unit that some ranks run and others skip shifts every
later all-gather by one (when two units have the same size, each rank silently gets another unit's
parameters).

:class:`UnusedParameters` makes the first two exact and turns the third into an error:

* Every forward of an FSDP2 unit first agrees, with one host-side all-gather of the unit's index, that
  every rank is about to run the same unit (and at the end of the step, that every rank has finished):
  otherwise a ``ValueError`` on every rank names the unit each rank was at. Such a module cannot be
  its own unit; left in the unit around it, its parameters are gathered by every rank.
* Before backward (:meth:`UnusedParameters.prepare_backward`), the loss's autograd graph is walked for
  the (unsharded) parameters and the unit outputs it reaches; one all-reduce (MAX) of those flags over
  the ranks says what any rank reaches. A parameter some rank reaches and this one does not gets a
  zero gradient here, and a unit output some rank reaches and this one does not gets a path of zero
  gradient into the loss: every rank then runs the same units' backward and reduces the same gradients,
  so each gradient is the exact sum over the ranks that used the parameter (a plain sum of the real
  gradients and zeros). A parameter no rank used keeps no gradient, as on one device, so an optimizer
  (AdamW's weight decay, its moments) treats it as one device's would.

Gradients must be reduced at every backward (no accumulation without reduction,
``set_requires_gradient_sync(False)``): what a rank accumulated unreduced is invisible to the others.

:class:`UnusedParametersCheck` is the cheap half, for a model whose graph should not change (what
``NDParallelStrategy`` runs without ``find_unused_parameters``): it changes nothing and raises a
``ValueError`` on every rank, naming the parameters and the ranks, before a reduction the ranks
would enter with different gradients, instead of gloo's size mismatch or an NCCL hang. Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_ndclip import _compat

__all__ = ["UnusedParameters", "UnusedParametersCheck"]

_DONE = -1
"""The position a rank reports once its forward is over (units report their index, from 0)."""


class _ZeroPath(torch.autograd.Function):
    """``loss`` unchanged, with a zero gradient sent to each of ``outputs``: their units' backward (and
    reduce-scatter) runs on this rank, adding nothing (whatever their values, NaN included)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in outputs]
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.outputs))


class UnusedParameters:
    """Exact gradients for the FSDP2 units of ``model`` when the ranks' graphs differ (see the module
    docstring). Hooks every unit of ``model``; checks only inside :meth:`forward`.

    Args:
        model: the model, its FSDP2 units applied (``fully_shard``).
        group: the ranks that run ``model`` together (default: the world), a group whose collectives run
            on the host (gloo): the checks read their results without waiting for the accelerator.
    """

    reduces_every_backward = True
    """Whether FSDP2 must reduce at every backward (no accumulation without reduction): it must, see the module
    docstring."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.units = [(name or type(model).__name__, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        self._checking = False
        self._outputs: list[list[torch.Tensor]] = [[] for _ in self.units]
        self._handles: list[Any] = []
        for index, (_, unit) in enumerate(self.units):
            module: nn.Module = unit  # type: ignore[assignment]  # an FSDPModule is the module it was made from
            self._handles.append(module.register_forward_pre_hook(self._before_unit(index), prepend=True))
            self._handles.append(module.register_forward_hook(self._after_unit(index)))

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """The step's forward: every unit's forward checked against the other ranks', and at the end,
        that every rank is done."""
        self._checking = True
        self._outputs = [[] for _ in self.units]
        try:
            yield
            self._agree(_DONE)
        finally:
            self._checking = False

    def _before_unit(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._checking:
                self._agree(index)

        return hook

    def _after_unit(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._checking:
                leaves = _compat.tree_leaves(output)
                self._outputs[index] += [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]

        return hook

    def _agree(self, position: int) -> None:
        """Raise on every rank unless every rank is at ``position`` (a unit's index, or :data:`_DONE`)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = torch.tensor([position], dtype=torch.int64)
        everyone = torch.empty(dist.get_world_size(self.group), dtype=torch.int64)
        dist.all_gather_into_tensor(everyone, mine, group=self.group)
        positions = everyone.tolist()
        if len(set(positions)) == 1:
            return
        where = {
            rank: "had finished its forward" if p == _DONE else f"was about to run the FSDP2 unit {self.units[p][0]!r}"
            for rank, p in enumerate(positions)
        }
        unit = next(self.units[p][0] for p in positions if p != _DONE)
        raise ValueError(
            "the ranks ran different FSDP2 units in this step: "
            + "; ".join(f"rank {rank} {what}" for rank, what in where.items())
            + f". FSDP2 gathers each unit's parameters with one collective in the order the units run, so a module "
            f"that some ranks run and others skip ({unit!r}) cannot be a unit of its own: leave it out of "
            "ParallelPlan(fsdp_units) (or do not fully_shard it in configure_model), so that it belongs to the unit "
            "around it, which every rank runs; its gradients are then exact"
        )

    def prepare_backward(self, loss: torch.Tensor, reduces: bool = True) -> torch.Tensor:
        """Before ``loss.backward()``: give this rank the zero gradients and zero paths that make every rank
        reduce the same gradients of the same units (one all-reduce). Returns the loss to call backward on
        (``loss`` itself, or equal to it with the zero paths attached). ``reduces``: must be true (see
        :attr:`reduces_every_backward`)."""
        if not reduces:
            raise ValueError("UnusedParameters needs FSDP2 to reduce the gradients at every backward")
        parameters = [p for _, unit in self.units for p in _compat.fsdp_unsharded_parameters(unit)]
        reached_parameters, reached_nodes = _reached(loss)
        outputs = [[o for o in outs if o.grad_fn in reached_nodes] for outs in self._outputs]
        local = torch.tensor(
            [p is not None and (id(p) in reached_parameters or p.grad is not None) for p in parameters]
            + [bool(outs) for outs in outputs],
            dtype=torch.uint8,
        )
        anywhere = local.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.group)
        missing = (anywhere > local).tolist()
        with torch.no_grad():
            for parameter, absent in zip(parameters, missing):
                if absent and parameter is not None and parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)
        dangling = [t for outs, absent in zip(self._outputs, missing[len(parameters) :]) if absent for t in outs]
        self._outputs = [[] for _ in self.units]
        if dangling:
            if not any(t.requires_grad for t in dangling):
                return loss
            return _ZeroPath.apply(loss, *dangling)
        return loss


class UnusedParametersCheck:
    """Refuses, on every rank, a backward before which the ranks that reduce an FSDP2 unit's gradients together
    would bring gradients of different parameters of it: one used a parameter (a vision tower on an image batch)
    that another did not (the same tower on a text-only batch). Changes nothing; never a false refusal where FSDP2
    reduces the same gradients on every rank.

    Every backward walks the loss's autograd graph for the units' (unsharded) parameters it reaches, kept over the
    backwards that accumulate without reducing (a parameter reached in any of them has a gradient to reduce); the
    backward that reduces all-gathers those flags over ``group`` (a byte per parameter, once per accumulation
    window) and compares them within each unit's reduction ranks. Cost measured in ``benchmarks/bench_unused.py``.

    Args:
        model: the model, its FSDP2 units applied (``fully_shard``); the same units on every rank.
        group: every rank of the world, a group whose collectives run on the host (gloo; default: the world's, when
            it is gloo): the check reads its result without waiting for the accelerator.
    """

    reduces_every_backward = False
    """Whether FSDP2 must reduce at every backward: no, a window's backwards may accumulate (the check keeps what they
    reached)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.units = [(name or type(model).__name__, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        named = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        self._names: list[str] = []
        self._unit_of: list[int] = []
        keys = []
        for index, (_, unit) in enumerate(self.units):
            parameters, ranks = _compat.fsdp_unit_layout(unit)
            self._names += [named.get(id(p), f"{self.units[index][0]}[{i}]") for i, p in enumerate(parameters)]
            self._unit_of += [index] * len(parameters)
            keys.append(min(ranks, default=-1) if len(ranks) > 1 else -1)  # -1: reduced over no other rank
        self._reached = torch.zeros(len(self._names), dtype=torch.bool)
        world = dist.get_world_size(group)
        everyone = torch.empty(world * len(keys), dtype=torch.int64)
        dist.all_gather_into_tensor(everyone, torch.tensor(keys, dtype=torch.int64), group=group)
        # [rank, parameter]: the lowest rank of the ranks that reduce it together with that rank (-1: none)
        self._peers = everyone.view(world, len(keys))[:, self._unit_of]
        self._active = bool((self._peers >= 0).any())

    def forward(self) -> AbstractContextManager[None]:
        """The step's forward: nothing to check there."""
        return nullcontext()

    def prepare_backward(self, loss: torch.Tensor, reduces: bool) -> torch.Tensor:
        """Before ``loss.backward()``: note the unit parameters it reaches; where this backward reduces (``reduces``,
        the same on every rank), raise ``ValueError`` on every rank if the ranks of one reduction reached different
        ones since the last reduction. Returns ``loss``."""
        if not self._active:
            return loss
        parameters = [p for _, unit in self.units for p in _compat.fsdp_unsharded_parameters(unit)]
        reached, _ = _reached(loss)
        self._reached |= torch.tensor([p is not None and id(p) in reached for p in parameters], dtype=torch.bool)
        if reduces:
            mine, self._reached = self._reached.to(torch.uint8), torch.zeros_like(self._reached)
            everyone = torch.empty(self._peers.shape[0] * len(mine), dtype=torch.uint8)
            dist.all_gather_into_tensor(everyone, mine, group=self.group)
            self._refuse_differences(everyone.view(self._peers.shape))
        return loss

    def _refuse_differences(self, reached: torch.Tensor) -> None:
        """Raise where ranks of one reduction (equal ``_peers`` entries, not -1) differ in ``reached`` ([rank,
        parameter])."""
        if bool((reached == reached[0]).all()):
            return
        world = reached.shape[0]
        groups = self._peers.masked_fill(self._peers < 0, world)  # a row of its own for "reduced with no other rank"
        flags, empty = reached.to(torch.int64), torch.zeros(world + 1, reached.shape[1], dtype=torch.int64)
        high = empty.scatter_reduce(0, groups, flags, "amax", include_self=False)
        low = empty.scatter_reduce(0, groups, flags, "amin", include_self=False)
        split = (high != low)[:world]  # [group, parameter]
        bad = split.any(0).nonzero().flatten().tolist()
        if not bad:
            return
        first = bad[0]
        ranks = [r for r in range(world) if self._peers[r, first] >= 0 and split[self._peers[r, first], first]]
        used = [r for r in ranks if reached[r, first]]
        skipped = [r for r in ranks if not reached[r, first]]
        names = [self._names[j] for j in bad]
        raise ValueError(
            f"the backward reached {names[:6]}{' ...' if len(names) > 6 else ''} (FSDP2 unit "
            f"{self.units[self._unit_of[first]][0]!r}) on ranks {used} but not on ranks {skipped} since the gradients "
            "were last reduced: FSDP2 would reduce gradients of different parameters over ranks that reduce them "
            "together (gloo aborts with a size mismatch, NCCL hangs). A model whose graph changes from batch to batch "
            "(a vision tower on text-only micro-batches, a branch some batches skip, an adapter used for some tasks) "
            "needs NDParallelStrategy(find_unused_parameters=True) (in a loop of one's own: "
            "lightning_ndclip.core.parallel.unused.UnusedParameters): each such gradient is then the exact sum over "
            "the ranks that used it, as on one device"
        )


def _reached(loss: torch.Tensor) -> tuple[set[int], set[Any]]:
    """The ids of the tensors whose gradients ``loss``'s backward accumulates (parameters), and the graph's nodes."""
    nodes: set[Any] = set()
    variables: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            variables.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return variables, nodes
