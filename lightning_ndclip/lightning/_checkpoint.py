"""Distributed checkpoints that a fault never tears.

Lightning's ``ModelParallelStrategy`` writes a distributed checkpoint (one ``torch.distributed.checkpoint``
shard per rank, dcp's ``.metadata`` and Lightning's ``meta.pt``) into the target directory in place: a rank
killed while saving over an existing checkpoint leaves old and new shards side by side, and that directory
loads with no error. Here every rank writes into a fresh sibling directory ``<path>.tmp-<token>`` (the token
picked by rank 0 and broadcast), rank 0 writes ``meta.pt`` last, once every shard and dcp's ``.metadata`` are
written, and then swaps the new directory in: in one atomic exchange of the two paths where the file system
offers it (Linux: ext4, xfs, btrfs, tmpfs, ...), else by renaming the old one to ``<path>.old-<token>`` and the
new one to ``path``; then the old one is deleted. A crash at any point leaves at ``path`` the old complete
checkpoint or the new complete one, or (only without the exchange, between the two renames: no checkpoint at
``path``) the old one at ``<path>.old-<token>``, which :func:`checkpoint_problem` names when asked to load
``path``. Leftovers of an interrupted save are
removed by the next save to the same path that succeeds.

Loading refuses a directory that lacks ``meta.pt`` or ``.metadata``, or a shard file ``.metadata`` refers to
(or has it shorter than the data it locates there): :func:`checkpoint_problem` says what is missing.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_ndclip import _compat

__all__ = [
    "checkpoint_problem",
    "file_system_path",
    "refuse_incomplete_checkpoint",
    "save_distributed_checkpoint_atomically",
]

DCP_METADATA = ".metadata"
"""dcp's index of a distributed checkpoint: which file holds each tensor's bytes."""
SHARD_SUFFIX = ".distcp"
TMP_TAG = ".tmp-"
"""``<path>.tmp-<token>``: a save's new checkpoint until it is complete and swapped in."""
ASIDE_TAG = ".old-"
"""``<path>.old-<token>``: the checkpoint a save replaces, from the first rename of the swap until it is deleted."""


_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _sibling(path: Path, tag: str, token: str) -> Path:
    return path.with_name(f"{path.name}{tag}{token}")


