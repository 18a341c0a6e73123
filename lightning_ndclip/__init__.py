"""lightning_ndclip: exact N-D parallel gradient norms, clipping and loss normalization."""

from lightning_ndclip.norm import GradNorms, clip_grad_norm_, clip_grads_with_norm_, get_total_norm, grad_norms
from lightning_ndclip.plan import NormPlanError

__version__ = "0.1.0.dev0"

__all__ = [
    "GradNorms",
    "NormPlanError",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "grad_norms",
]
