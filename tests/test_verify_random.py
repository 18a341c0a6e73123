"""``VerifyOneDevice`` on a step that draws random numbers (dropout): the replay on one process draws the parallel
step's own numbers (``lightning_ndclip.core.draws``), so dropout on FSDP2 and on FSDP2 x TP (on the replicated output
of a rowwise layer and on the colwise-split hidden features) is exact against the plain module, and the same check
with fresh draws is not; tp peers that drew apart are reported, never "exact"; what cannot be replayed is "not
checked" with its reason, not a mismatch."""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group
from lightning.pytorch.strategies import ModelParallelStrategy
from test_verify import token_batches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

import lightning_ndclip as nd
from lightning_ndclip.core import draws as draws_module
from lightning_ndclip.core.draws import NotReplayable, PeersDrewApart, RandomDraws, assemble, assemble_peers
from lightning_ndclip.lightning import verify

V, D, P = 16, 8, 0.3


class DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.hidden_drop, self.out_drop = nn.Dropout(P), nn.Dropout(P)
        self.own_stream: Any = None  # set on the parallel module: a stream of each tp rank's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under tp: hidden_drop on each rank's colwise half of the features (a mask of that rank's own: the halves
        # differ, so their order counts), out_drop on the replicated output (alike on the tp peers)
        with self.own_stream("tp") if self.own_stream is not None else nullcontext():
            hidden = self.hidden_drop(torch.tanh(self.up(x)))
        return x + self.out_drop(self.down(hidden))


class DropLM(L.LightningModule):
    """A tiny float64 LM with dropout in its blocks; ``apart``: tp rank 1 draws from another seed."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.Sequential(DropBlock(), DropBlock())
        self.head = nn.Linear(D, V, bias=False)
        self.double()
        self.apart, self.tp_rank = apart, 0  # tp_rank set on the parallel module only (the replay's copy keeps 0)

    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, nd.NDParallelStrategy):
            self.tp_rank = strategy.meshes["tp"].get_local_rank() if strategy.parallel_dims.tp > 1 else 0
        else:  # Lightning's ModelParallelStrategy
            self.tp_rank = self.device_mesh["tensor_parallel"].get_local_rank()

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        streams = getattr(self.trainer.strategy, "random_streams", None)  # NDParallelStrategy's, the replay's stand-in
        for block in self.blocks:
            block.own_stream = streams.fork if streams is not None else None
        tokens, labels = batch
        if not self.apart:
            return self._loss(tokens, labels)
        with torch.random.fork_rng(devices=[]):  # every rank's stream ends where it began: only the masks differ
            if self.tp_rank == 1:
                torch.manual_seed(1234 + batch_idx)
            return self._loss(tokens, labels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def _loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return token_batches(V)


TP_PLAN = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


class ConfiguredDropLM(DropLM):
    """Parallelized in configure_model, the Lightning way (ModelParallelStrategy: no replica check of its own), its
    loss Lightning's mean of the micro-batch means (no count_tokens: ModelParallelStrategy does not normalize)."""

    count_tokens = None

    def configure_model(self) -> None:
        parallelize_module(self, self.device_mesh["tensor_parallel"], TP_PLAN)
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


def _strategy(layout: str) -> Any:
    if layout == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    if layout == "fsdp":
        return nd.NDParallelStrategy(dp_shard=2, loss_normalization="token_mean", summary=False,
                                     plan=nd.ParallelPlan(fsdp_units=[DropBlock]))  # fmt: skip
    return nd.NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean", summary=False,
                                 plan=nd.ParallelPlan(tp_plan=TP_PLAN, fsdp_units=[DropBlock]))  # fmt: skip


