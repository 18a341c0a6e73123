r"""Exact global gradient norm and clipping for N-D parallel models, in one collective.

For gradients :math:`g_1, \dots, g_k` of one logical model, viewed as a single flat vector :math:`G`,

.. math::

    \|G\|_p = \Big(\sum_{\text{logical elements } x} |x|^p\Big)^{1/p}, \qquad
    \|G\|_\infty = \max_x |x|, \qquad \|G\|_{-\infty} = \min_x |x|,

for every ``p`` torch accepts: ``p > 0``, ``p < 0`` (where one zero element makes the total 0, and
an ``inf`` element adds nothing), ``±inf``, and ``p = 0``, which torch defines per tensor and then
over the tensors: the number of logical tensors with a nonzero element (``nan`` counts as nonzero).
Whatever the mesh, every rank adds :math:`|x|^p` over the elements it is the designated holder of
(the plan, :mod:`._plan`), and one all-reduce (SUM, or MAX for ``±inf``: the minima travel negated)
yields the exact total on every rank; for ``p = 0`` the same all-reduce sums each logical tensor's
nonzero count over its counted pieces (one slot per tensor), and the total counts the nonzero slots.
No gradient is gathered, and the norm and the clip coefficient stay device tensors.

The functions are drop-ins for torch's ``get_total_norm``, ``clip_grad_norm_`` and
``clip_grads_with_norm_`` (the same arguments, results, warnings and errors; a DTensor total where
the gradients are DTensors), plus keyword-only arguments for what one device does not need.

One call, top to bottom (:func:`_global_norm`): the layout's plan (cached, :mod:`._cache`; agreed
with every rank on first use), the local powers of the counted pieces (the contiguous runs of
FSDP2's buffers, :mod:`._runs`), one all-reduce that also checks that every rank used the same
plan, the root; clipping multiplies every local piece by one device coefficient.
"""

from __future__ import annotations

import math
import operator
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_ndclip._compat import (
    device_has_foreach_support,
    disable_torch_function_subclass,
    foreach_mul_,
    foreach_norm,
    group_by_device_and_dtype,
    local_tensors,
)
from lightning_ndclip.core.agree import host_reads_are_free
from lightning_ndclip.core.norm._cache import NormPlans, PlanEntry, layout_key
from lightning_ndclip.core.norm._plan import NormPlanError, build_plan
from lightning_ndclip.core.norm._runs import RunFinder, dim0_paddings
from lightning_ndclip.core.parallel.mesh import PerProcessGroup

__all__ = ["GradNorms", "NormPlans", "clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm", "grad_norms"]

_GRAD = operator.attrgetter("grad")
_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_

_default_plans = PerProcessGroup(NormPlans)
"""The caches of every call that passes ``plans=None`` (for the default process group of the moment: a plan holds
the meshes and process groups it was agreed over)."""


