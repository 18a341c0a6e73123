"""Lightning's own tests for ``ModelParallelStrategy``, run against :class:`NDParallelStrategy` on CPU ranks (gloo).

Ported from Lightning's tests (Apache-2.0): ``tests/tests_pytorch/strategies/test_model_parallel.py`` (unit
tests, in the pytest process) and ``tests/tests_pytorch/strategies/test_model_parallel_integration.py``
(multi-GPU tests, here on 1, 2 or 4 CPU ranks of the harness's worker pools). Copyright The Lightning AI team,
licensed under the Apache License, Version 2.0. The test names are Lightning's; what changed is the strategy
class (and the mesh sizes where a test builds the mesh), ``cuda`` devices became ``cpu``, and where our design
deliberately differs an assertion checks its stated equivalent, with a comment saying why.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from re import escape
from unittest import mock
from unittest.mock import Mock

import lightning.pytorch.strategies.model_parallel as lightning_model_parallel
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import run_on_ranks
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from test_callbacks import use_existing_process_group
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics.classification import Accuracy

from lightning_ndclip import NDParallelStrategy

_MP = "lightning.pytorch.strategies.model_parallel"


@pytest.fixture(autouse=True)
def _restore_process_state():
    """The unit tests run in the pytest process: undo what a (mocked) setup leaves behind there, the
    environment variables ``_init_dist_connection`` sets and the rank ``set_world_ranks`` gives
    ``rank_zero_only`` (a Mock, with a mocked cluster environment)."""
    rank = getattr(rank_zero_only, "rank", None)
    with mock.patch.dict(os.environ):
        yield
    rank_zero_only.rank = rank


# ------------------------------------------------------------------------------------------------------
# test_model_parallel.py: unit tests
# ------------------------------------------------------------------------------------------------------


@mock.patch(f"{_MP}._TORCH_GREATER_EQUAL_2_4", False)
def test_torch_greater_equal_2_4():
    # Lightning's message names type(self).__name__
    with pytest.raises(ImportError, match="NDParallelStrategy requires PyTorch 2.4 or higher"):
        NDParallelStrategy()


def test_device_mesh_access():
    strategy = NDParallelStrategy()
    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        _ = strategy.device_mesh


@pytest.mark.parametrize(
    ("num_nodes", "devices", "invalid_dp_size", "invalid_tp_size"),
    [
        (1, 4, 1, 1),
        (1, 4, 2, 3),
        (1, 4, 4, 2),
        (2, 4, 1, 4),
        (2, 4, 2, 1),
    ],
)
def test_validate_device_mesh_dimensions(num_nodes, devices, invalid_dp_size, invalid_tp_size):
    """Test passing sizes that don't multiply to the world size raises an error."""
    strategy = NDParallelStrategy(
        data_parallel_size=invalid_dp_size,
        tensor_parallel_size=invalid_tp_size,
    )
    strategy._setup_distributed = Mock()
    strategy._accelerator = Mock()
    strategy.cluster_environment = Mock(
        world_size=Mock(return_value=(num_nodes * devices)), local_rank=Mock(return_value=1)
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    with pytest.raises(RuntimeError, match="multiplied should equal the world size"):
        strategy.setup_environment()


def test_fsdp_v1_modules_unsupported():
    """Test that the strategy won't allow setting up a module wrapped with the legacy FSDP API."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Model(LightningModule):
        def configure_model(self):
            pass

    model = Model()
    model.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    strategy = NDParallelStrategy()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()

    with pytest.raises(TypeError, match="only supports the new FSDP2 APIs in PyTorch >= 2.4"):
        strategy.setup(Mock())


def test_configure_model_required():
    class Model1(LightningModule):
        pass

    class Model2(LightningModule):
        def configure_model(self):
            pass

    model = Model1()
    strategy = NDParallelStrategy()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()
    strategy._parallel_devices = [torch.device("cpu")]

    with pytest.raises(TypeError, match="you are required to override the `configure_model"):
        strategy.setup(Mock())

    model = Model2()
    strategy.model = model
    strategy._lightning_module = model
    strategy.setup(Mock())


def test_save_checkpoint_storage_options(tmp_path):
    """Test that the strategy does not accept storage options for saving checkpoints."""
    strategy = NDParallelStrategy()
    # Lightning's message names type(self).__name__
    with pytest.raises(
        TypeError, match=escape("NDParallelStrategy.save_checkpoint(..., storage_options=...)` is not")
    ):
        strategy.save_checkpoint(checkpoint=Mock(), filepath=tmp_path, storage_options=Mock())


# Lightning 2.6.6 removes a sharded checkpoint with shutil.rmtree; master (after #21821, fsspec paths)
# with _remove_checkpoint: mock whichever the installed version calls, as its own test does.
_HAS_REMOVE_CHECKPOINT = hasattr(lightning_model_parallel, "_remove_checkpoint")


@mock.patch.object(NDParallelStrategy, "broadcast", lambda _, x: x)
@mock.patch("lightning.fabric.plugins.io.torch_io._atomic_save")
@mock.patch(f"{_MP}._remove_checkpoint" if _HAS_REMOVE_CHECKPOINT else f"{_MP}.shutil")
def test_save_checkpoint_path_exists(remove_checkpoint_mock, atomic_save_mock, tmp_path):
    remove_checkpoint = remove_checkpoint_mock if _HAS_REMOVE_CHECKPOINT else remove_checkpoint_mock.rmtree
    strategy = NDParallelStrategy(save_distributed_checkpoint=False)

    # save_distributed_checkpoint=False, path exists, path is not a sharded checkpoint: error
    path = tmp_path / "not-empty"
    path.mkdir()
    (path / "file").touch()
    assert not _is_sharded_checkpoint(path)
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(Mock(), filepath=path)

    # save_distributed_checkpoint=False, path exists, path is a sharded checkpoint: no error (overwrite)
    path = tmp_path / "sharded-checkpoint"
    path.mkdir()
    (path / "meta.pt").touch()
    assert _is_sharded_checkpoint(path)
    strategy.save_checkpoint(Mock(), filepath=path)
    remove_checkpoint.assert_called_once_with(path)

    # save_distributed_checkpoint=False, path exists, path is a file: no error (overwrite)
    path = tmp_path / "file.pt"
    path.touch()
    atomic_save_mock.reset_mock()
    strategy.save_checkpoint(Mock(), filepath=path)
    atomic_save_mock.assert_called_once()

    strategy = NDParallelStrategy(save_distributed_checkpoint=True)

    save_mock = mock.patch("torch.distributed.checkpoint.save")

    # save_distributed_checkpoint=True, path exists, path is a folder: no error (overwrite)
    path = tmp_path / "not-empty-2"
    path.mkdir()
    (path / "file").touch()
    with save_mock:
        strategy.save_checkpoint({"state_dict": {}, "optimizer_states": {"": {}}}, filepath=path)
    assert (path / "file").exists()

    # save_distributed_checkpoint=True, path exists, path is a file: no error (overwrite)
    path = tmp_path / "file-2.pt"
    path.touch()
    with save_mock:
        strategy.save_checkpoint({"state_dict": {}, "optimizer_states": {"": {}}}, filepath=path)
    assert path.is_dir()


@mock.patch("lightning.fabric.strategies.model_parallel._has_dtensor_modules", return_value=True)
def test_load_unknown_checkpoint_type(_, tmp_path):
    """Test that the strategy validates the contents at the checkpoint path."""
    strategy = NDParallelStrategy()
    strategy.model = Mock()
    strategy._lightning_module = Mock(strict_loading=True)
    path = tmp_path / "empty_dir"  # neither a single file nor a directory with meta file
    path.mkdir()
    with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
        strategy.load_checkpoint(checkpoint_path=path)


@mock.patch(f"{_MP}._setup_device_mesh")
# our setup_environment builds the mesh with ParallelDims.build_mesh, not Lightning's _setup_device_mesh
@mock.patch("lightning_ndclip.core.parallel.mesh.ParallelDims.build_mesh")
@mock.patch("torch.distributed.init_process_group")
def test_set_timeout(init_process_group_mock, _, __):
    """Test that the timeout gets passed to the ``torch.distributed.init_process_group`` function."""
    test_timedelta = timedelta(seconds=30)
    strategy = NDParallelStrategy(timeout=test_timedelta)
    strategy._lightning_module = Mock()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = Mock()
    strategy.setup_environment()
    process_group_backend = strategy._get_process_group_backend()
    global_rank = strategy.cluster_environment.global_rank()
    world_size = strategy.cluster_environment.world_size()
    kwargs = {}
    if _TORCH_GREATER_EQUAL_2_3:
        kwargs["device_id"] = strategy.root_device if strategy.root_device.type != "cpu" else None
    init_process_group_mock.assert_called_with(
        process_group_backend, rank=global_rank, world_size=world_size, timeout=test_timedelta, **kwargs
    )


def test_meta_device_materialization():
    """Test that the `setup()` method materializes meta-device tensors in the LightningModule."""

    class NoResetParameters(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    class CustomModel(LightningModule):
        def __init__(self):
            super().__init__()
            # nn.Sequential as a parameterless module
            self.layer1 = nn.Sequential(NoResetParameters(), NoResetParameters())
            self.layer2 = nn.Linear(4, 4)
            self.register_buffer("buffer", torch.rand(2))

        def reset_parameters(self):
            self.buffer.fill_(1.0)

        def configure_model(self) -> None:
            pass

    with torch.device("meta"):
        model = CustomModel()
    assert model.layer1[0].weight.is_meta
    assert model.layer2.weight.is_meta
    assert model.buffer.is_meta

    strategy = NDParallelStrategy()
    strategy._accelerator = Mock()
    strategy._device_mesh = Mock()
    strategy._parallel_devices = [torch.device("cpu")]
    strategy._lightning_module = model
    strategy.model = model

    with pytest.warns(UserWarning, match=r"`reset_parameters\(\)` method for re-initialization: NoResetParameters"):
        strategy.setup(Mock())
    assert all(not p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())


def test_align_compiled_param_names_with_module():
    """Test that optimizer state dict keys are aligned with compiled submodule parameter names."""
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    class SimpleModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

        def forward(self, x):
            return self.model(x)

    # Test with compiled submodule (torch.compile only wraps it here: nothing is compiled)
    m = SimpleModule()
    m.model = torch.compile(m.model)

    # Simulate optimizer state dict without _orig_mod in keys (includes both state and param_groups)
    names = ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    state_dict = {
        "state": {name: {"step": 1} for name in names},
        "param_groups": [{"params": list(names), "lr": 0.01}],
    }

    result = _align_compiled_param_names_with_module(state_dict, m)

    # Verify state keys now have _orig_mod inserted
    expected_keys = {
        "model._orig_mod.0.weight",
        "model._orig_mod.0.bias",
        "model._orig_mod.2.weight",
        "model._orig_mod.2.bias",
    }
    assert set(result["state"].keys()) == expected_keys

    # Verify param_groups params also have _orig_mod inserted
    assert set(result["param_groups"][0]["params"]) == expected_keys

    # Verify they match the module's named_parameters
    param_names = {name for name, _ in m.named_parameters()}
    assert set(result["state"].keys()) == param_names


def test_align_compiled_param_names_no_compile():
    """Test that non-compiled modules pass through unchanged."""
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    class SimpleModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))

        def forward(self, x):
            return self.model(x)

    m = SimpleModule()  # Not compiled
    state_dict = {"state": {"model.0.weight": {"step": 1}, "model.0.bias": {"step": 1}}}

    result = _align_compiled_param_names_with_module(state_dict, m)

    # Keys should be unchanged
    assert set(result["state"].keys()) == {"model.0.weight", "model.0.bias"}


@pytest.mark.skipif(
    not hasattr(lightning_model_parallel, "_resolve_path"),
    reason="fsspec URLs for distributed checkpoints (Lightning #21821) are missing in the installed Lightning (2.6.x): "
    "its save_checkpoint turns the path into a pathlib.Path (gs://... -> gs:/...) and has no _prepare_directory_checkpoint"
    " / _is_checkpoint_dir / _atomic_save to patch",
)
def test_model_parallel_pytorch_save_checkpoint_remote_path(monkeypatch):
    """Regression: a gs:// URL must reach the DCP layer uncorrupted (not gs:/)."""
    mp = lightning_model_parallel

    strategy = NDParallelStrategy()
    strategy._save_distributed_checkpoint = True
    monkeypatch.setattr(strategy, "broadcast", lambda x: x)
    monkeypatch.setattr(type(strategy), "global_rank", property(lambda self: 0))

    captured = {}
    monkeypatch.setattr(mp, "_distributed_checkpoint_save", lambda state, path: captured.update(path=path))
    monkeypatch.setattr(mp, "_prepare_directory_checkpoint", lambda p: None)
    monkeypatch.setattr(mp, "_is_checkpoint_dir", lambda p: False)
    monkeypatch.setattr(mp, "_atomic_save", lambda obj, path: captured.update(meta=str(path)))

    checkpoint = {"state_dict": {"w": 1}, "optimizer_states": []}
    strategy.save_checkpoint(checkpoint, "gs://bucket/run/ckpt")
    assert captured["path"] == "gs://bucket/run/ckpt"
    assert captured["meta"] == "gs://bucket/run/ckpt/meta.pt"


# ------------------------------------------------------------------------------------------------------
# test_model_parallel_integration.py: CUDA ranks became CPU ranks of the harness (gloo); every worker
# function first lets Lightning join the pool's process group.
# ------------------------------------------------------------------------------------------------------


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def _parallelize_feed_forward_tp(model, device_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh = device_mesh["tensor_parallel"]
    tp_plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, tp_mesh, tp_plan)
    return model


def _parallelize_feed_forward_fsdp2(model, device_mesh):
    from torch.distributed.fsdp import fully_shard

    dp_mesh = device_mesh["data_parallel"]
    assert dp_mesh.ndim == 1  # Hybrid-sharding not supported

    # Fully-shard each layer
    fully_shard(model.w1, mesh=dp_mesh)
    fully_shard(model.w2, mesh=dp_mesh)
    fully_shard(model.w3, mesh=dp_mesh)
    return model


def _parallelize_feed_forward_fsdp2_tp(model, device_mesh):
    model = _parallelize_feed_forward_tp(model, device_mesh)
    return _parallelize_feed_forward_fsdp2(model, device_mesh)


def _parallelize_with_compile(parallelize):
    def fn(model, device_mesh):
        model = parallelize(model, device_mesh)
        # as in Lightning's test, the compiled module is returned and dropped by configure_model: the
        # compile=True variants only wrap the module, nothing gets compiled (so they stay cheap on CPU)
        return torch.compile(model)

    return fn


class TemplateModel(LightningModule):
    def __init__(self, compile=False):
        super().__init__()
        self.model = FeedForward()
        self._compile = compile

    def training_step(self, batch):
        output = self.model(batch)
        return output.sum()

    def train_dataloader(self):
        dataset_size = 8
        dataset = RandomDataset(32, dataset_size)
        return DataLoader(dataset, batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class FSDP2Model(TemplateModel):
    def configure_model(self):
        parallelize = _parallelize_feed_forward_fsdp2_tp
        if self._compile:
            parallelize = _parallelize_with_compile(parallelize)
        parallelize(self.model, device_mesh=self.device_mesh)


class TensorParallelModel(TemplateModel):
    def configure_model(self):
        parallelize = _parallelize_feed_forward_tp
        if self._compile:
            parallelize = _parallelize_with_compile(parallelize)
        parallelize(self.model, device_mesh=self.device_mesh)


class FSDP2TensorParallelModel(TemplateModel):
    def configure_model(self):
        parallelize = _parallelize_feed_forward_fsdp2_tp
        if self._compile:
            parallelize = _parallelize_with_compile(parallelize)
        parallelize(self.model, device_mesh=self.device_mesh)


class SimpleCompiledModule(LightningModule):
    def __init__(self, backend="inductor"):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self._loss = nn.MSELoss()
        self._backend = backend

    def configure_model(self):
        self.model = torch.compile(self.model, backend=self._backend)

    def training_step(self, batch, batch_idx):
        x, y = batch
        preds = self.model(x)
        return self._loss(preds, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _compiled_model_dataloader(batch_size: int = 32, num_batches: int = 2):
    total_samples = batch_size * num_batches
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(total_samples, 32, generator=generator)
    targets = torch.randn(total_samples, 32, generator=generator)
    dataset = torch.utils.data.TensorDataset(features, targets)
    return DataLoader(dataset, batch_size=batch_size)


_QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def _assert_lightning_layout(device_mesh, dp_size: int, tp_size: int) -> None:
    """Lightning's 2-D mesh ("data_parallel", "tensor_parallel") assertions, on our world mesh: it has the 5
    named dims ("pp", "dp_replicate", "dp_shard", "cp", "tp") by design and answers to Lightning's two names."""
    assert device_mesh["data_parallel"].size() == dp_size
    assert device_mesh["tensor_parallel"].size() == tp_size
    assert device_mesh["data_parallel"].size() * device_mesh["tensor_parallel"].size() == dist.get_world_size()


def _setup_device_mesh_case() -> None:
    use_existing_process_group()
    for dp_size, tp_size in ((1, 4), (4, 1), (2, 2)):
        strategy = NDParallelStrategy(
            data_parallel_size=dp_size,
            tensor_parallel_size=tp_size,
        )
        trainer = Trainer(
            accelerator="cpu",
            devices=4,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            max_steps=1,
            **_QUIET,
        )

        # the closures below run within their own iteration (in trainer.fit), hence the noqa: B023
        class Model(BoringModel):
            def configure_model(self):
                device_mesh = self.device_mesh
                assert isinstance(device_mesh, DeviceMesh)
                assert device_mesh.device_type == model.device.type  # noqa: B023
                # Lightning: mesh_dim_names == ("data_parallel", "tensor_parallel"), size(0) == dp_size,
                # size(1) == tp_size, ndim == 2; ours has 5 named dims by design (see _assert_lightning_layout)
                _assert_lightning_layout(device_mesh, dp_size, tp_size)  # noqa: B023
                assert device_mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")

        model = Model()
        trainer.fit(model)

    # Passing "auto" will select internode and intranode dimensions automatically
    strategy = NDParallelStrategy(
        data_parallel_size="auto",
        tensor_parallel_size="auto",
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        num_nodes=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        max_steps=1,
        **_QUIET,
    )

    class Model(BoringModel):
        def configure_model(self):
            device_mesh = self.device_mesh
            # Lightning: mesh_dim_names == ("data_parallel", "tensor_parallel"), size(0) == 1, size(1) == 4
            _assert_lightning_layout(device_mesh, 1, 4)

    model = Model()
    trainer.fit(model)


def test_setup_device_mesh():
    run_on_ranks(4, _setup_device_mesh_case)


def _tensor_parallel_case(compile: bool) -> None:
    use_existing_process_group()

    class Model(TensorParallelModel):
        def on_train_start(self):
            device_mesh = self.device_mesh
            optimizer = self.optimizers()
            assert all(
                tensor.device_mesh == device_mesh["tensor_parallel"] for tensor in optimizer.param_groups[0]["params"]
            )
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert self.model.w1.weight.device_mesh == device_mesh["tensor_parallel"]

            # No data sharding, all GPUs get the same input inside a TP group
            dataloader = self.trainer.train_dataloader
            assert len(dataloader) == 8 // dataloader.batch_size
            assert isinstance(dataloader.sampler, DistributedSampler)

        def training_step(self, batch):
            # All batches must be identical across TP group
            batches = self.all_gather(batch)
            assert all(torch.equal(batches[0], batches[i]) for i in range(1, len(batches)))
            return super().training_step(batch)

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        # Lightning's ModelParallelStrategy() defaults to tp = all devices; ours to FSDP over all ranks
        strategy=NDParallelStrategy(data_parallel_size="auto", tensor_parallel_size="auto"),
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
        **_QUIET,
    )

    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)

    trainer.fit(model)


@pytest.mark.parametrize("compile", [True, False])
def test_tensor_parallel(compile):
    run_on_ranks(2, _tensor_parallel_case, compile)


def _single_file_checkpoint_with_compile_case(tmp_path: str, backend: str) -> None:
    use_existing_process_group()
    tmp_path = Path(tmp_path)
    seed_everything(0)
    strategy = NDParallelStrategy(
        data_parallel_size=1,
        tensor_parallel_size=1,
        save_distributed_checkpoint=False,
    )

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        limit_train_batches=2,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )

    dataloader = _compiled_model_dataloader(batch_size=32, num_batches=2)

    with trainer.init_module(empty_init=True):
        model = SimpleCompiledModule(backend=backend)

    trainer.fit(model, dataloader)

    if trainer.is_global_zero:
        checkpoint_path = tmp_path / "compiled-model.ckpt"
        trainer.save_checkpoint(checkpoint_path)

    trainer.strategy.barrier()


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "inductor",
            marks=pytest.mark.skip(
                reason="inductor on CPU measured 55 s cold / 16 s with a warm cache for this 2-layer MLP on the 2-core test "
                "machine, over the ~20 s budget; compile is orthogonal to the strategy (the 'eager' case covers "
                "the compiled-module checkpoint path)"
            ),
        ),
        # added: backend="eager" gives the same OptimizedModule (`_orig_mod` parameter names, the subject of
        # the regression) without inductor's C++ build
        "eager",
    ],
)
def test_model_parallel_single_file_checkpoint_with_compile(tmp_path, backend):
    """Replicate the reporter's setup: compiled model + ModelParallel single-file checkpointing."""
    run_on_ranks(1, _single_file_checkpoint_with_compile_case, str(tmp_path), backend)


