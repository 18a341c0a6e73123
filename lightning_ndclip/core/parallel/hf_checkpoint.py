"""Hugging Face checkpoints in and out of a ``transformers`` model parallelized on any mesh.

:func:`load_hf_checkpoint` fills a model built on the meta device and parallelized (FSDP2, tensor
parallel, both) from a Hugging Face checkpoint: each rank reads, through PyTorch's distributed
checkpoint and its ``HuggingFaceStorageReader``, only the slices of the safetensors files that its
own shards hold, so no rank ever holds the whole model. The buffers a checkpoint does not store (the
rotary ``inv_freq``, Gemma's ``embed_scale``) are recomputed by the model's own initialization.

:func:`save_hf_checkpoint` writes what ``from_pretrained`` reads (``config.json``, sharded
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``) from a model sharded
on any mesh (FSDP2, tensor parallel, both), one tensor at a time: each is gathered whole
(``DTensor.full_tensor``, a collective on every rank), rank 0 adds it to the shard it is filling
and writes the shard once it reaches ``max_shard_bytes``. No rank holds more than one tensor and
one shard; the whole model is never gathered anywhere.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.tensor_parallel import tied_parameters

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]

_INDEX = "model.safetensors.index.json"


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_hf_checkpoint(model: Any, directory: str | os.PathLike[str], *, max_shard_bytes: int = 2**30) -> Path:
    """Write ``model`` (a ``transformers`` ``PreTrainedModel``, parallelized or not) to ``directory`` as a
    Hugging Face checkpoint that ``from_pretrained`` loads on one process. Call it on every rank (a
    collective per sharded tensor); rank 0 writes. A tied weight (one tensor under several names) is
    written once, under its first name, as ``save_pretrained`` does; ``from_pretrained`` ties it again.

    Returns:
        ``directory``, as a ``Path``.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    writer = _is_rank_zero()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
    seen: set[int] = set()
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        nonlocal shard, size, total
        total += size
        if writer and shard:
            save_file(shard, str(out / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append(list(shard))
        shard, size = {}, 0

    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        value = tensor.detach()
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if writer:
            shard[name] = value.cpu().contiguous()
            size += value.numel() * value.element_size()
        if size >= max_shard_bytes:
            flush()
    flush()
    if writer:
        _name_shards(out, files, total)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank returns once the checkpoint is complete
    return out


def _name_shards(out: Path, files: list[list[str]], nbytes: int) -> None:
    """Rename the shards ``model-0000k-of-0000n.safetensors`` and write the index ``from_pretrained`` reads."""
    weight_map: dict[str, Any] = {}
    for k, names in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(out / f"part-{k:05d}.safetensors", out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (out / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def load_hf_checkpoint(
    model: nn.Module, directory: str | os.PathLike[str], *, device: torch.device | str | None = None, strict: bool = True
) -> None:
    """Load the Hugging Face checkpoint in ``directory`` (``*.safetensors``, one file or sharded) into
    ``model``, a ``transformers`` model (or a module holding one under the same names) that may be
    parallelized on any mesh and built on the meta device. Call it on every rank, after parallelizing.

    * A model still on the meta device is first given storage on ``device`` (default: the current
      accelerator, else the CPU) with ``to_empty``.
    * Every parameter and persistent buffer is read from the files; a sharded one (a ``DTensor``) reads
      only the slices its local shard holds. A tied weight (one tensor under several names) is read
      once, under whichever of its names the checkpoint stores. Values are cast to the model's dtypes.
    * The buffers a checkpoint does not store (``persistent=False``) are recomputed by the model's own
      ``_init_weights``; one that it leaves unset is an error naming it, never uninitialized memory.

    Raises:
        ValueError: before anything is allocated, the same on every rank (every rank reads the same
            file headers), naming the tensors: with ``strict``, a weight of the model the checkpoint
            lacks or a tensor of the checkpoint the model lacks; a shape that differs; a tie the model
            declares (``all_tied_weights_keys``) but holds as two parameters; tensors that
            ``transformers`` converts on load (merged or split, as MoE experts' per-expert files).
            After loading, a buffer the checkpoint lacks that the model's initialization leaves unset.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    to_read = _names_to_read(model, reader.read_metadata().state_dict_metadata, strict)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        _to_empty_keeping_ties(model, torch.device(device) if device is not None else _default_device())
    _recompute_unsaved_buffers(model)
    state = model.state_dict()
    single = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # dcp's note that one process reads alone: what single means
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({stored: state[name] for stored, name in to_read.items()}, storage_reader=reader, no_dist=single)


def _default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator.type, torch.accelerator.current_device_index()) if accelerator else torch.device("cpu")


def _to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)``, which makes a new parameter of each name of a plain tied
    tensor moved off the meta device, with every tie (:func:`tied_parameters`) made one again."""
    ties = tied_parameters(model)
    model.to_empty(device=device)
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            path, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(path), attribute, first)


def _renamed(model: nn.Module) -> Callable[[str], str | None]:
    """The checkpoint name -> model name map that ``from_pretrained`` applies (``transformers``' own
    renamings, e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``), or ``None`` for a stored tensor that
    ``transformers`` converts (merges, splits) rather than renames."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    except (ImportError, AttributeError, TypeError):  # not a transformers model, or a release without these
        return lambda key: key
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(key: str) -> str | None:
        for renaming in renamings:
            key = renaming.rename_source_key(key)[0]
        return None if any(c.rename_source_key(key)[1] is not None for c in converters) else key

    return rename


def _names_to_read(model: nn.Module, stored: dict[str, Any], strict: bool) -> dict[str, str]:
    """``{checkpoint name: model name}`` for each parameter and persistent buffer of ``model`` (one name
    of a tied tensor), checked against the checkpoint's names and shapes before anything is read."""
    state = model.state_dict(keep_vars=True)
    rename = _renamed(model)
    from_stored = {key: rename(key) for key in stored}
    converted = sorted(key for key, name in from_stored.items() if name is None)
    to_stored = {name: key for key, name in from_stored.items() if name is not None}
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    to_read: dict[str, str] = {}
    missing: list[str] = []
    for names in aliases.values():
        found = next((name for name in names if name in to_stored), None)
        if found is None:
            missing.append(" = ".join(names))
        else:
            to_read[to_stored[found]] = found
    unexpected = sorted(key for key, name in from_stored.items() if name is not None and name not in state)
    wrong = [
        f"{key}: checkpoint {tuple(stored[key].size)}, model {tuple(state[name].shape)}"
        for key, name in to_read.items()
        if tuple(stored[key].size) != tuple(state[name].shape)
    ]

    def some(names: list[str]) -> str:
        return f"{names[:5]}" + (f" (+{len(names) - 5})" if len(names) > 5 else "")

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
    if converted:
        problems.append(
            f"transformers converts {some(converted)} when loading (merged or split, not renamed), which cannot be "
            "read into shards: save it once in the model's own layout (from_pretrained on one process, then "
            "safetensors.torch.save_file(model.state_dict(), ...)), or load it with from_pretrained on every rank"
        )
    if strict and missing:
        problems.append(f"missing from the checkpoint: {some(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint, not in {type(model).__name__}: {some(unexpected)}")
    if problems:
        raise ValueError(f"load_hf_checkpoint: the checkpoint does not fit {type(model).__name__}: " + "; ".join(problems))
    return to_read


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
