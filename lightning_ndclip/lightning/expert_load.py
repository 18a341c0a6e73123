"""``router_aux_loss``: a transformers MoE's load-balancing loss, exact on every mesh, from ``training_step``.

The numerics are the core's (:mod:`lightning_ndclip.core.load_balance`): the routing statistics are summed over
the strategy's data ranks (``meshes["dp_cp"]``) before the loss is formed, and each rank returns its share. This
module finds the group, the expert count and the coefficient from the LightningModule, and logs the expert load.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_ndclip import _compat
from lightning_ndclip.core import libraries
from lightning_ndclip.core.load_balance import (
    LOAD_BALANCING_KEY,
    alone,
    experts_of,
    in_pooled_replay,
    load_balance,
    max_over_mean,
)

__all__ = ["router_aux_loss"]

_WINDOW_LOAD: weakref.WeakKeyDictionary[pl.LightningModule, torch.Tensor] = weakref.WeakKeyDictionary()
"""Per LightningModule, the global expert load of the accumulation window so far (``[L, E]`` int64)."""


def router_aux_loss(
    module: pl.LightningModule,
    outputs: Any,
    attention_mask: torch.Tensor | None = None,
    *,
    model: nn.Module | None = None,
    coef: float | None = None,
    log_expert_load: bool = True,
    log_prefix: str = "expert_load/",
) -> torch.Tensor:
    r"""This data rank's share of ``coef`` times the load-balancing loss of the global micro-batch, for
    ``training_step`` to return under ``"load_balancing_loss"``::

        out = self.lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return {"loss": ce, "load_balancing_loss": router_aux_loss(self, out, batch["attention_mask"])}

    transformers' ``aux_loss`` (:func:`~lightning_ndclip.core.load_balance.load_balancing_loss`) with the token
    fractions and mean router probabilities summed over the strategy's data ranks (``meshes["dp_cp"]``: dp x cp,
    which covers ep) before the loss is formed: one all-reduce of ``L x E + 1`` integers. ``NDParallelStrategy``
    adds the entry to the loss as the mean over the window's micro-batches, not scaled by tokens, so the step's
    gradient is the one device's of ``CE(window) + coef x mean over micro-batches of aux(global micro-batch)``
    (``docs/howto/moe-balancing.md``), on every mesh; ``VerifyOneDevice`` checks it.

    Args:
        module: the LightningModule (``self``): its trainer's strategy gives the data ranks.
        outputs: the model's output (with ``router_logits``), or the router logits themselves.
        attention_mask: the ``[batch, sequence]`` mask the model was called with (padding is not counted).
        model: the transformers model, for the expert count, top-k and ``router_aux_loss_coef``; default: the one
            transformers model inside ``module``.
        coef: the loss's weight; default: the model's ``router_aux_loss_coef``.
        log_expert_load: log, for each routed layer ``i`` (the entries of ``router_logits``), ``<log_prefix>layer_<i>``:
            the most (token, choice) pairs any expert received over the optimizer step, over the mean per expert,
            on the whole global batch (1 is a perfect balance; ``E / top_k`` every token on the same experts). Device
            tensors, logged at each optimizer step without a host read (the logger reads them when it writes).
        log_prefix: the logged names' prefix.

    Raises:
        TypeError: under a strategy that does not add ``"load_balancing_loss"`` to the loss (the entry would be
            dropped, the loss untrained): anything but ``NDParallelStrategy(loss_normalization=...)`` with ``pp=1``.
    """
    router_logits = _router_logits(outputs)
    found = model if model is not None else _the_model(module)
    num_experts, top_k = experts_of(found)
    if coef is None:
        coef = _coefficient(found)
    trainer = _trainer_of(module)
    if in_pooled_replay() or not isinstance(trainer, pl.Trainer):
        # a replay on one process (VerifyOneDevice's stand-in trainer), or a module outside a Trainer: nothing to sum
        # over, nothing to log
        with alone():
            return coef * load_balance(router_logits, num_experts, top_k, attention_mask).loss
    strategy = trainer.strategy
    if not getattr(strategy, "adds_load_balancing_loss", False):
        raise TypeError(
            f"router_aux_loss needs a strategy that adds training_step's {LOAD_BALANCING_KEY!r} to the loss, unscaled by "
            f"tokens: NDParallelStrategy(loss_normalization='token_mean' or 'sample_mean', pp=1); {type(strategy).__name__}"
            " would drop it"
        )
    balance = load_balance(router_logits, num_experts, top_k, attention_mask, group=strategy.meshes["dp_cp"])  # type: ignore[attr-defined]
    if log_expert_load and trainer.training:
        _log_window_load(module, trainer, balance.expert_load, log_prefix)
    return coef * balance.loss


def _trainer_of(module: pl.LightningModule) -> Any:
    """The module's trainer, or ``None`` outside one."""
    try:
        return module.trainer
    except RuntimeError:  # not attached to a Trainer
        return None


def _router_logits(outputs: Any) -> Any:
    if isinstance(outputs, (torch.Tensor, tuple, list)):
        return outputs
    logits = outputs.get("router_logits") if isinstance(outputs, Mapping) else getattr(outputs, "router_logits", None)
    if logits is None:
        raise ValueError("the model output has no router_logits: call the model with output_router_logits=True")
    return logits


def _the_model(module: nn.Module) -> nn.Module:
    return libraries.the_model(module, "router_aux_loss", instead="Pass router_aux_loss(model=...)").model


def _coefficient(model: nn.Module) -> float:
    routing = libraries.expert_routing(model)
    if routing is None or routing.coef is None:
        raise ValueError(f"{type(model).__name__} names no load-balancing weight (router_aux_loss_coef): pass coef=...")
    return routing.coef


def _log_window_load(module: pl.LightningModule, trainer: pl.Trainer, load: torch.Tensor, prefix: str) -> None:
    """Add this micro-batch's global expert load to its window's; at the window's end, log each layer's max / mean."""
    so_far = _WINDOW_LOAD.get(module)
    total = load if so_far is None or so_far.shape != load.shape else so_far + load
    if _compat.should_accumulate(trainer):
        _WINDOW_LOAD[module] = total
        return
    _WINDOW_LOAD.pop(module, None)
    for layer, value in enumerate(max_over_mean(total).unbind()):
        module.log(
            f"{prefix}layer_{layer}", value, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True, batch_size=1
        )