def _fit(module: L.LightningModule, layout: str, fresh_draws: bool = False) -> dict:
    """One verified step; ``fresh_draws``: the replay draws its own numbers (what it did before it replayed)."""
    use_existing_process_group()
    check = nd.VerifyOneDevice(on_mismatch="warn")
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=_strategy(layout), max_steps=1,
        accumulate_grad_batches=2, logger=False, callbacks=[check, nd.GlobalNormClip(1.0)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    fresh = mock.patch.object(verify, "_replaying", lambda draws: nullcontext()) if fresh_draws else nullcontext()
    with warnings.catch_warnings(record=True) as caught, fresh:
        warnings.simplefilter("always")
        trainer.fit(module)
    return {"report": check.report, "warned": [str(w.message) for w in caught if "VerifyOneDevice" in str(w.message)]}


def _dropout_case(layout: str, fresh_draws: bool) -> dict:
    return _fit(DropLM(), layout, fresh_draws)


def _reversed_tp_case() -> dict:
    """The tp ranks' parts joined in the wrong order (the check of the order's test)."""
    right = draws_module.assemble
    with mock.patch.object(draws_module, "assemble", lambda pieces, shape, peers="tp": right(pieces[::-1], shape, peers)):
        return _fit(DropLM(), "fsdp_tp")


def _errors(report: str) -> tuple[float, float]:
    """The report's loss and worst-gradient relative errors."""
    loss = float(re.search(r"loss .* rel\. error (\S+)", report).group(1))
    worst = float(re.search(r"worst parameters \(of \d+\):\n\s+\S+\s+(\S+)", report).group(1))
    return loss, worst


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_dropout_is_replayed_exactly(layout):
    """dp_shard=2 (2 ranks) and dp_shard=2 x tp=2 (4 ranks), accumulation 2, dropout 0.3 in every block: exact in
    float64 with the step's own draws; with fresh draws (the replay before this change) the same check fails."""
    world = 2 if layout == "fsdp" else 4
    results = run_on_ranks(world, _dropout_case, layout, False)
    report = results[0]["report"]
    assert all(r["warned"] == [] for r in results), results[0]["warned"]
    assert "verdict: exact" in report and "in float64" in report, report
    assert "random draws  16 replayed" in report, report  # 2 blocks x 2 dropouts x 2 micro-batches x 2 data ranks
    assert ("assembled from 2 tp ranks" in report) == (layout == "fsdp_tp"), report
    assert "as one batch not checked: the step drew random numbers" in report, report
    loss_err, worst = _errors(report)
    assert loss_err < 1e-12 and worst < 1e-12, report

    fresh = run_on_ranks(world, _dropout_case, layout, True)
    assert "verdict: MISMATCH" in fresh[0]["report"], fresh[0]["report"]
    assert all(len(r["warned"]) == 1 and "MISMATCH" in r["warned"][0] for r in fresh), fresh[0]["warned"]
    assert _errors(fresh[0]["report"])[1] > 1e-2, fresh[0]["report"]
    if layout == "fsdp_tp":  # each tp rank's hidden mask is its own: joined in the other order, they mismatch
        assert "verdict: MISMATCH" in run_on_ranks(4, _reversed_tp_case)[0]["report"]


def _apart_case(layout: str, apart: bool) -> dict:
    module = ConfiguredDropLM(apart) if layout == "model_parallel" else DropLM(apart)
    try:
        return _fit(module, layout)
    except ValueError as error:  # a check of the strategy's own
        return {"report": None, "warned": [], "raised": str(error)}


def test_tp_peers_that_draw_apart_are_reported():
    """tp rank 1 draws its masks from another seed: the replicated output's mask differs between the tp peers, which
    no one device computes. Under Lightning's ModelParallelStrategy VerifyOneDevice reports it, naming the tp ranks
    (the same run with the peers alike: exact); NDParallelStrategy's own check of the replicas' gradients stops it
    first. Never "exact"."""
    results = run_on_ranks(4, _apart_case, "model_parallel", True)
    report = results[0]["report"]
    assert "verdict: MISMATCH" in report and "exact" not in report, report
    assert "the tp ranks 0 and 1 drew different random numbers" in report, report
    for result in results:
        assert len(result["warned"]) == 1 and "tp ranks 0 and 1" in result["warned"][0], result["warned"]
    alike = run_on_ranks(4, _apart_case, "model_parallel", False)[0]
    assert alike["warned"] == [] and "verdict: exact" in alike["report"], alike
    assert "assembled from 2 tp ranks" in alike["report"], alike["report"]
    for result in run_on_ranks(4, _apart_case, "fsdp_tp", True):
        assert "differ between tensor-parallel ranks" in result["raised"] and "dropout" in result["raised"], result


class DTensorDropLM(DropLM):
    """The hidden features stay a DTensor (``use_local_output=False``): its dropout draws on a DTensor."""


def _dtensor_case() -> dict:
    use_existing_process_group()
    plan = {"blocks.*.up": ColwiseParallel(use_local_output=False), "blocks.*.down": RowwiseParallel()}
    strategy = nd.NDParallelStrategy(tp=2, loss_normalization="token_mean", summary=False, plan=nd.ParallelPlan(tp_plan=plan))
    check = nd.VerifyOneDevice()  # "raise": a not-checked step must not raise
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, callbacks=[check],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DTensorDropLM())
    return {"report": check.report, "warned": [str(w.message) for w in caught if "VerifyOneDevice" in str(w.message)]}


