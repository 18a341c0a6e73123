r"""The MoE load-balancing loss of the *global* micro-batch: routing statistics summed over the data ranks.

transformers' ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` (the auxiliary
loss that ``output_router_logits=True`` adds, times ``router_aux_loss_coef``) is the Switch Transformer
loss of **one forward**. Over the :math:`T` counted tokens of that forward (``attention_mask`` non-zero;
all of them without a mask) and its :math:`L` routed layers (the entries of ``router_logits``), with
:math:`p_{l,t} = \mathrm{softmax}(z_{l,t})` and :math:`\mathrm{top}_K(p_{l,t})` its :math:`K` largest:

.. math::

    c_e = \#\{(l, t, j) : \text{choice } j \text{ of token } t \text{ in layer } l \text{ is } e\},\qquad
    S_e = \sum_{l,t} p_{l,t,e},\qquad
    \mathrm{aux} = E \sum_e \frac{c_e}{LT} \cdot \frac{S_e}{LT}

(:math:`f_e = c_e / LT`, the fraction of (token, choice) pairs routed to expert :math:`e` per routed row,
and :math:`P_e = S_e / LT`, the mean router probability of :math:`e`; both pooled over the layers, as
transformers concatenates them). The selection :math:`c` carries no gradient; :math:`S` does.

Under data parallelism each rank forwards only its part of the global micro-batch, and transformers
forms :math:`f` and :math:`P` from that part: the loss, and its gradient, change with the layout. The
global micro-batch :math:`M` is the concatenation of every data rank's micro-batch (dp x cp ranks:
the context-parallel ranks hold parts of the same sequences; expert-parallel ranks are data ranks too,
and the router runs whole on each). Its loss is

.. math::

    \mathrm{aux}(M) = E \sum_e \frac{c_e}{LT} \cdot \frac{\sum_r S_{r,e}}{LT}
    = \sum_r \underbrace{E \sum_e \frac{c_e}{LT} \cdot \frac{S_{r,e}}{LT}}_{\mathrm{share}_r}

with :math:`c_e = \sum_r c_{r,e}` and :math:`T = \sum_r T_r` summed over the ranks (integers, no
gradient: **one all-reduce** of :math:`L E + 1` int64 per call). Given them, the loss is linear in the
probability sums, so it splits into one **share** per rank: :math:`\mathrm{share}_r` holds only rank
:math:`r`'s own probabilities, the shares add up to :math:`\mathrm{aux}(M)` exactly, and the gradient
of :math:`\mathrm{share}_r` is the part of :math:`\nabla\,\mathrm{aux}(M)` that flows through rank
:math:`r`'s tokens. A data-parallel gradient reduction that SUMs (FSDP2 under this package) adds those
parts into :math:`\nabla\,\mathrm{aux}(M)`: the gradient one device gets from the same micro-batch, on
every mesh. No probability crosses ranks, so no differentiable collective is needed. This is the
package's rule (the mean is in the loss, the reductions are sums) applied to a loss that is no mean over
tokens.

Edge cases: a rank without counted tokens has a zero share and gradient; a global micro-batch without
counted tokens gives 0 (transformers: NaN). Counts are exact int64 (transformers sums them in float32).
Everything stays on the device: no host read.

:func:`load_balancing_loss` returns the share (on one process: the whole loss, equal to transformers'
``aux_loss``); :func:`load_balance` also returns the global per-layer expert load. How a training step
weighs the shares of the micro-batches of an optimizer step (the reference a parallel run equals) is
in ``docs/howto/moe-balancing.md``: with ``NDParallelStrategy``, training_step returns the share under
:data:`LOAD_BALANCING_KEY` and the strategy weighs it :func:`window_share`.

:class:`PooledRouting` lets one process replay the data ranks' micro-batches one after the other with the
statistics they would have summed (``VerifyOneDevice``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_ndclip.core import libraries
from lightning_ndclip.core.parallel.mesh import ParallelMeshes

__all__ = [
    "LOAD_BALANCING_KEY",
    "LoadBalance",
    "PooledRouting",
    "experts_of",
    "load_balance",
    "load_balancing_loss",
    "window_share",
]

LOAD_BALANCING_KEY = "load_balancing_loss"
"""The key of ``training_step``'s output dict under which ``NDParallelStrategy`` takes this rank's share of a
load-balancing loss: added to the loss as :func:`window_share`, not scaled by the micro-batch's tokens."""

