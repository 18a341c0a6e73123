"""The step hooks on this cp rank's part of the batch, where the library models' own plans cut their sequences
(``ParallelPlan(tp_plan="auto")`` with ``cp > 1``): the batch cut the way the model's library cuts it, the cut's
shard active around the hook, and whether the loss the hook returned is a library model's own (its part of the
micro-batch's mean, which the loss normalization may weight by this shard's count)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip.core import libraries
from lightning_ndclip.core.parallel.plan import ParallelPlan

__all__ = ["CutSteps"]


class CutSteps:
    """Runs step hooks on this cp rank's part of the batch (the hook's first argument) where ``plan`` cuts the library
    models' sequences over ``cp``; elsewhere as they are."""

    def __init__(self, module: nn.Module, plan: ParallelPlan, cp: DeviceMesh) -> None:
        self._module, self._plan, self._cp = module, plan, cp
        self.cuts = plan.cuts_sequences(cp.size())
        """Whether batches are cut (``tp_plan="auto"`` with ``cp > 1``)."""

    @cached_property
    def library(self) -> libraries.ModelLibrary:
        """The library whose models' batches are cut (one: a batch is cut once); a ``ValueError`` naming what the
        module holds otherwise."""
        kinds = {found.library.name: found.library for found in libraries.models(self._module)}
        if len(kinds) != 1:
            raise ValueError(
                f"cp > 1 with tp_plan='auto' cuts each batch the way its model's library does, and "
                f"{type(self._module).__name__} holds models of {sorted(kinds) or 'no library'}: give one library's"
            )
        return next(iter(kinds.values()))

    def run(self, hook: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """``hook(*args, **kwargs)`` on this rank's part of the batch, and whether the loss it returned (``output`` or
        ``output["loss"]``) is one a library model computed in it."""
        if not self.cuts:
            return hook(*args, **kwargs), False
        batch = args[0] if args else kwargs["batch"]
        cut = self.library.cut_batch(batch, self._cp, self._plan.kv_exchange)
        args, kwargs = ((cut.batch, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": cut.batch})
        with cut.active:
            output = hook(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        return output, any(loss is own for own in cut.model_losses)

    def context_summary(self) -> str | None:
        """The library's line for the startup summary (how attention sees the other cp ranks), or ``None``."""
        return self.library.context_summary(self._cp.size(), self._plan.kv_exchange) if self.cuts else None
