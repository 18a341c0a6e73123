"""A Griffe extension for the API reference: the package's docstrings, made for Markdown.

The docstrings of ``lightning_ndclip`` are Google style with a few reStructuredText habits that
Markdown does not know. Before mkdocstrings renders them, this extension rewrites, in memory only
(the source files are not touched):

* grouped parameters, ``q, k, v: local tensors`` in an ``Args:`` section, into one entry per name
  with the shared description, so Griffe can match each name to the signature (``--strict`` fails
  on a parameter it cannot match, which is how a renamed argument is caught);
* roles such as ``:func:`get_total_norm``` or ``:class:`~lightning_ndclip.core.parallel.mesh.ParallelDims```
  into optional cross-references (a link when the target is rendered somewhere in the site, plain
  code otherwise: never a warning);
* ``:math:`...``` into a small HTML rendering of the LaTeX (sums, fractions, sub/superscripts),
  so the site needs no MathJax and no network.

Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Alias, AliasResolutionError, CyclicAliasError, Extension, GriffeLoader, Module, Object

_ARGS_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments", "other parameters"}
_SECTION = re.compile(r"^(?P<indent>\s*)(?P<title>[A-Za-z][A-Za-z ]*):\s*$")
_GROUPED = re.compile(r"^(?P<indent>\s*)(?P<names>\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)(?P<rest>\s*(?:\([^)]*\))?:\s.*)$")
_ROLE = re.compile(r":(?P<kind>func|class|meth|attr|data|mod|obj|exc|const):`(?P<tilde>~?)(?P<target>[^`]+)`")
_MATH = re.compile(r":math:`(?P<tex>[^`]+)`")

_TEX_WORDS = {
    "sum": "Σ",
    "prod": "Π",
    "ell": "ℓ",
    "infty": "∞",
    "dots": "…",
    "ldots": "…",
    "cdots": "⋯",
    "cdot": "·",
    "times": "×",
    "le": "≤",
    "leq": "≤",
    "ge": "≥",
    "geq": "≥",
    "min": "min",
    "max": "max",
    "in": "∈",
    "|": "‖",
    ",": "\u2009",
    " ": " ",
    "qquad": "\u2003\u2003",
    "quad": "\u2003",
    "Big": "",
    "big": "",
    "left": "",
    "right": "",
    "_": "_",
}


def _group(tex: str, i: int) -> tuple[str, int]:
    """The argument starting at ``tex[i]``: a braced group or one character; returns (text, next index)."""
    if i < len(tex) and tex[i] == "{":
        depth, j = 0, i
        while j < len(tex):
            depth += {"{": 1, "}": -1}.get(tex[j], 0)
            if depth == 0:
                return tex[i + 1 : j], j + 1
            j += 1
        return tex[i + 1 :], len(tex)
    if i < len(tex) and tex[i] == "\\":
        m = re.match(r"\\([A-Za-z]+|.)", tex[i:])
        assert m is not None
        return m.group(0), i + len(m.group(0))
    return tex[i : i + 1], i + 1


def tex_to_html(tex: str) -> str:
    """A best-effort HTML rendering of the small LaTeX expressions the docstrings use."""
    out: list[str] = []
    i = 0
    while i < len(tex):
        c = tex[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+|.)", tex[i:])
            assert m is not None
            word = m.group(1)
            i += len(m.group(0))
            if word in ("text", "mathrm", "operatorname", "mathbf"):
                arg, i = _group(tex, i)
                out.append(html.escape(arg.replace("\\_", "_")))
            elif word == "frac":
                num, i = _group(tex, i)
                den, i = _group(tex, i)
                num_html, den_html = tex_to_html(num), tex_to_html(den)
                wrap = re.compile(r"[\s+\-]")
                num_html = f"({num_html})" if wrap.search(num.strip()) else num_html
                den_html = f"({den_html})" if wrap.search(den.strip()) else den_html
                out.append(f"{num_html}/{den_html}")
            else:
                out.append(html.escape(_TEX_WORDS.get(word, word)))
        elif c in "_^":
            arg, i = _group(tex, i + 1)
            tag = "sub" if c == "_" else "sup"
            out.append(f"<{tag}>{tex_to_html(arg)}</{tag}>")
        elif c in "{}":
            i += 1
        else:
            out.append(html.escape(c))
            i += 1
    # Markdown must not read emphasis into the result
    return "".join(out).replace("_", "&#95;").replace("*", "&#42;")


def split_grouped_parameters(text: str) -> str:
    """Rewrite ``a, b: description`` entries of Args-like sections into one entry per name."""
    lines = text.split("\n")
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        section = _SECTION.match(line)
        indent = len(line) - len(line.lstrip())
        if section:
            title = section.group("title").strip().lower()
            section_indent = indent if title in _ARGS_SECTIONS else None
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = None  # left the section
        grouped = _GROUPED.match(line) if section_indent is not None else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        body = [grouped.group("rest")]
        j = i + 1
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
            body.append("\n" + lines[j])
            j += 1
        for name in re.split(r"\s*,\s*", grouped.group("names")):
            out.append(grouped.group("indent") + name + "".join(body))
        i = j
    return "\n".join(out)


class MarkdownDocstrings(Extension):
    """Rewrites every docstring of the loaded package as described in the module docstring."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj.docstring.value, obj, loader)

    def _rewrite(self, text: str, obj: Object, loader: GriffeLoader) -> str:
        text = split_grouped_parameters(text)
        text = _MATH.sub(lambda m: f'<span class="math">{tex_to_html(m.group("tex"))}</span>', text)
        return _ROLE.sub(lambda m: self._reference(m, obj, loader), text)

    def _reference(self, match: re.Match[str], obj: Object, loader: GriffeLoader) -> str:
        target = match.group("target").strip()
        shown = target.rsplit(".", 1)[-1] if match.group("tilde") else target
        code = f"<code>{html.escape(shown)}</code>"
        path = self._resolve(target, obj, loader)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    @staticmethod
    def _resolve(target: str, obj: Object, loader: GriffeLoader) -> str | None:
        """The canonical path of ``target`` as seen from ``obj``, or ``None`` outside the package."""
        scopes = [""] if "." in target and target.split(".")[0] in loader.modules_collection else []
        scope: Object | None = obj
        while scope is not None:
            scopes.append(scope.path + ".")
            scope = scope.parent
        for prefix in scopes:
            try:
                found = loader.modules_collection.get_member(prefix + target)
            except (KeyError, ValueError, AliasResolutionError, CyclicAliasError):
                continue  # not there, or reached through an alias to another package
            try:
                return found.final_target.path if isinstance(found, Alias) else found.path
            except (AliasResolutionError, CyclicAliasError):
                return None  # an alias to something outside the loaded package
        return None


if "on_package" not in vars(Extension):  # Griffe 1.x names the same event on_package_loaded
    MarkdownDocstrings.on_package_loaded = MarkdownDocstrings.on_package  # type: ignore[attr-defined]


def _walk(obj: Object):
    yield obj
    for member in obj.members.values():
        if isinstance(member, Alias):
            continue
        yield from _walk(member)
