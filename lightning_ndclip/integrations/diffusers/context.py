"""Context parallelism for ``diffusers`` models, where their own context-parallel plan (``_cp_plan``) says.

A ``diffusers`` model class that supports context parallelism names, in ``_cp_plan``, the module inputs to cut
along the sequence (``ContextParallelInput(split_dim, expected_dims, split_output)``: an input by name or position,
or with ``split_output`` the module's output, as for rotary embeddings) and the outputs to gather back
(``ContextParallelOutput(gather_dim)``). :func:`context_parallelize` reads it as diffusers'
``enable_parallelism`` does, for training:

* each cut takes this cp rank's contiguous ``1 / cp`` of the sequence (full, non-causal attention needs no load
  balancing; :func:`~lightning_ndclip.core.context.attention.shard_sequence`); a tensor whose dim count is not the
  entry's ``expected_dims`` is left whole, as diffusers leaves it (Wan 2.1's per-clip timestep), and conditioning
  the plan does not name (text embeddings) stays whole on every rank;
* the model's attention over the cut sequence runs
  :func:`~lightning_ndclip.core.context.attention.context_parallel_attention` (ring, O(S/cp) memory per rank):
  diffusers' attention processors hand their ``_parallel_config`` to the attention backend only for the call that
  attends over the cut sequence (self-attention, not cross-attention to whole text), so that config is the marker;
* each gather is :func:`~lightning_ndclip.core.context.attention.gather_sequence`: every cp rank holds the whole
  output, computes the loss one device computes and counts it as its own; the gather's gradient sums the ranks'
  (equal) gradients of each part, which makes the sum over the cp ranks the one-device gradient, for the token and
  the per-sample mean alike (each clip's count, and the step's, counted once per cp rank on both sides).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip import _compat
from lightning_ndclip.core.context.attention import context_parallel_attention, gather_sequence, shard_sequence
from lightning_ndclip.core.parallel.tensor_parallel import matches_plan_key

__all__ = ["CUT_LIKE", "VERIFIED", "context_parallelize"]


class _CutSequence:
    """The attention processors' ``_parallel_config`` on a model made context parallel: the cp group the attention
    over the cut sequence runs on."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.mask_checked = False

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
        is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, **others: Any,
    ) -> torch.Tensor:  # fmt: skip
        """diffusers' backend call (``[batch, seq, heads, head_dim]`` tensors) over the cut sequence; the keys may be
        another sequence cut alike (a prompt), masked per key (:meth:`allowed_keys`)."""
        refused = {"dropout_p": dropout_p > 0, "enable_gqa": enable_gqa}
        refused.update((name, bool(value)) for name, value in others.items())
        if any(refused.values()):
            names = [name for name, on in refused.items() if on]
            raise ValueError(
                f"context parallelism on a diffusers model: its attention over the cut sequence was called with {names}, "
                "which the ring attention does not take; train it with cp=1"
            )
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, heads, tokens, head_dim]
        batch, heads, queries, keys = *q.shape[:3], k.shape[2]
        ids = kv_ids = None
        if attn_mask is not None:
            allowed = self.allowed_keys(attn_mask, keys)  # [batch, heads or 1, keys]
            if allowed.shape[1] > 1:  # a mask per head: each head its own row
                q, k, v = (t.reshape(batch * heads, 1, *t.shape[2:]) for t in (q, k, v))
            allowed = allowed.expand(batch, -1, keys).reshape(-1, keys)
            ids = torch.zeros(allowed.shape[0], queries, dtype=torch.int64, device=q.device)
            kv_ids = torch.where(allowed, 0, -1)
        out = context_parallel_attention(
            q, k, v, group=self.group, positions=self._positions(queries, q.device), is_causal=is_causal, scale=scale,
            sample_ids=ids, kv_sample_ids=kv_ids, kv_positions=self._positions(keys, q.device),
        )  # fmt: skip
        return out.reshape(batch, heads, queries, -1).transpose(1, 2)

    def _positions(self, local: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.rank * local, (self.rank + 1) * local, device=device)

    def allowed_keys(self, mask: torch.Tensor, keys: int) -> torch.Tensor:
        """``[batch, heads or 1, keys]`` booleans from an attention mask over this rank's ``keys`` that masks keys only
        (``[batch, heads or 1, 1, keys]``): True, or a 0 bias, attends; False, or a bias of -1e4 or below (LTX's
        -10000: ``exp`` of it is 0 in every float dtype), does not. A query whose every key (on every cp rank) carries
        such a bias attends to all of them, as the bias then cancels in one device's softmax.

        Raises:
            ValueError: on every cp rank, the first time: the mask varies along the queries, or biases by other
                values (the ring adds no bias).
        """
        key_only = mask.dim() == 4 and mask.shape[2] == 1 and mask.shape[3] == keys
        if not key_only or (not self.mask_checked and mask.is_floating_point()):
            bad = (torch.ones(()) if not key_only else ((mask != 0) & (mask > -1e4)).any().float()).to(mask.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)  # on the host, the first call only
            if bad.item():
                raise ValueError(
                    f"context parallelism on a diffusers model: an attention mask of shape {tuple(mask.shape)} over "
                    f"{keys} keys, which the ring attention does not take (it masks whole keys, [batch, heads, 1, keys], "
                    "by True / False or a bias of 0 / -1e4 and below); train it with cp=1"
                )
        self.mask_checked = True
        if not mask.is_floating_point():
            return mask[:, :, 0]
        allowed = mask[:, :, 0] == 0
        some = allowed.any(-1, keepdim=True).to(torch.int32)
        dist.all_reduce(some, op=dist.ReduceOp.MAX, group=self.group)
        return allowed | (some == 0)


