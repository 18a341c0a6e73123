"""The Newton-Schulz orthogonalization of one whole matrix (Muon's update direction).

For a matrix ``G`` (transposed first when it has more rows than columns) normalized to Frobenius norm 1,
``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, ``steps`` times: the quintic iteration of Keller Jordan's Muon,
with torch.optim.Muon's coefficients. It drives every singular value of ``G`` towards 1 (to roughly 0.7-1.2 with
these coefficients), ``U S V^T -> U S' V^T``.

The function of a whole matrix: a shard of it orthogonalized alone is a different matrix (see
:class:`~lightning_ndclip.core.optim.muon.Muon`, which assembles each matrix before calling this). In ``dtype``
bfloat16 (torch.optim.Muon's choice) the result is the bfloat16 computation, which float64 does not reproduce;
``dtype=None`` computes in the matrix's own dtype.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_COEFFICIENTS", "newton_schulz"]

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""``(a, b, c)``: torch.optim.Muon's (and Keller Jordan's) quintic coefficients."""


def newton_schulz(
    matrix: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> torch.Tensor:
    """``matrix`` (2-D, whole) orthogonalized by ``steps`` Newton-Schulz iterations, in ``dtype`` (``None``: the
    matrix's dtype). With the defaults, the same operations in the same order as torch.optim.Muon's, so the same
    bits on the same device."""
    if matrix.ndim != 2:
        raise ValueError(f"newton_schulz orthogonalizes a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    x = matrix.to(dtype or matrix.dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x
