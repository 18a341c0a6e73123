"""``GlobalNormClip``: exact global-norm clipping and logging for any Lightning strategy."""

from __future__ import annotations

import math
import operator
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_ndclip import _compat
from lightning_ndclip.core.norm.clip_grad import GradNorms, NormPlans, grad_norms

__all__ = ["GlobalNormClip"]

NonFinitePolicy = Literal["skip", "raise", "clip"]


class GlobalNormClip(Callback):
    r"""Clip gradients to a global norm of at most ``max_norm`` before every optimizer step, exactly,
    on any mesh, and log the norms.

    Runs in ``on_before_optimizer_step``: after the closure (and gradient accumulation) and after the
    fp16 grad scaler's unscale, before ``optimizer.step()``. The norm is computed by
    :func:`lightning_ndclip.grad_norms` over the optimizer's parameters (one all-reduce once the
    layout is known), and gradients are scaled by :math:`\min(1, \text{max\_norm}/(\text{norm} +
    10^{-6}))`, a device tensor, by the callback or, folded, by a fused optimizer in its own pass.

    Args:
        max_norm: the maximum global norm.
        norm_type: p of the p-norm (any ``p > 0``, or ``inf``).
        nonfinite: what to do when the norm is ``nan`` or ``inf`` (decided identically on every rank,
            since the norm is): ``"skip"`` (default) drops every gradient (``grad = None``) so the
            optimizer leaves parameters and state unchanged, counts the step in
            ``grad_norm/skipped_steps`` and warns; ``"raise"`` raises ``RuntimeError``; ``"clip"``
            scales anyway (gradients become non-finite, as with PyTorch). ``"skip"`` and ``"raise"``
            read one boolean on the host per step, and first compute a non-finite norm again with
            float64 sums (finite gradients above about 1e19 overflow float32 sums of squares);
            ``"clip"`` never synchronizes (on accelerators such a norm stays ``inf``).
        log_every_n_steps: log at the optimizer steps Lightning writes to the logger with this
            period (step ``s`` when ``(s + 1) % log_every_n_steps == 0``, and the last step of a
            run); default: the Trainer's ``log_every_n_steps``; use a multiple of it (values logged
            at steps Lightning does not write are dropped by Lightning).
        log_module_depth: also log ``grad_norm/<module>`` for every module prefix of this many dotted
            name components (``1``: ``layers``, ``2``: ``layers.0``, ...); exact global norms.
        log_name_filter: also log ``grad_norm/<name>`` for every parameter whose name matches this
            regular expression (``re.search``).
        expert_pattern: also log ``grad_norm/expert`` and ``grad_norm/dense``: the exact norms of
            the parameters whose name matches this regular expression (e.g. ``r"\.experts\."``) and
            of all others.
        fold_into_optimizer: let the optimizer apply the clip: an optimizer that reads the
            ``grad_scale`` and ``found_inf`` attributes ``GradScaler`` sets (torch's Adam, AdamW,
            SGD and Adagrad with ``fused=True``) gets ``grad_scale = 1 / coef`` and divides every
            gradient by it in its own pass, writing it back, so ``p.grad`` ends clipped as without
            folding (up to one rounding of ``1 / coef``), one pass over the gradients fewer. The
            attribute is removed after the step. ``None`` (default): fold wherever the optimizer
            supports it, unless the norm is accumulated in float64 (the coefficient travels in
            float32, as ``GradScaler``'s scale does); ``True``: fold float64 norms too, and raise
            ``ValueError`` at fit start for an optimizer that does not support it; ``False``: never
            fold.
        pp_mesh, tied_parameters, process_group, accumulate_dtype: as in
            :func:`lightning_ndclip.clip_grad_norm_`.

    Under an fp16 ``GradScaler`` (``"16-mixed"``), Lightning unscales the gradients before this
    callback for every optimizer except those that unscale in their own step (the fused ones); for
    those the callback calls ``scaler.unscale_(optimizer)`` itself, so the norm is always that of
    the true gradients. A non-finite norm there is the scaler's overflow, routine while it finds its
    scale: the scaler skips the step and lowers the scale, and the callback only counts the step in
    ``skipped_steps``, whatever ``nonfinite`` says (no warning, no error). When the last
    ``training_step`` of an accumulation window returns ``None``, Lightning takes no step under a
    ``GradScaler`` (it neither unscales nor steps), and the callback leaves that step alone too.

    The callback keeps its own :class:`lightning_ndclip.NormPlans` (the plan of each gradient layout)
    for as long as it lives.

    Logged (pre-clip and post-clip are both named, so neither is mistaken for the other):
    ``grad_norm/total`` (pre-clip), ``grad_norm/clipped`` (post-clip), ``grad_norm/clip_coef``,
    ``grad_norm/skipped_steps``; with several optimizers, each under ``grad_norm/opt<i>/`` (its
    index in ``trainer.optimizers``), since one batch may step them all.

    Counters, for run summaries (all kept in the callback's checkpoint state): the read-only
    properties ``seen_steps`` (optimizer steps seen), ``clipped_steps`` (steps whose finite norm
    was scaled down, i.e. clip coefficient < 1) and ``clip_rate`` (``clipped_steps / seen_steps``;
    0.0 before the first step), and ``skipped_steps`` (steps skipped for a non-finite norm). A step
    with a non-finite norm counts as seen but never as clipped, whatever ``nonfinite`` is. The
    clipped count is accumulated in a device tensor, so counting adds no host synchronization; it
    is read (one synchronization) only when asked for: ``clipped_steps``, ``clip_rate``, or a
    checkpoint.
    """

    def __init__(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        nonfinite: NonFinitePolicy = "skip",
        log_every_n_steps: int | None = None,
        log_module_depth: int | None = None,
        log_name_filter: str | None = None,
        expert_pattern: str | None = None,
        pp_mesh: DeviceMesh | None = None,
        tied_parameters: Mapping[str, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        accumulate_dtype: torch.dtype | None = None,
        fold_into_optimizer: bool | None = None,
    ) -> None:
        if not max_norm > 0:
            raise ValueError(f"GlobalNormClip(max_norm=...) must be > 0, got {max_norm}")
        if not float(norm_type) > 0:
            raise ValueError(f"GlobalNormClip(norm_type=...) must be > 0 or inf, got {norm_type}")
        if nonfinite not in ("skip", "raise", "clip"):
            raise ValueError(f"GlobalNormClip(nonfinite=...) must be 'skip', 'raise' or 'clip', got {nonfinite!r}")
        if log_module_depth is not None and log_module_depth < 1:
            raise ValueError(f"GlobalNormClip(log_module_depth=...) must be >= 1, got {log_module_depth}")
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self.nonfinite = nonfinite
        self.log_every_n_steps = log_every_n_steps
        self.log_module_depth = log_module_depth
        self.log_name_filter = re.compile(log_name_filter) if log_name_filter else None
        self.expert_pattern = re.compile(expert_pattern) if expert_pattern else None
        self.fold_into_optimizer = fold_into_optimizer
        self._norm_kwargs = {
            "pp_mesh": pp_mesh,
            "tied_parameters": tied_parameters,
            "process_group": process_group,
            "accumulate_dtype": accumulate_dtype,
        }
        self._plans = NormPlans()
        self.skipped_steps = 0
        self._seen_steps = 0
        self._clipped: torch.Tensor | None = None  # device tensor: steps with a finite norm and coef < 1
        self._groupings: dict[str, tuple[tuple[str, ...], list[str], torch.Tensor]] = {}
        self._named_cache: list[tuple[str, torch.Tensor]] | None = None
        # per optimizer: the handle of the step post-hook that removes the grad_scale _fold set
        self._unfold_hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()
        self._folded: set[int] = set()  # ids of the optimizers whose grad_scale the callback set
        self._backward_ran = True  # whether the current batch's training_step ran a backward

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.gradient_clip_val is not None:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) and GlobalNormClip both clip "
                "gradients. Remove gradient_clip_val: GlobalNormClip computes the exact global norm on "
                "every mesh (Lightning's clipping is exact only on a single mesh)."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = getattr(trainer.strategy, "model", None) or pl_module
        if isinstance(trainer.strategy, FSDPStrategy) or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()
        ):
            raise TypeError(
                "GlobalNormClip does not support FSDP1 (FullyShardedDataParallel, Lightning's FSDPStrategy): "
                "its flat parameters are plain tensors holding a different shard on each rank, from which no "
                "exact norm can be computed. Use FSDP2 (fully_shard), e.g. with ModelParallelStrategy or "
                "NDParallelStrategy, or keep FSDPStrategy with Trainer(gradient_clip_val=...)"
            )
        if self.fold_into_optimizer:
            unable = [type(o).__name__ for o in trainer.optimizers if not _compat.applies_grad_scale(o)]
            if unable:
                raise ValueError(
                    f"GlobalNormClip(fold_into_optimizer=True): the optimizers {unable} do not apply a "
                    "grad_scale in their step; use torch.optim's Adam, AdamW, SGD or Adagrad with fused=True, "
                    "or fold_into_optimizer=None (fold where possible) or False"
                )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._backward_ran = False

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_ran = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._unfold_hooks.values():
            handle.remove()
        self._unfold_hooks.clear()

    @property
    def seen_steps(self) -> int:
        """Optimizer steps seen so far (skipped ones included)."""
        return self._seen_steps

    @property
    def clipped_steps(self) -> int:
        """Optimizer steps whose finite global norm exceeded ``max_norm`` (reads one device value)."""
        return 0 if self._clipped is None else int(self._clipped)

    @property
    def clip_rate(self) -> float:
        """``clipped_steps / seen_steps``; 0.0 before the first step."""
        return self.clipped_steps / self._seen_steps if self._seen_steps else 0.0

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "seen_steps": self._seen_steps,
            "clipped_steps": self.clipped_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self._seen_steps = state_dict.get("seen_steps", 0)  # absent from checkpoints of older versions
        self._clipped = torch.tensor(state_dict.get("clipped_steps", 0), dtype=torch.int64)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and not scaler.is_enabled():  # a disabled scaler neither unscales nor skips
            scaler = None
        if scaler is not None and pl_module.automatic_optimization and not self._backward_ran:
            return  # training_step returned None: under a GradScaler, Lightning then neither unscales nor steps
        if scaler is not None and _compat.applies_grad_scale(optimizer) and any(p.grad is not None for p in params):
            scaler.unscale_(optimizer)  # Lightning leaves these scaled (their step unscales); the norm needs them true
        named = self._named(pl_module, params)
        log_now = self._should_log(trainer)
        per_tensor = log_now and any(
            x is not None for x in (self.log_module_depth, self.log_name_filter, self.expert_pattern)
        )
        kwargs: dict[str, Any] = dict(self._norm_kwargs)
        if kwargs["pp_mesh"] is None:  # NDParallelStrategy(pp > 1) knows its pipeline dim and ties
            kwargs["pp_mesh"] = getattr(trainer.strategy, "pipeline_mesh", None)
        if kwargs["tied_parameters"] is None:
            kwargs["tied_parameters"] = getattr(trainer.strategy, "tied_parameters", None)
        # the total is read below anyway (unless nonfinite="clip"): an overflowed float32 sum is redone in float64
        norms = grad_norms(
            named,
            self.norm_type,
            per_tensor=per_tensor,
            retry_overflow=self.nonfinite != "clip" or None,
            plans=self._plans,
            **kwargs,
        )
        total = norms.total
        coef = norms.clip_coef(self.max_norm)
        fold = self._can_fold(optimizer, total)
        if self.nonfinite != "clip" and not (norms.finite if norms.finite is not None else bool(torch.isfinite(total))):
            if scaler is not None:  # the scaler's overflow: it skips the step and lowers its scale itself
                self.skipped_steps += 1
            elif self.nonfinite == "raise":
                raise RuntimeError(
                    f"GlobalNormClip: the global gradient norm is {float(total)} at step "
                    f"{trainer.global_step} (raised on every rank; nonfinite='skip' skips such steps)"
                )
            else:
                # not through found_inf: a fused optimizer's first step makes its state (SGD's momentum
                # from torch.empty_like) before the kernel skips, and would keep it uninitialised
                for p in params:
                    p.grad = None
                self.skipped_steps += 1
                rank_zero_warn(  # every rank skips alike: one warning for the job
                    f"GlobalNormClip: non-finite global gradient norm at step {trainer.global_step}; the "
                    f"optimizer step is skipped on every rank ({self.skipped_steps} skipped so far)",
                    category=RuntimeWarning,
                )
        elif fold:
            self._fold(optimizer, (1.0 / coef).to(torch.float32), scaler)
        else:
            norms.clip_(self.max_norm)
        self._count(total, coef)
        if log_now:
            self._log(pl_module, norms, coef, _log_prefix(trainer, optimizer))

    def _can_fold(self, optimizer: torch.optim.Optimizer, total: torch.Tensor) -> bool:
        """Whether this step's clip is left to ``optimizer`` (see ``fold_into_optimizer``)."""
        return (
            self.fold_into_optimizer is not False
            and _compat.applies_grad_scale(optimizer)
            and (self.fold_into_optimizer or total.dtype != torch.float64)
            and not hasattr(optimizer, "grad_scale")  # someone else uses the protocol this step
            and not hasattr(optimizer, "found_inf")
        )

    def _fold(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, scaler: Any) -> None:
        """Set ``grad_scale`` on ``optimizer`` for its next step. A ``GradScaler`` removes it after the
        step it drives (multiplying its own scale into it); otherwise a step post-hook registered once
        per optimizer removes it."""
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        if scaler is None:
            self._folded.add(id(optimizer))
            if optimizer not in self._unfold_hooks:
                self._unfold_hooks[optimizer] = optimizer.register_step_post_hook(self._unfold)

    def _unfold(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._folded and hasattr(optimizer, "grad_scale"):
            del optimizer.grad_scale
        self._folded.discard(id(optimizer))

    def _named(self, pl_module: pl.LightningModule, params: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` for the optimizer's parameters, cached while they stay the same."""
        cached = self._named_cache
        if cached is None or len(cached) != len(params) or not all(map(operator.is_, params, (p for _, p in cached))):
            name_of = {id(p): n for n, p in pl_module.named_parameters()}
            cached = self._named_cache = [(name_of.get(id(p), f"param_group_param[{i}]"), p) for i, p in enumerate(params)]
        return cached

    def _should_log(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning writes this optimizer step's logged values to the logger (its own rule:
        ``(steps done + 1) % every == 0``), or this is the run's last step."""
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 1) or 0)
        if trainer.logger is None or every == 0:  # log_every_n_steps=0: Lightning logs nothing
            return False
        step = _compat.batches_that_stepped(trainer) + 1
        last = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
        return step % every == 0 or last

    def _count(self, total: torch.Tensor, coef: torch.Tensor) -> None:
        """Count the step as seen, and as clipped if its norm is finite and ``coef < 1`` (on the device)."""
        clipped = ((coef < 1) & torch.isfinite(total)).to(torch.int64)
        self._clipped = clipped if self._clipped is None else self._clipped.to(clipped.device) + clipped
        self._seen_steps += 1

    def _log(self, pl_module: pl.LightningModule, norms: GradNorms, coef: torch.Tensor, prefix: str) -> None:
        values: dict[str, torch.Tensor | float] = {
            "grad_norm/total": norms.total,
            "grad_norm/clipped": norms.total * coef,
            "grad_norm/clip_coef": coef,
            # a device tensor filled in place: a Python float would be copied to the device, a host sync
            "grad_norm/skipped_steps": torch.full((), float(self.skipped_steps), device=norms.total.device),
        }
        if norms.per_tensor is not None:
            values.update(self._detail(norms))
        for key, value in values.items():
            key = key.replace("grad_norm/", prefix, 1)
            pl_module.log(key, value, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True)

    def _detail(self, norms: GradNorms) -> dict[str, torch.Tensor]:
        """Exact per-parameter (``log_name_filter``), per-module (``log_module_depth``) and
        dense/expert (``expert_pattern``) norms, all from the per-parameter norms of the one all-reduce."""
        assert norms.per_tensor is not None
        out: dict[str, torch.Tensor] = {}
        if self.log_name_filter is not None:
            for name, value in zip(norms.names, norms.per_tensor.unbind()):
                if self.log_name_filter.search(name):
                    out[f"grad_norm/{name}"] = value
        if self.log_module_depth is not None:
            depth = self.log_module_depth
            out.update(self._grouped(norms, "module", lambda n: ".".join(n.split(".")[:depth])))
        if self.expert_pattern is not None:
            pattern = self.expert_pattern
            out.update(self._grouped(norms, "expert", lambda n: "expert" if pattern.search(n) else "dense"))
        return out

    def _grouped(self, norms: GradNorms, kind: str, label_of: Callable[[str], str]) -> dict[str, torch.Tensor]:
        """Exact norms of groups of parameters: the p-norm of their per-parameter norms."""
        assert norms.per_tensor is not None
        cached = self._groupings.get(kind)
        if cached is None or cached[0] != norms.names:
            labels_per_name = [label_of(n) for n in norms.names]
            labels = sorted(set(labels_per_name))
            index = torch.tensor([labels.index(x) for x in labels_per_name], device=norms.per_tensor.device)
            cached = self._groupings[kind] = (norms.names, labels, index)
        _, labels, index = cached
        p = self.norm_type
        if math.isinf(p):
            grouped = torch.zeros(len(labels), dtype=norms.per_tensor.dtype, device=index.device)
            grouped.scatter_reduce_(0, index, norms.per_tensor, reduce="amax")
        else:
            grouped = torch.zeros(len(labels), dtype=torch.float64, device=index.device)
            grouped.index_add_(0, index, norms.per_tensor.to(torch.float64).pow(p))
            grouped = grouped.pow(1.0 / p)
        return {f"grad_norm/{label}": value for label, value in zip(labels, grouped.unbind())}


def _log_prefix(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> str:
    """``grad_norm/``, or ``grad_norm/opt<i>/`` for the trainer's i-th of several optimizers: one
    batch may step several, and values logged under one key in one batch keep only the last."""
    if len(trainer.optimizers) < 2:
        return "grad_norm/"
    index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), None)
    return "grad_norm/" if index is None else f"grad_norm/opt{index}/"
