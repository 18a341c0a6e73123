"""The family matrix: every transformers causal-LM family with a tensor-parallel plan (tiny configs,
``hf_families.py``), trained with its own plan (``tp_plan="auto"``) on dp_shard=2 x tp=2 with the exact token mean,
accumulation over micro-batches of uneven token counts and ``GlobalNormClip``, against the same model trained on one
process in float64: the logged losses, the norms and the parameters after 2 clipped steps agree to 1e-5 (fp32), or
the family is refused with an error naming the style. ``docs/howto/hugging-face.md``'s table is this matrix
(``test_the_docs_table_is_the_matrix`` fails, printing the table, when they differ)."""

from __future__ import annotations

import re
import warnings
from fnmatch import fnmatch
from pathlib import Path

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import EXPERTS_OVER_TP, FAMILIES, MOE, tiny_causal_lm, with_experts_over_tp
from test_callbacks import Recorder
from torch import nn
from torch.distributed.fsdp import FSDPModule

import lightning_ndclip as nd

transformers = pytest.importorskip("transformers")

STEPS, LR, MAX_NORM, BATCH = 2, 0.5, 0.5, 2
DOCS = Path(__file__).resolve().parent.parent / "docs" / "howto" / "hugging-face.md"

REFUSED: dict[str, str] = {}  # family -> the style its plan uses that no exact PyTorch style expresses
EXACT = [family for family in FAMILIES if family not in REFUSED]


def _unmapped_style(model: nn.Module) -> str | None:
    """A style of this transformers release's plan that ``hf_tp_plan`` does not map (the MoE plans of 5.0 use
    ``ep_router`` / ``local_colwise``; later releases ``moe_tp_experts``, which it maps)."""
    try:
        nd.hf_tp_plan(model)
    except ValueError as error:
        return re.search(r"= '(\w+)'", str(error))[1]
    return None


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 32, (8, 6), generator=g)
    labels = torch.randint(3, 32, (8, 6), generator=g)
    labels[torch.rand(8, 6, generator=g) < 0.3] = -100  # micro-batches with different token counts
    return tokens, labels


class _FamilyModule(L.LightningModule):
    """A family's tiny causal LM trained the usual way: the token-mean cross-entropy of (input_ids, labels) batches
    (``data``, default ``_data()``) with SGD."""

    def __init__(self, family: str, data: tuple[torch.Tensor, torch.Tensor] | None = None, batch: int = BATCH) -> None:
        super().__init__()
        self.lm = tiny_causal_lm(family)
        self.data, self.batch = data, batch

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.lm(input_ids=tokens).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        data = _data() if self.data is None else self.data
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=self.batch)


def _reference(family: str) -> dict:
    """One process, float64; each Trainer step covers all 8 rows (2 micro-batches x 2 data ranks x 2 rows). MoE
    experts run their plain loop (the grouped matmul kernels have no float64)."""
    model = tiny_causal_lm(family).double()
    if family in MOE:
        model.set_experts_implementation("eager")
    tokens, labels = _data()
    losses, norms = [], []
    for _ in range(STEPS):
        model.zero_grad()
        logits = model(input_ids=tokens).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _sharded_over_tp(param: torch.Tensor) -> bool:
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" in names and not param.placements[names.index("tp")].is_replicate()  # Shard, or _StridedShard


def _fit(module: L.LightningModule, strategy: nd.NDParallelStrategy, steps: int) -> tuple[L.Trainer, dict]:
    """Train ``module`` on 4 CPU ranks (accumulation 2, ``VerifyOneDevice``, ``GlobalNormClip``): the trainer, and what
    the run logged (losses, norms), reported (``verified``) and warned of FSDP2 views (``view_warnings``)."""
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, accumulate_grad_batches=2,
        callbacks=[verify := nd.VerifyOneDevice(), nd.GlobalNormClip(MAX_NORM)], logger=recorder, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return trainer, {
        "losses": [m["train_loss"] for _, m in recorder.rows if "train_loss" in m],
        "norms": [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m],
        "view_warnings": sorted({str(w.message)[:80] for w in caught if "returned a view tensor" in str(w.message)}),
        "verified": verify.report,
    }


