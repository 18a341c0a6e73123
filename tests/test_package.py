"""Release hygiene: one version everywhere, a public API that is all exported, and a pure-PyTorch
core that imports without Lightning."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAVE_LIGHTNING

import lightning_ndclip

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_same_in_pyproject_the_package_and_the_changelog():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert lightning_ndclip.__version__ == version
    releases = re.findall(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert releases and releases[0] == version, f"CHANGELOG's newest release {releases[:1]} != {version}"


def test_every_name_in_all_is_importable():
    for name in lightning_ndclip.__all__:
        if name in lightning_ndclip._LIGHTNING_NAMES and not HAVE_LIGHTNING:  # the core-only run
            with pytest.raises(ImportError, match=rf"lightning_ndclip\.{name} needs .*lightning_ndclip\[lightning\]"):
                getattr(lightning_ndclip, name)
            continue
        assert getattr(lightning_ndclip, name) is not None, name


def test_the_pure_pytorch_core_imports_without_lightning():
    code = (
        "import sys\n"
        "for m in ('lightning', 'lightning.pytorch', 'lightning.fabric', 'torchmetrics'): sys.modules[m] = None\n"
        "import lightning_ndclip as nd\n"
        "from lightning_ndclip.core import agree, context, experts, loss, norm, parallel, pipeline\n"
        "from lightning_ndclip.core.parallel import coverage, mesh, plan, reduce, replicas, summary, tensor_parallel\n"
        "from lightning_ndclip.integrations.transformers import checkpoint, context, dropout, pipeline, plans\n"
        "assert nd.clip_grad_norm_ and nd.sync_token_count and nd.ParallelDims\n"
        "try:\n"
        "    nd.GlobalNormClip\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GlobalNormClip needs" in done.stdout


_LIGHTNING_ROOTS = ("lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics", "lightning_ndclip.lightning")


def _lightning_imports(source: str) -> list[str]:
    """What ``source`` imports from Lightning, at any depth (a function's lazy import included): modules,
    ``lightning_ndclip._compat`` helpers that reach a Lightning name, and module names given as strings
    (``importlib.import_module("lightning...")``)."""
    from lightning_ndclip._compat import PRIVATE_NAMES

    def is_lightning(module: str) -> bool:
        return any(module == root or module.startswith(f"{root}.") for root in _LIGHTNING_ROOTS)

    lightning_helpers = {name for name, targets in PRIVATE_NAMES.items() if any(is_lightning(t.split(":")[0]) for t in targets)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if is_lightning(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if is_lightning(node.module):
                found.append(node.module)
            elif node.module == "lightning_ndclip._compat":
                found += [f"_compat.{a.name}" for a in node.names if a.name in lightning_helpers]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_compat":
            if node.attr in lightning_helpers:
                found.append(f"_compat.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_lightning(node.value):
            found.append(node.value)
    return found


def test_the_core_reaches_no_lightning_name_directly_or_lazily():
    """The layering rule of docs/architecture.md, checked on the source: the core-only CI job catches an import
    that runs at import time or in a tested path; this also catches one deferred into a function."""
    core = Path(lightning_ndclip.__file__).parent / "core"
    found = {str(p.relative_to(core)): _lightning_imports(p.read_text()) for p in sorted(core.rglob("*.py"))}
    assert {name: imports for name, imports in found.items() if imports} == {}
    # the check can fail: a lazy import, a Lightning helper of _compat, a module named by a string
    planted = (
        "def f():\n    from lightning.pytorch import Trainer\n"
        "def g():\n    return _compat.metadata_filename()\n"
        "h = importlib.import_module('lightning.fabric')\n"
    )
    assert _lightning_imports(planted) == ["lightning.pytorch", "lightning.fabric", "_compat.metadata_filename"]


_MAY_IMPORT = {  # each part of the core, and the other parts it may import (lightning_ndclip/core/__init__.py)
    "norm": {"parallel.mesh", "agree"},
    "loss": {"agree"},
    "parallel": {"context", "agree", "random", "libraries"},
    "context": set(),
    "pipeline": {"agree", "libraries"},
    "libraries": {"pipeline"},  # the type of a model's own split, for type checkers only
    "experts": {"parallel.expert_parallel"},
    "agree": set(),
    "load_balance": {"parallel.mesh", "libraries"},
    "random": {"parallel.mesh"},
    "draws": set(),
    "optim": set(),
}


def _package_imports(path: Path) -> list[str]:
    """The ``lightning_ndclip`` modules the file at ``path`` imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in found if m.startswith("lightning_ndclip.")]


def test_only_the_package_root_imports_the_model_library_integrations():
    """The model-library boundary (lightning_ndclip/core/libraries.py): the core and the Lightning layer ask the
    registered adapters and import no integration; an integration imports the core, never the Lightning layer."""
    package = Path(lightning_ndclip.__file__).parent
    wrong = [
        f"{path.relative_to(package)}: {module}"
        for part in ("core", "lightning")
        for path in sorted((package / part).rglob("*.py"))
        for module in _package_imports(path)
        if module.startswith("lightning_ndclip.integrations")
    ]
    wrong += [
        f"{path.relative_to(package)}: {module}"
        for path in sorted((package / "integrations").rglob("*.py"))
        for module in _package_imports(path)
        if module.startswith("lightning_ndclip.lightning")
    ]
    assert wrong == []
    # the root imports each integration, which registers its adapter
    assert any(m.startswith("lightning_ndclip.integrations.transformers.") for m in _package_imports(package / "__init__.py"))


def test_each_part_of_the_core_imports_only_what_its_docstring_allows():
    core = Path(lightning_ndclip.__file__).parent / "core"
    wrong = []
    for path in sorted(core.rglob("*.py")):
        relative = path.relative_to(core).with_suffix("")
        if relative.parts == ("__init__",):
            continue
        part = relative.parts[0]
        allowed = _MAY_IMPORT[part] | {part}
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                if not module.startswith("lightning_ndclip.core.") or module.count(".") < 2:
                    continue
                target = module.removeprefix("lightning_ndclip.core.")
                if not any(target == a or target.startswith(f"{a}.") for a in allowed):
                    wrong.append(f"{relative}: {module}")
    assert not wrong, wrong


def test_the_architecture_pages_import_table_is_the_one_the_code_is_checked_against():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", page.split("| core part | may import |", 1)[1].split("\n\n", 1)[0], re.M)
    table = {part: set(re.findall(r"`([\w.]+)`", imports)) for part, imports in rows}
    assert table == _MAY_IMPORT
