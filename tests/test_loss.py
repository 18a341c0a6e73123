"""Golden tests of loss normalization: distributed gradients equal the single-device gradients of
the same global batch (float64, relative 1e-10), on real ``fully_shard`` / ``parallelize_module``
models with SUM reduction; the usual biased recipe (per-rank mean, averaged gradients) fails the
same check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ndclip.core.loss import (
    count_valid_tokens,
    sample_ids_from_lengths,
    sync_sample_weights,
    sync_token_count,
)
from lightning_ndclip.core.reduce import use_sum_reduction
from lightning_ndclip.lightning.metrics import GlobalMeanLoss

VOCAB, WIDTH, ROW = 13, 8, 12


class TokenModel(nn.Module):
    """Per-token model (no mixing across positions), so a sequence split over cp ranks needs no
    attention exchange: the test isolates the loss weighting."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.tanh(self.up(h))))


def _packed_batch(seed: int, rows: int) -> dict[str, torch.Tensor]:
    """Rows packed with variable-length samples, padding labelled -100; some samples masked."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, ROW), generator=g)
    labels = torch.randint(0, VOCAB, (rows, ROW), generator=g)
    ids = torch.full((rows, ROW), -1)
    next_id = 0
    for r in range(rows):
        lengths = []
        while sum(lengths) < ROW - 2:
            lengths.append(int(torch.randint(1, 6, (1,), generator=g)))
        lengths[-1] -= sum(lengths) - (ROW - 2 - (r % 3))  # rows end with 0..2 padding tokens
        lengths = [n for n in lengths if n > 0]
        row_ids = sample_ids_from_lengths(torch.tensor(lengths)) + next_id
        ids[r, : len(row_ids)] = row_ids
        next_id += len(lengths)
    labels[ids < 0] = -100
    labels[(tokens == 3) & (ids >= 0)] = -100  # masked tokens inside samples
    return {"tokens": tokens, "labels": labels, "ids": ids, "num_samples": next_id}


def _token_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["tokens"])
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none"
    ).view_as(batch["labels"])


def _shard_rows(batch: dict, index: int, parts: int) -> dict:
    """The rows of one data-parallel rank, sample ids renumbered from 0."""
    rows = batch["tokens"].shape[0] // parts
    sl = slice(index * rows, (index + 1) * rows)
    ids = batch["ids"][sl].clone()
    present = ids[ids >= 0]
    first = int(present.min()) if present.numel() else 0
    ids[ids >= 0] -= first
    n = int(present.max()) - first + 1 if present.numel() else 0
    return {"tokens": batch["tokens"][sl], "labels": batch["labels"][sl], "ids": ids, "num_samples": n}


def _split_sequence(batch: dict, index: int, parts: int) -> dict:
    """Context parallelism: this cp rank's contiguous part of every row (samples split across ranks)."""
    cols = ROW // parts
    sl = slice(index * cols, (index + 1) * cols)
    return {k: (v[:, sl] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _reference_grads(batches: list[dict], hierarchical: bool) -> dict[str, torch.Tensor]:
    """Single device, whole window: token mean over all valid tokens, or mean of sample means."""
    model = TokenModel()
    losses = [_token_losses(model, b) for b in batches]
    if hierarchical:
        sample_means = []
        for b, loss in zip(batches, losses):
            valid = b["labels"] != -100
            for s in range(b["num_samples"]):
                mask = (b["ids"] == s) & valid
                if mask.any():
                    sample_means.append(loss[mask].mean())
        total = torch.stack(sample_means).mean()
    else:
        total = torch.cat([loss.flatten() for loss in losses]).sum() / sum(
            int(count_valid_tokens(b["labels"])) for b in batches
        )
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_relative_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, float((full - reference[name]).norm() / reference[name].norm()))
    return worst


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

    loss_group = dp_mesh._flatten("loss").get_group() if dp_replicate > 1 else dp_mesh.get_group()
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
    loss_mesh = mesh._flatten("dp_cp")
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


def _edge_case() -> dict:
    rank = dist.get_rank()
    labels = torch.full((2, 5), -100) if rank == 0 else torch.tensor([[1, 2, -100, -100, -100]] * 2)
    count = sync_token_count(count_valid_tokens(labels))
    loss_sum = torch.tensor(0.0, dtype=torch.float64, requires_grad=True) if rank == 0 else torch.tensor(
        3.0, dtype=torch.float64, requires_grad=True
    )
    scaled = count.normalize(loss_sum)
    scaled.backward()
    nobody = sync_token_count(torch.tensor(0))
    empty_loss = nobody.normalize(torch.tensor(0.0, requires_grad=True))
    empty_loss.backward()
    # one-token sample, a padding-only row, a micro-batch with no sample at all
    ids = [torch.tensor([[0, -1, -1], [-1, -1, -1]]), torch.full((1, 3), -1)]
    w = sync_sample_weights(ids, [1, 0], dp_group=None)
    return {
        "count": int(count.total),
        "scaled": float(scaled),
        "grad_finite": bool(torch.isfinite(loss_sum.grad)),
        "empty": bool(nobody.empty),
        "empty_loss": float(empty_loss),
        "weights": [x.tolist() for x in w.weights],
        "samples": int(w.num_samples),
    }


def test_edge_cases_give_zero_not_nan():
    r0, r1 = run_on_ranks(2, _edge_case)
    assert r0["count"] == r1["count"] == 4
    assert r0["scaled"] == 0.0 and r1["scaled"] == 0.75 and r0["grad_finite"]
    assert r0["empty"] and r0["empty_loss"] == 0.0
    assert r0["samples"] == 2  # one one-token sample on each of the 2 ranks
    assert r0["weights"] == [[[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]]]


def _ddp_case(use_hook: bool) -> float:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ndclip.core.reduce import sum_allreduce_hook

    window = [_packed_batch(20, 8)]
    reference = _reference_grads(window, hierarchical=False)
    model = DistributedDataParallel(TokenModel())
    if use_hook:
        model.register_comm_hook(None, sum_allreduce_hook)
    mine = _shard_rows(window[0], dist.get_rank(), dist.get_world_size())
    count = sync_token_count(count_valid_tokens(mine["labels"]))
    count.normalize(_token_losses(model, mine).sum()).backward()
    return _max_relative_error(model.module, reference)


def test_ddp_sum_hook_gives_the_exact_token_mean():
    assert max(run_on_ranks(2, _ddp_case, True)) < 1e-10
    assert min(run_on_ranks(2, _ddp_case, False)) > 1e-2  # DDP's default divides by the world size


def _out_of_range_case(bad_id_offset: int) -> str:
    """dp=2 x cp=2; rank 3 labels one valid token of its 2nd micro-batch with an id >= num_samples
    (and one masked-out token too, which does not count)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ids = [torch.tensor([[0, 0, 1, -1]]), torch.tensor([[0, 1, 1, 2]])]
    valid = [torch.ones(1, 4, dtype=torch.bool), torch.tensor([[True, True, True, False]])]
    ids[1][0, 3] = 2 + bad_id_offset + 3  # masked out: ignored on every rank
    if dist.get_rank() == 3:
        ids[1][0, 1] = 2 + bad_id_offset
    with pytest.raises(ValueError) as info:
        sync_sample_weights(ids, [2, 2], valid, cp_group=mesh["cp"].get_group(), dp_group=mesh["dp"].get_group())
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize("bad_id_offset", [0, 5], ids=["id-equal-to-num_samples", "id-beyond"])
def test_a_sample_id_out_of_range_raises_on_every_rank(bad_id_offset):
    """An id equal to num_samples used to get weight 0 silently (and one beyond it an IndexError
    on that rank alone)."""
    messages = run_on_ranks(4, _out_of_range_case, bad_id_offset)
    assert all(m.startswith("sample_ids must lie in 0 .. num_samples - 1 (-1 for padding), but ") for m in messages)
    assert messages[3].endswith("on this rank: micro-batch 1 has 1 valid tokens with a sample id >= num_samples=2")
    assert all(m.endswith("on another rank of the data- or context-parallel group") for m in messages[:3])
