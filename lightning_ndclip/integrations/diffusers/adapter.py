"""``diffusers`` as the :class:`~lightning_ndclip.core.libraries.ModelLibrary` the core and the strategy ask."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip import _compat
from lightning_ndclip.core.libraries import ModelLibrary, outermost
from lightning_ndclip.integrations.diffusers import checkpoint, context


class Diffusers(ModelLibrary):
    """Hugging Face ``diffusers``: its ``ModelMixin`` models (the denoising transformers)."""

    name = "diffusers"
    extra = "diffusers"

    def models(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The outermost ``ModelMixin``\\ s inside ``module``; none before ``diffusers`` has loaded its model classes."""
        return outermost(module, "diffusers.models.modeling_utils:ModelMixin")

    def block_names(self, model: nn.Module) -> Collection[str]:
        return _compat.library_block_names(model)

    def context_summary(self, cp: int, kv_exchange: str) -> str:
        return (
            f"each diffusers model's inputs cut where its _cp_plan says (1/{cp} of the tokens per rank, contiguous), "
            "its outputs gathered where it says; the attention over the cut sequence by ring attention"
        )

    def context_parallelize(self, model: nn.Module, cp: DeviceMesh) -> None:
        context.context_parallelize(model, cp)

    def load_checkpoint(
        self, model: nn.Module, directory: Any, *, device: torch.device, held_elsewhere: Collection[str] = ()
    ) -> None:
        if held_elsewhere:
            raise ValueError("diffusers checkpoints are not loaded into pipeline stages: train a diffusers model with pp=1")
        checkpoint.load_diffusers_checkpoint(model, directory, device=device)