def _leftovers(path: Path) -> list[Path]:
    """The ``<path>.tmp-<token>`` / ``<path>.old-<token>`` siblings that interrupted saves left, oldest first."""
    pattern = re.compile(re.escape(path.name) + r"\.(tmp|old)-[0-9a-f]{32}")
    if not path.parent.is_dir():
        return []
    found = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _is_checkpoint_file(name: str) -> bool:
    """Whether a directory entry is part of a distributed checkpoint (what a save replaces)."""
    meta = _compat.metadata_filename()
    return name.endswith(SHARD_SUFFIX) or name.startswith(DCP_METADATA) or name.startswith(meta)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (best effort: not every file system lets a directory be fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_meta(checkpoint: dict[str, Any], directory: Path) -> None:
    """Write Lightning's ``meta.pt`` under a temporary name, fsync it and rename it into place: present
    means complete."""
    final = directory / _compat.metadata_filename()
    part = final.with_name(final.name + ".part")
    with open(part, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, final)
    _fsync_dir(directory)


def _exchange(new: Path, path: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or file system does not offer it."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) == 0


def _swap_in(new: Path, path: Path, token: str) -> None:
    """Put the complete checkpoint ``new`` at ``path`` (rank 0 only) and delete the old one. Where the file
    system can exchange two paths atomically, ``new`` and ``path`` swap in one step, so ``path`` never lacks a
    complete checkpoint (the old one, now at ``new``'s name, is deleted after); elsewhere the old one is
    renamed aside (``<path>.old-<token>``) and ``new`` into place. Entries of an old directory that are not
    checkpoint files are moved into the new one first (an in-place save kept them); the old checkpoint stays
    complete."""
    if path.is_dir() and not path.is_symlink():
        for entry in path.iterdir():
            if not _is_checkpoint_file(entry.name):
                entry.rename(new / entry.name)
    aside = None
    if (path.exists() or path.is_symlink()) and _exchange(new, path):
        aside = new
    else:
        if path.exists() or path.is_symlink():
            aside = _sibling(path, ASIDE_TAG, token)
            os.rename(path, aside)
        os.rename(new, path)
    _fsync_dir(path.parent)
    for leftover in ([aside] if aside is not None else []) + _leftovers(path):
        _remove(leftover)


def save_distributed_checkpoint_atomically(strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
    """Save ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states`` and the rest) at ``path`` as
    ``ModelParallelStrategy`` does, in its distributed format, but never in place (see the module docstring).
    Called on every rank with the same ``path``; returns once the new checkpoint is at ``path`` on every rank."""
    token = strategy.broadcast(uuid.uuid4().hex)
    new = _sibling(path, TMP_TAG, token)
    new.mkdir(parents=True, exist_ok=True)
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(converted, checkpoint_id=new)
    strategy.barrier()  # every shard and dcp's .metadata are written
    error: str | None = None
    failure: BaseException | None = None
    if strategy.global_rank == 0:
        try:
            _write_meta(checkpoint, new)  # last: marks the new directory complete
            _swap_in(new, path, token)
        except Exception as exc:
            error, failure = f"{type(exc).__name__}: {exc}", exc
    error = strategy.broadcast(error)  # also the final barrier: no rank returns before the swap
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"saving the distributed checkpoint {str(path)!r} failed on rank 0: {error}")


def checkpoint_problem(path: Path) -> str | None:
    """Why the distributed checkpoint at ``path`` must not be loaded, or ``None``: a directory lacking
    ``meta.pt`` or dcp's ``.metadata``, or a shard file that ``.metadata`` refers to (or with fewer bytes than
    it locates there); a missing ``path`` beside the leftovers of an interrupted save. A single file (a full
    checkpoint, written atomically by rank 0) and a plain missing path are left to Lightning's own checks."""
    if not path.exists():
        leftovers = _leftovers(path)
        if not leftovers:
            return None
        states = []
        for p in leftovers:
            kind = "the checkpoint it was replacing" if ASIDE_TAG in p.name[len(path.name):] else "the one being saved"
            problem = checkpoint_problem(p) if p.is_dir() else "not a directory"
            states.append(f"{str(p)!r} ({kind}, " + ("complete" if problem is None else "incomplete") + ")")
        return (
            f"The path {str(path)!r} does not point to a valid checkpoint: a save over it was interrupted, leaving "
            f"{', '.join(states)}; rename a complete one to {str(path)!r} to resume from it"
        )
    if not path.is_dir():
        return None
    missing = [f"{name} missing" for name in (_compat.metadata_filename(), DCP_METADATA) if not (path / name).is_file()]
    if (path / DCP_METADATA).is_file():
        try:
            storage = FileSystemReader(path).read_metadata().storage_data or {}
        except Exception as exc:  # a truncated or foreign file
            missing.append(f"{DCP_METADATA} unreadable ({type(exc).__name__}: {exc})")
            storage = {}
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            shard = path / name
            if not shard.is_file():
                missing.append(f"shard {name} missing")
            elif shard.stat().st_size < end:
                missing.append(f"shard {name} truncated ({shard.stat().st_size} of {end} bytes)")
    if not missing:
        return None
    return (
        f"The path {str(path)!r} does not point to a valid checkpoint: the distributed checkpoint directory is "
        f"incomplete (a save that did not finish, or files removed): {', '.join(missing)}; refusing to load it"
    )


def refuse_incomplete_checkpoint(strategy: Any, path: Path) -> None:
    """Raise the same ``ValueError`` on every rank if :func:`checkpoint_problem` finds one (rank 0 looks,
    and broadcasts its verdict: the ranks never disagree on whether to load). An error while looking is
    the verdict too, instead of leaving the other ranks waiting in the broadcast."""
    problem = None
    if strategy.global_rank == 0:
        try:
            problem = checkpoint_problem(path)
        except Exception as exc:  # any error reading the directory (permissions, a foreign layout)
            problem = f"could not check the checkpoint {str(path)!r} on rank 0: {type(exc).__name__}: {exc}"
    problem = strategy.broadcast(problem)
    if problem is not None:
        raise ValueError(problem)


def file_system_path(path: Any) -> Path:
    """``path`` as a file system path; a URL (``s3://``, ``gs://``, ``file://``, ...) raises ``ValueError``.

    The atomic swap renames directories, and Lightning's ``ModelParallelStrategy`` makes a ``Path`` of
    whatever it is given: ``s3://bucket/x`` would be written to a local directory ``s3:/bucket/x``,
    lost with the machine. Call it with the path every rank received (broadcast), so that every rank
    raises together."""
    if isinstance(path, str) and "://" in path:
        raise ValueError(
            f"checkpoint path {path!r} is a URL; NDParallelStrategy saves and loads distributed checkpoints "
            f"on a file system path (Lightning's ModelParallelStrategy would write it to the local directory "
            f"{str(Path(path))!r}). Save to a local or mounted directory (e.g. an s3fs or gcsfuse mount)."
        )
    return Path(path)
