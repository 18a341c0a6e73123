"""What the benchmarks share: spawning the ranks and writing the report."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_and_report(
    worker: Callable[..., None],
    args: Any,
    stem: Path,
    write_markdown: Callable[[dict, Path], None],
    write_plot: Callable[[dict, Path], None],
    cases: list[dict] | None = None,
) -> None:
    """Run ``worker(rank, args, port, json_path)`` on ``args.world_size`` spawned CPU ranks (one
    thread each unless ``OMP_NUM_THREADS`` says otherwise), then turn the JSON rank 0 wrote into
    ``<stem>.md`` and ``<stem>.png`` and print the table.

    With ``cases`` (argument overrides, one dict per case), every case runs in freshly spawned
    ranks, so that no case inherits the heap left by the ones before it; the JSON files' rows are
    concatenated."""
    stem.parent.mkdir(exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    data: dict = {}
    for overrides in cases or [{}]:
        case_args = argparse.Namespace(**{**vars(args), **overrides})
        Path(f"{stem}.json").unlink(missing_ok=True)
        try:
            mp.spawn(worker, args=(case_args, _free_port(), f"{stem}.json"), nprocs=args.world_size, join=True)
        except mp.ProcessExitedException as e:  # a crash in gloo's teardown, after rank 0 wrote the case
            if not Path(f"{stem}.json").exists():
                raise
            print(f"warning: {e} (after the case's results were written)")
        part = json.loads(Path(f"{stem}.json").read_text())
        if data:
            data["rows"] += part["rows"]
        else:
            data = dict(part, args=vars(args))
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    write_markdown(data, Path(f"{stem}.md"))
    write_plot(data, Path(f"{stem}.png"))
    print(Path(f"{stem}.md").read_text())
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {stem}.md/.png/.json")
