"""Mixture of experts and expert parallelism.

:class:`MoE` is a top-k routed layer whose experts are stored as one ``[num_experts, ...]`` weight
per projection. :func:`shard_experts` makes those weights DTensors sharded on dim 0 over an ``ep``
mesh dim; the layer then dispatches each (token, choice) pair to the rank that owns its expert with
an all-to-all, runs its local experts, and sends the results back with the reverse all-to-all (both
differentiable; they work on gloo and nccl). Ranks may receive no token at all: their experts still
run on zero rows, so every rank issues the same collectives (no hang) and gets zero gradients.

Expert gradients come out on the expert's owner, summed over the tokens of every rank of the ep
group. When several data-parallel ranks hold the same experts (``dp_shard x cp > ep``), their
expert gradients must be summed over those ranks too: ``fully_shard`` the experts over the
"expert data-parallel" mesh dim with SUM reduction. The global norm then counts every expert once
(sharded on ep and on the expert-dp dim) and every dense weight once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_ndclip.core.parallel.expert_parallel import TokenRoute

__all__ = ["Experts", "MoE", "shard_experts"]


class Experts(nn.Module):
    """``num_experts`` feed-forward experts stored as ``w_in [E, dim, hidden]`` and
    ``w_out [E, hidden, dim]`` (a separate module, so FSDP can wrap experts apart from dense weights)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor, expert: torch.Tensor, first: int) -> torch.Tensor:
        """Rows ``x`` routed to global expert ids ``expert``, run on the local experts ``first, ...``."""
        w_in = self.w_in.to_local() if isinstance(self.w_in, DTensor) else self.w_in
        w_out = self.w_out.to_local() if isinstance(self.w_out, DTensor) else self.w_out
        out = x.new_zeros(x.shape[0], w_out.shape[-1])
        for e in range(w_in.shape[0]):
            # every expert runs, on zero rows if none were routed to it: its weights stay in the
            # autograd graph, so FSDP's backward hooks (and collectives) fire on every rank alike
            rows = (expert == first + e).nonzero(as_tuple=True)[0]
            out = out.index_add(0, rows, torch.nn.functional.gelu(x[rows] @ w_in[e]) @ w_out[e])
        return out


class MoE(nn.Module):
    """Top-k routed feed-forward experts: ``y = Σ_k g_k(x) · W2[e_k] σ(W1[e_k] x)``.

    Args:
        dim: token width.
        hidden: expert hidden width.
        num_experts: number of experts.
        top_k: experts per token; gates are the softmax router probabilities of the chosen experts.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(dim, hidden, num_experts)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]``; tokens are routed independently."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x), dim=-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert = chosen.reshape(-1)
        if self.ep_group is None or dist.get_world_size(self.ep_group) == 1:
            y = self.experts(x[token], expert, 0)
        else:
            y = self._dispatch_and_run(x[token], expert, self.ep_group)
        out = x.new_zeros(x.shape).index_add(0, token, y * gates.reshape(-1, 1))
        return out.reshape(shape)

    def _dispatch_and_run(self, rows: torch.Tensor, expert: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Send each row to its expert's owner, run the local experts, send the results back."""
        per_rank = self.num_experts // dist.get_world_size(group)
        route = TokenRoute(expert, per_rank, group)
        first = dist.get_rank(group) * per_rank
        return route.receive(self.experts(route.send(rows), route.received_expert, first))


def shard_experts(moe: MoE, ep_mesh: DeviceMesh) -> MoE:
    """Shard ``moe``'s expert weights on dim 0 over the 1-D ``ep_mesh`` (DTensor parameters) and route
    its tokens over that dim. ``num_experts`` must be divisible by the ep size."""
    ep = ep_mesh.size()
    if moe.num_experts % ep:
        raise ValueError(f"num_experts={moe.num_experts} is not divisible by the ep mesh size {ep}")
    for name in ("w_in", "w_out"):
        weight = getattr(moe.experts, name)
        setattr(moe.experts, name, nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)])))
    moe.ep_group = ep_mesh.get_group()
    return moe
