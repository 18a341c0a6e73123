"""Tests of the multi-rank harness itself."""

import os
import time

import harness
import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run_on_ranks


def _rank_info(tag: str, *, scale: torch.Tensor) -> tuple[int, int, str, torch.Tensor]:
    return dist.get_rank(), dist.get_world_size(), tag, scale * dist.get_rank()


def _all_reduce_ranks() -> torch.Tensor:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t


def _pid() -> int:
    return os.getpid()


def _worker_settings() -> tuple[dict[str, str | None], int, str]:
    env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR")}
    return env, torch.get_num_threads(), dist.get_backend()


def _agreement() -> tuple[bool, bool]:
    return harness.ranks_agree(torch.ones(3)), harness.ranks_agree(dist.get_rank())


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 0 now waits for rank 1 forever


def _sleep_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(world_size, _rank_info, "x", scale=torch.tensor([2.0]))
    assert [r[:3] for r in results] == [(rank, world_size, "x") for rank in range(world_size)]
    assert [r[3].item() for r in results] == [2.0 * rank for rank in range(world_size)]


def test_all_reduce() -> None:
    results = run_on_ranks(4, _all_reduce_ranks)
    assert all(torch.equal(t, torch.tensor([10.0])) for t in results)


def test_worker_settings() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    assert run_on_ranks(2, _worker_settings) == [(env, 1, "gloo")] * 2


def test_ranks_agree() -> None:
    assert run_on_ranks(2, _agreement) == [(True, False)] * 2


def test_pool_is_reused() -> None:
    pids = run_on_ranks(2, _pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert run_on_ranks(2, _pid) == pids


def test_rejects_functions_workers_cannot_import() -> None:
    with pytest.raises(ValueError, match="module-level"):
        run_on_ranks(1, lambda: None)


def test_exception_on_one_rank_fails_fast_and_pool_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "ERROR_GRACE_S", 1.0)
    pids = run_on_ranks(2, _pid)
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(2, _raise_on_rank_1, timeout=60)
    assert time.monotonic() - start < 15
    message = str(failure.value)
    assert "_raise_on_rank_1" in message
    assert "ranks that raised: [1]" in message
    assert "ValueError: boom from rank 1" in message
    assert "---- rank 0 did not answer; its stack ----" in message and "all_reduce" in message
    new_pids = run_on_ranks(2, _pid)
    assert set(new_pids).isdisjoint(pids)


def test_hang_is_reported_with_stack_and_pool_recovers() -> None:
    run_on_ranks(2, _pid)  # start the pool outside the timed part
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(2, _sleep_on_rank_1, timeout=3)
    assert time.monotonic() - start < 15
    message = str(failure.value)
    assert "_sleep_on_rank_1" in message
    assert "did not answer within the 3 s timeout: [0, 1]" in message
    assert "of which [0] returned, then stuck in the post-task barrier" in message
    rank_1_stack = message.split("---- rank 1 did not answer; its stack ----")[1]
    assert "in _sleep_on_rank_1" in rank_1_stack
    assert run_on_ranks(2, _rank_info, "again", scale=torch.ones(1))[1][:3] == (1, 2, "again")


def _make_groups() -> int:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    dist.all_reduce(torch.ones(1), group=mesh["a"].get_group())
    dist.barrier(dist.new_group([0, 1]))
    return len(os.listdir("/proc/self/task"))


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_tasks_process_groups_are_destroyed_when_it_returns():
    before = run_on_ranks(4, _thread_count)
    during = run_on_ranks(4, _make_groups)
    assert all(d > b for d, b in zip(during, before))  # each gloo group runs threads of its own
    for _ in range(3):  # and they go when the task does: no growth from task to task
        run_on_ranks(4, _make_groups)
    assert run_on_ranks(4, _thread_count) == before


def _leak_a_thread() -> None:
    import threading

    import harness

    harness.THREAD_SETTLE_S = 0.5  # the thread never ends: no need to wait 10 s to see it (the failed pool is replaced)
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="left-behind", daemon=True).start()


def test_a_task_that_leaves_a_thread_fails_naming_itself() -> None:
    with pytest.raises(RankFailure, match=r"_leak_a_thread left 1 more threads than a clean worker holds"):
        run_on_ranks(2, _leak_a_thread)