VERIFIED = (
    "WanTransformer3DModel", "ChronoEditTransformer3DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel",
    "QwenImageTransformer2DModel", "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel",
    "HeliosTransformer3DModel", "MiniMaxH3Transformer3DModel",
)  # fmt: skip
"""The model classes whose plans (with :data:`CUT_LIKE`) are tested exact against one device in float64
(``tests/test_diffusers_sweep.py``, ``tests/test_diffusers_context.py``): every class with a ``_cp_plan`` in
diffusers 0.42.1. A class a later release adds is refused until its plan is tested here."""

CUT_LIKE = {"LTX2VideoTransformer3DModel": {"cross_attn_rope": "rope"}}
"""class -> {module: module whose plan entry it takes}: outputs the class's own plan (diffusers 0.42.1) leaves whole
where they meet the cut sequence. LTX-2's audio-video cross-attention rotates the video by ``cross_attn_rope``'s
embedding of the whole video, so each rank's cut queries met every position's rotation (a shape error); cut as its
``rope`` is, each rank rotates its own positions."""


def _plan(model: nn.Module) -> dict[Any, Any]:
    """``model``'s ``_cp_plan`` with the entries :data:`CUT_LIKE` adds for its class (or a class it derives from)."""
    plan = _compat.diffusers_cp_plan(model)
    for cls in type(model).__mro__:
        for module, like in CUT_LIKE.get(cls.__name__, {}).items():
            plan.setdefault(module, plan[like])
    return plan


def context_parallelize(model: nn.Module, cp: DeviceMesh) -> None:
    """Make ``model`` (a ``diffusers`` model with a ``_cp_plan``) context parallel over ``cp`` (see the module
    docstring).

    Raises:
        ValueError: before any change, naming the model: it has no ``_cp_plan``, or one not yet verified
            (:data:`VERIFIED`), an entry names a module it does not have, or an attention processor has no
            ``_parallel_config`` (it could not be routed to the ring).
    """
    name = type(model).__name__
    plan = _plan(model)
    if not plan:
        raise ValueError(
            f"cp > 1 with tp_plan='auto': {name} has no context-parallel plan (_cp_plan) in this diffusers release, so "
            "nothing says where to cut its sequence; train it with cp=1"
        )
    if not any(c.__name__ in VERIFIED and c.__module__.startswith("diffusers.") for c in type(model).__mro__):
        raise ValueError(
            f"cp > 1 with tp_plan='auto': {name}'s context-parallel plan is not yet verified exact here (verified: "
            f"{', '.join(VERIFIED)}); train it with cp=1, or cut its sequence yourself (shard_sequence and "
            "context_parallel_attention)"
        )
    targets = {key: [m for n, m in model.named_modules() if matches_plan_key(n, key)] for key in plan}  # '*': any block
    missing = [key for key, found in targets.items() if not found]
    processors = [m.processor for m in model.modules() if getattr(m, "processor", None) is not None]
    unrouted = sorted({type(p).__name__ for p in processors if not _compat.takes_parallel_config(p)})
    if missing or unrouted or not processors:
        problem = f"_cp_plan names modules it does not have: {missing}" if missing else (
            f"its attention processors {unrouted or 'none found'} take no _parallel_config")  # fmt: skip
        raise ValueError(f"cp > 1 with tp_plan='auto': {name}'s {problem}; train it with cp=1")
    group, rank, size = cp.get_group(), cp.get_local_rank(), cp.size()
    cut = functools.partial(_cut, rank=rank, size=size, model=name)
    for key, entry in plan.items():
        for module in targets[key]:
            _hook(module, entry, cut, group)
    marker = _CutSequence(group, rank, size)
    for processor in processors:
        _compat.set_parallel_config(processor, marker)
    _compat.route_diffusers_attention(_routed)


