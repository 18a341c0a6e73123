"""Golden tests of loss normalization: distributed gradients equal the single-device gradients of
the same global batch (float64, relative 1e-10), on real ``fully_shard`` / ``parallelize_module``
models with SUM reduction; the usual biased recipe (per-rank mean, averaged gradients) fails the
same check. ``GlobalMeanLoss`` (a torchmetrics metric: Lightning's extra) logs the single-device mean."""

from __future__ import annotations

import pytest
import torch
from harness import run_on_ranks
from test_loss import (
    ROW,
    TokenModel,
    _max_relative_error,
    _packed_batch,
    _reference_grads,
    _shard_rows,
    _token_losses,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ndclip._compat import flatten_mesh
from lightning_ndclip.core.loss import count_valid_tokens, sync_sample_weights, sync_token_count
from lightning_ndclip.core.parallel.reduce import use_sum_reduction
from lightning_ndclip.lightning.metrics import GlobalMeanLoss


def _split_sequence(batch: dict, index: int, parts: int) -> dict:
    """Context parallelism: this cp rank's contiguous part of every row (samples split across ranks)."""
    cols = ROW // parts
    sl = slice(index * cols, (index + 1) * cols)
    return {k: (v[:, sl] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _token_mean_case(shape: tuple[int, int, int], micro_batches: int, biased: bool) -> float:
    """shape = (dp_replicate, dp_shard, tp); the global batch of each micro-step has 8 rows."""
    dp_replicate, dp_shard, tp = shape
    dp = dp_replicate * dp_shard
    window = [_packed_batch(seed, 8) for seed in range(micro_batches)]
    reference = _reference_grads(window, hierarchical=False)

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = TokenModel()
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    for name in ("embed", "up", "down", "head"):
        fully_shard(getattr(model, name), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if not biased:
        use_sum_reduction(model)
    dp_rank = mesh["dp_replicate"].get_local_rank() * dp_shard + mesh["dp_shard"].get_local_rank()
    mine = [_shard_rows(b, dp_rank, dp) for b in window]

    loss_group = flatten_mesh(dp_mesh, "loss").get_group() if dp_replicate > 1 else dp_mesh.get_group()
    count = sync_token_count([count_valid_tokens(b["labels"]) for b in mine], group=loss_group)
    metric = GlobalMeanLoss(process_group=loss_group)
    for m, b in enumerate(mine):
        model.set_requires_gradient_sync(m == len(mine) - 1)  # reduce once, on the last micro-batch
        losses = _token_losses(model, b)
        metric.update(losses.detach().sum(), count_valid_tokens(b["labels"]))
        if biased:  # the usual recipe: per-rank mean, averaged by FSDP and by accumulation
            loss = losses.sum() / count_valid_tokens(b["labels"]).clamp(min=1) / len(mine)
        else:
            loss = count.normalize(losses.sum())
        loss.backward()
    with torch.no_grad():  # the logged loss is the single-device mean over the whole window
        ref_model = TokenModel()
        losses = torch.cat([_token_losses(ref_model, b).flatten() for b in window])
        expected = float(losses.sum()) / sum(int(count_valid_tokens(b["labels"])) for b in window)
    assert abs(float(metric.compute()) - expected) <= 1e-12 * abs(expected)
    return _max_relative_error(model, reference)


TOKEN_CASES = {
    "dp4": ((1, 4, 1), 1),
    "hsdp2x2": ((2, 2, 1), 1),
    "fsdp2xtp2": ((1, 2, 2), 1),
    "dp2-accumulate3": ((1, 2, 1), 3),
}


@pytest.mark.parametrize("case", TOKEN_CASES, ids=list(TOKEN_CASES))
def test_global_token_mean_matches_single_device(case):
    shape, micro = TOKEN_CASES[case]
    world = shape[0] * shape[1] * shape[2]
    errors = run_on_ranks(world, _token_mean_case, shape, micro, False)
    assert max(errors) < 1e-10, errors
    biased = run_on_ranks(world, _token_mean_case, shape, micro, True)
    assert min(biased) > 1e-4, f"the biased recipe should be detectably wrong, got {biased}"


def _hierarchical_case(biased: bool) -> float:
    """dp=2 x cp=2: rows split by dp, each row's sequence split by cp (samples cut in two)."""
    window = [_packed_batch(10 + seed, 4) for seed in range(2)]  # 2 micro-batches
    reference = _reference_grads(window, hierarchical=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = TokenModel()
    loss_mesh = flatten_mesh(mesh, "dp_cp")
    for name in ("embed", "up", "down", "head"):
        fully_shard(getattr(model, name), mesh=loss_mesh)
    fully_shard(model, mesh=loss_mesh)
    if not biased:
        use_sum_reduction(model)
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    mine = [_split_sequence(_shard_rows(b, dp, 2), cp, 2) for b in window]

    weights = sync_sample_weights(
        [b["ids"] for b in mine],
        [b["num_samples"] for b in mine],
        [b["labels"] != -100 for b in mine],
        cp_group=mesh["cp"].get_group(),
        dp_group=mesh["dp"].get_group(),
    )
    metric = GlobalMeanLoss(process_group=loss_mesh.get_group())
    for m, b in enumerate(mine):
        model.set_requires_gradient_sync(m == len(mine) - 1)
        losses = _token_losses(model, b)
        if biased:  # per-rank token mean, averaged over ranks and micro-batches
            valid = b["labels"] != -100
            loss = losses.sum() / valid.sum().clamp(min=1) / len(mine)
        else:
            loss = weights.normalize(losses, m)
            t = weights.tokens_per_sample[m]
            per_token_t = torch.cat([t, t.new_ones(1)])[torch.where(b["ids"] >= 0, b["ids"], len(t))]
            metric.update((losses.detach() / per_token_t).sum(), weights.local_samples if m == 0 else 0)
        loss.backward()
    error = _max_relative_error(model, reference)
    if not biased:
        model_ref = TokenModel()  # the metric equals the single-device hierarchical loss
        with torch.no_grad():
            expected = _hierarchical_loss_value(model_ref, window)
        assert abs(float(metric.compute()) - expected) <= 1e-12 * abs(expected)
    return error


def _hierarchical_loss_value(model: nn.Module, batches: list[dict]) -> float:
    means = []
    for b in batches:
        loss, valid = _token_losses(model, b), b["labels"] != -100
        means += [loss[(b["ids"] == s) & valid].mean() for s in range(b["num_samples"]) if ((b["ids"] == s) & valid).any()]
    return float(torch.stack(means).mean())


def test_hierarchical_sample_mean_under_context_parallel_matches_single_device():
    errors = run_on_ranks(4, _hierarchical_case, False)
    assert max(errors) < 1e-10, errors
    biased = run_on_ranks(4, _hierarchical_case, True)
    assert min(biased) > 1e-4, biased
