r"""Context parallelism: sequence shards and attention that is exact under them, on any backend.

The ranks of a context-parallel (cp) group hold the same rows and each a part of the sequence.

* :func:`shard_sequence` cuts a sequence dim into the cp parts; with ``load_balance=True`` (for
  causal attention) the sequence is cut into ``2 x cp`` chunks and rank ``r`` takes chunks ``r`` and
  ``2cp - 1 - r``, so every rank has the same amount of causal work. It also returns the global
  positions of the local tokens, which position embeddings and masks must use.
* :func:`context_parallel_attention` attends the local queries to the whole sequence with the right
  mask (causal by global position, and/or block-diagonal by packed sample). How the ranks see each
  other's K and V is ``kv_exchange``:

  - ``"ring"`` (default): :func:`~lightning_ndclip.core.context.ring_attention.ring_attention`. K/V blocks go
    round the cp ring point to point and each rank merges its blocks' results with the log-sum-exp
    rule; the backward passes the dK/dV accumulators round the same way. O(S/cp) memory per rank.
  - ``"all_gather"``: K and V (and their positions / sample ids) are all-gathered and attended in one
    masked ``scaled_dot_product_attention``; the gather's backward sums the K/V gradients over the
    group and hands each rank its slice. Memory per rank grows with the whole sequence ``S`` (a full
    K/V and a ``local_seq x S`` score matrix). (In our tests on gloo with torch 2.13,
    ``torch.distributed.nn.functional.all_gather`` followed by a ``cat`` along the sequence dim gave
    wrong K/V gradients, apparently because its all-to-all backward receives non-contiguous gradient
    slices; it is right for a leading-dim gather. This module uses its own.)

  Both need only send/recv or all-gather / all-reduce, so they run on CPU/gloo, where PyTorch's
  ``context_parallel`` does not.

Parameters are replicated over cp; their gradients must be summed over cp (FSDP2 over
``dp_shard_cp`` with SUM reduction does it), and the loss normalized as in
:mod:`lightning_ndclip.core.loss` (per-sample token counts summed over cp).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ndclip.core.context import work
from lightning_ndclip.core.context.ring_attention import ring_attention

__all__ = ["context_parallel_attention", "gather_sequence", "shard_sequence"]


def _chunk_ids(cp_rank: int, cp_size: int, load_balance: bool) -> list[int]:
    return [cp_rank, 2 * cp_size - 1 - cp_rank] if load_balance else [cp_rank]


def shard_sequence(
    tensor: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 1, load_balance: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's part of ``tensor`` along ``dim`` and the global positions of that part.

    Args:
        tensor: a full sequence tensor (tokens, labels, sample ids, embeddings...).
        cp_rank, cp_size: this rank's index in the cp group and the group's size.
        dim: the sequence dim.
        load_balance: cut into ``2 x cp_size`` chunks and take chunks ``cp_rank`` and
            ``2 cp_size - 1 - cp_rank`` (for causal attention); else one contiguous part.

    Returns:
        ``(local part, positions)``, positions a 1-D int64 tensor of the local tokens' global indices.

    Raises:
        ValueError: if the sequence length is not divisible by the number of chunks.
    """
    length = tensor.shape[dim]
    chunks = 2 * cp_size if load_balance else cp_size
    if cp_size > 1:
        work.note()
    if length % chunks:
        raise ValueError(
            f"sequence dim {dim} has length {length}, not divisible by {chunks} "
            f"({'2 x ' if load_balance else ''}cp={cp_size}); pad the sequence"
        )
    size = length // chunks
    positions = torch.cat(
        [torch.arange(c * size, (c + 1) * size, device=tensor.device) for c in _chunk_ids(cp_rank, cp_size, load_balance)]
    )
    return tensor.index_select(dim, positions), positions