def test_a_draw_on_a_dtensor_is_not_checked():
    results = run_on_ranks(2, _dtensor_case)
    report = results[0]["report"]
    assert "verdict: not checked: a random draw that cannot be replayed: aten.bernoulli_" in report, report
    assert "on a DTensor" in report and "MISMATCH" not in report, report
    assert len(results[0]["warned"]) == 1 and "did not check" in results[0]["warned"][0], results[0]["warned"]


# --- the draws module on one process -------------------------------------------------------------------------------


def test_dropout_and_draws_are_recorded_and_replayed():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    before = torch.get_rng_state()
    with RandomDraws() as recorder:
        y = F.dropout(x, P)  # the CPU's bernoulli_
        noise = torch.rand(3)
        out, mask = torch.native_dropout(x, 0.5, True)  # CUDA's dropout
        F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])  # tagged, no dropout: no draw
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    F.dropout(x, P), torch.rand(3), torch.native_dropout(x, 0.5, True)
    assert torch.equal(torch.get_rng_state(), after)  # recording draws nothing more
    assert [d.shape for d in recorder.draws] == [(4, 6), (3,), (4, 6)] and recorder.unsupported == []
    (y.sum() + (out * 2).sum()).backward()
    grad, x.grad = x.grad.clone(), None

    torch.manual_seed(123)  # other numbers: the replay must not use them
    with RandomDraws(replay=recorder.draws):
        y2 = F.dropout(x, P)
        noise2 = torch.rand(3, dtype=torch.float64)  # the recorded numbers, cast to the requested dtype
        out2, mask2 = torch.native_dropout(x, 0.5, True)
    (y2.sum() + (out2 * 2).sum()).backward()
    assert torch.equal(y, y2) and torch.equal(out, out2) and torch.equal(mask, mask2) and torch.equal(grad, x.grad)
    assert noise2.dtype == torch.float64 and torch.equal(noise.double(), noise2)
    with RandomDraws(replay=[recorder.draws[0]]):  # a CPU mask replayed by CUDA's native_dropout, and back
        assert torch.allclose(torch.native_dropout(x, P, True)[0], y)
    with RandomDraws(replay=[recorder.draws[2]]):
        assert torch.allclose(F.dropout(x, 0.5), out)
    assert not torch.equal(F.dropout(x, P), y)  # fresh numbers differ: the checks above can fail


def test_a_kernel_that_draws_inside_is_named_not_recorded():
    x = torch.randn(2, 3, 4, 8)
    with RandomDraws() as recorder:
        F.scaled_dot_product_attention(x, x, x)  # tagged as seeded: no draw without dropout
        F.rrelu(x, training=True)  # its noise drawn inside the kernel
    assert recorder.draws == [] and len(recorder.unsupported) == 1, recorder.unsupported
    assert "aten.rrelu_with_noise" in recorder.unsupported[0] and "draws its random numbers inside" in recorder.unsupported[0]
    with pytest.raises(NotReplayable, match="rrelu_with_noise"), RandomDraws(replay=[]):
        F.rrelu(x, training=True)


