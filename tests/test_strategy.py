"""NDParallelStrategy: mesh sizes validated with the arithmetic in the message, data and
``sync_dist`` over the right dims, and Trainer.fit equal to single-device training."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from lightning.pytorch.strategies import StrategyRegistry
from test_callbacks import LOCAL_BATCH, STEPS, MlpModule, Recorder, _reference, use_existing_process_group
from test_loss import TokenModel, _packed_batch, _token_losses
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelDims, ParallelPlan, count_valid_tokens


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=8, dp_shard=2, tp=2), "pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 = 4, but world_size=8"),
        (dict(world_size=6, tp=4), "= 4 does not divide world_size=6"),
        (dict(world_size=8, dp_shard=2, cp=2, tp=2, ep=3), "ep=3 must divide dp_shard x cp = 2 x 2 = 4"),
        (dict(world_size=8, tp=0), "tp must be a positive int, got 0"),
        (dict(world_size=8, dp_shard=-2), "dp_shard must be a positive int or -1, got -2"),
    ],
)
def test_parallel_dims_errors_state_the_arithmetic(kwargs, message):
    with pytest.raises(ValueError) as info:
        ParallelDims(**kwargs)
    assert message in str(info.value)


def test_dp_shard_takes_the_rest():
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, pp=2)
    assert dims.dp_shard == 2 and dims.shape == (2, 2, 2, 1, 2) and dims.batch_size == 4


def test_strategy_checks_sizes_at_construction_and_is_registered():
    with pytest.raises(ValueError, match="ep=4 must divide"):
        NDParallelStrategy(dp_shard=2, ep=4)
    NDParallelStrategy(ep=4)  # dp_shard=-1 may still grow to a multiple of 4
    assert "nd_parallel" in StrategyRegistry
    assert NDParallelStrategy().is_distributed


def _trainer(strategy, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", max_steps=STEPS, log_every_n_steps=1, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def _wrong_world_case() -> str:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2), devices=2, logger=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(MlpModule(tp=True))
    return str(info.value)


@pytest.mark.faults
def test_world_size_mismatch_fails_on_every_rank_before_any_collective():
    for message in run_on_ranks(2, _wrong_world_case, timeout=60):
        assert "dp_shard=2 x cp=1 x tp=2 = 4, but world_size=2" in message


class _SyncDistModule(MlpModule):
    def training_step(self, batch, batch_idx):
        dp_rank = float(self.trainer.strategy.meshes["dp"].get_local_rank())
        self.log("dp_rank_sum", torch.tensor(dp_rank, dtype=torch.float64), sync_dist=True, reduce_fx="sum")
        return super().training_step(batch, batch_idx)


def _fit_case(dp: int, tp: int, max_norm: float) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _SyncDistModule(tp=tp > 1)
    strategy = "nd_parallel" if tp == 1 else NDParallelStrategy(dp_shard=dp, tp=tp)
    trainer = _trainer(strategy, devices=dp * tp, callbacks=[GlobalNormClip(max_norm)], logger=recorder)
    trainer.fit(module)
    sampler = trainer.train_dataloader.sampler
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.full_tensor() for n, p in module.net.named_parameters()},
        "sampler": (sampler.num_replicas, sampler.rank),
        "dp_rank_sum": float(trainer.callback_metrics["dp_rank_sum"]),
        "dims": trainer.strategy.parallel_dims.describe(),
    }


@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 1)], ids=["dp_shard2xtp2", "nd_parallel-by-name"])
def test_fit_matches_single_device(dp, tp):
    ref_norms, ref_params = _reference(dp, max_norm=0.3)
    results = run_on_ranks(dp * tp, _fit_case, dp, tp, 0.3)
    for rank, r in enumerate(results):
        assert r["sampler"] == (dp, rank // tp), "tp peers must share a batch, dp ranks must not"
        assert r["dp_rank_sum"] == sum(range(dp)), "sync_dist must reduce over dp x cp only"
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name
    assert len(results[0]["norms"]) == STEPS
    for ours, ref in zip(results[0]["norms"], ref_norms):
        assert abs(ours - ref) <= 1e-12 * ref
    assert results[0]["dims"].startswith(f"pp=1 x dp_replicate=1 x dp_shard={dp} x cp=1 x tp={tp}")


# --- loss_normalization="token_mean": exact global token mean with gradient accumulation ---

ACCUMULATE, BATCHES, ROWS_PER_RANK, TOKEN_LR = 3, 5, 2, 0.3  # windows of 3 and 2 micro-batches


def _token_rows() -> TensorDataset:
    batch = _packed_batch(7, 48)  # variable-length samples, padding and masked tokens
    return TensorDataset(batch["tokens"], batch["labels"])


class _TokenModule(L.LightningModule):
    """``training_step`` returns the Lightning habit, ``cross_entropy(..., ignore_index=-100)`` (this
    micro-batch's mean), or per-token losses, or their sum."""

    def __init__(self, returns: str = "mean") -> None:
        super().__init__()
        self.model = TokenModel()
        self.returns = returns

    def configure_model(self) -> None:
        mesh = self.trainer.strategy.meshes["dp_shard_cp"]
        for name in ("embed", "up", "down", "head"):
            fully_shard(getattr(self.model, name), mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def count_tokens(self, batch) -> torch.Tensor:
        return count_valid_tokens(batch[1])

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.model(tokens).flatten(0, 1)
        if self.returns == "mean":
            return nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100)
        losses = nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="none")
        return losses.view_as(labels) if self.returns == "per_token" else losses.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=TOKEN_LR)

    def train_dataloader(self):
        return DataLoader(_token_rows(), batch_size=ROWS_PER_RANK, shuffle=False)


