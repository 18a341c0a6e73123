"""Pipelines of transformers models without hand-written stages: ``NDParallelStrategy(pp=2, ...)`` with
``PipelineOptions(module=...)`` holding a transformers causal LM cuts it where its own ``base_model_pp_plan`` says
(an even split of its decoder layers; the rotary embedding, the masks and Gemma's specifics on every stage; a tied
embedding and head declared as one parameter), composed with FSDP2 (pp=2 x dp_shard=2) and its own tensor-parallel
plan (pp=2 x tp=2): the logged losses, the norms and every parameter after 2 clipped steps with accumulation equal
the same model trained on one process in float64 (1e-5, fp32). ``lightning_ndclip.integrations.transformers.pipeline``."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import COMMON, FAMILIES, MOE, tiny_causal_lm
from test_hf_families import MAX_NORM, _data, _fit, _head_norms_left_whole, _reference
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_ndclip as nd
from lightning_ndclip.core.pipeline import model_units, split_model, split_points_of, stage_units_of
from lightning_ndclip.integrations.transformers.pipeline import HFPipelineSplit

transformers = pytest.importorskip("transformers")

LR = 0.5  # test_hf_families' _reference trains with this learning rate
LAYOUTS = {"pp2xdp2": {"dp_shard": 2}, "pp2xtp2": {"tp": 2}}
PIPELINED = ["Llama", "Llama (tied)", "Qwen3", "Gemma2 (tied)", "Gemma3 (tied)"]


class _PipelinedFamily(L.LightningModule):
    """A family's tiny causal LM, pipelined by the strategy: ``training_step`` runs the schedule on (input_ids,
    labels) batches, ``pipeline_loss`` is the per-token cross-entropy of the last stage's logits."""

    def __init__(self, family: str, dp: int, loss_parallel: bool = False) -> None:
        super().__init__()
        self.lm = tiny_causal_lm(family)
        self.dp, self.loss_parallel, self.sharded = dp, loss_parallel, set()

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_parallel:  # the logits a DTensor, this rank's block of the vocabulary
            if isinstance(logits, DTensor):  # VerifyOneDevice's replay: plain logits
                self.sharded.add(tuple(logits.to_local().shape))
            return nd.vocab_parallel_cross_entropy(logits, labels)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")

    def training_step(self, batch, batch_idx):
        return self.trainer.strategy.run_pipeline(*batch)

    def validation_step(self, batch, batch_idx):  # forward only: the sum of the batch's per-token losses
        return self.trainer.strategy.run_pipeline(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):  # every optimizer step: 2 accumulated batches x dp ranks = the 8 rows
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=8 // self.dp // 2)


def _strategy(module: _PipelinedFamily, layout: str) -> nd.NDParallelStrategy:
    units = [type(module.lm.base_model.layers[0])]  # the decoder layer, each one FSDP2 unit
    tp = LAYOUTS[layout].get("tp", 1)
    plan = nd.ParallelPlan(tp_plan="auto" if tp > 1 else None, fsdp_units=units, loss_parallel=module.loss_parallel)
    return nd.NDParallelStrategy(
        pp=2, **LAYOUTS[layout], plan=plan, pipeline=nd.PipelineOptions(module="lm", microbatches=2),
        loss_normalization="token_mean", summary=False,
    )  # fmt: skip


def _pipelined_case(
    family: str, layout: str, fault: str | None = None, validate: bool = False, loss_parallel: bool = False
) -> dict:
    use_existing_process_group()
    module = _PipelinedFamily(family, dp=LAYOUTS[layout].get("dp_shard", 1), loss_parallel=loss_parallel)
    strategy = _strategy(module, layout)
    restore = _inject(fault)
    try:
        trainer, logged = _fit(module, strategy, 2)
        if validate:  # the trained model on the 8 rows: the exact token mean, logged as val_loss
            (metrics,) = trainer.validate(module, dataloaders=module.train_dataloader(), verbose=False)
            logged["val_loss"] = metrics["val_loss"]
    except ValueError as error:  # VerifyOneDevice's verdict on a broken pipeline, or a refused one
        if fault is None and not loss_parallel:
            raise
        return {"error": str(error), "tied": list(strategy.pipeline_options.tied_parameters)}
    finally:
        restore()
    names = {n for stage in module.lm for n, _ in stage.named_parameters()}
    return {
        **logged,
        "params": {n: p.detach().full_tensor() for stage in module.lm for n, p in stage.named_parameters()},
        "names": sorted(names),
        "tied": sorted(k for tie in strategy.pipeline_options.tied_parameters for k in tie),
        "own_class": [isinstance(stage, getattr(transformers, FAMILIES[family][1])) for stage in module.lm],
        "sharded": sorted(module.sharded),
    }