def _fsdp2_tensor_parallel_case(compile: bool) -> None:
    use_existing_process_group()

    class Model(FSDP2TensorParallelModel):
        def on_train_start(self):
            optimizer = self.optimizers()
            assert all(isinstance(weight, DTensor) for weight in self.model.parameters())
            assert all(isinstance(tensor, DTensor) for tensor in optimizer.param_groups[0]["params"])
            assert self.model.w1.weight.device_mesh.ndim == 2
            assert self.model.w1.weight.device_mesh.size(0) == 2
            assert self.model.w1.weight.device_mesh.size(1) == 2
            assert all(weight.device.type != "meta" for weight in self.model.parameters())
            assert all(tensor.device_mesh.ndim == 2 for tensor in optimizer.param_groups[0]["params"])
            assert all(tensor.device.type != "meta" for tensor in optimizer.param_groups[0]["params"])

            # No data sharding across TP dimension, sharding across data-parallel dimension only
            device_mesh = self.device_mesh
            dp_mesh = device_mesh["data_parallel"]
            dataloader = self.trainer.train_dataloader
            assert len(dataloader) == 8 // dataloader.batch_size // dp_mesh.size()
            assert isinstance(dataloader.sampler, DistributedSampler)

        def training_step(self, batch):
            batches = self.all_gather(batch)
            dp_mesh = self.device_mesh["data_parallel"]
            tp_mesh = self.device_mesh["tensor_parallel"]

            # Batches across the TP dimension must be identical
            batches_tp = batches[tp_mesh.mesh]
            assert all(torch.equal(batches_tp[0], batches_tp[i]) for i in range(1, len(batches_tp)))
            # Batches across the DP dimension must be different
            batches_dp = batches[dp_mesh.mesh]
            assert all(not torch.equal(batches_dp[0], batches_dp[i]) for i in range(1, len(batches_dp)))

            return super().training_step(batch)

    strategy = NDParallelStrategy(
        data_parallel_size=2,
        tensor_parallel_size=2,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
        **_QUIET,
    )

    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model(compile=compile)

    trainer.fit(model)


