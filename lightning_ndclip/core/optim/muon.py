"""Muon on any mesh: the update of one device, each matrix assembled once.

Muon's update of a matrix ``W`` with gradient ``G`` (torch.optim.Muon's, argument for argument):

    B <- mu B + (1 - mu) G                       (the momentum, as ``lerp``)
    U <- (1 - mu) G + mu B  if nesterov else B
    O <- NS(U)                                   (:func:`~lightning_ndclip.core.optim.orthogonal.newton_schulz`)
    W <- (1 - lr wd) W - lr' O,    lr' = lr * adjust(shape of W)

Everything but ``NS`` is elementwise and runs on each rank's shard as it is. ``NS`` is a function of the whole
matrix: a shard orthogonalized alone is a different update, and the same code on a DTensor is exact only because
DTensor redistributes inside each of its matrix products (15 per matrix with 5 steps). Here each matrix is
assembled once instead: the matrices of a parameter group that share a shape and a layout are stacked, the stack
redistributed so that each rank holds whole matrices (every mesh dim sharding the stack's first dim: the owners
spread over the ranks that shard the matrices and over their replicas, so every rank orthogonalizes about
``1 / mesh size`` of them and each replica set orthogonalizes a matrix once), orthogonalized there one by one, and
redistributed back to the parameters' layout. Two redistributions per stack, whatever the number of matrices. On
one mesh dim (FSDP2 alone) the two are all-to-alls of this module's own, each owner receiving only its matrices'
shards; elsewhere DTensor's ``redistribute`` (on gloo, which has no all-to-all for DTensor, all-gathers).

What is exact: the same ``NS`` of the same whole matrix as on one device. In ``ns_dtype=torch.bfloat16`` (the
default, torch.optim.Muon's) that is torch.optim.Muon's bfloat16 computation, bit for bit on the same device and
input; float64 (``ns_dtype=None`` with float64 parameters) is the one to compare a run against one device's to
rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from lightning_ndclip.core.optim.orthogonal import DEFAULT_COEFFICIENTS, newton_schulz

__all__ = ["Muon"]

AdjustLR = Literal["original", "match_rms_adamw", "spectral_unclamped"]


def _adjusted_lr(lr: float, adjust: AdjustLR | None, rows: int, columns: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for a ``rows x columns`` matrix."""
    if adjust is None or adjust == "original":
        return lr * math.sqrt(max(1.0, rows / columns))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr * math.sqrt(rows / columns)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's shard, which shares its storage)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(Optimizer):
    """torch.optim.Muon's update, exact on any mesh (FSDP2, tensor, expert and pipeline parallel, replicas), at two
    redistributions per group of same-shaped matrices instead of DTensor's communication inside every matrix product.

    The arguments are torch.optim.Muon's, with the same defaults; ``ns_dtype`` is the dtype Newton-Schulz runs in
    (``torch.bfloat16``, torch's; ``None``: the gradient's own, float64 to check a run against one device).
    Parameters are 2-D matrices or 3-D stacks of them (packed MoE experts ``[experts, rows, columns]``: each expert's
    matrix orthogonalized on its own, its learning rate adjusted by its own shape). The others (embeddings, norms,
    biases: torch.optim.Muon leaves them to another optimizer) go in a param group with ``"muon": False``, which is
    stepped by torch.optim.AdamW's update (its ``lr``, ``weight_decay``, ``betas``, ``adamw_eps``): one optimizer
    for the whole module, as Lightning's automatic optimization takes it::

        matrices = [p for n, p in module.named_parameters() if p.ndim >= 2 and "embed" not in n]
        others = [p for n, p in module.named_parameters() if p.ndim < 2 or "embed" in n]
        Muon([{"params": matrices}, {"params": others, "muon": False, "lr": 3e-4, "weight_decay": 0.01}], lr=0.02)

    Raises:
        ValueError: at construction, a parameter that is not 2-D or 3-D (naming it when the parameters are given with
            their names); at a step, a gradient still ``Partial`` over a mesh dim (its reduction has not run), naming
            the parameter and the dim. Either is raised on every rank that holds the parameter.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLR | None = None,
        *,
        ns_dtype: torch.dtype | None = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"Muon({name}={value!r}): must be >= 0")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw", "spectral_unclamped"):
            raise ValueError(
                f"Muon(adjust_lr_fn={adjust_lr_fn!r}): must be None, 'original', 'match_rms_adamw' or 'spectral_unclamped'"
            )
        if not 0 < ns_steps < 100:
            raise ValueError(f"Muon(ns_steps={ns_steps}): must be between 1 and 99")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, muon=True, betas=betas,
            adamw_eps=adamw_eps,
        )  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if group["muon"] and p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon orthogonalizes matrices (2-D) and stacks of them (3-D), and {_name(group, i)} has shape "
                        f"{tuple(p.shape)}: put it in a param group with 'muon': False (AdamW's update; embeddings, "
                        "norms and biases usually are)"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient; returns ``closure()``'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            held = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            if not group["muon"]:
                self._adamw_step([p for _, p in held], group)
                continue
            directions = [self._momentum_direction(p, group, _name(group, i)) for i, p in held]
            orthogonal = _orthogonalized([p for _, p in held], directions, group)
            for (_, p), update in zip(held, orthogonal):
                rows, columns = p.shape[-2:]
                local = _local(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(update, alpha=-_adjusted_lr(group["lr"], group["adjust_lr_fn"], rows, columns))
        return loss

    def _adamw_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch.optim.AdamW's update of a ``"muon": False`` group (elementwise: each rank's shard as it is)."""
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        grads = [cast(torch.Tensor, p.grad) for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["adamw_eps"], maximize=False,
        )  # fmt: skip

    def _momentum_direction(self, p: torch.Tensor, group: dict[str, Any], name: str) -> torch.Tensor:
        """This rank's shard of ``U`` (the module docstring): the momentum updated in place, elementwise."""
        grad = p.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            partial = [dim for dim, placement in zip(grad.device_mesh.mesh_dim_names or (), grad.placements)
                       if placement.is_partial()]  # fmt: skip
            if partial:
                raise ValueError(
                    f"Muon: the gradient of {name} is a partial sum over mesh dim(s) {partial}: its reduction has not "
                    "run (step after backward and the gradient reduction, e.g. after the accumulation window's last "
                    "micro-batch)"
                )
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)  # the gradient's layout: a DTensor for sharded ones
        buffer, grad = _local(state["momentum_buffer"]), _local(grad)
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer


