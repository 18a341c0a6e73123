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
from test_hf_families import _fit, _head_norms_left_whole, _unmapped_style

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


def _fit_case(family: str, layout: dict[str, int], loss_parallel: bool = False) -> dict:
    use_existing_process_group()
    module = _CausalLM(family, batch=ROWS // (2 * layout.get("dp_shard", 1)))  # every step: all rows, in 2 micro-batches
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(module.lm.base_model.layers[0])], loss_parallel=loss_parallel)
    strategy = nd.NDParallelStrategy(**layout, plan=plan, loss_normalization="token_mean", summary=False)
    _, logged = _fit(module, strategy, STEPS)
    result = {**logged, "params": {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()}}
    if loss_parallel:  # the logits of a forward outside a step (the whole sequence): how they are laid out
        logits = module.lm(input_ids=_data()[0]["input_ids"][None]).logits
        result["logits"] = f"{type(logits).__name__} {tuple(getattr(logits, 'placements', ()))}"
    return result


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
    model = tiny_causal_lm(family)
    if _unmapped_style(model) or _head_norms_left_whole(model):  # older releases' plans, refused on tp (the matrix)
        pytest.skip(f"this transformers release's {family} plan is refused on tp (test_hf_families.py)")
    _check(run_on_ranks(4, _fit_case, family, {"dp_shard": 1, "cp": 2, "tp": 2})[0], _reference(family))