@dataclass(frozen=True)
class GradNorms:
    """The result of :func:`grad_norms`.

    Attributes:
        total: the exact global norm, a plain 0-dim device tensor (also for DTensor gradients),
            identical on every rank.
        per_tensor: the exact global norm of every logical tensor world-wide (every pipeline stage;
            a tied parameter once; for ``p = 0`` its count of nonzero elements), a 1-D device tensor
            aligned with ``names``; ``None`` unless requested.
        names: the names of the entries of ``per_tensor``.
        finite: whether ``total`` is finite, where the call read that on the host (to redo an
            overflowed float32 sum in float64: ``retry_overflow``), so that a caller needs no second
            read; ``None`` where it read nothing.
    """

    total: torch.Tensor
    per_tensor: torch.Tensor | None
    names: tuple[str, ...]
    finite: bool | None = None
    _to_scale: tuple[torch.Tensor, ...] = field(default=(), repr=False, compare=False)
    _mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)  # see _as_torch_returns

    def clip_coef(self, max_norm: float) -> torch.Tensor:
        r"""The clip coefficient :math:`\min(1, \text{max\_norm} / (\text{total} + 10^{-6}))`, a
        device tensor (``nan`` when the total is)."""
        return _clip_coef(max_norm, self.total)

    @torch.no_grad()
    def clip_(self, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """Scale the gradients these norms were computed from by :meth:`clip_coef`, as
        :func:`clip_grads_with_norm_` would, without reading the parameters again (the gradient
        tensors as they were when the norms were computed). Returns the coefficient."""
        coef = self.clip_coef(max_norm)
        _scale_(self._to_scale, coef, foreach)
        return coef

    def as_dict(self) -> dict[str, torch.Tensor]:
        """``{name: norm}`` for every logical tensor (requires ``per_tensor``)."""
        if self.per_tensor is None:
            raise ValueError("per-tensor norms were not requested (per_tensor=False)")
        return dict(zip(self.names, self.per_tensor.unbind()))


@dataclass(frozen=True)
class _Request:
    """What one norm call asks for, beyond its tensors: the options of the public functions."""

    norm_type: float
    per_tensor: bool = False
    error_if_nonfinite: bool = False
    foreach: bool | None = None
    pp_mesh: DeviceMesh | None = None
    group: dist.ProcessGroup | None = None
    accumulate_dtype: torch.dtype | None = None
    retry_overflow: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm_type", float(self.norm_type))  # any float, as torch (nan gives nan)

    @property
    def extreme(self) -> bool:
        """``±inf``: the total is the largest (smallest) ``|x|``, combined by MAX (of the negated minima)."""
        return math.isinf(self.norm_type)

    @property
    def counts(self) -> bool:
        """``p = 0``: the total counts the logical tensors whose nonzero count, summed over their
        counted pieces in a slot each, is positive."""
        return self.norm_type == 0

    @property
    def powered(self) -> bool:
        """Finite ``p != 0``: pieces add ``|x|^p``, the total is the sum to the power ``1 / p``."""
        return not (self.extreme or self.counts)

    @property
    def slots(self) -> bool:
        """Whether the all-reduce carries a slot per logical tensor (per-tensor norms, or ``p = 0``)."""
        return self.per_tensor or self.counts

    @property
    def context(self) -> tuple:
        """What fixes the all-reduce's size for a given plan (see :func:`_agreed_plan`)."""
        return (self.pp_mesh, self.group, self.extreme, self.slots)


class _PlansDiffer(Exception):
    """Ranks reduced with different plans (or one had none): they exchange plans and try again."""


@torch.no_grad()
def get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
    tied: Mapping[str, torch.Tensor] | None = None,
    process_group: dist.ProcessGroup | None = None,
    accumulate_dtype: torch.dtype | None = None,
    retry_overflow: bool | None = None,
    plans: NormPlans | None = None,
) -> torch.Tensor:
    r"""The exact global norm of ``tensors`` (usually gradients) over every rank that holds part of them.

    A drop-in for :func:`torch.nn.utils.get_total_norm`, for plain tensors and DTensors on any meshes
    (``Shard``, ``_StridedShard``, ``Replicate``), across pipeline stages. Collective: every rank of
    ``process_group`` calls it, with tensors of the same layouts as the other ranks of its stage.
    Sharded mesh dims and stages are summed; replicated dims, copies of a mesh instance (plain
    tensors: DDP-style replicas) and tied tensors count once. ``Partial`` tensors are refused.

    Every ``norm_type`` torch accepts has torch's one-device meaning, exactly on any mesh:
    :math:`(\sum_x |x|^p)^{1/p}` over the logical elements for finite ``p != 0`` (``p < 0`` too:
    0 if any element is 0, and an ``inf`` element adds 0), :math:`\max_x |x|` for ``inf``,
    :math:`\min_x |x|` for ``-inf``, and for ``0`` the number of logical tensors with a nonzero
    element (torch's ``vector_norm(ord=0)`` of the per-tensor nonzero counts; a sharded tensor's
    count is the sum over its shards).

    Args:
        tensors: a tensor or an iterable of tensors.
        norm_type: p of the p-norm: any float, ``±inf`` included (see above).
        error_if_nonfinite: raise (on every rank) if the total is ``nan`` or ``inf`` (a host read).
        foreach: use the foreach kernels; ``None`` uses them where the device supports them.
        pp_mesh: the 1-D pipeline mesh. Default: the ``"pp"`` dim of the DTensors' root mesh, if any;
            else no pipeline parallelism.
        tied: ``{key: tensor}`` for tensors held by several pipeline stages as one logical tensor,
            already summed over them; every holder passes the same key. Counted once.
        process_group: the group spanning the model (default: the world).
        accumulate_dtype: dtype of the local sums and of the result; default ``float32``, or
            ``float64`` if any rank holds a ``float64`` tensor. The cross-rank sum is always done in
            ``float64``.
        retry_overflow: when the total comes out non-finite, compute it again accumulating in float64
            (a float32 sum of squares overflows for elements above about 1.8e19 although the norm
            fits). Reads the total on the host; ``None``: where that is free (CPU, or with
            ``error_if_nonfinite``), so that on accelerators an overflowed total stays ``inf``. For
            ``p > 0`` only: for ``p < 0``, float32 sums of :math:`|x|^p` overflow for tiny elements
            (below about 5e-20 for ``p = -2``) into a total of 0, as torch's do; float64 avoids it.
        plans: the caches to use (:class:`NormPlans`); ``None``: one default instance for the process.

    Returns:
        The total norm, a 0-dim tensor of ``accumulate_dtype``, identical on every rank: where any of
        ``tensors`` is a DTensor, as torch returns it, a DTensor replicated over every dim of the
        first DTensor's mesh (its value is the same on every rank, so that is a true replica, also
        where the tensors lie on several meshes, which torch refuses); else a plain tensor.

    Raises:
        NormPlanError: on every rank, when the first call with a layout finds a ``Partial`` tensor,
            ranks of one stage passing different tensors, or inconsistent meshes.
    """
    tensors = _as_tensor_list(tensors)
    request = _Request(norm_type, False, error_if_nonfinite, foreach, pp_mesh, process_group, accumulate_dtype, retry_overflow)
    return _as_torch_returns(_global_norm(tensors, None, _tie_keys(tensors, tied), request, plans))


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
    *,
    plans: NormPlans | None = None,
) -> None:
    r"""Scale the gradients of ``parameters`` by :math:`\min(1, \text{max\_norm} / (\text{total\_norm} + 10^{-6}))`.

    Like :func:`torch.nn.utils.clip_grads_with_norm_`, on the local shards of DTensor gradients (no
    collective). ``total_norm``: the global norm, a plain tensor or a DTensor (as :func:`get_total_norm`
    returns; torch's own ``Partial`` totals are reduced, as torch does); ``plans``: as there.
    """
    if isinstance(total_norm, DTensor):  # a replica's value is its local tensor; torch's Partial one is reduced
        replica = all(p.is_replicate() for p in total_norm.placements)
        total_norm = total_norm.to_local() if replica else total_norm.full_tensor()
    grads = [g for g in _read_grads(_as_tensor_list(parameters)) if g is not None]
    plans = _default_plans.get() if plans is None else plans
    finder, padding = plans.scale_runs.get(layout_key(grads), lambda: (RunFinder(), dim0_paddings(grads)))
    _scale_(finder.runs(local_tensors(grads), [True] * len(grads), padding).to_scale, _clip_coef(max_norm, total_norm), foreach)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
    tied_parameters: Mapping[str, torch.Tensor] | None = None,
    process_group: dist.ProcessGroup | None = None,
    accumulate_dtype: torch.dtype | None = None,
    retry_overflow: bool | None = None,
    plans: NormPlans | None = None,
) -> torch.Tensor:
    r"""Clip the gradients of ``parameters`` to a global norm of at most ``max_norm``, exactly.

    A drop-in for :func:`torch.nn.utils.clip_grad_norm_`: the global norm as in :func:`get_total_norm`
    (one all-reduce; every ``norm_type`` torch accepts), then every local gradient times
    :math:`\min(1, \text{max\_norm} / (\text{norm} + 10^{-6}))`, a device tensor (1 when the norm is
    below ``max_norm``: gradients left bit for bit). Parameters whose ``grad`` is ``None`` are skipped
    (ranks of a stage must agree on which); an empty generator warns, as torch does.

    Args:
        parameters: a tensor or an iterable of tensors whose gradients are clipped.
        max_norm: the maximum global norm.
        norm_type, error_if_nonfinite, foreach, pp_mesh, process_group, accumulate_dtype, retry_overflow, plans: as
            in :func:`get_total_norm`.
        tied_parameters: ``{key: parameter}`` for parameters held by several pipeline stages as one
            logical parameter, gradients already summed over the holders; counted once.

    Returns:
        The **pre-clip** total norm, a 0-dim tensor identical on every rank (a replicated DTensor
        where any gradient is a DTensor, as in :func:`get_total_norm`).
    """
    if isinstance(parameters, types.GeneratorType):
        parameters = list(parameters)
        if not parameters:  # stacklevel 3: past torch.no_grad's wrapper, at the caller, as torch's
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    params = _as_tensor_list(parameters)
    grads = _read_grads(params)
    if any(map(operator.is_, grads, repeat(None))):  # not `None in grads`: that calls Tensor.__eq__
        params, grads = [p for p, g in zip(params, grads) if g is not None], [g for g in grads if g is not None]
    request = _Request(norm_type, False, error_if_nonfinite, foreach, pp_mesh, process_group, accumulate_dtype, retry_overflow)
    norms = _global_norm(cast("list[torch.Tensor]", grads), None, _tie_keys(params, tied_parameters), request, plans)
    norms.clip_(max_norm, foreach)
    return _as_torch_returns(norms)


