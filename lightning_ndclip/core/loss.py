r"""Exact loss normalization: the mean is taken in the loss, over the *global* batch.

Averaging gradients over data-parallel ranks (DDP and FSDP's default) is biased as soon as ranks
hold different numbers of tokens: a token on a rank with :math:`N_k` tokens gets weight
:math:`1/(W N_k)` instead of :math:`1/N`. The exact gradient of a mean over the global batch is

* **global token mean** (LLMs): :math:`L = \frac{1}{N}\sum_i \ell_i`, with :math:`N` the valid
  tokens over every data-parallel and context-parallel rank and every micro-batch of the optimizer
  step. Each rank backpropagates :math:`\frac{1}{N}\sum_{i\ \text{local}} \ell_i`;
* **hierarchical (per-sample) mean** (video DiT): :math:`L = \frac{1}{B}\sum_b \frac{1}{T_b}
  \sum_{i \in b} \ell_{b,i}`, with :math:`T_b` the valid tokens of sample :math:`b` summed over the
  context-parallel ranks that hold parts of it, and :math:`B` the samples over data-parallel ranks
  and micro-batches (a sample split over cp ranks counts once). Each rank backpropagates
  :math:`\sum_{i\ \text{local}} \ell_i / (B\,T_{b(i)})`;

and then every data-parallel gradient reduction is a plain SUM (:mod:`lightning_ndclip.core.parallel.reduce`).

The counts are synchronized **before** backward, as device tensors (no host sync), with one small
all-reduce per optimizer step for the token mean and two for the hierarchical mean (per-sample
counts over cp, sample count over dp). Edge cases: a rank or micro-batch with no valid token
contributes zero; a window with no valid token anywhere gives a zero loss and zero gradients
(``empty`` is true) instead of NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, overload

import torch
import torch.distributed as dist

from lightning_ndclip.core.agree import host_reads_are_free, raise_agreed

__all__ = [
    "MicroBatchShare",
    "SampleWeights",
    "PendingTokenCount",
    "TokenCount",
    "count_valid_tokens",
    "loss_share",
    "sample_ids_from_lengths",
    "sync_sample_weights",
    "sync_token_count",
]

IGNORE_INDEX = -100
"""Label value of tokens that do not count (as in ``torch.nn.functional.cross_entropy``)."""


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, *, async_op: bool = False) -> dist.Work | None:
    """Sum ``t`` over ``group`` in place; with ``async_op``, the collective's work to wait for (``None``: nothing to do)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return None


def _no_count(group: dist.ProcessGroup | None) -> torch.Tensor:
    """The count of a rank without micro-batches: zero, on the device of its group's collectives, so
    that it still joins the all-reduce the other ranks wait in."""
    gloo = not (dist.is_available() and dist.is_initialized()) or dist.get_backend(group) == "gloo"
    return torch.zeros((), dtype=torch.int64, device=None if gloo else torch.accelerator.current_accelerator())


def count_valid_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The number of labels that are not ``ignore_index``, a 0-dim int64 device tensor."""
    return (labels != ignore_index).sum()


@dataclass(frozen=True)
class TokenCount:
    """The global valid-token count of one optimizer step.

    Attributes:
        total: :math:`N`, valid tokens over the group and every micro-batch (0-dim int64 tensor).
        empty: ``total == 0`` as a 0-dim bool tensor (the step has nothing to learn from).
        invalid: how many local counts, over the group, were not finite non-negative integers
            (0-dim int64; on CPU such a count raises instead, see :func:`sync_token_count`).
    """

    total: torch.Tensor
    empty: torch.Tensor
    invalid: torch.Tensor | None = None

    def normalize(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """``loss_sum / N``: the local sum of per-token losses scaled to its share of the global mean
        (zero, not NaN, when ``N == 0``; NaN when a count was invalid). See :func:`loss_share`."""
        return loss_share(loss_sum, self, reduction="sum")


def _invalid_counts(counts: Sequence[torch.Tensor]) -> torch.Tensor:
    """How many of ``counts`` are not finite non-negative integers (0-dim int64, on their device)."""
    bad = [~(torch.isfinite(c) & (c >= 0) & (c == c.round())) if c.is_floating_point() else c < 0 for c in counts]
    return torch.stack([b.any() for b in bad]).sum() if bad else torch.zeros((), dtype=torch.int64)


def _invalid_count_message(counts: Sequence[torch.Tensor]) -> str | None:
    """This rank's bad counts, by micro-batch, or ``None``."""
    mine = [f"micro-batch {m}: {c.tolist()}" for m, c in enumerate(counts) if bool(_invalid_counts([c]))]
    return f"token counts must be finite non-negative integers, got {', '.join(mine)}" if mine else None


