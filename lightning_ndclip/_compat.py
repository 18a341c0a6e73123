"""Every private (``_``-prefixed) Lightning and PyTorch name the package uses, in one place.

Each entry says why no public API serves. ``tests/test_compat.py`` checks that every one of them
exists in the installed versions, so an upgrade that drops one fails loudly there, not mid-training.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device

__all__ = ["materialize_distributed_module", "optimizers_to_device", "should_accumulate"]


def materialize_distributed_module(module: torch.nn.Module, device: torch.device) -> None:
    """Materialize meta-device tensors after parallelization, as ``ModelParallelStrategy.setup`` does
    (reason: our ``setup`` re-states Lightning's so a declarative plan can replace ``configure_model``)."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer states to the device, as ``ModelParallelStrategy.setup`` does (same reason)."""
    _optimizers_to_device(optimizers, device)


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the current micro-batch is not the last of its accumulation window (reason: the loop's
    own decision; re-deriving it could disagree with Lightning at an epoch's last, partial window)."""
    return trainer.fit_loop._should_accumulate()