class _GatherAlongDim(torch.autograd.Function):
    """All-gather along ``dim``; backward sums the full gradient over the group (an all-reduce,
    available on every backend) and keeps this rank's slice. Equal-sized parts are assumed. The sum is taken on a
    copy: autograd may hand the same gradient tensor to another branch (``x + gather(...)`` gives both summands the
    one tensor), which an all-reduce in place would sum over the ranks too."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.group, ctx.dim, ctx.size = group, dim, t.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.size
        return grad.narrow(ctx.dim, start, ctx.size), None, None


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """The whole sequence from each cp rank's equal, contiguous part ``t`` along ``dim`` (rank order), e.g. a model's
    output gathered where its context-parallel plan says. Differentiable: the gradient of this rank's part is the
    sum over the group of the gradients of its rows, so where every rank computes the same loss on the gathered
    tensor (as one device would), counting that loss once per rank gives the one-device gradient."""
    if t.requires_grad:
        return _GatherAlongDim.apply(t, group, dim)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    positions: torch.Tensor,
    is_causal: bool = False,
    sample_ids: torch.Tensor | None = None,
    kv_sample_ids: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    kv_exchange: Literal["ring", "all_gather"] = "ring",
) -> torch.Tensor:
    """Exact attention of local queries over the whole (cp-sharded) sequence.

    Args:
        q, k, v: local ``[batch, heads, local_seq, head_dim]`` tensors.
        group: the cp process group (``None``: no context parallelism, plain attention).
        positions: global positions of the local tokens (from :func:`shard_sequence`), ``[local_seq]``.
        is_causal: mask keys at later global positions.
        sample_ids: ``[batch, local_seq]`` packed-sample ids of the local tokens (``-1`` padding):
            tokens attend only within their sample (padding queries attend to padding only).
        kv_sample_ids, kv_positions, window, scale: the keys' own ids and positions (cross-attention to another
            sequence cut alike), a sliding window and the score scale, as in
            :func:`~lightning_ndclip.core.context.ring_attention.ring_attention`.
        kv_exchange: ``"ring"``: K/V blocks passed round the cp ring, O(S/cp) memory per rank
            (:func:`~lightning_ndclip.core.context.ring_attention.ring_attention`, key tiles of 1024);
            ``"all_gather"``: the whole K/V gathered on every rank, memory growing with S. Unused
            without context parallelism (``group`` ``None`` or of size 1).

    Returns:
        ``[batch, heads, local_seq, head_dim]``, equal to the matching rows of single-device attention.

    Raises:
        ValueError: if ``kv_exchange`` is neither ``"ring"`` nor ``"all_gather"``, or as
            :func:`~lightning_ndclip.core.context.ring_attention.ring_attention` for the other arguments.
    """
    if kv_exchange not in ("ring", "all_gather"):
        raise ValueError(f"kv_exchange must be 'ring' or 'all_gather', got {kv_exchange!r}")
    if window is not None and (window < 1 or not is_causal):
        raise ValueError(f"window must be a positive number of positions, with is_causal=True; got {window}")
    kv_ids = sample_ids if kv_sample_ids is None else kv_sample_ids
    if kv_ids is not None and sample_ids is None:
        raise ValueError("kv_sample_ids needs sample_ids (the queries' ids)")
    rule = _Attend(is_causal, window, scale)
    kv_positions = positions if kv_positions is None else kv_positions
    if group is None or dist.get_world_size(group) == 1:
        return _masked_attention(q, k, v, positions, kv_positions, sample_ids, kv_ids, rule)
    if kv_exchange == "ring":
        return ring_attention(q, k, v, group=group, positions=positions, is_causal=is_causal, sample_ids=sample_ids,
                              kv_sample_ids=kv_sample_ids, kv_positions=kv_positions, window=window, scale=scale)  # fmt: skip
    work.note()
    kv_ids = gather_sequence(kv_ids, group, 1) if kv_ids is not None else None
    return _masked_attention(
        q, gather_sequence(k, group, 2), gather_sequence(v, group, 2), positions,
        gather_sequence(kv_positions, group, 0), sample_ids, kv_ids, rule,
    )


class _Attend(NamedTuple):
    is_causal: bool
    window: int | None
    scale: float | None


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    kv_positions: torch.Tensor,
    sample_ids: torch.Tensor | None,
    kv_ids: torch.Tensor | None,
    rule: _Attend,
) -> torch.Tensor:
    mask = None
    if rule.is_causal:  # boolean [q, kv] masks only: no wider temporary of the mask's size
        allowed = kv_positions[None, :] <= positions[:, None]
        if rule.window is not None:
            allowed &= kv_positions[None, :] > positions[:, None] - rule.window
        mask = allowed[None, None]  # [1, 1, q, kv]
    if sample_ids is not None and kv_ids is not None:
        same = (sample_ids[:, :, None] == kv_ids[:, None, :])[:, None]  # [batch, 1, q, kv]
        mask = same if mask is None else mask & same
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=rule.scale)
