"""lightning_ndclip: exact N-D parallel gradient norms, clipping and loss normalization.

Two layers (``docs/architecture.md``): :mod:`lightning_ndclip.core`, pure PyTorch, which imports no
Lightning; and :mod:`lightning_ndclip.lightning`, the strategy, callback and metric built on it,
which need ``lightning`` / ``torchmetrics`` (``pip install 'lightning_ndclip[lightning]'``). Every
public name of both is exported here, the Lightning ones when those packages are installed.
"""

from typing import Any

from lightning_ndclip.core.agree import AgreedError
from lightning_ndclip.core.context.attention import context_parallel_attention, shard_sequence
from lightning_ndclip.core.context.ring_attention import ring_attention
from lightning_ndclip.core.experts import Experts, MoE, shard_experts
from lightning_ndclip.core.load_balance import LoadBalance, load_balance, load_balancing_loss
from lightning_ndclip.core.loss import (
    PendingTokenCount,
    SampleWeights,
    TokenCount,
    count_valid_tokens,
    loss_share,
    sample_ids_from_lengths,
    sync_sample_weights,
    sync_token_count,
)
from lightning_ndclip.core.norm import NormPlanError
from lightning_ndclip.core.norm.clip_grad import (
    GradNorms,
    NormPlans,
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
    grad_norms,
)
from lightning_ndclip.core.optim.muon import Muon
from lightning_ndclip.core.optim.orthogonal import newton_schulz
from lightning_ndclip.core.parallel.coverage import check_data_parallel_reduction
from lightning_ndclip.core.parallel.expert_parallel import ExpertParallel
from lightning_ndclip.core.parallel.expert_tensor_parallel import PackedExpertsParallel
from lightning_ndclip.core.parallel.loss_parallel import loss_parallel_plan, vocab_parallel_cross_entropy, vocab_parallel_head
from lightning_ndclip.core.parallel.mesh import LIGHTNING_DIM_NAMES, MESH_DIM_NAMES, ParallelDims, ParallelMeshes
from lightning_ndclip.core.parallel.plan import ParallelPlan, parallelize
from lightning_ndclip.core.parallel.reduce import sum_allreduce_hook, use_sum_reduction
from lightning_ndclip.core.parallel.replicas import broadcast_replicas_, check_replica_gradients
from lightning_ndclip.core.parallel.summary import ModuleRow, ParallelSummary, summarize
from lightning_ndclip.core.parallel.tensor_parallel import check_ties, tensor_parallelize, tied_parameters
from lightning_ndclip.core.pipeline import (
    SCHEDULES,
    PipelineOptions,
    build_pipeline,
    model_units,
    schedule_stages,
    split_model,
    stage_units_of,
    sync_tied_parameters,
    tie_gradients,
)
from lightning_ndclip.core.random import RandomStreams
from lightning_ndclip.integrations.diffusers.checkpoint import load_diffusers_checkpoint, save_diffusers_checkpoint
from lightning_ndclip.integrations.transformers.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from lightning_ndclip.integrations.transformers.plans import HF_STYLES, LatentKeyParallel, hf_ep_plan, hf_tp_plan

_LIGHTNING_NAMES = ("GlobalMeanLoss", "GlobalNormClip", "NDParallelStrategy", "VerifyOneDevice", "router_aux_loss")

try:  # the Lightning layer (importing the strategy registers strategy="nd_parallel")
    from lightning_ndclip.lightning.callbacks import GlobalNormClip
    from lightning_ndclip.lightning.expert_load import router_aux_loss
    from lightning_ndclip.lightning.metrics import GlobalMeanLoss
    from lightning_ndclip.lightning.strategy import NDParallelStrategy
    from lightning_ndclip.lightning.verify import VerifyOneDevice
except ModuleNotFoundError as missing:
    if missing.name is None or missing.name.split(".")[0] not in ("lightning", "torchmetrics"):
        raise
    _missing = missing.name

    def __getattr__(name: str) -> Any:
        if name in _LIGHTNING_NAMES:
            raise ImportError(f"lightning_ndclip.{name} needs {_missing!r}: pip install 'lightning_ndclip[lightning]'")
        raise AttributeError(f"module 'lightning_ndclip' has no attribute {name!r}")


__version__ = "0.2.0"

__all__ = [
    "HF_STYLES",
    "AgreedError",
    "LIGHTNING_DIM_NAMES",
    "MESH_DIM_NAMES",
    "SCHEDULES",
    "Experts",
    "GlobalMeanLoss",
    "GlobalNormClip",
    "ExpertParallel",
    "GradNorms",
    "LatentKeyParallel",
    "LoadBalance",
    "ModuleRow",
    "MoE",
    "Muon",
    "NDParallelStrategy",
    "NormPlanError",
    "NormPlans",
    "ParallelDims",
    "ParallelMeshes",
    "PackedExpertsParallel",
    "ParallelPlan",
    "ParallelSummary",
    "PipelineOptions",
    "RandomStreams",
    "PendingTokenCount",
    "SampleWeights",
    "TokenCount",
    "VerifyOneDevice",
    "broadcast_replicas_",
    "build_pipeline",
    "check_data_parallel_reduction",
    "check_replica_gradients",
    "check_ties",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "context_parallel_attention",
    "count_valid_tokens",
    "get_total_norm",
    "grad_norms",
    "hf_ep_plan",
    "hf_tp_plan",
    "load_balance",
    "load_balancing_loss",
    "load_diffusers_checkpoint",
    "load_hf_checkpoint",
    "loss_parallel_plan",
    "loss_share",
    "model_units",
    "newton_schulz",
    "parallelize",
    "ring_attention",
    "router_aux_loss",
    "sample_ids_from_lengths",
    "save_diffusers_checkpoint",
    "save_hf_checkpoint",
    "schedule_stages",
    "shard_experts",
    "shard_sequence",
    "split_model",
    "stage_units_of",
    "sum_allreduce_hook",
    "summarize",
    "sync_sample_weights",
    "sync_tied_parameters",
    "sync_token_count",
    "tensor_parallelize",
    "tie_gradients",
    "tied_parameters",
    "use_sum_reduction",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_head",
]
