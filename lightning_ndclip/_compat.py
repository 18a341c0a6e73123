"""Every private (``_``-prefixed) Lightning, PyTorch, ``transformers`` and ``diffusers`` name the package uses, in one place.

Each entry says why no public API serves. :data:`PRIVATE_NAMES` maps every entry to the private
names it relies on; ``tests/test_compat.py`` checks that each of them exists in the installed
versions (so an upgrade that drops one fails loudly there, not mid-training), that every entry is
registered, and that no other module of the package uses a private torch / Lightning name.

The norm's hot paths use the PyTorch entries per tensor per step, so those are aliases bound once
at import, C-level callables (``operator.attrgetter``), or one call per list (``local_tensors``), never
a Python call per tensor. Lightning is imported inside the Lightning entries only: the pure-PyTorch
core imports this module and must import without Lightning.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed import _functional_collectives
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as _checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._foreach_utils import _device_has_foreach_support, _group_tensors_by_device_and_dtype
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode
from torch.utils._pytree import tree_leaves as _tree_leaves
from torch.utils._pytree import tree_map as _tree_map

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "PRIVATE_NAMES",
    "StridedShard",
    "AsyncCollectiveTensor",
    "all_to_all_autograd",
    "applies_grad_scale",
    "batches_that_stepped",
    "checkpoint_wrapper",
    "concatenate_meshes",
    "device_has_foreach_support",
    "disable_torch_function_subclass",
    "diffusers_cp_plan",
    "library_block_names",
    "dynamo_counters",
    "redistribute_logger",
    "dtensor_spec",
    "flatten_mesh",
    "foreach_mul_",
    "fsdp_unit_layout",
    "fsdp_unsharded_parameters",
    "foreach_norm",
    "group_by_device_and_dtype",
    "local_tensors",
    "materialize_distributed_module",
    "metadata_filename",
    "optimizers_to_device",
    "root_mesh",
    "route_diffusers_attention",
    "save_distributed_checkpoint",
    "set_parallel_config",
    "takes_parallel_config",
    "set_device_mesh",
    "setup_distributed",
    "should_accumulate",
    "logged_in_this_hook",
    "sync_ddp_if_available",
    "tree_leaves",
    "tree_map",
    "unsafe_view",
    "unflatten_mesh",
    "view_base",
    "initialize_buffers",
    "class_pp_plan",
    "attention_implementation",
    "ModuleStyle",
    "DispatchMode",
    "VALUE_READ_OPS",
]

PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    # PyTorch
    "local_tensors": ("torch.distributed.tensor:DTensor._local_tensor",),
    "dtensor_spec": ("torch.distributed.tensor:DTensor._spec",),
    "StridedShard": ("torch.distributed.tensor.placement_types:_StridedShard",),
    "AsyncCollectiveTensor": ("torch.distributed._functional_collectives:AsyncCollectiveTensor",),
    "view_base": ("torch:Tensor._base",),
    "fsdp_unit_layout": (
        "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._fsdp_param_group",
    ),
    "fsdp_unsharded_parameters": (
        "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._fsdp_param_group",
    ),
    "unsafe_view": ("torch:ops.aten._unsafe_view",),
    "foreach_norm": ("torch:_foreach_norm",),
    "foreach_mul_": ("torch:_foreach_mul_",),
    "device_has_foreach_support": ("torch.utils._foreach_utils:_device_has_foreach_support",),
    "group_by_device_and_dtype": ("torch.utils._foreach_utils:_group_tensors_by_device_and_dtype",),
    "disable_torch_function_subclass": ("torch._C:DisableTorchFunctionSubclass",),
    "dynamo_counters": ("torch._dynamo.utils:counters",),
    "redistribute_logger": ("torch.distributed.tensor._redistribute:logger",),
    "tree_leaves": ("torch.utils._pytree:tree_leaves",),
    "tree_map": ("torch.utils._pytree:tree_map",),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",),
    "flatten_mesh": ("torch.distributed.device_mesh:DeviceMesh._flatten",),
    "unflatten_mesh": ("torch.distributed.device_mesh:DeviceMesh._unflatten",),
    "concatenate_meshes": ("torch.distributed.device_mesh:DeviceMesh._concatenate",),
    "root_mesh": ("torch.distributed.device_mesh:DeviceMesh._get_root_mesh",),
    "all_to_all_autograd": ("torch.distributed._functional_collectives:all_to_all_single_autograd",),
    "applies_grad_scale": ("torch.optim:Adam._step_supports_amp_scaling",),
    "ModuleStyle": ("torch.distributed.tensor.parallel:ParallelStyle._apply",),
    "DispatchMode": ("torch.utils._python_dispatch:TorchDispatchMode",),
    "VALUE_READ_OPS": ("torch:ops.aten._local_scalar_dense", "torch:ops.aten._unique2"),
    "initialize_buffers": (
        "torch.nn:Module._parameters",
        "torch.nn:Module._buffers",
        "transformers:PreTrainedModel._init_weights",
    ),
    "class_pp_plan": ("transformers:PreTrainedModel._pp_plan",),
    "attention_implementation": ("transformers:PreTrainedConfig._attn_implementation",),
    "diffusers_cp_plan": ("diffusers.models.modeling_utils:ModelMixin._cp_plan",),
    "library_block_names": (
        "diffusers.models.modeling_utils:ModelMixin._repeated_blocks",
        "diffusers.models.modeling_utils:ModelMixin._no_split_modules",
        "transformers:PreTrainedModel._no_split_modules",
    ),
    "takes_parallel_config": ("diffusers.models.transformers.transformer_wan:WanAttnProcessor._parallel_config",),
    "set_parallel_config": ("diffusers.models.transformers.transformer_wan:WanAttnProcessor._parallel_config",),
    "route_diffusers_attention": (
        "diffusers.models.attention_dispatch:_AttentionBackendRegistry._backends",
        "diffusers.models.attention_dispatch:_AttentionBackendRegistry._supported_arg_names",
    ),
    # Lightning
    "materialize_distributed_module": ("lightning.fabric.utilities.init:_materialize_distributed_module",),
    "optimizers_to_device": ("lightning.fabric.utilities.optimizer:_optimizers_to_device",),
    "should_accumulate": ("lightning.pytorch.loops.fit_loop:_FitLoop._should_accumulate",),
    "logged_in_this_hook": ("lightning.pytorch.trainer.trainer:Trainer._results",),
    "batches_that_stepped": ("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._batches_that_stepped",),
    "set_device_mesh": (
        "lightning.pytorch.core.module:LightningModule._device_mesh",
        "lightning.pytorch.strategies:ModelParallelStrategy._device_mesh",
    ),
    "setup_distributed": ("lightning.pytorch.strategies:ModelParallelStrategy._setup_distributed",),
    "save_distributed_checkpoint": ("lightning.pytorch.strategies:ModelParallelStrategy._save_distributed_checkpoint",),
    "sync_ddp_if_available": ("lightning.fabric.utilities.distributed:_sync_ddp_if_available",),
    "metadata_filename": ("lightning.fabric.utilities.load:_METADATA_FILENAME",),
}
"""Each entry of this module -> the private names it relies on, as ``"module:Qualified.name"``."""


# --- PyTorch -------------------------------------------------------------------------------------


_LOCAL_TENSOR = operator.attrgetter("_local_tensor")


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard, other tensors as they are (reason: ``to_local()`` runs an autograd
    Function whenever grad mode is on, microseconds per tensor per step; the attribute is the same
    tensor). One call per list, in C when every tensor is a DTensor (no Python line per tensor)."""
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    if all(map(isinstance, tensors, repeat(DTensor))):
        return list(map(_LOCAL_TENSOR, tensors))
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