def _token_reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One device: per window, the sum of every token loss of every rank's micro-batches divided by
    the window's valid tokens; clipped; SGD. The norms, the parameters, and each window's loss."""
    model = TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=TOKEN_LR)
    tokens, labels = _token_rows().tensors
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0)).tolist()
    norms, losses = [], []
    for window in ([0, 1, 2], [3, 4]):
        rows = [order[(j * ROWS_PER_RANK + t) * dp + r] for j in window for r in range(dp) for t in range(ROWS_PER_RANK)]
        batch = {"tokens": tokens[rows], "labels": labels[rows]}
        opt.zero_grad()
        loss = _token_losses(model, batch).sum() / count_valid_tokens(batch["labels"])
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _token_fit_case(dp: int, normalization: str | None, returns: str = "mean", reduction: str = "mean") -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _TokenModule(returns)
    strategy = NDParallelStrategy(dp_shard=dp, loss_normalization=normalization, loss_reduction=reduction)
    trainer = _trainer(strategy, devices=dp, max_steps=-1, max_epochs=1, limit_train_batches=BATCHES,
                       accumulate_grad_batches=ACCUMULATE, callbacks=[GlobalNormClip(0.05)], logger=recorder)
    trainer.fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.model.named_parameters()},
        "train_loss": [m["train_loss"] for _, m in recorder.rows if "train_loss" in m],
    }


def _worst(results: list[dict], reference: dict[str, torch.Tensor]) -> float:
    return max(
        float((value - reference[name]).norm() / reference[name].norm())
        for r in results
        for name, value in r["params"].items()
    )


@pytest.mark.parametrize(
    "returns,reduction",
    [("mean", "mean"), ("per_token", "mean"), ("sum", "sum")],
    ids=["the-lightning-habit-a-mean", "per-token-losses", "a-sum-with-loss_reduction-sum"],
)
def test_token_mean_with_accumulation_and_a_partial_window_matches_single_device(returns, reduction):
    ref_norms, ref_params, ref_losses = _token_reference(2)
    results = run_on_ranks(2, _token_fit_case, 2, "token_mean", returns, reduction)
    assert _worst(results, ref_params) < 1e-10
    for r in results:
        assert len(r["norms"]) == 2 and len(r["train_loss"]) == 2
        for ours, ref in zip(r["norms"], ref_norms):
            assert abs(ours - ref) <= 1e-10 * ref
        for ours, ref in zip(r["train_loss"], ref_losses):  # what one device shows for the same window
            assert abs(ours - ref) <= 1e-10 * ref


@pytest.mark.faults
def test_the_per_rank_mean_without_the_strategy_or_taken_for_a_sum_is_detectably_wrong():
    _, ref_params, _ = _token_reference(2)
    biased = run_on_ranks(2, _token_fit_case, 2, None)  # FSDP averages per-rank means
    assert _worst(biased, ref_params) > 1e-4
    as_sum = run_on_ranks(2, _token_fit_case, 2, "token_mean", "mean", "sum")  # 0.1.0's contract, a mean returned
    assert _worst(as_sum, ref_params) > 1e-4
    ref_norms, _, _ = _token_reference(2)
    assert as_sum[0]["norms"][0] < 0.2 * ref_norms[0], "gradients about n_local times too small"


class _BadCountModule(_TokenModule):
    def __init__(self, bad, window: int = 0) -> None:
        super().__init__()
        self.bad, self.calls, self.window = bad, 0, window

    def count_tokens(self, batch) -> torch.Tensor:
        self.calls += 1
        if self.trainer.global_rank == 1 and self.calls == 2 + self.window * ACCUMULATE:  # rank 1, micro-batch 1
            if self.bad == "raise":
                raise KeyError("labels")
            if self.bad in ("meta", "none"):
                return torch.tensor(5, device="meta") if self.bad == "meta" else None
            return torch.tensor(self.bad)
        return super().count_tokens(batch)


def _bad_count_case(bad, window: int = 0) -> str:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(dp_shard=2, loss_normalization="token_mean"), devices=2, logger=False,
                       accumulate_grad_batches=ACCUMULATE)
    with pytest.raises(ValueError) as info:
        trainer.fit(_BadCountModule(bad, window))
    assert trainer.global_step == window, "raised before the bad window's first forward, after the steps before it"
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize("bad", [-3, float("nan"), 2.5, float("inf")])
def test_a_bad_token_count_raises_the_same_error_on_every_rank(bad):
    messages = run_on_ranks(2, _bad_count_case, bad, timeout=60)
    assert messages[0] == messages[1], "every rank raises the same error"
    assert messages[0].startswith("rank 1: token counts must be finite non-negative integers, got micro-batch 1: ")
    assert str(bad) in messages[0]


@pytest.mark.faults
@pytest.mark.parametrize(
    "bad, expected",
    [
        ("raise", "count_tokens(batch) of micro-batch 1 raised KeyError: 'labels'"),
        ("meta", "count_tokens(batch) of micro-batch 1 raised ValueError: returned a meta tensor, which holds no value"),
        ("none", "count_tokens(batch) of micro-batch 1 raised TypeError: returned NoneType, not the number of valid"),
    ],
)
def test_count_tokens_failing_on_one_rank_raises_the_same_error_on_every_rank(bad, expected):
    """It raised on that rank alone (torch's 'Cannot copy out of meta tensor'), and the other died on a closed
    connection; now the count's all-reduce carries the failure and every rank raises the same error."""
    messages = run_on_ranks(2, _bad_count_case, bad, timeout=60)
    assert messages[0] == messages[1] and messages[0].startswith(f"rank 1: {expected}"), messages


@pytest.mark.faults
def test_a_count_failing_in_a_window_read_ahead_raises_on_every_rank_before_its_forward():
    """The second window's counts are read and their all-reduce issued during the first step (after its last
    forward); the failure is raised when the second window starts, on every rank, before any forward of it."""
    messages = run_on_ranks(2, _bad_count_case, "raise", 1, timeout=60)
    assert messages[0] == messages[1] and messages[0].startswith("rank 1: count_tokens(batch) of micro-batch 1 raised"), messages


class _DictWithoutLoss(_TokenModule):
    def training_step(self, batch, batch_idx):
        return {"logits_sum": super().training_step(batch, batch_idx)}


def _dict_without_loss_case() -> str:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(loss_normalization="token_mean"), devices=1, logger=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(_DictWithoutLoss())
    return str(info.value)


@pytest.mark.faults
def test_a_dict_without_loss_names_its_keys():
    (message,) = run_on_ranks(1, _dict_without_loss_case)
    assert "without a 'loss' key" in message and "logits_sum" in message


def _missing_count_tokens_case() -> str:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(loss_normalization="token_mean"), devices=1, logger=False)
    with pytest.raises(TypeError) as info:
        trainer.fit(MlpModule(tp=False))
    return str(info.value)


