"""Declarative parallelization: tensor parallel, activation checkpointing and FSDP2 from arguments.

A plain function, readable top to bottom, and the plan object that holds its arguments, which
:class:`~lightning_ndclip.NDParallelStrategy` applies when it is given one (``plan=``) instead of a
``configure_model`` hook. Usable without Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from typing_extensions import TypeIs

from lightning_ndclip._compat import checkpoint_wrapper, concatenate_meshes
from lightning_ndclip.core import libraries
from lightning_ndclip.core.parallel.mesh import ParallelMeshes
from lightning_ndclip.core.parallel.tensor_parallel import (
    COMPILED,
    check_plan_keys,
    matches_plan_key,
    output_not_a_view,
    resolved_plan,
    tensor_parallelize,
    views_copied,
)

__all__ = ["ParallelPlan", "check_plan_sizes", "parallelize"]


def _own_plans(tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None) -> TypeIs[Literal["auto"]]:
    """Whether ``tp_plan`` asks for the library models' own plans (``"auto"``): their tp, ep and cp plans, their blocks
    as the FSDP2 units (:mod:`~lightning_ndclip.core.libraries`). The one place this rule is written."""
    return tp_plan == "auto"


def check_plan_sizes(tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None, tp: int, ep: int, cp: int = 1) -> None:
    """A tp plan of its own needs ``tp > 1``; ``tp_plan="auto"`` (the models' own plans) fits any mesh, and applies
    what the mesh has dims for (tensor parallelism on ``tp``, experts on ``ep``, sequences cut on ``cp``)."""
    if isinstance(tp_plan, Mapping) and tp_plan and tp == 1:
        raise ValueError("plan=ParallelPlan(tp_plan={...}) needs tp > 1; set tp > 1 or drop tp_plan")


def _replace_children(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> dict[nn.Module, nn.Module]:
    """Wrap every submodule of one of ``classes`` in an activation-checkpoint wrapper; return the wrappers, by the
    module each wraps."""
    wrappers: dict[nn.Module, nn.Module] = {}
    for name, child in module.named_children():
        if isinstance(child, classes):
            wrappers[child] = checkpoint_wrapper(child)
            setattr(module, name, wrappers[child])
        else:
            wrappers.update(_replace_children(child, classes))
    return wrappers


def _check_not_compiled(module: nn.Module, classes: Sequence[type[nn.Module]], compile: bool) -> None:
    """Raise, naming it, if a module of ``classes`` (to checkpoint) or, with ``compile``, of the ``fsdp_units`` ones
    is held by a ``torch.compile`` wrapper (compiled before the plan): the wrapper would go on calling it without
    its checkpoint; compiled once more, it would be compiled twice."""
    for name, child in module.named_modules():
        if name.rpartition(".")[2] == COMPILED and isinstance(child, tuple(classes)):
            what = "compile" if compile else "activation_checkpointing"
            raise ValueError(
                f"{what}: {name} ({type(child).__name__}) was compiled before the plan was applied (torch.compile(block) "
                "wraps it): compile after the plan, once: ParallelPlan(compile=True) (each fsdp_units module, once "
                "parallelized), or block.compile(fullgraph=True) after parallelize(), instead of torch.compile(block)"
            )


def _fullgraph(compile: bool | Mapping[str, Any]) -> bool:
    """Whether ``compile`` (:func:`parallelize`'s argument) compiles each block as one graph."""
    return compile if isinstance(compile, bool) else bool(compile.get("fullgraph", True))


def _compile_units(units: Sequence[nn.Module], options: Mapping[str, Any]) -> None:
    """``unit.compile(fullgraph=True, **options)`` for each FSDP2 unit: in place (its names and state dict keys stay),
    its own hooks (FSDP2's) outside the compiled code, its submodules' (tensor parallelism) and the activation
    checkpoint of a checkpointed unit (the unit is then its wrapper) inside."""
    for unit in units:
        unit.compile(**{"fullgraph": True, **options})


def _check_classes(module: nn.Module, argument: str, classes: Sequence[type[nn.Module]]) -> None:
    """Raise, naming them, if some of ``classes`` have no instance among ``module``'s submodules."""
    present = {type(m) for m in module.modules() if m is not module}
    missing = [c.__name__ for c in classes if not any(issubclass(t, c) for t in present)]
    if missing:
        raise ValueError(
            f"{argument}: {missing} match no submodule of {type(module).__name__} (its submodules are of classes "
            f"{sorted(t.__name__ for t in present)})"
        )


def parallelize(
    module: nn.Module,
    meshes: ParallelMeshes,
    *,
    tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None = None,
    fsdp_units: Sequence[type[nn.Module]] = (),
    activation_checkpointing: Sequence[type[nn.Module]] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    root_units: Sequence[nn.Module] | None = None,
    compile: bool | Mapping[str, Any] = False,
    loss_parallel: bool | str = False,
) -> nn.Module:
    """Apply tensor parallelism, activation checkpointing and FSDP2 to ``module``, in that order, then compile
    each ``fsdp_units`` module if asked.

    Args:
        module: the model (modified in place and returned).
        meshes: the strategy's meshes; TP uses ``tp``, FSDP2 uses ``fsdp`` (``dp_shard_cp``, or
            ``dp_replicate x dp_shard_cp`` for HSDP).
        tp_plan: ``{module name: ParallelStyle}`` (names relative to ``module``; wildcards as in
            PyTorch), or ``"auto"``: the own plans of the library models inside ``module`` (Hugging Face
            ``transformers`` models: :func:`~lightning_ndclip.integrations.transformers.plans.hf_tp_plan`; with
            ``cp > 1`` also their attention over the cut sequence; see :mod:`~lightning_ndclip.core.libraries`). Applied by
            :func:`~lightning_ndclip.core.parallel.tensor_parallel.tensor_parallelize`: ``parallelize_module``
            keeping tied parameters (a tied embedding and LM head) one parameter.
        fsdp_units: module classes that each become one ``fully_shard`` unit (e.g. the transformer
            block); the root gets a unit for the remaining parameters. Nested matches (a block and the expert
            matrices inside it) are each a unit, the inner one wrapped first. Empty with ``tp_plan="auto"``: the
            repeated blocks of the library models inside ``module``, as their library names them
            (:func:`~lightning_ndclip.core.libraries.block_classes`: transformers' decoder layers, diffusers'
            transformer blocks).
        activation_checkpointing: module classes whose instances recompute activations in backward.
        mp_policy: FSDP2 mixed-precision policy (e.g. bf16 parameters, fp32 reduction).
        reshard_after_forward: FSDP2's choice for the non-root units.
        root_units: the modules whose ``forward`` is called, each made one more unit for the
            parameters no ``fsdp_units`` member holds (default: ``module`` itself). A LightningModule
            whose ``training_step`` calls ``self.model(...)`` needs ``[self.model]``: FSDP2 gathers a
            unit's parameters in that unit's forward. A container without ``forward``
            (``nn.ModuleList``, ``nn.ModuleDict``: the nanoGPT habit, ``for block in self.blocks``)
            stands for its members, each a unit of its own.
        compile: ``True``, or keyword arguments of ``torch.compile`` (``{"mode": "max-autotune"}``): each
            module of the ``fsdp_units`` classes (the transformer blocks) is compiled, the torchtitan way,
            after it is parallelized: ``block.compile(fullgraph=True, **compile)`` (``fullgraph=False`` may be
            given), in place, so module names and checkpoint keys stay. FSDP2's hooks run outside the
            compiled code; the tensor-parallel styles of its layers and its activation checkpoint inside,
            without a graph break (a checkpointed block's FSDP2 unit is then its checkpoint wrapper, as in
            torchtitan: FSDP2 hooks in compiled code would break its graph).
        loss_parallel: ``True`` (or the LM head's plan key): the head's logits stay sharded along the vocabulary
            and the loss is computed on the shards
            (:func:`~lightning_ndclip.core.parallel.loss_parallel.loss_parallel_plan`); ``tp > 1``; with ``pp > 1``,
            the stage holding the head (:meth:`ParallelPlan.for_stage`) returns vocabulary-sharded logits.

    Raises:
        ValueError: before changing ``module``, naming the argument and the entries, when an
            ``fsdp_units`` or ``activation_checkpointing`` class or a ``tp_plan`` key matches no
            submodule, or a TP plan is given without a ``tp`` dim, or ``compile`` without ``fsdp_units``,
            or a module to checkpoint or to compile was compiled before (a ``torch.compile`` wrapper holds
            it: compile after the plan), or ``compile`` asks for one graph per block with ``ep > 1``; after
            tensor parallelism, when the plan shards the copies of a tied parameter differently (naming them);
            ``loss_parallel`` without an LM head to shard (see
            :func:`~lightning_ndclip.core.parallel.loss_parallel.loss_parallel_plan`).
    """
    options = None if compile is False else {} if compile is True else dict(compile)  # None: no compile
    if _own_plans(tp_plan) and not fsdp_units:
        fsdp_units = libraries.block_classes(module)
    _check_arguments(module, meshes, tp_plan, fsdp_units, activation_checkpointing, compile)
    experts = _apply_tensor_parallel(module, meshes, tp_plan, loss_parallel)
    wrappers = _apply_activation_checkpointing(module, activation_checkpointing)
    fsdp_kwargs: dict[str, Any] = {"mesh": meshes["fsdp"], **({} if mp_policy is None else {"mp_policy": mp_policy})}
    for unit in experts.values():  # whole experts per ep rank, sharded over the ranks that hold the same experts
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **{**fsdp_kwargs, "mesh": meshes["edp"]})
    units = tuple(fsdp_units)
    matched = [m for m in module.modules() if units and isinstance(m, units) and m is not module]
    if options is not None:  # a checkpointed unit's wrapper is the unit, compiled with the checkpoint inside (torchtitan's order)
        matched = [wrappers.get(m, m) for m in matched]
    for unit in reversed(matched):  # inner units first: an outer unit's fully_shard would take their parameters
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    _shard_roots(module, _callable_units([module] if root_units is None else root_units), fsdp_kwargs)
    if options is not None:
        _compile_units(matched, options)
    return module


def _check_arguments(
    module: nn.Module,
    meshes: ParallelMeshes,
    tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None,
    fsdp_units: Sequence[type[nn.Module]],
    activation_checkpointing: Sequence[type[nn.Module]],
    compile: bool | Mapping[str, Any],
) -> None:
    """:func:`parallelize`'s checks before it changes anything (see its ``Raises``)."""
    if compile is not False and not fsdp_units:
        raise ValueError(
            "compile compiles each module of the fsdp_units classes (the transformer blocks), and fsdp_units is "
            "empty: name the block class in fsdp_units"
        )
    _check_classes(module, "fsdp_units", fsdp_units)
    _check_classes(module, "activation_checkpointing", activation_checkpointing)
    _check_not_compiled(module, activation_checkpointing, compile=False)
    if compile is not False:
        _check_not_compiled(module, fsdp_units, compile=True)
    tp, ep, cp = meshes["tp"].size(), meshes["ep"].size(), meshes["cp"].size()
    check_plan_sizes(tp_plan, tp, ep, cp)
    if ep > 1 and _own_plans(tp_plan) and _fullgraph(compile):
        raise ValueError(
            "compile with ep > 1: each block's experts are an FSDP2 unit of their own (hooks Dynamo does not trace) "
            "and exchange their tokens in sizes read on the host, so a block is no single graph; give "
            "compile={'fullgraph': False} (graph breaks there), or leave compile off"
        )


def _apply_tensor_parallel(
    module: nn.Module, meshes: ParallelMeshes, tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None,
    loss_parallel: bool | str,
) -> dict[str, nn.Module]:  # fmt: skip
    """The tp plan (``"auto"``: each library model's own, with its ep and cp plans) and the loss-parallel head;
    the modules holding whole experts per ep rank, each to be an FSDP2 unit of its own."""
    experts: dict[str, nn.Module] = {}
    if _own_plans(tp_plan):
        tp_plan, experts = _apply_library_plans(module, meshes)
    if loss_parallel:  # the LM head's logits stay sharded along the vocabulary
        from lightning_ndclip.core.parallel.loss_parallel import loss_parallel_plan

        tp_plan = loss_parallel_plan(module, tp_plan if isinstance(tp_plan, Mapping) else None, loss_parallel)
    if tp_plan:
        tensor_parallelize(module, meshes["tp"], tp_plan)
    return experts


def _apply_activation_checkpointing(
    module: nn.Module, activation_checkpointing: Sequence[type[nn.Module]]
) -> dict[nn.Module, nn.Module]:
    """Each module of the ``activation_checkpointing`` classes wrapped to recompute in backward: ``{module: its
    wrapper}``; a library model's checkpointed layers told not to cache."""
    wrappers = _replace_children(module, tuple(activation_checkpointing)) if activation_checkpointing else {}
    for library in libraries.registered() if wrappers else ():
        library.recompute_without_cache(module, wrappers.values())
    return wrappers


def _shard_roots(module: nn.Module, roots: list[nn.Module], fsdp_kwargs: dict[str, Any]) -> None:
    """The root FSDP2 units, after every inner one: one parameter held by two roots refused; their outputs never
    views (FSDP2 would warn that an in-place op drops their backward hook)."""
    shared = shared_parameters(roots)
    if shared:
        raise ValueError(
            f"root units {shared[0]} hold one parameter between them ({shared[1]}): as two fully_shard units "
            "they would make it two parameters. Give their common parent as the root unit (its forward must "
            "be the one called)"
        )
    for root in roots:
        for linear in _own_linears(root):  # e.g. an LM head: its output may be the unit's
            linear.register_forward_hook(output_not_a_view)
        root.register_forward_hook(views_copied)  # before fully_shard's own hook, which sees the output after it
        fully_shard(root, **fsdp_kwargs)
        if isinstance(root, nn.Sequential):
            _SequentialCalled(root, next((n for n, m in module.named_modules() if m is root), "") or "the module")


def own_class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class: ``fully_shard`` swaps a unit's class for a subclass of it
    (``FSDPLlamaForCausalLM``), which messages, summaries and saved configs must not name."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _apply_library_plans(
    module: nn.Module, meshes: ParallelMeshes
) -> tuple[dict[str, ParallelStyle] | None, dict[str, nn.Module]]:
    """``tp_plan="auto"``: the own plans of the library models inside ``module`` (:mod:`~lightning_ndclip.core.libraries`):
    with ``cp > 1`` their attention over the sequence cut along cp, with ``ep > 1`` their experts whole over ep
    (each split over tp along its width when ``tp > 1``) applied here; returns their tensor-parallel plan without
    the experts' entries (``None`` where ``tp == 1``), and the expert modules (each an FSDP2 unit over ``edp``).

    Raises:
        ImportError: no library model found where a library is not installed (naming its extra).
        ValueError: no library model found; or the models found have no plan for a dim of size > 1.
    """
    tp, ep, cp = meshes["tp"].size(), meshes["ep"].size(), meshes["cp"].size()
    if tp == ep == cp == 1:
        return None, {}
    found = libraries.require_models(
        module,
        f"tp_plan='auto' with tp={tp}, ep={ep}, cp={cp}",
        needs="give tp_plan as {module name: ParallelStyle}, and your own model's attention context_parallel_attention "
        "for cp > 1",
    )
    users = list({id(f.library): f.library for f in found}.values())
    for model in found if cp > 1 else ():
        model.library.context_parallelize(model.model, meshes["cp"])
    experts: dict[str, nn.Module] = {}
    if ep > 1:
        ep_plan = {key: style for library in users for key, style in library.ep_plan(module).items()}
        if not ep_plan:
            raise ValueError(_no_plan(module, found, f"ep={ep}", "an expert-parallel plan", "train with ep=1"))
        ep_mesh = meshes["ep"] if tp == 1 else concatenate_meshes([meshes["ep"], meshes["tp"]])
        parallelize_module(module, ep_mesh, resolved_plan(module, ep_plan))
        experts = {n: m for n, m in module.named_modules() if any(matches_plan_key(n, key) for key in ep_plan)}
    if tp == 1:
        return None, experts
    tp_plan = {key: style for library in users for key, style in library.tp_plan(module, tp).items()}
    if not tp_plan:
        instead = "give tp_plan as {module name: ParallelStyle}"
        raise ValueError(_no_plan(module, found, f"tp={tp}", "a tensor-parallel plan", instead))
    # the experts' own tp entries were applied with ep above
    return {key: style for key, style in tp_plan.items() if not any(matches_plan_key(n, key) for n in experts)}, experts


