"""A transformers MoE fine-tuned with its load-balancing loss (``output_router_logits=True``) in the Trainer: with
``router_aux_loss`` under ``"load_balancing_loss"``, 4 ranks (FSDP2 over dp_shard=4; dp_shard=4 x ep=2 with the model's
own expert-parallel plan) train exactly as one device (float64 reference, 1e-5 in float32), with accumulation over
micro-batches of uneven padding and a rank without loss tokens, and ``VerifyOneDevice`` reports exact; the model's own
per-rank ``aux_loss`` in the loss changes the training and ``VerifyOneDevice`` reports the mismatch. The expert load is
logged per layer and optimizer step as on one device."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import tiny_causal_lm
from test_balance import transformers_aux
from test_callbacks import Recorder
from torch.nn import functional as F

import lightning_ndclip as nd
from lightning_ndclip.core.load_balance import experts_of, max_over_mean
from lightning_ndclip.lightning.expert_load import router_aux_loss

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(  # releases before model.ep_plan (5.0, the floor) also return float32 router logits
    not hasattr(transformers.PreTrainedModel, "ep_plan"), reason="this transformers release has no model.ep_plan"
)
needs_the_strategy = pytest.mark.skipif(
    not hasattr(nd.NDParallelStrategy, "adds_load_balancing_loss"),
    reason="needs NDParallelStrategy to add training_step's 'load_balancing_loss' (docs/howto/moe-balancing.md)",
)

STEPS, LR, MAX_NORM, BATCH, COEF, RANKS = 2, 0.5, 0.5, 2, 0.5, 4
ROWS, LENGTH = 16, 6


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16 rows (one optimizer step: 2 micro-batches x 4 data ranks x 2 rows): padding of uneven lengths (row 9 all
    padding) and uneven label counts; rank 3's first micro-batch (rows 3 and 7) routed but without a label."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 32, (ROWS, LENGTH), generator=g)
    pads = torch.tensor([0, 2, 5, 1, 0, 3, 0, 4, 1, LENGTH, 0, 2, 3, 0, 1, 0])
    mask = (torch.arange(LENGTH) < LENGTH - pads[:, None]).long()
    labels = torch.where(mask > 0, torch.randint(3, 32, (ROWS, LENGTH), generator=g), -100)
    labels[torch.rand(ROWS, LENGTH, generator=g) < torch.linspace(0.0, 0.8, ROWS)[:, None]] = -100
    labels[[3, 7]] = -100
    return ids, mask, labels


class _BalancedLM(L.LightningModule):
    """A tiny MoE causal LM: the token-mean cross-entropy plus ``COEF`` times the load-balancing loss, the global
    one (``router_aux_loss``) or transformers' per-rank ``aux_loss`` added to the loss."""

    def __init__(self, family: str, balancing: str) -> None:
        super().__init__()
        self.lm = tiny_causal_lm(family)
        self.lm.config.router_aux_loss_coef = COEF
        self.lm.router_aux_loss_coef = COEF
        self.balancing = balancing

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[2] != -100).sum()

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        out = self.lm(input_ids=ids, attention_mask=mask, output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        if self.balancing == "global":
            return {"loss": ce, "load_balancing_loss": router_aux_loss(self, out, mask)}
        return ce + COEF * out.aux_loss  # what the model's own loss adds: each rank's micro-batch alone

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        """In order (Lightning's own sampler shuffles): rank r reads rows r, r + 4, ..., so the ranks' micro-batch
        m is rows 8m .. 8m + 7."""
        data = torch.utils.data.TensorDataset(*_data())
        where = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False, **where)
        return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


def _reference(family: str) -> dict:
    """One process, float64: each step covers the 16 rows as its 2 global micro-batches (rows 0-7, then 8-15: the 4
    ranks' first and second micro-batches), the loss the window's token-mean cross-entropy plus ``COEF`` times the
    mean of the 2 micro-batches' load-balancing losses; the expert load of each step, per layer."""
    model = tiny_causal_lm(family).double()
    model.set_experts_implementation("eager")
    ids, mask, labels = _data()
    tokens = (labels != -100).sum()
    norms, loads = [], []
    for _ in range(STEPS):
        model.zero_grad()
        loss, load = 0.0, 0
        for rows in (slice(0, 8), slice(8, 16)):
            out = model(input_ids=ids[rows], attention_mask=mask[rows], output_router_logits=True)
            ce = F.cross_entropy(out.logits.flatten(0, 1), labels[rows].flatten(), ignore_index=-100, reduction="sum")
            loss = loss + ce / tokens + COEF * transformers_aux(out.router_logits, *experts_of(model), mask[rows]) / 2
            load = load + nd.load_balance(out.router_logits, model, attention_mask=mask[rows]).expert_load
        loss.backward()
        loads.append(max_over_mean(load).tolist())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return {"norms": norms, "loads": loads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _fit_case(family: str, ep: int, balancing: str) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _BalancedLM(family, balancing)
    layer = type(module.lm.model.layers[0])
    plan = nd.ParallelPlan(tp_plan="auto" if ep > 1 else None, fsdp_units=[layer])
    strategy = nd.NDParallelStrategy(dp_shard=RANKS, ep=ep, plan=plan, loss_normalization="token_mean", summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=RANKS, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=2,
        callbacks=[verify := nd.VerifyOneDevice(on_mismatch="warn"), nd.GlobalNormClip(MAX_NORM)], logger=recorder,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="VerifyOneDevice") if balancing != "global" else contextlib.nullcontext():
        trainer.fit(module)
    layers = len(module.lm.model.layers)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "loads": [[m[f"expert_load/layer_{i}"] for i in range(layers)] for _, m in recorder.rows if "expert_load/layer_0" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()},
        "verified": verify.report,
    }


@needs_the_strategy
@pytest.mark.parametrize("ep", [1, 2], ids=["fsdp2", "fsdp2_ep2"])
def test_router_aux_loss_trains_as_one_device_and_verify_says_exact(ep):
    reference = _reference("Qwen3-MoE")
    result = run_on_ranks(RANKS, _fit_case, "Qwen3-MoE", ep, "global")[0]
    assert "verdict: exact" in result["verified"], result["verified"]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(torch.tensor(result["loads"]), torch.tensor(reference["loads"]), rtol=1e-6, atol=0)


@needs_the_strategy
def test_the_models_own_per_rank_aux_loss_is_caught():
    """transformers' ``aux_loss`` of each rank's micro-batch in the loss: the norms leave the one-device ones and
    VerifyOneDevice reports the mismatch (as one batch, each global micro-batch's loss differs)."""
    reference = _reference("Qwen3-MoE")
    result = run_on_ranks(RANKS, _fit_case, "Qwen3-MoE", 1, "per_rank")[0]
    assert "MISMATCH" in result["verified"] and "differs from its micro-batches" in result["verified"], result["verified"]
    errors = [abs(a / b - 1) for a, b in zip(result["norms"], reference["norms"])]
    assert max(errors) > 1e-4, errors  # 2e-3 here, against 1e-5 for the exact runs


def _other_strategy_case() -> str:
    use_existing_process_group()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(_BalancedLM("Mixtral", "global"))
    except TypeError as error:
        return str(error)
    return "trained"


def test_a_strategy_that_would_drop_the_loss_is_refused():
    """Lightning's own strategies ignore a training_step's other keys: the load-balancing loss would not train."""
    message = run_on_ranks(1, _other_strategy_case)[0]
    assert "router_aux_loss needs a strategy that adds training_step's 'load_balancing_loss'" in message, message
