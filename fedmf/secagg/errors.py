"""The errors of secure aggregation, members of the ``FedmfError`` family (``fedmf/errors.py``).

``SecAggError``: a parameter, a message or a call that secure aggregation refuses (one line,
naming what is wrong). ``SecAggAbort``: the round's secure sum cannot be completed — too few
clients, shares or neighbours left for the reconstruction threshold, survivors that did not sign
the survivor set, or shares that do not reconstruct a committed secret; nothing of the round may be released, and the round is redone
with fresh noise (without the owners whose secret did not reconstruct, ``SecAggServer.culprits``).
"""

from __future__ import annotations

from ..errors import FedmfError

__all__ = ["SecAggError", "SecAggAbort"]


class SecAggError(FedmfError):
    """A secure-aggregation parameter, message or call that cannot be accepted."""


class SecAggAbort(SecAggError):
    """The round's secure sum cannot be completed; nothing of it may be released."""
