"""The SecAgg+ parameters of a run, as one immutable description checked where it is built.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) lets the server learn the modular sum of the clients'
vectors and nothing else about any one of them, when the parameters below hold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..checks import integer, open_unit, positive
from ..errors import ConfigError
from .errors import SecAggError

__all__ = ["SecAggParams", "SecureAggregation", "PROTOCOL", "MIN_BITS", "MAX_BITS", "COLLUSION_FRACTION", "SECURITY_BITS",
           "DEFAULT_DEGREE", "DEFAULT_THRESHOLD", "DEFAULT_BITS", "DEFAULT_SCALE", "exposure", "graph_for"]

#: the defaults of ``fedmf simulate --secagg-*`` (the Flower app's secagg-* keys: server/config.py); degree and
#: threshold 0: derived from each round's cohort (``graph_for``)
DEFAULT_DEGREE, DEFAULT_THRESHOLD, DEFAULT_BITS, DEFAULT_SCALE = 0, 0, 32, 65536.0

#: the modulus 2^bits: at least 4 bits; at most 62, so that centred sums and exact squared norms
#: stay inside int64
MIN_BITS, MAX_BITS = 4, 62
#: the derived graph's security target (Bell et al. 2020, Sec. 4): a fraction γ of the clients may
#: collude with the server, and a client's update is exposed with probability ≤ 2^-σ per round
COLLUSION_FRACTION, SECURITY_BITS = 0.05, 40


def exposure(neighbours: int, threshold: int, gamma: float = COLLUSION_FRACTION) -> float:
    """The probability that an honest-but-curious server colluding with a random fraction ``gamma``
    of the clients gets both secrets of one client, i.e. that ≥ t of its ``neighbours`` collude (its
    own share is honest): P[Bin(k, γ) ≥ t] (Bell et al. 2020, Sec. 4)."""
    return math.fsum(math.comb(neighbours, c) * gamma**c * (1 - gamma) ** (neighbours - c)
                     for c in range(threshold, neighbours + 1))


def graph_for(cohort: int, gamma: float = COLLUSION_FRACTION, sigma: int = SECURITY_BITS) -> tuple[int, int]:
    """The derived degree k and threshold t for ``cohort`` sampled clients, exposure ≤ 2^-σ at γ.

    Sparse: the smallest even k with t = k/2 + 1 (the most dropouts that 2t > k + 1 allows: k/2 of
    the k + 1 holders) meeting the bound; at γ = 5 %, σ = 40 that is k = 28, t = 15 (≈ 2^-40.6).
    Cohorts of at most k + 1 clients: the complete graph (k = cohort − 1, rounded up to even) with
    the smallest t ≥ ⌊cohort/2⌋ + 1 meeting the bound; up to 10 clients at γ = 5 % that is
    t = cohort, i.e. no dropout tolerated (a dropout aborts the attempt, which is redone)."""
    cohort = integer("secure-aggregation cohort", cohort, minimum=2)
    bound = 2.0 ** -sigma
    k = 2
    while exposure(k, k // 2 + 1, gamma) > bound:
        k += 2
    if cohort - 1 > k:
        return k, k // 2 + 1
    others = cohort - 1
    t = next(t for t in range(cohort // 2 + 1, cohort + 1) if exposure(others, t, gamma) <= bound)
    return others + others % 2, t


@dataclass(frozen=True)
class SecAggParams:
    """SecAgg+ for one run; each field with its security (or privacy) meaning.

    ``degree`` (k) and ``threshold`` (t) both 0 (the default): derived for each round from its
    cohort by ``graph_for`` (``for_cohort``), so that an honest-but-curious server colluding with a
    fraction γ = 5 % of the clients gets a given client's update with probability ≤ 2^-40 per round
    (Bell et al. 2020, Sec. 4; ``exposure``): k = 28, t = 15 for cohorts above 29 clients, the
    complete graph below, with t = cohort up to 10 clients (every dropout then aborts the attempt).
    Set both to choose them (validated as below); the exposure of a choice is ``exposure(k, t)``
    (k = 8, t = 5: ≈ 2^-16 at γ = 5 %).

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
    vector is uniform to the server. The planned cohort's clipped, quantized sum plus a 12σ margin
    for the release's noise must not wrap (``fedmf.secagg.quantize.check_no_wrap``).

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
        degree = integer("secure-aggregation degree", self.degree, minimum=0)
        threshold = integer("secure-aggregation threshold", self.threshold, minimum=0)
        if (degree == 0) != (threshold == 0):
            raise ConfigError(f"secure-aggregation degree and threshold are both 0 (derived from the cohort) or "
                              f"both set, got degree {degree}, threshold {threshold}")
        if degree:
            self._check_graph(degree, threshold)
        object.__setattr__(self, "bits", integer("secure-aggregation bits", self.bits, minimum=MIN_BITS,
                                                 maximum=MAX_BITS))
        object.__setattr__(self, "scale", positive("secure-aggregation scale", self.scale))
        object.__setattr__(self, "beta", open_unit("secure-aggregation beta", self.beta))
        object.__setattr__(self, "stage_timeout_s", positive("secure-aggregation stage timeout", self.stage_timeout_s))

    def _check_graph(self, degree: int, threshold: int) -> None:
        degree = integer("secure-aggregation degree", degree, minimum=2)
        if degree % 2:
            raise SecAggError(f"secure-aggregation degree must be even (a Harary graph), got {degree}")
        threshold = integer("secure-aggregation threshold", threshold, minimum=2, maximum=degree + 1)
        if 2 * threshold <= degree + 1:
            raise SecAggError(f"secure-aggregation threshold must exceed half of degree + 1 = {degree + 1} "
                              f"shares (Bell et al. 2020), got {threshold}")
        object.__setattr__(self, "degree", degree)
        object.__setattr__(self, "threshold", threshold)

    @property
    def derived(self) -> bool:
        """Whether k and t are derived from each round's cohort (both 0)."""
        return self.degree == 0

    def for_cohort(self, cohort: int) -> SecAggParams:
        """These parameters with k and t fixed for a round of ``cohort`` clients (``graph_for`` when
        derived; as set otherwise)."""
        if not self.derived:
            return self
        degree, threshold = graph_for(cohort)
        return dataclasses.replace(self, degree=degree, threshold=threshold)

    @property
    def modulus(self) -> int:
        """2^bits."""
        return 1 << self.bits

    def shares(self, cohort: int) -> int:
        """Shares of each secret for a cohort of ``cohort`` clients (its neighbours and itself)."""
        return min(self.for_cohort(cohort).degree, cohort - 1) + 1


