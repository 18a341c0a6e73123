"""What ``NDParallelStrategy`` checks once, at the first training step of a fit: the mistakes that train without an
error and give other numbers than one device, each refused on every rank, naming the cause. Each costs a collective
(or a watch of the forward) that the steady state does not pay.

* The tp, cp and pipeline peers were fed the same batch (a digest over the world:
  :func:`~lightning_ndclip.core.parallel.replicas.check_peers_fed_alike`).
* Under tp, the first forward is watched for a fused projection cut into its parts and a whole parameter meeting
  split activations (:func:`~lightning_ndclip.core.parallel.split_activations.watch_split_activations`).
* Under cp, the step cut some sequence or attended over one: else every cp rank computed the whole sequence, a
  silent no-op (:mod:`lightning_ndclip.core.context.work`).
* After the step, the tp and cp peers' random streams still agree.
* At the first optimizer step under tp, the parameters the tp ranks hold as copies got the same gradient on each
  (:func:`~lightning_ndclip.core.parallel.replicas.check_replica_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip.core.context import work as context_work
from lightning_ndclip.core.parallel.mesh import ParallelMeshes
from lightning_ndclip.core.parallel.replicas import check_peers_fed_alike, check_replica_gradients
from lightning_ndclip.core.parallel.split_activations import watch_split_activations
from lightning_ndclip.core.random import RandomStreams

__all__ = ["FirstStepChecks"]


class FirstStepChecks:
    """The checks of one fit's first step (see the module docstring); each runs once."""

    def __init__(self) -> None:
        self._fed = self._stepped = self._gradients = False

    def check_batch(self, batch: Any, world: DeviceMesh) -> None:
        """The first batch: the same on the peers that must share it."""
        if not self._fed:
            self._fed = True
            check_peers_fed_alike(batch, world)

    @contextmanager
    def watching(
        self, model: nn.Module, meshes: ParallelMeshes, *, watch_forward: bool, streams: RandomStreams | None,
        module_name: str, device: torch.device,
    ) -> Iterator[None]:  # fmt: skip
        """Around the first training step (nothing around later ones): ``watch_forward`` (no pipeline, whose stages
        run their own forward) watches the forward under tp; under cp, a step that cut nothing is refused after it."""
        first, self._stepped = not self._stepped, True
        tp, cp = meshes["tp"].size(), meshes["cp"].size()
        watch_cp = first and cp > 1
        with watch_split_activations(model, meshes["tp"]) if first and watch_forward and tp > 1 else nullcontext():
            with context_work.watch() if watch_cp else nullcontext() as seen:
                yield
        if watch_cp:
            _refuse_idle_context_parallelism(seen, cp, module_name, device)
        if first and streams is not None and tp * cp > 1:
            streams.check_peers_agree()

    def closure(self, closure: Callable[[], Any], model: nn.Module, tp_mesh: DeviceMesh) -> Callable[[], Any]:
        """The first optimizer step's ``closure`` under tp, checking the copies' gradients once it has run."""
        if self._gradients or tp_mesh.size() == 1:
            return closure
        self._gradients = True
        return partial(_checked, closure, model, tp_mesh)


def _checked(closure: Callable[[], Any], model: nn.Module, tp_mesh: DeviceMesh) -> Any:
    output = closure()
    check_replica_gradients(model, tp_mesh)
    return output


def _refuse_idle_context_parallelism(seen: Any, cp: int, module_name: str, device: torch.device) -> None:
    """Refuse, on every rank, a first step that cut no sequence along cp and ran no context-parallel attention on any
    rank. One all-reduce of a flag, read once."""
    idle = torch.tensor([0 if seen.count else 1], device=device)
    dist.all_reduce(idle, op=dist.ReduceOp.MIN)  # 1: no rank did any
    if int(idle.item()):
        raise ValueError(
            f"NDParallelStrategy(cp={cp}): the first training step of {module_name} cut no sequence "
            f"along cp and attended over none, so each of the {cp} cp ranks computed the whole sequence (context "
            "parallelism did nothing). Give the model's own plans (ParallelPlan(tp_plan='auto'), for a model of a "
            "library whose adapter cuts it: transformers, diffusers), or cut the batch in training_step with "
            "lightning_ndclip.shard_sequence and attend with context_parallel_attention; or train with cp=1"
        )
