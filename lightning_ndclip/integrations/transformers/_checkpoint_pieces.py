"""Model tensors that ``transformers`` assembles from several checkpoint tensors, read into shards and written from them.

``transformers`` keeps the experts of its MoE families packed, ``experts.gate_up_proj [E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``experts.down_proj [E, H, I]``, while the hub ships one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.<e>.w1.weight``, ...). Its conversion
mapping (``transformers.conversion_mapping``, per model type) says how: a ``WeightConverter`` whose operations stack
each source pattern's tensors, one per expert, along a new dim (``MergeModulelist``), then concatenate the sources
(``Concatenate``); ``save_pretrained`` applies the inverse. :class:`Conversions` reads those rules for one model and
:func:`assemble` / :func:`hub_pieces` turn each packed tensor into :class:`Piece` s: one stored tensor each, equal to
``full[piece.index]`` of the model tensor's global value ``full`` (the expert along the stacked dim, the source's
rows along the concatenated one). A tensor stored as the model holds it is one piece, :func:`whole`.

* :func:`read_pieces` copies into a rank's local shard, whatever its placements (``Shard``, ``_StridedShard``, on any
  mesh), only the blocks of each stored tensor that the shard holds, read with ``safetensors``' ``get_slice``: no rank
  reads the experts or slices of another, and none holds more than its shard and one block.
* :func:`gather_piece` assembles one stored tensor on one rank from the blocks the ranks hold (one copy of each): no
  rank holds more than that tensor, never a whole packed weight.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from lightning_ndclip import _compat
from lightning_ndclip.core.agree import some

Index = tuple[int | slice, ...]
"""Where a stored tensor sits in a model tensor: an int on a dim the stored tensor lacks (the expert of a stack), a
slice ``start:stop`` on every other dim."""

_LITERAL = re.compile(r"[\w.*]+")
"""A pattern this module reads: names, dots, and ``*`` for the expert (no other regular expression)."""


@dataclass(frozen=True)
class Piece:
    """One stored tensor, ``name``, equal to ``full[index]`` of the model tensor it fills."""

    name: str
    index: Index

    def shape(self) -> tuple[int, ...]:
        """The stored tensor's shape."""
        return tuple(part.stop - part.start for part in self.index if isinstance(part, slice))


def whole(name: str, shape: Sequence[int]) -> Piece:
    """A tensor stored as the model holds it, under ``name``."""
    return Piece(name, tuple(slice(0, n) for n in shape))


# --- transformers' rules --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    """A ``WeightConverter`` this module reads: the model tensor named ``...target...`` is the concatenation along
    ``cat_dim`` over ``sources`` of the stack along ``stack_dim``, over the experts ``e``, of the stored tensors named
    ``...source...`` with ``*`` = ``e`` (``None``: not stacked, or not concatenated)."""

    target: str
    sources: tuple[str, ...]
    stack_dim: int | None
    cat_dim: int | None

    def pieces(self, name: str, shape: Sequence[int]) -> list[Piece] | None:
        """The pieces of the model tensor ``name``, named as after ``transformers``' renamings, in the order
        ``transformers`` joins them; ``None`` where its shape does not split evenly between the sources."""
        dims = [d for d in (self.stack_dim, self.cat_dim) if d is not None]
        if self.target not in name or any(d >= len(shape) for d in dims):
            return None
        rows = shape[self.cat_dim] // len(self.sources) if self.cat_dim is not None else 0
        if self.cat_dim is not None and rows * len(self.sources) != shape[self.cat_dim]:
            return None
        experts: Sequence[int | None] = range(shape[self.stack_dim]) if self.stack_dim is not None else [None]
        pieces = []
        for k, source in enumerate(self.sources):
            for expert in experts:
                index: list[int | slice] = [slice(0, n) for n in shape]
                if self.cat_dim is not None:
                    index[self.cat_dim] = slice(k * rows, (k + 1) * rows)
                if self.stack_dim is not None and expert is not None:
                    index[self.stack_dim] = expert
                stored = source.replace("*", str(expert))  # a source without * is not stacked: no expert
                pieces.append(Piece(name.replace(self.target, stored, 1), tuple(index)))
        return pieces


def _rule(converter: Any) -> _Rule | None:
    """``converter`` as a :class:`_Rule`, or ``None`` when it does more than stack (``MergeModulelist``) and / or
    concatenate (``Concatenate``) into one target, or names its tensors by patterns that are more than names and
    ``*``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    operations = list(converter.operations)
    kinds = [type(op) for op in operations]
    stacked = kinds[:1] == [MergeModulelist]
    joined = kinds[int(stacked) :] == [Concatenate]
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    if not (stacked or joined) or len(kinds) > int(stacked) + int(joined):  # a split, a transpose, an interleave, ...
        return None
    if len(targets) != 1 or (len(sources) > 1 and not joined):
        return None
    if not all(_named(p, int(stacked)) for p in sources) or not _named(targets[0], 0):
        return None
    stack_dim = operations[0].dim if stacked else None
    cat_dim = operations[-1].dim if joined else None
    return None if stack_dim == cat_dim else _Rule(targets[0], tuple(sources), stack_dim, cat_dim)


