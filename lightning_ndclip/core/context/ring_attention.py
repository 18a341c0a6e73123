"""Ring attention: exact attention over a cp-sharded sequence in O(S/cp) memory per rank.

**Math.** For a query row ``i``, scores ``s_ij = q_i·k_j / sqrt(d)`` (``-inf`` where masked) and keys
split into blocks ``b``, each block gives its own softmax result and log-sum-exp:

    lse_ib = log Σ_{j in b} exp(s_ij)          o_ib = Σ_{j in b} exp(s_ij - lse_ib) v_j

and attention over all keys is their log-sum-exp merge:

    lse_i = log Σ_b exp(lse_ib)                out_i = Σ_b exp(lse_ib - lse_i) o_ib

The merge is associative and commutative, so blocks are folded in one at a time, in any order (the
online softmax). A row fully masked in a block has ``lse_ib = -inf`` and weight ``0`` in the merge;
exponents subtract ``0`` where a log-sum-exp is ``-inf``, so no ``-inf - (-inf)`` makes a NaN (a row
masked in every block gives ``out = 0``, ``lse = -inf``).

The backward recomputes each block's probabilities from the saved final ``lse``: with
``p_ij = exp(s_ij - lse_i)``, ``dO`` the output gradient and ``delta_i = dO_i·out_i``:

    dv_j = Σ_i p_ij dO_i     ds_ij = p_ij (dO_i·v_j - delta_i)
    dq_i = Σ_j ds_ij k_j / sqrt(d)     dk_j = Σ_i ds_ij q_i / sqrt(d)

so each term needs one key block and this rank's ``q``, ``dO``, ``out``, ``lse`` only.

**transformers' variants.** A soft cap replaces ``s_ij`` by ``c·tanh(s_ij / c)`` before masking, and
the backward multiplies ``ds_ij`` by its derivative ``1 - tanh²(s_ij / c)``. A sliding window masks keys
``window`` or more positions behind the query. A sink is one more key per head with logit ``σ_h`` and a
zero value: after the last block it is merged like any block (``lse_i ← logaddexp(lse_i, σ_h)``, ``out_i``
rescaled), the backward uses that final ``lse``, and ``dσ_h = -Σ_i exp(σ_h - lse_i) delta_i``.

**Communication.** The ranks of the cp group form a ring. Forward: at each of ``cp`` steps every
rank computes on the K/V block it holds (its own first) while sending that block, with its tokens'
global positions and sample ids, to the next rank and receiving the previous rank's, so the next
block's transfer overlaps the current block's compute (``cp - 1`` transfers). Backward: the blocks go
round again, each followed by its dK/dV accumulator: a rank adds its queries' contribution to the
accumulator of the block it holds and passes it on; after ``cp`` transfers every accumulator is back
at its owner, summed over all queries. dQ stays local. Only point-to-point ``batch_isend_irecv``, so
any backend with send/recv works (gloo included); every rank makes every transfer, whatever it skips.

**Memory per rank** (local length ``L = S / cp``, key tile ``t``): saved for backward ``q, k, v,
out, lse`` (and positions / ids), O(L); in flight two K/V blocks (held and arriving) and, in
backward, up to three dK/dV accumulators (received, being summed, being sent), O(L); score-sized
buffers ``[batch, heads, L, t]``: one in forward, two in backward (probabilities and score
gradient). Nothing of size ``S``.

**Masks and precision** as :func:`~lightning_ndclip.core.context.attention.context_parallel_attention`: causal
by global position, block-diagonal by packed sample id (``-1``: padding, which attends to padding).
Key tiles that are entirely masked for every local query are skipped; which ones is read on the
host once per key block (one device synchronization per ring step, not one per tile). float32 / float64 inputs are
computed in their dtype; float16 / bfloat16 ones in float32 (scores, merge, gradient accumulators,
dK/dV in transit), the output and gradients cast back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ndclip.core.context import work

__all__ = ["ring_attention"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    positions: torch.Tensor,
    is_causal: bool = False,
    sample_ids: torch.Tensor | None = None,
    kv_sample_ids: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_size: int | None = 1024,
) -> torch.Tensor:
    """Exact attention of local queries over the whole cp-sharded sequence, K/V passed round a ring.

    What :func:`~lightning_ndclip.core.context.attention.context_parallel_attention` runs by default
    (``kv_exchange="ring"``); call it directly to choose ``block_size`` or for soft-capping and sinks.

    Args:
        q, k, v: local ``[batch, heads, local_seq, head_dim]`` tensors, the same ``local_seq`` on
            every rank of ``group`` (``v`` may have its own head dim; ``k`` and ``v`` their own ``local_seq``
            with ``kv_positions``).
        group: the cp process group (of any size, 1 included).
        positions: global positions of the local tokens (from
            :func:`~lightning_ndclip.core.context.attention.shard_sequence`), ``[local_seq]``.
        is_causal: mask keys at later global positions.
        sample_ids: ``[batch, local_seq]`` packed-sample ids of the local tokens (``-1`` padding):
            tokens attend only within their sample (padding queries attend to padding only).
        kv_sample_ids: the ids the local tokens have as keys, if not ``sample_ids`` (a query attends
            to a key when its ``sample_ids`` entry equals the key's ``kv_sample_ids`` entry): e.g. a
            padding key given ``-1`` and its query its document's id, so padding is masked as a key
            only (``transformers``' padding mask).
        kv_positions: global positions of the local keys, if not ``positions``: cross-attention to
            another sequence cut alike (a prompt's tokens), of its own length.
        window: with ``is_causal``, a query attends to the ``window`` latest positions up to its own
            (keys ``j`` with ``i - window < j <= i``; ``transformers``' ``sliding_window``).
        scale: the score scale, ``head_dim ** -0.5`` by default.
        softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` before masking (Gemma 2).
        sinks: ``[heads]`` logits of one extra key per head with a zero value: it takes its share of
            every row's softmax and gets its gradient (GPT-OSS's attention sinks).
        block_size: keys per tile: the score-sized buffers (one in forward, two in backward, three
            with ``softcap``) are ``[batch, heads, local_seq, block_size]``; ``None``: a whole block.

    Returns:
        ``[batch, heads, local_seq, v_head_dim]``, equal to the matching rows of single-device
        attention; its backward gives exact q, k, v (and ``sinks``) gradients.

    Raises:
        ValueError: if ``block_size`` is not positive, ``window`` is not positive or given without
            ``is_causal``, or ``kv_sample_ids`` is given without ``sample_ids``.
    """
    work.note()
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be a positive number of keys or None, got {block_size}")
    if window is not None and (window < 1 or not is_causal):
        raise ValueError(f"window must be a positive number of positions, with is_causal=True; got {window}")
    if kv_sample_ids is not None and sample_ids is None:
        raise ValueError("kv_sample_ids needs sample_ids (the queries' ids)")
    mask = _MaskRule(is_causal, window)
    options = _Options(q.shape[-1] ** -0.5 if scale is None else scale, softcap, block_size)
    kv_ids = sample_ids if kv_sample_ids is None else kv_sample_ids
    q_meta, kv_meta = _meta(positions, sample_ids), _meta(positions if kv_positions is None else kv_positions, kv_ids)
    return _RingAttention.apply(q, k, v, sinks, q_meta, kv_meta, group, mask, options)


@dataclass(frozen=True)
class _MaskRule:
    """Which keys a query may not attend to, besides other samples: later ones, ones out of the window."""

    is_causal: bool
    window: int | None


@dataclass(frozen=True)
class _Options:
    scale: float
    softcap: float | None
    block_size: int | None


class _Ring:
    """Point-to-point transfers to the next rank of a group, from the previous one.

    Messages between two ranks are matched in the order they are posted, so every rank posts the
    same sequence of sends to its next rank as it posts receives from its previous one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next, self.prev = (rank + 1) % self.size, (rank - 1) % self.size

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next) for t in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev) for t in recv]
        return dist.batch_isend_irecv(ops) if ops else []

    def pass_on(
        self, block: list[torch.Tensor], step: int, extra_recv: Sequence[torch.Tensor] = ()
    ) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Start sending ``block`` on and receiving the next one (none after the last step), after
        receiving ``extra_recv``; returns the arriving buffers and the transfers to wait for."""
        arriving = [torch.empty_like(t) for t in block] if step < self.size - 1 else []
        return arriving, self.start(block if arriving else [], [*extra_recv, *arriving])


def _wait(works: list[dist.Work]) -> None:
    for pending in works:
        pending.wait()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, *likes: torch.Tensor) -> list[torch.Tensor]:
    parts = flat.split([t.numel() for t in likes])
    return [part.view(t.shape) for part, t in zip(parts, likes)]


def _meta(positions: torch.Tensor, sample_ids: torch.Tensor | None) -> torch.Tensor:
    """``[1 (+ batch), local_seq]`` int64: the positions, then the sample ids if any (one message)."""
    rows = [positions[None]] + ([sample_ids] if sample_ids is not None else [])
    return torch.cat([r.to(torch.int64) for r in rows])


def _tile_mask(q_meta: torch.Tensor, kv_meta: torch.Tensor, cols: slice, rule: _MaskRule) -> torch.Tensor | None:
    """``[batch or 1, 1, queries, keys]``, True where a local query may not attend to a key of the
    ``cols`` tile; ``None`` when it may attend to every one."""
    masked = None
    if rule.is_causal:
        behind = q_meta[0, :, None] - kv_meta[0, None, cols]  # how far each key is behind each query
        masked = behind < 0 if rule.window is None else (behind < 0) | (behind >= rule.window)
        masked = masked[None, None]
    if q_meta.shape[0] > 1:
        other = (q_meta[1:, :, None] != kv_meta[1:, None, cols])[:, None]
        masked = other if masked is None else masked | other
    return masked


def _all(masked: torch.Tensor | None) -> torch.Tensor:
    assert masked is not None  # causal or packed: there is a mask
    return masked.all()


def _tiles(
    q_meta: torch.Tensor, kv_meta: torch.Tensor, rule: _MaskRule, tile: int | None
) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """``(key columns, masked)`` of every key tile of a block that some local query may attend to
    (see :func:`_tile_mask`). Which tiles are entirely masked is read on the host once per block,
    for all its tiles together (one device synchronization per block, not one per tile)."""
    length = kv_meta.shape[1]
    spans = [slice(start, start + (tile or length)) for start in range(0, length, tile or length)]
    if not rule.is_causal and q_meta.shape[0] == 1:
        yield from ((cols, None) for cols in spans)
        return
    # one tile's mask at a time, here and below: no block-sized mask is ever held
    skipped = torch.stack([_all(_tile_mask(q_meta, kv_meta, cols, rule)) for cols in spans]).tolist()
    for cols, skip in zip(spans, skipped):
        if not skip:
            yield cols, _tile_mask(q_meta, kv_meta, cols, rule)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows with no key) replaced by 0, to subtract without making NaN."""
    return lse.masked_fill(lse == -math.inf, 0.0)


def _scores(q_scaled: torch.Tensor, k: torch.Tensor, masked: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    s = q_scaled @ k.to(q_scaled.dtype).transpose(-2, -1)
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    return s if masked is None else s.masked_fill_(masked, -math.inf)


def _forward_block(q_scaled, k, v, tiles, softcap, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one key block's attention into ``out`` / ``lse`` (in place), tile by tile."""
    for cols, masked in tiles:
        _forward_tile(q_scaled, k[..., cols, :], v[..., cols, :], masked, softcap, out, lse)


def _forward_tile(q_scaled, k, v, masked, softcap, out: torch.Tensor, lse: torch.Tensor) -> None:
    """A tile's normalized output times ``exp(tile_lse - merged)`` is ``Σ_j exp(s_ij - m_i) v_j ·
    exp(m_i - merged)`` (``m_i`` the row max): one score-sized buffer, freed on return."""
    s = _scores(q_scaled, k, masked, softcap)
    row_max = _finite(s.amax(dim=-1, keepdim=True))
    p = s.sub_(row_max).exp_()
    _merge(out, lse, p @ v.to(p.dtype), row_max + p.sum(dim=-1, keepdim=True).log(), row_max)


def _merge(out: torch.Tensor, lse: torch.Tensor, unnormalized: torch.Tensor, part_lse: torch.Tensor, shift) -> None:
    """Fold a part ``(Σ_j exp(s_ij - shift_i) v_j, its log-sum-exp)`` into ``out`` / ``lse`` (in place)."""
    merged = torch.logaddexp(lse, part_lse)
    safe = _finite(merged)
    out.mul_(torch.exp(lse - safe)).add_(unnormalized.mul_(torch.exp(shift - safe)))
    lse.copy_(merged)


def _backward_block(q_scaled, k, v, tiles, dout, lse, delta, options: _Options, dq, dk, dv) -> None:
    """Add one key block's contributions to ``dq`` and to its ``dk`` / ``dv`` (in place);
    ``lse`` is the final log-sum-exp with ``-inf`` replaced by 0."""
    for cols, masked in tiles:
        _backward_tile(
            q_scaled, k[..., cols, :], v[..., cols, :], masked, dout, lse, delta, options, dq, dk[..., cols, :], dv[..., cols, :]
        )


def _backward_tile(q_scaled, k, v, masked, dout, lse, delta, options: _Options, dq, dk, dv) -> None:
    """Two score-sized buffers (``p``, then ``ds`` in place of ``dp``), freed on return; with a soft
    cap a third, ``tanh(s / cap)``, for the cap's derivative ``1 - tanh²``."""
    k, v = k.to(q_scaled.dtype), v.to(q_scaled.dtype)
    if options.softcap is None:
        p = _scores(q_scaled, k, masked, None).sub_(lse).exp_()
    else:
        capped = (q_scaled @ k.transpose(-2, -1)).div_(options.softcap).tanh_()
        s = capped * options.softcap
        p = (s if masked is None else s.masked_fill_(masked, -math.inf)).sub_(lse).exp_()
    dv += p.transpose(-2, -1) @ dout
    ds = (dout @ v.transpose(-2, -1)).sub_(delta).mul_(p)
    if options.softcap is not None:
        ds.mul_(1 - capped.square_())
    dq.add_(ds @ k, alpha=options.scale)
    dk += ds.transpose(-2, -1) @ q_scaled


class _RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (see the module docstring); saves only local tensors."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, q_meta, kv_meta, group, mask: _MaskRule, options: _Options):
        ring, dtype = _Ring(group), _compute_dtype(q.dtype)
        q_scaled = q.to(dtype) * options.scale
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)
        lse = q.new_full((*q.shape[:-1], 1), -math.inf, dtype=dtype)
        block = [_pack(k, v), kv_meta]
        for step in range(ring.size):
            arriving, works = ring.pass_on(block, step)
            held_k, held_v = _unpack(block[0], k, v)
            _forward_block(
                q_scaled, held_k, held_v, _tiles(q_meta, block[1], mask, options.block_size), options.softcap, out, lse
            )
            _wait(works)
            block = arriving
        if sinks is not None:  # one more key per head, with a zero value: it rescales the rows only
            sink = sinks.to(dtype).view(1, -1, 1, 1).expand_as(lse)
            _merge(out, lse, torch.zeros_like(out), sink, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse, q_meta, kv_meta)
        ctx.group, ctx.mask, ctx.options = group, mask, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse, q_meta, kv_meta = ctx.saved_tensors
        options: _Options = ctx.options
        ring, dtype = _Ring(ctx.group), _compute_dtype(q.dtype)
        q_scaled, dout = q.to(dtype) * options.scale, dout.to(dtype)
        delta = (dout * out.to(dtype)).sum(-1, keepdim=True)
        lse, dq = _finite(lse), torch.zeros_like(q_scaled)
        block, sent, size = [_pack(k, v), kv_meta], [], k.numel() + v.numel()
        for step in range(ring.size):
            # the held block's accumulator left its previous holder before the next block did: received first
            incoming = [q_scaled.new_empty(size)] if step > 0 else []
            arriving, works = ring.pass_on(block, step, incoming)
            acc = q_scaled.new_zeros(size)
            tiles = _tiles(q_meta, block[1], ctx.mask, options.block_size)
            _backward_block(q_scaled, *_unpack(block[0], k, v), tiles, dout, lse, delta, options, dq, *_unpack(acc, k, v))
            _wait(works + sent)
            if incoming:
                acc += incoming[0]
            sent = ring.start([acc], []) if ring.size > 1 else []
            block = arriving
        if ring.size > 1:  # this rank's own accumulator, back from the previous rank
            own = [acc.new_empty(size)]
            _wait(sent + ring.start([], own))
            acc = own[0]
        dk, dv = _unpack(acc, k, v)
        dsinks = None
        if sinks is not None:  # the sink's probability times (0 - delta), summed over rows
            p_sink = torch.exp(sinks.to(dtype).view(1, -1, 1, 1) - lse)
            dsinks = -(p_sink * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None
