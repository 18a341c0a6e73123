"""Accumulation windows read ahead, so a loss can be normalized by the whole window's counts.

The exact global mean over an optimizer step needs the token (or per-sample) counts of *every*
micro-batch of the step before the first backward. :class:`LossWindows` wraps the training
dataloader: it reads each window of ``accumulate_grad_batches`` batches ahead, synchronizes its
counts over the loss dims (one all-reduce for tokens, two for samples), and then yields the
batches one by one, remembering each batch's scale for the strategy's ``training_step``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_ndclip.core.loss import sync_sample_weights, sync_token_count

if TYPE_CHECKING:
    from lightning_ndclip.lightning.strategy import NDParallelStrategy

__all__ = ["LossWindows"]


class LossWindows:
    """Wraps the training dataloader: reads each accumulation window ahead, synchronizes its loss
    normalization (token count, or per-sample weights) over the loss dims, then yields the window's
    batches one by one.

    Windows follow Lightning's accumulation: ``accumulate_grad_batches`` consecutive batches from
    the start of the epoch, the last one shorter when the epoch (or ``limit_train_batches``) ends.

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
        self._windows: dict[int, tuple[Any, bool]] = {}
        self._read = self._yielded = 0  # batches of the current window read ahead, and yielded
        self._restored_behind: int | None = None  # a restored loader's batches Lightning already consumed
        self.first_window: tuple[torch.Tensor, str, int] | None = None  # (count, "tokens"/"samples", micro-batches)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, ... of the wrapped loader
        return getattr(self.__dict__["dataloader"], name)

    def window_of(self, batch_idx: int) -> tuple[Any, bool]:
        """The normalization of ``batch_idx`` (``(TokenCount of the window, this batch's local
        count)``, or its per-token sample weights) and whether it is the window's last batch."""
        try:
            return self._windows.pop(batch_idx)
        except KeyError:
            raise RuntimeError(
                f"LossWindows has no loss normalization for batch_idx={batch_idx}, only for "
                f"{sorted(self._windows) or 'no batch'}: training_step ran on a batch that the wrapped "
                "training dataloader did not yield in Lightning's order"
            ) from None

    def _scales(self, window: list[Any]) -> list[Any]:
        module: Any = self._strategy.lightning_module  # a LightningModule with the hooks of its normalization
        meshes, device = self._strategy.meshes, self._strategy.root_device
        if self._strategy._loss_normalization == "token_mean":
            # summed over the batch dims only: the ranks of a cp group read the same raw batch
            counts = [torch.as_tensor(module.count_tokens(b)).to(device) for b in window]
            count = sync_token_count(counts, group=meshes["dp"].get_group())
            if self.first_window is None:
                self.first_window = (count.total, "tokens", len(window))
            return [(count, local) for local in counts]
        described = [module.sample_ids(b) for b in window]
        weights = sync_sample_weights(
            [torch.as_tensor(d[0]).to(device) for d in described],
            [int(d[1]) for d in described],
            [torch.as_tensor(d[2]).to(device) for d in described] if all(len(d) > 2 for d in described) else None,
            cp_group=meshes["cp"].get_group(),
            dp_group=meshes["dp"].get_group(),
        )
        if self.first_window is None:
            self.first_window = (weights.num_samples, "samples", len(window))
        return weights.weights

    def _before_window(self) -> None:
        """Called before each window is read ahead."""

    def __iter__(self) -> Iterator[Any]:
        every = self._trainer.accumulate_grad_batches
        limit = self._trainer.num_training_batches
        self._windows.clear()
        self._read = self._yielded = 0
        batches = iter(self.dataloader)
        # this body runs at the epoch's first fetch, after Lightning restored (on resume) or reset its
        # progress: the batch_idx Lightning gives the next batch, > 0 when resumed mid-epoch
        index = self._trainer.fit_loop.epoch_loop.batch_idx + 1
        # a plain loader starts the epoch over: drop what the checkpointed run consumed
        behind, self._restored_behind = (index if self._restored_behind is None else self._restored_behind), None
        deque(islice(batches, behind), maxlen=0)
        while index < limit:
            self._before_window()  # up to Lightning's next boundary: (batch_idx + 1) % every == 0, or the end
            window = list(islice(batches, int(min(every - index % every, limit - index))))
            if not window:
                return
            self._read, self._yielded = len(window), 0
            for position, (batch, scale) in enumerate(zip(window, self._scales(window))):
                self._windows[index] = (scale, position == len(window) - 1)
                index += 1
                self._yielded += 1
                yield batch


class _StatefulLossWindows(LossWindows):
    """:class:`LossWindows` of a stateful dataloader, which Lightning saves in checkpoints and restores
    on resume: stateful itself, so Lightning saves and restores it through this wrapper.

    Its state is the loader's where Lightning stands: at a window boundary (a checkpoint at an
    optimizer step) the loader's current state; mid-window, where the loader has read ahead of
    Lightning, the loader's state before the window with the count of its batches Lightning consumed,
    which the resumed iteration reads and drops.
    """

    def __init__(self, dataloader: Any, strategy: NDParallelStrategy, trainer: pl.Trainer) -> None:
        super().__init__(dataloader, strategy, trainer)
        self._window_start: Any = None  # the loader's state before the current window

    def _before_window(self) -> None:
        self._window_start = self.dataloader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        if self._yielded == self._read:
            return {"loader": self.dataloader.state_dict(), "behind": 0}
        return {"loader": self._window_start, "behind": self._yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) == {"loader", "behind"}:
            self.dataloader.load_state_dict(state_dict["loader"])
            self._restored_behind = int(state_dict["behind"])
        else:  # the loader's own state, saved without this wrapper (or by 0.1.0's at a window boundary)
            self.dataloader.load_state_dict(state_dict)
            self._restored_behind = 0
