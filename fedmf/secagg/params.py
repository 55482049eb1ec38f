"""The SecAgg+ parameters of a run, as one immutable description checked where it is built.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) lets the server learn the modular sum of the clients'
vectors and nothing else about any one of them, when the parameters below hold.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from ..checks import integer, open_unit, positive
from ..errors import ConfigError
from .errors import SecAggError

__all__ = ["SecAggParams", "SecureAggregation", "PROTOCOL", "MIN_BITS", "MAX_BITS", "COLLUSION_FRACTION", "SECURITY_BITS",
           "DEFAULT_DEGREE", "DEFAULT_THRESHOLD", "DEFAULT_BITS", "DEFAULT_SCALE", "exposure", "graph_for",
           "malicious_exposure", "min_threshold"]

#: the defaults of ``fedmf simulate --secagg-*`` (the Flower app's secagg-* keys: server/config.py); degree and
#: threshold 0: derived from each round's cohort (``graph_for``)
DEFAULT_DEGREE, DEFAULT_THRESHOLD, DEFAULT_BITS, DEFAULT_SCALE = 0, 0, 32, 65536.0

#: the modulus 2^bits: at least 4 bits; at most 62, so that centred sums and exact squared norms
#: stay inside int64
MIN_BITS, MAX_BITS = 4, 62
#: the derived graph's security target (Bell et al. 2020, Sec. 4): a fraction γ of the clients may
#: collude with the server, and a client's update is exposed with probability ≤ 2^-σ per round
COLLUSION_FRACTION, SECURITY_BITS = 0.05, 40

_log = logging.getLogger(__name__)


def _log2(p: float) -> float:
    return math.log2(p) if p > 0 else -math.inf


def exposure(neighbours: int, threshold: int, gamma: float = COLLUSION_FRACTION) -> float:
    """The probability that ≥ ``threshold`` of a client's ``neighbours`` are among a random fraction
    ``gamma`` of colluding clients: P[Bin(k, γ) ≥ t] (Bell et al. 2020, Sec. 4). With t the Shamir
    threshold it is an honest-but-curious server's chance of both secrets of one client (its own share
    is honest); ``malicious_exposure`` is a deviating server's."""
    return math.fsum(math.comb(neighbours, c) * gamma**c * (1 - gamma) ** (neighbours - c)
                     for c in range(max(threshold, 0), neighbours + 1))


def malicious_exposure(neighbours: int, threshold: int, gamma: float = COLLUSION_FRACTION) -> float:
    """A deviating server's chance of unmasking one client in enrolled mode: colluding neighbours sign
    both stories of a lie about U3 and hand over both shares, so c ≥ 2t − 1 − k of them suffice
    (REVIEW-i36-secagg-2 HIGH-1; Bonawitz et al. CCS 2017 need 2t > n + n_C): P[Bin(k, γ) ≥ 2t − 1 − k]."""
    return exposure(neighbours, 2 * threshold - 1 - neighbours, gamma)


