"""Run test functions on every rank of a gloo process group, using reusable worker pools.

Starting a worker would cost seconds (importing torch), so workers are forked from a fork server that
imported torch, Lightning and transformers once, and one pool of ``world_size`` processes is created
per world size at first use and kept for the whole pytest session
(``conftest.py`` calls :func:`shutdown_all` at the end). At most :data:`MAX_WORKERS`
processes are kept; the least recently used pool is shut down to make room.

A task that raises on some rank, hangs, or leaves the group unusable breaks its pool: the
pool's processes are killed and it is recreated transparently on the next call.

A task leaves its workers as it found them: every process group it created (``DeviceMesh`` dims,
flattened meshes, ``new_group``) is destroyed when it returns (each gloo group keeps threads spinning
in the worker: left alone they piled up to thousands and slowed the whole suite to a crawl), and a
task after which a worker holds more threads than it started with fails, naming the task and the
threads.

Usage (``fn`` must be a module-level function; it is imported by name in the workers)::

    def _sum_ranks():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(4, _sum_ranks) == [6.0] * 4
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import gc
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

MAX_WORKERS = 15
"""Most worker processes alive at once, over all pools."""
ERROR_GRACE_S = 5.0
"""After a rank raised, how long the other ranks may take to answer before the pool is killed."""
STARTUP_TIMEOUT_S = 180.0
"""How long a new pool may take until every rank has joined the process group."""
THREAD_SETTLE_S = 10.0
"""After a task's process groups are destroyed, how long other threads it started may take to end."""
GROUP_SETTLE_S = 0.5
"""How long a destroyed gloo group's threads may take to end: the group joins them when it is freed, so threads
still there after this are held by a reference the clean-up does not reach (the pool is then replaced at once
rather than after ``THREAD_SETTLE_S``: on torch 2.12 that is most tasks that build a mesh)."""
COLLECTIVE_TIMEOUT_S = 60.0
"""The workers' process-group timeout (gloo's default is 30 minutes): a collective that some rank
never joins raises on the ranks waiting in it, inside a task's default 120 s."""

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent
_WORKER_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "MASTER_ADDR": "127.0.0.1",
    **({"GLOO_SOCKET_IFNAME": "lo"} if Path("/sys/class/net/lo").exists() else {}),
}


_PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_ndclip", "transformers"]
"""Imported once by the fork server the workers are forked from (each of those it finds): a new pool
then starts in about a second instead of every worker importing them (4 workers, 2 cores: ~11 s)."""


def _start_context() -> Any:
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([name for name in _PRELOAD if importlib.util.find_spec(name.split(".")[0])])
    return ctx