dtensor_spec: Callable[[DTensor], Any] = operator.attrgetter("_spec")
"""A DTensor's spec: placements, mesh, global shape, stride and dtype in one object (reason: it keys the
norm's plan cache by value, comparing and hashing as one object whose hash PyTorch caches; the public
``placements`` / ``device_mesh`` / ``shape`` are one property each)."""

StridedShard = _StridedShard
"""The placement FSDP2 x TP gives a dim sharded by two mesh dims (reason: not exported publicly;
it must count as ``Shard``, not as an unknown placement)."""

AsyncCollectiveTensor = _functional_collectives.AsyncCollectiveTensor
"""What a tensor-parallel style returns when its output's collective is still pending (``to_local()`` after a
redistribute: a rowwise layer's sum, a vocab-split embedding's) (reason: compiled code given one as input returns
no gradient for it, torch 2.14, so the output hook waits for it; its class is exported only privately)."""

view_base: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")
"""The tensor a view was made from, e.g. FSDP2's flat gradient buffer (reason: no public API returns
it; ``untyped_storage()`` gives bytes, not a tensor with a dtype and an address to compare)."""

unsafe_view: Callable[[torch.Tensor, Sequence[int]], torch.Tensor] = torch.ops.aten._unsafe_view
"""A reshape that autograd does not record as a view (reason: how ``torch.matmul`` returns its 3-D
result; a ``Linear`` with a bias returns a view of its 2-D ``addmm`` result instead, which FSDP2
warns about for a unit's output, and no public op turns a view into a tensor without copying)."""


