"""Accumulation windows read ahead, so a loss can be normalized by the whole window's counts.

The exact global mean over an optimizer step needs the token (or per-sample) counts of *every*
micro-batch of the step before the first backward. :class:`LossWindows` wraps the training
dataloader: when ``training_step`` reaches a window's first batch, it reads the window's other
batches ahead, synchronizes its counts over the loss dims (one all-reduce for tokens, two for
samples), and then yields the batches one by one, remembering each batch's
:class:`~lightning_ndclip.core.loss.MicroBatchShare`. After a window's last forward the strategy has the next
window read (:meth:`LossWindows.read_next_window`): its token count's all-reduce then runs during this step's
backward and optimizer step, and is waited for before the next window's first forward.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_ndclip.core.agree import AgreedError, call_hook
from lightning_ndclip.core.loss import MicroBatchShare, sync_sample_weights, sync_token_count

if TYPE_CHECKING:
    from lightning_ndclip.lightning.strategy import NDParallelStrategy

__all__ = ["LossWindows"]


class LossWindows:
    """Wraps the training dataloader: yields its batches, and gives each its loss normalization
    (token count, or per-sample weights) synchronized over the loss dims for its whole accumulation
    window.

    Windows follow Lightning's accumulation: batches up to the next ``(batch_idx + 1) %
    accumulate_grad_batches == 0``, the last one shorter when the epoch (or ``limit_train_batches``)
    ends. A window's size is decided when ``training_step`` asks for its first batch's
    normalization (:meth:`window_of`), not when the batch is read: Lightning reads an unsized loader's
    first batch before ``on_train_epoch_start``, where ``GradientAccumulationScheduler`` sets that
    epoch's factor. The window's remaining batches are then read ahead, their counts synchronized
    (one all-reduce for tokens, two for samples), and yielded as Lightning asks for them.

    Resumed mid-epoch, Lightning's ``batch_idx`` goes on from the checkpoint's position: the batches
    are numbered from there, and the first window ends where Lightning's does. A plain dataloader
    starts the epoch over, so the batches the checkpointed run consumed are read and dropped: the
    resumed run reads what the uninterrupted one read. A stateful dataloader (``state_dict`` /
    ``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``) is restored by Lightning to its
    saved position instead, and nothing is dropped (see :class:`_StatefulLossWindows`).
    """

    def __new__(cls, dataloader: Any = None, *args: Any, **kwargs: Any) -> LossWindows:
        stateful = all(callable(getattr(dataloader, name, None)) for name in ("state_dict", "load_state_dict"))
        return super().__new__(_StatefulLossWindows if cls is LossWindows and stateful else cls)

    def __init__(self, dataloader: Any, strategy: NDParallelStrategy, trainer: pl.Trainer) -> None:
        self.dataloader = dataloader
        self._strategy = strategy
        self._trainer = trainer
        self._windows: dict[int, MicroBatchShare] = {}  # batch_idx -> its share of its window
        self._source: Iterator[Any] = iter(())
        self._unwindowed: dict[int, Any] = {}  # batches read whose window is not decided yet
        self._ahead: deque[Any] = deque()  # batches read for a window, not yet yielded
        self._next_read = 0  # the batch_idx of the next batch read from the loader
        self._window = (0, 0)  # the last window decided: [start, end) batch_idx
        self._issued: _Issued | None = None  # a decided window whose counts' all-reduce is in flight
        self._restored_behind: int | None = None  # a restored loader's batches Lightning already consumed
        self.first_window: tuple[torch.Tensor, str, int] | None = None  # (count, "tokens"/"samples", micro-batches)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, ... of the wrapped loader
        return getattr(self.__dict__["dataloader"], name)

    def window_of(self, batch_idx: int) -> MicroBatchShare:
        """How the loss of ``batch_idx`` becomes its share of its window's loss. Called for a window's
        first batch, decides the window: reads its other batches and syncs the counts."""
        if batch_idx not in self._windows and batch_idx == self._window[1]:
            self._decide_window(batch_idx)
        if self._issued is not None and batch_idx == self._issued.start:  # wait for its counts: raise alike, if at all
            issued, self._issued = self._issued, None
            for position, share in enumerate(issued.shares()):
                last = position == issued.size - 1
                self._windows[issued.start + position] = replace(share, ends_window=last, micro_batches=issued.size)
        try:
            return self._windows.pop(batch_idx)
        except KeyError:
            raise RuntimeError(
                f"LossWindows has no loss normalization for batch_idx={batch_idx}, only for "
                f"{sorted(self._windows) or 'no batch'}: training_step ran on a batch that the wrapped "
                "training dataloader did not yield in Lightning's order"
            ) from None

    def _decide_window(self, start: int) -> None:
        every, limit = self._trainer.accumulate_grad_batches, self._trainer.num_training_batches
        end = int(min(start + every - start % every, limit))
        while self._next_read < end and self._read_batch(snapshot=self._next_read == start):  # read ahead of Lightning
            self._ahead.append(self._unwindowed[self._next_read - 1])
        end = min(end, self._next_read)
        window = [self._unwindowed.pop(i) for i in range(start, end)]
        self._issued = _Issued(start, len(window), self._shares(window))
        self._window = (start, end)
        self._forget_before(start)

    def read_next_window(self) -> None:
        """Decide the window after the last one decided, now: read its batches and issue its counts' all-reduce,
        which then overlaps the rest of this optimizer step. Call after a window's last forward; nothing at the
        epoch's end (the next epoch may accumulate differently)."""
        if self._issued is None and self._window[1] < self._trainer.num_training_batches:
            self._decide_window(self._window[1])

    def close(self) -> None:
        """Wait for the counts' all-reduce of a window decided ahead that no step will use (training ended before
        it), so that no collective is left in flight once ``fit`` returns (a process group destroyed then would
        keep a thread waiting in it). A problem in those counts is no one's: training is over."""
        issued, self._issued = self._issued, None
        if issued is not None:
            with contextlib.suppress(AgreedError):
                issued.shares()

    def _read_batch(self, snapshot: bool) -> bool:
        """Read the loader's next batch into ``_unwindowed``; ``False`` at its end. ``snapshot``: the batch
        may start a window (a stateful loader keeps its state from before it)."""
        if snapshot:
            self._before_read(self._next_read)
        batch = next(self._source, _END)
        if batch is _END:
            return False
        self._unwindowed[self._next_read] = batch
        self._next_read += 1
        return True

    def _before_read(self, batch_idx: int) -> None:
        """Called before reading a batch that may start a window."""

    def _forget_before(self, batch_idx: int) -> None:
        """Called once a window starting at ``batch_idx`` is decided: Lightning is past the earlier ones."""

    def _shares(self, window: list[Any]) -> Callable[[], list[MicroBatchShare]]:
        """What gives the window's batches' shares (``ends_window`` left to the caller): the token count's all-reduce
        is issued here and waited for when that is called. The LightningModule's hooks run through
        :func:`~lightning_ndclip.core.agree.call_hook`: an exception or an unusable value on any rank
        becomes the same error on every rank of the count's all-reduce, which carries the flag."""
        module: Any = self._strategy.lightning_module  # a LightningModule with the hooks of its normalization
        meshes, device = self._strategy.meshes, self._strategy.root_device
        problems: list[str] = []
        if self._strategy.loss_normalization == "token_mean":
            counts = []
            for m, batch in enumerate(window):
                hook, check = partial(module.count_tokens, batch), partial(as_count, device=device)
                count, problem = call_hook(f"count_tokens(batch) of micro-batch {m}", hook, check)
                counts.append(torch.zeros((), dtype=torch.int64, device=device) if count is None else count)
                problems += [problem] if problem else []
            # summed over the batch dims only: the ranks of a cp group read the same raw batch
            pending = sync_token_count(counts, group=meshes["dp"].get_group(), problem="; ".join(problems) or None, async_op=True)
            reduction, size = self._strategy.loss_reduction, len(window)

            def shares() -> list[MicroBatchShare]:
                total = pending.wait()
                if self.first_window is None:
                    self.first_window = (total.total, "tokens", size)
                # under cp the raw micro-batch's count: the strategy weighs only a loss that is a part of its mean by it
                return [MicroBatchShare(total, local_tokens=local, reduction=reduction) for local in counts]

            return shares
        described = []
        for m, batch in enumerate(window):
            ids, problem = call_hook(
                f"sample_ids(batch) of micro-batch {m}", partial(module.sample_ids, batch), partial(as_sample_ids, device=device)
            )
            described.append(ids or (torch.zeros(0, dtype=torch.int64, device=device), 0, None))
            problems += [problem] if problem else []
        masked = any(d[2] is not None for d in described)
        weights = sync_sample_weights(
            [d[0] for d in described],
            [d[1] for d in described],
            [torch.ones_like(ids, dtype=torch.bool) if m is None else m for ids, _, m in described] if masked else None,
            cp_group=meshes["cp"].get_group(),
            dp_group=meshes["dp"].get_group(),
            problem="; ".join(problems) or None,
        )
        if self.first_window is None:
            self.first_window = (weights.num_samples, "samples", len(window))
        return lambda: [MicroBatchShare(w) for w in weights.weights]

    def __iter__(self) -> Iterator[Any]:
        limit = self._trainer.num_training_batches
        self._windows.clear()
        self._unwindowed.clear()
        self._ahead.clear()
        self._issued = None
        self._source = iter(self.dataloader)
        # this body runs at the epoch's first fetch, after Lightning restored (on resume) or reset its
        # progress: the batch_idx Lightning gives the next batch, > 0 when resumed mid-epoch
        index = self._trainer.fit_loop.epoch_loop.batch_idx + 1
        # a plain loader starts the epoch over: drop what the checkpointed run consumed
        behind, self._restored_behind = (index if self._restored_behind is None else self._restored_behind), None
        deque(islice(self._source, behind), maxlen=0)
        self._next_read, self._window = index, (index, index)
        while True:
            if self._ahead:
                yield self._ahead.popleft()
            elif self._next_read < limit and self._read_batch(snapshot=True):
                yield self._unwindowed[self._next_read - 1]
            else:
                return


