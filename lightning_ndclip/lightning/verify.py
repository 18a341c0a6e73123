"""``VerifyOneDevice``: check, on your own model, that the parallel step equals the plain model on one process.

Before the strategy parallelizes anything (the callback's ``setup``, which Lightning runs before
``configure_model`` and before a declarative plan), the callback copies the LightningModule to the
CPU. During the first accumulation window it keeps every micro-batch. At the window's optimizer
step, before any clipping, it gathers every gradient whole (``DTensor.full_tensor``, one collective
per parameter; rank 0 keeps them) and the micro-batches of every data rank; once the step is done,
rank 0 replays the window on the copy, in float64 where the model runs in it, with the module's own
``training_step``, normalized as one device would:

* the module defines ``count_tokens``: the exact global token mean, ``sum_i n_i loss_i / sum_i n_i``
  (``loss_i`` the mean over the ``n_i`` tokens of micro-batch ``i``; a sum with
  ``loss_reduction="sum"``), whatever the strategy was told: a per-rank mean is caught;
* ``loss_normalization="sample_mean"``: the exact per-sample mean, from ``sample_ids``, each
  token weighted ``1 / (its sample's valid tokens x the window's samples)``;
* otherwise: the mean of the micro-batch losses (Lightning's meaning).

With ``count_tokens`` and a mean loss it also replays the window as one batch (the micro-batches
concatenated: what one device computes), which must equal the weighted micro-batches: a count of other
tokens than the loss averages over, or a loss that is no token mean, is caught there.

A step that draws random numbers (dropout, noise) is replayed with the parallel step's own draws
(:mod:`lightning_ndclip.core.draws`): every rank records the draws of each micro-batch's forward (from
``on_train_batch_start`` to ``on_before_backward``: activation checkpointing's recomputation is not
recorded), sends them to rank 0 with its micro-batches, and each micro-batch's replay draws them instead,
each assembled from the ranks holding its samples: alike on the tp / cp peers (a replicated activation's
mask), or each tp rank's part concatenated in tp rank order (dropout on a colwise layer's heads). Peers
that drew different numbers for a tensor they each hold whole are a mismatch (no one device computes
that); a draw on a ``DTensor``, inside a fused kernel (attention with dropout on CUDA), split over ``cp``,
or with ``pp > 1`` is "not checked", with its reason, and a warning. The window as one batch cannot
reuse the micro-batches' draws: it is left out when the step drew. A step that draws nothing sends
nothing more and is checked as before.

It then compares the window's loss, every parameter's gradient (by the module's own names) and the
total norm, prints a short report on rank 0, and on a mismatch raises ``ValueError`` on every rank
(or warns) naming the parameters and, where it can tell, why: a tie that parallelization split into
two parameters, a gradient ``k`` times the reference (a sum or mean over the wrong mesh dims), a
parameter missing on one side.

The replayed ``training_step`` sees, as ``self.trainer``, one process: its ``strategy`` has the same
``loss_normalization``, ``meshes`` with every dim of size 1 (so a context-parallel step takes the whole
sequence), and a ``run_pipeline`` that runs the unsplit model (``PipelineOptions.module``) on the
whole batch and returns ``pipeline_loss`` (per-token losses or their sum as is; without
``loss_normalization``, the mean of its means over the same pipeline micro-batches as the schedule);
``self.log`` calls are dropped. With ``pp > 1``, each stage's gradients come to rank 0 from one rank
of that stage, by the names of the unsplit model; parameters tied across stages
(``PipelineOptions.tied_parameters``) count once in the norm.

Limits: the plain module must fit in one process's CPU memory: rank 0 holds a copy of it from
``setup`` to the first step, and then the window's micro-batches, every gradient whole, the random
draws of the window's forwards (a CPU copy of every mask, on the rank that drew it and on rank 0) and
the replay at once; random draws are replayed only where they can be (above): those of
``training_step``'s forward, drawn in the same order on one process (one in ``count_tokens`` or
``sample_ids`` is not); the module's weights must be real when ``setup`` runs (not on the meta
device; layers built in ``configure_model`` are not in the copy); ``training_step`` may use of the
trainer only what the one-process stand-in above has.
"""

from __future__ import annotations

import copy
import math
import re
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_ndclip import _compat
from lightning_ndclip.core import libraries
from lightning_ndclip.core.draws import NotReplayable, PeersDrewApart, RandomDraws, Source, assemble_peers
from lightning_ndclip.core.load_balance import LOAD_BALANCING_KEY, PooledRouting
from lightning_ndclip.core.parallel.mesh import ParallelMeshes, one_rank_meshes
from lightning_ndclip.core.parallel.tensor_parallel import tied_parameters
from lightning_ndclip.core.pipeline import unsplit_output
from lightning_ndclip.lightning.callbacks import GlobalNormClip

__all__ = ["VerifyOneDevice"]

