"""``transformers`` as the :class:`~lightning_ndclip.core.libraries.ModelLibrary` the core and the strategy ask:
each answer is the integration's module that does the work (none of them imports ``transformers`` before a
model of it exists)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_ndclip import _compat
from lightning_ndclip.core.libraries import ExpertRouting, ModelLibrary, SequenceCut
from lightning_ndclip.integrations.transformers import checkpoint, context, dropout, pipeline, plans


class Transformers(ModelLibrary):
    """Hugging Face ``transformers``: its ``PreTrainedModel``\\ s."""

    name = "transformers"
    extra = "hf"

    def models(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        return plans.transformers_models(module)

    def block_names(self, model: nn.Module) -> Collection[str]:
        return _compat.library_block_names(model)

    def tp_plan(self, module: nn.Module, tp: int) -> dict[str, ParallelStyle]:
        return plans.tp_plan_of(module, tp)

    def ep_plan(self, module: nn.Module) -> dict[str, ParallelStyle]:
        return plans.ep_plan_of(module)

    def context_parallelize(self, model: nn.Module, cp: DeviceMesh) -> None:
        context.context_parallelize(model, cp)

    def context_summary(self, cp: int, kv_exchange: str) -> str:
        return (
            f"every batch's sequences cut into 2 x cp = {2 * cp} chunks (rank r: chunks r and {2 * cp - 1}-r); the "
            f"transformers models attend over them by {kv_exchange} attention"
        )

    def cut_batch(self, batch: Any, cp: DeviceMesh, kv_exchange: str) -> SequenceCut:
        local, shard = context.shard_batch(batch, cp, kv_exchange=kv_exchange)  # type: ignore[arg-type]
        return SequenceCut(local, shard.active(), shard.model_losses)

    def output_heads(self, module: nn.Module) -> dict[str, nn.Module]:
        return plans.output_heads(module)

    def use_vocab_parallel_loss(self, model: nn.Module) -> None:
        plans.use_vocab_parallel_loss(model)

    def replay_loss_parallel(self, parallel: nn.Module, plain: nn.Module) -> None:
        plans.replay_loss_parallel(parallel, plain)

    def recompute_without_cache(self, module: nn.Module, recomputed: Collection[nn.Module]) -> None:
        plans.recompute_without_cache(module, recomputed)

    def attention_dropout(self, model: nn.Module) -> float:
        return dropout.attention_dropout(model)

    def fork_split_head_dropout(self, model: nn.Module, tp_rank: int) -> Callable[[], None]:
        return dropout.fork_split_head_dropout(model, tp_rank)

    def expert_routing(self, source: Any) -> ExpertRouting | None:
        return plans.expert_routing(source)

    def pipeline_split(self, model: nn.Module) -> pipeline.HFPipelineSplit | None:
        return pipeline.HFPipelineSplit(model) if any(m is model for _, m in self.models(model)) else None

    def load_checkpoint(
        self, model: nn.Module, directory: Any, *, device: torch.device, held_elsewhere: Collection[str] = ()
    ) -> None:
        checkpoint.load_hf_checkpoint(model, directory, device=device, held_elsewhere=held_elsewhere)