def _hook(module: nn.Module, entry: Any, cut: Callable[..., Any], group: dist.ProcessGroup) -> None:
    """Cut ``module``'s inputs or outputs, or gather its outputs, as its plan ``entry`` says."""
    if isinstance(entry, Mapping):
        inputs = {k: v for k, v in entry.items() if not v.split_output}
        outputs = {k: v for k, v in entry.items() if v.split_output}
        if inputs:
            parameters = list(inspect.signature(module.forward).parameters)
            module.register_forward_pre_hook(functools.partial(_cut_inputs, inputs, parameters, cut), with_kwargs=True)
        if outputs:
            module.register_forward_hook(functools.partial(_cut_outputs, outputs, cut))
    else:
        gathers = list(entry) if isinstance(entry, Sequence) else [entry]
        module.register_forward_hook(functools.partial(_gather_outputs, gathers, group))


def _routed(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """diffusers attention backend ``original``, the ring where the call attends over a cut sequence."""

    @functools.wraps(original)
    def attention(*, _parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        if isinstance(_parallel_config, _CutSequence):
            return _parallel_config.attend(**kwargs)
        return original(_parallel_config=_parallel_config, **kwargs)

    return attention


def _cut(value: Any, entry: Any, *, rank: int, size: int, model: str) -> Any:
    """This rank's part of ``value`` by a ``ContextParallelInput`` ``entry`` (tensors of other dim counts whole)."""
    if not isinstance(value, torch.Tensor) or (entry.expected_dims is not None and value.dim() != entry.expected_dims):
        return value
    if value.shape[entry.split_dim] % size:
        raise ValueError(
            f"context parallelism on {model}: a sequence of {value.shape[entry.split_dim]} tokens (dim "
            f"{entry.split_dim} of a {tuple(value.shape)} tensor) is cut into cp={size} equal parts, and {size} does "
            "not divide it: choose latent sizes whose token count cp divides"
        )
    return shard_sequence(value, rank, size, dim=entry.split_dim)[0]


def _cut_inputs(
    entries: Mapping[str | int, Any], parameters: list[str], cut: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    args = list(args)  # type: ignore[assignment]
    for key, entry in entries.items():
        if isinstance(key, str) and key in kwargs:
            kwargs[key] = _cut_each(kwargs[key], entry, cut)
            continue
        index = key if isinstance(key, int) else parameters.index(key) if key in parameters else len(args)
        if index < len(args):
            args[index] = _cut_each(args[index], entry, cut)  # type: ignore[index]
    return tuple(args), kwargs


def _cut_each(value: Any, entry: Any, cut: Callable[..., Any]) -> Any:
    if isinstance(value, (list, tuple)):  # one entry per element
        return type(value)(cut(v, e) for v, e in zip(value, entry))
    return cut(value, entry)


def _cut_outputs(entries: Mapping[int, Any], cut: Callable[..., Any], module: nn.Module, args: Any, output: Any) -> Any:
    single = isinstance(output, torch.Tensor)
    parts = [output] if single else list(output)
    for index, entry in entries.items():
        parts[index] = cut(parts[index], entry)
    return parts[0] if single else type(output)(parts)


def _gather_outputs(entries: list[Any], group: dist.ProcessGroup, module: nn.Module, args: Any, output: Any) -> Any:
    single = isinstance(output, torch.Tensor)
    parts = [output] if single else list(output)
    for index, entry in enumerate(entries):
        if entry is not None:
            parts[index] = gather_sequence(parts[index], group, entry.gather_dim)
    return parts[0] if single else type(output)(parts)