@overload
def sync_token_count(
    local_counts: torch.Tensor | int | Sequence[torch.Tensor | int],
    group: dist.ProcessGroup | None = None,
    *,
    problem: str | None = None,
    async_op: Literal[False] = False,
) -> TokenCount: ...


@overload
def sync_token_count(
    local_counts: torch.Tensor | int | Sequence[torch.Tensor | int],
    group: dist.ProcessGroup | None = None,
    *,
    problem: str | None = None,
    async_op: Literal[True],
) -> PendingTokenCount: ...


def sync_token_count(
    local_counts: torch.Tensor | int | Sequence[torch.Tensor | int],
    group: dist.ProcessGroup | None = None,
    *,
    problem: str | None = None,
    async_op: bool = False,
) -> TokenCount | PendingTokenCount:
    """Sum the valid-token counts of this rank's micro-batches over ``group``: one all-reduce.

    Every count must be a finite, non-negative integer (an integer tensor, or a float one holding
    an integer value). A bad count on any rank, or a ``problem`` (a message: this rank could not
    count, e.g. its ``count_tokens`` raised), makes every rank of ``group`` raise the same
    :class:`~lightning_ndclip.core.agree.AgreedError` (a ``ValueError``), naming each rank and
    micro-batch at fault; the flag rides in the same all-reduce (:mod:`lightning_ndclip.core.agree`).
    On accelerators, where reading the flag would make the host wait, the count's
    :meth:`TokenCount.normalize` returns NaN instead (the step is then non-finite everywhere).

    Args:
        local_counts: the count of each micro-batch of the optimizer step on this rank (or their
            sum), e.g. from :func:`count_valid_tokens`; an empty sequence for a rank without
            micro-batches counts 0.
        group: every rank whose tokens enter the mean: the data-parallel *and* context-parallel
            ranks (not tp or pp peers, which see the same tokens). Default: the world.
        problem: why this rank has no usable counts (its ``local_counts`` are then placeholders).
        async_op: issue the all-reduce and return at once a :class:`PendingTokenCount`, whose
            :meth:`~PendingTokenCount.wait` gives the :class:`TokenCount` (and raises for bad counts):
            the collective overlaps whatever runs in between (the strategy: the previous step's backward
            and optimizer step).
    """
    given = [local_counts] if isinstance(local_counts, (torch.Tensor, int)) else list(local_counts)
    counts = [torch.as_tensor(c).detach() for c in given] or [_no_count(group)]
    invalid = _invalid_counts(counts) + int(problem is not None)
    total = torch.stack([c.to(torch.int64).sum() for c in counts]).sum()
    buffer = torch.stack([total, invalid.to(total.device)])
    pending = PendingTokenCount(buffer, _all_reduce(buffer, group, async_op=async_op), counts, problem, group)
    return pending if async_op else pending.wait()


