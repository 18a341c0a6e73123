"""Hugging Face ``diffusers`` models (Wan, LTX, Flux, Qwen-Image, ...) on every mesh: the integration of the
``diffusers`` extra.

- :mod:`~lightning_ndclip.integrations.diffusers.context`: context parallelism where a model's own ``_cp_plan``
  cuts and gathers, its attention over the cut sequence routed to the ring;
- :mod:`~lightning_ndclip.integrations.diffusers.adapter`: the :class:`~lightning_ndclip.core.libraries.ModelLibrary`
  the core and the strategy ask (registered by :mod:`lightning_ndclip.integrations`).
"""
