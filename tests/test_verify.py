"""``VerifyOneDevice`` on the traps it must catch, each reproduced and reported with the right parameters named
(a tie split by tensor parallelism, a fused qkv split wrongly, a per-rank mean, a loss left unnormalized under SUM
reductions), and on correct layouts, which pass. (An HSDP unit without its replicate dim never gets that far: the
strategy refuses it at setup.)"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from lightning.pytorch.strategies import ModelParallelStrategy
from test_context_trainer import _CausalLMModule, _DiTModule
from test_pipeline_trainer import _PipelinedLM, _TiedPipelinedLM
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd
from lightning_ndclip.core.context.attention import shard_sequence

V, D = 16, 8


class Block(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.up = nn.Linear(D, 3 * D if fused else 2 * D)
        self.down = nn.Linear(D if fused else 2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:  # q, k, v packed in one projection
            q, k, v = self.up(x).chunk(3, dim=-1)
            return x + self.down(q * torch.sigmoid(k) + v)
        return x + self.down(torch.tanh(self.up(x)))


def token_batches(vocab: int = V) -> torch.utils.data.DataLoader:
    """16 rows of 6 token ids and their labels (some ignored: uneven token counts), 2 rows a batch."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (16, 6), generator=g)
    labels = torch.randint(0, vocab, (16, 6), generator=g)
    labels[torch.rand(16, 6, generator=g) < 0.4] = -100  # uneven token counts
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=2)