def redistribute_logger() -> logging.Logger:
    """DTensor's redistribution logger, which notes at WARNING every strided shard gathered by "sequential
    all_gather" operations (reason: no public switch; the benchmarks and the tp sweep gather FSDP2 x TP
    parameters whole by design and silence it)."""
    return logging.getLogger("torch.distributed.tensor._redistribute")


def dynamo_counters() -> Any:
    """``torch.compile``'s counters: ``["graph_break"]`` (reason -> count), ``["stats"]["unique_graphs"]`` (reason:
    the one place Dynamo counts graph breaks; ``fullgraph=True`` raises at the first only, and the test suite counts
    them, none of them ours, in compiled blocks). Imported when called: ``torch._dynamo`` is slow to import."""
    from torch._dynamo.utils import counters

    return counters


def fsdp_unit_layout(unit: Any) -> tuple[list[torch.nn.Parameter], list[int]]:
    """The parameters the FSDP2 unit ``unit`` manages (its sharded ones, as registered on the modules), in the unit's
    order, and the global ranks it reduces their gradients over, this rank's among them (reason: a check that the
    ranks of one reduction bring the same gradients needs both; FSDP2 has no public API for a unit's parameters or
    mesh)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        return [], []
    return [p.sharded_param for p in group.fsdp_params], group.mesh_info.mesh.mesh.flatten().tolist()


def fsdp_unsharded_parameters(unit: Any) -> list[torch.nn.Parameter | None]:
    """The unsharded parameter of each parameter the FSDP2 unit ``unit`` manages (``None`` before its first
    all-gather), in the unit's order (reason: FSDP2 reduce-scatters the gradients these got on this rank, and
    giving one a zero gradient is the only way for a rank that did not use it to join the others' reduction;
    FSDP2 has no public API for its unsharded parameters)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    found: list[torch.nn.Parameter | None] = []
    for parameter in group.fsdp_params:
        try:
            found.append(parameter.unsharded_param)
        except AttributeError:  # not all-gathered yet
            found.append(None)
    return found


DispatchMode = _TorchDispatchMode
"""The base class of a mode that sees every op as the dispatcher runs it (reason: PyTorch exports it
only from the private ``torch.utils._python_dispatch``; the test suite's proof that a step reads no
tensor value on the host is one)."""

VALUE_READ_OPS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten._unique2.default})
"""The ops through which the host reads a tensor's value (``item()``, ``float()``, ``bool()``; ``unique()``),
private by name (reason: a read reaches the dispatcher as one of them; no public op stands for it)."""


class ModuleStyle(ParallelStyle):
    """A ``ParallelStyle`` whose subclasses define the public :meth:`apply` (reason: the one method a
    style must define, which ``parallelize_module`` calls, is the private ``_apply``; a style of our
    own, for a module PyTorch's styles do not cover, has to provide it)."""

    def apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        raise NotImplementedError

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return self.apply(module, device_mesh)


def initialize_buffers(model: Any, module: torch.nn.Module) -> None:
    """Run a ``transformers`` model's own initialization of ``module`` (one of its submodules) for the
    module's buffers only: on a shallow copy that shares its buffers and holds meta tensors for its
    parameters, so its weights, which may be sharded, are never written (reasons: ``_init_weights``
    is the one per-module initialization ``transformers`` has, its public ``initialize_weights``
    writes every weight; ``copy.copy`` would share the parameter dict, and no public API replaces
    a parameter without mutating the module)."""
    stand_in = torch.nn.Module.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in._parameters = {
        name: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for name, p in module._parameters.items()
    }
    stand_in._buffers = dict(module._buffers)
    with torch.no_grad():
        model._init_weights(stand_in)