class PendingTokenCount:
    """A token count whose all-reduce is in flight (:func:`sync_token_count` with ``async_op=True``).

    It holds no value: the count exists only as :meth:`wait`'s result, so nothing can read a sum the
    collective has not written yet. Issue the next optimizer step's counts early (e.g. before this step's
    backward) and wait before its first forward: every rank raises there alike for bad counts, before any
    collective of the forward. On accelerators :meth:`wait` makes the current stream wait, not the host.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        work: dist.Work | None,
        counts: list[torch.Tensor],
        problem: str | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._buffer, self._work, self._counts, self._problem, self._group = buffer, work, counts, problem, group
        self._count: TokenCount | None = None

    def wait(self) -> TokenCount:
        """The summed :class:`TokenCount` once the all-reduce is done; raises on every rank for bad counts
        where host reads are free (see :func:`sync_token_count`). Later calls return the same count."""
        if self._count is None:
            if self._work is not None:
                self._work.wait()
            total, invalid = self._buffer.unbind()
            if host_reads_are_free(total.device) and int(invalid):  # the message is made only for a failure
                raise_agreed(invalid, self._problem or _invalid_count_message(self._counts), self._group)
            self._count = TokenCount(total=total, empty=total == 0, invalid=invalid)
        return self._count


def loss_share(
    loss: torch.Tensor,
    normalization: TokenCount | torch.Tensor,
    *,
    local_tokens: torch.Tensor | None = None,
    reduction: str = "sum",
    source: str = "the loss",
) -> torch.Tensor:
    r"""This micro-batch's share of the global mean: the one place a loss is scaled (the strategy,
    its pipeline glue and :meth:`TokenCount.normalize` / :meth:`SampleWeights.normalize` all call it).

    With a :class:`TokenCount` (global token mean), the share is :math:`\sum_{i\ \text{local}} \ell_i / N`,
    the local sum read off ``loss``:

    * per-token losses (any non-scalar shape, ignored tokens 0, as ``cross_entropy(...,
      reduction="none")`` gives them): summed;
    * a scalar with ``reduction="sum"``: the sum itself;
    * a scalar with ``reduction="mean"``: the mean over the micro-batch's ``local_tokens`` valid
      tokens (``cross_entropy``'s default), times ``local_tokens`` (zero, not NaN, when it has none).
      Without ``local_tokens`` (where the micro-batch's own count is unknown) a mean is refused.

    With per-token weights (a tensor, one micro-batch's entry of :attr:`SampleWeights.weights`:
    the hierarchical mean), the share is :math:`\sum_i w_i \ell_i`; ``loss`` must hold the per-token
    losses, shaped like the weights.

    Args:
        loss: what the user's loss function returned for this micro-batch.
        normalization: the step's :class:`TokenCount`, or this micro-batch's per-token weights.
        local_tokens: this micro-batch's valid tokens (needed only for a scalar mean).
        reduction: ``"mean"`` or ``"sum"``: what a scalar ``loss`` is.
        source: what returned ``loss``, for error messages (e.g. ``"training_step"``).

    Raises:
        ValueError: naming ``source``, for a loss that cannot be scaled exactly.
    """
    # in at least float32, back to the loss's dtype at the end: in float16 a count above 65504 is inf
    # and a sample weight below about 6e-8 is 0, either of which made the share and every gradient 0
    wide = torch.promote_types(loss.dtype, torch.float32)
    if isinstance(normalization, torch.Tensor):
        if loss.shape != normalization.shape:
            raise ValueError(
                f"with loss_normalization='sample_mean', {source} must return per-token losses shaped like the "
                f"micro-batch's sample ids {tuple(normalization.shape)}, got {tuple(loss.shape)}"
            )
        return (loss.to(wide) * normalization.to(wide)).sum().to(loss.dtype)
    loss_sum = local_loss_sum(loss, local_tokens=local_tokens, reduction=reduction, source=source)
    share = (loss_sum / normalization.total.clamp(min=1).to(wide)).to(loss.dtype)
    return share if normalization.invalid is None else torch.where(normalization.invalid > 0, torch.nan, share)


@dataclass(frozen=True)
class MicroBatchShare:
    """How one micro-batch's loss becomes its share of the optimizer step's loss: the one value a
    training loop hands its loss scaling (Lightning's ``NDParallelStrategy`` makes one per micro-batch
    and gives it to its ``training_step`` and its pipeline).

    Attributes:
        normalization: the step's :class:`TokenCount` (the global token mean); this micro-batch's
            per-token weights (the per-sample mean: its entry of :attr:`SampleWeights.weights`); or a
            plain factor (no loss normalization: a mean of micro-batch means, e.g. ``1 / k``).
        local_tokens: this micro-batch's valid tokens, for a scalar mean under the token mean
            (``None`` where its own count is unknown: a cp shard, a pipeline's micro-batch).
        reduction: what a scalar loss is under the token mean: ``"mean"`` or ``"sum"``.
        ends_window: whether the optimizer step follows this micro-batch.
        micro_batches: how many micro-batches (on each data rank) its accumulation window holds.
    """

    normalization: TokenCount | torch.Tensor | float
    local_tokens: torch.Tensor | None = None
    reduction: str = "mean"
    ends_window: bool = True
    micro_batches: int = 1

    @property
    def weights(self) -> torch.Tensor | None:
        """The per-token weights of the per-sample mean, or ``None``."""
        return self.normalization if isinstance(self.normalization, torch.Tensor) else None

    def apply(self, loss: torch.Tensor, source: str = "the loss") -> torch.Tensor:
        """``loss``'s share (:func:`loss_share`; with a plain factor, the loss, or the sum of per-token
        losses, times it)."""
        if isinstance(self.normalization, float):
            return (loss if loss.dim() == 0 else loss.sum()) * self.normalization
        return loss_share(loss, self.normalization, local_tokens=self.local_tokens, reduction=self.reduction, source=source)

    def of_rows(self, rows: torch.Tensor | None) -> MicroBatchShare:
        """The share of some rows of this micro-batch (a pipeline's micro-batch): the per-token weights at
        ``rows``; any other share without a local count (those rows' own is unknown)."""
        if self.weights is not None and rows is not None:
            return replace(self, normalization=self.weights[rows])
        return replace(self, local_tokens=None)


def local_loss_sum(
    loss: torch.Tensor, *, local_tokens: torch.Tensor | None = None, reduction: str = "sum", source: str = "the loss"
) -> torch.Tensor:
    """The sum of this micro-batch's per-token losses read off ``loss`` (see :func:`loss_share`), in at
    least float32: per-token losses summed, a scalar sum as it is, a scalar mean times ``local_tokens``.

    Raises:
        ValueError: naming ``source``, for a mean without ``local_tokens`` or an unknown ``reduction``.
    """
    wide = torch.promote_types(loss.dtype, torch.float32)
    if loss.dim() > 0:
        loss_sum = loss.sum(dtype=wide)
    elif reduction == "sum":
        loss_sum = loss.to(wide)
    elif reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    elif local_tokens is None:
        raise ValueError(
            f"with loss_normalization='token_mean', {source} must return per-token losses (e.g. cross_entropy(..., "
            "reduction='none')) or, with NDParallelStrategy(loss_reduction='sum'), their sum: its mean cannot be "
            "weighted by its tokens"
        )
    else:
        count = local_tokens.to(device=loss.device)
        loss_sum = torch.where(count > 0, loss.to(wide) * count.to(wide), torch.zeros((), dtype=wide, device=loss.device))
    return loss_sum


def sample_ids_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Per-token sample ids ``0, 0, 1, 1, 1, ...`` of a packed row from its samples' lengths."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)


@dataclass(frozen=True)
class SampleWeights:
    """Per-token weights of the hierarchical mean for every micro-batch of one optimizer step.

    Attributes:
        weights: per micro-batch, a tensor shaped like its ``sample_ids`` holding
            :math:`1/(B\\,T_{b(i)})` for valid tokens and 0 elsewhere.
        tokens_per_sample: per micro-batch, :math:`T_b` of each of its samples (summed over cp).
        num_samples: :math:`B`, samples with at least one valid token over dp and micro-batches.
        local_samples: the samples this rank counts in :math:`B` (cp rank 0 of each sample's group
            counts it; others 0): the weight for a sample-weighted loss metric.
        empty: ``num_samples == 0``.
    """

    weights: list[torch.Tensor]
    tokens_per_sample: list[torch.Tensor]
    num_samples: torch.Tensor
    local_samples: torch.Tensor
    empty: torch.Tensor

    def normalize(self, token_losses: torch.Tensor, micro_batch: int = 0) -> torch.Tensor:
        """:math:`\\sum_i w_i \\ell_i` for one micro-batch: its share of the global hierarchical
        mean (``token_losses`` shaped like that micro-batch's ``sample_ids``). See :func:`loss_share`."""
        return loss_share(token_losses, self.weights[micro_batch])


def _bin_tokens(ids: torch.Tensor, mask: torch.Tensor, num_samples: int) -> torch.Tensor:
    """``num_samples + 1`` counts: the tokens in ``mask`` of each sample, then those whose id is
    ``num_samples`` or more (a scatter of known size: no host sync, unlike ``bincount``)."""
    bins = torch.where(mask, ids.clamp(max=num_samples), num_samples + 1).reshape(-1)
    counts = torch.zeros(num_samples + 2, dtype=torch.int64, device=ids.device)
    return counts.index_add_(0, bins, torch.ones_like(bins))[:-1]


def _out_of_range_message(binned: Sequence[torch.Tensor], num_samples: Sequence[int]) -> str | None:
    """This rank's micro-batches with sample ids out of range, or ``None``."""
    here = [
        f"micro-batch {m} has {int(c[-1])} valid tokens with a sample id >= num_samples={n}"
        for m, (c, n) in enumerate(zip(binned, num_samples))
        if c[-1]
    ]
    return f"sample_ids must lie in 0 .. num_samples - 1 (-1 for padding), but {'; '.join(here)}" if here else None


def sync_sample_weights(
    sample_ids: Sequence[torch.Tensor],
    num_samples: Sequence[int],
    valid: Sequence[torch.Tensor] | None = None,
    *,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    problem: str | None = None,
) -> SampleWeights:
    """Token weights of the hierarchical (per-sample) mean, synchronized before backward.

    Two all-reduces per optimizer step: the per-sample token counts over ``cp_group`` and the
    sample count over ``dp_group``.

    Args:
        sample_ids: per micro-batch of this rank, the sample index of every token
            (``0 .. num_samples[m] - 1``; ``-1`` for padding), any shape. Under context parallelism
            the ranks of a cp group hold parts of the *same* samples and use the same indices.
        num_samples: per micro-batch, how many samples it holds (the same on every cp rank).
        valid: optional per-micro-batch masks of tokens that count (e.g. ``labels != -100``).
        cp_group: the context-parallel group (``None`` without context parallelism).
        dp_group: the data-parallel group over which samples are distinct (default: the world
            when there is no ``cp_group``). With a ``cp_group``, pass the dp group explicitly.
        problem: why this rank has no usable sample ids (e.g. its ``sample_ids`` raised; its
            arguments are then placeholders, of the same ``num_samples`` as its cp peers').

    A sample id out of range, or a ``problem``, on any rank makes every rank raise an
    :class:`~lightning_ndclip.core.agree.AgreedError` (a ``ValueError``) naming the ranks at fault
    (the flag rides in the two all-reduces); on accelerators the weights become NaN instead.
    """
    if cp_group is not None and dp_group is None:
        raise ValueError("with a cp_group, pass dp_group too (the ranks holding distinct samples)")
    if len(sample_ids) != len(num_samples):
        raise ValueError(f"{len(sample_ids)} sample_ids tensors but {len(num_samples)} num_samples")
    sample_ids = [ids.to(torch.int64) for ids in sample_ids]
    masks = [(ids >= 0) if valid is None else (ids >= 0) & valid[m].to(torch.bool) for m, ids in enumerate(sample_ids)]
    # per micro-batch: the valid tokens of each of its samples, then those whose id is >= num_samples
    binned = [_bin_tokens(ids, mask, n) for ids, mask, n in zip(sample_ids, masks, num_samples)]
    counts = torch.cat([*binned, torch.tensor([int(problem is not None)], device=binned[0].device if binned else None)])
    if cp_group is not None:
        _all_reduce(counts, cp_group)
    counts, failed = counts[:-1], counts[-1]
    per_micro_batch = counts.split([n + 1 for n in num_samples])
    per_sample = [c[:-1] for c in per_micro_batch]
    present = sum(((c > 0).sum() for c in per_sample), counts.new_zeros(()))
    first_cp_rank = cp_group is None or dist.get_rank(cp_group) == 0
    local_samples = present if first_cp_rank else torch.zeros_like(present)
    out_of_range = sum((c[-1] for c in per_micro_batch), failed)
    summed = torch.stack([present, out_of_range])
    _all_reduce(summed, dp_group)
    total_samples, out_of_range = summed.unbind()
    # elsewhere, reading the flag would sync: the weights become nan; the message is made only for a failure
    if host_reads_are_free(counts.device) and int(out_of_range):
        message = problem or _out_of_range_message(binned, num_samples)
        raise_agreed(out_of_range, message, *([cp_group] if cp_group is not None else []), dp_group)
    scale = total_samples.clamp(min=1).to(torch.float64)
    weights = []
    for ids, mask, t in zip(sample_ids, masks, per_sample):
        inverse = torch.cat([1.0 / (t.clamp(min=1).to(torch.float64) * scale), scale.new_zeros(1)])
        weight = inverse[torch.where(mask, ids.clamp(max=len(t)), len(t))]  # the extra last entry: weight 0
        weights.append(torch.where(out_of_range > 0, torch.nan, weight))
    return SampleWeights(
        weights=weights,
        tokens_per_sample=list(per_sample),
        num_samples=total_samples,
        local_samples=local_samples,
        empty=total_samples == 0,
    )