def _fit_case(family: str, export_to: str | None = None, experts_over_tp: bool = False) -> dict:
    use_existing_process_group()
    module = _FamilyModule(family)
    if experts_over_tp:
        with_experts_over_tp(module.lm)
    plan = nd.ParallelPlan(tp_plan="auto")  # FSDP2 units: the family's own blocks (its _no_split_modules)
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=plan, loss_normalization="token_mean", summary=False)
    _, logged = _fit(module, strategy, STEPS)
    if export_to is not None:  # the trained model back as a Hugging Face checkpoint, and its logits here
        nd.save_hf_checkpoint(module.lm, export_to, max_shard_bytes=4096)  # several shards
        with torch.no_grad():
            return {"logits": module.lm(input_ids=_data()[0]).logits}
    return {
        **logged,
        "params": {n: p.detach().full_tensor() for n, p in module.lm.named_parameters()},
        "tp_split": sorted(n for n, p in module.lm.named_parameters() if _sharded_over_tp(p)),
        "layer_units": [isinstance(layer, FSDPModule) for layer in module.lm.base_model.layers],
    }


def _head_norms_left_whole(model: nn.Module) -> bool:
    """Whether this transformers release's plan leaves per-head norms (Qwen3 / Gemma3 ``q_norm``, over one head's
    width) whole: releases before 'replicated_with_grad_allreduce' (5.0-5.4, 5.10) do. The strategy sums their
    gradients over tp (it sees them meet split activations in the first forward); pipeline stages do not watch."""
    modules = dict(model.named_modules())
    per_head = any(
        name.endswith(".q_norm") and norm.weight.numel() < modules[name[: -len("q_norm")] + "q_proj"].out_features
        for name, norm in modules.items()
    )
    return per_head and not any("q_norm" in k for k in model.tp_plan)


@pytest.mark.parametrize("family", EXACT)
def test_a_family_trained_with_its_own_plan_equals_one_device(family):
    unmapped = _unmapped_style(tiny_causal_lm(family))
    if unmapped is not None:  # an older release's MoE plan
        assert family in MOE and unmapped in ("ep_router", "local_colwise", "local_rowwise", "gather"), unmapped
        return
    reference = _reference(family)
    assert min(reference["norms"]) > MAX_NORM, "clipping should be active at every step"
    result = run_on_ranks(4, _fit_case, family)[0]
    # the model's own plan was applied: exactly the weights of the modules it names are split over tp (a tied
    # weight, one parameter, by any of its modules), the norms its plan replicates left out
    model = tiny_causal_lm(family)
    whole = ("replicated_with_grad_allreduce", "mla_kv_a_proj", "replicate")  # weights these styles keep whole
    styles = {k: v for k, v in model.tp_plan.items() if v not in whole}
    canonical = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    split = {canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
             if n.endswith(".weight") and any(fnmatch(n.rsplit(".", 1)[0], k) for k in styles)}  # fmt: skip
    assert [n for n in result["tp_split"] if n.endswith(".weight")] == sorted(split), result["tp_split"]
    # every expert weight split over tp where the plan names the experts (transformers 5.5-5.24), none after
    experts = [n for n, _ in model.named_parameters() if ".experts." in n and "moe_tp_experts" in model.tp_plan.values()]
    assert [n for n in result["tp_split"] if ".experts." in n] == sorted(experts)
    assert result["layer_units"] == [True] * len(model.base_model.layers)  # each decoder layer an FSDP2 unit
    assert result["view_warnings"] == []  # FSDP2's, for a unit (the model, the strategy's root) returning a view
    assert "verdict: exact" in result["verified"], result["verified"]  # the users' own check agrees
    assert "as one batch  loss" in result["verified"], result["verified"]  # the window as one batch too
    _assert_matches(result, reference)