def _inject(fault: str | None):
    """A broken pipeline for the test that must fail: ``"no_rotary"``, stages after the first apply no rotary
    position embedding (cos 1, sin 0); ``"untied"``, the tie across stages is not declared (each stage trains its
    own copy). Returns what undoes it (the workers are reused)."""
    if fault is None:
        return lambda: None
    from lightning_ndclip.integrations.transformers import pipeline as hf_pipeline
    from lightning_ndclip.lightning import _pipeline

    if fault == "untied":
        own_ties, check_ties = _pipeline._own_ties, _pipeline._check_ties
        _pipeline._own_ties = lambda *args: ()
        _pipeline._check_ties = lambda *args: None

        def undo() -> None:
            _pipeline._own_ties, _pipeline._check_ties = own_ties, check_ties

        return undo
    stage = hf_pipeline.HFPipelineSplit.stage

    def without_rotary(self, keep):
        built = stage(self, keep)
        if self.units[0] not in keep:
            rotary = built.base_model.rotary_emb
            original = rotary.forward

            def identity_rotation(x, *args, **kwargs):
                cos, sin = original(x, *args, **kwargs)
                return torch.ones_like(cos), torch.zeros_like(sin)

            rotary.forward = identity_rotation
        return built

    hf_pipeline.HFPipelineSplit.stage = without_rotary

    def undo_rotary() -> None:
        hf_pipeline.HFPipelineSplit.stage = stage

    return undo_rotary


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's stage parameters, by the names of the unsplit model (copies of one name must agree)."""
    params: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result["params"].items():
            if name in params:
                assert torch.equal(params[name], value), f"{name} differs between ranks holding it"
            params[name] = value
    return params


def _reference_params(family: str, reference: dict) -> dict[str, torch.Tensor]:
    """The reference's parameters under every name (a tied weight under both), as the stages name them."""
    model = tiny_causal_lm(family)
    canonical = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return {n: reference["params"][canonical[id(p)]] for n, p in model.named_parameters(remove_duplicate=False)}


def _max_error(results: list[dict], family: str, reference: dict, check: bool = True) -> float:
    """The largest relative error (in norm) of a parameter after the steps, against the float64 reference."""
    expected = _reference_params(family, reference)
    params = _merged(results)
    assert sorted(params) == sorted(expected), (sorted(params), sorted(expected))
    for name, value in expected.items() if check else ():  # as test_hf_families checks every parameter
        torch.testing.assert_close(params[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)
    return max(float((params[n].double() - v).norm() / v.norm()) for n, v in expected.items())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", PIPELINED)
def test_a_transformers_model_pipelined_without_stages_equals_one_device(family, layout):
    if "tp" in LAYOUTS[layout] and _head_norms_left_whole(tiny_causal_lm(family)):
        pytest.skip("this transformers release's plan leaves q_norm / k_norm whole on split heads (test_hf_families)")
    reference = _reference(family)
    assert min(reference["norms"]) > MAX_NORM, "clipping should be active at every step"
    results = run_on_ranks(4, _pipelined_case, family, layout)
    tied = "tied" in family
    for r in results:
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(reference[key]), rtol=1e-5, atol=0, msg=key)
        assert r["view_warnings"] == []
        assert r["tied"] == (["lm_head.weight", "model.embed_tokens.weight"] if tied else [])  # declared for the user
        assert r["own_class"] == [True]  # each stage is a copy of the model, of its own class
    verified = results[0]["verified"]  # VerifyOneDevice replays the unsplit model (rank 0 reports)
    assert "verdict: exact" in verified, verified
    # the first stage holds the embedding and layer 0, the last layer 1, the norm and the head
    first, last = results[0]["names"], results[-1]["names"]
    assert "model.embed_tokens.weight" in first and not any(n.startswith("model.layers.1.") for n in first)
    assert {"model.norm.weight", "lm_head.weight"} <= set(last) and not any(n.startswith("model.layers.0.") for n in last)
    error = _max_error(results, family, reference)
    assert error < 1e-5, error
    print(f"{family} {layout}: max relative parameter error {error:.2e}")


