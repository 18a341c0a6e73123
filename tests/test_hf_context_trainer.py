"""The family matrix on context-parallel layouts: every transformers causal-LM family of ``hf_families.py`` (and
GPT-OSS, for its attention sinks), its tiny config with sliding windows where the family has them, trained with
``tp_plan="auto"`` on ``dp_shard=2 x cp=2`` (and a few on ``cp=2 x tp=2``) through the model's own loss
(``labels=``), accumulation over micro-batches of uneven token counts and ``GlobalNormClip``; against the same model
trained on one process in float64 on the whole sequences: losses, norms and every parameter after 2 clipped steps
agree to 1e-5 (fp32), and ``VerifyOneDevice`` reports the step exact."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import FAMILIES, MOE, tiny_causal_lm
from test_hf_families import _fit

import lightning_ndclip as nd

transformers = pytest.importorskip("transformers")

STEPS, LR, MAX_NORM, BATCH, ROWS, SEQ = 2, 0.5, 0.5, 2, 8, 8
WINDOWED = {"sliding_window": 3}  # shorter than the sequence: the window masks
OVERRIDES = {  # the variants the families ship, in tiny configs
    "Llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 4}},
    "Mistral": WINDOWED, "Gemma2 (tied)": WINDOWED, "Gemma3 (tied)": WINDOWED, "Phi3": WINDOWED,
    "Starcoder2 (tied)": WINDOWED, "GPT-OSS": WINDOWED,
    "Qwen2 (tied)": {**WINDOWED, "use_sliding_window": True, "max_window_layers": 1},
}  # fmt: skip
CP_FAMILIES = [*FAMILIES, "GPT-OSS"]


def _model(family: str):
    model = tiny_causal_lm(family, **OVERRIDES.get(family, {}))
    if family in MOE or family == "GPT-OSS":
        model.set_experts_implementation("eager")  # the grouped kernels have no float64 for the reference
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 32, (ROWS, SEQ), generator=g)
    labels = tokens.clone()
    labels[torch.rand(ROWS, SEQ, generator=g) < 0.3] = -100  # micro-batches with different token counts
    return [{"input_ids": t, "labels": y} for t, y in zip(tokens, labels)]


class _CausalLM(L.LightningModule):
    """A family's causal LM fine-tuned the way the transformers docs show: ``model(**batch).loss``."""

    def __init__(self, family: str, batch: int = BATCH) -> None:
        super().__init__()
        self.lm = _model(family)
        self.batch = batch

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()  # the model shifts the labels: position t predicts t + 1

    def training_step(self, batch, batch_idx):
        return self.lm(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_data(), batch_size=self.batch)


def _reference(family: str) -> dict:
    """One process, float64, each step on all 8 rows (2 micro-batches x 2 data ranks x 2 rows), whole sequences."""
    model = _model(family).double()
    batch = torch.utils.data.default_collate(_data())
    losses, norms = [], []
    for _ in range(STEPS):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _fit_case(family: str, layout: dict[str, int]) -> dict:
    use_existing_process_group()
    module = _CausalLM(family, batch=ROWS // (2 * layout.get("dp_shard", 1)))  # every step: all rows, in 2 micro-batches
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(module.lm.base_model.layers[0])])
    strategy = nd.NDParallelStrategy(**layout, plan=plan, loss_normalization="token_mean", summary=False)
    _, logged = _fit(module, strategy, STEPS)
    return {**logged, "params": {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()}}


def _check(result: dict, reference: dict) -> None:
    assert "verdict: exact" in result["verified"], result["verified"]
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=1e-5, atol=0, msg=key)
    assert result["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", CP_FAMILIES)
def test_a_family_on_dp_shard_and_cp_equals_one_device(family):
    reference = _reference(family)
    assert min(reference["norms"]) > MAX_NORM, "clipping should be active at every step"
    _check(run_on_ranks(4, _fit_case, family, {"dp_shard": 2, "cp": 2})[0], reference)


@pytest.mark.parametrize("family", ["Llama (tied)", "Qwen3", "Gemma2 (tied)", "Mixtral"])
def test_a_family_on_cp_and_tp_equals_one_device(family):
    # each tp rank attends its own heads over the cut sequence; Qwen3's per-head norms summed over tp, a tied head
    _check(run_on_ranks(4, _fit_case, family, {"dp_shard": 1, "cp": 2, "tp": 2})[0], _reference(family))