def class_pp_plan(model_class: type) -> dict[str, Any]:
    """A ``transformers`` model class's own pipeline plan, its head's (``{"lm_head": (inputs, outputs)}``), without
    its base model's (reason: the public ``PreTrainedModel.pp_plan`` has the head's entries only from the releases
    that merge the class's plan into it; 5.0's leaves them out)."""
    return dict(getattr(model_class, "_pp_plan", None) or {})


def attention_implementation(config: Any) -> str:
    """The attention implementation a ``transformers`` model's layers look up (``"sdpa"``, ``"eager"``, a registered
    name), resolved (reason: ``config._attn_implementation`` is what the modeling code itself reads; the public
    ``attn_implementation`` argument is the request, not what was resolved, and no public getter exists)."""
    name: str = config._attn_implementation
    return name


def diffusers_cp_plan(model: Any) -> dict[Any, Any]:
    """A ``diffusers`` model's (or model class's) context-parallel plan (reason: ``_cp_plan`` is where diffusers
    declares it, read by its own ``enable_parallelism``; no public getter exists)."""
    return dict(getattr(model if isinstance(model, type) else type(model), "_cp_plan", None) or {})


def library_block_names(model: Any) -> list[str]:
    """The class names of a ``transformers`` or ``diffusers`` model's repeated blocks (reason: the libraries declare
    them only as ``_repeated_blocks`` (diffusers' regional compile) and ``_no_split_modules`` (the modules
    ``device_map`` never splits: the layers), read by their own loaders; no public getter exists)."""
    return list(getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None) or [])


def takes_parallel_config(processor: Any) -> bool:
    """Whether a ``diffusers`` attention processor hands a parallel config to its attention backend (reason: the
    processors' ``_parallel_config`` is the one place diffusers marks the attention over a cut sequence)."""
    return hasattr(processor, "_parallel_config")


def set_parallel_config(processor: Any, config: Any) -> None:
    """Set the config a ``diffusers`` attention processor hands its backend (same reason; what ``enable_parallelism``
    sets)."""
    processor._parallel_config = config