@torch.no_grad()
def grad_norms(
    named_parameters: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
    norm_type: float = 2.0,
    *,
    per_tensor: bool = True,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    tied_parameters: Mapping[str, torch.Tensor] | None = None,
    process_group: dist.ProcessGroup | None = None,
    accumulate_dtype: torch.dtype | None = None,
    retry_overflow: bool | None = None,
    plans: NormPlans | None = None,
) -> GradNorms:
    """The exact global norm and, from the same single all-reduce, the exact global norm of every
    parameter world-wide (all pipeline stages), for logging.

    Args:
        named_parameters: ``(name, parameter)`` pairs, or a module (its ``named_parameters()``).
        per_tensor: also return the per-parameter norms (costs one extra local pass over the
            gradients instead of the coalesced one, and a slot per parameter in the all-reduce).
        norm_type, foreach, pp_mesh, tied_parameters, process_group, accumulate_dtype, retry_overflow, plans: as
            in :func:`clip_grad_norm_` (``retry_overflow=None``: on CPU only).
    """
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    pairs = list(named_parameters)
    kept = [(n, p, g) for (n, p), g in zip(pairs, _read_grads([p for _, p in pairs])) if g is not None]
    request = _Request(norm_type, per_tensor, False, foreach, pp_mesh, process_group, accumulate_dtype, retry_overflow)
    tie_keys = _tie_keys([p for _, p, _ in kept], tied_parameters)
    return _global_norm([g for _, _, g in kept], [n for n, _, _ in kept], tie_keys, request, plans)


