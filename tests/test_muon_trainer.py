"""Muon in ``Trainer.fit`` under NDParallelStrategy with GlobalNormClip, written as a user writes it (matrices by
Muon, the rest in a ``"muon": False`` group, one optimizer): the parameters after 3 clipped steps equal one process
in float64 running Muon from its definition (test_muon.ReferenceMuon) and torch.optim.AdamW on the same batches,
on dp_shard, dp_shard x tp, HSDP, pp x dp_shard and experts over ep."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_experts import MAX_NORM as EXPERT_MAX_NORM
from test_experts import WORLD as EXPERT_WORLD
from test_experts import MoEModel
from test_experts import _data as _expert_data
from test_experts_trainer import _MoEModule
from test_muon import ReferenceMuon
from test_pipeline import TinyLM, _batch
from test_pipeline_trainer import _PipelinedLM
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning_ndclip as nd

STEPS, ACCUMULATE, LOCAL_BATCH = 3, 2, 2
MAX_NORM = {"mlp": 0.5, "pp": 0.1}
"""Below the norms of most steps (0.61, 0.43, 0.54 and 0.12, 0.11): clipping is part of what is compared."""
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
ADAMW = dict(lr=0.01, weight_decay=0.1)


def _by_muon(name: str, p: torch.Tensor) -> bool:
    """Matrices (and stacks of expert matrices) but the embedding."""
    return p.ndim in (2, 3) and "embed" not in name


def _muon(named: list[tuple[str, nn.Parameter]]) -> nd.Muon:
    """The optimizer a user writes: the matrices by Muon, the rest by AdamW's update."""
    matrices = [p for n, p in named if _by_muon(n, p)]
    others = [p for n, p in named if not _by_muon(n, p)]
    return nd.Muon([{"params": matrices}, {"params": others, "muon": False, **ADAMW}], **MUON, ns_dtype=None)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 8, generator=g, dtype=torch.float64), torch.randn(64, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4)).double()


class _MuonMlp(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return _muon(list(self.named_parameters()))

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=LOCAL_BATCH, shuffle=False)


def _step_reference(
    model: nn.Module, loss: torch.Tensor, muon: ReferenceMuon, adamw: torch.optim.Optimizer, max_norm: float,
    by_muon: Callable[[str, torch.Tensor], bool] = _by_muon,
) -> None:
    """One clipped step of the reference: Muon on the optimizer's matrices, AdamW (torch's) on the rest."""
    model.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if by_muon(name, p):
                p.copy_(muon.step(name, p, p.grad))
    adamw.step()


def _adamw_of(model: nn.Module, by_muon: Callable[[str, torch.Tensor], bool] = _by_muon) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for n, p in model.named_parameters() if not by_muon(n, p)], **ADAMW)