def test_loss_parallel_on_cp_and_tp_equals_one_device():
    """The model's own loss over the sequence cut along cp (labels shifted over the whole sequence), on logits sharded
    along the vocabulary over tp."""
    result = run_on_ranks(4, _fit_case, "Llama (tied)", {"dp_shard": 1, "cp": 2, "tp": 2}, True)[0]
    _check(result, _reference("Llama (tied)"))
    assert result["logits"] in ("DTensor (Shard(dim=-1),)", "DTensor (Shard(dim=2),)"), result["logits"]


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index of packed rows (position ids restarting at 0), numbered from 0 in each row."""
    return (position_ids == 0).cumsum(-1) - 1


def _batches_of(kind: str) -> list[dict[str, torch.Tensor]]:
    """``padded``: right padding (attention_mask) of different lengths; ``packed``: documents of different lengths
    one after the other (position_ids restarting at 0), the labels pre-shifted as ``next_labels``."""
    rows = _data()
    g = torch.Generator().manual_seed(2)
    for i, row in enumerate(rows):
        if kind == "padded":
            length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
            row["attention_mask"] = (torch.arange(SEQ) < length).long()
            row["labels"] = torch.where(row["attention_mask"] == 1, row["labels"], -100)
        else:
            cut = 1 + i % (SEQ - 2)  # two documents: [0, cut), [cut, SEQ)
            row["position_ids"] = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
            row["next_labels"] = torch.cat([row["labels"][1:], torch.tensor([-100])])
            del row["labels"]
    return rows


class _TaskLM(_CausalLM):
    """``padded``: the model's own loss, also as the validation loss. ``packed``: the per-sample mean over documents,
    from per-token losses of the model's logits (the labels shifted in the data; ``sample_ids`` numbers the
    documents of the micro-batch and cuts them as the strategy cuts the sequence)."""

    def __init__(self, family: str, kind: str, batch: int) -> None:
        super().__init__(family, batch)
        self.kind = kind

    def sample_ids(self, batch):
        docs = _documents(batch["position_ids"])
        per_row = docs.amax(dim=1) + 1
        numbered = docs + (per_row.cumsum(0) - per_row)[:, None]
        numbered = torch.where(batch["next_labels"] != -100, numbered, -1)
        cp = self.device_mesh["cp"]
        return nd.core.context.shard_sequence(numbered, cp.get_local_rank(), cp.size(), load_balance=True)[0], int(per_row.sum())

    def training_step(self, batch, batch_idx):
        if self.kind == "padded":
            return self.lm(**batch).loss
        logits = self.lm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["next_labels"].flatten(), ignore_index=-100, reduction="none"
        )
        return per_token.view(batch["next_labels"].shape)

    validation_step = training_step

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_batches_of(self.kind), batch_size=self.batch)

    val_dataloader = train_dataloader


def _task_reference(family: str, kind: str) -> dict:
    model = _model(family).double()
    batch = torch.utils.data.default_collate(_batches_of(kind))
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        if kind == "padded":
            loss = model(**batch).loss
        else:  # the mean over documents of their token means
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            labels = batch["next_labels"]
            per_token = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
            ).view(labels.shape)
            docs = _documents(batch["position_ids"]) + 2 * torch.arange(ROWS)[:, None]  # two documents per row
            valid = labels != -100
            sums = torch.zeros(2 * ROWS, dtype=per_token.dtype).index_add(0, docs[valid], per_token[valid])
            counts = torch.zeros(2 * ROWS).index_add(0, docs[valid], torch.ones(int(valid.sum())))
            loss = (sums[counts > 0] / counts[counts > 0]).mean()
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _task_case(family: str, kind: str) -> dict:
    use_existing_process_group()
    module = _TaskLM(family, kind, batch=BATCH)
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(module.lm.base_model.layers[0])])
    normalization = "token_mean" if kind == "padded" else "sample_mean"
    strategy = nd.NDParallelStrategy(dp_shard=2, cp=2, plan=plan, loss_normalization=normalization, summary=False)
    trainer, logged = _fit(module, strategy, STEPS)
    # after a validation forward FSDP2 may hold the parameters gathered (plain tensors)
    params = {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in module.lm.named_parameters()}
    validated = trainer.validate(module, verbose=False)[0]["val_loss"]
    return {**logged, "params": params, "val_loss": float(validated)}


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_padded_and_packed_batches_equal_one_device(kind):
    # padding: masked as keys on every rank; packed documents: attention within each, the per-sample mean over them;
    # the validation loss, the exact mean of the model's losses after training (sample_mean: of the documents)
    family = "Qwen2 (tied)"  # a sliding window on one layer, full attention on the other
    reference = _task_reference(family, kind)
    result = run_on_ranks(4, _task_case, family, kind)[0]
    assert "verdict: exact" in result["verified"], result["verified"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
    final = _model(family).double()
    final.load_state_dict(reference["params"], strict=False)  # a tied head is the embedding
    batch = torch.utils.data.default_collate(_batches_of(kind))
    if kind == "padded":
        torch.testing.assert_close(result["val_loss"], final(**batch).loss.item(), rtol=1e-5, atol=0)


class _OwnMeanLM(_CausalLM):
    """Its own mean over this rank's tokens: a scalar whose count is this rank's, which the strategy cannot know."""

    def training_step(self, batch, batch_idx):
        logits = self.lm(input_ids=batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _own_mean_case() -> str:
    use_existing_process_group()
    module = _OwnMeanLM("Llama")
    plan = nd.ParallelPlan(tp_plan="auto")
    strategy = nd.NDParallelStrategy(dp_shard=2, cp=2, plan=plan, loss_normalization="token_mean", summary=False)
    with pytest.raises(ValueError) as error:
        _fit(module, strategy, STEPS)
    return str(error.value)


def test_a_scalar_mean_of_its_own_is_refused_under_cp():
    message = run_on_ranks(4, _own_mean_case)[0]
    assert "must return per-token losses" in message and "the transformers model's own .loss" in message, message


class _DropoutLM(_CausalLM):
    """GPT-NeoX with hidden dropout; records the zeros of every dropout's output (its mask) in each step."""

    def __init__(self) -> None:
        super().__init__("GPT-NeoX", batch=ROWS // 4)
        self.lm = tiny_causal_lm("GPT-NeoX", hidden_dropout=0.5)
        self.masks: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        for m in self.lm.modules():
            if isinstance(m, torch.nn.Dropout) and m.p > 0:
                m.register_forward_hook(lambda module, args, out: self.masks.append((out == 0).detach().clone()))


def _dropout_case() -> list[torch.Tensor]:
    use_existing_process_group()
    module = _DropoutLM()
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(module.lm.base_model.layers[0])])
    strategy = nd.NDParallelStrategy(dp_shard=2, cp=2, plan=plan, loss_normalization="token_mean", summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer.fit(module)
    return module.masks


def test_dropout_inside_a_model_whose_sequences_are_cut_over_cp_differs_between_the_parts():
    """Every activation of the model is this cp rank's tokens: its dropout draws from the rank's own stream over cp
    (with the shared stream, both halves of a sequence got the same mask at the same local positions)."""
    masks = run_on_ranks(4, _dropout_case)  # ranks 0 and 1: the two cp halves of data rank 0's sequences
    assert len(masks[0]) == len(masks[1]) > 0 and masks[0][0].float().mean() > 0.2
    assert all(not torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