_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("lightning_ndclip_routing_scope", default=None)


@dataclass(frozen=True)
class LoadBalance:
    """The load-balancing loss of one forward's routing, and what the data ranks agreed on to form it.

    Attributes:
        loss: this rank's share of :math:`\\mathrm{aux}(M)`, the loss of the global micro-batch (see the
            module); the shares of the ranks of the group add up to it. On one process: the whole loss.
        expert_load: ``[L, E]`` int64, the (token, choice) pairs each expert of each routed layer received,
            summed over the group: the global micro-batch's load.
        tokens: the counted tokens of the global micro-batch (0-dim int64; each layer routes them all).
    """

    loss: torch.Tensor
    expert_load: torch.Tensor
    tokens: torch.Tensor

    @property
    def imbalance(self) -> torch.Tensor:
        """Per layer, the most pairs any expert received over the mean per expert (``[L]``, float32; 1 is a
        perfect balance, ``E / K`` all tokens on the same experts; 0 for a layer that routed nothing)."""
        return max_over_mean(self.expert_load)


def max_over_mean(expert_load: torch.Tensor) -> torch.Tensor:
    """``expert_load.max(-1) / expert_load.mean(-1)`` in float32, 0 where nothing was routed (no host read)."""
    load = expert_load.to(torch.float32)
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.amax(dim=-1) / mean.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def experts_of(config: Any) -> tuple[int, int]:
    """``(num_experts, top_k)`` of a mixture-of-experts model or config, as its library reads them
    (:func:`~lightning_ndclip.core.libraries.expert_routing`; a ``transformers`` one: the model's own
    ``num_experts`` and ``num_experts_per_tok``, else its config's, a multimodal config's ``text_config``)."""
    routing = libraries.expert_routing(config)
    if routing is None:
        raise ValueError(
            f"{type(config).__name__} names no expert count or no top-k that a model library reads (transformers: "
            "num_experts / num_local_experts / n_routed_experts, num_experts_per_tok): pass num_experts=... and top_k=..."
        )
    return routing.num_experts, routing.top_k


def _layers(router_logits: Any, num_experts: int) -> list[torch.Tensor]:
    """Each routed layer's logits as ``[rows, E]`` (a DTensor made whole: the router is replicated)."""
    if router_logits is None:
        raise ValueError("router_logits is None: call the model with output_router_logits=True")
    if isinstance(router_logits, torch.Tensor):  # one layer's
        router_logits = [router_logits]
    layers = [t.full_tensor() if isinstance(t, DTensor) else t for t in router_logits]
    if not layers:
        raise ValueError("router_logits holds no layer")
    for i, t in enumerate(layers):
        if t.shape[-1] != num_experts:
            raise ValueError(f"router_logits[{i}] has {t.shape[-1]} logits per token, not num_experts={num_experts}")
    return [t.reshape(-1, num_experts) for t in layers]


def _local_statistics(
    layers: list[torch.Tensor], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(pairs [L, E] int64, tokens 0-dim int64, probability sums [E])``, as transformers
    selects (softmax in the logits' dtype, top-k of it) and sums (in at least float32)."""
    rows = layers[0].shape[0]
    device = layers[0].device
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device) != 0
        if mask.numel() != rows:
            raise ValueError(
                f"attention_mask has {mask.numel()} entries but the router saw {rows} tokens per layer: pass the mask "
                "of the tokens the model was called on ([batch, sequence])"
            )
    wide = torch.promote_types(layers[0].dtype, torch.float32)
    pairs = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
    sums = torch.zeros(num_experts, dtype=wide, device=device)
    for layer, logits in enumerate(layers):
        if logits.shape[0] != rows:
            raise ValueError(f"router_logits[{layer}] has {logits.shape[0]} tokens, router_logits[0] {rows}")
        probabilities = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probabilities, top_k, dim=-1).indices
        counted = torch.ones_like(chosen) if mask is None else mask.unsqueeze(-1).expand_as(chosen).to(torch.int64)
        pairs[layer].scatter_add_(0, chosen.reshape(-1), counted.reshape(-1))
        wide_probabilities = probabilities.to(wide)
        if mask is not None:
            wide_probabilities = torch.where(mask.unsqueeze(-1), wide_probabilities, 0.0)
        sums = sums + wide_probabilities.sum(dim=0)
    tokens = torch.full((), rows, dtype=torch.int64, device=device) if mask is None else mask.sum()
    return pairs, tokens, sums


