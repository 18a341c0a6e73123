"""Faults that other test files do not cover: a rank that never joins the norm, a check that raises on
one rank only. Each asserts the right numbers or an error on the waiting ranks within a bounded time,
never a wait until gloo's 30-minute default. In ``Trainer.fit`` (a rank killed mid-training, a checkpoint
resumed on another mesh): test_faults_trainer.py.

The whole fault suite (these and the fault cases of the other files) runs with ``pytest -m faults``;
``docs/troubleshooting.md`` lists each fault with what happens.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import lightning_ndclip as nd

pytestmark = pytest.mark.faults

GROUP_TIMEOUT_S = 5


def _absent_rank_case(cached: bool) -> dict:
    """Rank 1 never calls the norm (before the plan is cached, or after): rank 0 waits in the plan
    exchange or the all-reduce of a group with a 5 s timeout."""
    group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    grads = [distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0)])]
    if cached:
        nd.get_total_norm(grads, process_group=group)
    if dist.get_rank() == 1:
        return {}
    start = time.monotonic()
    try:
        nd.get_total_norm(grads, process_group=group)
    except RuntimeError as error:
        return {"waited": time.monotonic() - start, "error": str(error)}
    return {"waited": time.monotonic() - start, "error": None}


@pytest.mark.parametrize("cached", [False, True], ids=["first-call", "cached-plan"])
def test_a_rank_that_never_joins_the_norm_makes_the_waiting_rank_raise_within_the_group_timeout(cached):
    waiting = run_on_ranks(2, _absent_rank_case, cached, timeout=60)[0]
    assert waiting["error"] is not None, "the norm returned without rank 1"
    assert GROUP_TIMEOUT_S - 1 <= waiting["waited"] < 4 * GROUP_TIMEOUT_S, waiting


def _check_raising_on_one_rank_case() -> str:
    from unittest import mock

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from lightning_ndclip import ParallelDims
    from lightning_ndclip.core.parallel import coverage

    meshes = ParallelDims(world_size=2, dp_shard=2).build_mesh("cpu")
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=meshes["fsdp"])
    boom = mock.patch.object(coverage, "_first_problem", side_effect=RuntimeError("boom"))
    with boom if dist.get_rank() == 1 else contextlib.nullcontext():
        with pytest.raises(ValueError) as info:
            coverage.check_data_parallel_reduction(model, meshes)
    return str(info.value)


def test_the_reduction_check_failing_on_one_rank_raises_on_every_rank():
    """An exception inside the check on rank 1 alone must not leave rank 0 waiting in the gather."""
    for message in run_on_ranks(2, _check_raising_on_one_rank_case, timeout=60):
        assert message == "rank 1: checking the data-parallel reduction raised RuntimeError: boom", message