@pytest.mark.parametrize("compile", [True, False])
def test_fsdp2_tensor_parallel(compile):
    run_on_ranks(4, _fsdp2_tensor_parallel_case, compile)


def _modules_without_parameters_case(tmp_path: str) -> None:
    use_existing_process_group()

    class MetricsModel(TensorParallelModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage) -> None:
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch):
            assert self.metric.device.type == self.metric.tp.device.type == "cpu"  # Lightning: "cuda"
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return super().training_step(batch)

    model = MetricsModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=NDParallelStrategy(),  # the layout does not matter here
        max_steps=1,
        enable_checkpointing=False,
        logger=False,
        **_QUIET,
    )
    trainer.fit(model)


def test_modules_without_parameters(tmp_path):
    """Test that TorchMetrics get moved to the device despite not having any parameters."""
    run_on_ranks(2, _modules_without_parameters_case, str(tmp_path))


def _module_init_context_case(compile: bool, precision: str, expected_dtype: torch.dtype, tmp_path: str) -> None:
    use_existing_process_group()

    class Model(FSDP2Model):
        def on_train_start(self):
            assert self.model.w1.weight.device == torch.device("cpu")  # Lightning: ("cuda", self.local_rank)
            assert self.model.w1.weight.dtype == expected_dtype
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"  # Lightning: "cuda"

    def _run_setup_assertions(empty_init, expected_device):
        trainer = Trainer(
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=2,
            strategy=NDParallelStrategy(),  # the layout does not matter here
            precision=precision,
            max_steps=1,
            barebones=True,
            enable_checkpointing=False,
            logger=False,
        )
        with trainer.init_module(empty_init=empty_init):
            model = Model(compile=compile)

        # The model is on the CPU/meta-device until after `ModelParallelStrategy.setup()`
        assert model.model.w1.weight.device == expected_device
        assert model.model.w1.weight.dtype == expected_dtype
        trainer.fit(model)

    # Case 1: No empty init
    _run_setup_assertions(empty_init=False, expected_device=torch.device("cpu"))

    # Case 2: Empty-init with meta device
    _run_setup_assertions(empty_init=True, expected_device=torch.device("meta"))