def _process_group(group: Any) -> tuple[bool, dist.ProcessGroup | None]:
    """Whether to sum over ``group`` (a group, ``None`` for the world, a 1-D mesh, or a :class:`ParallelMeshes`'
    ``dp_cp`` view): not outside ``torch.distributed`` nor over one rank; and its process group."""
    if isinstance(group, ParallelMeshes):
        group = group["dp_cp"]
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D mesh (e.g. meshes['dp_cp']), got a {group.ndim}-D one")
        group = group.get_group()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return False, None
    return True, group


def load_balance(
    router_logits: Any,
    num_experts: Any = None,
    top_k: int | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    group: Any = None,
) -> LoadBalance:
    """The load-balancing loss of the global micro-batch (this rank's share of it) and the global expert load.

    Args:
        router_logits: the model output's ``router_logits`` (``output_router_logits=True``): one ``[tokens,
            E]`` (or ``[batch, sequence, E]``) tensor per routed layer.
        num_experts: ``E``; or a transformers model or config, which gives ``E`` and ``top_k``
            (:func:`experts_of`).
        top_k: ``K``, the experts each token is routed to.
        attention_mask: ``[batch, sequence]``; tokens where it is 0 are not counted (padding). Under
            context parallelism: this rank's part of it, as given to the model.
        group: the data ranks whose micro-batches make the global micro-batch: every rank that holds other
            tokens (dp x cp; not tp or pp peers, which hold the same). A process group, a 1-D mesh, or the
            strategy's :class:`~lightning_ndclip.core.parallel.mesh.ParallelMeshes` (its ``dp_cp`` view).
            Default: the world (none outside ``torch.distributed``).

    Collective over ``group`` (one all-reduce), unless a :class:`PooledRouting` pass is active.
    """
    if top_k is None:
        num_experts, top_k = experts_of(num_experts)
    elif not isinstance(num_experts, int):
        num_experts = experts_of(num_experts)[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1 .. num_experts={num_experts}")
    layers = _layers(router_logits, num_experts)
    pairs, tokens, sums = _local_statistics(layers, num_experts, top_k, attention_mask)
    local = torch.cat([pairs.flatten(), tokens.reshape(1)])
    scope = _SCOPE.get()
    if scope is not None:
        summed = scope.totals(local)
    else:
        summed = local.clone()
        reduce, process_group = _process_group(group)
        if reduce:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=process_group)
    expert_load, total = summed[:-1].reshape(pairs.shape), summed[-1]
    rows = (total * len(layers)).clamp(min=1).to(sums.dtype)  # L T: each layer routes every counted token
    fractions = expert_load.sum(dim=0).to(sums.dtype) / rows
    share = num_experts * (fractions * (sums / rows)).sum()
    return LoadBalance(loss=share, expert_load=expert_load, tokens=total)