def test_token_mean_requires_count_tokens():
    (message,) = run_on_ranks(1, _missing_count_tokens_case)
    assert "count_tokens(batch)" in message


class _NoLossModule(_TokenModule):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)  # computes the loss, returns nothing


def _no_loss_case() -> str:
    use_existing_process_group()
    trainer = _trainer(NDParallelStrategy(loss_normalization="token_mean"), devices=1, logger=False)
    with pytest.raises(TypeError) as info:
        trainer.fit(_NoLossModule())
    return str(info.value)


def test_token_mean_names_a_training_step_that_returns_no_loss():
    (message,) = run_on_ranks(1, _no_loss_case)
    assert "loss_normalization='token_mean'" in message and "got NoneType" in message


def _precision_case(precision: str) -> list[float]:
    use_existing_process_group()
    recorder = Recorder()
    module = MlpModule(tp=False)
    if precision == "bf16-true":
        module.net.float()  # bf16-true converts floating-point modules; start from fp32 weights

    def make() -> L.Trainer:
        return _trainer(NDParallelStrategy(), devices=2, max_steps=2, precision=precision,
                        callbacks=[GlobalNormClip(0.3)], logger=recorder)
    if precision == "16-mixed":
        with pytest.raises(ValueError) as info:
            make()
        return [str(info.value)]
    make().fit(module)
    return [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_with_a_close_global_norm(precision):
    ref_norms, _ = _reference(2, max_norm=0.3)
    norms = run_on_ranks(2, _precision_case, precision)[0]
    assert len(norms) == 2
    assert abs(norms[0] - ref_norms[0]) <= 2e-2 * ref_norms[0]  # bf16 forward/backward, fp32 norm


def test_fp16_mixed_is_refused_with_the_reason():
    for (message,) in run_on_ranks(2, _precision_case, "16-mixed"):
        assert "does not support" in message and "16-mixed" in message and "bf16-mixed" in message


class _AdamModule(MlpModule):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _resume_case(directory: str) -> dict:
    use_existing_process_group()

    def trainer(epochs: int) -> L.Trainer:
        return _trainer(NDParallelStrategy(dp_shard=2, tp=2), devices=4, max_steps=-1, max_epochs=epochs,
                        limit_train_batches=2, callbacks=[GlobalNormClip(0.3)], logger=False)

    straight = _AdamModule(tp=True)
    trainer(3).fit(straight)
    first = trainer(1)
    first.fit(_AdamModule(tp=True))
    first.save_checkpoint(f"{directory}/epoch1.ckpt")
    resumed = _AdamModule(tp=True)
    with torch.no_grad():  # only a real restore of weights (and Adam state) can undo this
        for p in resumed.net.parameters():
            p.add_(1.0)
    trainer(3).fit(resumed, ckpt_path=f"{directory}/epoch1.ckpt")
    full = lambda m: {n: p.detach().full_tensor() for n, p in m.net.named_parameters()}  # noqa: E731
    return {"straight": full(straight), "resumed": full(resumed)}


def test_resume_from_a_distributed_checkpoint_equals_an_uninterrupted_run(tmp_path):
    for r in run_on_ranks(4, _resume_case, str(tmp_path)):
        for name, value in r["straight"].items():
            assert torch.equal(value, r["resumed"][name]), name


# --- declarative parallelization: a LightningModule with no parallel code ---


class _PlainModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MlpModule(tp=False).net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    configure_optimizers = MlpModule.configure_optimizers
    train_dataloader = MlpModule.train_dataloader


def _declarative_case(dp_replicate: int, dp_shard: int, tp: int) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _PlainModule()
    plan = {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()} if tp > 1 else None
    strategy = NDParallelStrategy(
        dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
        plan=ParallelPlan(tp_plan=plan, fsdp_units=(torch.nn.Linear,), activation_checkpointing=(torch.nn.Tanh,)),
    )
    trainer = _trainer(strategy, devices=dp_replicate * dp_shard * tp, callbacks=[GlobalNormClip(0.3)], logger=recorder)
    trainer.fit(module)
    units = sum(isinstance(m, FSDPModule) for m in module.modules())
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.net.named_parameters()},
        "units": units,
        "placements": sorted({str(p.placements) for p in module.parameters()}),
    }


