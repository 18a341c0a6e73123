"""Faults never tear a distributed checkpoint: a rank killed while saving over a checkpoint leaves the old one,
which loads exactly; an incomplete checkpoint directory is refused on every rank, saying what is missing.

Lightning's ``ModelParallelStrategy`` saves in place: the same kill leaves a directory of old and new shards
that loads with no error, every parameter part old, part new (``test_lightning_in_place_save_tears``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import harness
import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from test_callbacks import MlpModule, use_existing_process_group
from torch.distributed.checkpoint import FileSystemWriter

from lightning_ndclip import NDParallelStrategy

pytestmark = pytest.mark.faults


class _Capture(MlpModule):
    """Keeps the full parameters as training starts, i.e. as the checkpoint restored them."""

    def on_train_start(self) -> None:
        self.restored = {n: p.detach().full_tensor() for n, p in self.net.named_parameters()}
        self.trainer.should_stop = True


class _LightningSave(NDParallelStrategy):
    """What NDParallelStrategy did before: Lightning's in-place save and its unchecked load."""

    save_checkpoint = ModelParallelStrategy.save_checkpoint
    load_checkpoint = ModelParallelStrategy.load_checkpoint


def _trainer(lightning: bool = False, **kwargs) -> L.Trainer:
    strategy = _LightningSave() if lightning else NDParallelStrategy()
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, limit_train_batches=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _full(model: MlpModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.net.named_parameters()}


def _save_then_die_saving_again(directory: str, kill: str, lightning: bool) -> None:
    """Save, change every parameter, save again over it: rank 1 exits (as if killed) before or after writing
    its shard of the second save. Rank 0 keeps both states in ``states.pt`` for the test."""
    use_existing_process_group()
    model = MlpModule(tp=False)
    trainer = _trainer(lightning, max_epochs=1)
    trainer.fit(model)
    path = f"{directory}/model.ckpt"
    trainer.save_checkpoint(path)
    first = _full(model)
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(1.0)
    second = _full(model)  # a collective: on every rank
    if dist.get_rank() == 0:
        torch.save({"first": first, "second": second}, f"{directory}/states.pt")
    dist.barrier()
    if dist.get_rank() == 1:
        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if kill == "before_shard":
                os._exit(1)
            write(self, plan, planner).wait()
            os._exit(1)

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    trainer.save_checkpoint(path)