@pytest.mark.parametrize(
    ("precision", "expected_dtype"),
    [
        ("32-true", torch.float32),
        ("16-true", torch.float16),
        ("bf16-true", torch.bfloat16),  # Lightning: RunIf(bf16_cuda=True), a GPU capability; the CPU has bf16
    ],
)
@pytest.mark.parametrize("compile", [True, False])
def test_module_init_context(compile, precision, expected_dtype, tmp_path):
    """Test that the module under the init-context gets moved to the right device and dtype."""
    run_on_ranks(2, _module_init_context_case, compile, precision, expected_dtype, str(tmp_path))


def _strategy_state_dict_case(tmp_path: str, save_distributed_checkpoint: bool) -> None:
    use_existing_process_group()
    model = FSDP2Model()
    correct_state_dict = model.state_dict()  # State dict before wrapping

    strategy = NDParallelStrategy(save_distributed_checkpoint=save_distributed_checkpoint)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model)

    state_dict = trainer.strategy.lightning_module_state_dict()

    if save_distributed_checkpoint:
        # All ranks return a state dict
        assert len(state_dict) > 0
        # State dict should contain same keys as non-distributed state dict
        assert list(state_dict.keys()) == list(correct_state_dict.keys())
    else:
        if trainer.global_rank != 0:
            # The full state-dict is only returned on rank 0
            assert len(state_dict) == 0
            return
        # State dict should contain same keys as non-distributed state dict
        assert list(state_dict.keys()) == list(correct_state_dict.keys())