def _no_plan(module: nn.Module, found: Sequence[libraries.LibraryModel], dim: str, plan: str, instead: str) -> str:
    names = ", ".join(f"{f.name or '(the module)'}: {type(f.model).__name__} ({f.library.name})" for f in found)
    return f"tp_plan='auto' with {dim}: no model in {type(module).__name__} has {plan} (models found: {names}); {instead}"


class _SequentialCalled:
    """An ``nn.Sequential`` root unit gathers, in its forward, the weights of its members that are no
    FSDP2 unit of their own; iterated instead (``for layer in self.layers``), such a member would meet
    sharded weights ('got mixed torch.Tensor and DTensor'). Its forward hooks make that a clear error,
    raised alike on every rank (they all run the same code)."""

    def __init__(self, sequential: nn.Sequential, name: str) -> None:
        self.active, self.name = False, name
        self.members = {
            member: f"{name}.{child}"
            for child, member in sequential.named_children()
            if not isinstance(member, FSDPModule) and any(True for _ in member.parameters())
        }
        if not self.members:  # every member gathers its own weights: iterating is fine, and no hook runs
            return
        sequential.register_forward_pre_hook(self.enter)
        sequential.register_forward_hook(self.leave)
        for member in self.members:
            member.register_forward_pre_hook(self.check)

    def enter(self, *_: Any) -> None:
        self.active = True

    def leave(self, *_: Any) -> None:
        self.active = False

    def check(self, member: nn.Module, _: Any) -> None:
        if not self.active:
            raise ValueError(
                f"{self.members[member]} ({type(member).__name__}) was called outside the forward of {self.name}, an "
                f"nn.Sequential that is an FSDP2 root unit: it gathers its members' weights in its forward, and it was "
                f"iterated, not called. Call it ({self.name}(x)), hold the layers in an nn.ModuleList, or name the "
                "modules training_step calls in ParallelPlan(root_units=...)"
            )


