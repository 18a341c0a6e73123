"""Optimizers whose update is a function of whole matrices, exact on any mesh.

:mod:`~lightning_ndclip.core.optim.muon` holds :class:`Muon` (torch.optim.Muon's update, each matrix assembled once
over the ranks that shard it); :mod:`~lightning_ndclip.core.optim.orthogonal` the orthogonalization of one
matrix. Imports no other part of the core.
"""

from lightning_ndclip.core.optim.muon import Muon
from lightning_ndclip.core.optim.orthogonal import newton_schulz

__all__ = ["Muon", "newton_schulz"]
