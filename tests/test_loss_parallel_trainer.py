"""Loss parallel in ``Trainer.fit``: ``NDParallelStrategy(dp_shard=2, tp=2, loss_normalization="token_mean")`` trains a
tied tiny Llama on its own ``.loss``, computed on the vocabulary shards (``ParallelPlan(tp_plan="auto",
loss_parallel=True)``, or the same calls in ``configure_model``), exactly as one process in float64 (4 ranks, 2
micro-batches each, rows with different token counts)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_loss_parallel import _llama
from torch.distributed.tensor import DTensor

import lightning_ndclip as nd
from lightning_ndclip.core.parallel.loss_parallel import loss_parallel_plan

LR = 0.5


class _LlamaModule(L.LightningModule):
    """A tied tiny Llama trained on its own ``.loss``, made loss parallel by ``ParallelPlan(tp_plan="auto",
    loss_parallel=True)`` (:class:`_LlamaByHook`: by the same calls in ``configure_model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _llama(True)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1][:, 1:] != -100).sum()  # the model shifts its labels by one

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return self.lm(input_ids=tokens, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_trainer_batch()), batch_size=2)


class _LlamaByHook(_LlamaModule):
    def configure_model(self) -> None:
        from lightning_ndclip.integrations.transformers.plans import hf_tp_plan

        meshes = self.trainer.strategy.meshes
        nd.parallelize(self.lm, meshes, tp_plan=loss_parallel_plan(self.lm, hf_tp_plan(self.lm, tp=2)))


def _trainer_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 37, (8, 7), generator=g)
    labels = torch.where(torch.rand(8, 7, generator=g) < 0.3, -100, tokens)  # rows with different counts
    return tokens, labels


def _trainer_case(by_plan: bool) -> dict:
    use_existing_process_group()
    module = _LlamaModule() if by_plan else _LlamaByHook()
    plan = nd.ParallelPlan(tp_plan="auto", loss_parallel=True, fsdp_units=[type(module.lm.model.layers[0])]) if by_plan else None
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=plan, loss_normalization="token_mean", summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[nd.VerifyOneDevice()],  # raises on a mismatch: its replay computes the model's loss as the shards do
    )  # fmt: skip
    trainer.fit(module)
    params = {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()}
    assert isinstance(module.lm(input_ids=_trainer_batch()[0][:1]).logits, DTensor)  # sharded along the vocabulary
    return params


@pytest.mark.parametrize("by_plan", [True, False], ids=["ParallelPlan", "configure_model"])
def test_trainer_token_mean_of_the_llamas_own_loss_parallel_loss_equals_one_device(by_plan):
    pytest.importorskip("transformers")
    from lightning_ndclip.integrations.transformers.plans import vocab_parallel_causal_lm_loss

    model = _llama(True)
    model.loss_function = vocab_parallel_causal_lm_loss
    tokens, labels = _trainer_batch()  # one optimizer step: 2 data ranks x 2 micro-batches x 2 rows = all 8 rows
    model(input_ids=tokens, labels=labels, num_items_in_batch=(labels[:, 1:] != -100).sum()).loss.backward()
    with torch.no_grad():
        expected = {n: p - LR * p.grad for n, p in model.named_parameters()}
    for params in run_on_ranks(4, _trainer_case, by_plan):
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12, msg=name)
