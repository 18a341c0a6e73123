"""Activations tensor parallelism splits, followed through the first forward.

``ColwiseParallel`` gives each tensor-parallel rank a contiguous block of a linear layer's output features
(rank ``r`` of ``tp`` holds features ``[r N / tp, (r + 1) N / tp)``, a plain tensor); the model computes on
these blocks until a ``RowwiseParallel`` layer sums them. Two mistakes there train without an error:

* **A fused projection cut into its parts**, ``q, k, v = self.qkv(h).chunk(3, -1)`` or
  ``gate, up = self.gate_up(h).chunk(2, -1)``: each rank cuts its own block, not the whole output (with
  ``tp = 2`` rank 0's "q", "k" and "v" are the two halves of q and the first half of k), and the model
  computes another function. A ``ValueError`` names the layer. A head-major layout split with ``view``
  (each rank's block holds whole heads' q, k and v) is not a cut and passes.
* **A whole parameter applied to split activations**: one the plan leaves unsplit, the same on every tp
  rank (a per-head norm's weight, a learnable activation between a colwise and a rowwise layer). Each
  rank's gradient is only its heads' (features') part. Where the parameter meets split activations only,
  the sum of the parts over ``tp`` is the exact gradient: a hook on the parameter sums it in every
  backward, from the first. A parameter that meets split and whole activations cannot be summed (its whole
  part would count ``tp`` times), and an op that fails on a split activation and a whole parameter (a
  per-head tensor of all heads against this rank's heads) is a shape error: both a ``ValueError`` naming
  the parameter.
* **A whole activation entering split ones**: the output of a layer the plan leaves whole, or of a rowwise
  layer (summed over tp), that requires grad, meeting split activations outside a colwise layer (a rotary
  key shared by every head concatenated to this rank's heads, a per-head mask computed for every head).
  Each rank's backward gives it its heads' part of the gradient, and nothing sums the parts: a
  ``ValueError`` names the layer that made it and the module where it met the split ones.
  (``ColwiseParallel`` sums its input's gradient itself.)

A weight split by a style (a DTensor) that the model reads outside its module's forward, with plain
tensors, fails in DTensor; a ``ValueError`` names it.

:func:`watch_split_activations` watches one forward (the first step's; a Python check per op; compiled modules
run eagerly in it and are first compiled in the next). Every rank runs the same code, so every rank raises at
the same point. Parameters that are DTensors (split or
replicated by a style) are DTensor's to handle and are left alone. Pure PyTorch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.tensor_parallel import OWN_OUTPUT_GRADIENT

__all__ = ["watch_split_activations"]

_SPLITS = {torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split, torch.Tensor.tensor_split, torch.tensor_split}
"""Ops that cut a tensor into parts along one dim (``dim`` their third argument or keyword)."""


def _split_over(module: nn.Module, tp_dim: str, weight_dim: int) -> bool:
    """Whether ``module`` is a linear layer whose weight is split along ``weight_dim`` over the mesh dim ``tp_dim``
    (0: ``ColwiseParallel``, 1: ``RowwiseParallel``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    if tp_dim not in names:
        return False
    placement = weight.placements[names.index(tp_dim)]
    return isinstance(placement, (Shard, _compat.StridedShard)) and placement.dim == weight_dim


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree``, nested in tuples, lists and dicts as an op's arguments and results hold them (the
    watch's per-op walk: pytree's general one was a tenth of a watched forward's time)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class _Watch(TorchFunctionMode):
    """Follows through every op the split activations (``split``: by id, each kept alive while watched, so an id is
    not reused) and the tensors computed from whole parameters alone (``made_of``: id -> the parameters' names);
    records the parameters that meet split activations (``on_split``) and those that meet anything else
    (``on_whole``: whole activations, token ids). Buffers, and tensors computed from them alone, are constants."""

    def __init__(self) -> None:
        super().__init__()
        self.split: dict[int, torch.Tensor] = {}
        self.colwise_outputs: dict[int, str] = {}
        self.parameters: dict[int, tuple[str, nn.Parameter]] = {}  # the whole parameters, as the forward uses them
        self.made_of: dict[int, tuple[set[str], torch.Tensor]] = {}
        self.constants: dict[int, torch.Tensor] = {}  # buffers, and tensors computed from them alone
        self.on_split: dict[str, nn.Parameter] = {}
        self.on_whole: set[str] = set()
        self.modules: list[tuple[str, bool]] = []  # the modules whose forward runs (innermost last), and whether
        # their input holds split activations
        self.made_by: dict[int, tuple[str, torch.Tensor, bool]] = {}  # whole activations requiring grad -> the layer
        # that made them, and whether it returned them (else an op outside any layer computed them from its output)
        self.whole_on_split: dict[str, str] = {}  # the layer whose whole output met split activations -> where
        self.dtensors: dict[int, tuple[str, torch.Tensor]] = {}  # split or replicated weights, and tensors read from them

    def where(self) -> str:
        return self.modules[-1][0] if self.modules and self.modules[-1][0] else "the model's forward"

    def made(self, name: str, output: Any) -> None:
        """``output`` of the module ``name``: its whole activations that require grad are recorded as its (the
        innermost module returning them names them)."""
        for t in _compat.tree_leaves(output):
            whole = isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad
            if whole and id(t) not in self.split and not self.sources(t) and not self.made_by.get(id(t), ("", t, False))[2]:
                self.made_by[id(t)] = (name, t, True)

    def sources(self, tensor: torch.Tensor) -> set[str]:
        if id(tensor) in self.parameters:
            return {self.parameters[id(tensor)][0]}
        found = self.made_of.get(id(tensor))
        return set(found[0]) if found is not None else set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        leaves_in = [t for t in inputs if not isinstance(t, DTensor)]
        tensors = [t for t in leaves_in if id(t) not in self.constants]  # a buffer is no activation: beta + weight
        if func in _SPLITS and args and id(args[0]) in self.colwise_outputs:
            self.refuse_cut(func, args, kwargs)
        split = any(id(t) in self.split for t in tensors)
        made_of = [t for t in tensors if self.sources(t)]
        whole = [self.made_by[id(t)][0] for t in tensors if id(t) in self.made_by]
        try:
            output = func(*args, **kwargs)
        except RuntimeError as error:
            self.refuse_failed(func, error, split, made_of, whole, args, kwargs)
            raise
        outputs = _tensors(output)
        leaves = [t for t in outputs if not isinstance(t, DTensor)]
        self.follow_dtensors(inputs, outputs)
        if split:
            for layer in whole:
                self.whole_on_split.setdefault(layer, f"{func.__name__} ({self.where()})")
        elif whole:  # computed from a whole activation: still that layer's
            self.made_by.update((id(t), (whole[0], t, False)) for t in leaves if t.requires_grad and id(t) not in self.made_by)
        if leaves_in and not tensors:  # of buffers alone: still a constant
            self.constants.update((id(t), t) for t in leaves)
        elif split:
            for t in made_of:
                for name in self.sources(t):
                    self.on_split[name] = self.parameter(name)
            self.split.update((id(t), t) for t in leaves)
        elif made_of and len(made_of) == len(tensors):  # of parameters alone (1 + weight, weight.float()): still them
            names: set[str] = set().union(*(self.sources(t) for t in made_of))
            self.made_of.update((id(t), (names, t)) for t in leaves)
        elif made_of:  # with whole activations, data or constants: the output is an activation
            self.on_whole.update(*(self.sources(t) for t in made_of))
        return output

    def refuse_failed(
        self, func: Any, error: RuntimeError, split: bool, made_of: list[torch.Tensor], whole: list[str], args: Any, kwargs: Any
    ) -> None:
        """A ``ValueError`` naming the cause where an op failed on split activations and whole ones, or on a split
        weight and plain tensors."""
        if split and made_of:
            failed = sorted(set().union(*(self.sources(t) for t in made_of)))
            raise ValueError(
                f"{failed} (left whole by the tensor-parallel plan, the same on every tp rank) met activations "
                f"the plan splits over tp and {func.__name__} failed: {error}. A per-head parameter must be split "
                "with the heads (give its module a style that shards it), or the activations gathered first"
            ) from error
        if split and whole:
            raise ValueError(
                f"the output of {sorted(set(whole))} (whole: the same on every tp rank, left whole by the plan or summed by "
                "a rowwise layer) "
                f"met activations the plan splits over tp in {self.where()} and {func.__name__} failed: {error}. A "
                "tensor of every head against this rank's heads: split that layer's output with the heads (a "
                "ColwiseParallel style for it, and its per-head parameters with it), or leave the heads whole"
            ) from error
        read = sorted({self.dtensors[id(t)][0] for t in _tensors((args, kwargs)) if id(t) in self.dtensors})
        if read:
            raise ValueError(
                f"{read} (split or replicated over tp by the plan: a DTensor) is read in {self.where()}, outside its "
                f"module's forward, with plain tensors, and {func.__name__} failed: {error}. The model uses the weight "
                "directly: leave its module out of the tensor-parallel plan"
            ) from error

    def follow_dtensors(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        names = [self.dtensors[id(t)][0] for t in inputs if id(t) in self.dtensors]
        if names:
            self.dtensors.update((id(t), (names[0], t)) for t in outputs if isinstance(t, DTensor))

    def parameter(self, name: str) -> nn.Parameter:
        return next(p for n, p in self.parameters.values() if n == name)

    def refuse_cut(self, func: Any, args: Any, kwargs: Any) -> None:
        tensor = args[0]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if dim % tensor.dim() != tensor.dim() - 1:
            return
        parts = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
        raise ValueError(
            f"{self.colwise_outputs[id(tensor)]} is ColwiseParallel (each tensor-parallel rank holds a contiguous block "
            f"of its output features) and its output is cut into parts along those features ({func.__name__}({parts}, "
            "dim=-1)): each rank cuts its own block, not the whole output, so a fused projection's parts (q, k, v or "
            "gate, up) are mixed and the model computes another function. Lay the fused rows out per head and split "
            "them with view (each rank's block then holds whole heads' q, k and v), or use separate projections, each "
            "ColwiseParallel (docs: 'A fused qkv projection under tensor parallel')"
        )


@contextmanager
def watch_split_activations(model: nn.Module, tp_mesh: DeviceMesh) -> Iterator[None]:
    """Watch the forward inside (see the module docstring): the fused-projection trap and a whole parameter
    that meets split and whole activations, or fails on split ones, raise ``ValueError`` naming them; each whole
    parameter that meets split activations only gets, on leaving, a hook summing its gradient over ``tp_mesh``
    (its mesh dim name is the one the colwise and rowwise weights are split over).

    Modules compiled with ``torch.compile`` run eagerly inside (``torch.compiler.set_stance("force_eager")``): the
    watch sees every op, and Dynamo traces neither the watch nor its hooks, which are gone when it first compiles
    them (the next forward)."""
    watch = _Watch()
    handles = _hooked(model, (tp_mesh.mesh_dim_names or ("tp",))[0], watch)
    watch.dtensors.update((id(p), (n, p)) for n, p in model.named_parameters() if isinstance(p, DTensor))
    try:
        with watch, torch.compiler.set_stance("force_eager"):  # compiled blocks run their Python: the watch sees its ops
            yield
    finally:
        for handle in handles:
            handle.remove()
    _refuse_what_was_seen(watch)
    _sum_over_tp(watch, tp_mesh.get_group())


def _hooked(model: nn.Module, tp_dim: str, watch: _Watch) -> list[Any]:
    """Hooks on every module of ``model`` telling ``watch`` what enters and leaves it, which outputs a colwise layer
    splits and which a rowwise layer makes whole again; their handles."""
    handles = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        is_rowwise = _split_over(module, tp_dim, 1)

        def entered(module: nn.Module, args: Any, kwargs: Any, prefix: str = prefix, name: str = name) -> None:
            watch.modules.append((name, any(id(t) in watch.split for t in _compat.tree_leaves((args, kwargs)))))
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(p, DTensor):
                    watch.dtensors[id(p)] = (f"{prefix}{pname}", p)
                elif p.requires_grad:
                    watch.parameters[id(p)] = (f"{prefix}{pname}", p)
            watch.constants.update((id(b), b) for b in module.buffers(recurse=False) if not isinstance(b, DTensor))

        def left(module: nn.Module, args: Any, output: Any, name: str = name, rowwise: bool = is_rowwise) -> None:
            _, split_in = watch.modules.pop()
            outputs = [t for t in _compat.tree_leaves(output) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)]
            if split_in and not rowwise:  # split in, split out, though the module computes on DTensors the watch skips
                # (an output known whole, a rowwise layer's inside it, stays whole)
                watch.split.update((id(t), t) for t in outputs if id(t) not in watch.made_by and not watch.sources(t))
            if module in OWN_OUTPUT_GRADIENT:  # its style sums its output's gradient
                for t in outputs:
                    watch.made_by.pop(id(t), None)
            else:
                watch.made(name, output)

        handles.append(module.register_forward_pre_hook(entered, with_kwargs=True, prepend=True))  # before a style's
        if _split_over(module, tp_dim, 0):

            def colwise(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                local = isinstance(output, torch.Tensor) and not isinstance(output, DTensor)
                if local and output.shape[-1] < cast(nn.Linear, module).out_features:  # this rank's block, not gathered
                    watch.split[id(output)] = output
                    watch.colwise_outputs[id(output)] = name

            handles.append(module.register_forward_hook(colwise))
        elif is_rowwise:

            def rowwise(module: nn.Module, args: Any, output: Any) -> None:  # summed over tp: whole again
                if isinstance(output, torch.Tensor):
                    watch.split.pop(id(output), None)

            handles.append(module.register_forward_hook(rowwise))
        handles.append(module.register_forward_hook(left))  # after the colwise / rowwise hook: the split output known
    return handles


def _refuse_what_was_seen(watch: _Watch) -> None:
    """The watched forward's traps: a whole parameter meeting split and whole activations, a whole activation
    entering split ones."""
    mixed = sorted(set(watch.on_split) & watch.on_whole)
    if mixed:
        raise ValueError(
            f"{mixed} (left whole by the tensor-parallel plan, the same on every tp rank) meet both activations the "
            "plan splits over tp and whole ones: each rank's gradient is part split, part whole, and no sum over tp "
            "is exact. Split them with the activations (a style for their module), or gather those activations first"
        )
    if watch.whole_on_split:
        met = "; ".join(f"{layer}'s output, in {where}" for layer, where in sorted(watch.whole_on_split.items())[:3])
        if len(watch.whole_on_split) > 3:
            met += f" (and {len(watch.whole_on_split) - 3} more)"
        raise ValueError(
            f"a whole activation (the same on every tp rank: of a layer the plan leaves whole, or a rowwise layer's sum) "
            f"meets activations the plan splits over tp: {met}. Each rank's backward gives it only its heads' "
            "part of the gradient, and nothing sums the parts. Give that layer the style that splits its output with "
            "the heads (ColwiseParallel, its per-head parameters with it), or gather the split activations first"
        )


def _sum_over_tp(watch: _Watch, group: dist.ProcessGroup) -> None:
    """A hook summing the gradient over tp on each whole parameter that met split activations only (once per
    parameter, however often it is watched)."""
    for parameter in watch.on_split.values():
        hooked = _SUMMED.get(id(parameter))
        if hooked is None or hooked() is not parameter:  # once: watching the same module again must not sum twice
            _SUMMED[id(parameter)] = weakref.ref(parameter)
            parameter.register_hook(lambda grad, group=group: _summed(grad, group))


_SUMMED: dict[int, weakref.ref[torch.Tensor]] = {}
"""The parameters whose gradient a hook already sums over tp, by id (a tensor compares by value, not identity)."""


def _summed(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of a gradient (its heads'), summed over the tp ranks."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad
