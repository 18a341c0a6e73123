"""The package's integrations of model libraries, one package each, behind one interface
(:class:`~lightning_ndclip.core.libraries.ModelLibrary`):

- :mod:`~lightning_ndclip.integrations.transformers`: Hugging Face ``transformers`` models (their tensor-, expert-
  and pipeline-parallel plans, context parallelism, attention dropout over split heads, checkpoints);
- :mod:`~lightning_ndclip.integrations.diffusers`: Hugging Face ``diffusers`` models (context parallelism where
  their own plan cuts).

Importing this package registers their adapters with :mod:`lightning_ndclip.core.libraries` (importing
:mod:`lightning_ndclip` does); none imports its library before a model of it exists. An integration imports the core; the
core and the Lightning layer never import an integration (``tests/test_package.py`` checks it): they ask the
registered adapters.
"""

from lightning_ndclip.core import libraries
from lightning_ndclip.integrations.diffusers.adapter import Diffusers
from lightning_ndclip.integrations.transformers.adapter import Transformers

libraries.register(Transformers())  # first: messages name the libraries in this order
libraries.register(Diffusers())