class LM(L.LightningModule):
    def __init__(self, tied: bool = False, fused: bool = False, tokens: bool = True, configure=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.Sequential(Block(fused), Block(fused))
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.tokens, self.configure = tokens, configure

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return token_batches()


class CountingLM(LM):
    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()


class SampleLM(LM):
    """Every row a sample; training_step returns per-token losses, as loss_normalization='sample_mean' wants."""

    def sample_ids(self, batch):
        tokens, labels = batch
        ids = torch.arange(tokens.shape[0])[:, None].expand(tokens.shape)
        return ids, tokens.shape[0], labels != -100

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        losses = nn.functional.cross_entropy(self(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
        return losses.view(labels.shape)


class ConfiguredLM(LM):
    """Parallelized in configure_model, the Lightning way."""

    def configure_model(self) -> None:
        self.configure(self)


def _fit(module: L.LightningModule, strategy, devices: int = 4, clip: bool = True, whole_window: bool = True) -> dict:
    use_existing_process_group()
    verify = nd.VerifyOneDevice(on_mismatch="warn", whole_window=whole_window)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, accumulate_grad_batches=2, logger=False,
        callbacks=[verify, *([nd.GlobalNormClip(1.0)] if clip else [])], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return {"report": verify.report, "warned": [str(w.message) for w in caught if "VerifyOneDevice" in str(w.message)]}


# --- correct layouts pass ------------------------------------------------------------------------------------------

TP_PLAN = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def _correct_case(layout: str) -> dict:
    strategies = {
        "fsdp": lambda: nd.NDParallelStrategy(dp_shard=4, loss_normalization="token_mean", summary=False,
                                              plan=nd.ParallelPlan(fsdp_units=[Block])),
        "fsdp_tp_tied": lambda: nd.NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean", summary=False,
                                                      plan=nd.ParallelPlan(tp_plan=TP_PLAN, fsdp_units=[Block])),
        "hsdp": lambda: nd.NDParallelStrategy(dp_replicate=2, dp_shard=2, summary=False,
                                              plan=nd.ParallelPlan(fsdp_units=[Block])),
        "fsdp_sample_mean": lambda: nd.NDParallelStrategy(dp_shard=4, loss_normalization="sample_mean", summary=False,
                                                          plan=nd.ParallelPlan(fsdp_units=[Block])),
    }  # fmt: skip
    if layout == "fsdp_sample_mean":
        return _fit(SampleLM(), strategies[layout]())
    module = LM(tied=True) if layout == "hsdp" else CountingLM(tied=layout == "fsdp_tp_tied")
    return _fit(module, strategies[layout]())


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp_tied", "hsdp", "fsdp_sample_mean"])
def test_a_correct_layout_passes(layout):
    results = run_on_ranks(4, _correct_case, layout)
    assert all(r["warned"] == [] for r in results), results[0]["warned"]
    report = results[0]["report"]
    assert "verdict: exact" in report and "in float64" in report, report
    assert results[1]["report"] is None  # the report is rank 0's
    if layout.startswith("fsdp") and layout != "fsdp_sample_mean":  # count_tokens and a mean: the window as one batch too
        assert "as one batch  loss" in report and "not checked" not in report, report


# --- the traps -----------------------------------------------------------------------------------------------------


def _split_tie(module: L.LightningModule) -> None:  # Lightning's way, without the strategy's tie keeping
    tp = module.device_mesh["tensor_parallel"]
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(module, tp, plan)
    fully_shard(module, mesh=module.device_mesh["data_parallel"])


def _fused_colwise(module: L.LightningModule) -> None:  # q, k and v split as one weight: each rank's chunk(3) mixes them
    parallelize_module(module, module.device_mesh["tensor_parallel"], TP_PLAN)
    fully_shard(module, mesh=module.device_mesh["data_parallel"])


def _trap_case(trap: str) -> dict:
    if trap == "tie":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        return _fit(ConfiguredLM(tied=True, configure=_split_tie), strategy)
    if trap == "fused_qkv":  # NDParallelStrategy names it at the first forward (test_split_activations_trainer.py)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        return _fit(ConfiguredLM(fused=True, configure=_fused_colwise), strategy)
    if trap == "per_rank_mean":  # count_tokens says the loss is a token mean; the strategy averages rank means
        return _fit(CountingLM(), nd.NDParallelStrategy(dp_shard=4, summary=False, plan=nd.ParallelPlan(fsdp_units=[Block])))
    # "unnormalized": SUM reductions asked for, the loss left a per-rank mean: every gradient dp x accumulation too big
    return _fit(LM(), nd.NDParallelStrategy(dp_shard=4, sum_reduction=True, summary=False,
                                            plan=nd.ParallelPlan(fsdp_units=[Block])))  # fmt: skip


@pytest.mark.parametrize(
    ("trap", "named", "cause"),
    [
        ("tie", ["head.weight", "embed.weight"], "a separate parameter after parallelization"),
        ("fused_qkv", ["blocks.0.up.weight", "blocks.1.up.weight"], ""),
        ("per_rank_mean", ["head.weight"], ""),
        ("unnormalized", [], "4 times the one-device gradient"),  # a SUM of 4 rank means
    ],
)
def test_a_trap_is_caught_naming_the_parameters(trap, named, cause):
    results = run_on_ranks(4, _trap_case, trap)
    for result in results:  # the same warning on every rank
        assert len(result["warned"]) == 1 and "MISMATCH" in result["warned"][0], result["warned"]
        message = result["warned"][0]
        for name in named:
            assert name in message or name in results[0]["report"], (name, results[0]["report"])
        assert cause in message, message
    assert "verdict: MISMATCH" in results[0]["report"]


# --- the window as one batch: count_tokens must count what the loss averages over --------------------------------


class ShiftingLM(LM):
    """The loss shifts the labels itself, as transformers' ``labels=`` does (position t predicts label t + 1);
    ``count_tokens`` counts the labels the loss reads (``shifted``) or, the trap, every label."""

    def __init__(self, shifted: bool, zero_gradient: bool = False) -> None:
        super().__init__()
        self.shifted = shifted
        # zero_gradient: a shift added to every logit, which the softmax cancels: its gradient is 0 in exact arithmetic
        self.logit_shift = nn.Parameter(torch.zeros(1)) if zero_gradient else None

    def count_tokens(self, batch) -> torch.Tensor:
        labels = batch[1]
        return (labels[:, 1:] if self.shifted else labels).ne(-100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)[:, :-1] + (0.0 if self.logit_shift is None else self.logit_shift)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _shifting_case(shifted: bool, whole_window: bool = True, zero_gradient: bool = False) -> dict:
    strategy = nd.NDParallelStrategy(dp_shard=4, loss_normalization="token_mean", summary=False,
                                     plan=nd.ParallelPlan(fsdp_units=[Block]))  # fmt: skip
    return _fit(ShiftingLM(shifted, zero_gradient), strategy, whole_window=whole_window)


def test_a_count_of_other_tokens_than_the_loss_averages_is_caught():
    """The parallel run follows count_tokens, and so does the micro-batch replay: only the window as one batch,
    what one device computes, shows that the count includes labels the loss never reads."""
    results = run_on_ranks(4, _shifting_case, False)
    for result in results:
        assert len(result["warned"]) == 1 and "the window as one batch differs" in result["warned"][0], result["warned"]
        assert "labels[:, 1:]" in result["warned"][0]
    report = results[0]["report"]
    assert "verdict: MISMATCH: 0 of" in report, report  # every gradient equals the replay weighted the same way
    blind = run_on_ranks(4, _shifting_case, False, False)[0]["report"]
    assert "verdict: exact" in blind and "as one batch" not in blind, blind  # the check left out: the trap passes
    right = run_on_ranks(4, _shifting_case, True)[0]
    assert right["warned"] == [] and "verdict: exact" in right["report"] and "as one batch  loss" in right["report"]


def test_a_gradient_that_is_zero_in_exact_arithmetic_is_no_mismatch():
    """A shift of every logit has gradient 0; float32 on 4 ranks leaves rounding noise there that is
    enormous relative to float64's: it is compared against the total norm instead (it was reported as a
    mismatch of relative error 6e8)."""
    result = run_on_ranks(4, _shifting_case, True, True, True)[0]
    assert result["warned"] == [], result["warned"]
    assert "verdict: exact" in result["report"], result["report"]


def test_micro_batches_concatenate_by_structure():
    from collections import namedtuple

    from lightning_ndclip.lightning.verify import _concatenated, _Unaligned

    pair = namedtuple("pair", "x y")
    a = {"ids": torch.zeros(2, 3), "meta": "same", "pair": pair(torch.zeros(2), [torch.ones(2, 1)])}
    b = {"ids": torch.ones(1, 3), "meta": "same", "pair": pair(torch.ones(1), [torch.zeros(1, 1)])}
    joined = _concatenated([a, b])
    assert joined["ids"].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]] and joined["meta"] == "same"
    assert isinstance(joined["pair"], pair) and joined["pair"].x.tolist() == [0, 0, 1]
    assert joined["pair"].y[0].shape == (3, 1)
    for other in ({**b, "ids": torch.ones(1, 4)}, {**b, "meta": "other"}, {"ids": b["ids"]}):
        with pytest.raises(_Unaligned):
            _concatenated([a, other])


