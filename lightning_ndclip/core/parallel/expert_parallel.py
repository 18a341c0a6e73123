"""Expert parallelism: whole experts per ``ep`` rank, each (token, choice) pair sent to its expert's owner.

:class:`TokenRoute` is the exchange itself, shared by the package's own :class:`~lightning_ndclip.core.experts.MoE`
and by :class:`ExpertParallel`: the pairs sorted by the rank owning their expert (experts are contiguous per
rank: rank ``r`` of ``ep`` owns experts ``[r E/ep, (r+1) E/ep)``), one all-to-all of the counts (host ints:
the split sizes), then differentiable all-to-alls there (:meth:`TokenRoute.send`) and back
(:meth:`TokenRoute.receive`), whose backward sends the gradients the same ways. Dropless: every pair reaches
its expert, however uneven the split; a rank that receives no pair still joins every collective.

:class:`ExpertParallel` applies it to a *packed-experts* module, as ``transformers``' MoE families have them
(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, GLM-4-MoE, ERNIE-4.5-MoE, ...): every weight holds all
``E = module.num_experts`` experts along dim 0 (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, GPT-OSS's
biases ``[E, ...]``), and the module is called as ``experts(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``, returning each token's routing-weighted sum over its ``k`` experts,

    y_t = sum_j w_tj f_{e_tj}(x_t).

Its weights become DTensors ``Shard(0)`` over ``ep`` (``E/ep`` whole experts per rank). A call sends every pair
``(t, j)`` (the row ``x_t``, the expert ``e_tj``, the weight ``w_tj``) to the owner of ``e_tj``, which runs the
module's own ``forward`` on what it received (``k = 1``, local expert ids, its local weights, ``num_experts``
set to ``E/ep`` for the call), and sends each ``w_tj f_{e_tj}(x_t)`` back, where the ``k`` results of a token
are summed (the routing weights travel with the rows, in the rows' dtype: the hidden states' dtype, which
``transformers``' routers return them in). So the function is the module's own, exactly (up to the order of the
``k``-term sums), and so are the gradients: the routing weights' flows back to the router through the exchange,
and an expert's gradient, on its owner, sums over the pairs of every rank of the ``ep`` group. Sum the expert
gradients over the ranks holding the same experts too: ``fully_shard`` the module over the ``edp`` mesh (SUM
reduction), as
:func:`~lightning_ndclip.core.parallel.plan.parallelize` does.

On a 2-D ``(ep, tp)`` mesh each expert is also split along its intermediate width over ``tp``, as
:class:`~lightning_ndclip.core.parallel.expert_tensor_parallel.PackedExpertsParallel` splits it (``gate_up_proj``
``_StridedShard(1, split_factor=2)``, ``down_proj`` ``Shard(2)``): the ``tp`` ranks, which hold the same tokens,
exchange them alike within their own ``ep`` groups, each runs its width slice of the received pairs' experts, the
results (partial sums over ``tp``) are summed over ``tp`` before they go back, and so are, in backward, the
gradients of what was received.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.expert_tensor_parallel import PackedExpertsParallel
from lightning_ndclip.core.parallel.tensor_parallel import gradient_summed_over, sum_over

__all__ = ["ExpertParallel", "TokenRoute"]


class TokenRoute:
    """Where each (token, choice) pair of this rank goes: to the ``ep`` rank owning its expert.

    Args:
        expert: the global expert id of each pair, ``[P]``.
        per_rank: experts per ``ep`` rank (``E / ep``).
        group: the ``ep`` process group.

    Attributes:
        received_expert: the global expert ids of the pairs this rank received, ``[R]``, grouped by sender.
    """

    def __init__(self, expert: torch.Tensor, per_rank: int, group: dist.ProcessGroup) -> None:
        self.group = group
        self.order = torch.argsort(expert, stable=True)  # grouped by owner: experts are contiguous per rank
        send_counts = torch.bincount(expert // per_rank, minlength=dist.get_world_size(group))
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        self.sent, self.received = send_counts.tolist(), recv_counts.tolist()  # split sizes are host ints
        self.received_expert = expert.new_empty(sum(self.received))
        dist.all_to_all_single(self.received_expert, expert[self.order], self.received, self.sent, group=group)

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (one per pair, in the order of ``expert``) as the owners receive them (differentiable)."""
        return _compat.all_to_all_autograd(rows[self.order].contiguous(), self.received, self.sent, self.group)

    def receive(self, results: torch.Tensor) -> torch.Tensor:
        """The owners' ``results`` (one per received pair) back on the pairs' ranks, in the order of ``expert``."""
        back = _compat.all_to_all_autograd(results.contiguous(), self.sent, self.received, self.group)
        return back.new_zeros(back.shape).index_copy(0, self.order, back)