@pytest.mark.parametrize("family", ["Llama", "Llama (tied)"])
def test_loss_parallel_on_the_last_stage_of_a_pipelined_transformers_model_equals_one_device(family):
    """pp=2 x tp=2, ``ParallelPlan(tp_plan="auto", loss_parallel=True)``: the last stage returns the logits sharded along
    the vocabulary ([2, 6, 16]: 16 of 32 per tp rank), ``pipeline_loss`` is ``vocab_parallel_cross_entropy`` on them;
    losses, norms and parameters after 2 clipped steps equal one device's. A release whose plan leaves a tied embedding whole
    (transformers 5.0) would hold the embedding whole on the first stage and the head vocabulary-sharded on the last:
    refused on every rank, naming the tie."""
    model = tiny_causal_lm(family)
    results = run_on_ranks(4, _pipelined_case, family, "pp2xtp2", None, False, True)
    if "tied" in family and not any(key.endswith("embed_tokens") for key in model.tp_plan):
        for r in results:
            assert "['model.embed_tokens.weight', 'lm_head.weight'] are one parameter" in r["error"], r
        return
    reference = _reference(family)
    for rank, r in enumerate(results):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(reference[key]), rtol=1e-5, atol=0, msg=key)
        assert r["sharded"] == ([(2, 6, 16)] if rank >= 2 else []), r["sharded"]  # ranks 2 and 3: the last stage
    assert "verdict: exact" in results[0]["verified"], results[0]["verified"]
    error = _max_error(results, family, reference)
    assert error < 1e-5, error


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_validation_loss_of_a_pipeline_is_the_exact_global_token_mean(layout):
    """``validation_step`` returning ``run_pipeline``'s loss: ``val_loss`` is the token mean over every data rank's
    batches, the same on every rank, equal to one device's on the trained model (float64 reference)."""
    family = "Llama (tied)"
    reference = _reference(family)
    model = tiny_causal_lm(family).double()
    model.load_state_dict(reference["params"], strict=False)  # the tied head is the embedding
    tokens, labels = _data()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
        expected = float(nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    for r in run_on_ranks(4, _pipelined_case, family, layout, None, True):
        assert abs(r["val_loss"] - expected) <= 1e-5 * expected, (r["val_loss"], expected)


@pytest.mark.faults
@pytest.mark.parametrize(
    ("family", "fault", "named"),
    [("Llama", "no_rotary", "lm.model.layers.1.self_attn.q_proj.weight"), ("Llama (tied)", "untied", "lm.lm_head.weight")],
)
def test_the_check_fails_without_rotary_on_later_stages_or_without_the_tie(family, fault, named):
    """The checks above can fail: with stages after the first that skip the rotary position embedding, or a tie
    across stages left undeclared (two parameters), VerifyOneDevice's replay of the unsplit model finds the first
    step's gradients of the second stage's attention (or of the head) far from one device's, on every rank."""
    results = run_on_ranks(4, _pipelined_case, family, "pp2xdp2", fault)
    for r in results:
        assert r["tied"] == [], r["tied"]
        assert "MISMATCH" in r["error"] and f"{named} (rel. error" in r["error"], r["error"]
    worst = float(re.search(rf"{re.escape(named)} \(rel\. error ([0-9.]+e[+-][0-9]+)", results[0]["error"])[1])
    assert worst > 1e-3, worst


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_stages_of_every_family_chained_equal_the_model(family):
    """On one process, float64: the stages the split cuts, run one after the other, give the model's logits
    bit for bit, and keep its parameter names; the tensor-parallel plan of each stage names only what it holds."""
    model = tiny_causal_lm(family).double()
    if family in MOE:
        model.set_experts_implementation("eager")
    tokens = _data()[0]
    if _layers_return_tuples(model):
        pytest.skip(f"this transformers release's {family} layers return tuples, which the stages do not pass on")
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        units = model_units(model)
        stages = [split_model(model, keep) for keep in stage_units_of(units, split_points_of(model, (), 2), 2)]
        hidden = tokens
        for stage in stages:
            hidden = stage(hidden)
    assert torch.equal(hidden, expected)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    for stage in stages:
        held = {n for n, _ in stage.named_modules()}
        plan_modules = {k for k in stage.tp_plan if "*" not in k}
        assert plan_modules <= held, plan_modules - held


def _layers_return_tuples(model: nn.Module) -> bool:
    """Whether the decoder layers return ``(hidden_states, ...)`` (GPT-NeoX in transformers 5.0), not the tensor."""
    seen = []
    hook = model.base_model.layers[0].register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        model(input_ids=_data()[0][:1])
    hook.remove()
    return isinstance(seen[0], tuple)


@pytest.mark.parametrize("family", ["Gemma2", "Gemma3"])
@pytest.mark.parametrize("split_points", [["model.layers.1"], ["model.layers.3"], ["model.layers.1", "model.layers.2"]])
def test_stages_run_each_layer_as_its_type_with_its_rotary_embedding(family, split_points):
    """Sliding-window and full-attention layers (Gemma3: each type its own rotary base) on uneven stages: every stage
    builds both masks and both rotary embeddings and gives each layer those of its type, by its global index."""
    config_class = {"Gemma2": "Gemma2Config", "Gemma3": "Gemma3TextConfig"}[family]
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = getattr(transformers, config_class)(**{**COMMON, "num_hidden_layers": 4, "head_dim": 4, "sliding_window": 2,
                                                    "layer_types": types})  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).double()
    tokens = _data()[0]
    units = model_units(model)
    stages = [split_model(model, keep) for keep in stage_units_of(units, split_points, len(split_points) + 1)]
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        hidden = tokens
        for stage in stages:
            hidden = stage(hidden)
        model.config.sliding_window = 16  # the window matters: without it the logits differ
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = model(input_ids=tokens).logits
    assert torch.equal(hidden, expected)
    assert not torch.allclose(unwindowed, expected)