# --- what it refuses -----------------------------------------------------------------------------------------------


def _after_clip_case() -> str:
    use_existing_process_group()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=nd.NDParallelStrategy(summary=False, plan=nd.ParallelPlan(fsdp_units=[Block])),
        max_steps=1, logger=False, callbacks=[nd.GlobalNormClip(1.0), nd.VerifyOneDevice()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(LM())
    except ValueError as error:
        return str(error)
    return "ran"


def test_it_refuses_to_come_after_the_clip():
    for message in run_on_ranks(2, _after_clip_case):
        assert "VerifyOneDevice cannot check this run" in message and "after GlobalNormClip" in message


class TrainerBoundLM(LM):
    """A training_step that reads what the replay's one-process stand-in trainer does not have (its metrics)."""

    def training_step(self, batch, batch_idx):
        assert self.trainer.callback_metrics is not None
        return super().training_step(batch, batch_idx)


def _replay_failure_case() -> dict:
    return _fit(TrainerBoundLM(), nd.NDParallelStrategy(dp_shard=2, summary=False, plan=nd.ParallelPlan(fsdp_units=[Block])),
                devices=2)  # fmt: skip


@pytest.mark.faults
def test_a_replay_that_fails_on_rank_zero_is_reported_on_every_rank():
    """Rank 0 replays alone while the others wait for its verdict: its failure is their verdict too, not a hang."""
    for result in run_on_ranks(2, _replay_failure_case):
        assert len(result["warned"]) == 1 and "could not replay the step on one process" in result["warned"][0]


# --- pipeline and context parallel: the replayed step sees one process -------------------------------------------


class _MeanPipelinedLM(_PipelinedLM):
    count_tokens = None  # no token count: Lightning's mean of the micro-batch means

    def pipeline_loss(self, output, target):  # a pipeline micro-batch's mean, as without loss_normalization
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)


def _pipeline_case(kind: str) -> dict:
    module = {"tied": _TiedPipelinedLM, "mean": _MeanPipelinedLM}.get(kind, _PipelinedLM)()
    module.dp = dp = 2 if kind == "pp_dp" else 1
    ties = [("embed.weight", "head.weight")] if kind == "tied" else []
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=dp, loss_normalization=None if kind == "mean" else "token_mean", summary=False,
        pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2, tied_parameters=ties),
        plan=nd.ParallelPlan(fsdp_units=(nn.Linear,) if dp > 1 else ()),
    )  # fmt: skip
    return _fit(module, strategy, devices=2 * dp)


@pytest.mark.parametrize("kind", ["pp", "pp_dp", "tied", "mean"])
def test_a_pipeline_passes(kind):
    """pp=2 (x dp_shard=2 with FSDP2), a tie across stages declared, and the mean of micro-batch means."""
    results = run_on_ranks(4 if kind == "pp_dp" else 2, _pipeline_case, kind)
    assert all(r["warned"] == [] for r in results), results[0]["warned"]
    report = results[0]["report"]
    assert "verdict: exact" in report and "in float64" in report, report
    module = _TiedPipelinedLM() if kind == "tied" else _PipelinedLM()
    names = dict(module.named_parameters(remove_duplicate=False))
    assert f"(of {len(names)})" in report  # every parameter of both stages, by the unsplit model's names


