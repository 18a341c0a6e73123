"""Hugging Face ``transformers`` models on every mesh: the integration of the ``hf`` extra.

- :mod:`~lightning_ndclip.integrations.transformers.plans`: the models' own tensor- and expert-parallel plans as
  PyTorch ``ParallelStyle``\\ s, their LM heads and own loss under loss parallel;
- :mod:`~lightning_ndclip.integrations.transformers.context`: their batches cut along the sequence and their
  attention over the cut (context parallelism);
- :mod:`~lightning_ndclip.integrations.transformers.dropout`: attention dropout drawn per tensor-parallel head;
- :mod:`~lightning_ndclip.integrations.transformers.pipeline`: pipeline stages where their own pipeline plan cuts;
- :mod:`~lightning_ndclip.integrations.transformers.checkpoint`: their checkpoints loaded into shards and saved
  from them;
- :mod:`~lightning_ndclip.integrations.transformers.adapter`: all of it as the
  :class:`~lightning_ndclip.core.libraries.ModelLibrary` the core and the strategy ask (registered by
  :mod:`lightning_ndclip.integrations`).
"""
