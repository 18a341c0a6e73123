"""Loss normalization in pure PyTorch: the exact token mean through DDP's SUM hook against one device,
zero rather than NaN at the edges, out-of-range sample ids raising on every rank; and the model and packed
batches the other loss tests share. The golden tests on ``fully_shard`` / ``parallelize_module`` models
(which also check the ``GlobalMeanLoss`` metric, hence Lightning) are in test_loss_global_mean.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_ndclip.core.loss import (
    count_valid_tokens,
    sample_ids_from_lengths,
    sync_sample_weights,
    sync_token_count,
)

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
    # a rank without micro-batches (an empty list; it raised before the all-reduce, leaving the other waiting),
    # and a count given as a Python int
    uneven = sync_token_count([] if rank == 0 else [3, torch.tensor(2)])
    empty_loss = nobody.normalize(torch.tensor(0.0, requires_grad=True))
    empty_loss.backward()
    # one-token sample, a padding-only row, a micro-batch with no sample at all
    ids = [torch.tensor([[0, -1, -1], [-1, -1, -1]]), torch.full((1, 3), -1)]
    w = sync_sample_weights(ids, [1, 0], dp_group=None)
    return {
        "count": int(count.total),
        "uneven": int(uneven.total),
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
    assert r0["uneven"] == r1["uneven"] == 5
    assert r0["scaled"] == 0.0 and r1["scaled"] == 0.75 and r0["grad_finite"]
    assert r0["empty"] and r0["empty_loss"] == 0.0
    assert r0["samples"] == 2  # one one-token sample on each of the 2 ranks
    assert r0["weights"] == [[[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]]]


def _pending_case() -> dict:
    rank = dist.get_rank()
    pending = sync_token_count([torch.tensor(3 + rank), 2], async_op=True)
    assert not hasattr(pending, "total"), "a count in flight has no value to read"
    bad = sync_token_count([torch.tensor(-1 if rank == 1 else 1)], async_op=True)  # the all-reduce is issued: no raise
    count = pending.wait()
    try:
        bad.wait()
    except ValueError as error:
        raised = str(error)
    return {"total": int(count.total), "again": pending.wait() is count, "raised": raised}


def test_a_count_issued_early_is_the_same_count_and_raises_on_every_rank_when_waited_for():
    for r in run_on_ranks(2, _pending_case):
        assert r["total"] == 3 + 4 + 2 * 2 and r["again"]
        assert r["raised"].startswith("rank 1: token counts must be finite non-negative integers"), r["raised"]


def _ddp_case(use_hook: bool) -> float:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ndclip.core.parallel.reduce import sum_allreduce_hook

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
    expected = (
        "rank 3: sample_ids must lie in 0 .. num_samples - 1 (-1 for padding), but micro-batch 1 has 1 valid tokens "
        "with a sample id >= num_samples=2"
    )
    assert messages == [expected] * 4, messages  # the same on every rank of the dp and cp groups
