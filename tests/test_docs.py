"""The documentation site stays complete and its links stay valid, checked without building it.

* every public name (``lightning_ndclip.__all__`` and each submodule's ``__all__``) has a
  mkdocstrings ``::: identifier`` directive (or is in the ``members:`` list of one) in
  ``docs/reference/``, and every directive names an object that exists;
* every page under ``docs/`` is in the ``nav`` of ``mkdocs.yml``, and every nav entry exists;
* relative links and snippet includes (``--8<-- "path"``) in the pages point to existing files.

Everything is read with ``ast`` and plain text parsing: no import of torch, no mkdocs, no network.
``mkdocs build --strict`` checks the rest (anchors, docstrings, cross-references).
"""

from __future__ import annotations

import ast
import fnmatch
import re
import textwrap
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML: a dependency of Lightning

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE_DIR = ROOT / "lightning_ndclip"
PACKAGE = PACKAGE_DIR.name

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*):::[ \t]+(?P<identifier>[\w.]+)[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_LINK_DEFINITION = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*<?(?P<target>\S+?)>?(?:[ \t]+.*)?$")
_SNIPPET = re.compile(r"^[ \t]*-{1,}8<-{1,}[ \t]+[\"'](?P<path>[^\"']+)[\"'][ \t]*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


# --- the package's public names, read from the source ------------------------------------------


def _module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_all(tree: ast.Module, path: Path) -> list[str] | None:
    """The literal ``__all__`` of a module, or ``None`` if it has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            value = ast.literal_eval(node.value)  # a computed __all__ would fail here, loudly
            assert all(isinstance(v, str) for v in value), f"{path}: __all__ must list strings"
            return list(value)
    return None


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at top level: definitions, assignments, imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _reexports(tree: ast.Module) -> dict[str, str]:
    """``{name: defining module}`` for the ``from lightning_ndclip.x import name`` of ``__init__``
    (including those inside ``try`` blocks)."""
    origin: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            module = node.module if node.level == 0 else f"{PACKAGE}.{node.module}"
            for alias in node.names:
                origin[alias.asname or alias.name] = f"{module}.{alias.name}"
    return origin


def _modules() -> dict[str, Path]:
    """``{dotted module name: file}`` for every public module of the package (none named ``_x``)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if any(part.startswith("_") and part != "__init__" for part in parts):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def public_names() -> dict[str, set[str]]:
    """Every public name, as ``{qualified name: identifiers that document it}``.

    A submodule's name ``lightning_ndclip.m.x`` is documented by that identifier; a top-level name
    ``lightning_ndclip.x`` by ``lightning_ndclip.x`` or by the identifier of the object it re-exports.
    """
    names: dict[str, set[str]] = {}
    for module, path in _modules().items():
        tree = _module_tree(path)
        exported = _module_all(tree, path) or []
        origin = _reexports(tree)  # a package re-exporting its modules' names: documented where they are defined
        for name in exported:
            qualified = f"{module}.{name}"
            names[qualified] = {qualified} | ({origin[name]} if name in origin else set())
    return names


# --- what the reference pages document -----------------------------------------------------------


def _directives() -> list[tuple[Path, int, str, list[str]]]:
    """``(page, line, identifier, members)`` for every ``:::`` directive under ``docs/reference``."""
    found = []
    for page in sorted((DOCS / "reference").rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if not match:
                continue
            indent = len(match.group("indent"))
            block = []
            for following in lines[i + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                block.append(following)
            options = yaml.safe_load(textwrap.dedent("\n".join(block))) if any(s.strip() for s in block) else None
            members = ((options or {}).get("options") or {}).get("members") or []
            found.append((page, i + 1, match.group("identifier"), list(members) if isinstance(members, list) else []))
    return found


def documented() -> set[str]:
    """Identifiers rendered by the reference pages (directives and their explicit member lists)."""
    out = set()
    for _, _, identifier, members in _directives():
        out.add(identifier)
        out.update(f"{identifier}.{m}" for m in members)
    return out


def test_every_public_name_has_a_reference_entry():
    names = public_names()
    assert f"{PACKAGE}.clip_grad_norm_" in names, "the package's __all__ was not found"
    have = documented()
    missing = sorted(qualified for qualified, identifiers in names.items() if not identifiers & have)
    assert not missing, (
        "public names without an API reference entry; add a directive to a page of docs/reference/, e.g.\n"
        + "\n".join(sorted({f"::: {max(names[q], key=len)}" for q in missing}))
    )


def test_every_directive_names_an_existing_object():
    modules = _modules()
    trees = {m: _module_tree(p) for m, p in modules.items()}
    problems = []
    for page, line, identifier, members in _directives():
        module = max((m for m in modules if identifier == m or identifier.startswith(m + ".")), key=len, default=None)
        where = f"{page.relative_to(ROOT)}:{line}: ::: {identifier}"
        if module is None:
            problems.append(f"{where}: no such module in {PACKAGE}")
            continue
        rest = identifier[len(module) + 1 :].split(".") if identifier != module else []
        bound = _bound_names(trees[module])
        if rest and rest[0] not in bound:
            problems.append(f"{where}: {module} defines no {rest[0]!r}")
        if not rest:
            problems.extend(f"{where}: {module} defines no member {m!r}" for m in members if m not in bound)
    assert not problems, "\n".join(problems)


# --- the nav -------------------------------------------------------------------------------------


def _config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [] if _SCHEME.match(entry) else [entry]
    if isinstance(entry, list):
        return [page for item in entry for page in _nav_pages(item)]
    if isinstance(entry, dict):
        return [page for value in entry.values() for page in _nav_pages(value)]
    return []


def _excluded(relative: str, patterns: list[str]) -> bool:
    """mkdocs' ``exclude_docs`` (gitignore-style; the simple forms used here) and dotfiles."""
    if any(part.startswith(".") for part in relative.split("/")):
        return True
    for pattern in patterns:
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        anchored = pattern.lstrip("/")
        if anchored.endswith("/") and (relative.startswith(anchored) or f"/{anchored}" in f"/{relative}"):
            return True
        if fnmatch.fnmatch(relative, anchored) or fnmatch.fnmatch(relative.rsplit("/", 1)[-1], anchored):
            return True
    return False


def pages() -> list[str]:
    """Every Markdown page mkdocs builds, relative to ``docs/``."""
    patterns = (_config().get("exclude_docs") or "").splitlines()
    found = (p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    return sorted(p for p in found if not _excluded(p, patterns))


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = _config()
    assert Path(config.get("docs_dir", "docs")).name == DOCS.name
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), f"pages listed twice in the nav: {sorted({p for p in nav if nav.count(p) > 1})}"
    assert not (missing := sorted(set(pages()) - set(nav))), f"pages missing from the mkdocs.yml nav: {missing}"
    assert not (absent := sorted(p for p in nav if not (DOCS / p).is_file())), f"nav entries without a file: {absent}"


# --- links ---------------------------------------------------------------------------------------


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, inline code removed."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            fence = None if fence == match.group(1) else fence or match.group(1)
            continue
        if fence is None:
            out.append((number, _INLINE_CODE.sub("", line)))
    return out


def test_relative_links_and_snippets_point_to_existing_files():
    problems = []
    for relative in pages():
        page = DOCS / relative
        for number, line in _prose_lines(page.read_text(encoding="utf-8")):
            where = f"docs/{relative}:{number}"
            snippet = _SNIPPET.match(line)
            if snippet:  # pymdownx.snippets: relative to the repository root, ':start:end' optional
                path = re.sub(r"(:-?\d*){1,2}$", "", snippet.group("path"))
                if not (ROOT / path).is_file():
                    problems.append(f"{where}: snippet {snippet.group('path')!r} not found")
                continue
            targets = [m.group("target") for m in _LINK.finditer(line)]
            definition = _LINK_DEFINITION.match(line)
            if definition:
                targets.append(definition.group("target"))
            for target in targets:
                if _SCHEME.match(target) or target.startswith(("#", "/")):
                    continue
                path = target.split("#", 1)[0].split("?", 1)[0]
                resolved = (page.parent / path).resolve()
                if not resolved.exists():
                    problems.append(f"{where}: link {target!r} points to a missing file")
                elif resolved.suffix == ".md" and DOCS.resolve() not in resolved.parents:
                    problems.append(f"{where}: link {target!r} leaves docs/ (the site cannot link there)")
    assert not problems, "\n".join(problems)
