"""Context parallelism in ``Trainer.fit``: ``NDParallelStrategy(dp_shard=2, cp=2)`` with the per-sample
and the token mean equals single-device training in float64 (the models: test_context.py)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_context import TinyTransformer, _reference, _video_batch
from test_loss import _packed_batch
from torch import nn
from torch.distributed.fsdp import fully_shard

import lightning_ndclip as nd
from lightning_ndclip.core.context.attention import shard_sequence
from lightning_ndclip.core.loss import count_valid_tokens

# --- end to end: NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="sample_mean") ---

DIT_ROWS, DIT_LR = 4, 0.5


class _DiTModule(L.LightningModule):
    """Packed video rows; the cp rank takes its part of each row; loss: the per-sample mean."""

    def __init__(self, biased: bool = False) -> None:
        super().__init__()
        self.model = TinyTransformer(None)
        self.biased = biased

    def configure_model(self) -> None:
        fully_shard(self.model, mesh=self.trainer.strategy.meshes["fsdp"])
        if self.biased:  # the usual recipe: per-rank token mean, averaged (cp ranks included)
            self.model.set_gradient_divide_factor(1.0)  # FSDP's default divides by dp x cp ...
            self.model.set_force_sum_reduction_for_comms(True)  # ... here made explicit: mean below

    def _cp(self):
        cp = self.trainer.strategy.meshes["cp"]
        return cp.get_local_rank(), cp.size(), cp.get_group()

    def sample_ids(self, batch):
        ids = batch[2]
        present = ids[ids >= 0].unique()  # renumber the micro-batch's samples 0..n-1, alike on cp ranks
        local = torch.where(ids >= 0, torch.searchsorted(present, ids.clamp(min=0)), -1)
        rank, size, _ = self._cp()
        return shard_sequence(local, rank, size, dim=1)[0], len(present)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        rank, size, group = self._cp()
        (x, positions), (y, _), (ids, _) = (shard_sequence(t, rank, size, dim=1) for t in (x, y, ids))
        pred = self.model(x, positions, ids, group, is_causal=False)
        losses = ((pred - y) ** 2).sum(-1)  # per-token losses; the strategy weighs them
        if self.biased:
            return losses[ids >= 0].mean() / self.trainer.world_size
        return losses

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=DIT_LR)

    def train_dataloader(self):
        b = _video_batch(DIT_ROWS)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(b["x"], b["y"], b["ids"]), batch_size=1)


def _dit_trainer_case(biased: bool) -> dict:
    use_existing_process_group()
    module = _DiTModule(biased)
    mode = None if biased else "sample_mean"
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization=mode),
        max_steps=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)  # one step = 2 micro-batches x 2 dp ranks = every row: order-independent
    return {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}


def test_sample_mean_with_context_parallel_in_the_trainer_matches_single_device():
    batch = _video_batch(DIT_ROWS)
    grads, _ = _reference("video", batch)
    expected = {n: p.detach() - DIT_LR * grads[n] for n, p in TinyTransformer(None).named_parameters()}
    def worst(results):
        return max(float((v - expected[n]).norm() / expected[n].norm()) for r in results for n, v in r.items())

    assert worst(run_on_ranks(4, _dit_trainer_case, False)) < 1e-12
    assert worst(run_on_ranks(4, _dit_trainer_case, True)) > 1e-4, "the per-rank mean should be detectably off"


class _UncutDiT(_DiTModule):
    """The same model, its training_step written as on one device: the whole clip on every rank, nothing cut."""

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        pred = self.model(x, torch.arange(x.shape[1]), ids, None, is_causal=False)
        return ((pred - y) ** 2).sum(-1)


def _uncut_case(module_class) -> str:
    use_existing_process_group()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=1, logger=False,
        strategy=nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="sample_mean", summary=False),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module_class())
    except ValueError as error:
        return str(error)
    return "trained"


def test_cp_that_cuts_nothing_is_refused_at_the_first_step_on_every_rank():
    # every cp rank would compute the whole clip: right numbers, context parallelism a silent no-op
    for message in run_on_ranks(4, _uncut_case, _UncutDiT):
        assert "NDParallelStrategy(cp=2): the first training step of _UncutDiT cut no sequence" in message
        assert "shard_sequence" in message and "tp_plan='auto'" in message
    assert run_on_ranks(4, _uncut_case, _DiTModule) == ["trained"] * 4  # the step that cuts trains


# --- end to end: NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="token_mean") ---


class _CausalLMModule(L.LightningModule):
    """Packed token rows; the cp rank takes its load-balanced part of each row; loss: token mean."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer(13)

    def configure_model(self) -> None:
        fully_shard(self.model, mesh=self.trainer.strategy.meshes["fsdp"])

    def count_tokens(self, batch) -> torch.Tensor:  # of the raw batch, as cp peers all see it
        return count_valid_tokens(batch[1])

    def training_step(self, batch, batch_idx):
        cp = self.trainer.strategy.meshes["cp"]
        rank, size = cp.get_local_rank(), cp.size()
        (tokens, positions), (labels, _) = (shard_sequence(t, rank, size, dim=1, load_balance=True) for t in batch)
        logits = self.model(tokens, positions, None, cp.get_group(), is_causal=True)
        # per-token losses of this rank's cp shard (a mean would need the shard's own token count)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=DIT_LR)

    def train_dataloader(self):
        b = _packed_batch(8, 4)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(b["tokens"], b["labels"]), batch_size=1)


def _lm_trainer_case() -> dict:
    use_existing_process_group()
    module = _CausalLMModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=1, accumulate_grad_batches=2, logger=False,
        strategy=nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="token_mean"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)  # one step = 2 micro-batches x 2 dp ranks = every row
    return {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}


def test_token_mean_with_context_parallel_in_the_trainer_matches_single_device():
    """Each token counted once: cp peers read the same raw batch, so counts are summed over dp only."""
    grads, _ = _reference("lm", _packed_batch(8, 4))
    expected = {n: p.detach() - DIT_LR * grads[n] for n, p in TinyTransformer(13).named_parameters()}
    results = run_on_ranks(4, _lm_trainer_case)
    assert max(float((v - expected[n]).norm() / expected[n].norm()) for r in results for n, v in r.items()) < 1e-12


class _FailingSampleIds(_DiTModule):
    def sample_ids(self, batch):
        if self.trainer.strategy.meshes["dp"].get_local_rank() == 1:  # both cp ranks of one data rank
            raise IndexError("no sample lengths in this batch")
        return super().sample_ids(batch)


def _failing_sample_ids_case() -> str:
    use_existing_process_group()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=nd.NDParallelStrategy(dp_shard=2, cp=2, loss_normalization="sample_mean"),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(_FailingSampleIds())
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.faults
def test_sample_ids_failing_on_some_ranks_raises_the_same_error_on_every_rank():
    messages = run_on_ranks(4, _failing_sample_ids_case, timeout=60)
    failing = "sample_ids(batch) of micro-batch 0 raised IndexError: no sample lengths in this batch"
    assert messages == [f"rank 2: {failing}; rank 3: {failing}"] * 4, messages
