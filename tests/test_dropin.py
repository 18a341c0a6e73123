"""NDParallelStrategy as a drop-in for Lightning's ModelParallelStrategy: Lightning's keywords and
dim names, every training_step signature, the same losses and parameters as Lightning's own
strategy and as one device, and a LightningModule that is never patched."""

from __future__ import annotations

import warnings
from unittest import mock
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from test_callbacks import LOCAL_BATCH, LR, STEPS, Recorder, _data, _mlp, _reference, use_existing_process_group
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from lightning_ndclip import NDParallelStrategy, ParallelPlan, PipelineOptions

# --- arguments: Lightning's names, "auto", and errors that name the argument, before any collective ---


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(tensor_parallel=2), TypeError, "argument 'tensor_parallel'; did you mean 'tensor_parallel_size'"),
        (dict(data_parallel_size="all"), ValueError, "data_parallel_size must be a positive int or 'auto'"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be a positive int or 'auto'"),
        (dict(data_parallel_size=True), ValueError, "data_parallel_size must be a positive int or 'auto'"),
        (dict(data_parallel_size=2, dp_shard=2), TypeError, "data_parallel_size (Lightning's name for dp_shard) or dp_shard=2"),
        (dict(tensor_parallel_size=2, tp=2), TypeError, "tensor_parallel_size (Lightning's name for tp) or tp=2"),
        (dict(tp=2, fsdp_units=[torch.nn.Linear]), TypeError, "fsdp_units=...) is now plan=ParallelPlan(fsdp_units=...)"),
        (dict(pp=2, pp_schedule="gpipe"), TypeError, "pp_schedule=...) is now pipeline=PipelineOptions(schedule=...)"),
        (dict(plan=ParallelPlan(tp_plan={"a": ColwiseParallel()})), ValueError, "plan=ParallelPlan(tp_plan={...}) needs tp > 1"),
        (dict(pp=2, pipeline=PipelineOptions(split_points=["a", "b"])), ValueError, "2 stages need 1 PipelineOptions("),
    ],
)
def test_bad_arguments_name_themselves_and_the_accepted_forms(kwargs, error, message):
    with pytest.raises(error) as info:
        NDParallelStrategy(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(schedule="zb"), "PipelineOptions(schedule='zb'): choose one of ['1f1b', 'gpipe',"),
        (dict(microbatches=0), "PipelineOptions(microbatches=0): must be a positive int"),
        (dict(stages_per_rank=None), "PipelineOptions(stages_per_rank=None): must be a positive int"),
    ],
)
def test_pipeline_options_refuse_what_no_pipeline_can_run(kwargs, message):
    with pytest.raises(ValueError) as info:
        PipelineOptions(**kwargs)
    assert message in str(info.value)


def test_lightning_sizes_mismatch_is_the_error_lightning_raises():
    strategy = NDParallelStrategy(data_parallel_size=2, tensor_parallel_size=3)
    strategy._setup_distributed = Mock()  # 1 node x 4 devices, as Lightning's own test mocks it
    strategy._accelerator = Mock()
    strategy.cluster_environment = Mock(world_size=Mock(return_value=4), local_rank=Mock(return_value=1))
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(RuntimeError, match="multiplied should equal the world size") as info:
        strategy.setup_environment()
    assert isinstance(info.value, ValueError) and "data_parallel_size=2 x tensor_parallel_size=3 = 6" in str(info.value)


# --- a LightningModule written for ModelParallelStrategy, run unchanged ---