def _global_norm(
    grads: Sequence[torch.Tensor],
    names: Sequence[str] | None,
    tie_keys: Sequence[str | None] | None,
    request: _Request,
    plans: NormPlans | None,
) -> GradNorms:
    """The one call path of the public functions. A non-finite total is computed again in float64
    (``retry_overflow``; every rank sees the same total, so all do), rather than always accumulating
    in float64, which cost 4-16x on CPU (``benchmarks/results/local_norm_cpu_2_threads.md``)."""
    plans = _default_plans.get() if plans is None else plans
    names_key, ties_key = (None if x is None else tuple(x) for x in (names, tie_keys))
    key = (layout_key(grads), names_key, ties_key, request.pp_mesh, request.group)
    entry = plans.plans.get(key, partial(_agreed_plan, plans, grads, names, tie_keys, request))
    try:
        total, per_slot, to_scale = _norm(entry, grads, request, plans, request.accumulate_dtype)
    except _PlansDiffer:  # some rank's plan differs or it had none: agree on one (or all raise), once
        entry = plans.plans.put(key, _agreed_plan(plans, grads, names, tie_keys, request, diverged=True))
        try:
            total, per_slot, to_scale = _norm(entry, grads, request, plans, request.accumulate_dtype)
        except _PlansDiffer:
            raise RuntimeError(
                "ranks used different norm plans in the same call even after exchanging them; every rank of "
                "a stage must pass gradients of the same layout"
            ) from None
    retry = request.retry_overflow
    if retry is None:
        retry = request.error_if_nonfinite or host_reads_are_free(total.device)
    finite = None
    if retry and request.powered and request.norm_type > 0 and total.dtype != torch.float64:
        # p > 0 only: there an overflowed float32 sum is a non-finite total; for p < 0 it is a total of 0,
        # as torch's own is (accumulate_dtype=torch.float64 avoids both)
        finite = bool(torch.isfinite(total))  # the step's one host read
        if not finite:
            total64, per_slot64, _ = _norm(entry, grads, request, plans, torch.float64)
            total, per_slot = total64.to(total.dtype), None if per_slot64 is None else per_slot64.to(total.dtype)
            finite = bool(torch.isfinite(total))
    if request.error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {request.norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. This error is raised on every rank. To disable it, set `error_if_nonfinite=False`."
        )
    return GradNorms(total, per_slot, entry.plan.slot_names, finite, _to_scale=tuple(to_scale), _mesh=entry.mesh)


