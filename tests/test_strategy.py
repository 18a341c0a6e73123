"""NDParallelStrategy: mesh sizes validated with the arithmetic in the message, data and
``sync_dist`` over the right dims, and Trainer.fit equal to single-device training."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from lightning.pytorch.strategies import StrategyRegistry
from test_callbacks import STEPS, MlpModule, Recorder, _reference, use_existing_process_group

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelDims


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