def _mlp_reference(dp: int) -> dict[str, torch.Tensor]:
    """Each optimizer step reads the next dp x ACCUMULATE x LOCAL_BATCH rows in the order of the DistributedSampler
    Lightning injects (shuffled with seed 0), micro-batches of one size: the mean of their means is the mean over the
    rows."""
    model, (x, y) = _mlp(), _data().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    muon, adamw = ReferenceMuon(**MUON), _adamw_of(model)
    rows = dp * ACCUMULATE * LOCAL_BATCH
    for step in range(STEPS):
        chunk = order[step * rows : (step + 1) * rows]
        _step_reference(model, nn.functional.mse_loss(model(x[chunk]), y[chunk]), muon, adamw, MAX_NORM["mlp"])
    return {n: p.detach() for n, p in model.named_parameters()}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _fit(
    module: L.LightningModule, strategy: nd.NDParallelStrategy, max_norm: float, steps: int = STEPS, accumulate: int = ACCUMULATE
) -> dict:
    use_existing_process_group()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        callbacks=[nd.GlobalNormClip(max_norm)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return {n: _full(p) for n, p in module.named_parameters()}


MESHES = {
    "dp_shard": dict(dp_shard=4, plan=nd.ParallelPlan(fsdp_units=(nn.Linear,))),
    "dp_shard_tp": dict(dp_shard=2, tp=2, plan=nd.ParallelPlan(
        tp_plan={"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}, fsdp_units=(nn.Linear,))),
    "hsdp": dict(dp_replicate=2, dp_shard=2, plan=nd.ParallelPlan(fsdp_units=(nn.Linear,))),
}  # fmt: skip


def _mlp_case(mesh: str) -> dict[str, torch.Tensor]:
    return _fit(_MuonMlp(), nd.NDParallelStrategy(**MESHES[mesh]), MAX_NORM["mlp"])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_muon_in_the_trainer_equals_one_device(mesh):
    dp = {"dp_shard": 4, "dp_shard_tp": 2, "hsdp": 4}[mesh]
    expected = {f"net.{n}": p for n, p in _mlp_reference(dp).items()}
    for params in run_on_ranks(4, _mlp_case, mesh):
        for name, value in params.items():
            assert (value - expected[name]).abs().max() < 1e-12, name


class _MuonPipelinedLM(_PipelinedLM):
    def configure_optimizers(self):
        return _muon(list(self.named_parameters()))


def _pp_case() -> dict[str, torch.Tensor]:
    use_existing_process_group()
    module = _MuonPipelinedLM()
    module.dp = 2
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=2, loss_normalization="token_mean", plan=nd.ParallelPlan(fsdp_units=(nn.Linear,)),
        pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2),
    )  # fmt: skip
    _fit(module, strategy, MAX_NORM["pp"], steps=2)
    stages = module.model.values() if isinstance(module.model, nn.ModuleDict) else module.model
    return {n: _full(p) for stage in stages for n, p in stage.named_parameters()}


def _pp_reference(steps: int) -> dict[str, torch.Tensor]:
    """Each step covers the whole batch (2 accumulated batches x 2 data ranks): its token mean."""
    model, (tokens, labels) = TinyLM(), _batch()
    muon, adamw = ReferenceMuon(**MUON), _adamw_of(model)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
        _step_reference(model, loss, muon, adamw, MAX_NORM["pp"])
    return {n: p.detach() for n, p in model.named_parameters()}


def test_muon_on_pipeline_stages_equals_one_device():
    expected = _pp_reference(steps=2)
    for params in run_on_ranks(4, _pp_case):
        assert params
        for name, value in params.items():
            assert (value - expected[name]).abs().max() < 1e-12, name


class _MuonMoEModule(_MoEModule):
    """test_experts_trainer's MoE (experts over ep=2, FSDP2 over the ranks holding the same experts) with Muon: the
    expert stacks ``[4, 8, 16]`` / ``[4, 16, 8]`` orthogonalized per expert, the dense matrices whole."""

    def configure_optimizers(self):
        return _muon(list(self.named_parameters()))


def _ep_case() -> dict[str, torch.Tensor]:
    strategy = nd.NDParallelStrategy(dp_shard=EXPERT_WORLD, ep=2, sum_reduction=True)
    return _fit(_MuonMoEModule(), strategy, EXPERT_MAX_NORM, steps=2, accumulate=1)  # a step: one batch per rank


def _ep_reference(steps: int) -> dict[str, torch.Tensor]:
    """The whole data set per step (the Trainer's step covers it: one batch per rank), the loss its mean."""
    model, (x, y) = MoEModel(), _expert_data()
    muon, adamw = ReferenceMuon(**MUON), _adamw_of(model)
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).sum() / x.shape[0]
        _step_reference(model, loss, muon, adamw, EXPERT_MAX_NORM)
    return {f"model.{n}": p.detach() for n, p in model.named_parameters()}


def test_muon_on_experts_over_ep_equals_one_device():
    expected = _ep_reference(steps=2)
    for params in run_on_ranks(EXPERT_WORLD, _ep_case):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            assert (value - expected[name]).abs().max() < 1e-12, name


def _hf_by_muon(name: str, p: torch.Tensor) -> bool:
    """What Muon users give it in a transformers LM: the blocks' matrices (not the embedding nor the head)."""
    return p.ndim in (2, 3) and "embed" not in name and "lm_head" not in name


def _hf_muon(named: list[tuple[str, nn.Parameter]]) -> nd.Muon:
    matrices = [p for n, p in named if _hf_by_muon(n, p)]
    others = [p for n, p in named if not _hf_by_muon(n, p)]
    return nd.Muon([{"params": matrices}, {"params": others, "muon": False, **ADAMW}], **MUON, ns_dtype=None)


def _hf_case() -> dict[str, torch.Tensor]:
    from test_hf_families import _FamilyModule

    class MuonLlama(_FamilyModule):
        def __init__(self) -> None:
            super().__init__("Llama")
            self.lm.double()

        def configure_optimizers(self):
            return _hf_muon(list(self.named_parameters()))

    module = MuonLlama()
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=nd.ParallelPlan(tp_plan="auto"), loss_normalization="token_mean")
    _fit(module, strategy, MAX_NORM["mlp"], steps=2)
    return {n: _full(p) for n, p in module.lm.named_parameters()}


def test_muon_on_a_transformers_model_with_its_own_plan_equals_one_device():
    """A tiny transformers Llama on dp_shard=2 x tp=2 with its own tp plan, the exact token mean over micro-batches
    of uneven token counts: each step covers all 8 rows."""
    pytest.importorskip("transformers")
    from hf_families import tiny_causal_lm
    from test_hf_families import _data as _hf_data

    model, (tokens, labels) = tiny_causal_lm("Llama").double(), _hf_data()
    muon, adamw = ReferenceMuon(**MUON), _adamw_of(model, _hf_by_muon)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        _step_reference(model, loss, muon, adamw, MAX_NORM["mlp"], _hf_by_muon)
    for params in run_on_ranks(4, _hf_case):
        for name, value in params.items():
            assert (value - dict(model.named_parameters())[name]).abs().max() < 1e-12, name


def _resume_case(directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """dp_shard=2 x tp=2, 2 steps per epoch: 2 epochs straight, and 1 epoch saved then resumed for the second (the
    momentum buffers and AdamW's moments, DTensors, through Lightning's distributed checkpoint)."""
    use_existing_process_group()
    out = {}
    for run, epochs, ckpt in (("straight", 2, None), ("first", 1, None), ("resumed", 2, f"{directory}/muon.ckpt")):
        module = _MuonMlp()
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=nd.NDParallelStrategy(**MESHES["dp_shard_tp"]), max_epochs=epochs,
            limit_train_batches=4, accumulate_grad_batches=ACCUMULATE, callbacks=[nd.GlobalNormClip(MAX_NORM["mlp"])],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, ckpt_path=ckpt)
        if run == "first":
            trainer.save_checkpoint(f"{directory}/muon.ckpt")
        out[run] = {n: _full(p) for n, p in module.named_parameters()}
    return out


def test_muon_resumes_from_a_checkpoint_as_if_uninterrupted(tmp_path):
    for runs in run_on_ranks(4, _resume_case, str(tmp_path)):
        assert any((runs["first"][n] - runs["straight"][n]).abs().max() > 1e-3 for n in runs["straight"])
        for name, value in runs["resumed"].items():
            assert torch.equal(value, runs["straight"][name]), name
