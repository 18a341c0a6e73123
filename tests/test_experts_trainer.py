"""Expert parallelism in ``Trainer.fit``: ``NDParallelStrategy(dp_shard=4, ep=2)`` with GlobalNormClip logs
the single-device norm, split exactly into expert and dense parts (the model: test_experts.py)."""

from __future__ import annotations

import lightning as L
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_callbacks import Recorder
from test_experts import LR, MAX_NORM, TOKENS_PER_RANK, WORLD, MoEModel, _data, _reference
from torch.distributed.fsdp import fully_shard

import lightning_ndclip as nd
from lightning_ndclip.core.experts import shard_experts

# --- end to end in the Trainer: NDParallelStrategy(dp_shard=4, ep=2) + GlobalNormClip ---


class _MoEModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = MoEModel()

    def configure_model(self) -> None:
        meshes = self.trainer.strategy.meshes
        shard_experts(self.model.moe, meshes["ep"])
        fully_shard(self.model.moe.experts, mesh=meshes["edp"])
        for layer in (self.model.inp, self.model.head):
            fully_shard(layer, mesh=meshes["fsdp"])
        fully_shard(self.model, mesh=meshes["fsdp"])

    def training_step(self, batch, batch_idx):
        x, y = batch  # the loss is this rank's share of the mean over the global batch
        return ((self.model(x) - y) ** 2).sum() / (WORLD * TOKENS_PER_RANK)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=TOKENS_PER_RANK)


def _trainer_case() -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _MoEModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=nd.NDParallelStrategy(dp_shard=WORLD, ep=2, sum_reduction=True),
        max_steps=1, callbacks=[nd.GlobalNormClip(MAX_NORM, expert_pattern=r"\.experts\.")], logger=recorder,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)  # one step: the global batch is the whole data set, in any order
    logged = [m for _, m in recorder.rows if "grad_norm/total" in m][0]
    return {"logged": logged, "params": {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}}


def test_moe_in_the_trainer_logs_exact_dense_and_expert_norms():
    ref_norms, ref_params = _reference(1, False)
    for r in run_on_ranks(WORLD, _trainer_case):
        logged = r["logged"]
        assert abs(logged["grad_norm/total"] - ref_norms[0]) <= 1e-12 * ref_norms[0]
        split = logged["grad_norm/expert"] ** 2 + logged["grad_norm/dense"] ** 2
        assert abs(split - ref_norms[0] ** 2) <= 1e-12 * ref_norms[0] ** 2
        for name, value in r["params"].items():
            assert float((value - ref_params[name]).norm() / ref_params[name].norm()) < 1e-10, name
