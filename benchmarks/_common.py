"""What the benchmarks share: spawning the ranks and writing the report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ndclip import _compat


def machine(**versions: str) -> dict:
    """The machine a benchmark ran on (cores, CPU model, RAM), torch's version, today's date, and ``versions``."""
    import datetime
    import platform

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "cpu": cpu, "ram_gib": ram_gib, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), **versions}  # fmt: skip


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


def join_as_trainer_rank(rank: int, world_size: int, port: int, run_id: str, pin: bool = True) -> list[int]:
    """Make this spawned process rank ``rank`` of a gloo group that a Lightning ``Trainer`` joins as under torchrun:
    one thread, pinned to core ``rank % cores`` (``pin``: the same sharing in every fit), Lightning's hints and logs
    off, the environment a TorchElastic launch sets. Returns the cores this process could run on."""
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if pin and cores:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    warnings.filterwarnings("ignore")  # Lightning's hints (num_workers, ...) on every rank and fit
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    _compat.redistribute_logger().setLevel(logging.ERROR)  # full_tensor() of TP params
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", TORCHELASTIC_RUN_ID=run_id,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))  # fmt: skip
    return cores


def time_method(obj: Any, name: str, spent: dict[str, list[float]]) -> None:
    """Wrap ``obj``'s method ``name`` (on the instance) to add each call's time to ``spent[name][-1]`` (the open slot:
    a caller appends one per timed step or micro-batch; calls before the first slot are not counted)."""
    original = getattr(obj, name)

    @wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if spent[name]:
                spent[name][-1] += time.perf_counter() - start

    setattr(obj, name, timed)
