"""A torchmetrics metric for the correctly weighted global average loss."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric
from typing_extensions import override

__all__ = ["GlobalMeanLoss"]


class GlobalMeanLoss(Metric):
    r"""The weighted mean :math:`\sum \text{value} / \sum \text{weight}` over steps and ranks.

    * token mean: ``update(loss_sum_local, valid_tokens_local)``;
    * hierarchical mean: ``update(weights_sum, samples)`` with
      ``weights_sum`` :math:`= \sum_{i\ \text{local}} \ell_i / T_{b(i)}` and ``samples`` the
      :attr:`~lightning_ndclip.core.loss.SampleWeights.local_samples` (each sample counted by one cp rank).

    Pass ``process_group`` = the loss group (data-parallel x context-parallel ranks): tp and pp
    peers hold copies of the same values and must not be added again. A window with zero weight
    computes to ``nan`` (nothing was measured).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("value", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    value: torch.Tensor
    weight: torch.Tensor

    @override
    def update(self, value: torch.Tensor, weight: torch.Tensor | float) -> None:
        """Add a local weighted sum ``value`` and its total ``weight``."""
        self.value += torch.as_tensor(value, dtype=torch.float64, device=self.value.device).detach().sum()
        self.weight += torch.as_tensor(weight, dtype=torch.float64, device=self.weight.device).detach().sum()

    @override
    def compute(self) -> torch.Tensor:
        """The global weighted mean."""
        return self.value / self.weight