class RankFailure(AssertionError):
    """A task raised on some rank, or not every rank answered in time."""


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, retire_pool: bool = False, **kwargs: Any
) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a gloo group; return the results, indexed by rank.

    Arguments and results are pickled. Raises :class:`RankFailure` if a rank raises, if not
    every rank has answered (returned and passed the post-task clean-up) within ``timeout`` s, or if a
    rank holds more threads after the clean-up than a clean worker. ``retire_pool=True``: the workers
    are replaced after the task instead of checked, for a task whose meshes stay referenced where no
    clean-up reaches (``torch.compile``'s traced graphs and guards hold the meshes they saw).
    """
    if not 1 <= world_size <= MAX_WORKERS:
        raise ValueError(f"world_size must be in [1, {MAX_WORKERS}], got {world_size}")
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__" or "<" in qualname:
        raise ValueError(f"{module}.{qualname} is not a module-level function; workers cannot import it")
    task = pickle.dumps((module, qualname, args, kwargs, not retire_pool))
    pool = _pool_for(world_size)
    try:
        results = pool.run(f"{module}.{qualname}", task, timeout)
    except BaseException:
        retire_pool = True
        raise
    finally:
        if retire_pool or pool.retire:
            del _pools[world_size]
            pool.shutdown()
    return results


def ranks_agree(obj: Any) -> bool:
    """Inside a task: whether every rank passed an equal ``obj`` (tensors compared with ``torch.equal``)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    first = gathered[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(o, torch.Tensor) and torch.equal(first, o) for o in gathered)
    return all(o == first for o in gathered)


def shutdown_all() -> None:
    """Kill every pool's processes (called at the end of the pytest session)."""
    while _pools:
        _pools.popitem()[1].shutdown()


_pools: OrderedDict[int, _Pool] = OrderedDict()
"""Live pools by world size, least recently used first."""
atexit.register(shutdown_all)  # workers are not daemonic (tasks may start processes): never leave them behind


def _pool_for(world_size: int) -> _Pool:
    """Return a live pool for ``world_size``, starting one (and evicting old ones) if needed."""
    pool = _pools.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.shutdown()
        pool = None
    if pool is None:
        while _pools and sum(p.world_size for p in _pools.values()) + world_size > MAX_WORKERS:
            _pools.popitem(last=False)[1].shutdown()
        pool = _Pool(world_size)
    _pools[world_size] = pool
    return pool


class _Pool:
    """``world_size`` worker processes (forked from a fork server that imported torch) forming one gloo
    process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.retire = False  # a task left threads of process groups behind: replace the workers
        self._dir = Path(tempfile.mkdtemp(prefix=f"harness-ws{world_size}-"))
        ctx = _start_context()
        self._conns: list[connection.Connection] = []
        self._procs: list[Any] = []
        try:
            with mock.patch.dict(os.environ, _WORKER_ENV):
                for rank in range(world_size):
                    parent_end, child_end = ctx.Pipe()
                    self._conns.append(parent_end)
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(rank, world_size, str(self._dir / "store"), child_end, self._stack_file(rank),
                              os.getpid()),
                        name=f"harness-rank{rank}-of-{world_size}",
                    )
                    proc.start()
                    child_end.close()
                    self._procs.append(proc)
            self._await_ready()
        except BaseException:
            self.shutdown()
            raise

    def _stack_file(self, rank: int) -> str:
        return str(self._dir / f"stack-rank{rank}.txt")

    def _await_ready(self) -> None:
        waiting = set(range(self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            message = self._next_message(waiting, deadline)
            if message is None:
                raise RuntimeError(f"ranks {sorted(waiting)} of a new pool of {self.world_size} did not start "
                                   f"within {STARTUP_TIMEOUT_S} s")
            rank, kind, payload = message
            if kind != "ready":
                raise RuntimeError(f"rank {rank} of a new pool of {self.world_size} failed to start:\n{payload}")
            waiting.discard(rank)

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self._procs)

    def shutdown(self) -> None:
        """Kill and reap all processes, remove the temporary directory."""
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(10)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _next_message(self, ranks: set[int], deadline: float) -> tuple[int, str, Any] | None:
        """Wait for the next ``(rank, kind, payload)`` from one of ``ranks``; ``None`` at the deadline."""
        remaining = deadline - time.monotonic()
        ready = connection.wait([self._conns[r] for r in ranks], timeout=max(remaining, 0))
        if not ready:
            return None
        rank = self._conns.index(ready[0])
        try:
            kind, payload = pickle.loads(ready[0].recv_bytes())
        except (EOFError, OSError):
            self._procs[rank].join(1)
            kind, payload = "error", f"worker process died (exit code {self._procs[rank].exitcode})"
        return rank, kind, payload

    def run(self, name: str, task: bytes, timeout: float) -> list:
        """Send ``task`` to every rank and collect the results; raise :class:`RankFailure` on failure."""
        for conn in self._conns:
            conn.send_bytes(task)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        running = set(range(self.world_size))  # ranks that have not returned yet
        in_barrier: set[int] = set()  # ranks that returned but have not passed the post-task barrier
        deadline = time.monotonic() + timeout
        while running or (in_barrier and not errors):
            message = self._next_message(running | in_barrier, deadline)
            if message is None:
                break
            rank, kind, payload = message
            running.discard(rank)
            in_barrier.discard(rank)
            if kind == "ok":
                results[rank] = payload
                in_barrier.add(rank)
            elif kind == "retire":
                self.retire = True
            elif kind == "error":
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if not (errors or running or in_barrier):
            return [results[rank] for rank in range(self.world_size)]
        raise RankFailure(self._report(name, errors, running, set() if errors else in_barrier, timeout))

    def _report(self, name: str, errors: dict[int, str], running: set[int], in_barrier: set[int],
                timeout: float) -> str:
        """Describe a failed task, with the Python stacks of the ranks that did not answer."""
        test = os.environ.get("PYTEST_CURRENT_TEST", "")
        lines = [f"{name} failed on world size {self.world_size}" + (f" (test {test})" if test else "")]
        if errors:
            lines.append(f"ranks that raised: {sorted(errors)}")
        if running or in_barrier:
            limit = f"the {ERROR_GRACE_S} s grace period after an error" if errors else f"the {timeout} s timeout"
            lines.append(f"ranks that did not answer within {limit}: {sorted(running | in_barrier)}"
                         + (f" (of which {sorted(in_barrier)} returned, then stuck in the post-task barrier)"
                            if in_barrier else ""))
        for rank, text in sorted(errors.items()):
            lines.append(f"\n---- rank {rank} raised ----\n{text.rstrip()}")
        for rank, text in sorted(self._dump_stacks(running | in_barrier).items()):
            lines.append(f"\n---- rank {rank} did not answer; its stack ----\n{text.rstrip()}")
        return "\n".join(lines)

    def _dump_stacks(self, ranks: set[int]) -> dict[int, str]:
        """Make ``ranks`` write their Python stacks (faulthandler on SIGUSR1) and read them back."""
        offsets = {rank: os.path.getsize(self._stack_file(rank)) for rank in ranks}
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # until every dump has started and stopped growing
            time.sleep(0.1)
            new_sizes = {rank: os.path.getsize(self._stack_file(rank)) for rank in ranks}
            if new_sizes == sizes and all(new_sizes[r] > offsets[r] for r in ranks):
                break
            sizes = new_sizes
        stacks = {}
        for rank in ranks:
            with open(self._stack_file(rank)) as dump:
                dump.seek(offsets[rank])
                stacks[rank] = dump.read() or "(no stack dump received)"
        return stacks


def _worker_main(rank: int, world_size: int, store: str, conn: connection.Connection, stack_file: str,
                 parent_pid: int) -> None:
    """Worker process: join the gloo group, then run tasks until the pipe closes."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="harness-orphan-watchdog",
                     daemon=True).start()
    for path in (str(_REPO_ROOT), str(_TESTS_DIR)):
        if path not in sys.path:
            sys.path.insert(0, path)
    stacks = open(stack_file, "w")  # noqa: SIM115 - kept open for the worker's lifetime
    torch.set_num_threads(1)
    with contextlib.suppress(ImportError):
        import tqdm  # noqa: PLC0415 - where installed (Lightning's progress bars)

        tqdm.tqdm.monitor_interval = 0  # no monitor thread: it would outlive the task that drew the first bar
    world = _World(rank, world_size, store)
    try:
        world.join()
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:
            return
        # (re-)arm the stack dump: a task may have replaced the SIGUSR1 handler, as a Lightning
        # Trainer does when it restores the signal handlers it found at teardown
        faulthandler.unregister(signal.SIGUSR1)  # register() alone would not re-install it
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            module, qualname, args, kwargs, check_threads = pickle.loads(task)
            fn: Any = importlib.import_module(module)
            for attr in qualname.split("."):
                fn = getattr(fn, attr)
            reply, ok = pickle.dumps(("ok", fn(*args, **kwargs))), True
        except BaseException:
            reply, ok = pickle.dumps(("error", traceback.format_exc())), False
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(reply)
        if ok:  # a raising rank skips the clean-up: its pool is killed anyway
            conn.send_bytes(pickle.dumps(world.after_task(f"{module}.{qualname}", check_threads)))