def _own_linears(root: nn.Module) -> list[nn.Module]:
    """The ``nn.Linear`` modules of ``root`` (itself included) that no FSDP2 unit inside it holds."""
    found: list[nn.Module] = [root] if isinstance(root, nn.Linear) else []
    for child in root.children():
        if not isinstance(child, FSDPModule):
            found += _own_linears(child)
    return found


def shared_parameters(units: Sequence[nn.Module]) -> tuple[list[str], str] | None:
    """The first two of ``units`` (by class name) that hold one parameter between them, and its name in
    the first, or ``None``: such units cannot each be a ``fully_shard`` unit."""
    seen: dict[int, int] = {}
    for index, unit in enumerate(units):
        for name, param in unit.named_parameters():
            other = seen.setdefault(id(param), index)
            if other != index:
                return [type(units[other]).__name__, type(unit).__name__], name
    return None


def _callable_units(roots: Sequence[nn.Module]) -> list[nn.Module]:
    """``roots``, each container without a ``forward`` (``nn.ModuleList`` / ``nn.ModuleDict``, whose
    members the caller calls one by one) replaced by its members, and modules already FSDP2 units (or
    holding no parameter) left out: FSDP2 gathers a unit's parameters in that unit's forward."""
    units: list[nn.Module] = []
    for root in roots:
        if isinstance(root, FSDPModule) or not any(True for _ in root.parameters()):
            continue
        if type(root).forward is nn.Module.forward:  # a container: nn.Module's forward raises
            units += _callable_units(list(root.children()))
            if any(True for _ in root.parameters(recurse=False)):
                raise ValueError(
                    f"{type(root).__name__} holds parameters of its own but has no forward: FSDP2 could not "
                    "gather them; move them into a module whose forward is called"
                )
        else:
            units.append(root)
    return units


