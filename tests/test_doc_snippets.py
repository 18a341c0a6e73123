"""Every Python block of README.md and docs/ runs here, or says in its first line why it cannot.

A block runs in a fresh namespace in a harness worker of world size 1 (a gloo group of one rank),
so it must be complete: imports, a model, data. A block whose first line is ``# not run: <why>``
is not run whole and is reported as skipped with that reason (visible on the page); it must still
parse, its imports must import, and the ``NDParallelStrategy`` / ``ParallelPlan`` / ``PipelineOptions``
it constructs must be accepted as written (names the page's prose defines get the stand-ins of
``_STAND_INS``): a configuration the strategy refuses cannot hide in a block that is not run.

An HTML comment on the line before a block, invisible on the rendered page, may give the block
what the page's prose already gave the reader, and check its result::

    <!-- run: before=tiny_model_with_grads after=clip_matches_torch -->

``ranks=N`` runs it on N ranks (one gloo group of N) instead of 1; ``launch=torchrun`` lets a
script's own ``dist.init_process_group(...)`` find that group, as under ``torchrun``;
``continues=above`` runs the page's previous block (its chain, with its options) first, in the
same namespace. ``before`` names a function of ``doc_snippets.py`` returning the starting namespace
(e.g. a small model with gradients for a block that says ``model.parameters()``); ``after`` one
that checks the namespace the block left (e.g. that its norm equals
``torch.nn.utils.clip_grad_norm_``'s). Blocks run in a scratch working directory.

Where Lightning is not installed (CI's core-only run), a block that imports it, or names a fixture of
``doc_snippets_lightning.py``, is reported as skipped saying so; likewise a block that needs
``transformers`` (the ``hf`` extra) where that is not installed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import tempfile
import textwrap
from pathlib import Path
from unittest import mock

import doc_snippets
import pytest
from conftest import HAVE_LIGHTNING, imported_modules, needs_lightning
from harness import run_on_ranks
from helpers import use_existing_process_group

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^[ \t]*```python[ \t]*$")
_RUN = re.compile(r"^[ \t]*<!--\s*run:(?P<args>[^>]*)-->\s*$")
_NOT_RUN = re.compile(r"^#\s*not run:\s*(?P<why>.+)$")
_EXTRAS = {"transformers": "the hf extra", "diffusers": "the diffusers extra", "litgpt": "pip install litgpt"}
"""Optional packages a block (or its fixture) may import, and what installs each."""


def _blocks() -> list:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").split("\n")
        page_blocks: list[tuple[str, dict]] = []
        i = 0
        while i < len(lines):
            if _FENCE.match(lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
                run = _RUN.match(lines[i - 1]) if i else None
                options = dict(kv.split("=", 1) for kv in run["args"].split()) if run else {}
                source = textwrap.dedent("\n".join(lines[i + 1 : end]))
                if options.get("continues") == "above":  # the page's previous block (and its chain) first
                    previous, first = page_blocks[-1]
                    source, options = previous + "\n\n" + source, {**first, **options}
                page_blocks.append((source, options))
                found.append(pytest.param(source, options, id=f"{page.relative_to(ROOT)}:{i + 1}"))
                i = end
            i += 1
    return found


def _fixture(name: str):
    """A function of doc_snippets.py, or else of doc_snippets_lightning.py (imported here, by name, so
    that the core-only run, which skips the blocks naming one of its functions, never imports it)."""
    if hasattr(doc_snippets, name):
        return getattr(doc_snippets, name)
    return getattr(importlib.import_module("doc_snippets_lightning"), name)


def _missing(source: str, options: dict) -> str | None:
    """What the block needs that is not installed: Lightning (imported by the block or by its fixtures, or a
    fixture of doc_snippets_lightning.py), or an optional package of ``_EXTRAS``; None if nothing."""
    names = [options[key] for key in ("before", "after") if key in options]
    fixtures = [getattr(doc_snippets, name) for name in names if hasattr(doc_snippets, name)]
    code = "\n\n".join([source, *(inspect.getsource(f) for f in fixtures)])
    if not HAVE_LIGHTNING and (len(fixtures) < len(names) or needs_lightning(code)):
        return "Lightning (the lightning extra)"
    imported = {module.split(".")[0] for module, _ in imported_modules(ast.parse(code))}
    for package, extra in _EXTRAS.items():
        if package in imported and importlib.util.find_spec(package) is None:
            return f"{package} ({extra})"
    return None


_CONFIGURATIONS = ("NDParallelStrategy", "ParallelPlan", "PipelineOptions")
"""The constructors of a block that is not run whole that are run (they validate their arguments)."""


def _stand_ins() -> dict:
    """What a not-run block's configuration may name from the page's prose, each a stand-in of the same kind."""
    from torch import nn

    import lightning_ndclip as nd

    class Block(nn.Module):  # a layer class the page defined (fsdp_units=[...])
        pass

    layers = {name: Block for name in ("Block", "DiTBlock", "LlamaDecoderLayer", "Qwen3MoeDecoderLayer")}
    public = {name: getattr(nd, name) for name in nd.__all__}  # the page's earlier imports
    return {**public, "nd": nd, **layers, "plan": nd.ParallelPlan(), "tp_plan": {}, "path": "checkpoint/"}


def _check_configurations(source: str) -> None:
    """A not-run block: its imports import, and each configuration it constructs (outermost calls of
    ``_CONFIGURATIONS``) is accepted with its arguments as written."""
    tree = ast.parse(source)
    namespace: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), "<doc block imports>", "exec"), namespace)
    namespace = {**_stand_ins(), **namespace}

    def configuration(node: ast.AST) -> bool:
        func = node.func if isinstance(node, ast.Call) else None
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in _CONFIGURATIONS

    inner = {id(n) for call in ast.walk(tree) if configuration(call) for n in ast.walk(call) if n is not call}
    for call in (n for n in ast.walk(tree) if configuration(n) and id(n) not in inner):
        expression = ast.unparse(call)
        try:
            eval(compile(ast.Expression(call), "<doc block configuration>", "eval"), namespace)
        except NameError as error:
            pytest.fail(f"{expression}: {error}; give the name a stand-in in _stand_ins()")
        except Exception as error:  # noqa: BLE001 - the configuration as the page writes it is refused
            pytest.fail(f"{expression} is refused as written: {type(error).__name__}: {error}")


def _run_block(source: str, options: dict) -> None:
    use_existing_process_group()
    namespace = _fixture(options["before"])() if "before" in options else {}
    namespace["__name__"] = "__doc_snippet__"
    # the worker's gloo group is the one a script's init_process_group would get from torchrun's env
    launch = mock.patch("torch.distributed.init_process_group") if options.get("launch") == "torchrun" else None
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch, launch or contextlib.nullcontext():
        os.chdir(scratch)  # runs/, lightning_logs/ and checkpoints a block writes land here
        try:
            exec(compile(source, "<doc block>", "exec"), namespace)
            if "after" in options:
                _fixture(options["after"])(namespace)
        finally:
            os.chdir(cwd)
            # the block's classes outlive it (fully_shard keeps the FSDP class it made of each), and through their
            # functions' globals, this namespace and the meshes of what the block built
            namespace.clear()


@pytest.mark.parametrize("source, options", _blocks())
def test_every_python_block_runs_or_says_why_not(source, options):
    first = source.lstrip().split("\n", 1)[0]
    missing = _missing(source, options)
    if reason := _NOT_RUN.match(first):
        assert len(reason["why"].strip()) >= 10, "say why the block cannot run"
        if missing is None and HAVE_LIGHTNING:  # the configurations are the Lightning layer's
            _check_configurations(source)
        pytest.skip(f"not run: {reason['why'].strip()}{'' if missing is None else f'; needs {missing}'}")
    if missing:
        pytest.skip(f"needs {missing}, which is not installed")
    run_on_ranks(int(options.get("ranks", 1)), _run_block, source, options, timeout=120)
