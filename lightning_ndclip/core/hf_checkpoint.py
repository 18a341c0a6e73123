"""A parallelized Hugging Face ``transformers`` model written back as a Hugging Face checkpoint.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["save_hf_checkpoint"]

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
