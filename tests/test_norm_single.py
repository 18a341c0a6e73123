"""The norm functions in one process (no process group): per-tensor results keep their order."""

from __future__ import annotations

import torch

import lightning_ndclip as nd


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