def _agreed_plan(
    plans: NormPlans,
    grads: Sequence[torch.Tensor],
    names: Sequence[str] | None,
    tie_keys: Sequence[str | None] | None,
    request: _Request,
    diverged: bool | None = None,
) -> PlanEntry:
    """This layout's plan, agreed with every rank (collective). A cache miss (``diverged=None``) after
    earlier calls in the same context may be this rank's alone, the others being in the norm's
    all-reduce already: it joins that all-reduce with a marker first (:func:`_probe`), so that every
    rank comes to the exchange. After a disagreement, ranks whose layouts differ all raise alike."""
    size = plans.last_size.get(request.context)
    if diverged is None and size is not None:
        local = local_tensors(grads)
        device = _collective_device(request.group, local[0].device if local else torch.device("cpu"))
        diverged = not _probe(size, request.extreme, request.group, device)
    try:
        plan = build_plan(
            grads,
            [f"tensor[{i}]" for i in range(len(grads))] if names is None else names,
            [None] * len(grads) if tie_keys is None else tie_keys,
            pp_mesh=request.pp_mesh,
            group=request.group,
        )
    except NormPlanError as error:
        if not diverged:
            raise
        raise RuntimeError(
            "ranks used different cached norm plans in the same call (their gradient layouts diverged after "
            f"agreeing earlier); every rank of a stage must pass gradients of the same layout: {error}"
        ) from error
    first = next((g for g in grads if isinstance(g, DTensor)), None)
    return PlanEntry(plan, padding=dim0_paddings(grads), mesh=None if first is None else first.device_mesh)


