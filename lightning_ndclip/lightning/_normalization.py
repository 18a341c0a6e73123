"""What ``loss_normalization`` asks of the LightningModule, and ``training_step``'s loss made its share of the window's
global mean (the counts themselves: :class:`~lightning_ndclip.lightning._windows.LossWindows`; the rule:
:class:`~lightning_ndclip.core.loss.MicroBatchShare`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_ndclip.core.load_balance import LOAD_BALANCING_KEY, window_share
from lightning_ndclip.core.loss import MicroBatchShare

__all__ = ["check_module_for", "normalized", "refuse_load_balancing"]

_NORMALIZATION_HOOKS = {
    "token_mean": "count_tokens(batch) -> Tensor, the number of valid tokens in a raw batch",
    "sample_mean": "sample_ids(batch) -> (ids, num_samples[, valid]) for this rank's tokens",
}
"""The LightningModule hook each ``loss_normalization`` reads, as its error names it."""

_READS_ITS_OWN_BATCHES = (
    "counts each accumulation window's batches before its first backward, and training_step(dataloader_iter) reads "
    "its batches itself, after that. Take training_step(batch, batch_idx), or use loss_normalization=None with "
    "sum_reduction=True and scale each loss by lightning_ndclip.sync_token_count(counts).normalize(loss_sum)"
)
_OPTIMIZES_MANUALLY = (
    "scales the loss that training_step returns, after manual optimization has already run backward and stepped on "
    "the unscaled one. With manual optimization, use loss_normalization=None with sum_reduction=True and scale each "
    "loss before manual_backward: lightning_ndclip.sync_token_count(counts).normalize(loss_sum) or "
    "sync_sample_weights(...).normalize(token_losses)"
)


def check_module_for(mode: str | None, module: pl.LightningModule) -> None:
    """What ``loss_normalization=mode`` needs of the LightningModule, one rule each."""
    if mode is None:
        return
    hook = _NORMALIZATION_HOOKS[mode]
    if not callable(getattr(module, hook.split("(")[0], None)):
        raise TypeError(f"NDParallelStrategy(loss_normalization={mode!r}) needs the LightningModule to define {hook}")
    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        raise ValueError(f"NDParallelStrategy(loss_normalization={mode!r}) {_READS_ITS_OWN_BATCHES}")
    if not module.automatic_optimization:
        raise ValueError(f"NDParallelStrategy(loss_normalization={mode!r}) {_OPTIMIZES_MANUALLY}")


def normalized(output: Any, share: MicroBatchShare, k: int, *, mode: str | None, own: bool, cuts: bool) -> Any:
    """``training_step``'s ``output`` with its loss as its share of the global mean, times ``k`` (Lightning divides by
    ``accumulate_grad_batches`` before backward), and its ``"load_balancing_loss"`` as its share of the window's.
    ``own``: a scalar mean may be weighted by the micro-batch's count (not under cp, unless it is a library model's
    own loss, its part of the micro-batch's mean); ``cuts``: the strategy cuts the library models' sequences."""
    if isinstance(output, Mapping) and "loss" not in output:
        raise ValueError(f"training_step returned a dict without a 'loss' key (keys: {sorted(output)})")
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"with loss_normalization={mode!r}, training_step must return its loss (a "
            f"tensor, or a dict with a 'loss' tensor), got {type(loss).__name__}"
        )
    source = "training_step"
    if not own:
        hint = "; or return the transformers model's own .loss (labels=...) as it is" if cuts else ""
        share = dataclasses.replace(share, local_tokens=None)
        source += f" (cp > 1: count_tokens counts the raw batch, not this shard{hint})"
    scaled = share.apply(loss, source=source) * k
    balancing = output.get(LOAD_BALANCING_KEY) if isinstance(output, Mapping) else None
    if balancing is not None:  # a share of the global micro-batch's loss: the window's mean, not a token mean
        scaled = scaled + window_share(balancing, share.micro_batches) * k
    return {**output, "loss": scaled} if isinstance(output, Mapping) else scaled


def refuse_load_balancing(output: Any, mode: str | None, *, pp: int) -> Any:
    """``output``, unless it holds a ``"load_balancing_loss"``, which this run would drop (it is added only with
    ``loss_normalization`` and ``pp=1``): a ``ValueError``, the same on every rank."""
    if isinstance(output, Mapping) and output.get(LOAD_BALANCING_KEY) is not None:
        raise ValueError(
            f"training_step returned {LOAD_BALANCING_KEY!r}, which NDParallelStrategy adds to the loss only with "
            f"loss_normalization='token_mean' or 'sample_mean' and pp=1 (here loss_normalization={mode!r}, pp={pp})"
        )
    return output
