"""``diffusers`` checkpoints (the directories ``from_pretrained`` reads) in and out of a model parallelized on any mesh.

:func:`load_diffusers_checkpoint` fills a model built on the meta device and parallelized (FSDP2, cp) from a
``save_pretrained`` directory (``config.json``, ``diffusion_pytorch_model.safetensors`` or its shards and their
index): each rank reads only the slices of the files its own shards hold (PyTorch's distributed checkpoint and its
``HuggingFaceStorageReader``), so no rank holds the whole model. diffusers stores each tensor under the name and
in the layout the model holds it. The buffers a checkpoint does not store (Wan's rotary tables) are computed by the
model's own constructor, run with its parameters on the meta device.

:func:`save_diffusers_checkpoint` writes what ``save_pretrained`` writes from a model sharded on any mesh, one
tensor at a time (each gathered whole, written by rank 0 into the shard it is filling).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ndclip.core.agree import run_agreed, some
from lightning_ndclip.core.parallel.plan import own_class_name
from lightning_ndclip.core.parallel.tensor_parallel import to_empty_keeping_ties

__all__ = ["load_diffusers_checkpoint", "save_diffusers_checkpoint"]

WEIGHTS = "diffusion_pytorch_model"
_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")  # parts the wrappers add to module names, not to state_dict's


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def load_diffusers_checkpoint(
    model: nn.Module, directory: str | os.PathLike[str], *, device: torch.device | str | None = None, strict: bool = True
) -> None:
    """Load the ``save_pretrained`` directory ``directory`` into ``model``, a ``diffusers`` model that may be
    parallelized on any mesh and built on the meta device. Call it on every rank, after parallelizing.

    * A model still on the meta device is first given storage on ``device`` (default: the current accelerator,
      else the CPU) with ``to_empty``;
      its buffers the checkpoint does not store are then set as its class's constructor computes them from its
      config (run with every parameter on the meta device: no weight is allocated).
    * Every parameter and stored buffer is read from the files; a sharded one (a ``DTensor``) reads only the slices
      its local shard holds. Values are cast to the model's dtypes.

    Raises:
        ValueError: before anything is read, on every rank, naming the tensors: with ``strict``, a tensor of the
            model the checkpoint lacks or one of the checkpoint the model lacks; a shape that differs.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    stored: dict[str, Any] = dict(reader.read_metadata().state_dict_metadata)

    name = own_class_name(model)

    def prepare() -> list[str]:
        state = model.state_dict(keep_vars=True)
        missing = [n for n in state if n not in stored]
        unexpected = [k for k in stored if k not in state]
        wrong = [f"{n}: checkpoint {tuple(stored[n].size)}, model {tuple(t.shape)}" for n, t in state.items()
                 if n in stored and tuple(stored[n].size) != tuple(t.shape)]  # fmt: skip
        problems = [f"shapes differ: {some(wrong)}"] if wrong else []
        if strict and missing:
            problems.append(f"missing from the checkpoint: {some(missing)}")
        if strict and unexpected:
            problems.append(f"in the checkpoint, not in {name}: {some(unexpected)}")
        if problems:
            raise ValueError(f"load_diffusers_checkpoint: {directory} does not fit {name}: " + "; ".join(problems))
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            _to_empty_with_unsaved_buffers(model, device, set(state))
        return [n for n in state if n in stored]

    single = not _distributed()
    names = prepare() if single else run_agreed("load_diffusers_checkpoint", prepare)
    state = model.state_dict()
    with warnings.catch_warnings():  # dcp's note that one process reads alone: what single means
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({name: state[name] for name in names}, storage_reader=reader, no_dist=single)


def _to_empty_with_unsaved_buffers(model: nn.Module, device: torch.device | str | None, saved: set[str]) -> None:
    """``model.to_empty(device=device)`` keeping its ties, then each buffer ``saved`` does not name set as the model's
    constructor computes it."""
    to_empty_keeping_ties(model, device)
    unsaved = {_plain(n): b for n, b in model.named_buffers() if _plain(n) not in saved}
    if not unsaved:
        return
    with _parameters_on_meta():
        fresh = dict(type(model).from_config(model.config).named_buffers())  # type: ignore[attr-defined]
    with torch.no_grad():
        for name, buffer in unsaved.items():
            buffer.copy_(fresh[name])


def _plain(name: str) -> str:
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers is put on the meta device (its buffers stay where they are made):
    a model built inside holds its computed buffers and no weight."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    setattr(nn.Module, "register_parameter", on_meta)  # noqa: B010 - a method, put back below
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def save_diffusers_checkpoint(model: Any, directory: str | os.PathLike[str], *, max_shard_bytes: int = 2**30) -> Path:
    """Write ``model`` (a ``diffusers`` model, parallelized or not) to ``directory`` as ``save_pretrained`` does, for
    ``from_pretrained`` to load on one process: ``config.json``, then ``diffusion_pytorch_model.safetensors``, or, past
    ``max_shard_bytes``, ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` and their index. Call it on every
    rank (a gather per sharded tensor); rank 0 writes. No rank holds more than one whole tensor and one shard.

    Returns:
        ``directory``, as a ``Path``.
    """
    from safetensors.torch import save_file

    out, writer = Path(directory), not _distributed() or dist.get_rank() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        model.save_config(out)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "_class_name": own_class_name(model)}, indent=2, sort_keys=True))
    parts: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, str(out / f"part-{len(parts):05d}.safetensors"), metadata={"format": "pt"})
            parts.append(list(shard))
        shard, size = {}, 0

    for name, tensor in model.state_dict().items():
        value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not writer:
            continue
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = value.detach().cpu().contiguous()
        size, total = size + nbytes, total + nbytes
    if writer:
        flush()
        files = [f"{WEIGHTS}.safetensors"] if len(parts) == 1 else [
            f"{WEIGHTS}-{k:05d}-of-{len(parts):05d}.safetensors" for k in range(1, len(parts) + 1)]  # fmt: skip
        for k, file in enumerate(files):
            (out / f"part-{k:05d}.safetensors").replace(out / file)
        if len(files) > 1:
            weight_map = {name: file for file, names in zip(files, parts) for name in names}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / f"{WEIGHTS}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if _distributed():
        dist.barrier()
    return out
