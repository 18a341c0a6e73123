"""The exact global gradient norm and clipping, in one collective.

:mod:`~lightning_ndclip.core.norm.clip_grad` holds the public functions and the math; the plan of
who counts what (``_plan``), the caches kept between calls (``_cache``) and the coalescing of FSDP2's
gradient views into contiguous runs (``_runs``) are internal. May import ``core.parallel.mesh`` and ``core.agree``.
"""

from lightning_ndclip.core.norm._plan import NormPlanError
from lightning_ndclip.core.norm.clip_grad import (
    GradNorms,
    NormPlans,
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
    grad_norms,
)

__all__ = ["GradNorms", "NormPlanError", "NormPlans", "clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm", "grad_norms"]
