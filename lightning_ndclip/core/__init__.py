"""The pure-PyTorch core: everything that computes, with no Lightning import.

Usable on its own (a plain training loop, ``docs/howto/pure-pytorch.md``) and tested without
Lightning installed. Its public names are exported by :mod:`lightning_ndclip`; modules whose names
start with ``_`` are internal. The parts, and what each may import of the others (``tests/test_package.py``
checks it):

- :mod:`~lightning_ndclip.core.norm`: the exact global norm and clipping; imports ``parallel.mesh`` and ``agree``;
- :mod:`~lightning_ndclip.core.loss`: the exact loss normalization (counts, weights, shares); imports ``agree``;
- :mod:`~lightning_ndclip.core.parallel`: the mesh and the parallel wrapping (tensor and expert parallel, FSDP2
  plans) and its checks (coverage, replicas, summary, SUM reductions); imports ``context``, ``agree``, ``random``
  and ``libraries`` (``tp_plan="auto"``: the plans of the library models inside a module);
- :mod:`~lightning_ndclip.core.context`: context parallelism (sequence shards, ring attention); imports nothing else;
- :mod:`~lightning_ndclip.core.pipeline`: pipeline stages and schedules; imports ``libraries`` (a library model's own
  split) and ``agree`` (a stage failing to build raises on every rank);
- :mod:`~lightning_ndclip.core.libraries`: what the package asks of a model library (``transformers``, ...), and the
  registry of the integrations' adapters (``lightning_ndclip/integrations/``, which import the core, never the
  reverse); imports nothing else at run time (``pipeline``'s ``ModelSplit`` for type checkers);
- :mod:`~lightning_ndclip.core.experts`: a mixture-of-experts layer; imports ``parallel.expert_parallel`` (the token
  exchange of expert parallelism, shared with packed-experts modules);
- :mod:`~lightning_ndclip.core.agree`: errors raised alike on every rank of a group; imports nothing else.
- :mod:`~lightning_ndclip.core.random`: the step's random streams on a mesh (peers alike, data ranks apart, forks);
  imports ``parallel.mesh``;
- :mod:`~lightning_ndclip.core.draws`: a step's random draws recorded on the ranks and replayed on one device;
  imports nothing else;
- :mod:`~lightning_ndclip.core.optim`: optimizers of whole matrices (Muon) exact on any mesh; imports nothing else.
"""
