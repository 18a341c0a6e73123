"""Loss parallel over transformers families: each family of the tensor-parallel sweep (``test_hf_tp_sweep``), built
tiny and random in float64, is parallelized on 2 ranks as ``ParallelPlan(tp_plan="auto", loss_parallel=True)`` does
it, and its own ``.loss`` (``model(input_ids=..., labels=...)``, computed on the vocabulary shards) and gradients are
compared with the plain model on one process: the cross-entropy of its logits against the labels shifted by one,
in float64 (what ``ForCausalLMLoss`` computes, without its float32 rounding). Outcomes as in the tp sweep: EXACT
(1e-10, or 1e-5 where the one-device model rounds to float32), REFUSED (our ValueError, naming the cause: a model
whose loss is not ``ForCausalLMLoss`` or that computes it itself), WRONG (a silent wrong number), CRASH, NOT BUILT.

The suite runs :data:`SAMPLE`, the families whose head or logits are out of the common way; ``NDCLIP_SWEEP=all``
runs every family (by hand: ``NDCLIP_SWEEP=all pytest tests/test_hf_loss_parallel_sweep.py -s`` prints the
table)."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import test_hf_context_sweep as cp_sweep
import test_hf_tp_sweep as tp_sweep
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import Float32Ops, refused_by_us
from test_hf_context_sweep import ROWS, SEQ, VOCAB, _build, _tolerance
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

from lightning_ndclip.core.parallel.mesh import ParallelDims  # noqa: E402
from lightning_ndclip.core.parallel.plan import parallelize  # noqa: E402
from lightning_ndclip.core.parallel.split_activations import watch_split_activations  # noqa: E402

SAMPLE = [
    "gemma2",  # tied head, final logit soft-capping on the sharded logits
    "cohere",  # tied head, logits scaled (granite divides them alike)
    "gpt_neox",  # the head is embed_out
    "qwen2_moe",  # experts on tp, a router
    "gemma3",  # transformers 5.0: computes its loss itself (refused), later releases through its loss_function
]
"""The families the suite runs (those the installed release has)."""


def _one(family: str, architecture: str) -> tuple[str, str, float, float]:
    """``(outcome, detail, error, tolerance)`` of one family on this rank."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.where(torch.rand(ROWS, SEQ, generator=g) < 0.25, -100, input_ids)
    try:
        model = _build(family, architecture)
        plain = copy.deepcopy(model)
        with Float32Ops() as float32_ops:
            logits = plain(input_ids=input_ids).logits
        expected_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        expected_loss.backward()
    except Exception as error:
        return "NOT BUILT", f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}", 0.0, 0.0
    tolerance = _tolerance(plain, float32_ops.found)
    expected = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    scale = max((grad.abs().max() for grad in expected.values()), default=torch.tensor(1.0))
    try:
        meshes = ParallelDims(world_size=dist.get_world_size(), tp=2).build_mesh("cpu")
        parallelize(model, meshes, tp_plan="auto", loss_parallel=True)
        with watch_split_activations(model, meshes["tp"]):  # as the strategy watches the first forward
            output = model(input_ids=input_ids, labels=labels)
        if not isinstance(output.logits, DTensor):
            return "WRONG", "the logits are not vocabulary-sharded", 1.0, tolerance
        output.loss.backward()
    except Exception as error:
        if refused_by_us(error):
            return "REFUSED", str(error), 0.0, tolerance
        return "CRASH", f"{type(error).__name__}: {str(error)[:300]}", 0.0, tolerance
    errors = {"loss": float((output.loss.detach() - expected_loss.detach()).abs() / expected_loss.detach().abs())}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        reference = expected.get(name, torch.zeros_like(param))
        grad = torch.zeros_like(reference) if grad is None else grad
        errors[name] = float((grad - reference).abs().max() / torch.maximum(reference.abs().max(), 1e-3 * scale))
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] < tolerance:
        return "EXACT", "", errors[worst], tolerance
    return "WRONG", f"worst: {worst}", errors[worst], tolerance


def _families() -> dict[str, Any]:
    families = tp_sweep._families()
    if os.environ.get("NDCLIP_SWEEP") == "all":
        return families
    return {family: families[family] for family in SAMPLE if family in families}


def test_the_own_loss_of_transformers_families_is_exact_or_refused_under_loss_parallel():
    families = _families()
    outcomes = tp_sweep._merged(run_on_ranks(2, tp_sweep._sweep, families, _one, timeout=600))
    counts = cp_sweep.print_outcomes(outcomes)
    assert not {family: result for family, result in outcomes.items() if result[0] in ("WRONG", "CRASH")}
    assert counts.get("EXACT", 0) >= len(families) // 2, counts