class ExpertParallel(_compat.ModuleStyle):
    """Shard a packed-experts module's experts over ``ep``, whole experts per rank, and route its tokens to
    them (see the module docstring). ``parallelize_module(experts, meshes["ep"], ExpertParallel())``; on a 2-D
    ``(ep, tp)`` mesh every expert is split over ``tp`` along its intermediate width too.

    Args:
        weights: the module's expert weights (each ``[num_experts, ...]``); default: all its parameters. On an
            ``(ep, tp)`` mesh they must be ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.

    Raises:
        ValueError: at ``parallelize_module``, naming the module, when it has no int ``num_experts``, holds a
            parameter that is no expert weight (one per expert along dim 0; a weight shared by all experts would
            get a partial gradient on each ``ep`` rank) or ``ep`` does not divide ``num_experts``; on an
            ``(ep, tp)`` mesh, when its weights are not the two ``PackedExpertsParallel`` splits, or ``tp`` does not
            divide their width.
    """

    def __init__(self, weights: Sequence[str] | None = None) -> None:
        super().__init__()
        self.weights = None if weights is None else tuple(weights)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep_mesh, tp_mesh = (device_mesh, None) if device_mesh.ndim == 1 else (device_mesh["ep"], device_mesh["tp"])
        names, experts = self._check(module, ep_mesh.size())
        placements: dict[str, list[Any]] = {name: [Shard(0)] for name in names}
        if tp_mesh is not None:
            splits = _width_splits(module, names, tp_mesh.size())
            placements = {name: [Shard(0), splits[name]] for name in names}
        for name in names:
            param = getattr(module, name)
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.data, device_mesh, placements[name]), param.requires_grad)
            )
        dispatch = _Dispatch(module, ep_mesh, tp_mesh, names, experts)
        module.register_forward_pre_hook(dispatch.before, with_kwargs=True)
        module.register_forward_hook(dispatch.after, always_call=True)
        return module

    def _check(self, module: nn.Module, ep: int) -> tuple[tuple[str, ...], int]:
        kind = type(module).__name__
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool):
            raise ValueError(f"ExpertParallel: {kind} has no int num_experts, the count of the experts its weights hold")
        own = dict(module.named_parameters())
        names = tuple(own) if self.weights is None else self.weights
        missing = sorted(set(names) - set(own))
        shared = sorted(n for n in own if n not in names or own[n].dim() == 0 or own[n].shape[0] != experts)
        if missing or shared:
            raise ValueError(
                f"ExpertParallel: {kind} {f'lacks {missing}' if missing else f'holds {shared}, not one per expert'} "
                f"(an expert weight is [num_experts={experts}, ...]): a weight every expert shares would get a partial "
                "gradient on each ep rank; give this module a style of your own, or train it with ep=1"
            )
        if experts % ep:
            raise ValueError(f"ExpertParallel: {kind} holds {experts} experts, which ep={ep} does not divide")
        return names, experts


def _width_splits(module: nn.Module, names: tuple[str, ...], tp: int) -> dict[str, Any]:
    """The ``tp`` placement of each expert weight: :class:`PackedExpertsParallel`'s width split, after its checks."""
    style = PackedExpertsParallel()
    if set(names) != {style.gate_up, style.down}:
        raise ValueError(
            f"ExpertParallel on ep x tp splits the experts' width as PackedExpertsParallel does, over {style.gate_up!r} "
            f"and {style.down!r}; {type(module).__name__}'s expert weights are {sorted(names)}: train it with tp=1"
        )
    style.check(module, tp)
    return {style.gate_up: _compat.StridedShard(1, split_factor=2), style.down: Shard(2)}


class _Dispatch:
    """The two hooks of one packed-experts module: ``before`` sends the pairs to their experts' owners and hands
    the module's ``forward`` what this rank received (with its local weights); ``after`` sends the results back
    and sums each token's. A call's route is kept on a stack between the two (a recomputation in backward, under
    activation checkpointing, is a call of its own). With a ``tp`` mesh, the received pairs' gradients and the
    results are summed over it."""

    def __init__(
        self, module: nn.Module, mesh: DeviceMesh, tp_mesh: DeviceMesh | None, names: tuple[str, ...], experts: int
    ) -> None:
        self.group, self.tp_mesh, self.names, self.experts = mesh.get_group(), tp_mesh, names, experts
        self.per_rank = self.experts // mesh.size()
        self.first = mesh.get_local_rank() * self.per_rank
        self.signature = inspect.signature(module.forward)
        self.calls: list[tuple[TokenRoute, torch.Tensor, torch.Size, torch.Tensor]] = []  # route, pairs' tokens, shape, received

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self.signature.bind(*args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[:3]
        rows = hidden.reshape(-1, hidden.shape[-1])
        token = torch.arange(rows.shape[0], device=rows.device).repeat_interleave(index.shape[-1])
        route = TokenRoute(index.reshape(-1), self.per_rank, self.group)
        # one exchange for rows and routing weights: two would be two all-to-alls in backward, whose order autograd
        # may choose differently on each rank
        received = route.send(torch.cat([rows[token], weights.reshape(-1, 1).to(rows.dtype)], dim=-1))
        self.calls.append((route, token, hidden.shape, received))
        if self.tp_mesh is not None:  # each tp rank's width slice gives a partial gradient of what it received
            received = gradient_summed_over(received, self.tp_mesh)
        for name in self.names:
            weight = getattr(module, name)
            object.__setattr__(module, name, weight.to_local() if isinstance(weight, DTensor) else weight)
        object.__setattr__(module, "num_experts", self.per_rank)
        local = (route.received_expert - self.first).unsqueeze(-1)
        return (received[:, :-1], local, received[:, -1:].to(weights.dtype)), {}

    def after(self, module: nn.Module, inputs: Any, output: torch.Tensor | None) -> torch.Tensor | None:
        object.__setattr__(module, "num_experts", self.experts)
        local = [module.__dict__.pop(name) for name in self.names if name in module.__dict__]
        route, token, shape, received = self.calls.pop()
        if output is None:  # forward raised: the parameters are back in view, the error goes on
            return None
        # what this rank received and its local weights stay in the graph (with zero gradients) when no pair came:
        # every rank then runs the backward all-to-alls, and FSDP2 reduce-scatters the same gradients over edp
        output = output + sum((t.reshape(-1)[:0].sum() for t in [received, *local]), output.new_zeros(()))
        if self.tp_mesh is not None:
            output = sum_over(output, self.tp_mesh)
        back = route.receive(output)
        combined = back.new_zeros(shape)  # returned as is, not a view: FSDP2's pre-backward hook must stay on it
        combined.view(-1, shape[-1]).index_add_(0, token, back)
        return combined