def _assert_matches(result: dict, reference: dict) -> None:
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=1e-5, atol=0, msg=key)
    assert result["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_experts_the_plan_splits_over_tp_train_exactly():
    """Mixtral's experts under 'moe_tp_experts' (its own plan in transformers 5.5-5.24, given here where the release
    leaves the experts to ep): each expert's gate and up rows and its down columns split over tp; exact."""
    if _unmapped_style(tiny_causal_lm("Mixtral")) is not None:
        pytest.skip("this release's Mixtral plan has styles hf_tp_plan does not map")
    reference = _reference("Mixtral")
    result = run_on_ranks(4, _fit_case, "Mixtral", None, True)[0]
    experts = [n for n, _ in tiny_causal_lm("Mixtral").named_parameters() if ".experts." in n]
    assert experts and [n for n in result["tp_split"] if ".experts." in n] == sorted(experts)
    assert "verdict: exact" in result["verified"], result["verified"]
    _assert_matches(result, reference)


def test_a_plan_whose_style_cannot_be_exact_is_refused_naming_the_entry():
    llama = tiny_causal_lm("Llama")
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.mlp'\] = 'sequence_parallel': no plain PyTorch"):
        nd.hf_tp_plan(_with_plan("Llama", {**llama.tp_plan, "model.layers.*.mlp": "sequence_parallel"}))
    mixtral = tiny_causal_lm("Mixtral")
    if _unmapped_style(mixtral) is not None:
        return  # an older release's MoE plan
    weights_alone = {k: v for k, v in {**mixtral.tp_plan, **EXPERTS_OVER_TP}.items() if v != "moe_tp_experts"}
    with pytest.raises(ValueError, match=r"experts.gate_up_proj'\] = 'packed_colwise' names weights"):
        nd.hf_tp_plan(_with_plan("Mixtral", weights_alone))


def _with_plan(family: str, plan: dict) -> nn.Module:
    model = tiny_causal_lm(family)
    model.tp_plan = plan
    return model


def _table() -> str:
    rows = ["| family (tiny config) | tied embeddings | `tp_plan=\"auto\"` on dp_shard=2 × tp=2 |", "|---|---|---|"]
    for family in FAMILIES:
        model = tiny_causal_lm(family)
        tied = "yes" if model.get_output_embeddings().weight is model.get_input_embeddings().weight else "no"
        verdict = f"refused: `{REFUSED[family]}`" if family in REFUSED else "exact (1e-5, fp32)"
        rows.append(f"| {family.split(' (')[0]} | {tied} | {verdict} |")
    return "\n".join(rows)


def test_the_docs_table_is_the_matrix():
    text = DOCS.read_text(encoding="utf-8")
    found = re.search(r"<!-- family-matrix -->\n(.*?)\n<!-- /family-matrix -->", text, flags=re.S)
    assert found, f"{DOCS} lacks the <!-- family-matrix --> block"
    assert found[1] == _table(), f"update the table in {DOCS} to:\n{_table()}"


def _without_entries_case(family: str, dropped: str) -> str:
    use_existing_process_group()
    module = _FamilyModule(family)
    plan = {k: v for k, v in nd.hf_tp_plan(module).items() if dropped not in k}
    units = [type(module.lm.model.layers[0])]
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=nd.ParallelPlan(tp_plan=plan, fsdp_units=units),
                                     loss_normalization="token_mean", summary=False)  # fmt: skip
    try:
        return _fit(module, strategy, 1)[1]["verified"]
    except ValueError as error:
        return str(error)


def test_a_per_head_norm_the_plan_leaves_whole_gets_its_gradient_summed_over_tp():
    """Qwen3's q_norm / k_norm without their plan entries (as transformers 5.0-5.4 ship it): a weight the same on every
    tp rank applied to each rank's heads; the strategy sees it meet split activations in the first forward and sums
    its gradient over tp, so the step is exact (it was refused at the first step by the replica check)."""
    verified = run_on_ranks(4, _without_entries_case, "Qwen3", "_norm")[0]  # VerifyOneDevice reports on rank 0
    assert "verdict: exact" in verified, verified


@pytest.mark.faults
def test_a_rotary_key_left_whole_on_split_heads_is_refused_at_the_first_forward():
    """DeepSeek-V2's joint key-value projection kept whole without its style ('mla_kv_a_proj' taken as 'replicate'):
    its output's rotary part goes to each rank's heads, so each rank's gradient is a partial sum; the copies would
    drift apart, silently: refused in the first forward (by the replica check at the first step before), naming the
    layer and where its output met the split heads."""
    if _unmapped_style(tiny_causal_lm("DeepSeek-V2")) is not None:
        pytest.skip("this transformers release's DeepSeek-V2 plan has styles hf_tp_plan does not map")
    messages = run_on_ranks(4, _without_entries_case, "DeepSeek-V2", "kv_a_proj")
    assert all(m == messages[0] for m in messages), messages
    assert messages[0].startswith("a whole activation (the same on every tp rank"), messages[0]
    assert "lm.model.layers.0.self_attn.kv_a_proj_with_mqa's output, in copy_ (lm.model.layers.0.self_attn)" in messages[0]


@pytest.mark.parametrize("family", ["Llama (tied)", "Phi3"])
def test_a_trained_model_exports_as_a_hugging_face_checkpoint_that_from_pretrained_loads(family, tmp_path):
    """Trained on dp_shard=2 x tp=2, written shard by shard (no rank gathers the model), loaded on one process by
    from_pretrained: the same logits (fp32), the tie kept."""
    results = run_on_ranks(4, _fit_case, family, str(tmp_path))
    _, model_class, _ = FAMILIES[family]
    loaded = getattr(transformers, model_class).from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == ("tied" in family)
    with torch.no_grad():
        logits = loaded(input_ids=_data()[0]).logits
    for result in results:
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-6)
