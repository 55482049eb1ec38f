"""What both ends of SecAgg+ must agree on beyond Flower's record keys
(``flwr.common.secure_aggregation.secaggplus_constants.Key``, used by the adapters).

* Extra payload keys: the round's session, the modulus bits, the vector length, the neighbour
  list sent at setup, and the commitment to the mask seed sent with the shares.
* Share order: a client's secret is split into one share per member of its neighbourhood
  (itself included), share i + 1 to the i-th smallest node id; the server checks each share's
  index against its holder.
* The commitment to a mask seed is SHA-256 over a domain tag and the seed (a 256-bit uniform
  seed: the digest reveals nothing usable); a reconstructed seed is accepted only when it
  matches. A reconstructed mask key is checked against the public key the client sent instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["SESSION", "BITS", "LENGTH", "NEIGHBOURS", "COMMITMENT", "SEED_BYTES", "share_order", "share_index",
           "commit_seed"]

SESSION = "session"
BITS = "bits"
LENGTH = "length"
NEIGHBOURS = "neighbours"
COMMITMENT = "seed-commitment"

#: a client's mask seed: 32 random bytes from the operating system
SEED_BYTES = 32

_COMMIT_TAG = b"fedmf secagg seed commitment v1\x00"


def share_order(members: Iterable[int]) -> list[int]:
    """The holders of a client's shares, in share order (smallest node id first)."""
    return sorted(members)


def share_index(members: Iterable[int], holder: int) -> int:
    """The 1-based Shamir index of ``holder``'s share (``holder`` must be a member)."""
    return share_order(members).index(holder) + 1


def commit_seed(seed: bytes) -> bytes:
    """The 32-byte commitment to a mask seed."""
    return hashlib.sha256(_COMMIT_TAG + seed).digest()