def _name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    return repr(names[index]) if names else f"parameter {index} of its param group"


def _orthogonalized(params: list[torch.Tensor], directions: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
    """``NS`` of each parameter's whole direction, returned as this rank's shard: matrices of one shape and layout
    in one stack (a 3-D parameter is a stack of its own)."""
    stacks: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        layout = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        key = (tuple(p.shape), directions[i].dtype, layout) if p.ndim == 2 else ("stack", i)
        stacks.setdefault(key, []).append(i)
    results: list[torch.Tensor] = list(directions)
    for indices in stacks.values():
        orthogonal = _orthogonalized_stack([params[i] for i in indices], [directions[i] for i in indices], group)
        for i, update in zip(indices, orthogonal):
            results[i] = update
    return results


def _orthogonalized_stack(
    params: list[torch.Tensor], directions: list[torch.Tensor], group: dict[str, Any]
) -> list[torch.Tensor]:
    """``NS`` of matrices of one layout (2-D parameters, or the matrices of one 3-D parameter), each whole on the
    rank that orthogonalizes it; returned as this rank's shards."""

    def orthogonalize(matrices: torch.Tensor) -> torch.Tensor:  # [n, rows, columns], each whole
        dtype = group["ns_dtype"] or matrices.dtype
        done = [newton_schulz(m, coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"],
                              dtype=group["ns_dtype"]) for m in matrices]  # fmt: skip
        return torch.stack(done) if done else matrices.to(dtype)

    first = params[0]
    if not isinstance(first, DTensor):  # whole on this rank
        return [orthogonalize(d if d.ndim == 3 else d.unsqueeze(0)).reshape(d.shape) for d in directions]
    mesh, placements = first.device_mesh, first.placements
    if first.ndim == 2 and mesh.ndim == 1 and type(placements[0]) is Shard:  # FSDP2 alone: the exchange, by hand
        return _exchanged(first.shape, placements[0].dim, directions, mesh.get_group(), orthogonalize)
    shards = [DTensor.from_local(d, mesh, placements, shape=p.shape, stride=p.stride(), run_check=False)
              for p, d in zip(params, directions)]  # fmt: skip
    stack = shards[0] if first.ndim == 3 else cast(DTensor, torch.stack(list[torch.Tensor](shards)))
    owned = stack.redistribute(mesh, [Shard(0)] * mesh.ndim)  # whole matrices, spread over every rank of the mesh
    done = DTensor.from_local(
        orthogonalize(owned.to_local()), mesh, owned.placements, shape=stack.shape, stride=stack.stride(), run_check=False
    )
    back = done.redistribute(mesh, stack.placements).to_local()
    return [back] if first.ndim == 3 else list(back.unbind(0))


def _exchanged(
    shape: torch.Size, dim: int, shards: list[torch.Tensor], group: dist.ProcessGroup,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:  # fmt: skip
    """:func:`_orthogonalized_stack` for matrices of ``shape`` sharded on ``dim`` over one mesh dim (``group``): one
    all-to-all brings each owner every rank's shard of its matrices (the owners: contiguous blocks of the stack, as
    ``Shard(0)`` gives), one takes the results' pieces back. Each rank receives its own matrices only, where DTensor's
    redistribution all-gathers the whole stack on gloo (which has no all-to-all for it)."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    pieces = _chunk_sizes(shape[dim], ranks)  # each rank's rows (dim 0) or columns (dim 1), as Shard(dim) cuts
    owned = _chunk_sizes(len(shards), ranks)
    other = shape[1 - dim]

    def local_shape(rank: int) -> tuple[int, int]:
        return (pieces[rank], other) if dim == 0 else (other, pieces[rank])

    # in: the owners are contiguous blocks in rank order, so this rank's shards in stack order are what it sends
    sent = [owned[r] * pieces[me] * other for r in range(ranks)]
    numels = [owned[me] * pieces[r] * other for r in range(ranks)]
    received = _all_to_all(torch.cat([s.reshape(-1) for s in shards]), sent, numels, group)
    parts = [part.view(owned[me], *local_shape(r)) for r, part in enumerate(received.split(numels))]
    done = orthogonalize(torch.cat(parts, dim=1 + dim))  # [owned here, rows, columns], each whole
    # out: to each rank its piece of every result here; back here, this rank's piece of every matrix, in stack order
    starts = [sum(pieces[:r]) for r in range(ranks)]
    back = torch.cat([done.narrow(1 + dim, starts[r], pieces[r]).reshape(-1) for r in range(ranks)])
    returned = _all_to_all(back, numels, sent, group)
    return list(returned.view(len(shards), *local_shape(me)).unbind(0))


def _chunk_sizes(n: int, ranks: int) -> list[int]:
    """How ``torch.chunk`` (and so ``Shard``) cuts ``n`` over ``ranks``: ``ceil(n / ranks)`` each, the last ones less
    or none."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


def _all_to_all(send: torch.Tensor, sent: list[int], received: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The flat ``send``, its first ``sent[0]`` elements to rank 0 of ``group`` and so on; what each rank sent here
    (``received[r]`` elements from rank ``r``), flat, in rank order. As bytes, so that any dtype travels (gloo has no
    bfloat16)."""
    size = send.element_size()
    out = torch.empty(sum(received) * size, dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(out, send.view(torch.uint8), [n * size for n in received], [n * size for n in sent], group=group)
    return out.view(send.dtype)
