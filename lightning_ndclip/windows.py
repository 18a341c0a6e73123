"""Accumulation windows read ahead, so a loss can be normalized by the whole window's counts.

The exact global mean over an optimizer step needs the token (or per-sample) counts of *every*
micro-batch of the step before the first backward. :class:`LossWindows` wraps the training
dataloader: it reads each window of ``accumulate_grad_batches`` batches ahead, synchronizes its
counts over the loss dims (one all-reduce for tokens, two for samples), and then yields the
batches one by one, remembering each batch's scale for the strategy's ``training_step``.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_ndclip.loss import sync_sample_weights, sync_token_count

if TYPE_CHECKING:
    from lightning_ndclip.strategy import NDParallelStrategy

__all__ = ["LossWindows"]


class LossWindows:
    """Wraps the training dataloader: reads each accumulation window ahead, synchronizes its loss
    normalization (token count, or per-sample weights) over the loss dims, then yields the window's
    batches one by one.

    Windows follow Lightning's accumulation: ``accumulate_grad_batches`` consecutive batches from
    the start of the epoch, the last one shorter when the epoch (or ``limit_train_batches``) ends.
    """

    def __init__(self, dataloader: Any, strategy: NDParallelStrategy, trainer: pl.Trainer) -> None:
        self.dataloader = dataloader
        self._strategy = strategy
        self._trainer = trainer
        self._windows: dict[int, tuple[Any, bool]] = {}

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, ... of the wrapped loader
        return getattr(self.__dict__["dataloader"], name)

    def window_of(self, batch_idx: int) -> tuple[Any, bool]:
        """The normalization of ``batch_idx`` (``(TokenCount of the window, this batch's local
        count)``, or its per-token sample weights) and whether it is the window's last batch."""
        return self._windows.pop(batch_idx)

    def _scales(self, window: list[Any]) -> list[Any]:
        module: Any = self._strategy.lightning_module  # a LightningModule with the hooks of its normalization
        meshes, device = self._strategy.meshes, self._strategy.root_device
        if self._strategy._loss_normalization == "token_mean":
            # summed over the batch dims only: the ranks of a cp group read the same raw batch
            counts = [torch.as_tensor(module.count_tokens(b)).to(device) for b in window]
            count = sync_token_count(counts, group=meshes["dp"].get_group())
            return [(count, local) for local in counts]
        described = [module.sample_ids(b) for b in window]
        weights = sync_sample_weights(
            [torch.as_tensor(d[0]).to(device) for d in described],
            [int(d[1]) for d in described],
            [torch.as_tensor(d[2]).to(device) for d in described] if all(len(d) > 2 for d in described) else None,
            cp_group=meshes["cp"].get_group(),
            dp_group=meshes["dp"].get_group(),
        )
        return weights.weights

    def __iter__(self) -> Iterator[Any]:
        every = self._trainer.accumulate_grad_batches
        limit = self._trainer.num_training_batches
        self._windows.clear()
        batches = iter(self.dataloader)
        index = 0
        while index < limit:
            window = list(islice(batches, int(min(every, limit - index))))
            if not window:
                return
            for position, (batch, scale) in enumerate(zip(window, self._scales(window))):
                self._windows[index] = (scale, position == len(window) - 1)
                index += 1
                yield batch
