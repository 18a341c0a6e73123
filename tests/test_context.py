"""Context parallelism: attention over cp-sharded sequences, and whole models under dp x cp, equal
single-device attention, gradients and norms in float64. The same in ``Trainer.fit``:
test_context_trainer.py."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from test_loss import _packed_batch, _shard_rows
from test_norm_dtensor import assert_close
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lightning_ndclip as nd
from lightning_ndclip._compat import flatten_mesh
from lightning_ndclip.core.context.attention import (
    _GatherAlongDim,
    context_parallel_attention,
    gather_sequence,
    shard_sequence,
)
from lightning_ndclip.core.loss import count_valid_tokens, sync_sample_weights, sync_token_count

B, H, S, D = 2, 2, 12, 4


def _qkv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]


def _sample_ids() -> torch.Tensor:
    return torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])


def _attention_case(is_causal: bool, packed: bool, load_balance: bool) -> float:
    q, k, v, w = _qkv(0)
    ids = _sample_ids() if packed else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if not (is_causal or packed) else _reference_mask(is_causal, ids)
    )
    (ref * w).sum().backward()
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = [shard_sequence(t.detach(), rank, cp, dim=2, load_balance=load_balance)[0].requires_grad_() for t in (q, k, v)]
    local_w, positions = shard_sequence(w.detach(), rank, cp, dim=2, load_balance=load_balance)
    local_ids = shard_sequence(ids, rank, cp, dim=1, load_balance=load_balance)[0] if packed else None
    out = context_parallel_attention(
        *local, group=dist.group.WORLD, positions=positions, is_causal=is_causal, sample_ids=local_ids
    )
    (out * local_w).sum().backward()
    worst = float((out - ref.detach().index_select(2, positions)).abs().max())
    for mine, full in zip(local, (q, k, v)):
        expected = full.grad.index_select(2, positions)
        worst = max(worst, float((mine.grad - expected).abs().max() / expected.abs().max()))
    return worst


def _reference_mask(is_causal: bool, ids: torch.Tensor | None) -> torch.Tensor:
    mask = torch.ones(S, S, dtype=torch.bool)[None, None]
    if is_causal:
        mask = mask & torch.tril(torch.ones(S, S, dtype=torch.bool))
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    return mask


@pytest.mark.parametrize(
    "is_causal,packed,load_balance",
    [(True, False, True), (True, False, False), (False, True, False), (True, True, True)],
    ids=["causal-balanced", "causal", "packed-bidirectional", "causal-packed-balanced"],
)
def test_attention_over_sharded_sequences_equals_full_attention(is_causal, packed, load_balance):
    assert max(run_on_ranks(2, _attention_case, is_causal, packed, load_balance)) < 1e-12


def _residual_over_a_gather_case(in_place: bool) -> float:
    """``x + gather(cut(x) @ w)`` twice over, each rank computing the loss on its whole result and counting it once
    (``/ cp``), as diffusers plans that gather inside a block do (Helios): the gradients summed over the ranks against
    one device's. ``in_place``: the gather's backward sums the incoming gradient in place, as it once did."""
    g = torch.Generator().manual_seed(0)
    x0, w0, probe = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 8, 4), (4, 4), (2, 8, 4)))
    rank, size = dist.get_rank(), dist.get_world_size()

    def loss(x, w, cut, gather):
        for _ in range(2):
            x = x + gather(cut(x) @ w)  # AddBackward hands both summands the one gradient tensor
        return (x * probe).sum()

    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss(x1, w1, lambda t: t, lambda t: t).backward()  # one device
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    patch = mock.patch.object(_GatherAlongDim, "backward", staticmethod(_summed_in_place)) if in_place else None
    with patch or contextlib.nullcontext():
        (loss(x, w, lambda t: shard_sequence(t, rank, size)[0], lambda t: gather_sequence(t, None, 1)) / size).backward()
    errors = []
    for grad, expected in ((x.grad, x1.grad), (w.grad, w1.grad)):
        dist.all_reduce(grad)
        errors.append(float((grad - expected).abs().max() / expected.abs().max()))
    return max(errors)


def _summed_in_place(ctx, grad):
    grad = grad.contiguous()
    dist.all_reduce(grad, group=ctx.group)
    return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.size, ctx.size), None, None


def test_a_residual_over_a_gathered_sequence_gets_one_devices_gradient():
    assert max(run_on_ranks(2, _residual_over_a_gather_case, False)) < 1e-12
    assert min(run_on_ranks(2, _residual_over_a_gather_case, True)) > 0.5  # the in-place sum: counted twice


def test_shard_sequence_balances_causal_work_and_checks_divisibility():
    x = torch.arange(8)[None]
    assert shard_sequence(x, 0, 2, load_balance=True)[1].tolist() == [0, 1, 6, 7]
    assert shard_sequence(x, 1, 2, load_balance=True)[1].tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="length 8, not divisible by 6"):
        shard_sequence(x, 0, 3, load_balance=True)


class TinyTransformer(nn.Module):
    """Embedding (tokens) or projection (video patches) + one attention block + head."""

    def __init__(self, vocab: int | None, features: int = 6, width: int = 8, out: int = 13) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Embedding(vocab, width) if vocab else nn.Linear(features, width)
        self.pos = nn.Embedding(64, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, out)
        self.double()

    def forward(self, x, positions, sample_ids, group, is_causal):
        h = self.inp(x) + self.pos(positions)
        b, s, w = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, H, w // H).permute(2, 0, 3, 1, 4)
        a = context_parallel_attention(q, k, v, group=group, positions=positions, is_causal=is_causal, sample_ids=sample_ids)
        return self.head(h + self.proj(a.transpose(1, 2).reshape(b, s, w)))


def _video_batch(rows: int) -> dict:
    """Packed 'video' rows: patch features, regression targets, per-token sample ids."""
    base = _packed_batch(5, rows)
    g = torch.Generator().manual_seed(6)
    n = base["tokens"].shape[1]
    return {
        "x": torch.randn(rows, n, 6, generator=g, dtype=torch.float64),
        "y": torch.randn(rows, n, 13, generator=g, dtype=torch.float64),
        "ids": base["ids"],
        "num_samples": base["num_samples"],
    }


def _per_token_losses(model, batch, positions, ids, group, kind):
    if kind == "video":
        pred = model(batch["x"], positions, ids, group, is_causal=False)
        return ((pred - batch["y"]) ** 2).sum(-1)
    logits = model(batch["tokens"], positions, None, group, is_causal=True)
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none"
    ).view_as(batch["labels"])


def _reference(kind: str, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = TinyTransformer(None if kind == "video" else 13)
    positions = torch.arange(batch["ids"].shape[1])
    losses = _per_token_losses(model, batch, positions, batch["ids"] if kind == "video" else None, None, kind)
    if kind == "video":  # mean over samples of the mean over each sample's tokens
        means = [losses[batch["ids"] == s].mean() for s in range(batch["num_samples"])]
        loss = torch.stack(means).mean()
    else:
        loss = losses.sum() / count_valid_tokens(batch["labels"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))


def _model_case(kind: str, dp: int, cp: int) -> float:
    batch = _video_batch(4) if kind == "video" else _packed_batch(8, 4)
    ref_grads, ref_norm = _reference(kind, batch)
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    loss_mesh = flatten_mesh(mesh, "dp_cp")
    model = TinyTransformer(None if kind == "video" else 13)
    fully_shard(model, mesh=loss_mesh)
    nd.use_sum_reduction(model)
    cp_group, cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    rows = _shard_rows(batch, mesh["dp"].get_local_rank(), dp) if kind == "lm" else {
        **{k: v.chunk(dp)[mesh["dp"].get_local_rank()] for k, v in batch.items() if k != "num_samples"}
    }
    balance = kind == "lm"
    local = {k: shard_sequence(v, cp_rank, cp, dim=1, load_balance=balance)[0] for k, v in rows.items() if torch.is_tensor(v)}
    positions = shard_sequence(rows["ids"], cp_rank, cp, dim=1, load_balance=balance)[1]
    ids = local["ids"]
    losses = _per_token_losses(model, local, positions, ids if kind == "video" else None, cp_group, kind)
    if kind == "video":
        if dp > 1:  # renumber this dp rank's samples from 0 (the same on its cp ranks)
            ids = torch.where(ids >= 0, ids - int(rows["ids"][rows["ids"] >= 0].min()), ids)
        n = int(ids.max()) + 1 if dp == 1 else int(rows["ids"][rows["ids"] >= 0].max() - rows["ids"][rows["ids"] >= 0].min()) + 1
        weights = sync_sample_weights([ids], [n], cp_group=cp_group, dp_group=mesh["dp"].get_group())
        loss = weights.normalize(losses)
    else:
        loss = sync_token_count(count_valid_tokens(local["labels"]), group=loss_mesh.get_group()).normalize(losses.sum())
    loss.backward()
    assert_close(nd.get_total_norm([p.grad for p in model.parameters()]), ref_norm)
    return max(float((p.grad.full_tensor() - ref_grads[n]).norm() / ref_grads[n].norm()) for n, p in model.named_parameters())


@pytest.mark.parametrize("kind,dp,cp", [("video", 2, 2), ("lm", 1, 2)], ids=["dit-dp2xcp2", "causal-lm-cp2"])
def test_models_under_context_parallel_match_single_device(kind, dp, cp):
    assert max(run_on_ranks(dp * cp, _model_case, kind, dp, cp)) < 1e-10
