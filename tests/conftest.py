"""Pytest wiring: the multi-rank harness's pools (see ``harness.py``), and the core-only run.

Without Lightning installed (CI's ``.venv-core``: the package and pytest only), the test modules
that import Lightning are not collected, and what remains tests the pure-PyTorch core.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest

LIGHTNING_ROOTS = {"lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "tensorboard"}  # + examples extra
ROOT = Path(__file__).resolve().parent.parent
HAVE_LIGHTNING = all(importlib.util.find_spec(name) is not None for name in ("lightning", "torchmetrics"))
_LIGHTNING_LAYER = {"GlobalMeanLoss", "GlobalNormClip", "NDParallelStrategy"}


def imported_modules(tree: ast.AST) -> list[tuple[str, set[str]]]:
    """``(module, names imported from it)`` for every absolute import in ``tree``, at any depth
    (``import a.b`` gives ``("a.b", set())``)."""
    found: list[tuple[str, set[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, set()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.append((node.module, {alias.name for alias in node.names}))
    return found


def needs_lightning(source: str) -> bool:
    """Whether code imports Lightning (directly, through the package's Lightning layer, or through a
    module of tests/ or examples/ that does), anywhere in it; ``nd.GlobalNormClip`` counts as an import."""
    tree = ast.parse(source)
    if any(isinstance(node, ast.Attribute) and node.attr in _LIGHTNING_LAYER for node in ast.walk(tree)):
        return True
    for module, names in imported_modules(tree):
        if module == "lightning_ndclip" and _LIGHTNING_LAYER & names:
            return True
        root = module.split(".")[0]
        if root in LIGHTNING_ROOTS or module.startswith("lightning_ndclip.lightning"):
            return True
        local = [ROOT / folder / f"{root}.py" for folder in ("tests", "examples")]
        if any(path.exists() and needs_lightning(path.read_text(encoding="utf-8")) for path in local):
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if HAVE_LIGHTNING or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if needs_lightning(collection_path.read_text(encoding="utf-8")) else None


@pytest.fixture(scope="session", autouse=True)
def _shutdown_rank_pools() -> Iterator[None]:
    """Kill the harness's worker pools when the test session ends."""
    yield
    harness.shutdown_all()