#: the protocol's name in a plan and in the run config (``secure-aggregation = "secaggplus"``)
PROTOCOL = "secaggplus"


@dataclass(frozen=True)
class SecureAggregation:
    """What a ``RunPlan`` records of a run under secure aggregation (``RunPlan.with_secure_aggregation``):
    the SecAgg+ ``params`` that bear on privacy and on the sum (the stage timeout does not: it is
    left out), the update's dimension ``dim`` and the quantization's stated norm ``inflation``
    (``fedmf.secagg.quantize.Quantization.inflation``) that follows from them, ζ and β: every
    update's decoded norm is at most ζ·inflation = ζ_eff, from which σ is computed
    (``fedmf.secagg.sensitivity``), so ε is the central plan's and the noise is larger."""

    params: SecAggParams
    dim: int
    inflation: float

    def to_dict(self) -> dict:
        p = self.params
        return {"protocol": PROTOCOL, "degree": p.degree, "threshold": p.threshold, "bits": p.bits,
                "scale": p.scale, "beta": p.beta, "dim": self.dim, "inflation": self.inflation}

    @staticmethod
    def params_from_dict(data: dict) -> tuple[SecAggParams, int]:
        """The ``params`` and ``dim`` of a ``to_dict`` (its inflation is recomputed by the plan)."""
        if data.get("protocol") != PROTOCOL:
            raise SecAggError(f"unknown secure-aggregation protocol {data.get('protocol')!r}")
        params = SecAggParams(degree=data["degree"], threshold=data["threshold"], bits=data["bits"],
                              scale=data["scale"], beta=data["beta"])
        return params, integer("update dimension", data["dim"], minimum=1)
