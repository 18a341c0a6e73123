"""The package's integrations of model libraries, one package each, behind one interface
(:class:`~lightning_ndclip.core.libraries.ModelLibrary`):

- :mod:`~lightning_ndclip.integrations.transformers`: Hugging Face ``transformers`` models (their tensor-, expert-
  and pipeline-parallel plans, context parallelism, attention dropout over split heads, checkpoints).

Each registers its adapter with :mod:`lightning_ndclip.core.libraries` when imported (:mod:`lightning_ndclip`
imports them all); none imports its library before a model of it exists. An integration imports the core; the
core and the Lightning layer never import an integration (``tests/test_package.py`` checks it): they ask the
registered adapters.
"""