def _norm(
    entry: PlanEntry, grads: Sequence[torch.Tensor], request: _Request, plans: NormPlans, acc: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """The norm with a given plan, accumulated in ``acc`` (default: the plan's): (total, per-slot norms
    or ``None``, the local tensors to scale). Raises :class:`_PlansDiffer` when the ranks' plans turn
    out to differ (on CPU, where that is read without a device sync)."""
    plan = entry.plan
    acc = acc or plan.accumulate_dtype
    local = local_tensors(grads)
    runs = entry.finder.runs(local, plan.counted, entry.padding)
    device = local[0].device if local else torch.device("cpu")
    if plan.needs_collective:
        device = _collective_device(plan.group, device)
    per_slot = None
    if request.slots:  # per logical tensor: a run may join several tensors, so their pieces one by one
        present = [i for i, t in enumerate(local) if plan.counted[i] and t.numel() > 0]
        index = entry.constant(tuple(present), device, torch.long, lambda: [plan.slots[i] for i in present])
        per_slot = torch.full((len(plan.slot_names),), _identity(request), dtype=torch.float64, device=device)
        per_slot.index_copy_(0, index, _powers([local[i] for i in present], request, acc, device))
        power = _combine(per_slot, request)
    else:
        power = _combine(_powers(runs.to_norm, request, acc, device), request)
    copies = runs.to_check if plan.needs_collective and not request.counts else []
    if copies:  # replicas counted elsewhere can still hold an inf or nan that would make them diverge
        # in ``acc``: a float32 sum that overflows makes the total nan, which the float64 retry redoes.
        # Only what makes torch's total non-finite counts: any inf or nan for p > 0, a nan for p < 0
        # (an inf adds 0); nothing for p = 0, whose count takes nan as nonzero
        check = _stacked_norms(copies, 1.0, acc, request.foreach, device).sum()
        power = torch.where(torch.isfinite(check) if request.norm_type > 0 else ~torch.isnan(check), power, math.nan)
    if plan.needs_collective:
        power, per_slot = _all_reduce(power, per_slot, request, entry, device)
        plans.last_size[request.context] = (4 if request.extreme else 2) + (0 if per_slot is None else per_slot.numel())
    if request.counts:  # the logical tensors with a nonzero count (nan where the plans differed)
        power = torch.where(power.isnan(), math.nan, cast(torch.Tensor, per_slot).gt(0).sum().to(torch.float64))
    root = 1.0 / request.norm_type if request.powered else 1.0
    total = power.pow(root)
    per_slot = None if per_slot is None or not request.per_tensor else per_slot.pow(root).to(acc)
    return total.to(acc), per_slot, runs.to_scale


def _powers(tensors: Sequence[torch.Tensor], request: _Request, acc: torch.dtype, device: torch.device) -> torch.Tensor:
    r"""Per tensor, :math:`\|t\|_p^p` (for ``±inf`` the norm itself, the largest or smallest :math:`|x|`;
    for ``0`` its nonzero count), float64 on ``device``."""
    norms = _stacked_norms(tensors, request.norm_type, acc, request.foreach, device)
    return norms.pow(request.norm_type) if request.powered else norms


def _identity(request: _Request) -> float:
    """What a rank holding no counted piece contributes: the identity of :func:`_combine`."""
    return math.inf if request.norm_type == -math.inf else 0.0


def _combine(values: torch.Tensor, request: _Request) -> torch.Tensor:
    """The local total of per-piece values: their sum, or for ``±inf`` their max (min); ``nan`` propagates."""
    if values.numel() == 0:
        return values.new_full((), _identity(request))
    if request.extreme:
        return values.amax() if request.norm_type > 0 else values.amin()
    return values.sum()


def _all_reduce(
    local: torch.Tensor,
    per_slot: torch.Tensor | None,
    request: _Request,
    entry: PlanEntry,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one collective: sums (or, for ``±inf``, maxes) the local contributions and checks, in the
    same buffer, that every rank used the same plan. Returns the global (total, per-slot) values:
    ``nan`` where any rank held one (a slot: ``inf`` for the inf norm), everything ``nan`` where the
    plans differ and raising would need a host sync."""
    plan = entry.plan
    f, n = float(plan.fingerprint), dist.get_world_size(plan.group)
    minimum = request.norm_type == -math.inf  # min(x) = -max(-x): one MAX serves both extremes
    if request.extreme:
        # A MAX reduction may drop nan (gloo keeps whichever operand it holds), so nan travels as a
        # flag; max(f) == f and max(-f) == -f on every rank exactly when all fingerprints are equal.
        sent = expected = entry.constant(("sent", True), device, torch.float64, lambda: [f, -f])
        parts = [(local.neg() if minimum else local).reshape(1), torch.isnan(local).to(torch.float64).reshape(1), sent]
    else:
        # A SUM propagates nan by itself, and the fingerprints add up exactly (see NormPlan). Two
        # different plans fail the check on every rank; with three or more, a rank whose fingerprint
        # is exactly the mean of all would miss it (odds of about one in the fingerprint range).
        sent = entry.constant(("sent", False), device, torch.float64, lambda: [f])
        expected = entry.constant(("expected", False), device, torch.float64, lambda: [n * f])
        parts = [local.reshape(1), sent]
    head = sum(t.numel() for t in parts)  # where the per-slot values start
    if per_slot is not None and request.extreme:  # a nan slot travels as inf (for -inf, sent negated: back as nan)
        parts.append(torch.where(per_slot.isnan(), math.inf, per_slot.neg() if minimum else per_slot))
    elif per_slot is not None:
        parts.append(per_slot)
    buffer = torch.cat(parts)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX if request.extreme else dist.ReduceOp.SUM, group=plan.group)
    agreed = torch.eq(buffer[head - sent.numel() : head], expected).all()
    if host_reads_are_free(device) and not agreed:
        raise _PlansDiffer()
    poisoned = ~agreed | (buffer[1] > 0) if request.extreme else ~agreed
    total = torch.where(poisoned, math.nan, buffer[0].neg() if minimum else buffer[0])
    if per_slot is None:
        return total, None
    slots = torch.where(buffer[head:] == math.inf, math.nan, buffer[head:].neg()) if minimum else buffer[head:]
    return total, torch.where(agreed, slots, math.nan)


_PROBE_MARK = float(2**55)
"""Above any plan fingerprint (< 2**52), so that no sum or max of fingerprints equals it."""


def _probe(size: int, extreme: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Join the norm's all-reduce (of the ``size`` it had last time in this context) with a marker where
    the plan fingerprint goes (``[total, fingerprint, ...]``, or ``[total, nan flag, f, -f, ...]`` for
    ``±inf``), so that ranks that hit their cached plans see a disagreement and exchange plans
    too. Returns whether every rank missed (a new layout everywhere). On accelerators, where ranks
    that hit do not read the check on the host, this rank raises unless every rank missed."""
    buffer = torch.zeros(size, dtype=torch.float64, device=device)
    if extreme:
        buffer[2], buffer[3] = _PROBE_MARK, -_PROBE_MARK
    else:
        buffer[1] = _PROBE_MARK
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX if extreme else dist.ReduceOp.SUM, group=group)
    everyone = bool(buffer[3] == -_PROBE_MARK) if extreme else bool(buffer[1] == dist.get_world_size(group) * _PROBE_MARK)
    if not everyone and not host_reads_are_free(device):
        raise RuntimeError(
            "this rank's gradient layout changed after its norm plan was cached, while other ranks kept "
            "theirs (their norm is nan this step); every rank of a stage must pass gradients of the same layout"
        )
    return everyone  # on CPU the ranks that hit saw the marker and come to the exchange as well


# --- helpers ---------------------------------------------------------------------------------------


def _as_tensor_list(tensors: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _read_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    with disable_torch_function_subclass():  # skips DTensor's __torch_function__ on `.grad`
        return list(map(_GRAD, params))


def _tie_keys(tensors: Sequence[torch.Tensor], tied: Mapping[str, torch.Tensor] | None) -> list[str | None] | None:
    if not tied:
        return None
    # entries not among the tensors are not counted here (a tied parameter without a gradient on this
    # rank, or owned by another optimizer); raising on the ranks holding it would leave the others waiting
    key_of = {id(t): k for k, t in tied.items()}
    keys = [key_of.get(id(t)) for t in tensors]
    return keys if any(k is not None for k in keys) else None


def _as_torch_returns(norms: GradNorms) -> torch.Tensor:
    """The total as torch's functions return it: where the gradients include DTensors, a DTensor
    replicated over every dim of the first one's mesh (its local tensor is the total itself, the same
    on every rank, so no check is needed); else the plain total."""
    mesh = norms._mesh
    if mesh is None:
        return norms.total
    return DTensor.from_local(norms.total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    return torch.clamp(float(max_norm) / (total_norm + _EPS), max=1.0)


def _use_foreach(foreach: bool | None, device: torch.device) -> bool:
    supported = device_has_foreach_support(device)
    if foreach and not supported:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return supported if foreach is None else foreach


def _scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    if not tensors:  # torch's grouping refuses an empty list
        return
    for (device, _), ([group], _) in group_by_device_and_dtype([list(tensors)]).items():
        c = coef.to(device)
        if _use_foreach(foreach, device):
            foreach_mul_(group, c)
        else:
            for t in group:
                t.mul_(c)


_ONE_KERNEL_EACH = 1 << 24
"""Elements from which a tensor's norm accumulated in float32 is one ``vector_norm`` kernel of its own rather than
a share of ``foreach_norm``'s batched ones: on an H200, 4-10 % faster in float32 and 10-15 % in bfloat16 on 1-4B
parameter sets of 16-67M-element tensors, and slower from about 4M elements down, or accumulated in float64
(``benchmarks/bench_local_norm.py``)."""


def _group_norms(group: list[torch.Tensor], norm_type: float, dtype: torch.dtype, foreach: bool) -> list[torch.Tensor]:
    """The norms of one device-and-dtype group, in its order: with ``foreach``, ``foreach_norm``'s, except for the
    tensors of at least :data:`_ONE_KERNEL_EACH` elements accumulated in float32 (a kernel each); else a kernel each."""
    alone = [not foreach or (dtype == torch.float32 and t.numel() >= _ONE_KERNEL_EACH) for t in group]
    batched = iter(foreach_norm([t for t, a in zip(group, alone) if not a], norm_type, dtype=dtype) if not all(alone) else ())
    return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) if a else next(batched) for t, a in zip(group, alone)]


def _stacked_norms(
    tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype, foreach: bool | None, device: torch.device
) -> torch.Tensor:
    """Per-tensor norms computed in ``dtype``, in the order of ``tensors`` (none is empty), as one
    float64 tensor on ``device`` (one copy per device and dtype group, not one per tensor)."""
    if not tensors:  # torch's grouping refuses an empty list
        return torch.zeros(0, dtype=torch.float64, device=device)
    parts, order = [], []
    for (group_device, _), ([group], indices) in group_by_device_and_dtype([list(tensors)], True).items():
        norms = _group_norms(group, norm_type, dtype, _use_foreach(foreach, group_device))
        parts.append(torch.stack(norms).to(device=device, dtype=torch.float64))
        order.extend(indices)
    if len(parts) == 1:
        return parts[0]
    stacked = torch.cat(parts)
    return torch.empty_like(stacked).index_copy_(0, torch.tensor(order, device=device), stacked)


def _collective_device(group: dist.ProcessGroup | None, like: torch.device) -> torch.device:
    """Where the local sums meet for the all-reduce: the gradients' device, or the CPU for gloo."""
    if like.type != "cpu" and dist.is_initialized() and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return like
