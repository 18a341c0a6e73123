"""The mesh and the parallel wrapping, with their checks.

- :mod:`~lightning_ndclip.core.parallel.mesh`: the parallel sizes and the device mesh;
- :mod:`~lightning_ndclip.core.parallel.plan`: ``parallelize`` / ``ParallelPlan`` (tensor parallel,
  activation checkpointing, FSDP2 from arguments);
- :mod:`~lightning_ndclip.core.parallel.tensor_parallel`, :mod:`~lightning_ndclip.core.parallel.expert_tensor_parallel`,
  :mod:`~lightning_ndclip.core.parallel.expert_parallel`: tensor-parallel styles that keep ties, the packed
  experts split over ``tp``, and whole experts over ``ep`` (the token exchange);
- :mod:`~lightning_ndclip.core.parallel.coverage`, :mod:`~lightning_ndclip.core.parallel.replicas`,
  :mod:`~lightning_ndclip.core.parallel.reduce`, :mod:`~lightning_ndclip.core.parallel.summary`: what
  the wrapping must guarantee (every gradient reduced, replicas equal, SUM reductions) and the
  startup summary;
- :mod:`~lightning_ndclip.core.parallel.unused`: exact FSDP2 gradients when the ranks' graphs differ
  (parameters used on some ranks only);
- :mod:`~lightning_ndclip.core.parallel.split_activations`: the activations ``ColwiseParallel`` splits, followed
  through the first forward (a fused projection chunked; whole parameters on split activations).

Imports no model library: ``tp_plan="auto"`` asks the registered ones (:mod:`~lightning_ndclip.core.libraries`).
"""
