"""Tensor parallelism from a plan, with tied parameters kept one parameter.

Two modules that share one weight (a tied input embedding and LM head, as Llama-3.2-1B, Qwen2.5,
Gemma ship) compute one function of one tensor: its gradient is the sum of both uses.
``parallelize_module`` gives every module it shards a new DTensor ``Parameter``, so a tie becomes
two parameters with two gradients: a different model, trained without a warning. Here:

- :func:`tied_parameters` finds the ties (parameter names that are one tensor);
- :func:`tensor_parallelize` is ``parallelize_module`` that keeps them: a tied module the plan
  leaves out gets the style that shards the shared weight the way its partner's style does (with
  its input and output replicated, so it computes what it did unsharded), and after the plan every
  group is made one ``Parameter`` again, which is exact when all copies have the same layout (both
  sides of a tied ``[vocab, hidden]`` weight ``Shard(0)``: a colwise head and a vocab-split
  embedding). Copies with different layouts are a ``ValueError`` naming the modules;
- a module the plan parallelizes returns its output as a plain tensor where its style says so
  (``use_local_output``), which DTensor makes a view of the result's local shard: that view is
  made a tensor of its own (:func:`output_not_a_view`), so that FSDP2 does not warn of a view when
  it is a unit's output (a transformers LM head's logits), and an output whose collective is pending
  is waited for (compiled code loses such an input's gradient); the hook does nothing inside compiled
  code, so a compiled block has no graph break of ours;
- a plan key matches a module inside a ``torch.compile(block)`` wrapper without its ``_orig_mod``
  (:func:`matches_plan_key`, :func:`resolved_plan`);
- :func:`check_ties` verifies, after any parallelization (a ``configure_model`` hook included), that
  every tie is still one parameter, raising the same error on every rank otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_ndclip import _compat

__all__ = ["check_ties", "tensor_parallelize", "tied_parameters"]

Ties = list[tuple[str, ...]]
"""Groups of parameter names (``module path.attribute``) that are one tensor, in model order."""


COMPILED = "_orig_mod"
"""The name ``torch.compile(module)`` gives the module it wraps: a block compiled before the plan is applied has its
layers under ``blocks.0._orig_mod.``, and a plan key names them without it."""


def matches_plan_key(name: str, key: str) -> bool:
    """Whether a module name matches a plan key part by part, ``*`` standing for one part (as in
    ``parallelize_module``); the ``_orig_mod`` parts of a module inside a ``torch.compile`` wrapper may be
    left out of the key (``blocks.*.up`` matches ``blocks.0._orig_mod.up``)."""
    parts, patterns = name.split("."), key.split(".")
    if len(parts) == len(patterns) and all(fnmatchcase(p, q) for p, q in zip(parts, patterns)):
        return True
    unwrapped = [p for p in parts if p != COMPILED]
    return len(unwrapped) < len(parts) and matches_plan_key(".".join(unwrapped), key)


def resolved_plan(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` for ``parallelize_module(module, ...)``: as given, or, where ``module`` holds ``torch.compile``
    wrappers (whose layers ``parallelize_module`` would not find under a key without ``_orig_mod``), the style of
    each matched submodule under its own name (the first key matching it; the module a wrapper holds, not the
    wrapper)."""
    wrappers = compiled_wrappers(module)
    if not wrappers:
        return dict(plan)
    names = [name for name, _ in module.named_modules() if name and name not in wrappers]
    return {name: style for name in names if (style := _style_of(plan, name)) is not None}


def compiled_wrappers(module: nn.Module) -> set[str]:
    """The names of the ``torch.compile`` wrappers in ``module`` (``""``: ``module`` is one): each holds its module
    as ``_orig_mod``."""
    return {name.rpartition(".")[0] for name, _ in module.named_modules() if name.rpartition(".")[2] == COMPILED}


def tied_parameters(module: nn.Module) -> Ties:
    """The groups of ``module``'s parameter names that name one tensor (two or more names each)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_tensor.values() if len(names) > 1]


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str | None = None) -> None:
    """``module.to_empty(device=...)`` (default: the current accelerator, else the CPU), which makes a new parameter
    of each name of a plain tied tensor moved off the meta device, with every tie (:func:`tied_parameters`) made one
    again: a checkpoint loader's first step for a model built on the meta device."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = torch.device(accelerator.type, torch.accelerator.current_device_index()) if accelerator else "cpu"
    ties = tied_parameters(module)
    module.to_empty(device=device)
    for names in ties:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            path, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(path), attribute, first)