_END = object()


@dataclass(frozen=True)
class _Issued:
    """A window read, its counts issued, not yet waited for: its first batch_idx, its number of batches, and what
    gives their shares (waiting for the counts)."""

    start: int
    size: int
    shares: Callable[[], list[MicroBatchShare]]


def as_count(value: Any, device: torch.device) -> torch.Tensor:
    """``count_tokens``' result as a count tensor on ``device``, or an error saying why it cannot be one."""
    if isinstance(value, bool) or not isinstance(value, (torch.Tensor, int, float)):
        raise TypeError(f"returned {type(value).__name__}, not the number of valid tokens (a tensor or an int)")
    count = torch.as_tensor(value).detach()
    if count.is_meta:
        raise ValueError("returned a meta tensor, which holds no value: count the batch's real labels")
    if count.dtype == torch.bool or count.is_complex():
        raise TypeError(f"returned a {count.dtype} tensor, not a number of tokens")
    return count.to(device, non_blocking=True)  # a count made on the host: copied without a device sync


def as_sample_ids(value: Any, device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``sample_ids``' result as ``(ids, num_samples, valid or None)`` on ``device``, or an error."""
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        raise TypeError(f"returned {type(value).__name__}, not (ids, num_samples[, valid])")
    tensors = [torch.as_tensor(value[0]), *(torch.as_tensor(v) for v in value[2:])]
    if any(t.is_meta for t in tensors):
        raise ValueError("returned a meta tensor, which holds no value")
    ids, valid = tensors[0].to(device), (tensors[1].to(device) if len(tensors) > 1 else None)
    return ids, int(value[1]), valid


class _StatefulLossWindows(LossWindows):
    """:class:`LossWindows` of a stateful dataloader, which Lightning saves in checkpoints and restores
    on resume: stateful itself, so Lightning saves and restores it through this wrapper.

    Its state is the loader's where Lightning stands: the loader's state before the batch that starts
    the window of Lightning's next batch, with the count of that window's batches Lightning consumed,
    which the resumed iteration reads and drops (the loader itself has read ahead of Lightning).
    """

    def __init__(self, dataloader: Any, strategy: NDParallelStrategy, trainer: pl.Trainer) -> None:
        super().__init__(dataloader, strategy, trainer)
        self._states: dict[int, Any] = {}  # batch_idx -> the loader's state before reading it

    def _before_read(self, batch_idx: int) -> None:
        self._states[batch_idx] = self.dataloader.state_dict()

    def _forget_before(self, batch_idx: int) -> None:
        self._states = {i: state for i, state in self._states.items() if i >= batch_idx}

    def state_dict(self) -> dict[str, Any]:
        consumed = self._trainer.fit_loop.epoch_loop.batch_idx + 1  # Lightning's next batch_idx
        start, end = self._window
        if start <= consumed < end:  # inside a decided window
            return {"loader": self._states[start], "behind": consumed - start}
        if consumed in self._states:  # a window's first batch, read ahead of Lightning
            return {"loader": self._states[consumed], "behind": 0}
        return {"loader": self.dataloader.state_dict(), "behind": 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) == {"loader", "behind"}:
            self.dataloader.load_state_dict(state_dict["loader"])
            self._restored_behind = int(state_dict["behind"])
        else:  # the loader's own state, saved without this wrapper (or by 0.1.0's at a window boundary)
            self.dataloader.load_state_dict(state_dict)
            self._restored_behind = 0