def test_a_model_that_cannot_be_split_is_refused_naming_it():
    llama = tiny_causal_lm("Llama")  # 2 layers
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has 2 decoder layers \(model.layers\), which do not split evenly"):
        HFPipelineSplit(llama).split_points(3)
    with pytest.raises(ValueError, match=r"'model.norm' is no decoder layer of LlamaForCausalLM after the first"):
        split_points_of(llama, ["model.norm"], 2)
    llama.config.base_model_pp_plan = None
    with pytest.raises(ValueError, match=r"LlamaForCausalLM cannot be cut into pipeline stages: its config has no base_model_pp"):
        HFPipelineSplit(llama)
    llama = tiny_causal_lm("Llama")
    llama.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM cannot be cut into pipeline stages: \['extra'\] hold parameters"):
        HFPipelineSplit(llama)


def _uneven_case() -> str:
    use_existing_process_group()
    module = _PipelinedFamily("Llama", dp=1)
    strategy = nd.NDParallelStrategy(pp=2, pipeline=nd.PipelineOptions(module="lm", stages_per_rank=2,
                                     schedule="interleaved_1f1b"), loss_normalization="token_mean")  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    try:
        trainer.fit(module)
    except ValueError as error:
        return str(error)
    return "trained"


def test_layers_that_do_not_split_evenly_are_refused_on_every_rank():
    messages = run_on_ranks(2, _uneven_case)
    assert all("LlamaForCausalLM has 2 decoder layers" in m and "4 pipeline stages" in m for m in messages), messages