def _unmatched_plan_case(argument: str) -> str:
    use_existing_process_group()
    plans = {
        "tp_plan": {"tp_plan": {"net.0": ColwiseParallel(), "net.9": RowwiseParallel(), "head.*": ColwiseParallel()}},
        "fsdp_units": {"fsdp_units": (torch.nn.Linear, torch.nn.Conv2d)},
        "activation_checkpointing": {"activation_checkpointing": (torch.nn.Tanh, torch.nn.GRU)},
    }
    strategy = NDParallelStrategy(tp=2, plan=ParallelPlan(**{"fsdp_units": (torch.nn.Linear,), **plans[argument]}))
    module = _PlainModule()
    before = {n: type(m) for n, m in module.named_modules()}
    with pytest.raises(ValueError) as info:
        _trainer(strategy, devices=2, logger=False).fit(module)
    assert {n: type(m) for n, m in module.named_modules()} == before  # refused before changing anything
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize(
    "argument, expected",
    [
        ("tp_plan", "tp_plan entries ['net.9', 'head.*'] match no submodule"),
        ("fsdp_units", "fsdp_units: ['Conv2d'] match no submodule"),
        ("activation_checkpointing", "activation_checkpointing: ['GRU'] match no submodule"),
    ],
)
def test_a_plan_entry_that_matches_nothing_is_an_error_naming_it(argument, expected):
    for message in run_on_ranks(2, _unmatched_plan_case, argument):
        assert expected in message


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 2, 1), (2, 2, 2)], ids=["fsdp2xtp2", "hsdp2x2", "hsdp2x2xtp2"])
def test_declarative_plan_parallelizes_a_plain_module_exactly(shape):
    dp = shape[0] * shape[1]
    ref_norms, ref_params = _reference(dp, max_norm=0.3)
    results = run_on_ranks(shape[0] * shape[1] * shape[2], _declarative_case, *shape)
    for r in results:
        assert r["units"] == 4  # three Linear units and the root
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name
    for ours, ref in zip(results[0]["norms"], ref_norms):
        assert abs(ours - ref) <= 1e-12 * ref
    if shape[0] > 1:
        assert any("Replicate()" in p for p in results[0]["placements"]), "HSDP should replicate over dp_replicate"


