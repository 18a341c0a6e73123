"""What the benchmarks share: spawning the ranks and writing the report."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def spawn_and_report(
    worker: Callable[..., None],
    args: Any,
    stem: Path,
    write_markdown: Callable[[dict, Path], None],
    write_plot: Callable[[dict, Path], None],
) -> None:
    """Run ``worker(rank, args, port, json_path)`` on ``args.world_size`` spawned CPU ranks (one
    thread each unless ``OMP_NUM_THREADS`` says otherwise), then turn the JSON rank 0 wrote into
    ``<stem>.md`` and ``<stem>.png`` and print the table."""
    stem.parent.mkdir(exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.spawn(worker, args=(args, port, f"{stem}.json"), nprocs=args.world_size, join=True)
    data = json.loads(Path(f"{stem}.json").read_text())
    write_markdown(data, Path(f"{stem}.md"))
    write_plot(data, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {stem}.md/.png/.json")