def load_balancing_loss(
    router_logits: Any,
    num_experts: Any = None,
    top_k: int | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    r"""This rank's share of transformers' load-balancing loss of the global micro-batch (the concatenation of
    the micro-batches of every rank of ``group``): :attr:`LoadBalance.loss` of :func:`load_balance`, whose
    arguments it takes. On one process it equals transformers' ``load_balancing_loss_func`` (the model output's
    ``aux_loss``; counts exact, sums in at least float32). Multiply by ``router_aux_loss_coef`` as the model
    does; the shares' gradients, summed over ``group`` (a SUM reduction), are the one-device gradient."""
    return load_balance(router_logits, num_experts, top_k, attention_mask, group=group).loss


def window_share(share: torch.Tensor, micro_batches: int, source: str = "training_step") -> torch.Tensor:
    r"""A load-balancing share's part of its optimizer step's loss: ``share / micro_batches``, the mean over the
    ``micro_batches`` micro-batches of the accumulation window (what ``NDParallelStrategy`` adds to the token-mean
    share of the loss for :data:`LOAD_BALANCING_KEY`, unscaled by tokens).

    The step's loss is then :math:`\frac{1}{N}\sum_i \ell_i + \frac{1}{m}\sum_{j=1}^{m} \mathrm{coef} \cdot
    \mathrm{aux}(M_j)`: the exact token mean of the window and the mean of the load-balancing losses of its
    :math:`m` global micro-batches, on every mesh."""
    if not isinstance(share, torch.Tensor) or share.dim() != 0:
        got = type(share).__name__ if not isinstance(share, torch.Tensor) else f"a tensor of shape {tuple(share.shape)}"
        raise ValueError(f"{source}'s {LOAD_BALANCING_KEY!r} must be a 0-dim tensor (this rank's share), got {got}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    return share / micro_batches


class _Scope:
    """Where :func:`load_balance` takes the summed statistics from instead of an all-reduce."""

    def totals(self, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PooledRouting(_Scope):
    """One process standing in for the data ranks of a parallel run, replaying their micro-batches one after
    the other (``VerifyOneDevice``): the pieces of one global micro-batch (its data ranks' micro-batches) are
    forwarded twice, first inside :meth:`record` (their statistics are summed, by ``key`` and by the order of
    the calls within a piece), then inside :meth:`apply`, where each call forms its share with the summed
    statistics: the shares of the pieces add up to the global micro-batch's loss, and their gradients to its
    gradient. No collective is issued inside either.

    Usage::

        pool = PooledRouting()
        for key, piece in pieces:          # key: the micro-batch's index in its window
            with pool.record(key):
                step(piece)                # losses discarded
        if pool.used:
            for key, piece in pieces:
                with pool.apply(key):
                    step(piece).backward()
    """

    def __init__(self) -> None:
        self._summed: dict[Hashable, list[torch.Tensor]] = {}
        self._mode: str | None = None
        self._key: Hashable = None
        self._call = 0

    @property
    def used(self) -> bool:
        """Whether any call was recorded."""
        return bool(self._summed)

    @contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """One piece of the global micro-batch ``key``: its calls add their statistics (and use their own)."""
        with self._entered("record", key):
            yield

    @contextmanager
    def apply(self, key: Hashable) -> Iterator[None]:
        """One piece of the global micro-batch ``key`` again: its calls use the statistics summed by :meth:`record`."""
        with self._entered("apply", key):
            yield

    @contextmanager
    def _entered(self, mode: str, key: Hashable) -> Iterator[None]:
        self._mode, self._key, self._call = mode, key, 0
        token = _SCOPE.set(self)
        try:
            yield
        finally:
            _SCOPE.reset(token)
            self._mode = None

    def totals(self, local: torch.Tensor) -> torch.Tensor:
        calls = self._summed.setdefault(self._key, [])
        index, self._call = self._call, self._call + 1
        if self._mode == "record":
            if index == len(calls):
                calls.append(local.detach().clone())
            elif calls[index].shape != local.shape:
                seen = f"{local.numel() - 1} (layer, expert) counts, before {calls[index].numel() - 1}"
                raise ValueError(f"load-balancing call {index} of micro-batch {self._key!r} saw {seen}")
            else:
                calls[index] = calls[index] + local
            return local
        if index >= len(calls) or calls[index].shape != local.shape:
            where = f"load-balancing call {index} of micro-batch {self._key!r}"
            raise ValueError(f"{where} was not recorded alike: the replay differs")
        return calls[index]


class _Alone(_Scope):
    def totals(self, local: torch.Tensor) -> torch.Tensor:
        return local


@contextmanager
def alone() -> Iterator[None]:
    """Within it, :func:`load_balance` sums over no rank (this process holds the whole micro-batch), whatever its
    ``group``, unless a :class:`PooledRouting` pass is active."""
    if in_pooled_replay():
        yield
        return
    token = _SCOPE.set(_Alone())
    try:
        yield
    finally:
        _SCOPE.reset(token)


def in_pooled_replay() -> bool:
    """Whether a :class:`PooledRouting` pass is active (a one-process replay: no collective, nothing to log)."""
    return isinstance(_SCOPE.get(), PooledRouting)