def _init_sync_case(init_sync: bool) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _PlainModule()  # seed 0: the single-device reference's weights
    if torch.distributed.get_rank() >= 2:  # replica 1 of dp_replicate=2 x dp_shard=2 draws its own
        torch.manual_seed(100 + torch.distributed.get_rank())
        for p in module.parameters():
            torch.nn.init.normal_(p)
    plan = ParallelPlan(fsdp_units=(torch.nn.Linear,))
    strategy = NDParallelStrategy(dp_replicate=2, dp_shard=2, plan=plan, init_sync=init_sync)
    _trainer(strategy, devices=4, callbacks=[GlobalNormClip(0.3)], logger=recorder).fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.net.named_parameters()},
    }


def test_init_sync_starts_hsdp_replicas_from_the_first_replica():
    ref_norms, ref_params = _reference(4, max_norm=0.3)
    for r in run_on_ranks(4, _init_sync_case, True):
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name
        assert all(abs(ours - ref) <= 1e-12 * ref for ours, ref in zip(r["norms"], ref_norms))
    # without it, replica 1 trains from its own weights: a different model on ranks 2 and 3
    unsynced = run_on_ranks(4, _init_sync_case, False)
    assert all(not torch.allclose(unsynced[2]["params"][n], ref_params[n]) for n in ref_params)


def _both_ways_case() -> str:
    use_existing_process_group()
    strategy = NDParallelStrategy(plan=ParallelPlan(fsdp_units=(torch.nn.Linear,)))
    with pytest.raises(ValueError) as info:
        _trainer(strategy, devices=1, logger=False).fit(MlpModule(tp=False))
    return str(info.value)


def test_declarative_plan_and_configure_model_together_is_an_error():
    (message,) = run_on_ranks(1, _both_ways_case)
    assert "overrides configure_model()" in message and "use one" in message


class _AccumulatingModule(MlpModule):
    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.epoch_loop.batch_idx == 0:  # first micro-batch of the first window
            self.reduced_after_first_micro_batch = any(p.grad is not None for p in self.parameters())


def _accumulate_case() -> dict:
    use_existing_process_group()
    module = _AccumulatingModule(tp=True)
    trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2), devices=4, max_steps=2, accumulate_grad_batches=2,
                       callbacks=[GlobalNormClip(0.3)], logger=False)
    trainer.fit(module)
    return {
        "reduced_early": module.reduced_after_first_micro_batch,
        "params": {n: p.detach().full_tensor() for n, p in module.net.named_parameters()},
    }


def test_accumulation_reduces_once_per_window_and_matches_single_device():
    _, ref_params = _reference(2, max_norm=0.3, accumulate=2, steps=2)
    for r in run_on_ranks(4, _accumulate_case):
        assert r["reduced_early"] is False, "FSDP2 should not reduce before the window's last micro-batch"
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name


