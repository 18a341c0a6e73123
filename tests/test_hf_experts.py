"""Expert parallelism for transformers' MoE families: ``tp_plan="auto"`` with ``ep > 1`` puts whole experts on each
``ep`` rank (the model's own ``ep_plan``) and sends the tokens to them by all-to-all. Against the same model on one
process in float64: the experts module alone (an idle rank, uneven splits, every gradient), then every MoE family
trained on dp_shard=4 x ep=2 with accumulation, the exact token mean and GlobalNormClip."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group
from hf_families import EXPERT_FAMILIES, tiny_causal_lm
from test_hf_families import _FamilyModule, _fit
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import lightning_ndclip as nd
from lightning_ndclip.core.parallel.expert_parallel import ExpertParallel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "ep_plan"), reason="this transformers release has no model.ep_plan"
)

STEPS, LR, MAX_NORM, BATCH = 3, 0.5, 0.5, 2


def _has_ep_plan(family: str) -> bool:
    return any(style == "ep_dispatch_experts" for style in tiny_causal_lm(family).ep_plan.values())


_DTYPES = {"eager": torch.float64, "grouped_mm": torch.float32, "batched_mm": torch.float32}  # grouped_mm: no float64
_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _experts_and_routing(implementation: str):
    """Mixtral's experts module (4 experts; float64 where the kernel has it), and 6 tokens' top-2 routing that sends
    no pair to experts 2 and 3: on ep=2, rank 1 receives nothing."""
    dtype = _DTYPES[implementation]
    model = tiny_causal_lm("Mixtral").to(dtype)
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 16, generator=g, dtype=dtype).requires_grad_()
    index = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    weights = torch.rand(6, 2, generator=g, dtype=dtype).requires_grad_()
    return experts, hidden, index, weights


def _gradients(experts: nn.Module, hidden, index, weights) -> dict[str, torch.Tensor]:
    out = experts(hidden, index, weights)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    grads = {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad}
    for name, param in experts.named_parameters():
        grads[name] = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    return grads


def _module_case(implementation: str, rank_routes: bool) -> dict[str, torch.Tensor]:
    use_existing_process_group()
    experts, hidden, index, weights = _experts_and_routing(implementation)
    if rank_routes and dist.get_rank() == 1:  # rank 1's tokens go to experts 2 and 3 (rank 0's go to 0 and 1)
        index = index + 2
    parallelize_module(experts, init_device_mesh("cpu", (2,)), ExpertParallel())
    return _gradients(experts, hidden, index, weights)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_the_experts_over_ep_equal_the_module_on_one_process_with_an_idle_rank(implementation):
    """Every pair of both ranks goes to rank 0's experts: rank 1 receives none, runs its experts on zero rows and
    still gets (zero) gradients; the outputs, the inputs' and routing weights' gradients and every expert's gradient
    (summed over the pairs of both ranks) equal one process, in float64."""
    experts, hidden, index, weights = _experts_and_routing(implementation)
    expected = _gradients(experts, hidden, index, weights)
    results = run_on_ranks(2, _module_case, implementation, False)
    tol = _TOLERANCE[hidden.dtype]
    for name in ("out", "hidden", "weights"):
        for result in results:
            torch.testing.assert_close(result[name], expected[name], rtol=tol, atol=tol, msg=name)
    for name in ("gate_up_proj", "down_proj"):  # both ranks' pairs: twice one rank's, and nothing for experts 2, 3
        torch.testing.assert_close(results[0][name], 2 * expected[name], rtol=tol, atol=tol, msg=name)
        assert results[0][name][2:].abs().max() == 0


def test_each_pair_reaches_its_expert_on_the_other_rank():
    """Rank 1 routes to experts 2 and 3 (rank 0's experts see none of its pairs): each rank's output is the one
    process's for its own routing."""
    results = run_on_ranks(2, _module_case, "eager", True)
    for rank, result in enumerate(results):
        experts, hidden, index, weights = _experts_and_routing("eager")
        expected = _gradients(experts, hidden, index + 2 * rank, weights)
        for name in ("out", "hidden", "weights"):
            torch.testing.assert_close(result[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)


def test_a_module_holding_a_weight_all_experts_share_is_refused_naming_it():
    experts = tiny_causal_lm("Mixtral").model.layers[0].mlp.experts
    experts.scale = nn.Parameter(torch.ones(16))
    with pytest.raises(ValueError, match=r"MixtralExperts holds \['scale'\], not one per expert"):
        ExpertParallel()._check(experts, 2)
    with pytest.raises(ValueError, match="holds 4 experts, which ep=3 does not divide"):
        ExpertParallel()._check(tiny_causal_lm("Mixtral").model.layers[0].mlp.experts, 3)


def test_an_ep_plan_entry_inside_the_experts_that_is_no_expert_weight_is_refused_naming_it():
    model = tiny_causal_lm("Mixtral")
    model.ep_plan = {**model.ep_plan, "model.layers.*.mlp.experts.norm": "replicated_with_grad_allreduce"}
    with pytest.raises(ValueError, match=r"ep_plan\['model.layers.\*.mlp.experts.norm'\] = 'replicated_with_grad_allreduce'"):
        nd.hf_ep_plan(model)
    with pytest.raises(ValueError, match="no Hugging Face transformers model with an expert-parallel plan"):
        nd.hf_ep_plan(tiny_causal_lm("Llama"))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 32, (16, 6), generator=g)
    labels = torch.randint(3, 32, (16, 6), generator=g)
    labels[torch.rand(16, 6, generator=g) < torch.linspace(0.05, 0.9, 16).unsqueeze(1)] = -100  # very uneven counts
    return tokens, labels


def _reference(family: str) -> dict:
    """One process, float64, the experts' plain loop; each step covers all 16 rows (2 micro-batches x 16 / 2 rows
    over the data ranks)."""
    model = tiny_causal_lm(family).double()
    model.set_experts_implementation("eager")
    tokens, labels = _data()
    norms = []
    for _ in range(STEPS):
        model.zero_grad()
        logits = model(input_ids=tokens).logits
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:  # ERNIE's routing statistics are a parameter no loss reaches
                    p -= LR * p.grad
    return {"norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


_WRAPPED = "_checkpoint_wrapped_module."


def _fit_case(family: str, ep: int, recompute: bool = False, tp: int = 1) -> dict:
    use_existing_process_group()
    module = _FamilyModule(family, _data(), batch=BATCH * tp)  # every step covers all 16 rows
    layer = type(module.lm.model.layers[0])
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[layer], activation_checkpointing=[layer] if recompute else [])
    strategy = nd.NDParallelStrategy(dp_shard=4 // tp, tp=tp, ep=ep, plan=plan, loss_normalization="token_mean", summary=False)
    trainer, logged = _fit(module, strategy, STEPS)
    experts = {n: p for n, p in module.lm.named_parameters() if ".experts." in n}
    return {
        **logged,
        "params": {n.replace(_WRAPPED, ""): p.detach().full_tensor() for n, p in module.lm.named_parameters()},
        "experts_here": {n: p.to_local().shape[0] for n, p in experts.items()},
        "experts_meshes": {tuple(p.device_mesh.mesh_dim_names) for p in experts.values()},
        "summary": [n for n in nd.summarize(module, trainer.strategy.meshes).notes if n.startswith("Experts")],
    }


@pytest.mark.parametrize("family", list(EXPERT_FAMILIES))
def test_a_moe_family_with_its_experts_over_ep_equals_one_device(family):
    if not _has_ep_plan(family):
        pytest.skip("this transformers release's model has no ep_plan")
    reference = _reference(family)
    assert min(reference["norms"]) > MAX_NORM, "clipping should be active at every step"
    result = run_on_ranks(4, _fit_case, family, 2)[0]
    assert result["experts_meshes"] == {("edp", "ep")}, result["experts_meshes"]  # whole experts over ep, FSDP over edp
    assert result["experts_here"] and set(result["experts_here"].values()) == {1}  # 4 experts / ep=2 / edp=2
    assert "verdict: exact" in result["verified"], result["verified"]
    assert result["view_warnings"] == []  # FSDP2's, for the experts unit returning a view
    assert len(result["summary"]) == 1 and "each ep rank holds 2 whole experts of each (ep=2)" in result["summary"][0]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_one_expert_per_rank_recomputed_in_backward_equals_one_device():
    """ep=4 on 4 ranks (one expert each, no expert data parallelism: edp=1), the decoder layers recomputed in
    backward (each token exchange runs again there)."""
    reference = _reference("Mixtral")
    result = run_on_ranks(4, _fit_case, "Mixtral", 4, True)[0]
    assert set(result["experts_here"].values()) == {1}
    assert result["summary"] == [
        "Experts: 2 modules of 4 experts; each ep rank holds 1 whole experts of each (ep=4), FSDP2-sharded over edp=1"
    ]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def _styles_in_transformers() -> dict[str, set[str]]:
    """Every style the configurations of the installed transformers use, by plan (``tp`` / ``ep``)."""
    import importlib
    import inspect
    import pkgutil

    import transformers.models

    styles: dict[str, set[str]] = {"tp": set(), "ep": set()}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}")
        except Exception:  # a family whose optional dependencies are missing
            continue
        for name in [n for n in dir(module) if n.endswith("Config")]:  # configurations only: no modeling import
            config = getattr(module, name, None)
            if inspect.isclass(config):
                for plan in ("tp", "ep"):
                    styles[plan] |= set((getattr(config, f"base_model_{plan}_plan", None) or {}).values())
    return styles


def test_every_style_of_the_installed_transformers_plans_is_mapped_or_refused_naming_it():
    """A sweep of the plans every configuration class of the installed transformers ships: each style is mapped
    (tp: HF_STYLES, ``replicate``, the experts' weight styles; ep: the experts module and its weights, or a tp style
    on a dense module) or refused, naming the style and the entry."""
    from lightning_ndclip.integrations.transformers import plans as hf

    styles = _styles_in_transformers()
    expert_weights = set(hf._EXPERT_WEIGHTS)
    for style in sorted(styles["tp"] - set(hf.HF_STYLES) - hf._LEFT_WHOLE - expert_weights):
        model = tiny_causal_lm("Llama")
        model.tp_plan = {"model.layers.*.mlp.gate_proj": style}
        with pytest.raises(ValueError, match=rf"tp_plan\['model.layers.\*.mlp.gate_proj'\] = '{style}'"):
            nd.hf_tp_plan(model)
    for style in sorted(styles["ep"] - {hf._EP_DISPATCH, hf._EP_WEIGHT}):
        model = tiny_causal_lm("Mixtral")
        model.ep_plan = {**model.ep_plan, "model.layers.*.self_attn.q_proj": style}
        if style in hf.HF_STYLES or style in hf._LEFT_WHOLE:  # a dense module: left to FSDP2 and the tp plan
            assert set(nd.hf_ep_plan(model)) == {"model.layers.*.mlp.experts"}
        else:
            with pytest.raises(ValueError, match=rf"ep_plan\['model.layers.\*.self_attn.q_proj'\] = '{style}'"):
                nd.hf_ep_plan(model)
    model = tiny_causal_lm("Mixtral")  # a style with no PyTorch equivalent, on a dense module: refused, not skipped
    model.ep_plan = {**model.ep_plan, "model.layers.*.mlp.gate": "packed_rowwise"}
    with pytest.raises(ValueError, match=r"ep_plan\['model.layers.\*.mlp.gate'\] = 'packed_rowwise'"):
        nd.hf_ep_plan(model)


def _tp_refused_case(family: str) -> str:
    try:
        _fit_case(family, 2, tp=2)
    except ValueError as error:
        return str(error)
    return "trained"


@pytest.mark.parametrize("family", [f for f in EXPERT_FAMILIES if f != "GPT-OSS"])
def test_experts_over_ep_and_each_split_over_tp_equal_one_device(family):
    """dp_shard=2 x tp=2 x ep=2 on 4 ranks: attention split over tp by the model's plan, whole experts over ep (edp=1),
    each split along its width over tp; the same numbers as one device."""
    if not _has_ep_plan(family):
        pytest.skip("this transformers release's model has no ep_plan")
    reference = _reference(family)
    result = run_on_ranks(4, _fit_case, family, 2, False, 2)[0]
    assert result["experts_meshes"] == {("edp", "ep", "tp")}, result["experts_meshes"]
    assert "verdict: exact" in result["verified"], result["verified"]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_experts_with_biases_over_ep_and_tp_are_refused_naming_their_weights():
    """GPT-OSS's experts hold biases and an interleaved gate/up layout, which the width split over tp does not cover."""
    messages = run_on_ranks(4, _tp_refused_case, "GPT-OSS")
    assert all("GptOssExperts's expert weights are" in m and "gate_up_proj_bias" in m for m in messages), messages