@pytest.mark.parametrize("save_distributed_checkpoint", [True, False])
def test_strategy_state_dict(tmp_path, save_distributed_checkpoint):
    """Test that the strategy returns the correct state dict of the LightningModule."""
    run_on_ranks(2, _strategy_state_dict_case, str(tmp_path), save_distributed_checkpoint)


def _load_full_state_checkpoint_into_regular_model_case(tmp_path: str) -> None:
    use_existing_process_group()
    tmp_path = Path(tmp_path)

    # Save a regular full-state checkpoint from a distributed model
    model = FSDP2Model()
    strategy = NDParallelStrategy(save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model)
    model_path = tmp_path / "last.ckpt"
    model_path = trainer.strategy.broadcast(model_path)
    trainer.save_checkpoint(model_path)
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    if trainer.global_rank != 0:
        assert len(model_state_dict) == 0
        assert len(optimizer_state_dict) == 0

    # Create a regular model and load the checkpoint into it
    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, **_QUIET)
    trainer.fit(model, ckpt_path=model_path)
    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    if trainer.global_rank == 0:
        assert len(model_state_dict) == len(restored_model_state_dict)
        assert len(optimizer_state_dict) == len(restored_optimizer_state_dict)
        torch.testing.assert_close(model_state_dict, restored_model_state_dict, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state_dict, restored_optimizer_state_dict, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_load_full_state_checkpoint_into_regular_model(tmp_path):
    """Test that a full-state checkpoint saved from a distributed model can be loaded back into a regular model."""
    run_on_ranks(2, _load_full_state_checkpoint_into_regular_model_case, str(tmp_path))


def _load_standard_checkpoint_into_distributed_model_case(tmp_path: str) -> None:
    use_existing_process_group()
    tmp_path = Path(tmp_path)

    # Save a regular DDP checkpoint
    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, **_QUIET)
    trainer.fit(model)
    model_path = tmp_path / "last.ckpt"
    model_path = trainer.strategy.broadcast(model_path)
    trainer.save_checkpoint(model_path)
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    # Create a distributed model and load the checkpoint into it
    model = FSDP2Model()
    strategy = NDParallelStrategy(save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model, ckpt_path=model_path)
    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    if trainer.global_rank != 0:
        assert len(restored_model_state_dict) == 0
        assert len(restored_optimizer_state_dict) == 0
    if trainer.global_rank == 0:
        assert len(model_state_dict) == len(restored_model_state_dict)
        assert len(optimizer_state_dict) == len(restored_optimizer_state_dict)
        torch.testing.assert_close(model_state_dict, restored_model_state_dict, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state_dict, restored_optimizer_state_dict, atol=0, rtol=0)
    trainer.strategy.barrier()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_load_standard_checkpoint_into_distributed_model(tmp_path):
    """Test that a regular checkpoint (weights and optimizer states) can be loaded into a distributed model."""
    run_on_ranks(2, _load_standard_checkpoint_into_distributed_model_case, str(tmp_path))


def _save_load_sharded_state_dict_case(tmp_path: str) -> None:
    use_existing_process_group()

    class CheckpointModel(FSDP2Model):
        def __init__(self, params_to_compare=None):
            super().__init__()
            self.params_to_compare = params_to_compare

        def on_train_start(self):
            if self.params_to_compare is None:
                return
            for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
                assert torch.equal(p0, p1.full_tensor())

    seed_everything(0)

    strategy = NDParallelStrategy(save_distributed_checkpoint=True)
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }

    # Initial training
    model = CheckpointModel()
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model)
    params_before = [p.full_tensor() for p in trainer.model.parameters()]

    checkpoint_path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    assert set(os.listdir(checkpoint_path)) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}

    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1  # model checkpoint callback
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata

    # Load checkpoint and continue training
    trainer_kwargs.update(max_epochs=2)
    model = CheckpointModel(params_to_compare=params_before)
    strategy = NDParallelStrategy(save_distributed_checkpoint=True)
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, ckpt_path=checkpoint_path)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_save_load_sharded_state_dict(tmp_path):
    """Test saving and loading with the distributed state dict format."""
    run_on_ranks(2, _save_load_sharded_state_dict_case, str(tmp_path))