def route_diffusers_attention(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each ``diffusers`` attention backend that takes a parallel config by ``wrap(backend)``, once (reason:
    backends are looked up by name in ``_AttentionBackendRegistry._backends`` at every call, whose names are an
    enum: no public way to add one or to wrap one)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    for name, backend in list(registry._backends.items()):
        takes = "_parallel_config" in registry._supported_arg_names.get(name, ())
        if takes and not getattr(backend, "__wrapped__", None):
            registry._backends[name] = wrap(backend)


foreach_norm = torch._foreach_norm
"""Per-tensor norms in one multi-tensor kernel (reason: no public foreach API; the kernel
``torch.nn.utils.clip_grad_norm_`` itself uses)."""

foreach_mul_ = torch._foreach_mul_
"""In-place multiply of many tensors in one kernel (same reason)."""

device_has_foreach_support = _device_has_foreach_support
"""Whether a device has the foreach kernels (reason: the rule ``clip_grad_norm_(foreach=None)`` uses
to pick them; re-deriving it could disagree with torch)."""

group_by_device_and_dtype = cast(
    "Callable[..., dict[tuple[torch.device, torch.dtype], tuple[list[list[torch.Tensor]], list[int]]]]",
    _group_tensors_by_device_and_dtype,
)
"""``{(device, dtype): ([tensors], indices)}`` for lists of tensors, grouped in C++ (reason: how
``torch.nn.utils.clip_grad_norm_`` groups them; reading ``device`` and ``dtype`` from Python costs
twice as much, 2 ms per call at 10,000 tensors)."""

all_to_all_autograd = _functional_collectives.all_to_all_single_autograd
"""Differentiable all-to-all of rows with split sizes (reason: PyTorch deprecates the public
``torch.distributed.nn.functional.all_to_all_single`` and names this one as its replacement)."""

disable_torch_function_subclass = torch._C.DisableTorchFunctionSubclass
"""Context manager skipping tensor subclasses' ``__torch_function__`` (reason: reading ``.grad`` of N
DTensor parameters without DTensor's Python dispatch per read; no public equivalent)."""

tree_leaves = _tree_leaves
"""The tensors of a nested output, flattened as torch's pipelining flattens it (reason: torch has no
public pytree module)."""

tree_map = _tree_map
"""A nested output with each tensor mapped, walked as FSDP2 walks a unit's output (reason: torch has no public
pytree module)."""

checkpoint_wrapper = _checkpoint_wrapper
"""Wraps a module so its forward is recomputed in backward, state-dict keys unchanged (reason: the
module-level wrapper FSDP2 recipes use; ``torch.utils.checkpoint`` is a function, not a module)."""


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D view over all dims of a sliced mesh, sharing the root's ranks (reason: torch has no public
    API to flatten mesh dims; ``init_device_mesh`` would make new, unrelated process groups)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Split one mesh dim into several named ones, as views of the same root (same reason)."""
    return mesh._unflatten(dim, sizes, names)


def concatenate_meshes(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """A mesh whose dims are those of ``meshes``, views of one root (same reason)."""
    return DeviceMesh._concatenate(list(meshes))


def applies_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` applies the ``grad_scale`` and ``found_inf`` attributes that
    ``GradScaler`` sets (torch's ``fused=True`` Adam, AdamW, SGD and Adagrad): it divides every
    gradient by ``grad_scale`` in its own pass, writes it back, and leaves parameters and state
    unchanged where ``found_inf`` is 1 (reason: the flag ``GradScaler`` and Lightning's AMP plugin
    read; no public accessor)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


root_mesh: Callable[[DeviceMesh], DeviceMesh] = operator.methodcaller("_get_root_mesh")
"""The mesh a sliced mesh was cut from, which names the ``pp`` dim (reason: no public accessor)."""


# --- Lightning (imported here, not at module level: see the module docstring) --------------------


def materialize_distributed_module(module: torch.nn.Module, device: torch.device) -> None:
    """Materialize meta-device tensors after parallelization, as ``ModelParallelStrategy.setup`` does
    (reason: our ``setup`` re-states Lightning's so a declarative plan can replace ``configure_model``)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer states to the device, as ``ModelParallelStrategy.setup`` does (same reason)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the current micro-batch is not the last of its accumulation window (reason: the loop's
    own decision; re-deriving it could disagree with Lightning at an epoch's last, partial window)."""
    return trainer.fit_loop._should_accumulate()


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning gives the values ``self.log`` sends to the logger (reason: ``global_step``
    differs from it with several optimizers or manual optimization; no public counter)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_device_mesh(obj: Any, mesh: DeviceMesh | None) -> None:
    """Set what the ``device_mesh`` property of a ``ModelParallelStrategy`` or a ``LightningModule``
    returns (reason: Lightning's own protocol, as its ``setup_environment`` does; neither has a setter)."""
    obj._device_mesh = mesh


def setup_distributed(strategy: Any) -> None:
    """``ModelParallelStrategy``'s process-group start: world ranks, backend, ``init_process_group``
    (reason: our ``setup_environment`` checks the sizes before it and builds the mesh after it)."""
    strategy._setup_distributed()


def save_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)`` (reason: the flag Lightning's own
    save / load read; a copy of our own could disagree with it)."""
    return bool(strategy._save_distributed_checkpoint)


def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """All-reduce over ``group`` with Lightning's ``reduce_op`` semantics ("mean", "sum", ``ReduceOp``),
    as ``ModelParallelStrategy.reduce`` does (reason: no public function with those semantics)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def logged_in_this_hook(trainer: pl.Trainer, hook: str, name: str) -> bool:
    """Whether ``self.log(name, ...)`` was already called in the running ``hook`` (reason: the loop's
    result collection is the only record; Lightning raises only when the two calls' options differ,
    and silently keeps the last value when they match)."""
    results = trainer._results
    return results is not None and f"{hook}.{name}" in results


def metadata_filename() -> str:
    """The file of a distributed checkpoint holding Lightning's non-tensor state (reason: Lightning
    names it only privately; our ``load_checkpoint`` reads what its ``save_checkpoint`` wrote)."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return _METADATA_FILENAME