def _cp_case(kind: str) -> dict:
    module = {"token_mean": _CausalLMModule, "sample_mean": _DiTModule, "local_positions": _LocalPositionsLM}[kind]()
    normalization = "sample_mean" if kind == "sample_mean" else "token_mean"
    return _fit(module, nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization=normalization, summary=False))


class _LocalPositionsLM(_CausalLMModule):
    """The trap: each cp rank numbers its own part of the sequence from 0, not by its global positions."""

    def training_step(self, batch, batch_idx):
        cp = self.trainer.strategy.meshes["cp"]
        rank, size = cp.get_local_rank(), cp.size()
        (tokens, _), (labels, _) = (shard_sequence(t, rank, size, dim=1, load_balance=True) for t in batch)
        positions = torch.arange(tokens.shape[1])
        logits = self.model(tokens, positions, None, cp.get_group(), is_causal=True)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")


@pytest.mark.parametrize("kind", ["token_mean", "sample_mean"])
def test_context_parallel_passes(kind):
    results = run_on_ranks(4, _cp_case, kind)
    assert all(r["warned"] == [] for r in results), results[0]["warned"]
    assert "verdict: exact" in results[0]["report"], results[0]["report"]
    if kind == "token_mean":  # per-token losses under cp: the window as one batch has no mean to compare
        assert "as one batch not checked: training_step returns no mean" in results[0]["report"], results[0]["report"]


@pytest.mark.parametrize(
    ("case", "world", "named"),
    [
        ((_cp_case, "local_positions"), 4, "model.pos.weight"),  # position embeddings read at the wrong rows
    ],
)
def test_a_pipeline_or_context_parallel_trap_is_caught(case, world, named):
    results = run_on_ranks(world, *case)
    for result in results:
        assert len(result["warned"]) == 1 and "MISMATCH" in result["warned"][0], result["warned"]
    assert named in results[0]["report"], results[0]["report"]


# --- the Lightning habit (each micro-batch's own mean) on dp x tp: it trains, and the report names the mean ---------


class _Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.head_dim = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # -1 heads: the local ones under a colwise q / k / v
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class _QKVBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(width), _Attention(width), nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class _QKVLM(L.LightningModule):
    """Separate q / k / v, layer norms outside the split region, a per-micro-batch mean; counts its tokens (so that
    VerifyOneDevice knows the mean meant: over the window's tokens)."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([_QKVBlock(width), _QKVBlock(width)])
        self.head = nn.Linear(width, vocab, bias=False)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return token_batches(vocab=32)


def _default_loss_tp_case() -> dict:
    use_existing_process_group()
    plan = {f"layers.*.{name}": ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "fc1")}
    plan |= {"layers.*.attn.o": RowwiseParallel(), "layers.*.fc2": RowwiseParallel()}
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, summary=False, plan=nd.ParallelPlan(tp_plan=plan, fsdp_units=[_QKVBlock]))
    verify = nd.VerifyOneDevice(on_mismatch="warn")
    module = _QKVLM()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=3, accumulate_grad_batches=2, logger=False,
        callbacks=[verify, nd.GlobalNormClip(1.0)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    norms = {n: p.to_local().detach().clone() for n, p in module.named_parameters() if "norm" in n}
    warned = [str(w.message) for w in caught if "VerifyOneDevice" in str(w.message)]
    return {"report": verify.report, "warned": warned, "steps": trainer.global_step, "norms": norms}


def test_the_per_micro_batch_mean_trains_on_dp_x_tp_and_is_reported_against_one_device():
    """The strategy's default loss (each micro-batch's own mean, averaged: not one device's token mean when
    micro-batches hold different token counts) trains on dp_shard x tp: the replica-gradient check stays quiet
    (the layer norms outside the split region get one gradient on both tp ranks, and stay equal), and
    VerifyOneDevice names the mismatch it documents."""
    results = run_on_ranks(4, _default_loss_tp_case)
    assert [r["steps"] for r in results] == [3] * 4
    for a, b in ((0, 1), (2, 3)):  # tp peers (tp is the inner mesh dim): the copies did not drift
        for name, value in results[a]["norms"].items():
            torch.testing.assert_close(value, results[b]["norms"][name], rtol=0, atol=0, msg=name)
    report = results[0]["report"]
    assert "verdict: MISMATCH" in report and "loss        parallel" in report, report
    worst = report.split("worst parameters")[1].splitlines()[1:6]
    assert all(line.split()[0].startswith("layers.") for line in worst), report  # named weights
    assert all(len(r["warned"]) == 1 and "MISMATCH" in r["warned"][0] for r in results)
