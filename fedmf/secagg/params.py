"""The SecAgg+ parameters of a run, as one immutable description checked where it is built.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) lets the server learn the modular sum of the clients'
vectors and nothing else about any one of them, when the parameters below hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import integer, open_unit, positive
from .errors import SecAggError

__all__ = ["SecAggParams", "MIN_BITS", "MAX_BITS"]

#: the modulus 2^bits: at least 4 bits; at most 62, so that centred sums and exact squared norms
#: stay inside int64
MIN_BITS, MAX_BITS = 4, 62


@dataclass(frozen=True)
class SecAggParams:
    """SecAgg+ for one run; each field with its security (or privacy) meaning.

    ``degree`` (k): each client shares pairwise masks and Shamir shares with k neighbours of a
    random k-regular (Harary) graph drawn by the server for each round (Bell et al., Sec. 3). The
    graph must be random and unknown in advance: a neighbourhood taken over by colluding clients
    lets them remove one honest client's masks. Bell et al. choose k = O(log n) for n clients;
    k ≥ n − 1 is the complete graph (the original SecAgg). Even, so that the Harary graph links
    k/2 clients on each side of a shuffled ring.

    ``threshold`` (t): Shamir shares needed to reconstruct a client's mask seed or mask key, out
    of the k + 1 shares of its neighbourhood (one kept by itself). t − 1 colluding shareholders
    learn nothing of a secret; each honest client reveals, for each neighbour, either the share of
    its mask seed (it survived) or of its mask key (it dropped), never both, and 2t > k + 1 is
    enforced. Against a server that lies about who dropped, the consistency check (Bonawitz et al.,
    CCS 2017; Bell et al., Sec. 5) makes every client sign the survivor set U3 before any share is
    revealed, and reveal only with t signatures of its neighbourhood on the U3 it signed, a seed
    share only with its owner's signature (docs/secagg-consistency.md). That holds against a
    deviating server **only in enrolled mode**: each node holds the enrollment (node config
    ``enrollment-file`` and ``user-key``), so that the SecAgg+ keys and signatures are bound to
    enrolled users and a server cannot substitute or simulate neighbours. Without an enrollment
    (Flower's simulation, declared-insecure identity) the server is trusted: honest-but-curious.
    Either way t or more colluding neighbours of a client unmask it. On the other side, a client
    whose surviving shareholders are fewer than t makes the round abort (nothing released), and
    so does a survivor that does not sign U3: t trades privacy against tolerance of dropouts.

    ``bits`` (b): the sum is computed modulo 2^b, the masks are uniform modulo 2^b, so one masked
    vector is uniform to the server. The planned cohort's clipped, quantized sum must not wrap
    (``fedmf.secagg.quantize.check_no_wrap``).

    ``scale`` (s): fixed-point units per unit of the clipped update; a larger scale lowers the
    rounding error and the norm inflation but needs more bits.

    ``beta`` (β): conditional randomized rounding's acceptance parameter (Kairouz, Liu, Steinke,
    ICML 2021, Thm. 1): a rounding is redrawn until its norm is within the bound that holds with
    probability ≥ 1 − β; the bound, not β, enters the sensitivity.

    ``stage_timeout_s``: how long the server waits for one stage's replies; a client that has not
    answered by then is treated as dropped at that stage (it cannot rejoin the round). Like the
    central mode's reply timeout it must be well above honest computation times, so that who
    drops out does not depend on a user's data.
    """

    degree: int
    threshold: int
    bits: int
    scale: float
    beta: float = math.exp(-0.5)
    stage_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        degree = integer("secure-aggregation degree", self.degree, minimum=2)
        if degree % 2:
            raise SecAggError(f"secure-aggregation degree must be even (a Harary graph), got {degree}")
        threshold = integer("secure-aggregation threshold", self.threshold, minimum=2, maximum=degree + 1)
        if 2 * threshold <= degree + 1:
            raise SecAggError(f"secure-aggregation threshold must exceed half of degree + 1 = {degree + 1} "
                              f"shares (Bell et al. 2020), got {threshold}")
        object.__setattr__(self, "degree", degree)
        object.__setattr__(self, "threshold", threshold)
        object.__setattr__(self, "bits", integer("secure-aggregation bits", self.bits, minimum=MIN_BITS,
                                                 maximum=MAX_BITS))
        object.__setattr__(self, "scale", positive("secure-aggregation scale", self.scale))
        object.__setattr__(self, "beta", open_unit("secure-aggregation beta", self.beta))
        object.__setattr__(self, "stage_timeout_s", positive("secure-aggregation stage timeout", self.stage_timeout_s))

    @property
    def modulus(self) -> int:
        """2^bits."""
        return 1 << self.bits

    def shares(self, cohort: int) -> int:
        """Shares of each secret for a cohort of ``cohort`` clients (its neighbours and itself)."""
        return min(self.degree, cohort - 1) + 1
