"""What was parallelized how: a compact table of the mesh and of each top-level module.

:func:`summarize` reads the parallelized model itself (its ``DTensor`` placements and FSDP2 units),
not the plan that made it, so it describes a ``configure_model`` of the user's as faithfully as
the strategy's declarative plan. Per row:

* **Params**: logical parameter elements (a sharded tensor counts its global shape once);
* **FSDP**: the FSDP2 units holding the row's parameters, counted inside the row; ``root`` when
  they belong to a unit of an enclosing module;
* **Sharded over** / **Replicated over**: the data and expert mesh dims (with sizes) that split the
  row's parameters or hold full copies of them; a data dim missing from a parameter's mesh is a
  replicated one (``dp_replicate`` for HSDP, every data dim for a plain tensor);
* **Tensor parallel**: parameters by tensor-parallel style, read off their ``tp`` placement:
  ``colwise`` (``Shard(0)``, as ``ColwiseParallel`` shards), ``rowwise`` (``Shard(1)``),
  ``replicated`` (every tp rank holds it whole: ``Replicate``, or no ``tp`` dim in its mesh);
* **Stage**: the pipeline stage (``pp > 1``);
* **Bytes/rank**: parameter bytes held by the first rank of the row's stage.

A note line counts the experts modules sharded over ``ep`` (holding parameters with an ``ep`` mesh dim) and
the whole experts each ``ep`` rank holds of them.

Nothing here changes the model. With ``pp > 1`` the rows of every stage are gathered over ``pp``
(one ``all_gather_object``, collective on every rank); otherwise nothing communicates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from lightning_ndclip._compat import StridedShard, dtensor_spec
from lightning_ndclip.core.parallel.mesh import MESH_DIM_NAMES, ParallelDims, ParallelMeshes
from lightning_ndclip.core.parallel.plan import own_class_name

__all__ = ["ModuleRow", "ParallelSummary", "summarize"]

_DATA_DIMS = ("dp_replicate", "dp_shard", "cp")
_VIEW_DIMS = {  # which world data dims a mesh dim of this name spans
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "cp": ("cp",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "edp": ("dp_shard", "cp"),  # edp x ep spans dp_shard x cp
    "ep": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class ModuleRow:
    """One top-level module (or one pipeline stage's part of it).

    Attributes:
        name: the module's name in the LightningModule (or the model given to :func:`summarize`).
        kind: its class name.
        params: logical parameter elements.
        fsdp: FSDP2 units holding its parameters (``"2"``, ``"root"``, ``"1 + root"``, or ``"-"``).
        sharded_over: mesh dims splitting its parameters, ``"dp_shard_cp=4"``.
        replicated_over: data dims holding full copies, ``"dp_replicate=2"``.
        tensor_parallel: parameter tensors by tp style, ``"colwise 2, rowwise 1, replicated 3"``.
        stage: its pipeline stage, or ``None`` without pipeline parallelism.
        bytes_per_rank: parameter bytes on the first rank of its stage.
    """

    name: str
    kind: str
    params: int
    fsdp: str
    sharded_over: str
    replicated_over: str
    tensor_parallel: str
    stage: int | None
    bytes_per_rank: int


@dataclass
class ParallelSummary:
    """The mesh, one :class:`ModuleRow` per top-level module, and free lines (the strategy adds
    the data side); ``str()`` renders the table."""

    mesh: str
    rows: list[ModuleRow]
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        columns = ["Name", "Type", "Params", "FSDP", "Sharded over", "Replicated over", "Tensor parallel"]
        cells = [
            [r.name, r.kind, _count(r.params), r.fsdp, r.sharded_over, r.replicated_over, r.tensor_parallel]
            for r in self.rows
        ]
        if any(r.stage is not None for r in self.rows):
            columns.append("Stage")
            for row, r in zip(cells, self.rows):
                row.append(str(r.stage))
        columns.append("Bytes/rank")
        for row, r in zip(cells, self.rows):
            row.append(_bytes(r.bytes_per_rank))
        keep = [i for i, c in enumerate(columns) if i < 3 or any(row[i] != "-" for row in cells)]
        table = [[columns[i] for i in keep]] + [[row[i] for i in keep] for row in cells]
        widths = [max(len(line[i]) for line in table) for i in range(len(keep))]
        lines = [f"lightning_ndclip: {self.mesh}"]
        for n, line in enumerate(table):
            prefix = "   " if n == 0 else f"{n - 1:<3}"
            lines.append(prefix + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
            if n == 0:
                lines.append("-" * len(lines[-1]))
        total = sum(r.params for r in self.rows)
        lines.append(f"{_count(total)} parameters in all")
        return "\n".join(lines + self.notes)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _top_level(module: nn.Module, skip: set[str]) -> list[tuple[str, nn.Module, bool]]:
    """The rows of ``module``, ``(name, module, its own parameters only)``: its children holding
    parameters, descending through a child that is the only one (and its parent holds no parameters
    of its own), so ``self.model`` shows its parts; parameters held directly get a row of their own."""
    prefix = ""
    while True:
        children = [(n, c) for n, c in module.named_children() if f"{prefix}{n}" not in skip and _has_params(c)]
        own = any(True for _ in module.parameters(recurse=False))
        if len(children) != 1 or own or isinstance(children[0][1], (nn.ModuleList, nn.ModuleDict)):
            rows = [(f"{prefix}{n}", c, False) for n, c in children]
            return ([(prefix.rstrip(".") or "(own parameters)", module, True)] if own else []) + rows
        prefix += children[0][0] + "."
        module = children[0][1]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _unit_owners(module: nn.Module) -> dict[int, nn.Module]:
    """``{id(parameter): the innermost FSDP2 unit holding it}``."""
    owners: dict[int, nn.Module] = {}
    for unit in reversed(list(module.modules())):  # inner units before the units enclosing them
        if isinstance(unit, FSDPModule):
            for p in unit.parameters():
                owners.setdefault(id(p), unit)
    return owners


def _tp_style(placement: object | None, ndim: int, embedding: bool) -> str:
    """The tensor-parallel style a ``tp`` placement comes from: ``ColwiseParallel`` shards a linear
    weight (``[out, in]``) and bias on dim 0 and an embedding (``[vocab, dim]``) on dim 1,
    ``RowwiseParallel`` the other way round."""
    if placement is None or isinstance(placement, Replicate):
        return "replicated"
    dim = getattr(placement, "dim", None)
    if dim is None or ndim > 2:
        return str(placement)
    styles = ("rowwise", "colwise") if embedding else ("colwise", "rowwise")
    return styles[dim % ndim] if ndim == 2 else styles[0]


class _Describer:
    """Describes parameters against the world mesh's sizes."""

    def __init__(self, meshes: ParallelMeshes) -> None:
        world = meshes.world
        self.sizes = dict(zip(MESH_DIM_NAMES, world.shape))
        self.tp = self.sizes["tp"] > 1

    def parameter(self, p: torch.Tensor, embedding: bool) -> tuple[set[str], set[str], str | None]:
        """(sharded over, replicated over, tp style) of one parameter (of an ``nn.Embedding`` or not)."""
        sharded: set[str] = set()
        replicated: set[str] = set()
        covered: set[str] = set()
        tp_placement = None
        if isinstance(p, DTensor):
            spec = dtensor_spec(p)
            for name, size, placement in zip(spec.mesh.mesh_dim_names or (), spec.mesh.shape, spec.placements):
                if name == "tp":
                    tp_placement = placement
                    continue
                covered.update(_VIEW_DIMS.get(name, ()))
                if size == 1:
                    continue
                if isinstance(placement, Replicate):
                    replicated.add(f"{name}={size}")
                elif isinstance(placement, StridedShard) or getattr(placement, "dim", None) is not None:
                    sharded.add(f"{name}={size}")
                else:
                    replicated.add(f"{name}={size} ({placement})")
        replicated.update(f"{d}={self.sizes[d]}" for d in _DATA_DIMS if d not in covered and self.sizes[d] > 1)
        return sharded, replicated, (_tp_style(tp_placement, p.dim(), embedding) if self.tp else None)


def _order(dims: set[str]) -> str:
    rank = {name: i for i, name in enumerate((*MESH_DIM_NAMES, "dp", "dp_shard_cp", "dp_cp", "edp", "ep"))}
    return ", ".join(sorted(dims, key=lambda d: (rank.get(d.split("=")[0], 99), d))) or "-"


def _row(
    name: str,
    module: nn.Module,
    owners: dict[int, nn.Module],
    describe: _Describer,
    stage: int | None,
    own_only: bool = False,
) -> ModuleRow:
    holders = [module] if own_only else list(module.modules())
    inner = set() if own_only else {id(m) for m in holders if isinstance(m, FSDPModule)}
    units: set[int] = set()
    outer = False
    sharded: set[str] = set()
    replicated: set[str] = set()
    styles: Counter[str] = Counter()
    params = nbytes = 0
    seen: set[int] = set()
    for holder in holders:
        for p in holder.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += p.numel()
            local = p.to_local() if isinstance(p, DTensor) else p
            nbytes += local.numel() * local.element_size()
            owner = owners.get(id(p))
            if owner is not None and id(owner) in inner:
                units.add(id(owner))
            elif owner is not None:
                outer = True
            s, r, style = describe.parameter(p, isinstance(holder, nn.Embedding))
            sharded |= s
            replicated |= r
            if style is not None:
                styles[style] += 1
    fsdp = " + ".join(([str(len(units))] if units else []) + (["root"] if outer else [])) or "-"
    order = ("colwise", "rowwise", "replicated")
    tp = ", ".join(f"{s} {styles[s]}" for s in sorted(styles, key=lambda s: (order.index(s) if s in order else 9, s)))
    kind = own_class_name(module)
    return ModuleRow(
        name=name,
        kind=kind,
        params=params,
        fsdp=fsdp,
        sharded_over=_order(sharded),
        replicated_over=_order(replicated),
        tensor_parallel=tp or "-",
        stage=stage,
        bytes_per_rank=nbytes,
    )


def _stage_rows(
    attribute: str, stages: Mapping[int, nn.Module], owners: dict[int, nn.Module], describe: _Describer
) -> list[ModuleRow]:
    rows = []
    for index in sorted(stages):
        for child_name, child in stages[index].named_children():
            if not _has_params(child):
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                child_name += ".{" + ",".join(n for n, _ in child.named_children()) + "}"
            rows.append(_row(f"{attribute}.{child_name}", child, owners, describe, index))
    return rows


def summarize(
    module: nn.Module,
    meshes: ParallelMeshes,
    stages: Mapping[str, Mapping[int, nn.Module]] | None = None,
) -> ParallelSummary:
    """Describe how ``module``'s parameters are laid out over ``meshes`` (see the module docstring).

    Args:
        module: the parallelized model (a LightningModule, or any ``nn.Module``).
        meshes: the meshes it was parallelized over.
        stages: with ``pp > 1``: ``{attribute of module: {global stage index: this rank's stage
            module}}``; those attributes get one row per stage part, gathered from every stage
            (collective over ``meshes["pp"]``).
    """
    describe = _Describer(meshes)
    owners = _unit_owners(module)
    stages = dict(stages or {})
    rows = [_row(name, child, owners, describe, None, own) for name, child, own in _top_level(module, set(stages))]
    staged = [row for attribute, mine in stages.items() for row in _stage_rows(attribute, mine, owners, describe)]
    pp = meshes["pp"]
    if stages and pp.size() > 1:
        gathered: list[list[ModuleRow] | None] = [None] * pp.size()
        dist.all_gather_object(gathered, staged, group=pp.get_group())
        staged = sorted((row for part in gathered for row in part or ()), key=lambda r: r.stage or 0)
    sizes = dict(zip(MESH_DIM_NAMES, meshes.world.shape))
    dims = ParallelDims(meshes.world.size(), **sizes, ep=meshes["ep"].size())
    return ParallelSummary(dims.describe(), rows + staged, _experts_notes(module, meshes))


def _experts_notes(module: nn.Module, meshes: ParallelMeshes) -> list[str]:
    """``Experts: 2 modules of 8 experts; each ep rank holds 4 whole experts of each (ep=2), FSDP2-sharded over
    edp=2``, or nothing when no parameter is sharded over ``ep``."""
    modules: Counter[int] = Counter()
    for child in module.modules():
        for p in child.parameters(recurse=False):
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()):
                modules[p.shape[0]] += 1
                break
    ep, edp = meshes["ep"].size(), meshes["edp"].size()
    return [
        f"Experts: {count} module{'s' * (count > 1)} of {experts} experts; each ep rank holds {experts // ep} whole "
        f"experts of each (ep={ep}), FSDP2-sharded over edp={edp}"
        for experts, count in sorted(modules.items())
    ]
