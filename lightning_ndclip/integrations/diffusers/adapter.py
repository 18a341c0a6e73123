"""``diffusers`` as the :class:`~lightning_ndclip.core.libraries.ModelLibrary` the core and the strategy ask."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ndclip.core.libraries import ModelLibrary, outermost
from lightning_ndclip.integrations.diffusers import context


class Diffusers(ModelLibrary):
    """Hugging Face ``diffusers``: its ``ModelMixin`` models (the denoising transformers)."""

    name = "diffusers"
    extra = "diffusers"

    def models(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The outermost ``ModelMixin``\\ s inside ``module``; none before ``diffusers`` has loaded its model classes."""
        return outermost(module, "diffusers.models.modeling_utils:ModelMixin")

    def context_parallelize(self, model: nn.Module, cp: DeviceMesh) -> None:
        context.context_parallelize(model, cp)
