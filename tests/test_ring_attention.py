"""Ring attention (``lightning_ndclip.core.context.ring_attention``, the default ``kv_exchange`` of
``context_parallel_attention``) equals single-device attention in float64, outputs and q/k/v
gradients, on 2 and 4 cp ranks; the reference is ``scaled_dot_product_attention`` over the whole
unsharded sequence on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_on_ranks

from lightning_ndclip.core.context.attention import context_parallel_attention, shard_sequence
from lightning_ndclip.core.context.ring_attention import ring_attention

B, H, S, D = 2, 2, 48, 8
TOLERANCE = 1e-10


def _inputs(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Full-sequence q, k, v and the weights of the loss ``(out * w).sum()``."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(4)]


def _sample_ids(small: bool = False) -> torch.Tensor:
    """Packed rows with padding (-1) at the end and in the middle; ``small``: many short samples."""
    if small:
        return torch.arange(S).div(3, rounding_mode="floor").remainder(5).expand(B, S).clone()
    row0 = [0] * 10 + [1] * 17 + [-1] * 3 + [2] * 13 + [-1] * 5
    row1 = [0] * 30 + [1] * 18
    return torch.tensor([row0, row1])


def _mask(is_causal: bool, ids: torch.Tensor | None) -> torch.Tensor | None:
    mask = torch.ones(1, 1, S, S, dtype=torch.bool)
    if is_causal:
        mask = mask & torch.tril(torch.ones(S, S, dtype=torch.bool))
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    return mask


def _reference(is_causal: bool, ids: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One-device float64 attention over the whole sequence: output and q, k, v gradients."""
    q, k, v, w = _inputs()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(is_causal, ids))
    (out * w).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


def _sharded(ids, load_balance, attend, dtype=torch.float64):
    """This rank's output and q, k, v gradients from ``attend(q, k, v, positions, sample_ids)``
    on its shard, and its positions."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    *qkv, w = (shard_sequence(t.detach(), rank, cp, dim=2, load_balance=load_balance)[0] for t in _inputs(dtype))
    positions = shard_sequence(torch.zeros(S), rank, cp, dim=0, load_balance=load_balance)[1]
    local_ids = shard_sequence(ids, rank, cp, dim=1, load_balance=load_balance)[0] if ids is not None else None
    qkv = [t.requires_grad_() for t in qkv]
    out = attend(*qkv, positions, local_ids)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in qkv], positions


def _versus_reference(is_causal, packed, load_balance, block_size, dtype=torch.float64) -> float:
    """Worst relative error of this rank's output and gradients against the matching rows of the reference."""
    ids = _sample_ids(packed == "small") if packed else None
    ref_out, ref_grads = _reference(is_causal, ids)

    def attend(q, k, v, positions, local_ids):
        if block_size == "default":  # the public default path
            return context_parallel_attention(q, k, v, group=dist.group.WORLD, positions=positions,
                                              is_causal=is_causal, sample_ids=local_ids)
        return ring_attention(q, k, v, group=dist.group.WORLD, positions=positions, is_causal=is_causal,
                              sample_ids=local_ids, block_size=block_size)

    out, grads, positions = _sharded(ids, load_balance, attend, dtype)
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    errors = [_relative_error(out, ref_out.index_select(2, positions))]
    errors += [_relative_error(g, ref.index_select(2, positions)) for g, ref in zip(grads, ref_grads)]
    return max(errors)


CASES = {  # is_causal, packed, load_balance, block_size (keys per tile; local blocks are 12 or 24 keys)
    "causal-balanced-tile5": (True, False, True, 5),
    "causal-unbalanced-whole-block": (True, False, False, None),
    "packed-bidirectional-tile7": (False, True, False, 7),
    "causal-packed-balanced-tile5": (True, True, True, 5),
    "bidirectional-default-path": (False, False, True, "default"),
}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_equals_one_device_attention(case, cp):
    assert max(run_on_ranks(cp, _versus_reference, *CASES[case])) < TOLERANCE