class LightningStyleModule(L.LightningModule):
    """Written against ModelParallelStrategy only: its mesh names, ``training_step(batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            parallelize_module(self.net, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)

    def training_step(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))  # the mean over every rank
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=LOCAL_BATCH, shuffle=False)


def _lightning_style_case(strategy_name: str, dp: int, tp: int) -> dict:
    use_existing_process_group()
    cls = {"lightning": ModelParallelStrategy, "ndclip": NDParallelStrategy}[strategy_name]
    strategy = cls(data_parallel_size=dp, tensor_parallel_size=tp)
    module = LightningStyleModule()
    hooks_before = (dict(vars(type(module))), {k for k, v in vars(module).items() if callable(v)})
    trainer = L.Trainer(accelerator="cpu", devices=dp * tp, strategy=strategy, max_steps=STEPS, logger=Recorder(),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    mesh = module.device_mesh
    return {
        "losses": module.losses,
        "params": {n: p.full_tensor() for n, p in module.net.named_parameters()},
        "sampler": (trainer.train_dataloader.sampler.num_replicas, trainer.train_dataloader.sampler.rank),
        "mesh": (mesh["data_parallel"].size(), mesh["tensor_parallel"].size()),
        "patched": hooks_before != (dict(vars(type(module))), {k for k, v in vars(module).items() if callable(v)}),
        "mesh_warnings": [str(w.message) for w in caught if "mesh" in str(w.message).lower()],
    }


@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 1), (1, 4)])
def test_a_module_written_for_model_parallel_strategy_trains_identically(dp, tp):
    _, ref_params = _reference(dp, max_norm=float("inf"))
    lightning = run_on_ranks(4, _lightning_style_case, "lightning", dp, tp)
    ours = run_on_ranks(4, _lightning_style_case, "ndclip", dp, tp)
    for rank, (theirs, mine) in enumerate(zip(lightning, ours)):
        assert mine["sampler"] == theirs["sampler"] == (dp, rank // tp)
        assert mine["mesh"] == theirs["mesh"] == (dp, tp)
        assert len(mine["losses"]) == STEPS
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-13, abs=0)
        for name, value in mine["params"].items():
            assert torch.allclose(value, theirs["params"][name], rtol=1e-13, atol=1e-15), name
            assert torch.allclose(value, ref_params[name], rtol=1e-12, atol=1e-14), name  # and one device
        assert not mine["patched"], "the strategy must not add or replace methods on the LightningModule"
        assert not mine["mesh_warnings"], mine["mesh_warnings"]


def _auto_case(kwargs: dict) -> tuple:
    use_existing_process_group()
    seen = {}

    class Probe(LightningStyleModule):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            seen["lightning"] = (mesh["data_parallel"].size(), mesh["tensor_parallel"].size())
            seen["ours"] = tuple(mesh[name].size() for name in ("dp_shard", "tp", "dp", "dp_cp", "fsdp"))
            super().configure_model()

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=NDParallelStrategy(**kwargs), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Probe())
    return seen["lightning"], seen["ours"]


@pytest.mark.parametrize(
    "kwargs,lightning,ours",
    [
        (dict(data_parallel_size="auto", tensor_parallel_size="auto"), (1, 4), (1, 4, 1, 1, 1)),  # Lightning's default
        (dict(tensor_parallel_size="auto"), (1, 4), (1, 4, 1, 1, 1)),  # the other one defaults to "auto"
        (dict(data_parallel_size=2, tensor_parallel_size=2), (2, 2), (2, 2, 2, 2, 2)),
        (dict(), (4, 1), (4, 1, 4, 4, 4)),  # no sizes: FSDP2 over every rank
    ],
    ids=["auto-auto", "tp-auto", "2x2", "default"],
)
def test_sizes_auto_and_default_resolve_as_documented(kwargs, lightning, ours):
    for seen in run_on_ranks(4, _auto_case, kwargs):
        assert seen == (lightning, ours)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(), "dp_shard=8 x cp=1 x tp=1"),  # no sizes: FSDP2 over every rank of every node
        (dict(data_parallel_size="auto", tensor_parallel_size="auto"), "dp_shard=2 x cp=1 x tp=4"),  # Lightning's
        (dict(dp_replicate=2), "dp_replicate=2 x dp_shard=4 x cp=1 x tp=1"),  # e.g. HSDP: replicas across nodes
    ],
)
def test_sizes_on_two_nodes(kwargs, expected):
    strategy = NDParallelStrategy(**kwargs)
    strategy._setup_distributed = Mock()  # 2 nodes x 4 devices, mocked as Lightning's own tests do
    strategy._accelerator = Mock()
    strategy.cluster_environment = Mock(world_size=Mock(return_value=8), local_rank=Mock(return_value=0))
    strategy.parallel_devices = [torch.device("cpu")] * 4
    strategy.num_nodes = 2
    strategy._lightning_module = Mock()
    with mock.patch("lightning_ndclip.core.parallel.mesh.ParallelDims.build_mesh"):  # no process group here
        strategy.setup_environment()
    assert expected in strategy.parallel_dims.describe()
