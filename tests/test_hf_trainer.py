"""A Hugging Face transformers Llama, tensor parallel with its own plan (``ParallelPlan(tp_plan="auto")``), equals the
plain model on one process: FSDP2 x TP, token mean and GlobalNormClip on, against float64 on one device; with tied
input and output embeddings too (they stay one parameter)."""

from __future__ import annotations

from fnmatch import fnmatch

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_callbacks import Recorder
from test_hf import _llama  # skips this module too where transformers is not installed
from torch import nn

import lightning_ndclip as nd

STEPS, LR, MAX_NORM, BATCH = 2, 0.5, 0.5, 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (8, 6), generator=g)
    labels = torch.randint(0, 32, (8, 6), generator=g)
    labels[torch.rand(8, 6, generator=g) < 0.3] = -100  # micro-batches with different token counts
    return tokens, labels


class _HFModule(L.LightningModule):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.llama = _llama(tied)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.llama(input_ids=tokens).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=BATCH)


def _reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model in float64 on one process; each Trainer step below covers the 8 rows (2 micro-batches x
    2 data ranks x 2 rows), so the order of rows inside a step does not matter."""
    model = _llama(tied).double()
    tokens, labels = _data()
    norms = []
    for _ in range(STEPS):
        model.zero_grad()
        logits = model(input_ids=tokens).logits
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_case(tied: bool) -> dict:
    use_existing_process_group()
    recorder = Recorder()
    module = _HFModule(tied)
    layer = type(module.llama.model.layers[0])
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[layer])
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=plan, loss_normalization="token_mean")
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=2,
        callbacks=[nd.GlobalNormClip(MAX_NORM)], logger=recorder, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return {
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "params": {n: p.detach().full_tensor() for n, p in module.llama.named_parameters()},
        "tied": module.llama.lm_head.weight is module.llama.model.embed_tokens.weight,
        "tp_sharded": sorted(n for n, p in module.llama.named_parameters() if "tp" in p.device_mesh.mesh_dim_names),
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_transformers_llama_with_its_own_plan_equals_one_device(tied):
    ref_norms, ref_params = _reference(tied)
    assert min(ref_norms) > MAX_NORM, "clipping should be active at every step"
    result = run_on_ranks(4, _fit_case, tied)[0]
    assert result["tied"] == tied
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert result["params"].keys() == ref_params.keys()
    for name, expected in ref_params.items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
    # the model's own plan was applied: exactly the weights of the modules it names are split over tp (and the
    # tied embedding, the same parameter as the split head)
    planned = [key for key in _llama().tp_plan] + (["model.embed_tokens"] if tied else [])
    expected = sorted(n for n, _ in _llama(tied).named_parameters() if any(fnmatch(n.rsplit(".", 1)[0], k) for k in planned))
    assert result["tp_sharded"] == expected and sum(".self_attn." in n for n in expected) == 2 * 4
