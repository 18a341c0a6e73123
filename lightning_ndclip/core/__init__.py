"""The pure-PyTorch core: everything that computes, with no Lightning import.

Usable on its own (a plain training loop, ``docs/howto/pure-pytorch.md``) and tested without
Lightning installed. Its public names are exported by :mod:`lightning_ndclip`; modules whose names
start with ``_`` are internal.
"""
