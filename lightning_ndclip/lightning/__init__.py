"""The Lightning layer: a strategy, a callback and a metric on top of :mod:`lightning_ndclip.core`.

It holds no numerics of its own: the loss scaling, the norm and the reductions are the core's,
called at Lightning's hooks. Its public names are exported by :mod:`lightning_ndclip` (importing
the strategy registers ``strategy="nd_parallel"`` with Lightning).
"""
