"""Context parallelism: sequence shards and attention that is exact under them.

:mod:`~lightning_ndclip.core.context.attention` cuts sequences and attends across the cp group;
:mod:`~lightning_ndclip.core.context.ring_attention` passes K/V blocks round the ring;
:mod:`~lightning_ndclip.core.context.work` tells whether a step did any of it. Imports nothing else of the core.
"""

from lightning_ndclip.core.context.attention import context_parallel_attention, gather_sequence, shard_sequence
from lightning_ndclip.core.context.ring_attention import ring_attention

__all__ = ["context_parallel_attention", "gather_sequence", "ring_attention", "shard_sequence"]
