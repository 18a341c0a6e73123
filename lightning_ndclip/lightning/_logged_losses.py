"""The exact global means ``NDParallelStrategy`` logs: each training window's loss (``log_loss``) and each evaluation
epoch's (``val_loss``, ``test_loss``), the numbers one device would log, on any mesh.

Training: each micro-batch's loss is already its share of the window's global mean (``LossWindows``); the shares
add up over the window, and at its end one scalar all-reduce over the loss dims (``dp_cp``) gives the mean.
Evaluation: each step's loss is weighted as in training (its tokens, or its samples' token means) and summed into a
``GlobalMeanLoss`` over the loss dims, computed when the epoch ends. A name the module's own hook logs too is
refused: Lightning would average the two per rank, a number that changes with the mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_ndclip import _compat
from lightning_ndclip.core.agree import call_hook
from lightning_ndclip.core.loss import local_loss_sum, loss_share, sync_sample_weights
from lightning_ndclip.core.parallel.mesh import ParallelMeshes
from lightning_ndclip.lightning._windows import as_count, as_sample_ids
from lightning_ndclip.lightning.metrics import GlobalMeanLoss

__all__ = ["LoggedLosses"]


class LoggedLosses:
    """What the strategy logs for one ``Trainer`` run (see the module docstring).

    Args:
        train_name: the name of the training window's mean (``log_loss``); ``None``: not logged.
        log_eval: log ``val_loss`` / ``test_loss``.
        normalization, reduction: the strategy's ``loss_normalization`` and ``loss_reduction``.
    """

    def __init__(
        self,
        train_name: str | None,
        log_eval: bool,
        normalization: Literal["token_mean", "sample_mean"] | None,
        reduction: Literal["mean", "sum"],
    ) -> None:
        self.train_name, self.log_eval = train_name, log_eval
        self.normalization, self.reduction = normalization, reduction
        self._window: torch.Tensor | None = None
        self._eval: dict[str, GlobalMeanLoss] = {}
        self._logged: set[str] = set()  # "hook.name" logged here

    def add_window_share(self, module: pl.LightningModule, group: dist.ProcessGroup, output: Any, k: int, last: bool) -> None:
        """Add this micro-batch's share (``training_step``'s normalized loss, over ``k`` as Lightning divides it) to the
        window's loss; at the window's end (``last``), sum the shares over ``group`` and log the global mean."""
        if self.train_name is None:
            return
        loss = output["loss"] if isinstance(output, Mapping) else output
        share = loss.detach().to(torch.float64) / k
        self._window = share if self._window is None else self._window + share
        if not last:
            return
        total, self._window = self._window, None
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        self._log(module, "training_step", self.train_name, total, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)

    def add_eval(
        self, module: pl.LightningModule, hook: str, name: str, output: Any, batch: Any, *, own: bool,
        meshes: ParallelMeshes, device: torch.device,
    ) -> None:  # fmt: skip
        """Add this evaluation step's loss (``output``'s), weighted as in training, to the epoch's exact global mean
        ``name`` and log it. ``own``: the loss is a library model's own, under cp its part of the batch's mean."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not (self.log_eval and self.normalization and isinstance(loss, torch.Tensor)):
            return
        if meshes["pp"].size() > 1:  # run_pipeline's evaluation loss: the sum of the batch's per-token losses
            if self.normalization != "token_mean" or meshes["cp"].size() > 1:
                return
            hooks: Any = module
            weighted = loss.detach(), as_count(hooks.count_tokens(batch), device)
        else:
            weighted = self._weighted(module, hook, loss.detach(), batch, own, meshes, device)
        metric = self._eval.get(name)
        if metric is None:
            metric = self._eval[name] = GlobalMeanLoss(process_group=meshes["dp_cp"].get_group()).to(device)
        metric.update(*weighted)
        self._log(module, hook, name, metric, on_step=False, on_epoch=True, metric_attribute=name)

    def _weighted(
        self, module: pl.LightningModule, hook: str, loss: torch.Tensor, batch: Any, own: bool, meshes: ParallelMeshes,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(sum of this rank's weighted losses, its weight)`` for the epoch's exact global mean."""
        hooks: Any = module
        cp = meshes["cp"]
        if self.normalization == "sample_mean":  # the hook's failure rides in the weights' all-reduces
            hook_call, check = partial(hooks.sample_ids, batch), partial(as_sample_ids, device=device)
            described, problem = call_hook("sample_ids(batch)", hook_call, check)
            ids, num_samples, valid = described or (torch.zeros(0, dtype=torch.int64, device=device), 0, None)
            weights = sync_sample_weights(
                [ids], [num_samples], None if valid is None else [valid],
                cp_group=cp.get_group(), dp_group=meshes["dp"].get_group(), problem=problem,
            )  # fmt: skip
            # the sum over this rank's samples of their token means: the share of the batch's mean, times B
            return loss_share(loss, weights.weights[0], source=hook) * weights.num_samples, weights.local_samples
        count = as_count(hooks.count_tokens(batch), device)
        # count_tokens counts the raw batch: under cp a mean over this rank's shard cannot be weighted by it
        local = None if cp.size() > 1 and not own else count
        value = local_loss_sum(loss, local_tokens=local, reduction=self.reduction, source=hook)
        return value, count if cp.get_local_rank() == 0 else torch.zeros_like(count)

    def _log(self, module: pl.LightningModule, hook: str, name: str, value: Any, **options: Any) -> None:
        """``module.log`` one of these exact means, refusing a name the module's ``hook`` logged too (checked before
        it is first logged here: Lightning keeps a name's entry once logged)."""
        if f"{hook}.{name}" not in self._logged and _compat.logged_in_this_hook(module.trainer, hook, name):
            switch = "log_loss=None or another name" if hook == "training_step" else "log_eval_loss=False"
            raise ValueError(
                f"{hook} logs {name!r}, and NDParallelStrategy(loss_normalization={self.normalization!r}) logs "
                f"the exact global mean under that name: rename yours, or pass NDParallelStrategy({switch}). Your "
                "own per-rank means, averaged over ranks, change with the mesh when token counts differ"
            )
        module.log(name, value, **options)
        self._logged.add(f"{hook}.{name}")
