"""Private torch / Lightning names: all of them in ``lightning_ndclip/_compat.py``, all of them present.

* every private name an entry of ``_compat`` relies on (its ``PRIVATE_NAMES``) exists in the installed
  torch and Lightning: an upgrade that drops one fails here, naming it and the versions;
* every entry of ``_compat`` is registered in ``PRIVATE_NAMES``, and ``_compat`` uses no private
  name it does not register;
* no other module of the package uses a private torch / Lightning name: no import from a private
  module or of a private name, no ``x._name`` that the package does not define itself (or that
  ``_compat`` registers), no ``getattr(x, "_name")`` of one, and no class of ours that silently
  re-defines a private attribute of the torch / Lightning class it extends.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from lightning_ndclip import _compat

PACKAGE = Path(_compat.__file__).resolve().parent
COMPAT = PACKAGE / "_compat.py"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != COMPAT)  # every module of both layers
EXTERNAL_ROOTS = {"torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "transformers", "diffusers"}
VERSIONS = f"torch {torch.__version__}, lightning {lightning.__version__}"


def _trainer() -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


# Instances for private names that are instance attributes (set in ``__init__``, not on the class).
INSTANCES: dict[type, Callable[[], object]] = {
    pl.LightningModule: pl.LightningModule,
    ModelParallelStrategy: ModelParallelStrategy,
    _TrainingEpochLoop: lambda: _trainer().fit_loop.epoch_loop,
    nn.Module: nn.Module,
    Callback: Callback,
    torch.optim.Adam: lambda: torch.optim.Adam([nn.Parameter(torch.zeros(1))], fused=True),
    FSDPState: FSDPState,
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _registered_components() -> set[str]:
    """Every ``_``-prefixed component of the names ``_compat`` registers (modules, classes, attributes)."""
    return {
        part
        for dotted in (d for names in _compat.PRIVATE_NAMES.values() for d in names)
        for part in dotted.replace(":", ".").split(".")
        if _private(part)
    }


# --- every registered private name exists ------------------------------------------------------


def _registry() -> list[tuple[str, str]]:
    return [(entry, dotted) for entry, names in _compat.PRIVATE_NAMES.items() for dotted in names]


@pytest.mark.parametrize(("entry", "dotted"), _registry(), ids=[f"{e}-{d}" for e, d in _registry()])
def test_private_name_exists(entry: str, dotted: str) -> None:
    where = f"lightning_ndclip._compat.{entry} relies on {dotted}, which the installed versions ({VERSIONS}) lack"
    assert any(_private(p) for p in dotted.replace(":", ".").split(".")), (
        f"{dotted} (for _compat.{entry}) names nothing private: a public name needs no _compat entry"
    )
    module_name, _, qualname = dotted.partition(":")
    if module_name.split(".")[0] in ("transformers", "diffusers"):  # optional dependencies (the hf, diffusers extras)
        pytest.importorskip(module_name.split(".")[0])
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        pytest.fail(f"{where}: no module {module_name} ({e})")
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i == len(parts) - 1 and inspect.isclass(obj):  # an instance attribute, set in __init__?
            make = INSTANCES.get(obj)
            if make is None:
                pytest.fail(
                    f"{where}, or it is an instance attribute of {obj.__qualname__}: add a factory for that "
                    "class to INSTANCES in tests/test_compat.py"
                )
            if hasattr(make(), part):
                return
        pytest.fail(f"{where}: {'.'.join([module_name, *parts[:i]])} has no attribute {part!r}")


def test_every_entry_is_registered() -> None:
    """Every public name ``_compat`` defines is an entry in ``PRIVATE_NAMES`` and ``__all__``."""
    tree = ast.parse(COMPAT.read_text())
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    entries = {n for n in defined if not n.startswith("_")} - {"PRIVATE_NAMES"}
    assert entries - set(_compat.PRIVATE_NAMES) == set(), "entries of _compat missing from PRIVATE_NAMES"
    assert set(_compat.PRIVATE_NAMES) - entries == set(), "PRIVATE_NAMES lists names _compat does not define"
    assert set(_compat.__all__) == entries | {"PRIVATE_NAMES"}
    for entry, names in _compat.PRIVATE_NAMES.items():
        assert names and all(":" in d for d in names), f"PRIVATE_NAMES[{entry!r}]: 'module:Qualified.name' strings"


def test_compat_uses_only_registered_private_names() -> None:
    """A private name used inside ``_compat`` is registered by some entry (so it is checked above)."""
    registered = _registered_components()
    used = {name for _, name, _ in _private_uses(COMPAT, own=set(), everything=True)}
    assert used - registered == set(), f"_compat uses private names no PRIVATE_NAMES entry registers: {used - registered}"


# --- no private name outside _compat ---------------------------------------------------------------


@functools.cache
def _own_private_names() -> frozenset[str]:
    """The private names the package defines itself (outside ``_compat``): functions, classes,
    module / class / local names, and attributes assigned on ``self`` / ``cls`` (the package's sources, read once per
    session: every per-module test below asks)."""
    own: set[str] = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return frozenset({n for n in own if _private(n)} - _registered_components())


def _private_uses(path: Path, own: Collection[str], everything: bool = False) -> Iterator[tuple[int, str, str]]:
    """``(line, private name, code)`` for every use in ``path`` of a private name not in ``own``:
    imports from private torch / Lightning modules or of private names, attribute accesses, and
    string attribute names given to ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` /
    ``operator.attrgetter`` / ``operator.methodcaller``. ``everything``: also ``own`` names."""
    tree = ast.parse(path.read_text())
    registered = _registered_components()
    imported: set[str] = set()  # local names bound to torch / Lightning modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in EXTERNAL_ROOTS:
                    imported.add(alias.asname or alias.name.split(".")[0])
                    for part in alias.name.split("."):
                        if _private(part):
                            yield node.lineno, part, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in EXTERNAL_ROOTS:
                for alias in node.names:
                    imported.add(alias.asname or alias.name)
                    for part in [*node.module.split("."), alias.name]:
                        if _private(part):
                            yield node.lineno, part, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        name, root = None, None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            name, root = node.attr, node.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
        elif isinstance(node, ast.Call) and len(node.args) >= 1:
            func = ast.unparse(node.func)
            index = 1 if func in ("getattr", "hasattr", "setattr", "delattr") else 0
            if func.split(".")[-1] in ("getattr", "hasattr", "setattr", "delattr", "attrgetter", "methodcaller"):
                arg = node.args[index] if len(node.args) > index else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
                    name = arg.value
        if name is None:
            continue
        on_external = isinstance(root, ast.Name) and root.id in imported
        if everything or name not in own or name in registered or on_external:
            yield node.lineno, name, ast.unparse(node)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_private_name_outside_compat(path: Path) -> None:
    found = [
        f"{path.name}:{line}: {name} in `{code}`"
        for line, name, code in _private_uses(path, _own_private_names())
    ]
    assert not found, (
        "private torch / Lightning names used outside lightning_ndclip/_compat.py (add an entry there, with "
        "its reason and its PRIVATE_NAMES line, and use that):\n" + "\n".join(found)
    )


def test_the_scan_finds_private_names_and_spares_our_own(tmp_path: Path) -> None:
    """The scanner itself: each kind of use is found; the package's own private names are not."""
    source = tmp_path / "snippet.py"
    source.write_text(
        "import torch\n"
        "from torch.utils._pytree import tree_leaves\n"  # 2: private module
        "from torch.distributed.tensor.placement_types import _StridedShard\n"  # 3: private name
        "from torch.distributed.device_mesh import DeviceMesh\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, t, mesh, opt):\n"
        "        a = t._local_tensor\n"  # 9: registered attribute
        "        b = torch._foreach_norm\n"  # 10: on an imported torch name
        "        c = DeviceMesh._concatenate\n"  # 11: on an imported torch class
        "        d = getattr(opt, '_optimizer', opt)\n"  # 12: by string
        "        e = t._some_new_private\n"  # 13: defined nowhere in the package
        "        f = torch._count\n"  # 14: on torch, though the package has a _count of its own
        "        return self._mine, t.__class__, self._counted_singles\n"
    )
    found = sorted((line, name) for line, name, _ in _private_uses(source, _own_private_names() | {"_mine"}))
    assert found == [
        (2, "_pytree"),
        (3, "_StridedShard"),
        (9, "_local_tensor"),
        (10, "_foreach_norm"),
        (11, "_concatenate"),
        (12, "_optimizer"),
        (13, "_some_new_private"),
        (14, "_count"),
    ]


def _external_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if b is not object and not b.__module__.startswith("lightning_ndclip")]


def test_our_subclasses_do_not_redefine_private_attributes_of_their_bases() -> None:
    """A class of ours extending a torch / Lightning class must not define (and so silently replace)
    one of its base's private attributes: class-level names, and instance attributes where
    ``INSTANCES`` can build the base."""
    clashes = []
    for path in MODULES:
        module = importlib.import_module(".".join(["lightning_ndclip", *path.relative_to(PACKAGE).with_suffix("").parts]))
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = _external_bases(getattr(module, node.name))
            if not bases:
                continue
            ours = set()
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
                    ours.add(sub.name)
                elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and ast.unparse(sub.value) == "self":
                    ours.add(sub.attr)
            for stmt in node.body:  # class-level names
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    ours.update(t.id for t in targets if isinstance(t, ast.Name))
            theirs: set[str] = set()
            for base in bases:
                theirs.update(vars(base))
                if base in INSTANCES:
                    theirs.update(vars(INSTANCES[base]()))
            clashes += [f"{path.name}: {node.name}.{n} (defined by {[b.__qualname__ for b in bases]})"
                        for n in sorted(ours & theirs) if _private(n)]
    assert not clashes, f"private attributes of torch / Lightning bases re-defined ({VERSIONS}):\n" + "\n".join(clashes)


# --- what some entries mean, beyond existing ---------------------------------------------------------


def test_set_device_mesh_is_what_device_mesh_returns() -> None:
    mesh: Any = object()
    module, strategy = pl.LightningModule(), ModelParallelStrategy()
    _compat.set_device_mesh(module, mesh)
    _compat.set_device_mesh(strategy, mesh)
    assert module.device_mesh is mesh and strategy.device_mesh is mesh


def test_lightning_state_readers() -> None:
    assert _compat.save_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False
    assert _compat.save_distributed_checkpoint(ModelParallelStrategy()) is True
    assert _compat.batches_that_stepped(_trainer()) == 0
    assert isinstance(_compat.metadata_filename(), str) and _compat.metadata_filename()


def test_torch_aliases() -> None:
    t = torch.arange(6.0)
    assert _compat.view_base(t[2:]) is t and _compat.view_base(t) is None
    assert _compat.StridedShard(1, split_factor=2).dim == 1  # layout reads .dim, as of Shard
    assert [float(n) for n in _compat.foreach_norm([t[:2], t[2:4]], 1)] == [1.0, 5.0]
    assert _compat.local_tensors([t])[0] is t  # plain tensors as they are (DTensors: tests/test_norm_dtensor.py)
    leaves = _compat.tree_leaves({"a": (t, [t])})
    assert len(leaves) == 2 and all(leaf is t for leaf in leaves)