def _named(pattern: str, stars: int) -> bool:
    """Whether ``pattern`` is a name, with ``stars`` ``*`` for the expert, and no other regular expression."""
    return _LITERAL.fullmatch(pattern) is not None and pattern.count("*") == stars


class Conversions:
    """``transformers``' conversion mapping for ``model`` (``get_model_conversion_mapping``): the renamings
    ``from_pretrained`` applies to every checkpoint name, the converters that may then apply (at most one per name),
    and the reversed renamings ``save_pretrained`` applies to a model it did not load (without the legacy ones or
    prefix changes). Empty for a model that is no ``transformers`` model, or a release without them."""

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        self.family = str(getattr(config, "model_type", type(model).__name__))
        self.renamings: list[Any] = []
        self.converters: list[Any] = []
        self.unrenamings: list[Any] = []
        self.packings: list[tuple[Any, _Rule]] = []
        try:
            from transformers import core_model_loading
            from transformers.conversion_mapping import get_model_conversion_mapping

            transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
            written = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
        except (ImportError, AttributeError, TypeError):  # not a transformers model, or a release without these
            return
        renaming = core_model_loading.WeightRenaming
        self.renamings = [t for t in transforms if isinstance(t, renaming)]
        self.converters = [t for t in transforms if not isinstance(t, renaming)]
        prefix_change = getattr(core_model_loading, "PrefixChange", ())  # 5.0 has none
        kept = [t for t in written[::-1] if isinstance(t, renaming) and not isinstance(t, prefix_change)]
        self.unrenamings = [t.reverse_transform() for t in kept]
        rules = [(converter, _rule(converter)) for converter in self.converters]
        self.packings = [(converter.reverse_transform(), rule) for converter, rule in rules if rule is not None]

    def rename(self, key: str) -> str:
        """A checkpoint name after the renamings."""
        for renaming in self.renamings:
            key = renaming.rename_source_key(key)[0]
        return key

    def unrename(self, name: str) -> str:
        """The name ``save_pretrained`` writes for ``name`` (a model name, or a piece's name after the renamings)."""
        for renaming in self.unrenamings:
            name = renaming.rename_source_key(name)[0]
        return name

    def converted(self, renamed: str) -> tuple[str, Any] | None:
        """The model tensor a renamed checkpoint name goes into, and its converter; ``None`` if none converts it."""
        for converter in self.converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                return target, converter
        return None

    def packing(self, name: str) -> _Rule | None:
        """The rule by which the model tensor ``name`` is assembled, if one this module reads does (matched as
        ``save_pretrained`` matches it: by the reversed converter)."""
        return next((rule for reverse, rule in self.packings if reverse.rename_source_key(name)[1] is not None), None)


# --- loading: which stored tensors fill which model tensors ---------------------------------------------------------