class _World:
    """This worker's default process group, and the clean-up after each task."""

    def __init__(self, rank: int, world_size: int, store: str) -> None:
        self.rank, self.world_size, self._store = rank, world_size, store
        self._generation = 0
        self._baseline: collections.Counter[str] = collections.Counter()

    def join(self) -> None:
        """Join the gloo group of every rank; the first time, note the threads a clean worker has."""
        dist.init_process_group(
            "gloo", rank=self.rank, world_size=self.world_size,
            init_method=f"file://{self._store}.{self._generation}", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        dist.barrier()  # the group's threads start at its first collective
        if not self._baseline:
            torch.ones(1, requires_grad=True).sum().backward()  # autograd's device threads start once, for good
            gc.freeze()  # what the imports made lives for good: the clean-up's gc.collect() skips it
            self._baseline = _threads()

    def after_task(self, task: str, check_threads: bool) -> tuple[str, str | None]:
        """Destroy the process groups ``task`` created, then check every rank is back in step and (``check_threads``)
        holds no more threads than a clean worker. Collective; ``("clean", None)`` or ``("error", why)``."""
        try:
            created = torch.tensor([len(_registered_groups()) > 1])  # non-members of a group have none to destroy
            dist.all_reduce(created, op=dist.ReduceOp.MAX)  # also the barrier that says every rank is back
            if created.item():
                dist.destroy_process_group()  # every group, the default one too: caches keyed by it let go of theirs
                _clear_mesh_caches()
                gc.collect()
                self._generation += 1
                self.join()
        except BaseException:
            return "error", "post-task clean-up failed:\n" + traceback.format_exc()
        if not check_threads:
            return "clean", None
        leaked = _threads() - self._baseline
        start = time.monotonic()
        while leaked and time.monotonic() < start + THREAD_SETTLE_S:
            if _only_process_groups(leaked) and time.monotonic() > start + GROUP_SETTLE_S:
                return "retire", None  # groups torch still holds somewhere (older releases' caches)
            time.sleep(0.05)
            gc.collect()
            leaked = _threads() - self._baseline
        if leaked:
            return "error", (f"{task} left {sum(leaked.values())} more threads than a clean worker holds on rank "
                             f"{self.rank} ({dict(leaked)}, by name): stop or join what it started")
        return "clean", None


def _only_process_groups(threads: collections.Counter[str]) -> bool:
    """Whether ``threads`` are only threads of some gloo process groups: two ``pt_gloo_runloop`` and one transport
    loop each (``gloo_tcp_loop``; unnamed, ``python``, on torch 2.12), or fewer of a group still being torn down (seen
    on torch 2.12 under load: one runloop left, its loop gone). Such groups are held by a cache the clean-up does not
    reach, or slow to stop: the pool is then replaced rather than the task failed (their threads cannot pile up); any
    other thread left behind fails the task."""
    runloops = threads["pt_gloo_runloop"]
    loops = threads["gloo_tcp_loop"] + threads["python"]
    return runloops > 0 and 2 * loops <= runloops + 1 and set(threads) <= {"pt_gloo_runloop", "gloo_tcp_loop", "python"}


def _registered_groups() -> list[Any]:
    """This rank's live process groups, the default one included (no public torch name lists them)."""
    return list(dist.distributed_c10d._world.pg_map)


def _clear_mesh_caches() -> None:
    """Empty the caches that keep device meshes, and with them their destroyed process groups and each one's
    gloo threads, alive: torch.distributed's (DTensor's sharding propagation and redistribution plans, keyed by
    meshes) and the package's (``PerProcessGroup``), found by what they are (a ``cache_clear``, a dict named
    ``*cache*``), so that a torch release that adds or renames one is covered too."""
    torch.compiler.reset()  # compiled graphs hold the meshes their DTensors were traced on
    clear_dtensor = getattr(importlib.import_module("torch.distributed.tensor.debug"), "_clear_sharding_prop_cache", None)
    if clear_dtensor is not None:
        clear_dtensor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a deprecated module attribute warns (torch.distributed.reduce_op)
        for name, module in list(sys.modules.items()):
            if module is not None and name.startswith(("torch.distributed", "lightning_ndclip")):
                _clear_caches_of(name, module)


def _clear_caches_of(name: str, module: Any) -> None:
    """Empty the caches defined in ``module`` (see :func:`_clear_mesh_caches`)."""
    for attr, value in list(vars(module).items()):
        if isinstance(value, dict) and "cache" in attr.lower():
            value.clear()
        elif isinstance(value, type) and value.__module__ == name:  # a class defined here: its cached methods
            for member in vars(value).values():
                member = getattr(member, "__func__", member)  # a staticmethod's or classmethod's function
                if callable(getattr(member, "cache_clear", None)):
                    member.cache_clear()
        elif not isinstance(value, type) and callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _threads() -> collections.Counter[str]:
    """This process's threads, counted by name."""
    names: collections.Counter[str] = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names[Path(f"/proc/self/task/{task}/comm").read_text().strip()] += 1
    return names


def _exit_when_orphaned(parent_pid: int) -> None:
    """Kill this worker once the process that started it (pytest, not the fork server it was forked
    from) has gone."""
    while _alive(parent_pid):
        time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid)
        return True
    return True
