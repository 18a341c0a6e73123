"""Random numbers on a mesh: what one device's draws mean when the step is split over ranks.

One device draws every random number of a step from one stream: other dropout masks for other samples and layers,
one timestep per sample, independent noise for every token. Split over a mesh, that becomes three rules:

* **Ranks holding the same samples and layers draw alike**: the tensor-parallel and context-parallel peers (ranks with
  the same data rank, ``meshes["dp"]``, and the same pipeline stage). A dropout mask on activations replicated over
  ``tp`` must be the same on every tp rank (else the replicas compute different functions and their gradients of the
  replicated weights differ); a per-sample value (a diffusion model's timestep and noise level) must be the same on
  every cp rank holding a part of the sample (else the parts are denoised at different levels).
* **Other samples and other layers draw apart**: data ranks and pipeline stages get streams of their own, as one
  device draws other numbers for other samples and for each layer (with one seed on every rank, the data ranks would
  draw the same masks and the same noise for their samples, and the stages the same masks for their layers).
* **A draw over this rank's part of a split tensor differs between the ranks splitting it**: noise for this cp rank's
  tokens, dropout over this tp rank's heads. Draw it inside ``streams.fork("cp")`` (or ``"tp"``): a stream of its own
  per coordinate on those dims, continued from call to call, which leaves the shared stream where it was (so the peers
  stay in step).

:class:`RandomStreams` seeds this rank's generators by those rules (``seed_shared``, undone by ``restore``) and forks
the per-rank streams;
:meth:`RandomStreams.check_peers_agree` checks after a step that the peers' shared streams still agree (a rank seeded
apart, or one that drew more numbers than its peers): a ``ValueError`` on every rank naming the ranks. Pure PyTorch;
seeding touches torch's default generators (CPU and the accelerator's), as ``torch.manual_seed`` does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_ndclip.core.parallel.mesh import ParallelMeshes

__all__ = ["RandomStreams", "fork_forward", "seeded_from_state"]

_FORKABLE = ("cp", "tp")
"""The mesh dims a draw can be split over: the ranks of the others hold other samples or layers anyway."""


def _mix(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (stable across processes and Python runs, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class RandomStreams:
    """This rank's random streams on ``meshes``: the shared one (peers alike, data ranks and stages apart) and forks.

    Args:
        meshes: the parallel meshes (:meth:`~lightning_ndclip.ParallelDims.build_mesh`).
        seed: the base seed, the same on every rank (the strategy passes rank 0's ``torch.initial_seed()``, which
            ``lightning.seed_everything`` sets).
        device: the accelerator whose generator is seeded and forked with the CPU's (``None``: the CPU's alone).
    """

    def __init__(self, meshes: ParallelMeshes, seed: int, device: torch.device | None = None) -> None:
        self.seed = int(seed)
        self.device = device if device is not None and device.type != "cpu" else None
        self.data_rank = meshes["dp"].get_local_rank()
        self.stage = meshes["pp"].get_local_rank()
        self._coordinates = {dim: meshes[dim].get_local_rank() for dim in _FORKABLE}
        self._forks: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._outer: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def seed_shared(self) -> None:
        """Seed torch's default generators with the shared stream of this rank's data rank and stage (the same on its
        tp and cp peers); :meth:`restore` gives them back as they were before the first call."""
        if self._outer is None:
            self._outer = self._states()
        torch.manual_seed(_mix(self.seed, "shared", self.data_rank, self.stage))

    def restore(self) -> None:
        """The default generators as they were before :meth:`seed_shared` (after training: the same on every rank if
        they were, so weights drawn next, for another model, start equal again)."""
        if self._outer is not None:
            self._set_states(self._outer)
            self._outer = None

    def _states(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), self._accelerator().get_rng_state(self.device) if self.device is not None else None

    def _set_states(self, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            self._accelerator().set_rng_state(states[1], self.device)

    @contextmanager
    def fork(self, *dims: str) -> Iterator[None]:
        """Draws inside come from a stream of this rank's own on ``dims`` (``"cp"``, ``"tp"``): different on the
        ranks splitting a tensor over them, alike on their other peers, continued from the last ``fork`` over the
        same dims; the shared stream is left where it was."""
        key = tuple(sorted(set(dims)))
        unknown = [d for d in key if d not in _FORKABLE]
        if not key or unknown:
            raise ValueError(f"fork over the mesh dims a tensor is split over, some of {_FORKABLE}; got {dims}")
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if self.device else "cuda"):
            if key in self._forks:
                self._set_states(self._forks[key])
            else:
                torch.manual_seed(_mix(self.seed, "fork", key, self.data_rank, self.stage, *(self._coordinates[d] for d in key)))
            yield
            self._forks[key] = self._states()

    def check_peers_agree(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise ``ValueError`` on every rank of ``group`` (default: the world) when ranks of one data rank and stage
        (tp and cp peers) have different shared streams now: they were seeded apart or drew different numbers of
        random values, so their masks or per-sample values differed in the step. One host-side all-gather."""
        state = torch.get_rng_state().numpy().tobytes()
        if self.device is not None:
            state += self._accelerator().get_rng_state(self.device).numpy().tobytes()
        mine = (dist.get_rank(), self.data_rank, self.stage, hashlib.sha256(state).hexdigest())
        everyone: list[tuple[int, int, int, str]] = [mine] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        apart: dict[tuple[int, int], dict[str, list[int]]] = {}
        for rank, data_rank, stage, digest in everyone:
            apart.setdefault((data_rank, stage), {}).setdefault(digest, []).append(rank)
        bad = {where: sorted(by.values()) for where, by in apart.items() if len(by) > 1}
        if bad:
            (data_rank, stage), groups = next(iter(sorted(bad.items())))
            raise ValueError(
                f"the random streams of ranks holding the same samples differ after the step (data rank {data_rank}, "
                f"pipeline stage {stage}: ranks {groups} each agree among themselves only): their tp / cp peers drew "
                "different dropout masks or per-sample values (a timestep), so the step is no one device's. Seed every "
                "rank alike (lightning.seed_everything, not seed + rank: the strategy already gives data ranks streams "
                "of their own), and draw what differs per rank (noise for this rank's tokens) inside "
                "strategy.random.fork('cp') or fork('tp')"
            )

    def _accelerator(self):  # noqa: ANN202 - torch.cuda, torch.xpu...: the module of the device's generator
        return getattr(torch, self.device.type) if self.device is not None else torch