@dataclass
class Assembly:
    """How a checkpoint's converted tensors fill the model: the ``pieces`` of each model tensor (named as stored);
    the model tensors they go into (``targets``, those of the conversions this module does not read among them);
    the stored tensors that fill none (``unexpected``), the pieces the checkpoint lacks (``missing``, named as
    ``save_pretrained`` names them), ``misshapen`` ones, and the conversions this module does not read
    (``unreadable``)."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    targets: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    misshapen: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def assemble(conversions: Conversions, model: Mapping[str, Sequence[int]], stored: Mapping[str, Sequence[int]]) -> Assembly:
    """The model tensors (``model``: ``{name: shape}``) that ``transformers`` assembles from the ``stored`` tensors
    (``{checkpoint name: shape}``, each one a converter takes), as pieces; checked, nothing read."""
    sources: dict[str, dict[str, str]] = {}  # model tensor -> {renamed checkpoint name: checkpoint name}
    converters: dict[str, Any] = {}
    for key in stored:
        renamed = conversions.rename(key)
        converted = conversions.converted(renamed)
        if converted is not None:
            sources.setdefault(converted[0], {})[renamed] = key
            converters[converted[0]] = converted[1]
    found = Assembly()
    for name, keys in sources.items():
        if name not in model:
            found.unexpected += sorted(keys.values())
            continue
        converter = converters[name]  # a split goes into several: named as transformers names them
        targets = [name.replace(converter.target_patterns[0], t, 1) for t in converter.target_patterns]
        found.targets.update(targets)
        rule = _rule(converter)
        pieces = rule.pieces(name, model[name]) if rule is not None else None
        if pieces is None:
            found.unreadable.append(
                f"{some(sorted(keys.values()))} into {some(targets)} for {conversions.family} by {converter.operations}"
            )
            continue
        found.pieces[name] = [Piece(keys[p.name], p.index) for p in pieces if p.name in keys]
        found.missing += [conversions.unrename(p.name) for p in pieces if p.name not in keys]
        found.unexpected += sorted(keys[r] for r in set(keys) - {p.name for p in pieces})
        found.misshapen += [
            f"{p.name}: checkpoint {tuple(stored[p.name])}, model {name}{_brackets(p.index)} {p.shape()}"
            for p in found.pieces[name]
            if tuple(stored[p.name]) != p.shape()
        ]
    return found


def _brackets(index: Index) -> str:
    return "[" + ", ".join(str(p) if isinstance(p, int) else f"{p.start}:{p.stop}" for p in index) + "]"


def hub_pieces(conversions: Conversions, name: str, shape: Sequence[int]) -> list[Piece]:
    """What ``save_pretrained`` writes for the model tensor ``name``: one tensor per expert and source where a rule
    this module reads assembles it, and each piece's name is read back into ``name`` by ``from_pretrained``'s own
    renamings and converters; else the tensor whole, under its (reverse-renamed) name."""
    rule = conversions.packing(name)
    pieces = rule.pieces(name, shape) if rule is not None else None
    stored = [Piece(conversions.unrename(p.name), p.index) for p in pieces or []]
    if not stored or any(_target(conversions, p.name) != name for p in stored):
        return [whole(conversions.unrename(name), shape)]
    return stored


def _target(conversions: Conversions, key: str) -> str | None:
    converted = conversions.converted(conversions.rename(key))
    return converted[0] if converted is not None else None


# --- reading into a shard, gathering from the shards ----------------------------------------------------------------


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """For each dim of ``tensor``, the global index of each position of its local shard, in order (a DTensor's
    ``to_local()``, as DTensor itself splits it from the placements, without communication; a plain tensor holds
    all of itself)."""
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    mesh, placements = tensor.device_mesh, tensor.placements
    return [
        distribute_tensor(torch.arange(n), mesh, [_along(p, dim) for p in placements], src_data_rank=None).to_local().cpu()
        for dim, n in enumerate(tensor.shape)
    ]


def _along(placement: Placement, dim: int) -> Placement:
    """``placement`` for a 1-D tensor of dim ``dim``'s indices: the same split if it splits ``dim``, else Replicate."""
    if isinstance(placement, _compat.StridedShard) and placement.dim == dim:
        return _compat.StridedShard(0, split_factor=placement.split_factor)
    if isinstance(placement, Shard) and placement.dim == dim:
        return Shard(0)
    return Replicate()