def _owner(module: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return path, module.get_submodule(path), attribute


def _shard_dim(style: ParallelStyle, owner: nn.Module) -> int | None:
    """The dim of the weight that ``style`` shards over tp, where PyTorch's style defines it."""
    kinds = {(ColwiseParallel, nn.Linear): 0, (ColwiseParallel, nn.Embedding): 1,
             (RowwiseParallel, nn.Linear): 1, (RowwiseParallel, nn.Embedding): 0}  # fmt: skip
    return next((dim for (kind, cls), dim in kinds.items() if type(style) is kind and isinstance(owner, cls)), None)


def _replicated_style(owner: nn.Module, dim: int) -> ParallelStyle | None:
    """A style that shards ``owner``'s weight on ``dim`` and keeps its input and output replicated (the
    module computes what it computed unsharded), or ``None`` if PyTorch has none."""
    if isinstance(owner, nn.Linear):
        return ColwiseParallel(output_layouts=Replicate()) if dim == 0 else RowwiseParallel(input_layouts=Replicate())
    if isinstance(owner, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate()) if dim == 0 else ColwiseParallel(output_layouts=Replicate())
    return None


def _style_of(plan: Mapping[str, ParallelStyle], path: str) -> ParallelStyle | None:
    return next((style for key, style in plan.items() if matches_plan_key(path, key)), None)


def _with_tied_partners(module: nn.Module, plan: Mapping[str, ParallelStyle], ties: Ties) -> dict[str, ParallelStyle]:
    """``plan`` plus, for a tied module it leaves out whose partner it shards, the replicated style
    that shards the shared weight the same way (e.g. the embedding of a tied colwise LM head)."""
    completed = dict(plan)
    for names in ties:
        owners = [_owner(module, name) for name in names]
        styles = [_style_of(plan, path) for path, _, _ in owners]
        dims = {_shard_dim(style, owner) for style, (_, owner, _) in zip(styles, owners) if style is not None}
        dim = dims.pop() if len(dims) == 1 else None
        if dim is None:
            continue  # nothing sharded, or copies _retie will compare
        for style, (path, owner, attribute) in zip(styles, owners):
            partner = _replicated_style(owner, dim) if style is None and attribute == "weight" else None
            if partner is not None and path:
                completed[path] = partner
    return completed


def _layout(param: torch.Tensor) -> str:
    if isinstance(param, DTensor):
        return f"DTensor {tuple(param.placements)} on mesh dims {param.device_mesh.mesh_dim_names}"
    return "a plain tensor (not sharded over tp)"


def _retie(module: nn.Module, ties: Ties) -> None:
    """Make every group of ``ties`` one parameter again (the first name's), or raise ``ValueError`` when
    the copies differ in layout."""
    for names in ties:
        owners = [_owner(module, name) for name in names]
        params = [getattr(owner, attribute) for _, owner, attribute in owners]
        if all(p is params[0] for p in params):
            continue
        layouts = [_layout(p) for p in params]
        same = all(
            isinstance(p, DTensor) and p.device_mesh == params[0].device_mesh and p.placements == params[0].placements
            for p in params
        ) or not any(isinstance(p, DTensor) for p in params)
        if not same or any(p.shape != params[0].shape for p in params):
            described = "; ".join(f"{name}: {layout}" for name, layout in zip(names, layouts))
            raise ValueError(
                f"tied parameters {list(names)} are one tensor in the model, and the tp plan shards them differently "
                f"({described}): as two parameters they would train a different model. Give their modules styles "
                "that shard the shared weight on the same dim (a colwise Linear head and a vocab-split "
                "RowwiseParallel(input_layouts=Replicate()) embedding both Shard(0)), or leave both out of the plan"
            )
        for _, owner, attribute in owners[1:]:
            setattr(owner, attribute, params[0])


def check_plan_keys(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Raise, naming them, if some keys of ``plan`` match no submodule of ``module``."""
    names = [name for name, _ in module.named_modules() if name]
    unmatched = [key for key in plan if not any(matches_plan_key(name, key) for name in names)]
    if unmatched:
        raise ValueError(
            f"tp_plan entries {unmatched} match no submodule of {type(module).__name__} (names are relative to "
            f"it, e.g. {names[:3]}; '*' matches one name part)"
        )


def tensor_parallelize(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """``torch.distributed.tensor.parallel.parallelize_module(module, tp_mesh, plan)``, keeping tied
    parameters one parameter (see the module docstring): a tied module the plan leaves out gets the
    replicated style matching its partner's, and each tie is restored after the plan. A parameter the
    plan replicates over tp whose gradient DTensor leaves ``Partial`` (a norm on tp-split activations)
    gets that gradient summed over tp once accumulated.

    Use it in place of ``parallelize_module`` in a ``configure_model`` hook, before ``fully_shard``, and
    before ``block.compile()``; blocks already wrapped by ``torch.compile(block)`` are found by the same keys.

    Raises:
        ValueError: a plan key matches no submodule (before changing ``module``), or a tie's copies end
            up with different layouts (naming them and their placements).
    """
    check_plan_keys(module, plan)
    ties = tied_parameters(module)
    completed = _with_tied_partners(module, plan, ties)
    parallelize_module(module, tp_mesh, resolved_plan(module, completed))
    _retie(module, ties)
    wrappers = compiled_wrappers(module)
    for name, child in module.named_modules():
        style = _style_of(completed, name) if name and name not in wrappers else None
        if style is not None and getattr(style, "use_local_output", False):
            child.register_forward_hook(output_not_a_view)
    for param in module.parameters():
        if isinstance(param, DTensor) and any(p.is_replicate() for p in param.placements):
            param.register_post_accumulate_grad_hook(_sum_partial_gradient)
    return module


def output_not_a_view(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A forward hook giving ``output``, when it is a view, as the same tensor not recorded as one, for
    the two views whose base nothing saves for backward: an ``nn.Linear``'s output on 3+-D input (a
    view of its fresh 2-D result) and a tensor-parallel style's local output (a view of the result
    DTensor's local shard, outside autograd). So FSDP2's backward hook on a unit's output cannot be
    lost to an in-place op on it, and FSDP2 does not warn that it could. An output whose collective is
    still pending (an ``AsyncCollectiveTensor``: a rowwise layer's sum, a vocab-split embedding's output) is
    waited for and given as a plain tensor the same way: compiled code it enters (a compiled transformer
    block after an embedding) would return no gradient for it (torch 2.14).

    Compiled (``torch.compile`` tracing it, e.g. inside a compiled transformer block): nothing to do, and
    nothing for Dynamo to trace (it cannot call the C-level ``view_base``, a graph break per layer): AOTAutograd
    returns no compiled region's output as a view of one of its intermediates, and a view inside the region
    is no unit's output."""
    if torch.compiler.is_compiling():
        return output
    pending = isinstance(output, _compat.AsyncCollectiveTensor)
    if pending or (type(output) is torch.Tensor and _compat.view_base(output) is not None):
        return _compat.unsafe_view(output, output.shape)
    return output


def views_copied(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A forward hook on an FSDP2 root unit giving each tensor of its (nested) output that is a view as a copy: a
    model that ends by reshaping its result (a diffusers transformer unpatchifying its latents) would return a view,
    on which an in-place op would drop FSDP2's backward hook (and FSDP2 warns that it could). A copy, not
    :func:`output_not_a_view`'s re-labelling: the base may be saved for backward. Free where nothing is a view."""
    if torch.compiler.is_compiling():
        return output
    return _compat.tree_map(lambda t: t.clone() if type(t) is torch.Tensor and _compat.view_base(t) is not None else t, output)


OWN_OUTPUT_GRADIENT: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Modules with plain (whole) weights whose style sums their output's gradient over tp where the output meets split
heads (:class:`~lightning_ndclip.integrations.transformers.plans.LatentKeyParallel`): the split-activation watch leaves their
output to them. A style whose weights are DTensors owns its output's gradient by being one."""


def gradient_summed_over(value: Any, mesh: DeviceMesh) -> Any:
    """Identity forward for a plain floating-point tensor that needs a gradient (anything else is returned
    as is); in backward its gradient, a partial sum over ``mesh`` (each rank's heads or experts), summed."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point() and value.requires_grad:
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return value


def sum_over(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``partial`` (this rank's part of a sum over ``mesh``) summed over ``mesh``; differentiable (the gradient
    goes back to every rank's part as it is)."""
    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()])
    return summed.to_local()


def _sum_partial_gradient(param: torch.Tensor) -> None:
    """A replicated weight applied to tp-split activations (a norm under ``SequenceParallel``) gets a
    ``Partial`` gradient from DTensor: its sum over tp, reduced here once accumulated (FSDP2, which
    replaces the parameter, reduces it itself before its own reduction)."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


def check_ties(module: nn.Module, ties: Sequence[Sequence[str]], group: dist.ProcessGroup | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` (one ``all_gather_object``) if a tie of ``ties``
    (recorded before parallelizing, :func:`tied_parameters`) is no longer one parameter of ``module``,
    naming the parameters, the rank and their layouts. Names this rank no longer holds (other
    pipeline stages) are left out; a tie must hold among those it holds."""
    problem = None
    try:
        params = dict(module.named_parameters(remove_duplicate=False))
        for names in ties:
            held = [name for name in names if name in params]
            if len({id(params[name]) for name in held}) > 1:
                described = "; ".join(f"{name}: {_layout(params[name])}" for name in held)
                problem = (
                    f"parameters {held} were one tensor (tied) before parallelization and are {len(held)} parameters "
                    f"after it ({described}): each would get its own gradient and update, a different model. In "
                    "configure_model, apply tensor parallelism with lightning_ndclip.tensor_parallelize (keeps ties) "
                    "instead of parallelize_module, or re-tie them before fully_shard"
                )
                break
    except Exception as error:  # every rank must reach the gather below
        problem = f"checking tied parameters raised {type(error).__name__}: {error}"
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        problems: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    else:
        problems = [problem]
    for rank, found in enumerate(problems):
        if found is not None:
            raise ValueError(f"rank {rank}: {found}")
