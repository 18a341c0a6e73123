"""Helpers shared by test modules that must not import Lightning (CI's core-only run collects them
without it; see ``conftest.py``)."""

from __future__ import annotations

import os

import torch.distributed as dist


def use_existing_process_group() -> None:
    """Let a Trainer in a harness worker join the worker's process group, as under torchrun."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", TORCHELASTIC_RUN_ID="harness", MASTER_PORT=os.environ.get("MASTER_PORT", "29999"),
    )