@dataclass(frozen=True)
class ParallelPlan:
    """What :func:`parallelize` applies, as one object: ``NDParallelStrategy(plan=ParallelPlan(...))``
    parallelizes a LightningModule that has no ``configure_model``. The fields but ``kv_exchange`` are
    :func:`parallelize`'s arguments of the same names; an empty plan (the default) applies nothing."""

    tp_plan: Mapping[str, ParallelStyle] | Literal["auto"] | None = None
    fsdp_units: Sequence[type[nn.Module]] = ()
    activation_checkpointing: Sequence[type[nn.Module]] = ()
    mp_policy: MixedPrecisionPolicy | None = None
    kv_exchange: Literal["ring", "all_gather"] = "ring"
    """With ``tp_plan="auto"`` and ``cp > 1``: how the ``transformers`` models' attention sees the other cp ranks'
    keys and values (:func:`~lightning_ndclip.core.context.attention.context_parallel_attention`); the strategy
    reads it when it cuts each batch (:func:`~lightning_ndclip.integrations.transformers.context.shard_batch`)."""
    compile: bool | Mapping[str, Any] = False
    """``True`` or ``torch.compile`` keyword arguments: each ``fsdp_units`` module (the transformer block) compiled
    with ``fullgraph=True`` once parallelized, in place (:func:`parallelize`'s ``compile``). The way to compile
    blocks with a plan: the strategy applies it in ``setup``, after ``configure_model``, and a module that has a
    plan has no ``configure_model``."""

    loss_parallel: bool | str = False
    """``True`` (or the LM head's plan key): cross-entropy on logits sharded along the vocabulary, never gathered
    (:func:`~lightning_ndclip.core.parallel.loss_parallel.loss_parallel_plan`): with ``tp_plan="auto"``, each
    ``transformers`` causal LM's own ``.loss``; with a plan of your own, its one gathered ``ColwiseParallel``
    ``nn.Linear`` entry, your loss :func:`~lightning_ndclip.core.parallel.loss_parallel.vocab_parallel_cross_entropy`."""

    def __post_init__(self) -> None:
        if not isinstance(self.loss_parallel, (bool, str)):
            raise ValueError(
                f"ParallelPlan(loss_parallel=...) must be True, False or the LM head's plan key, got {self.loss_parallel!r}"
            )
        if self.kv_exchange not in ("ring", "all_gather"):
            raise ValueError(f"ParallelPlan(kv_exchange=...) must be 'ring' or 'all_gather', got {self.kv_exchange!r}")
        object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))
        object.__setattr__(self, "activation_checkpointing", tuple(self.activation_checkpointing))

    def __bool__(self) -> bool:
        """Whether the plan applies anything."""
        return bool(self.tp_plan or self.fsdp_units or self.activation_checkpointing or self.mp_policy)

    def cuts_sequences(self, cp: int) -> bool:
        """Whether the library models' own plans (``tp_plan="auto"``) cut their sequences over ``cp`` ranks: the
        batch by their library's :meth:`~lightning_ndclip.core.libraries.ModelLibrary.cut_batch`, the model where
        its own plan says."""
        return _own_plans(self.tp_plan) and cp > 1

    def for_stage(self, model: nn.Module, stage: nn.Module) -> ParallelPlan:
        """The part of this plan, written for the whole ``model``, that applies to ``stage``, a pipeline stage cut from
        it (holding some of its modules under their names): the ``tp_plan`` entries naming modules of the stage, the
        ``fsdp_units`` / ``activation_checkpointing`` classes it has, loss parallel on the stage holding the head.
        ``tp_plan="auto"`` stays: the stages of a ``transformers`` model carry their own part of its plan.

        Raises:
            ValueError: before any change, an entry that names nothing in ``model`` (as :func:`parallelize` on
                ``model`` would), or a loss-parallel head ``model``'s plan does not single out.
        """
        _check_classes(model, "fsdp_units", self.fsdp_units)
        _check_classes(model, "activation_checkpointing", self.activation_checkpointing)
        present = {type(m) for m in stage.modules() if m is not stage}
        units, checkpointed = ([c for c in cs if any(issubclass(t, c) for t in present)]
                               for cs in (self.fsdp_units, self.activation_checkpointing))  # fmt: skip
        if not isinstance(self.tp_plan, Mapping):
            return replace(self, fsdp_units=units, activation_checkpointing=checkpointed)
        check_plan_keys(model, self.tp_plan)
        whole = dict(model.named_modules())  # a stage's stand-in for a module another stage holds is of another type
        held = [name for name, m in stage.named_modules() if name and type(m) is type(whole.get(name))]
        tp_plan = {key: style for key, style in self.tp_plan.items() if any(matches_plan_key(name, key) for name in held)}
        head: bool | str = self.loss_parallel
        if head:  # the head's key, found on the whole model; loss parallel where the stage holds it
            from lightning_ndclip.core.parallel.loss_parallel import head_keys

            head = next((key for key in head_keys(model, self.tp_plan, head) if key in tp_plan), False)
        return replace(self, tp_plan=tp_plan, loss_parallel=head, fsdp_units=units, activation_checkpointing=checkpointed)

    def apply(self, module: nn.Module, meshes: ParallelMeshes, *, root_units: Sequence[nn.Module] | None = None) -> nn.Module:
        """:func:`parallelize` ``module`` with this plan.

        Raises:
            ValueError: as :func:`parallelize`; and ``compile`` (one graph per block) with ``cp > 1`` and
                ``kv_exchange="ring"``, whose point-to-point exchanges Dynamo does not compile, or with ``tp > 1`` and
                a ``transformers`` model with attention dropout (drawn per tp rank: generators seeded in the step).
        """
        if _fullgraph(self.compile) and self.cuts_sequences(meshes["cp"].size()) and self.kv_exchange == "ring":
            raise ValueError(
                "ParallelPlan(compile=...) with cp > 1: the ring exchange of keys and values (kv_exchange='ring') sends "
                "and receives point to point, which Dynamo does not compile (a graph break per exchange); give "
                "kv_exchange='all_gather', or compile={'fullgraph': False}"
            )
        if _fullgraph(self.compile) and meshes["tp"].size() > 1 and _own_plans(self.tp_plan):
            dropping = [type(f.model).__name__ for f in libraries.models(module) if f.library.attention_dropout(f.model) > 0]
            if dropping:
                raise ValueError(
                    f"ParallelPlan(compile=...) with tp > 1: {dropping[0]} drops out its attention probabilities "
                    "(config.attention_dropout > 0), which each tp rank draws for its own heads with its generators seeded "
                    "for the call (integrations.transformers.dropout), and seeding is no op Dynamo compiles into the "
                    "block's graph; give compile={'fullgraph': False} (a graph break at each attention), or "
                    "attention_dropout = 0.0"
                )
        return parallelize(
            module,
            meshes,
            tp_plan=self.tp_plan,
            fsdp_units=self.fsdp_units,
            activation_checkpointing=self.activation_checkpointing,
            mp_policy=self.mp_policy,
            root_units=root_units,
            compile=self.compile,
            loss_parallel=self.loss_parallel,
        )
