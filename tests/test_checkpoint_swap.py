"""The swap that puts a new distributed checkpoint in place of the old one leaves a complete checkpoint at the
path at every instant where the file system can exchange two paths atomically: a process dying right after the
first rename used to leave no checkpoint at the path (Lightning's ``ckpt_path="last"`` then found none and
started over)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_ndclip.lightning import _checkpoint

# the checkpoint format is Lightning's (its meta.pt name comes from Lightning: issue 30 moves this module to the
# Lightning layer)
pytest.importorskip("lightning")


def _checkpoint_dir(path: Path, tag: str) -> Path:
    path.mkdir()
    (path / "meta.pt").write_text(tag)
    (path / "__0_0.distcp").write_text(tag)
    return path


class _Died(BaseException):
    """The process dying (not an Exception: nothing catches it)."""


TOKEN = "0123456789abcdef" * 2


def _die_after_first_rename(monkeypatch: pytest.MonkeyPatch, folder: Path) -> list:
    """Make the process die at the second rename of a checkpoint directory in ``folder``."""
    renames: list = []
    real = os.rename

    def rename(src, dst):
        if Path(src).parent == folder:
            renames.append((src, dst))
            if len(renames) > 1:
                raise _Died
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    return renames


def test_the_path_holds_a_complete_checkpoint_at_every_instant_of_the_swap(tmp_path, monkeypatch):
    path = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    new = _checkpoint_dir(tmp_path / f"last.ckpt.tmp-{TOKEN}", "new")
    (path / "notes.txt").write_text("kept")  # a file of the user's beside the checkpoint's
    if not _checkpoint._exchange(new, path) or not _checkpoint._exchange(new, path):  # twice: back as it was
        pytest.skip("this file system has no atomic exchange of two paths")
    renames = _die_after_first_rename(monkeypatch, tmp_path)
    monkeypatch.setattr(_checkpoint, "_remove", lambda p: (_ for _ in ()).throw(_Died()))  # dies before deleting
    with pytest.raises(_Died):
        _checkpoint._swap_in(new, path, TOKEN)
    assert renames == [] and (path / "meta.pt").read_text() == "new" and (path / "notes.txt").read_text() == "kept"
    assert (tmp_path / f"last.ckpt.tmp-{TOKEN}" / "meta.pt").read_text() == "old"  # deleted by the next save


def test_without_the_exchange_a_death_between_the_renames_leaves_the_old_checkpoint_named(tmp_path, monkeypatch):
    """The fallback's window, as before: no checkpoint at the path, and loading it names the old one."""
    path = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    new = _checkpoint_dir(tmp_path / f"last.ckpt.tmp-{TOKEN}", "new")
    monkeypatch.setattr(_checkpoint, "_exchange", lambda new, path: False)
    _die_after_first_rename(monkeypatch, tmp_path)
    with pytest.raises(_Died):
        _checkpoint._swap_in(new, path, TOKEN)
    assert not path.exists()
    assert "a save over it was interrupted" in _checkpoint.checkpoint_problem(path)
