"""lightning_ndclip: exact N-D parallel gradient norms, clipping and loss normalization.

The pure-PyTorch core (norm, loss, reduce, replicas, mesh, context, experts, pipeline) imports no Lightning;
``GlobalNormClip``, ``NDParallelStrategy`` and ``GlobalMeanLoss`` need ``lightning`` /
``torchmetrics`` (``pip install 'lightning_ndclip[lightning]'``) and are imported with the package when
those are installed.
"""

from typing import Any

from lightning_ndclip.loss import (
    SampleWeights,
    TokenCount,
    count_valid_tokens,
    sample_ids_from_lengths,
    sync_sample_weights,
    sync_token_count,
)
from lightning_ndclip.mesh import ParallelDims, ParallelMeshes
from lightning_ndclip.norm import GradNorms, clip_grad_norm_, clip_grads_with_norm_, get_total_norm, grad_norms
from lightning_ndclip.plan import NormPlanError
from lightning_ndclip.reduce import sum_allreduce_hook, use_sum_reduction
from lightning_ndclip.replicas import broadcast_replicas_

try:  # the Lightning integration (importing the strategy registers strategy="nd_parallel")
    from lightning_ndclip.callbacks import GlobalNormClip
    from lightning_ndclip.metrics import GlobalMeanLoss
    from lightning_ndclip.strategy import NDParallelStrategy
except ModuleNotFoundError as missing:
    if missing.name is None or missing.name.split(".")[0] not in ("lightning", "torchmetrics"):
        raise
    _missing = missing.name

    def __getattr__(name: str) -> Any:
        if name in ("GlobalNormClip", "GlobalMeanLoss", "NDParallelStrategy"):
            raise ImportError(f"lightning_ndclip.{name} needs {_missing!r}: pip install 'lightning_ndclip[lightning]'")
        raise AttributeError(f"module 'lightning_ndclip' has no attribute {name!r}")


__version__ = "0.1.0"

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
    "broadcast_replicas_",
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