@pytest.mark.parametrize("cp", [2, 4])
def test_rows_fully_masked_in_a_tile_give_no_nan(cp):
    # 3-token samples and tiles of 3 keys: many tiles hold keys some local queries may attend to
    # and others may not (those rows have lse = -inf in the tile); _versus_reference checks finiteness
    tiles = _mask(True, _sample_ids(small=True)).unflatten(-1, (S // 3, 3)).any(-1)  # [B, 1, S, tiles]
    assert ((~tiles).any(-2) & tiles.any(-2)).any()
    assert max(run_on_ranks(cp, _versus_reference, True, "small", False, 3)) < TOLERANCE


def test_ring_attention_in_bfloat16_merges_in_float32():
    # bf16 inputs (rounded from the float64 ones): the error is bf16's input and output rounding only
    assert max(run_on_ranks(2, _versus_reference, True, True, True, 5, torch.bfloat16)) < 2e-2


def _ring_versus_all_gather() -> float:
    ids = _sample_ids()
    results = []
    for exchange in ("ring", "all_gather"):
        def attend(q, k, v, positions, local_ids, exchange=exchange):
            return context_parallel_attention(q, k, v, group=dist.group.WORLD, positions=positions, is_causal=True,
                                              sample_ids=local_ids, kv_exchange=exchange)

        results.append(_sharded(ids, True, attend))
    (ring_out, ring_grads, _), (gather_out, gather_grads, _) = results
    return max(_relative_error(a, b) for a, b in zip([ring_out, *ring_grads], [gather_out, *gather_grads]))


def test_ring_and_all_gather_agree():
    assert max(run_on_ranks(4, _ring_versus_all_gather)) < TOLERANCE


def _merge_blocks(q, k, v, mask, blocks: int, merge: str) -> torch.Tensor:
    """Attention of all keys from per-block softmax results, merged by ``merge`` (the test's own code)."""
    outs, lses, maxes, sums = [], [], [], []
    for cols in torch.arange(S).chunk(blocks):
        s = (q @ k[..., cols, :].transpose(-2, -1) / D**0.5).masked_fill(~mask[..., cols], -torch.inf)
        m = s.amax(-1, keepdim=True).clamp(min=-1e300)  # a row masked in the whole block: weights 0
        e = torch.exp(s - m)
        outs.append(e @ v[..., cols, :] / e.sum(-1, keepdim=True).clamp(min=1e-300))
        lses.append(torch.logsumexp(s, -1, keepdim=True))
        maxes.append(m)
        sums.append((e @ v[..., cols, :], e.sum(-1, keepdim=True)))
    if merge == "lse":
        lse = torch.logsumexp(torch.stack(lses), 0)
        return sum(torch.exp(b - lse) * o for b, o in zip(lses, outs))
    if merge == "average":
        return torch.stack(outs).mean(0)
    # "no rescale": the online softmax's running sums without exp(m_old - m_new) between blocks
    return sum(a for a, _ in sums) / sum(n for _, n in sums)


@pytest.mark.parametrize("merge,expected_ok", [("lse", True), ("average", False), ("no rescale", False)])
def test_the_check_catches_a_naive_merge(merge, expected_ok):
    q, k, v, _ = (t.detach() for t in _inputs())
    mask = _mask(True, _sample_ids())
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    error = _relative_error(_merge_blocks(q, k, v, mask, 4, merge), ref)
    assert error < TOLERANCE if expected_ok else error > 1e-3


def test_bad_kv_exchange_and_block_size_raise():
    q = k = v = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="kv_exchange must be 'ring' or 'all_gather', got 'allgather'"):
        context_parallel_attention(q, k, v, group=None, positions=torch.arange(4), kv_exchange="allgather")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size must be a positive number of keys or None, got 0"):
        ring_attention(q, k, v, group=dist.group.WORLD, positions=torch.arange(4), block_size=0)


def _features_reference(window, softcap, sinks_on) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One-device float64 attention, written out (softmax over masked, capped scores and a sink column)."""
    q, k, v, w = _inputs()
    sinks = torch.linspace(-1.0, 1.5, H, dtype=torch.float64).requires_grad_()
    allowed = _mask(True, None) & (_DOCS[:, :, None] == _KEY_DOCS[:, None, :])[:, None]
    if window is not None:
        allowed = allowed & ~torch.tril(torch.ones(S, S, dtype=torch.bool), diagonal=-window)
    s = q @ k.transpose(-2, -1) * SCALE
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks_on:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    out = torch.softmax(s, dim=-1)[..., :S] @ v
    (out * w).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad] + ([sinks.grad] if sinks_on else [])


SCALE = 0.3
_DOCS = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])  # queries' document ids
_KEY_DOCS = torch.where(torch.tensor([[i in (4, 5, 30) for i in range(S)]] * B), -1, _DOCS)  # padding keys: -1


def _features_versus_reference(window, softcap, sinks_on) -> float:
    ref_out, ref_grads = _features_reference(window, softcap, sinks_on)
    rank, cp = dist.get_rank(), dist.get_world_size()
    sinks = torch.linspace(-1.0, 1.5, H, dtype=torch.float64).requires_grad_() if sinks_on else None

    def attend(q, k, v, positions, local_ids):
        key_ids = shard_sequence(_KEY_DOCS, rank, cp, dim=1, load_balance=True)[0]
        return ring_attention(q, k, v, group=dist.group.WORLD, positions=positions, is_causal=True,
                              sample_ids=local_ids, kv_sample_ids=key_ids, window=window, scale=SCALE,
                              softcap=softcap, sinks=sinks, block_size=5)

    out, grads, positions = _sharded(_DOCS, True, attend)
    errors = [_relative_error(out, ref_out.index_select(2, positions))]
    errors += [_relative_error(g, ref.index_select(2, positions)) for g, ref in zip(grads, ref_grads)]
    if sinks is not None:  # each rank's gradient covers its own queries: summed over the ranks
        dist.all_reduce(sinks.grad)
        errors.append(_relative_error(sinks.grad, ref_grads[-1]))
    return max(errors)


@pytest.mark.parametrize(
    "window, softcap, sinks_on", [(7, None, False), (None, 2.0, False), (None, None, True), (5, 1.5, True)]
)
def test_window_padding_keys_scale_softcap_and_sinks_equal_one_device(window, softcap, sinks_on):
    # transformers' features: a sliding window, padding masked as a key only, a custom scale, Gemma 2's
    # soft-capping, GPT-OSS's sinks; the reference writes each out on the whole sequence
    assert max(run_on_ranks(4, _features_versus_reference, window, softcap, sinks_on)) < TOLERANCE


def test_the_features_check_fails_without_the_feature():
    # the reference differs from plain causal attention in each feature: the test above can fail
    base_out, _ = _features_reference(None, None, False)
    for case in [(7, None, False), (None, 2.0, False), (None, None, True)]:
        assert _relative_error(_features_reference(*case)[0], base_out) > 1e-2


PROMPT = 12  # keys of another sequence (a prompt), cut alike, of its own length


def _cross_attention(kv_exchange: str) -> list[float]:
    """Queries of the S-token sequence over the keys of a PROMPT-token one, both cut contiguously over cp, some
    prompt tokens masked as keys (kv_sample_ids -1): the output and the q, k, v gradients against one device."""
    g = torch.Generator().manual_seed(3)
    q, w = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    k, v = (torch.randn(B, H, PROMPT, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    keep = torch.ones(B, PROMPT, dtype=torch.bool)
    keep[0, 9:] = keep[1, 2:5] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None])
    (expected * w).sum().backward()
    whole = [expected.detach(), *(t.grad.clone() for t in (q, k, v))]
    rank, cp = dist.get_rank(), dist.get_world_size()
    local_q, positions = shard_sequence(q.detach(), rank, cp, dim=2, load_balance=False)
    local_k, kv_positions = shard_sequence(k.detach(), rank, cp, dim=2, load_balance=False)
    local_v, _ = shard_sequence(v.detach(), rank, cp, dim=2, load_balance=False)
    local_keep, _ = shard_sequence(keep, rank, cp, dim=1, load_balance=False)
    leaves = [t.clone().requires_grad_() for t in (local_q, local_k, local_v)]
    out = context_parallel_attention(
        *leaves, group=dist.group.WORLD, positions=positions, kv_positions=kv_positions, kv_exchange=kv_exchange,
        sample_ids=torch.zeros(B, positions.numel(), dtype=torch.int64), kv_sample_ids=torch.where(local_keep, 0, -1),
    )  # fmt: skip
    (out * w[:, :, positions]).sum().backward()
    got = [out.detach(), *(t.grad for t in leaves)]
    parts = [whole[0][:, :, positions], whole[1][:, :, positions], whole[2][:, :, kv_positions], whole[3][:, :, kv_positions]]
    return [_relative_error(a, b) for a, b in zip(got, parts)]


@pytest.mark.parametrize("kv_exchange", ["ring", "all_gather"])
def test_cross_attention_to_another_cut_sequence_equals_one_device(kv_exchange):
    for errors in run_on_ranks(2, _cross_attention, kv_exchange):
        assert max(errors) < TOLERANCE, errors