def _mp_policy_case() -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _PlainModule()
    module.net.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = NDParallelStrategy(plan=ParallelPlan(fsdp_units=(torch.nn.Linear,), mp_policy=policy))
    _trainer(strategy, devices=2, max_steps=2, callbacks=[GlobalNormClip(0.3)], logger=recorder).fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "param_dtype": {
            unit._get_fsdp_state()._mp_policy.param_dtype for unit in module.modules() if isinstance(unit, FSDPModule)
        },
    }


def test_declarative_mixed_precision_policy_reaches_every_unit():
    ref_norms, _ = _reference(2, max_norm=0.3)
    result = run_on_ranks(2, _mp_policy_case)[0]
    assert result["param_dtype"] == {torch.bfloat16}
    assert abs(result["norms"][0] - ref_norms[0]) <= 2e-2 * ref_norms[0]  # bf16 compute, fp32 norm


class _SubMeshModule(MlpModule):
    """Shards over dp_shard_cp only (the HSDP trap), or leaves a parameter outside every unit."""

    def __init__(self, trap: str) -> None:
        super().__init__(tp=False)
        self.trap = trap
        if trap == "outside":
            self.temperature = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def configure_model(self) -> None:
        meshes = self.trainer.strategy.meshes
        mesh = meshes["dp_shard_cp"] if self.trap == "sub_mesh" else meshes["fsdp"]
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _hsdp_trap_case(trap: str) -> str:
    use_existing_process_group()
    module = _SubMeshModule(trap)
    with pytest.raises(ValueError) as info:
        # a sub-mesh is refused in every mode; a parameter nothing reduces in the exact (SUM) mode
        strategy = NDParallelStrategy(dp_replicate=2, dp_shard=2, sum_reduction=trap == "outside")
        _trainer(strategy, devices=4, logger=False).fit(module)
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize(
    "trap, expected",
    [
        ("sub_mesh", "'net.0.weight' has its gradient summed over ranks [0, 1] only, missing the data dims ['dp_replicate']"),
        ("outside", "parameter 'temperature' is in no fully_shard unit"),
    ],
)
def test_a_parameter_reduced_over_part_of_its_data_ranks_is_refused_naming_it(trap, expected):
    messages = run_on_ranks(4, _hsdp_trap_case, trap)
    assert all(expected in m and m.startswith("rank 0: ") for m in messages), messages


class _ManualTokenModule(_TokenModule):
    def __init__(self) -> None:
        super().__init__("mean")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)  # the micro-batch's own mean: scaling the returned loss comes too late
        self.optimizers().step()
        return loss


def _manual_token_mean_case() -> str:
    use_existing_process_group()
    strategy = NDParallelStrategy(dp_shard=2, loss_normalization="token_mean")
    with pytest.raises(ValueError) as info:
        _trainer(strategy, devices=2, max_steps=1).fit(_ManualTokenModule())
    return str(info.value)


def test_loss_normalization_with_manual_optimization_is_refused_on_every_rank():
    # it trained on the unscaled per-rank means with SUM reductions: gradients ~dp times too large
    for message in run_on_ranks(2, _manual_token_mean_case):
        assert "loss_normalization='token_mean'" in message and "manual optimization" in message, message


class _IterStepModule(_TokenModule):
    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def _dataloader_iter_case() -> str:
    use_existing_process_group()
    strategy = NDParallelStrategy(dp_shard=2, loss_normalization="token_mean")
    with pytest.raises(ValueError) as info:
        _trainer(strategy, devices=2, max_steps=1, logger=False).fit(_IterStepModule())
    return str(info.value)


@pytest.mark.faults
def test_training_step_with_dataloader_iter_and_loss_normalization_is_refused_saying_why():
    """It failed inside the window bookkeeping (no normalization for the batch_idx)."""
    for message in run_on_ranks(2, _dataloader_iter_case):
        assert "training_step(dataloader_iter) reads its batches itself" in message, message


