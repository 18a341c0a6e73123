"""lightning_ndclip: exact N-D parallel gradient norms, clipping and loss normalization."""

from lightning_ndclip.callbacks import GlobalNormClip
from lightning_ndclip.loss import (
    SampleWeights,
    TokenCount,
    count_valid_tokens,
    sample_ids_from_lengths,
    sync_sample_weights,
    sync_token_count,
)
from lightning_ndclip.mesh import ParallelDims, ParallelMeshes
from lightning_ndclip.metrics import GlobalMeanLoss
from lightning_ndclip.norm import GradNorms, clip_grad_norm_, clip_grads_with_norm_, get_total_norm, grad_norms
from lightning_ndclip.plan import NormPlanError
from lightning_ndclip.reduce import sum_allreduce_hook, use_sum_reduction
from lightning_ndclip.strategy import NDParallelStrategy

__version__ = "0.1.0.dev0"

__all__ = [
    "GlobalMeanLoss",
    "GlobalNormClip",
    "GradNorms",
    "NDParallelStrategy",
    "NormPlanError",
    "ParallelDims",
    "ParallelMeshes",
    "SampleWeights",
    "TokenCount",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "count_valid_tokens",
    "get_total_norm",
    "grad_norms",
    "sample_ids_from_lengths",
    "sum_allreduce_hook",
    "sync_sample_weights",
    "sync_token_count",
    "use_sum_reduction",
]