def holds_a_box(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s local shard is one box of its global value (consecutive indices along every dim): what
    ``torch.distributed.checkpoint`` reads correctly; a ``_StridedShard`` over ``tp`` (packed experts) is not."""
    return all(bool((indices.diff() == 1).all()) for indices in local_indices(tensor))


def blocks(held: Sequence[torch.Tensor], index: Index) -> Iterator[tuple[Index, tuple[slice, ...]]]:
    """Where a shard (``held``: :func:`local_indices`) meets ``full[index]``, as boxes: pairs of where in the shard
    and where in the stored tensor ``full[index]`` (which lacks each dim that ``index`` gives an int)."""
    per_dim: list[list[tuple[int | slice, slice | None]]] = []
    for positions, part in zip(held, index):
        if isinstance(part, int):
            per_dim.append([(p, None) for p in (positions == part).nonzero().flatten().tolist()])
        else:
            inside = ((positions >= part.start) & (positions < part.stop)).nonzero().flatten()
            per_dim.append(list(_runs(inside, positions[inside] - part.start)))
    for combination in itertools.product(*per_dim):
        yield tuple(into for into, _ in combination), tuple(out for _, out in combination if out is not None)


def _runs(local: torch.Tensor, stored: torch.Tensor) -> Iterator[tuple[slice, slice]]:
    """The maximal runs along which both ``local`` and ``stored`` positions go up by one, as pairs of slices."""
    cuts = (((local.diff() != 1) | (stored.diff() != 1)).nonzero().flatten() + 1).tolist()
    for start, stop in zip([0, *cuts], [*cuts, len(local)]):
        if stop > start:
            first, first_stored = int(local[start]), int(stored[start])
            yield slice(first, first + stop - start), slice(first_stored, first_stored + stop - start)


def stored_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """The file holding each tensor of the ``*.safetensors`` files in ``directory`` (their headers only)."""
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as stored:
            files.update(dict.fromkeys(stored.keys(), path))
    return files


def read_pieces(tensor: torch.Tensor, pieces: Sequence[Piece], files: Mapping[str, Path]) -> None:
    """Copy into ``tensor``'s local shard (a DTensor's ``to_local()``, a plain tensor whole) what it holds of each
    piece, cast to its dtype, exactly: only those blocks are read (``get_slice``); each file is opened for this tensor
    alone, so no more of its mapped pages stay resident than this tensor's blocks touch."""
    from safetensors import safe_open

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    held = local_indices(tensor)
    for path in sorted({files[p.name] for p in pieces}):
        with safe_open(str(path), framework="pt") as stored, torch.no_grad():
            for piece in (p for p in pieces if files[p.name] == path):
                source = stored.get_slice(piece.name)
                for into, out_of in blocks(held, piece.index):
                    local[into].copy_(source[out_of])


def gather_piece(tensor: torch.Tensor, piece: Piece, group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """``full[piece.index]``, on the first rank of ``group`` (the ranks holding ``tensor``; ``None``: the world) at
    least (``None`` elsewhere). A whole DTensor is gathered by ``full_tensor`` (a collective, every rank gets it); any
    other piece of a DTensor by ``gather_object`` of the blocks that each rank holds of it (one copy of each block: a
    rank sends only where it is the first along every dim that replicates), assembled on that rank alone. A
    collective on every rank of ``group`` for a DTensor; none for a plain tensor."""
    everything = piece.index == whole(piece.name, tensor.shape).index
    if not isinstance(tensor, DTensor):
        return tensor if everything else tensor[piece.index].clone()  # a piece of its own, not a view
    if everything:
        return tensor.full_tensor()
    held = local_indices(tensor)
    local = tensor.to_local()
    mine = [(out, _copy_to_cpu(local[into])) for into, out in blocks(held, piece.index)] if _first_copy(tensor) else []
    first = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(mine, gathered, group=group, group_dst=0)
    if gathered is None:
        return None
    value = torch.empty(piece.shape(), dtype=tensor.dtype)
    for out, block in itertools.chain.from_iterable(gathered):
        value[out] = block
    return value


def _copy_to_cpu(block: torch.Tensor) -> torch.Tensor:
    """``block`` in a CPU tensor of its own (pickling a view would send its whole storage)."""
    return torch.empty(block.shape, dtype=block.dtype).copy_(block)


def _first_copy(tensor: DTensor) -> bool:
    """Whether this rank's shard is the first copy of its blocks: coordinate 0 on every mesh dim that does not split."""
    coordinate = tensor.device_mesh.get_coordinate()
    splits = [isinstance(p, (Shard, _compat.StridedShard)) for p in tensor.placements]
    return coordinate is not None and all(c == 0 for c, split in zip(coordinate, splits) if not split)