def test_a_replay_that_does_not_fit_raises():
    x = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > P).float()
    for step, message in [
        (lambda: (F.dropout(x, P), F.dropout(x, P)), "draws more random tensors than the parallel step did"),
        (lambda: F.dropout(x[:2], P), "the replay asks for shape (2, 6), the parallel step drew (4, 6)"),
        (lambda: None, "the replay drew 0 random tensor(s) where the parallel step drew 1"),
    ]:
        with pytest.raises(NotReplayable, match=re.escape(message)), RandomDraws(replay=[mask], label="micro-batch 0"):
            step()


def test_assemble():
    a, b = torch.rand(2, 3), torch.rand(2, 3)
    assert assemble([a, a.clone()], (2, 3)) is a  # peers alike: the tensor
    with pytest.raises(PeersDrewApart, match="the tp ranks 0 and 1 drew different random numbers"):
        assemble([a, b], (2, 3))
    assert torch.equal(assemble([a, b], (2, 6)), torch.cat([a, b], dim=1))  # each rank's heads, in tp rank order
    assert torch.equal(assemble([a, b[:1]], (3, 3)), torch.cat([a, b[:1]]))  # uneven parts
    for shape in [(4, 6), (2, 5), (6,)]:
        with pytest.raises(NotReplayable, match="the tp ranks drew shapes"):
            assemble([a, b], shape)
    # over cp: a per-sample draw alike on the cp ranks; one split over the sequence is not replayable
    assert assemble_peers([[a], [a.clone()]], (2, 3)) is a
    with pytest.raises(PeersDrewApart, match="the cp ranks 0 and 1"):
        assemble_peers([[a], [b]], (2, 3))
    with pytest.raises(NotReplayable, match="split over cp"):
        assemble_peers([[a], [b]], (2, 6))


def _dtensor_draw() -> list[str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    with RandomDraws() as recorder:
        F.dropout(x, P)
    with pytest.raises(NotReplayable, match="on a DTensor"), RandomDraws(replay=[torch.ones(4, 4)]):
        F.dropout(x, P)
    return recorder.unsupported


def test_a_draw_on_a_dtensor_is_named_not_recorded():
    for unsupported in run_on_ranks(2, _dtensor_draw):
        assert len(unsupported) == 1 and "on a DTensor" in unsupported[0], unsupported


def test_the_step_draws_group_by_data_rank_and_name_what_cannot_replay():
    from lightning_ndclip.lightning.verify import _StepDraws

    a, b = torch.rand(2, 3), torch.rand(2, 3)

    def rank(data, cp, tp, draws, unsupported=()):
        return (data, cp, [], [], None, tp, draws, list(unsupported))

    assert _StepDraws.of([rank(0, 0, 0, [[], []]), rank(1, 0, 0, [[], []])], False) is None  # no draw: as before
    two_tp = [rank(0, 0, 0, [[a]]), rank(0, 0, 1, [[b]]), rank(1, 0, 0, [[b]]), rank(1, 0, 1, [[b]])]
    step = _StepDraws.of(two_tp, False)
    assert step is not None and not step.problem and step.peers == "2 tp ranks"
    assert [p.label for p in step.pieces] == ["data rank 0, micro-batch 0", "data rank 1, micro-batch 0"]
    assert torch.equal(step.pieces[0].sources[0](torch.Size((2, 6))), torch.cat([a, b], 1))
    assert "pp > 1" in _StepDraws.of(two_tp, True).problem
    uneven = [rank(0, 0, 0, [[a]]), rank(0, 0, 1, [[a, b]])]
    assert "drew different numbers of random tensors (cp 0 tp 0: 1, cp 0 tp 1: 2)" in _StepDraws.of(uneven, False).problem
    named = _StepDraws.of([rank(0, 0, 0, [[]], ["aten.rrelu_with_noise.default (a kernel ...)"])], False)
    assert "cannot be replayed: aten.rrelu_with_noise" in named.problem
