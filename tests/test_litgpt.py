"""LitGPT (Lightning's own LLM library) models under the strategy, written the way LitGPT's scripts train them: a
tiny Llama-style ``litgpt.GPT`` in a LightningModule, LitGPT's own ``chunked_cross_entropy`` (the token mean,
``-100`` ignored). On FSDP2 (``dp_shard=4``, each ``Block`` a unit, the exact token mean, accumulation over
micro-batches of uneven token counts, ``GlobalNormClip``, ``VerifyOneDevice``) the parameters after 2 clipped
steps equal the plain model trained on one process in float64 (1e-5); the per-micro-batch mean the Lightning habit
gives is off by more, and ``VerifyOneDevice`` says so. Under tp, the plan a GPT user writes (``attn.qkv`` colwise)
is refused at the first forward on every rank, naming the fused projection: LitGPT cuts ``[all q | all k | all v]``
rows with ``split``, which each rank would apply to its own block. CI runs this file in a venv of its own (LitGPT
pins ``huggingface-hub<1.4``, which the transformers releases the suite tests cannot share);
``docs/howto/litgpt.md`` is what it shows."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_ndclip as nd

litgpt = pytest.importorskip("litgpt")
from litgpt.utils import chunked_cross_entropy  # noqa: E402

STEPS, LR, MAX_NORM, ROWS = 2, 0.5, 0.5, 8
CONFIG = dict(
    name="tiny-llama", block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=4, n_query_groups=2,
    n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP", intermediate_size=64,
)  # fmt: skip
USER_TP_PLAN = {  # the plan a GPT user writes for LitGPT's module names
    "model.transformer.h.*.attn.qkv": ColwiseParallel(),
    "model.transformer.h.*.attn.proj": RowwiseParallel(),
    "model.transformer.h.*.mlp.fc_1": ColwiseParallel(),
    "model.transformer.h.*.mlp.fc_2": ColwiseParallel(),
    "model.transformer.h.*.mlp.proj": RowwiseParallel(),
}


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return litgpt.GPT(litgpt.Config(**CONFIG))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (ROWS, 9), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.4] = -100  # rows with different token counts
    return tokens[:, :-1], targets


class _LitGPTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _gpt()

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return chunked_cross_entropy(self.model(tokens), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=1)


def _fit_case(loss_normalization: str | None, tp: int = 1) -> dict:
    """4 ranks, each step 2 micro-batches x 4 data ranks (tp=1) of one row: the whole data set."""
    use_existing_process_group()
    module = _LitGPTModule()
    plan = nd.ParallelPlan(tp_plan=USER_TP_PLAN if tp > 1 else None, fsdp_units=[litgpt.model.Block])
    strategy = nd.NDParallelStrategy(dp_shard=4 // tp, tp=tp, plan=plan, loss_normalization=loss_normalization, summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=2,
        callbacks=[verify := nd.VerifyOneDevice(on_mismatch="warn"), nd.GlobalNormClip(MAX_NORM)], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module)
    except ValueError as error:
        return {"refused": str(error)}
    return {"params": {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}, "verified": verify.report}


def _reference() -> dict[str, torch.Tensor]:
    """The plain model on one process in float64, each step the token mean over all rows."""
    model = _gpt().double()
    tokens, targets = _data()
    for _ in range(STEPS):
        model.zero_grad()
        chunked_cross_entropy(model(tokens), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {n: p.detach() for n, p in model.named_parameters()}


def _worst(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert params.keys() == reference.keys()
    return max(float((params[n].double() - r).abs().max() / r.abs().max()) for n, r in reference.items())


def test_a_litgpt_model_trains_on_fsdp2_as_on_one_device():
    reference = _reference()
    exact, habit = run_on_ranks(4, _fit_case, "token_mean")[0], run_on_ranks(4, _fit_case, None)[0]
    assert _worst(exact["params"], reference) < 1e-5
    assert "verdict: exact" in exact["verified"], exact["verified"]  # the users' own check agrees
    assert "verdict: MISMATCH" in habit["verified"], habit["verified"]
    assert _worst(habit["params"], reference) > 1e-3  # each micro-batch's own mean: another function


def test_litgpts_fused_qkv_under_the_plan_a_user_writes_is_refused_naming_it():
    messages = [result["refused"] for result in run_on_ranks(4, _fit_case, "token_mean", 2)]
    assert all(m == messages[0] for m in messages), messages
    assert messages[0].startswith("model.transformer.h.0.attn.qkv is ColwiseParallel"), messages[0]
    assert "split" in messages[0] and "fused" in messages[0], messages[0]
