"""The norm functions in one process (no process group): per-tensor results keep their order;
gradients that require grad themselves are normed and clipped outside autograd."""

from __future__ import annotations

import pytest
import torch

import lightning_ndclip as nd
from lightning_ndclip.core.norm import clip_grad


def test_per_tensor_norms_stay_with_their_tensors_when_dtypes_are_interleaved():
    """Tensors are normed in (device, dtype) groups; the results must come back in input order."""
    dtypes = (torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float64)
    params = [torch.nn.Parameter(torch.zeros(3, dtype=d)) for d in dtypes]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    norms = nd.grad_norms([(f"p{i}", p) for i, p in enumerate(params)]).as_dict()
    for i, p in enumerate(params):
        expected = float(p.grad.double().norm())
        assert abs(float(norms[f"p{i}"]) - expected) <= 1e-6 * expected, (i, norms)
    total = nd.get_total_norm([p.grad for p in params], accumulate_dtype=torch.float64)
    assert abs(float(total) - sum(float(p.grad.double().norm()) ** 2 for p in params) ** 0.5) <= 1e-12 * float(total)


@pytest.mark.parametrize("accumulate", [torch.float32, torch.float64])
def test_large_tensors_normed_one_kernel_each_keep_their_place(monkeypatch, accumulate):
    """Tensors from ``_ONE_KERNEL_EACH`` elements, accumulated in float32, get a ``vector_norm`` each and the others
    ``foreach_norm``'s (an accelerator's faster path, forced here by a small threshold): the per-tensor norms and the
    total are each tensor's own, in input order."""
    monkeypatch.setattr(clip_grad, "_ONE_KERNEL_EACH", 10)
    grads = [torch.full((n,), float(i + 1)) for i, n in enumerate((3, 12, 5, 40, 9))]  # small, large, small, large
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    norms = nd.grad_norms([(f"p{i}", p) for i, p in enumerate(params)], accumulate_dtype=accumulate, foreach=True)
    for i, g in enumerate(grads):
        torch.testing.assert_close(float(norms.as_dict()[f"p{i}"]), float(g.double().norm()), rtol=1e-6, atol=0)
    expected = sum(float(g.double().norm()) ** 2 for g in grads) ** 0.5
    torch.testing.assert_close(float(nd.get_total_norm(grads, foreach=True)), expected, rtol=1e-6, atol=0)


def _double_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def test_gradients_that_require_grad_are_normed_and_clipped_in_place_outside_autograd():
    """Gradients made with ``create_graph=True`` require grad: the norms are plain tensors and the
    clip scales the gradients in place, as ``torch.nn.utils.clip_grad_norm_`` does for plain ones."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model, reference = _double_model(), _double_model()
    params = list(model.parameters())
    grads = torch.autograd.grad(model(x).square().sum(), params, create_graph=True)
    for p, g in zip(params, grads):
        p.grad = g
    assert all(p.grad.requires_grad for p in params)
    reference(x).square().sum().backward()
    max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)

    plans = nd.NormPlans()
    norms = nd.grad_norms(model, plans=plans)
    total = nd.get_total_norm([p.grad for p in params], plans=plans)
    assert norms.per_tensor is not None
    assert not (total.requires_grad or norms.total.requires_grad or norms.per_tensor.requires_grad)
    clipped = nd.clip_grad_norm_(params, max_norm, plans=plans)
    assert not clipped.requires_grad
    for got in (total, norms.total, clipped):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    for p, q in zip(params, reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=0)


def test_norm_plans_keep_the_plans_of_the_calls_given_them_until_cleared():
    mine, other = nd.NormPlans(), nd.NormPlans()
    grads = [torch.ones(3), torch.ones(2, 2)]
    nd.get_total_norm(grads, plans=mine)
    nd.get_total_norm(grads, plans=mine)  # the same layout: the same plan
    assert (len(mine), len(other)) == (1, 0)
    assert mine.counted() == (True, True) and other.counted() is None
    mine.clear()
    assert len(mine) == 0 and mine.counted() is None