def _restore(path: str, lightning: bool) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Load ``path``; then save over it: what was beside it, and what is after a save that succeeded."""
    use_existing_process_group()
    model = _Capture(tp=False)
    trainer = _trainer(lightning, max_epochs=2)
    trainer.fit(model, ckpt_path=path)
    before = sorted(os.listdir(Path(path).parent))
    dist.barrier()
    trainer.save_checkpoint(path)
    return model.restored, before, sorted(os.listdir(Path(path).parent))


def _kill_mid_save(tmp_path: Path, kill: str, lightning: bool) -> tuple[dict, tuple]:
    with pytest.raises(harness.RankFailure, match="rank 1|ranks that raised"):
        run_on_ranks(2, _save_then_die_saving_again, str(tmp_path), kill, lightning, timeout=60)
    states = torch.load(tmp_path / "states.pt")
    return states, run_on_ranks(2, _restore, str(tmp_path / "model.ckpt"), lightning, timeout=60)[0]


def test_a_rank_killed_saving_over_a_checkpoint_leaves_the_first_one_exactly(tmp_path):
    """Rank 1 killed once its shard of the second save is written (before it, the same holds a fortiori)."""
    states, (restored, before, after) = _kill_mid_save(tmp_path, "after_shard", lightning=False)
    assert restored.keys() == states["first"].keys()
    for name, value in states["first"].items():
        assert torch.equal(restored[name], value), name
    # nothing at the path but the first checkpoint's files; the interrupted save's directory beside it
    assert sorted(os.listdir(tmp_path / "model.ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    (leftover,) = set(before) - {"model.ckpt", "states.pt"}
    assert leftover.startswith("model.ckpt.tmp-"), before
    assert after == ["model.ckpt", "states.pt"]  # the next save that succeeds removes it


def test_lightning_in_place_save_tears(tmp_path):
    """The same kill, with Lightning's save and load: the directory loads silently, each parameter a mix of
    the first state (rank 1's half, never rewritten) and the second (rank 0's half)."""
    states, (restored, _, _) = _kill_mid_save(tmp_path, "before_shard", lightning=True)
    for name, value in restored.items():
        old, new = torch.eq(value, states["first"][name]), torch.eq(value, states["second"][name])
        assert bool((old | new).all()) and bool(old.any()) and bool(new.any()), name


_ASIDE = "gone.ckpt.old-" + "0" * 32
"""A checkpoint renamed aside by a save killed between its two renames: nothing at ``gone.ckpt``."""


def _refuse_torn_case(directory: str) -> dict[str, str]:
    use_existing_process_group()
    base = Path(directory)
    trainer = _trainer(max_epochs=1)
    trainer.fit(MlpModule(tp=False))
    trainer.save_checkpoint(base / "model.ckpt")
    tears = ("meta.pt", ".metadata", "__1_0.distcp", "truncated")
    if dist.get_rank() == 0:
        for removed in tears:
            shutil.copytree(base / "model.ckpt", base / removed)
            if removed == "truncated":
                shard = base / removed / "__0_0.distcp"
                shard.write_bytes(shard.read_bytes()[:-8])
            else:
                (base / removed / removed).unlink()
        shutil.copytree(base / "model.ckpt", base / _ASIDE)
    dist.barrier()
    messages = {}
    for name in (*tears, "gone.ckpt", "model.ckpt"):
        model = _Capture(tp=False)
        try:
            _trainer(max_epochs=2).fit(model, ckpt_path=base / name)
        except ValueError as error:
            assert not hasattr(model, "restored")
            messages[name] = str(error)
        else:
            messages[name] = "loaded"
    return messages


def test_an_incomplete_checkpoint_directory_is_refused_on_every_rank_saying_what_is_missing(tmp_path):
    results = run_on_ranks(2, _refuse_torn_case, str(tmp_path), timeout=60)
    assert results[0] == results[1]
    expected = {"meta.pt": "meta.pt missing", ".metadata": ".metadata missing",
                "__1_0.distcp": "shard __1_0.distcp missing", "truncated": "shard __0_0.distcp truncated"}
    for removed, what in expected.items():
        message = results[0][removed]
        assert "does not point to a valid checkpoint" in message and str(tmp_path / removed) in message, message
        assert what in message and "refusing to load" in message, message
    # a save killed between its renames: the path is missing, the complete old checkpoint named
    assert f"{str(tmp_path / _ASIDE)!r} (the checkpoint it was replacing, complete)" in results[0]["gone.ckpt"]
    assert results[0]["model.ckpt"] == "loaded"  # the intact one


def _round_trip_case(directory: str) -> dict:
    use_existing_process_group()
    path = Path(directory) / "model.ckpt"
    model = MlpModule(tp=False)
    trainer = _trainer(max_epochs=1)
    trainer.fit(model)
    trainer.save_checkpoint(path)
    if dist.get_rank() == 0:
        (path / "notes.txt").write_text("kept")
    dist.barrier()
    with torch.no_grad():
        for p in model.net.parameters():
            p.mul_(2.0)
    trainer.save_checkpoint(path)  # over the first: swapped in whole
    saved = _full(model)
    restored = _Capture(tp=False)
    _trainer(max_epochs=2).fit(restored, ckpt_path=path)
    return {"saved": saved, "restored": restored.restored, "files": sorted(os.listdir(path)),
            "siblings": sorted(os.listdir(directory))}


def test_save_over_a_checkpoint_and_load_round_trip(tmp_path):
    for r in run_on_ranks(2, _round_trip_case, str(tmp_path), timeout=60):
        for name, value in r["saved"].items():
            assert torch.equal(r["restored"][name], value), name
        # Lightning's layout; a file of the user's in the directory survives; no temporary directory left
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "notes.txt"]
        assert r["siblings"] == ["model.ckpt"]


def _url_case(directory: str, how: str) -> list[str]:
    use_existing_process_group()
    if how == "full":
        trainer = L.Trainer(strategy=NDParallelStrategy(save_distributed_checkpoint=False), accelerator="cpu",
                            devices=2, limit_train_batches=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    else:
        trainer = _trainer(lightning=how == "lightning", max_epochs=1)
    trainer.fit(MlpModule(tp=False))
    messages = []
    cwd = os.getcwd()
    os.chdir(directory)  # where a URL taken for a path is written
    try:
        for url in ("s3://bucket/model.ckpt", "file:///tmp/model.ckpt"):
            if how == "lightning":
                trainer.save_checkpoint(url)
                continue
            with pytest.raises(ValueError, match="is a URL") as info:
                trainer.save_checkpoint(url)
            messages.append(str(info.value))
        dist.barrier()
    finally:
        os.chdir(cwd)
    return messages


@pytest.mark.parametrize("how", ["sharded", "full"])
def test_a_url_is_refused_on_every_rank_instead_of_written_to_a_local_directory(tmp_path, how):
    results = run_on_ranks(2, _url_case, str(tmp_path), how, timeout=60)
    assert results[0] == results[1]
    assert "'s3://bucket/model.ckpt'" in results[0][0] and "'s3:/bucket/model.ckpt'" in results[0][0]
    assert os.listdir(tmp_path) == []


def test_lightning_writes_a_url_to_a_local_directory(tmp_path):
    run_on_ranks(2, _url_case, str(tmp_path), "lightning", timeout=60)
    assert (tmp_path / "s3:" / "bucket" / "model.ckpt" / "meta.pt").is_file()


class _Ranks:
    """What refuse_incomplete_checkpoint needs of a strategy: the rank and a broadcast from rank 0."""

    global_rank = property(lambda self: dist.get_rank())

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _unreadable_check_case(directory: str) -> str:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from lightning_ndclip.lightning._checkpoint import refuse_incomplete_checkpoint

    path = Path(directory) / "odd.ckpt"
    if dist.get_rank() == 0:  # a .metadata whose storage entries have no relative_path: the check itself fails
        path.mkdir()
        (path / "meta.pt").write_bytes(b"")
        (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={"w": None})))
    dist.barrier()
    with pytest.raises(ValueError) as info:
        refuse_incomplete_checkpoint(_Ranks(), path)
    return str(info.value)


def test_an_error_while_rank_0_checks_a_checkpoint_is_raised_on_every_rank(tmp_path):
    # it used to escape on rank 0 only, leaving the others waiting in the broadcast
    first, second = run_on_ranks(2, _unreadable_check_case, str(tmp_path), timeout=30)
    assert first == second
    assert "could not check the checkpoint" in first and str(tmp_path / "odd.ckpt") in first and "AttributeError" in first


def _full_save_fails_on_rank_0_case(directory: str) -> dict:
    use_existing_process_group()
    path = f"{directory}/model.ckpt"
    first = _trainer(max_epochs=1)
    first.fit(MlpModule(tp=False))
    first.save_checkpoint(path)  # a distributed checkpoint (a directory)
    full = L.Trainer(strategy=NDParallelStrategy(save_distributed_checkpoint=False), accelerator="cpu", devices=2,
                     limit_train_batches=2, max_epochs=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    full.fit(MlpModule(tp=False))
    full.save_checkpoint(path)  # over the directory: Lightning removed it on every rank at once
    replaced = Path(path).is_file()
    dist.barrier()
    if dist.get_rank() == 0:
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        full.strategy.checkpoint_io.save_checkpoint = disk_full
    try:
        full.save_checkpoint(path)
    except Exception as error:
        return {"replaced": replaced, "error": f"{type(error).__name__}: {error}"}
    return {"replaced": replaced, "error": "returned normally"}


def test_a_full_checkpoint_replaces_a_distributed_one_and_a_failure_on_rank_0_raises_on_every_rank(tmp_path):
    """The other ranks used to return normally from the failed save, and train on into a collective rank 0 never
    joined."""
    results = run_on_ranks(2, _full_save_fails_on_rank_0_case, str(tmp_path))
    assert all(r["replaced"] for r in results)
    assert results[0]["error"] == "OSError: [Errno 28] No space left on device", results  # rank 0: its own error
    assert results[1]["error"] == (
        f"AgreedError: rank 0: saving the full checkpoint '{tmp_path}/model.ckpt' raised OSError: [Errno 28] No space "
        "left on device"
    )