@contextmanager
def seeded_from_state(device: torch.device, *parts: object) -> Iterator[None]:
    """Draws inside come from the CPU's and ``device``'s generators seeded from where they are now and ``parts`` (e.g.
    a tp coordinate): numbers of their own per ``parts`` on ranks whose generators are alike, and the same numbers again
    wherever that state is restored (activation checkpointing's recomputation). Afterwards the generators move on to a
    state seeded from where they were, alike on ranks that were alike. Reads the generators' states on the host (no
    device synchronization)."""
    accelerator = getattr(torch, device.type) if device.type != "cpu" else None
    state = torch.get_rng_state().numpy().tobytes()
    if accelerator is not None:
        state += accelerator.get_rng_state(device).numpy().tobytes()

    def seed(value: int) -> None:
        torch.random.default_generator.manual_seed(value)
        if accelerator is not None:
            accelerator.manual_seed(value)  # the current device's generator: this rank's

    devices = [device] if accelerator is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        seed(_mix(state, *parts))
        yield
    seed(_mix(state, "next"))


def fork_forward(module: nn.Module, streams: RandomStreams, *dims: str) -> list[RemovableHandle]:
    """Run every forward of ``module`` inside ``streams.fork(*dims)``: for a model all of whose activations are split
    over those dims (a ``transformers`` model whose sequences the strategy cuts over ``cp``), so that its dropout masks
    differ between the parts, as one device's differ between tokens. Returns the hooks' handles."""
    active: list[AbstractContextManager[None]] = []

    def enter(module: nn.Module, args: Any) -> None:
        fork = streams.fork(*dims)
        fork.__enter__()
        active.append(fork)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