_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class VerifyOneDevice(Callback):
    """At the first optimizer step, compare the parallel run with the same module on one process.

    Args:
        on_mismatch: ``"raise"`` (default): a ``ValueError`` on every rank; ``"warn"``: a warning.
        rtol: the largest relative error ``|g - g_ref| / |g_ref|`` of a gradient (and of the loss and
            the total norm) that counts as equal; default by the parameters' dtype: 1e-4 (float32),
            2e-2 (bfloat16), 5e-3 (float16), 1e-8 (float64), or by the least precise dtype the model casts its
            activations to in the one-process replay, where that is lower (a float64 model whose norms compute in
            float32; the report names the first such cast).
        rows: how many of the worst parameters the report lists.
        whole_window: with ``count_tokens``, also replay the window as one batch (its micro-batches
            concatenated), which one device would see, and compare it with the micro-batches weighted
            by their ``count_tokens``: catches a count of other tokens than the loss averages over (a
            model's own loss that shifts the labels) and a loss that is not a mean over tokens (an
            MoE router's auxiliary loss computed per rank). With a ``"load_balancing_loss"``
            (:func:`~lightning_ndclip.lightning.expert_load.router_aux_loss`), each global micro-batch is
            one batch instead. Needs micro-batches of equal shapes but for dim 0 (else the report says
            it was not checked) and room for the whole window's activations. Left out when the step
            draws random numbers (the report says so).

    A step that draws random numbers (dropout) is replayed with its own draws, each micro-batch's, those of
    tensor-parallel peers joined as one device holds them; peers that drew apart are a mismatch, draws that
    cannot be replayed (on a ``DTensor``, split over ``cp``, with ``pp > 1``) make the report "not checked"
    (a warning, not an error).

    Put it before :class:`~lightning_ndclip.GlobalNormClip` in ``callbacks`` (the gradients are
    compared before clipping; the other order is refused at setup). After the first step it does
    nothing: it costs nothing when absent and only the first step when present.
    """

    def __init__(
        self, on_mismatch: Literal["raise", "warn"] = "raise", rtol: float | None = None, rows: int = 5, whole_window: bool = True
    ) -> None:
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}")
        self.on_mismatch, self.rtol, self.rows, self.whole_window = on_mismatch, rtol, rows, whole_window
        self._plain: pl.LightningModule | None = None
        self._batches: list[tuple[int, Any]] = []
        self._outputs: list[float] = []
        self._grads: dict[str, torch.Tensor | None] | None = None
        self._recorder: RandomDraws | None = None
        self._draws: list[list[torch.Tensor]] = []  # this rank's random draws, per micro-batch of the window
        self._unsupported: list[str] = []  # draws that cannot be replayed
        self._one_rank: ParallelMeshes | None = None
        self._done = False
        self._started = self._peak = 0.0
        self.report: str | None = None
        """The report of the check (on rank 0, once done)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._done:
            return
        _refuse_unsupported(trainer, pl_module, self)
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None and (dims.pp > 1 or dims.cp > 1):  # steps that read the meshes: one-rank meshes
            self._one_rank = one_rank_meshes(trainer.strategy.root_device.type)  # collective
        if trainer.global_rank == 0:  # the one process that replays
            memo: dict[int, Any] = {id(trainer): None, id(pl_module.device_mesh): None}
            self._plain = copy.deepcopy(pl_module, memo=memo).cpu()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._done:
            self._batches.append((batch_idx, _on_cpu(batch)))
            self._recorder = RandomDraws()  # the forward's draws, until on_before_backward
            self._recorder.__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._stop_recording()  # backward's draws (activation checkpointing recomputing) are the forward's again

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_recording()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()

    def _stop_recording(self) -> None:
        """Leave the recording mode (once per micro-batch) and keep what it recorded."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
            self._draws.append(recorder.draws)
            self._unsupported += recorder.unsupported

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._done or self._grads is not None:
            return
        self._started, self._peak = time.perf_counter(), _peak_mb()
        keeper = _keeps_gradients(trainer)
        pipeline = _pipeline_options(trainer)
        grads: dict[str, torch.Tensor | None] = {}
        whole: dict[int, torch.Tensor | None] = {}
        for name, param in pl_module.named_parameters(remove_duplicate=False):
            if id(param) not in whole:  # one collective per parameter, on every rank of its stage alike
                grad = param.grad
                full = grad.full_tensor() if isinstance(grad, DTensor) else grad
                whole[id(param)] = full.detach().to("cpu", torch.float64, copy=True) if keeper and full is not None else None
            grads[_plain_name(name, pipeline)] = whole[id(param)]
        self._grads = grads if keeper else {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_recording()  # a micro-batch without backward (training_step returned None)
        if self._done:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._outputs.append(float(loss) if isinstance(loss, torch.Tensor) else math.nan)
        if self._grads is None:  # the window goes on
            return
        self._done = True
        sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        rank0 = trainer.global_rank == 0
        dims = getattr(trainer.strategy, "parallel_dims", None)
        cp_rank = trainer.strategy.meshes["cp"].get_local_rank() if getattr(dims, "cp", 1) > 1 else 0  # type: ignore[attr-defined]
        tp_rank = _tp_rank(trainer)
        # the data rank's micro-batches (its cp / tp / pp peers hold the same); this rank's losses (its cp peers'
        # cover the other parts of the sequence); the gradients of this rank's pipeline stages; its random draws
        # (empty lists without any: nothing more to send)
        mine = (
            int(sampler["rank"]), cp_rank, self._batches, self._outputs, None if rank0 else self._grads,
            tp_rank, self._draws, self._unsupported,
        )  # fmt: skip
        gathered: list[Any] = [mine]
        if trainer.world_size > 1:
            gathered = [None] * trainer.world_size
            dist.gather_object(mine, gathered if rank0 else None, dst=0)
        verdict: list[Any] = [None]
        if rank0:
            by_data_rank = {rank: batches for rank, _, batches, *_ in gathered}
            losses = {(rank, cp): sum(outs) for rank, cp, _, outs, *_ in gathered}
            for stage_grads in (g[4] for g in gathered):
                self._grads.update(stage_grads or {})
            try:
                draws = _StepDraws.of(gathered, _pipeline_options(trainer) is not None)
                with torch.random.fork_rng(devices=[]):  # rank 0's generator as its peers' after the replay
                    data = [by_data_rank[r] for r in sorted(by_data_rank)]
                    verdict[0] = self._compare(trainer, pl_module, data, losses, draws)
            except Exception as error:  # the others wait in the broadcast below: they raise it too
                verdict[0] = f"VerifyOneDevice could not replay the step on one process: {type(error).__name__}: {error}"
        if trainer.world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        self._plain, self._batches, self._grads, self._draws = None, [], None, []
        problem = verdict[0]
        if problem is not None:
            if self.on_mismatch == "raise":
                raise ValueError(problem)
            warnings.warn(problem, UserWarning, stacklevel=2)

    def _compare(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        data: list[list],
        losses: dict[tuple[int, int], float],
        draws: _StepDraws | None = None,
    ) -> str | None:
        """Replay the window on the plain copy (with the step's own random ``draws``, if it drew); print the report;
        the mismatch message, or ``None``."""
        assert self._plain is not None and self._grads is not None
        stand_in = _OneProcessStrategy(trainer.strategy, self._one_rank)
        normalized = stand_in.loss_normalization is not None
        micro_batches = [b for batches in data for b in batches]
        one_process = _OneProcess(trainer, stand_in)
        k = len(data[0])
        if draws is not None and draws.problem:
            return self._unreplayed(k, len(data), draws, f"not checked: {draws.problem}")
        for library in libraries.registered():  # a model whose loss the plan computes on vocabulary shards: the same function
            library.replay_loss_parallel(pl_module, self._plain)
        try:
            plain, dtype, window_loss, pooled, computed = _replay(
                self._plain, data, one_process, None if draws is None else draws.pieces
            )
        except PeersDrewApart as error:
            return self._unreplayed(k, len(data), draws, f"MISMATCH: {error}")
        except NotReplayable as error:
            return self._unreplayed(k, len(data), draws, f"not checked: {error}")
        reference = {_WRAPPERS.sub("", n): p.grad for n, p in plain.named_parameters(remove_duplicate=False)}
        pipeline = _pipeline_options(trainer)
        # Lightning reports each micro-batch's loss over k; a pipeline's is its share of the window already
        parallel_loss = sum(losses.values()) * (k if pipeline else 1) / (1 if normalized else len(data))
        ref_loss = window_loss
        dtypes = {p.dtype for p in pl_module.parameters()} | ({computed.dtype} if computed is not None else set())
        rtol = self.rtol if self.rtol is not None else max(_RTOL.get(d, 1e-4) for d in dtypes)
        stage_ties = [tuple(f"{pipeline.module}.{n}" for n in tie) for tie in pipeline.tied_parameters] if pipeline else []
        parallel_ties = [tuple(_plain_name(n, pipeline) for n in tie) for tie in tied_parameters(pl_module)] + stage_ties
        norm, ref_norm = _total_norm(self._grads, stage_ties), _total_norm(reference, [])
        rows = _rows(self._grads, reference, tied_parameters(plain), parallel_ties, ref_norm)
        bad = [r for r in rows if r[1] > rtol]
        one_batch = (
            self.whole_window and stand_in.loss_reduction == "mean" and stand_in.loss_normalization != "sample_mean"
            and callable(getattr(plain, "count_tokens", None))
        )  # fmt: skip
        window = (
            None if not one_batch
            else _WindowCheck(skipped=f"not checked: {_DREW_NOTE}") if draws is not None
            else _WindowCheck.of(
                self._plain, [[b[m] for b in data] for m in range(k)] if pooled else [micro_batches],
                one_process, dtype, reference, ref_loss, ref_norm,
            )
        )  # fmt: skip
        found = _Found(
            k=k, data_ranks=len(data), dtype=dtype, rtol=rtol, rows=rows, bad=bad, parallel_loss=parallel_loss,
            ref_loss=ref_loss, norm=norm, ref_norm=ref_norm, window=window, draws=draws, computed=computed,
        )  # fmt: skip
        return self._report(found)

    def _report(self, found: _Found) -> str | None:
        """Print the report of a replayed step; the mismatch message, or ``None``."""
        f, rtol = found, found.rtol
        loss_err, norm_err = _relative(f.parallel_loss, f.ref_loss), _relative(f.norm, f.ref_norm)
        window_bad = f.window is not None and f.window.differs(rtol)
        verdict = (
            f"MISMATCH: {len(f.bad)} of {len(f.rows)} parameters beyond rtol {rtol:g}"
            + ("; the window as one batch differs from its micro-batches" if window_bad else "")
            if f.bad or loss_err > rtol or norm_err > rtol or window_bad
            else f"exact: every gradient, the loss and the norm within rtol {rtol:g}"
        )
        lines = [
            f"VerifyOneDevice: the first optimizer step ({f.k} micro-batch(es) x {f.data_ranks} data rank(s)) replayed "
            f"on one process in {str(f.dtype).replace('torch.', '')}",
            f"  loss        parallel {f.parallel_loss:.10g}   one device {f.ref_loss:.10g}   rel. error {loss_err:.1e}",
            f"  total norm  parallel {f.norm:.10g}   one device {f.ref_norm:.10g}   rel. error {norm_err:.1e}",
            f"  worst parameters (of {len(f.rows)}):",
            *(f"    {name:<44} {err:9.1e}  {cause}" for name, err, cause in f.rows[: self.rows]),
            *([] if f.window is None else [f"  as one batch {f.window.summary()}"]),
            *([] if f.draws is None else [f"  random draws  {f.draws.summary()}"]),
            *([] if f.computed is None else [f"  precision   {f.computed.summary(f.dtype)}"]),
            f"  verdict: {verdict}",
            self._cost(),
        ]
        self.report = "\n".join(lines)
        rank_zero_info(self.report)
        if not verdict.startswith("MISMATCH"):
            return None
        named = "; ".join(
            f"{name} (rel. error {err:.1e}{': ' + cause if cause else ''})" for name, err, cause in (f.bad or f.rows)[: self.rows]
        )
        return (
            f"VerifyOneDevice: the parallel run differs from the same module on one process at the first step: "
            f"{verdict}; loss rel. error {loss_err:.1e}, total norm rel. error {norm_err:.1e}. {named}"
            + (f". {f.window.explanation()}" if f.window is not None and window_bad else "")
        )

    def _cost(self) -> str:
        """The report's last line: what the check cost."""
        return (
            f"  the check took {time.perf_counter() - self._started:.2f} s (gathering, replay, comparison); rank 0's "
            f"peak memory grew by {max(0.0, _peak_mb() - self._peak):.0f} MB"
        )

    def _unreplayed(self, k: int, data_ranks: int, draws: _StepDraws | None, verdict: str) -> str | None:
        """The report of a step whose random draws could not be replayed (``verdict`` says why): a warning when
        ``"not checked"``; the mismatch message when peers drew apart."""
        lines = [
            f"VerifyOneDevice: the first optimizer step ({k} micro-batch(es) x {data_ranks} data rank(s)) not replayed "
            "on one process: its random draws",
            *([] if draws is None else [f"  random draws  {draws.summary(replayed=False)}"]),
            f"  verdict: {verdict}",
            self._cost(),
        ]
        self.report = "\n".join(lines)
        rank_zero_info(self.report)
        if verdict.startswith("MISMATCH"):
            return (
                f"VerifyOneDevice: the parallel run differs from the same module on one process at the first step: "
                f"{verdict.removeprefix('MISMATCH: ')}. Seed every rank alike (lightning.seed_everything), and draw "
                "what must differ per rank (noise for this rank's tokens, dropout on this rank's heads) from a stream "
                "of that rank's own"
            )
        reason = verdict.removeprefix("not checked: ")
        rank_zero_warn(f"VerifyOneDevice did not check the first step against one process: {reason}")
        return None


def _refuse_unsupported(trainer: pl.Trainer, pl_module: pl.LightningModule, callback: VerifyOneDevice) -> None:
    """Refuse, the same on every rank, what the check cannot replay."""
    problems = []
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        problems.append("training_step(dataloader_iter) reads its own batches")
    if any(p.is_meta for p in pl_module.parameters()):
        problems.append("the module's weights are on the meta device: there is no initial state to replay")
    if not any(True for _ in pl_module.parameters()):
        problems.append("the module has no parameters before configure_model: build its layers in __init__")
    order = [c for c in trainer.callbacks if isinstance(c, GlobalNormClip) or c is callback]  # type: ignore[attr-defined]
    if order and order[0] is not callback:
        problems.append("it comes after GlobalNormClip in callbacks (it must see the gradients before clipping)")
    if problems:
        raise ValueError("VerifyOneDevice cannot check this run: " + "; ".join(problems))


class _OneProcessStreams:
    """``random_streams`` as a replayed step sees it: one process, one stream; a fork draws from it (the replay feeds
    the step the parallel ranks' recorded draws in any case)."""

    def fork(self, *dims: str) -> AbstractContextManager[None]:
        return nullcontext()


class _OneProcessStrategy:
    """The strategy a replayed step sees: the run's loss normalization, on one process."""

    world_size, global_rank, local_rank = 1, 0, 0
    root_device = torch.device("cpu")

    def __init__(self, strategy: Any, one_rank: ParallelMeshes | None) -> None:
        self.loss_normalization = getattr(strategy, "loss_normalization", None)
        self.loss_reduction = getattr(strategy, "loss_reduction", "mean")
        self.pipeline_options = getattr(strategy, "pipeline_options", None)
        self._one_rank = one_rank
        self.world_mesh = None if one_rank is None else one_rank.world
        self.module: Any = None  # the replayed copy
        self.random_streams = _OneProcessStreams()

    @property
    def meshes(self) -> ParallelMeshes:
        if self._one_rank is None:
            raise RuntimeError("VerifyOneDevice builds one-rank meshes for a replayed step only when pp or cp > 1")
        return self._one_rank

    def run_pipeline(self, inputs: Any = None, target: Any = None) -> torch.Tensor:
        """The unsplit model on the whole batch: ``pipeline_loss`` as is (per-token losses or a sum);
        without loss normalization, the mean of its means over the schedule's micro-batches."""
        options = self.pipeline_options
        if options is None or options.module is None:
            raise RuntimeError("run_pipeline needs NDParallelStrategy(pp > 1)")
        model, loss_of = getattr(self.module, options.module), self.module.pipeline_loss
        if self.loss_normalization is not None:
            return loss_of(unsplit_output(model, inputs), target)
        chunks = options.microbatches
        split = [apply_to_collection(v, torch.Tensor, lambda t: t.tensor_split(chunks)) for v in (inputs, target)]
        return torch.stack([loss_of(unsplit_output(model, x), y) for x, y in zip(*split)]).mean()


class _OneProcess:
    """What a replayed step sees as ``self.trainer``: one process in training; ``self.log`` is dropped
    (``barebones``)."""

    barebones, training = True, True
    world_size = num_devices = num_nodes = 1
    global_rank = local_rank = node_rank = 0

    def __init__(self, trainer: pl.Trainer, strategy: _OneProcessStrategy) -> None:
        self.strategy = strategy
        self.current_epoch, self.global_step = trainer.current_epoch, trainer.global_step
        self.accumulate_grad_batches = trainer.accumulate_grad_batches


def _pipeline_options(trainer: pl.Trainer) -> Any:
    """The run's ``PipelineOptions`` when ``pp > 1``, else ``None``."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return trainer.strategy.pipeline_options if getattr(dims, "pp", 1) > 1 else None  # type: ignore[attr-defined]


def _tp_rank(trainer: pl.Trainer) -> int:
    """This rank's tensor-parallel rank: on ``meshes["tp"]`` (``NDParallelStrategy``), or on the device mesh's
    ``"tensor_parallel"`` dim (Lightning's ``ModelParallelStrategy``); 0 without tensor parallelism."""
    strategy: Any = trainer.strategy
    dims = getattr(strategy, "parallel_dims", None)
    if dims is not None:
        return strategy.meshes["tp"].get_local_rank() if dims.tp > 1 else 0
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh["tensor_parallel"].get_local_rank()


def _keeps_gradients(trainer: pl.Trainer) -> bool:
    """Whether this rank keeps the gradients it gathers whole: rank 0, and with ``pp > 1`` one rank of
    every stage (all its coordinates but ``pp`` zero)."""
    if _pipeline_options(trainer) is None:
        return trainer.global_rank == 0
    world = trainer.strategy.meshes.world  # type: ignore[attr-defined]
    coordinates = zip(world.mesh_dim_names or (), world.get_coordinate() or ())
    return all(c == 0 for name, c in coordinates if name != "pp")


def _plain_name(name: str, pipeline: Any) -> str:
    """A parallel parameter's name in the plain module: wrappers left out, and with ``pp > 1`` the stage
    index the pipeline puts after ``PipelineOptions.module`` (``model.1.layers.2.w`` -> ``model.layers.2.w``)."""
    name = _WRAPPERS.sub("", name)
    if pipeline is not None:
        name = re.sub(rf"^{re.escape(pipeline.module)}\.\d+\.", f"{pipeline.module}.", name)
    return name


def _total_norm(grads: Mapping[str, torch.Tensor | None], ties: list[tuple[str, ...]]) -> float:
    """The 2-norm of every gradient, a tensor held under several names counted once, and so the copies
    of a parameter tied across pipeline stages (``ties``, which hold the same summed gradient)."""
    copies = {name for tie in ties for name in [n for n in tie if n in grads][1:]}
    unique = {id(g): g for name, g in grads.items() if g is not None and name not in copies}
    return math.sqrt(sum(float(g.square().sum()) for g in unique.values()))


def _peak_mb() -> float:
    """This process's peak resident memory so far, in MB (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not on Unix
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _on_cpu(batch: Any) -> Any:
    return apply_to_collection(move_data_to_device(batch, "cpu"), torch.Tensor, lambda t: t.detach().clone())


class _LowestPrecision(TorchFunctionMode):
    """The least precise floating dtype the model casts its activations (tensors with a gradient) to inside, and the
    first call that does: a model run in float64 may compute parts in float32 (diffusers' Wan casts its norms'
    inputs ``.float()``), and its gradients then agree with one device's to float32's rounding, not float64's. Casts
    of tensors without a gradient (a rotary table computed in float32 from a buffer) leave the comparison exact."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype: torch.dtype | None = None
        self.op = ""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (
            isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.requires_grad
            and source.is_floating_point() and out.is_floating_point()
            and torch.finfo(out.dtype).eps > torch.finfo(source.dtype).eps
            and (self.dtype is None or torch.finfo(out.dtype).eps > torch.finfo(self.dtype).eps)
        ):  # fmt: skip
            self.dtype, self.op = out.dtype, getattr(func, "__name__", str(func))
        return out


@dataclass(frozen=True)
class _Computed:
    """A precision below the replay's own dtype that the model cast its activations to (:class:`_LowestPrecision`)."""

    dtype: torch.dtype
    op: str

    def summary(self, replayed_in: torch.dtype) -> str:
        name, run = (str(d).replace("torch.", "") for d in (self.dtype, replayed_in))
        return f"the model casts activations to {name} (first: .{self.op}()) while run in {run}: compared to {name}'s rounding"


def _replay(
    plain: pl.LightningModule,
    data: list[list[tuple[int, Any]]],
    trainer: _OneProcess,
    draws: list[_PieceDraws] | None = None,
) -> tuple[pl.LightningModule, torch.dtype, float, bool, _Computed | None]:
    """A copy of ``plain`` holding the window's gradient, in float64 if the module runs in it (else
    float32), its dtype, the window's loss, whether its steps return a ``"load_balancing_loss"``, and the precision
    below that dtype the model cast its activations to, if any.

    ``data`` holds each data rank's micro-batches; ``draws``, if the step drew random numbers, each micro-batch's
    (in the same order), which its ``training_step`` then draws. A step that returns a load-balancing loss (of the
    global micro-batch: every data rank's micro-batch ``m``) is replayed twice: once to sum each global micro-batch's
    routing statistics, and again with them (:class:`~lightning_ndclip.core.load_balance.PooledRouting`)."""
    pieces = [(m, batch) for batches in data for m, batch in enumerate(batches)]
    for dtype in (torch.float64, torch.float32):
        model = _copy(plain, trainer, dtype)
        try:
            pool, lowest = PooledRouting(), _LowestPrecision()
            with lowest:
                window = _accumulate(model, pieces, trainer.strategy, dtype, pool.record, draws)
            if pool.used:
                model.zero_grad(set_to_none=True)
                window = _accumulate(model, pieces, trainer.strategy, dtype, pool.apply, draws)
            below = lowest.dtype is not None and torch.finfo(lowest.dtype).eps > torch.finfo(dtype).eps
            return model, dtype, window, pool.used, _Computed(lowest.dtype, lowest.op) if below else None  # type: ignore[arg-type]
        except (RuntimeError, TypeError):
            if dtype == torch.float32:
                raise
    raise AssertionError("unreachable")


def _copy(plain: pl.LightningModule, trainer: _OneProcess, dtype: torch.dtype) -> pl.LightningModule:
    """A copy of ``plain`` in ``dtype`` that sees ``trainer`` as its trainer."""
    model = copy.deepcopy(plain).to(dtype).train()
    model.trainer = trainer  # type: ignore[assignment]  # the copy's, never the user's module
    trainer.strategy.module = model
    _compat.set_device_mesh(model, trainer.strategy.world_mesh)
    return model


def _accumulate(
    model: pl.LightningModule,
    pieces: list[tuple[int, tuple[int, Any]]],
    strategy: _OneProcessStrategy,
    dtype: torch.dtype,
    routing: Callable[[int], AbstractContextManager[None]],
    draws: list[_PieceDraws] | None = None,
) -> float:
    """Run ``training_step`` on every micro-batch (``(its index in its window, (batch_idx, batch))``), each inside
    ``routing(index)`` and replaying its random ``draws`` (each pass from its first), its loss weighted as one device
    would weigh it, a load-balancing loss as the mean over the window's micro-batches, and backward; returns the
    window's loss."""
    cast = [(i, _cast(b, dtype)) for _, (i, b) in pieces]
    if strategy.loss_normalization == "sample_mean":
        weights: list[Any] = _sample_weights(model, cast)
    else:
        weights = _token_weights(model, cast, strategy.loss_reduction)
    k = 1 + max(m for m, _ in pieces)
    window = torch.zeros((), dtype=torch.float64)
    for i, ((m, _), (batch_idx, batch), weight) in enumerate(zip(pieces, cast, weights)):
        with routing(m), _replaying(None if draws is None else draws[i]):
            loss, balancing = _training_step(model, batch_idx, batch)
        if loss is None:  # a skipped micro-batch, as Lightning skips it
            continue
        with torch.enable_grad():
            weighted = weight(loss) if callable(weight) else (loss * weight.to(loss.dtype)).sum()
            if balancing is not None:
                weighted = weighted + balancing / k
            weighted.backward()
        window += weighted.detach().double()
    return float(window)


def _replaying(draws: _PieceDraws | None) -> AbstractContextManager[Any]:
    """A micro-batch's forward drawing the parallel step's random numbers (a fresh cursor on every call)."""
    return nullcontext() if draws is None else RandomDraws(replay=draws.sources, label=draws.label)


_DREW_NOTE = "the step drew random numbers, which one batch would draw anew (only its micro-batches replay them)"


@dataclass(frozen=True)
class _PieceDraws:
    """One micro-batch's draws for the replay: where it is (for errors) and one source per draw."""

    label: str
    sources: list[Source]


@dataclass(frozen=True)
class _StepDraws:
    """The window's random draws as one device replays them: each micro-batch's (data ranks in order, then its
    micro-batches), each draw assembled from the ranks holding its samples; or why they cannot be replayed."""

    pieces: list[_PieceDraws]
    count: int  # drawn on all ranks together
    peers: str = ""
    problem: str = ""

    @staticmethod
    def of(gathered: list[Any], pipelined: bool) -> _StepDraws | None:
        """From the gathered ``(data rank, cp rank, ..., tp rank, draws per micro-batch, unsupported)`` of every
        rank; ``None`` when no rank drew (the step is checked as before)."""
        count = sum(len(d) for g in gathered for d in g[6])
        unsupported = [u for g in gathered for u in g[7]]
        if not count and not unsupported:
            return None
        if unsupported:
            more = f" (and {len(unsupported) - 1} more)" if len(unsupported) > 1 else ""
            return _StepDraws([], count, problem=f"a random draw that cannot be replayed: {unsupported[0]}{more}")
        if pipelined:
            return _StepDraws([], count, problem="random draws with pp > 1 (the schedule runs the stages inside training_step)")
        by_rank: dict[int, dict[tuple[int, int], list[list[torch.Tensor]]]] = {}
        for rank, cp, _, _, _, tp, draws, _ in gathered:
            if (cp, tp) in by_rank.setdefault(rank, {}):
                problem = f"random draws on ranks that hold the same samples at the same cp and tp ranks (data rank {rank})"
                return _StepDraws([], count, problem=problem)
            by_rank[rank][(cp, tp)] = draws
        pieces = []
        for rank in sorted(by_rank):
            peers = by_rank[rank]
            cps, tps = sorted({c for c, _ in peers}), sorted({t for _, t in peers})
            for m in range(min(len(d) for d in peers.values())):
                counts = {key: len(d[m]) for key, d in peers.items()}
                if len(set(counts.values())) > 1:
                    drawn = ", ".join(f"cp {c} tp {t}: {n}" for (c, t), n in sorted(counts.items()))
                    problem = (
                        f"data rank {rank}, micro-batch {m}: the ranks holding its samples drew different numbers of "
                        f"random tensors ({drawn})"
                    )
                    return _StepDraws([], count, problem=problem)
                by_cp = [[peers[(c, t)][m] for t in tps if (c, t) in peers] for c in cps]  # each rank's draws
                sources: list[Source] = [
                    partial(assemble_peers, [[drawn[j] for drawn in by_tp] for by_tp in by_cp])
                    for j in range(next(iter(counts.values())))
                ]
                pieces.append(_PieceDraws(f"data rank {rank}, micro-batch {m}", sources))
        sizes = {(len({c for c, _ in p}), len({t for _, t in p})) for p in by_rank.values()}
        cp, tp = max(sizes)
        peers_note = " and ".join(f"{n} {dim} ranks" for dim, n in (("tp", tp), ("cp", cp)) if n > 1)
        return _StepDraws(pieces, count, peers=peers_note)

    def summary(self, replayed: bool = True) -> str:
        if not replayed:
            return f"{self.count} drawn by the ranks"
        joined = f", each assembled from {self.peers}" if self.peers else ""
        return f"{sum(len(p.sources) for p in self.pieces)} replayed (the parallel step's own, per micro-batch{joined})"


def _cast(batch: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _training_step(model: pl.LightningModule, batch_idx: int, batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The loss ``training_step`` returns (``None`` for none) and its ``"load_balancing_loss"`` (or ``None``), with
    gradients enabled."""
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log on the stand-in trainer
        with_index = is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
        out = model.training_step(batch, batch_idx) if with_index else model.training_step(batch)
    loss = out["loss"] if isinstance(out, Mapping) else out
    balancing = out.get(LOAD_BALANCING_KEY) if isinstance(out, Mapping) else None
    return (loss if isinstance(loss, torch.Tensor) else None), balancing


def _token_weights(model: pl.LightningModule, batches: list[tuple[int, Any]], reduction: str) -> list[Any]:
    """Each micro-batch's share of the window's loss, as a function of its loss: with ``count_tokens``,
    the token mean (per-token losses or a sum over the window's tokens; a mean times its tokens over
    them); else the mean of the micro-batch losses."""
    counter = getattr(model, "count_tokens", None)
    if not callable(counter):
        return [torch.tensor(1.0 / len(batches), dtype=torch.float64)] * len(batches)
    counts = [float(counter(b)) for _, b in batches]
    total = max(sum(counts), 1.0)

    def share(n: float) -> Any:
        # a mean over no token is nan (0 / 0): it weighs 0, as the strategy weighs it
        return lambda loss: loss.sum() / total if loss.dim() or reduction == "sum" else loss.nan_to_num(0.0) * (n / total)

    return [share(n) for n in counts]


def _sample_weights(model: pl.LightningModule, batches: list[tuple[int, Any]]) -> list[torch.Tensor]:
    """Each token's weight in the per-sample mean, from ``sample_ids``: ``1 / (its sample's valid tokens
    x the window's samples with a valid token)``, 0 for padding (id -1) and masked tokens."""
    per_batch = []
    for _, batch in batches:
        ids, num_samples, *rest = model.sample_ids(batch)  # type: ignore[operator]
        ids = torch.as_tensor(ids).long()
        mask = (ids >= 0) & (torch.as_tensor(rest[0]).bool() if rest and rest[0] is not None else True)
        tokens = torch.zeros(int(num_samples), dtype=torch.float64).index_add_(
            0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64)
        )
        per_batch.append((ids, mask, tokens))
    samples = sum(int((tokens > 0).sum()) for _, _, tokens in per_batch)
    return [
        torch.where(mask, 1.0 / (tokens[ids.clamp(min=0)].clamp(min=1) * max(samples, 1)), 0.0)
        for ids, mask, tokens in per_batch
    ]


def _relative(got: float, expected: float) -> float:
    return abs(got - expected) / max(abs(expected), 1e-30)


class _Unaligned(ValueError):
    """Micro-batches that cannot be concatenated into one batch."""


def _concatenated(batches: list[Any]) -> Any:
    """The micro-batches as one batch: tensors concatenated along dim 0, in mappings, lists and tuples
    of the same structure; every other value must be equal in all of them. Raises :class:`_Unaligned`."""
    head = batches[0]
    if isinstance(head, torch.Tensor):
        if head.dim() == 0 or any(t.shape[1:] != head.shape[1:] for t in batches):
            raise _Unaligned(f"tensors of shapes {sorted({tuple(t.shape) for t in batches})}")
        return torch.cat(batches)
    if isinstance(head, Mapping):
        if any(set(b) != set(head) for b in batches):
            raise _Unaligned("mappings with different keys")
        joined = {k: _concatenated([b[k] for b in batches]) for k in head}
        try:
            return type(head)(joined)  # type: ignore[call-arg]  # e.g. transformers' BatchEncoding
        except TypeError:
            return joined
    if isinstance(head, (list, tuple)):
        if any(len(b) != len(head) for b in batches):
            raise _Unaligned("sequences of different lengths")
        items = [_concatenated([b[i] for b in batches]) for i in range(len(head))]
        named = isinstance(head, tuple) and type(head) is not tuple  # a namedtuple takes its fields one by one
        return type(head)(*items) if named else type(head)(items)
    if any(b != head for b in batches):
        raise _Unaligned(f"values that differ ({head!r}, ...)")
    return head


_ZERO_GRADIENT = 1e-3
"""A gradient below this fraction of the total norm is compared with that fraction of the norm: one
that is zero in exact arithmetic (a key bias, which the softmax cancels) comes out as rounding noise."""


@dataclass(frozen=True)
class _Found:
    """What replaying a step found, for its report: the window (``k`` micro-batches of ``data_ranks`` ranks) replayed
    in ``dtype``, compared within ``rtol``; each parameter's row (name, relative error, cause), those beyond ``rtol``;
    the loss and the total norm, parallel and one device; the window as one batch, the step's draws, the precision
    the model computed in (each where checked)."""

    k: int
    data_ranks: int
    dtype: torch.dtype
    rtol: float
    rows: list[tuple[str, float, str]]
    bad: list[tuple[str, float, str]]
    parallel_loss: float
    ref_loss: float
    norm: float
    ref_norm: float
    window: _WindowCheck | None
    draws: _StepDraws | None
    computed: _Computed | None


@dataclass(frozen=True)
class _WindowCheck:
    """The window replayed as one batch (what one device computes) against its micro-batches weighted
    by ``count_tokens``: the loss's relative error and the worst gradient, or why it was not checked."""

    loss: float = math.nan
    loss_error: float = 0.0
    worst: tuple[str, float, str] | None = None
    skipped: str = ""

    @staticmethod
    def of(
        plain: pl.LightningModule,
        groups: list[list[tuple[int, Any]]],
        trainer: _OneProcess,
        dtype: torch.dtype,
        reference: dict[str, torch.Tensor | None],
        ref_loss: float,
        ref_norm: float,
    ) -> _WindowCheck:
        """``groups``: the whole window as one group; or, for steps that return a load-balancing loss (of each global
        micro-batch), each global micro-batch (the data ranks' micro-batch ``m``) as one batch, its mean weighted by
        its ``count_tokens`` and its load-balancing loss by ``1 / k``."""
        try:
            joined = [_cast(_concatenated([b for _, b in group]), dtype) for group in groups]
        except _Unaligned as error:
            return _WindowCheck(skipped=f"not checked: the micro-batches do not concatenate ({error})")
        model = _copy(plain, trainer, dtype)
        value = 0.0
        try:
            counts = [float(model.count_tokens(b)) for b in joined] if len(groups) > 1 else [1.0]  # type: ignore[operator]
            for group, batch, count in zip(groups, joined, counts):
                loss, balancing = _training_step(model, group[0][0], batch)
                if loss is None or loss.dim():
                    return _WindowCheck(skipped="not checked: training_step returns no mean (per-token losses, or none)")
                if count and not torch.isfinite(loss):
                    return _WindowCheck(skipped="not checked: the whole window's mean is not finite (no valid token?)")
                with torch.enable_grad():
                    weighted = loss * (count / max(sum(counts), 1.0)) if count else torch.zeros_like(loss)
                    if balancing is not None:
                        weighted = weighted + balancing / len(groups)
                    weighted.backward()
                value += float(weighted.detach())
        except Exception as error:  # a step written for its micro-batch size: the check is left out, not the run
            failed = f"{type(error).__name__}: {error}"
            return _WindowCheck(skipped=f"not checked: training_step failed on the whole window ({failed})")
        grads = {_WRAPPERS.sub("", n): p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        rows = _rows(grads, reference, [], [], ref_norm)
        return _WindowCheck(value, _relative(value, ref_loss), rows[0] if rows else None)

    def differs(self, rtol: float) -> bool:
        return not self.skipped and (self.loss_error > rtol or (self.worst is not None and self.worst[1] > rtol))

    def summary(self) -> str:
        if self.skipped:
            return self.skipped
        worst = "" if self.worst is None else f"; worst gradient {self.worst[0]} {self.worst[1]:.1e}"
        return f" loss {self.loss:.10g}   rel. error {self.loss_error:.1e} (against the micro-batches){worst}"

    def explanation(self) -> str:
        worst = "" if self.worst is None else f", {self.worst[0]} rel. error {self.worst[1]:.1e}"
        return (
            f"The window as one batch (what one device computes) differs from its micro-batches weighted by "
            f"count_tokens (loss rel. error {self.loss_error:.1e}{worst}): count_tokens must count exactly the "
            "tokens the loss averages over (a model's own loss that shifts the labels, as transformers' "
            "`labels=` does, averages over labels[:, 1:]), and a loss that is not a mean over tokens (an MoE "
            "router's auxiliary loss computed per rank, batch statistics) cannot equal one device once split into "
            "micro-batches: for a transformers MoE, return lightning_ndclip.router_aux_loss(...) as "
            "'load_balancing_loss' (docs/howto/moe-balancing.md; VerifyOneDevice(whole_window=False) leaves this "
            "check out)"
        )


def _rows(
    grads: dict[str, torch.Tensor | None],
    reference: dict[str, torch.Tensor | None],
    plain_ties: list[tuple[str, ...]],
    parallel_ties: list[tuple[str, ...]],
    total_norm: float,
) -> list[tuple[str, float, str]]:
    """``(name, relative error, cause)`` for every parameter, worst first (errors of gradients below
    ``_ZERO_GRADIENT`` of ``total_norm`` relative to that)."""
    tied_together = {frozenset(t) for t in parallel_ties}
    split_ties = {
        name: [n for n in tie if n != name]
        for tie in plain_ties
        if frozenset(tie) not in tied_together
        for name in tie
    }
    rows = []
    for name in sorted(set(grads) | set(reference)):
        if name not in grads:
            rows.append((name, math.inf, "not in the parallel model"))
            continue
        if name not in reference:
            rows.append((name, math.inf, "not in the plain model"))
            continue
        got, expected = grads[name], reference[name]
        if expected is None or got is None:
            missing = "no gradient in the parallel run" if got is None else "no gradient on one device"
            rows.append((name, 0.0 if got is expected else math.inf, "" if got is expected else missing))
            continue
        error = float((got - expected).norm()) / max(float(expected.norm()), _ZERO_GRADIENT * total_norm, 1e-30)
        rows.append((name, error, _cause(name, got, expected, split_ties)))
    return sorted(rows, key=lambda r: -r[1])


def _cause(name: str, got: torch.Tensor, expected: torch.Tensor, split_ties: dict[str, list[str]]) -> str:
    if name in split_ties:
        return f"one tensor with {split_ties[name]} in the model, a separate parameter after parallelization"
    ref = float(expected.square().sum())
    if ref == 0.0:
        return ""
    ratio = float((got * expected).sum()) / ref
    cosine = float((got * expected).sum() / (got.norm() * expected.norm()).clamp(min=1e-30))
    if cosine > 1 - 1e-6 and abs(ratio - 1) > 1e-3:
        factor = f"{ratio:.4g} times" if ratio >= 1 else f"1/{1 / ratio:.4g} of"
        return f"{factor} the one-device gradient: a sum or mean over the wrong mesh dims (or a missing normalization)"
    return ""