def min_threshold(neighbours: int, gamma: float = COLLUSION_FRACTION, sigma: int = SECURITY_BITS) -> int:
    """The smallest t with 2t > k + 1 whose exposure and malicious exposure are both ≤ 2^-σ for k
    ``neighbours`` (t = k + 1 always qualifies: both are 0)."""
    bound = 2.0 ** -sigma
    return next(t for t in range((neighbours + 1) // 2 + 1, neighbours + 2)
                if exposure(neighbours, t, gamma) <= bound and malicious_exposure(neighbours, t, gamma) <= bound)


def graph_for(cohort: int, gamma: float = COLLUSION_FRACTION, sigma: int = SECURITY_BITS) -> tuple[int, int]:
    """The derived degree k and threshold t for ``cohort`` sampled clients: t = ``min_threshold(k)``,
    so that both the honest-but-curious exposure P[Bin(k, γ) ≥ t] and a deviating server's
    P[Bin(k, γ) ≥ 2t − 1 − k] are ≤ 2^-σ (Bell et al. CCS 2020, Sec. 4; REVIEW-i36-secagg-2 HIGH-1).

    Sparse: the smallest even k whose neighbourhood tolerates a quarter of its k neighbours dropping
    out (k + 1 − t ≥ k/4); at γ = 5 %, σ = 40 that is k = 28, t = 22 (7 dropouts; 2^-40.6 against a
    deviating server). A smaller k tolerates fewer (k = 24, t = 20: 5); a larger one costs linearly
    more (k = 40, t = 30: 11 dropouts; BENCHMARKS.md). Cohorts of at most k + 1 clients: the complete
    graph (k = cohort − 1, rounded up to even) with t = ``min_threshold(cohort − 1)``; up to 12 clients
    at γ = 5 % that is t = cohort, i.e. no dropout tolerated (a dropout aborts the attempt, which is
    redone)."""
    cohort = integer("secure-aggregation cohort", cohort, minimum=2)
    k = 2
    while 4 * (k + 1 - min_threshold(k, gamma, sigma)) < k:
        k += 2
    if cohort - 1 > k:
        return k, min_threshold(k, gamma, sigma)
    others = cohort - 1
    return others + others % 2, min_threshold(others, gamma, sigma)


@dataclass(frozen=True)
class SecAggParams:
    """SecAgg+ for one run; each field with its security (or privacy) meaning.

    ``degree`` (k) and ``threshold`` (t) both 0 (the default): derived for each round from its
    cohort by ``graph_for`` (``for_cohort``): k = 28, t = 22 for cohorts above 29 clients (7 dropouts
    per neighbourhood tolerated), the complete graph below, with t = cohort up to 12 clients (every
    dropout then aborts the attempt). Set both to choose them (validated as below; a choice below
    ``min_threshold(k)`` is accepted with a warning that gives both exposures: k = 8, t = 5 is ≈ 2^-16
    honest-but-curious and ≈ 0.34 against a deviating server at γ = 5 %).

    Threat model, with numbers (Bell et al. CCS 2020, Sec. 4; REVIEW-i36-secagg-2):
    - honest-but-curious server colluding with a random fraction γ = 5 % of the clients: a client's
      update is exposed in a round with probability P[Bin(k, γ) ≥ t] (``exposure``; ≈ 2^-77 at the
      derived k = 28, t = 22);
    - deviating server (enrolled mode only; without an enrollment the server is trusted): lies about
      dropouts, forged or replaced neighbours and replayed signatures are refused, but c ≥ 2t − 1 − k
      colluding neighbours of a client sign both stories of a lie and unmask it: probability
      P[Bin(k, γ) ≥ 2t − 1 − k] (``malicious_exposure``; ≈ 2^-40.6 at k = 28, t = 22, with the graph
      random). Only within one execution: each node signs a survivor set for at most one attempt per
      (run nonce, round) and never for an earlier round (``client/secagg_app.py``), but a new Flower
      run (new ``Context``) starts that record afresh. And the server draws the graph: a node checks its
      threshold against ``min_threshold`` of the neighbourhood it is shown and a minimum size, but a
      server that places colluders around a target is not bounded by γ (docs/secagg-consistency.md).

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
    share only with its owner's signature (docs/secagg-consistency.md); its signatures come from
    enrolled users only in enrolled mode (node config ``enrollment-file`` and ``user-key``). On the
    other side, a client whose surviving shareholders are fewer than t makes the round abort (nothing
    released), and so does a survivor that does not sign U3: t trades privacy against tolerance of
    dropouts.

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
        if threshold < min_threshold(degree):
            _log.warning("secure-aggregation k = %d, t = %d: exposure 2^%.1f (honest-but-curious), 2^%.1f "
                         "(deviating server) at γ = %g; the rule's t is %d", degree, threshold,
                         _log2(exposure(degree, threshold)), _log2(malicious_exposure(degree, threshold)),
                         COLLUSION_FRACTION, min_threshold(degree))
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
        out = dataclasses.replace(self)  # k and t set below, unchecked: graph_for meets the rule by construction
        object.__setattr__(out, "degree", degree)  # (a check would judge k rounded up to even, not the
        object.__setattr__(out, "threshold", threshold)  # min(k, cohort − 1) neighbours the round has)
        return out

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