def _all_reduces_per_step_case() -> list[int]:
    """Counts torch.distributed.all_reduce calls per optimizer step of a token_mean fit with GlobalNormClip."""
    import torch.distributed as dist

    use_existing_process_group()
    calls: list[int] = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    per_step: list[int] = []

    class _Count(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step > len(per_step):  # a window just ended
                per_step.append(calls[0])
                calls[0] = 0

    strategy = NDParallelStrategy(dp_shard=2, loss_normalization="token_mean", summary=False)
    trainer = _trainer(strategy, devices=2, max_steps=4, accumulate_grad_batches=ACCUMULATE, logger=False,
                       callbacks=[GlobalNormClip(1.0), _Count()])  # fmt: skip
    dist.all_reduce = counting
    try:
        trainer.fit(_TokenModule())
    finally:
        dist.all_reduce = real
    return per_step


def test_the_steady_state_has_three_all_reduces_per_step():
    """The next window's counts (carrying every rank's problem flag; issued after this window's last forward), the
    logged loss, the norm: the agreement on hook errors adds no collective (the norm plan's first exchange is an
    all_gather_object, not counted here). The epoch's last step reads no next window."""
    for per_step in run_on_ranks(2, _all_reduces_per_step_case):
        assert per_step[1:] == [3, 3, 2], per_step  # the first step also holds Lightning's setup (loader lengths)


def _threads_over_fits(fits: int) -> list[int]:
    use_existing_process_group()
    counts = []
    for _ in range(fits):
        module = MlpModule(tp=True)
        trainer = _trainer(NDParallelStrategy(dp_shard=2, tp=2, summary=False), devices=4, logger=False,
                           callbacks=[GlobalNormClip(1.0)])
        trainer.fit(module)
        del trainer, module
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def test_fits_in_one_process_hold_no_more_threads_after_the_first():
    """A notebook or a sweep fits again and again in one process: the meshes (and their gloo groups, each with threads
    of its own) are built once per layout, so the threads after the fifth fit are those after the first."""
    for counts in run_on_ranks(4, _threads_over_fits, 5):
        assert counts == [counts[0]] * 5, counts


def _whole_module_case(sizes: dict) -> dict:
    use_existing_process_group()
    module = _PlainModule()
    strategy = NDParallelStrategy(**sizes)
    trainer = _trainer(strategy, devices=4, callbacks=[GlobalNormClip(0.3)], logger=False)
    trainer.fit(module)
    return {"params": {n: p.full_tensor() for n, p in module.net.named_parameters()},
            "summary": str(strategy.parallel_summary()), "units": sum(isinstance(m, FSDPModule) for m in module.modules())}


@pytest.mark.parametrize("sizes", [dict(dp_shard=4), dict(dp_replicate=4, dp_shard=1), dict(dp_replicate=2, dp_shard=2)],
                         ids=["dp_shard4", "dp_replicate4", "hsdp"])
def test_data_parallel_sizes_alone_shard_the_whole_module_as_one_unit(sizes):
    _, ref_params = _reference(4, max_norm=0.3)
    for r in run_on_ranks(4, _whole_module_case, sizes):
        assert r["units"] == 1 and "plan=ParallelPlan(fsdp_units=[YourBlock])" in r["summary"]
        for name, value in r["params"].items():
            assert torch.allclose(value, ref_params[f"{name}"], rtol=1e-12, atol=1e-14), name


def _no_plan_with_tp_case() -> str:
    use_existing_process_group()
    with pytest.raises(TypeError) as info:
        _trainer(NDParallelStrategy(dp_shard=2, tp=2), devices=4, logger=False).fit(_PlainModule())
    return str(info.value)


def test_tp_without_a_plan_or_configure_model_still_asks_for_one():
    for message in run_on_ranks(4, _no_plan_with_tp_case):
        assert "configure_model()" in message and "plan=ParallelPlan(" in message


class _UnseededDataMlp(MlpModule):
    """A dataset each rank draws for itself, differently (as from unseeded random numbers)."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(100 + self.global_rank)
        x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64)
        data = TensorDataset(x, y)
        return DataLoader(data, batch_size=LOCAL_BATCH)


def _unseeded_data_case() -> str:
    use_existing_process_group()
    with pytest.raises(ValueError) as info:
        _trainer(NDParallelStrategy(dp_shard=2, tp=2), devices=4, logger=False).fit(_UnseededDataMlp(tp=True))
    return str(info.value)


def test_tp_peers_fed_different_batches_are_named_at_the_first_step():
    for message in run_on_ranks(4, _unseeded_data_case):
        assert "ranks [0, 1] are tp peers and must train on the same batch" in message, message
        assert "rank 1 received another batch than rank 0" in message
