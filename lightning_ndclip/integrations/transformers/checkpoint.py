"""Hugging Face checkpoints in and out of a ``transformers`` model parallelized on any mesh.

:func:`load_hf_checkpoint` fills a model built on the meta device and parallelized (FSDP2, tensor
parallel, expert parallel, any of them together) from a Hugging Face checkpoint: each rank reads only the
slices of the safetensors files that its own shards hold, so no rank ever holds the whole model. Tensors
stored as the model holds them are read through PyTorch's distributed checkpoint and its
``HuggingFaceStorageReader``; those that ``transformers`` assembles from several stored tensors (the MoE
families' per-expert tensors, packed into ``experts.gate_up_proj`` / ``experts.down_proj``), and shards
that are no box of the global tensor (the packed experts' gate and up slices under ``tp``), block by block
(``_hf_checkpoint_pieces``). The buffers a checkpoint does not store (the rotary ``inv_freq``, Gemma's
``embed_scale``) are recomputed by the model's own initialization.

:func:`save_hf_checkpoint` writes what ``save_pretrained`` writes and ``from_pretrained`` reads
(``config.json``, sharded ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``,
under the names and in the layout of the model type's conversion mapping: one tensor per expert where
``transformers`` packs them) from a model sharded on any mesh, one stored tensor at a time: each is
gathered (``DTensor.full_tensor``, or, for one expert's tensor, the blocks the ranks hold of it, sent to
one rank), the writer adds it to the shard it is filling and writes the shard once it reaches
``max_shard_bytes``. No rank holds more than one stored tensor and one shard: the whole model is never
gathered anywhere, nor is a packed experts weight that is stored one tensor per expert. Pipeline stages
(copies of the model holding some of its units) are written by the ranks holding them, each stage's
first rank writing its files, and rank 0 the index.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ndclip import _compat
from lightning_ndclip.core.agree import run_agreed, some
from lightning_ndclip.core.parallel.plan import own_class_name
from lightning_ndclip.core.parallel.tensor_parallel import to_empty_keeping_ties
from lightning_ndclip.integrations.transformers._checkpoint_pieces import (
    Conversions,
    Piece,
    assemble,
    gather_piece,
    holds_a_box,
    hub_pieces,
    read_pieces,
    stored_files,
    whole,
)

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]

_INDEX = "model.safetensors.index.json"


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_hf_checkpoint(
    model: Any | Sequence[Any], directory: str | os.PathLike[str], *, max_shard_bytes: int = 2**30
) -> Path:
    """Write ``model`` (a ``transformers`` ``PreTrainedModel``, parallelized or not, or this rank's pipeline
    stages of one: a sequence of stage copies of the model, each holding some of its units) to ``directory`` as a
    Hugging Face checkpoint that ``from_pretrained`` loads on one process, bit for bit. Call it on every rank,
    each with its own model or stages (a collective per sharded stored tensor among the ranks holding it).

    * The names and layout are ``save_pretrained``'s for a model of this type (``transformers``' conversion
      mapping, reversed): a packed experts weight that ``transformers`` assembles from per-expert tensors
      (``MergeModulelist``, ``Concatenate``) is written as those tensors (Mixtral's
      ``block_sparse_moe.experts.<e>.w1.weight``, Qwen-MoE's ``mlp.experts.<e>.gate_proj.weight``, ...), each
      gathered from the blocks the ranks hold of it; a model tensor that a conversion this function does not
      reverse assembles is written as the model holds it, which ``from_pretrained`` reads as is.
    * A tied weight (one tensor under several names) is written once, under its first name, as
      ``save_pretrained`` writes it; ``from_pretrained`` ties it again. So is a weight a stage declares tied
      (``all_tied_weights_keys``) to one another stage holds (a last stage's ``lm_head`` tied to the embedding).
    * Pipeline stages: the ranks holding the same tensors (one stage's, or the same stages') write them, the
      lowest of them writing their files; rank 0 names every file and writes the index. Without stages every
      rank holds every tensor and rank 0 writes all of them.

    Returns:
        ``directory``, as a ``Path``.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    models: list[Any] = list(model) if isinstance(model, (nn.ModuleList, list, tuple)) else [model]
    holders = _Holders.of(models)
    if holders.writer:
        out.mkdir(parents=True, exist_ok=True)
    if _is_rank_zero():
        models[0].config.save_pretrained(out)
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size, total
        total += size
        if holders.writer and shard:
            part = f"part-{holders.rank:05d}-{len(files):05d}.safetensors"
            save_file(shard, str(out / part), metadata={"format": "pt"})
            files.append(list(shard))
        shard, size = {}, 0

    seen: set[int] = set()
    for stage in models:
        conversions = Conversions(stage)
        for name, tensor in stage.state_dict(keep_vars=True).items():
            if id(tensor) in seen or not holders.writes(name, stage):
                continue
            seen.add(id(tensor))
            for piece in hub_pieces(conversions, name, tensor.shape):
                value = gather_piece(tensor.detach(), piece, holders.group)
                if holders.writer and value is not None:
                    shard[piece.name] = value.cpu().contiguous()
                    size += value.numel() * value.element_size()
                if size >= max_shard_bytes:
                    flush()
    flush()
    written = holders.gather((holders.rank, files, total) if holders.writer else None)
    if _is_rank_zero():
        _name_shards(out, [w for w in written if w is not None])
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank returns once the checkpoint is complete
    return out


@dataclass(frozen=True)
class _Holders:
    """The ranks holding the same tensors as this one (all of them, unless the model is cut into pipeline
    stages): their process group (``None``: the world), whether this rank writes their files (the lowest of
    them), and the names of the tensors some other holders write (an earlier group holding them too, or the
    source of a declared tie that this rank's stages hold a copy of)."""

    rank: int
    group: dist.ProcessGroup | None
    writer: bool
    held_by_earlier: frozenset[str]
    held_elsewhere: frozenset[str]

    @staticmethod
    def of(models: Sequence[Any]) -> _Holders:
        names = sorted({n for m in models for n in m.state_dict(keep_vars=True)})
        if not (dist.is_available() and dist.is_initialized()):
            return _Holders(0, None, True, frozenset(), frozenset())
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, names)  # ranks holding the same names hold the same stages
        rank, groups = dist.get_rank(), dict[tuple[str, ...], list[int]]()
        for r, held in enumerate(everyone):
            groups.setdefault(tuple(held), []).append(r)
        mine = groups[tuple(names)]
        group = None
        if len(groups) > 1:
            for ranks in groups.values():  # every rank creates every group, in the same order
                created = dist.new_group(ranks)
                group = created if ranks is mine and isinstance(created, dist.ProcessGroup) else group
        earlier = {n for held, ranks in groups.items() if ranks[0] < mine[0] for n in held}
        elsewhere = set().union(*everyone) - set(names)
        return _Holders(rank, group, rank == mine[0], frozenset(earlier), frozenset(elsewhere))

    def writes(self, name: str, model: Any) -> bool:
        """Whether these holders write the tensor ``name`` of ``model``."""
        tied_to = (getattr(model, "all_tied_weights_keys", None) or {}).get(name)
        return name not in self.held_by_earlier and tied_to not in self.held_elsewhere

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, on rank 0 (``[value]`` on one process; ``[]`` elsewhere)."""
        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered or []


def _name_shards(out: Path, written: list[tuple[int, list[list[str]], int]]) -> None:
    """Rename the writers' shards (``written``: each writer's rank, the names in each of its parts, its bytes)
    ``model-0000k-of-0000n.safetensors`` and write the index ``from_pretrained`` reads."""
    parts = [(rank, k, names) for rank, files, _ in written for k, names in enumerate(files)]
    weight_map: dict[str, Any] = {}
    for k, (rank, part, names) in enumerate(parts):
        final = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(out / f"part-{rank:05d}-{part:05d}.safetensors", out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": sum(nbytes for *_, nbytes in written)}, "weight_map": weight_map}
    (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def load_hf_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    strict: bool = True,
    held_elsewhere: Collection[str] = (),
) -> None:
    """Load the Hugging Face checkpoint in ``directory`` (``*.safetensors``, one file or sharded) into
    ``model``, a ``transformers`` model (or a module holding one under the same names) that may be
    parallelized on any mesh and built on the meta device. Call it on every rank, after parallelizing.

    * A model still on the meta device is first given storage on ``device`` (default: the current
      accelerator, else the CPU) with ``to_empty``.
    * Every parameter and persistent buffer is read from the files; a sharded one (a ``DTensor``) reads
      only the slices its local shard holds. A tied weight (one tensor under several names) is read
      once, under whichever of its names the checkpoint stores. Values are cast to the model's dtypes.
    * Names are read as ``from_pretrained`` reads them, through ``transformers``' conversion mapping for the
      model's type: its renamings (GPT-NeoX's ``embed_out``, Mixtral's ``block_sparse_moe``), and the
      converters that stack per-expert tensors and concatenate them (``MergeModulelist``, ``Concatenate``)
      into the packed experts weights (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``):
      each rank reads, of each expert's tensors, only the blocks its shard holds (under ``ep`` its own
      experts, under ``tp`` its rows of the gate and of the up projection), never a whole packed weight.
    * The buffers a checkpoint does not store (``persistent=False``) are recomputed by the model's own
      ``_init_weights``; one that it leaves unset is an error naming it, never uninitialized memory.
    * A pipeline stage (a copy of the model holding some of its units) names the units other stages hold in
      ``held_elsewhere`` (module names): their tensors are skipped, not refused; a weight of the stage that the
      model declares tied to one stored under another unit (a last stage's ``lm_head`` tied to the first
      stage's embedding) is read from that tensor.

    Raises:
        ValueError: before anything is read, on every rank (one exchange: where another rank met the
            problem, e.g. of another pipeline stage, an :class:`~lightning_ndclip.core.agree.AgreedError`
            naming it), naming the tensors: with ``strict``, a weight of the model the checkpoint
            lacks or a tensor of the checkpoint the model lacks (an expert's tensor among them); a shape
            that differs; a tie the model declares (``all_tied_weights_keys``) but holds as two
            parameters; tensors that ``transformers`` converts otherwise than by stacking and
            concatenating (splits, transposes, interleaves), naming them and the model type (all before
            anything is allocated); a buffer the checkpoint lacks that the model's initialization leaves unset.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata

    def prepare() -> tuple[dict[str, str], dict[str, list[Piece]]]:
        to_read, pieces = _names_to_read(model, metadata, strict, tuple(held_elsewhere))
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            to_empty_keeping_ties(model, device)
        _recompute_unsaved_buffers(model)
        return to_read, pieces

    single = not (dist.is_available() and dist.is_initialized())
    # pipeline stages check different tensors: one stage's problem raises on every rank before dcp's collective read
    to_read, pieces = prepare() if single else run_agreed("load_hf_checkpoint", prepare)
    state = model.state_dict()
    for stored, name in list(to_read.items()):  # a shard that is no box: read block by block, not by dcp
        if isinstance(state[name], DTensor) and not holds_a_box(state[name]):
            pieces[name] = [whole(to_read.pop(stored), state[name].shape)]
    with warnings.catch_warnings():  # dcp's note that one process reads alone: what single means
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({stored: state[name] for stored, name in to_read.items()}, storage_reader=reader, no_dist=single)
    files = stored_files(directory) if pieces else {}
    for name, tensor_pieces in pieces.items():
        read_pieces(state[name], tensor_pieces, files)


def _names_to_read(
    model: nn.Module, stored: dict[str, Any], strict: bool, held_elsewhere: tuple[str, ...] = ()
) -> tuple[dict[str, str], dict[str, list[Piece]]]:
    """``{checkpoint name: model name}`` for each parameter and persistent buffer of ``model`` stored as the
    model holds it (one name of a tied tensor, or the tensor it is declared tied to), and ``{model name: pieces}``
    for each one ``transformers`` assembles from several stored tensors; checked against the checkpoint's names
    and shapes before anything is read. Tensors of the modules ``held_elsewhere`` are left out."""
    state = model.state_dict(keep_vars=True)
    conversions = Conversions(model)
    elsewhere = tuple(f"{unit}." for unit in held_elsewhere)
    from_stored = {key: conversions.rename(key) for key in stored}
    declared_ties = getattr(model, "all_tied_weights_keys", None) or {}
    held_here = {name: key for key, name in from_stored.items()}
    from_stored = {key: name for key, name in from_stored.items() if not name.startswith(elsewhere)}
    converted = {key for key, name in from_stored.items() if conversions.converted(name) is not None}
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    assembly = assemble(conversions, shapes, {key: tuple(stored[key].size) for key in converted})
    to_stored = {name: key for key, name in from_stored.items() if key not in converted}
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    to_read: dict[str, str] = {}
    missing: list[str] = []
    for names in aliases.values():
        found = next((name for name in names if name in to_stored), None)
        source = next((declared_ties[name] for name in names if declared_ties.get(name) in held_here), None)
        if found is not None:
            to_read[to_stored[found]] = found
        elif source is not None and source.startswith(elsewhere):  # tied to a tensor another stage holds
            to_read[held_here[source]] = names[0]
        elif not any(name in assembly.targets for name in names):
            missing.append(" = ".join(names))
    missing += assembly.missing
    unexpected = sorted(key for key, name in from_stored.items() if key not in converted and name not in state)
    unexpected += assembly.unexpected
    wrong = [
        f"{key}: checkpoint {tuple(stored[key].size)}, model {tuple(state[name].shape)}"
        for key, name in to_read.items()
        if tuple(stored[key].size) != tuple(state[name].shape)
    ]
    wrong += assembly.misshapen
    problems = [f"shapes differ: {some(wrong)}"] if wrong else []
    untied = [
        f"{target} = {source}"
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items()
        if target in state and source in state and state[target] is not state[source]
    ]
    if untied:
        problems.append(
            f"the model declares {some(untied)} tied and holds them as two parameters (transformers releases that "
            "skip tie_weights for a model built on the meta device): call model.tie_weights() before parallelizing"
        )
    if assembly.unreadable:
        problems.append(
            f"transformers converts {'; '.join(assembly.unreadable)} when loading, which cannot be read into shards "
            "(only stacked and concatenated tensors can: MergeModulelist, Concatenate): save it once in the model's "
            "own layout (from_pretrained on one process, then safetensors.torch.save_file(model.state_dict(), ...)), "
            "or load it with from_pretrained on every rank"
        )
    if strict and missing:
        problems.append(f"missing from the checkpoint: {some(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint, not in {own_class_name(model)}: {some(unexpected)}")
    if problems:
        raise ValueError(f"load_hf_checkpoint: the checkpoint does not fit {own_class_name(model)}: " + "; ".join(problems))
    return to_read, assembly.pieces


def _recompute_unsaved_buffers(model: nn.Module) -> None:
    """Set every ``persistent=False`` buffer as the model's own ``_init_weights`` computes it (from its
    config), run on a stand-in of the buffer's module whose parameters are meta tensors, so that the
    model's weights (sharded or not) are never written. Floating buffers are NaN first: one still NaN
    after is a buffer the model does not recompute, and an error."""
    try:
        from transformers import PreTrainedModel

        models: tuple[type, ...] = (PreTrainedModel,)
    except ModuleNotFoundError:  # no transformers model to recompute them: each is checked below
        models = ()
    saved = {id(tensor) for tensor in model.state_dict(keep_vars=True).values()}
    unset: list[str] = []
    owners: dict[str, Any] = {}
    for name, module in model.named_modules():
        parent = owners.get(name.rpartition(".")[0]) if name else None
        owners[name] = module if isinstance(module, models) else parent
        prefix = f"{name}." if name else ""
        unsaved = {f"{prefix}{b}": buffer for b, buffer in module.named_buffers(recurse=False) if id(buffer) not in saved}
        if not unsaved:
            continue
        with torch.no_grad():
            for buffer in unsaved.values():
                if buffer.is_floating_point():
                    buffer.fill_(float("nan"))
        if owners[name] is not None:
            _compat.initialize_buffers(owners[name], module)
        unset += [b for b, buffer in unsaved.items() if buffer.is_floating_point() and bool(buffer.isnan().any())]
    if unset:
        raise ValueError(
            f"load_hf_checkpoint: the checkpoint does not store the buffers {unset[:5]} and the model's _init_weights "
            "does not recompute them: build the model off the meta device, or set them after loading"
        )
