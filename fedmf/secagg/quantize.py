"""Fixed-point encoding of a clipped update into integers modulo 2^b, and back.

A clipped update x (‖x‖₂ ≤ ζ) is scaled by s (units per unit of the update) and rounded to the
integer grid by *conditional randomized rounding* (Kairouz, Liu, Steinke, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021, Sec. 4.1
and Thm. 1): each coordinate goes to its floor or ceiling with the probabilities that keep it
unbiased, and the whole rounding is redrawn until ‖x̃‖₂² ≤ B, with (c = ζ·s, d the dimension)

    B = ⌊ min{ c² + d/4 + √(2 ln(1/β))·(c + √d/2),  (c + √d)² } ⌋        (KLS 2021, Thm. 1)

so *every* encoded vector has ‖x̃‖₂ ≤ √B — a bound checked exactly, in integers, not one that
holds with probability 1 − β. The stated inflation is √B / c (rounded up), and the sensitivity
uses ζ·inflation (``fedmf.secagg.sensitivity``). Unlike KLS we apply no random rotation: the sum
cannot wrap for any cohort that ``check_no_wrap`` accepts, whatever the vectors.

Adaptive clipping's "unclipped" bit travels as one extra coordinate (0 or 1, not scaled), inside
the masked vector; the private client-metric release's value v (``fedmf.round.client_metrics``) as
one more, after it: ⌊clip(v, 0, L)·s⌋ capped at ``metric_cap`` (rounded down, so every decoded value
w/s lies in [0, L] and the sensitivity L holds exactly; the sum reads low by < 1/s per client). Words are uint64 holding residues modulo 2^b.

The server releases a modular sum W only through ``noisy_centred``: centre((W + s·N) mod 2^b)/s, the
noise N added to the residue *before* the centring (REVIEW-i36-privacy-path HIGH-1). On the circle
ℤ/2^b, d(K + x, K) ≤ |x| for every K, so whatever word a hostile client sends (fixing the others' sum
K anywhere), the noisy residue is the Gaussian mechanism on the lift K + x reduced mod 2^b, and the
centring and ÷s are post-processing: one honest user still moves it by at most its own ‖x‖. With
honest clients it equals centre(W)/s + N whenever |centre(W) + s·N| < 2^(b−1), which ``check_no_wrap``'s
noise margin gives except with probability ≤ 2·Φ(−12) ≈ 3.6·10⁻³³ per word and round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..checks import integer, open_unit, positive
from .errors import SecAggError
from .params import MAX_BITS, MIN_BITS

__all__ = ["Quantization", "DecodedSum", "quantize", "decode_sum", "max_safe_cohort", "check_no_wrap",
           "kls_bound_sq", "metric_cap", "metric_word", "noisy_centred", "NOISE_MARGIN_SIGMAS"]

_INT64_SAFE = 1 << 62  # squared norms below this are exact in int64
#: the no-wrap check's noise margin, in noise stds per word: P(|N(0, σ²)| > 12σ) = erfc(12/√2) ≈ 3.6·10⁻³³
NOISE_MARGIN_SIGMAS = 12.0


def kls_bound_sq(c: float, dim: int, beta: float) -> int:
    """⌊B⌋, KLS 2021 Thm. 1's bound on ‖x̃‖₂² after rounding a vector of norm ≤ c (grid units)."""
    conditional = c * c + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(dim) / 2.0)
    trivial = (c + math.sqrt(dim)) ** 2
    return math.floor(min(conditional, trivial))


def metric_cap(clip: float, scale: float) -> int:
    """W, the largest fixed-point word of a metric clipped to [0, L = ``clip``]: ⌊L·s⌋, lowered
    while W/s > L in float64, so that a decoded value never exceeds L."""
    cap = math.floor(positive("client-metrics-clip", clip) * positive("secure-aggregation scale", scale))
    while cap > 0 and cap / scale > clip:
        cap -= 1
    return cap


def metric_word(value: object, clip: float, scale: float) -> int:
    """A client's metric as one word: ⌊clip(v, 0, L)·s⌋ ≤ ``metric_cap`` (rounded down); missing,
    not a number or not finite: 0 (as ``ClientMetricRelease.clipped``)."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return 0
    if not math.isfinite(v):
        return 0
    return min(math.floor(min(max(v, 0.0), clip) * scale), metric_cap(clip, scale))


@dataclass(frozen=True)
class Quantization:
    """How one client's update of ``dim`` values (plus the unclipped bit if ``with_bit``) is
    encoded: clip to ``clip_norm``, × ``scale``, conditional randomized rounding with ``beta``,
    residues modulo 2^``bits``. ``max_tries`` roundings are drawn before the deterministic
    fallback (rounding toward zero, whose norm never exceeds the input's); the expected number of
    draws is at most 1/(1 − β) (KLS 2021, Sec. 4.1).

    With adaptive clipping the client encodes Δ/ζₜ with ``clip_norm`` 1 (the mechanism runs on
    the normalized sum), so one ``Quantization`` serves the whole run. ``metric_clip`` L (None: no
    metric): the private client-metric release's value travels as the last word (``metric_word``).
    """

    clip_norm: float
    scale: float
    bits: int
    dim: int
    beta: float = math.exp(-0.5)
    with_bit: bool = False
    max_tries: int = 1000
    metric_clip: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", positive("clip_norm", self.clip_norm))
        object.__setattr__(self, "scale", positive("secure-aggregation scale", self.scale))
        object.__setattr__(self, "bits", integer("secure-aggregation bits", self.bits, minimum=MIN_BITS,
                                                 maximum=MAX_BITS))
        object.__setattr__(self, "dim", integer("update dimension", self.dim, minimum=1))
        object.__setattr__(self, "beta", open_unit("secure-aggregation beta", self.beta))
        object.__setattr__(self, "max_tries", integer("rounding tries", self.max_tries, minimum=1))
        if self.metric_clip is not None:
            object.__setattr__(self, "metric_clip", positive("client-metrics-clip", self.metric_clip))
            if metric_cap(self.metric_clip, self.scale) >= _INT64_SAFE:
                raise SecAggError("client-metrics-clip × scale is too large for exact integers; lower the scale")
        if not isinstance(self.with_bit, bool):
            raise SecAggError(f"with_bit must be a bool, got {self.with_bit!r}")
        if (self.coordinate_bound + math.sqrt(self.dim)) ** 2 >= _INT64_SAFE:
            raise SecAggError(f"clip_norm × scale = {self.scaled_clip:.6g} is too large for exact integer norms "
                              f"in {self.dim} dimensions; lower the secure-aggregation scale")

    @property
    def scaled_clip(self) -> float:
        """c = ζ·s, the clip norm in grid units."""
        return self.clip_norm * self.scale

    @property
    def coordinate_bound(self) -> int:
        """⌈ζ·s⌉: no encoded coordinate exceeds it in absolute value (each scaled coordinate is
        within [−c, c] and is rounded to its floor or ceiling)."""
        return math.ceil(self.scaled_clip)

    @property
    def bound_sq(self) -> int:
        """B: every encoded update has ‖x̃‖₂² ≤ B (grid units, checked exactly)."""
        return kls_bound_sq(self.scaled_clip, self.dim, self.beta)

    @property
    def inflation(self) -> float:
        """√B / (ζ·s), rounded up: a decoded update's ℓ2 norm is at most ζ × this."""
        ratio = math.sqrt(self.bound_sq) / self.scaled_clip
        return math.nextafter(math.nextafter(max(ratio, 1.0), math.inf), math.inf)

    @property
    def length(self) -> int:
        """Words per client: the update's values, the bit if any, the metric if any."""
        return self.dim + int(self.with_bit) + int(self.metric_clip is not None)

    @property
    def word_bound(self) -> int:
        """No word of one client exceeds this in absolute value: ⌈ζ·s⌉, or the metric's cap if larger."""
        return max(self.coordinate_bound, 0 if self.metric_clip is None else metric_cap(self.metric_clip, self.scale))

    @property
    def mask(self) -> int:
        """2^bits − 1."""
        return (1 << self.bits) - 1


@dataclass(frozen=True)
class DecodedSum:
    """The decoded modular sum: the float64 sum of the updates, with the bit the count of
    unclipped updates, with the metric the sum of the clipped metric values (as the clients sent
    them: a hostile client may send any word)."""

    vector: np.ndarray
    unclipped: int | None
    metric: float | None = None


def _update(q: Quantization, update: object) -> np.ndarray:
    if not isinstance(update, np.ndarray) or update.dtype.kind not in "fiu" or update.shape != (q.dim,):
        shape = getattr(update, "shape", None)
        raise SecAggError(f"update must be a real numpy vector of {q.dim} values, got {type(update).__name__} "
                          f"of shape {shape}")
    x = update.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("update has non-finite values")
    return x


def quantize(q: Quantization, update: np.ndarray, rng: np.random.Generator, unclipped: bool | None = None,
             metric: object = None) -> np.ndarray:
    """The words (uint64 residues modulo 2^bits) a client masks: its update clipped to ζ (again:
    a no-op for a clipped update, it only removes floating-point excess), scaled, rounded
    conditionally so that ‖x̃‖₂² ≤ ``q.bound_sq``; then the bit, when ``q.with_bit``; then the
    metric's word, when ``q.metric_clip`` (``metric``: the reported value, None when missing)."""
    if not isinstance(rng, np.random.Generator):
        raise SecAggError(f"rng must be a numpy Generator, got {type(rng).__name__}")
    if q.with_bit != (unclipped is not None):
        raise SecAggError("the unclipped bit is required exactly when the quantization carries it")
    if q.metric_clip is None and metric is not None:
        raise SecAggError("a metric was given but the quantization carries none")
    x = _update(q, update)
    norm = float(np.linalg.norm(x))
    if norm > q.clip_norm:
        x = x * (q.clip_norm / norm)
    c = q.scaled_clip
    y = np.clip(x * q.scale, -c, c)
    floor = np.floor(y)
    frac = y - floor
    base = floor.astype(np.int64)
    bound = q.bound_sq
    rounded = None
    for _ in range(q.max_tries):
        candidate = base + (rng.random(q.dim) < frac)
        if int(np.dot(candidate, candidate)) <= bound:  # exact: int64, below 2^62 by construction
            rounded = candidate
            break
    if rounded is None:
        rounded = np.trunc(y).astype(np.int64)  # |x̃ᵢ| ≤ |yᵢ|: ‖x̃‖₂ ≤ ‖y‖₂ ≤ c ≤ √B
        if int(np.dot(rounded, rounded)) > bound:
            raise SecAggError("update cannot be quantized within the stated norm bound")
    words = rounded.view(np.uint64) & np.uint64(q.mask)
    if q.with_bit:
        words = np.append(words, np.uint64(1 if unclipped else 0))
    if q.metric_clip is not None:
        words = np.append(words, np.uint64(metric_word(metric, q.metric_clip, q.scale)))
    return words


def _words(q: Quantization, words: object) -> np.ndarray:
    if not isinstance(words, np.ndarray) or words.dtype != np.uint64 or words.shape != (q.length,):
        raise SecAggError(f"a modular sum must be a uint64 vector of {q.length} words")
    if np.any(words > np.uint64(q.mask)):
        raise SecAggError(f"a modular sum has words outside [0, 2^{q.bits})")
    return words


def decode_sum(q: Quantization, words: np.ndarray) -> DecodedSum:
    """The float64 sum of the updates from the modular sum of their words: residues centred to
    [−2^(b−1), 2^(b−1)), ÷ scale (exact while ``check_no_wrap`` accepted the cohort). For one client's
    words, tests and benchmarks: the server never releases this, only ``noisy_centred`` (HIGH-1)."""
    w = _words(q, words).astype(np.int64)
    half = 1 << (q.bits - 1)
    signed = np.where(w >= half, w - (1 << q.bits), w)
    vector = signed[: q.dim].astype(np.float64) / q.scale
    metric = float(signed[q.length - 1]) / q.scale if q.metric_clip is not None else None
    return DecodedSum(vector=vector, unclipped=int(signed[q.dim]) if q.with_bit else None, metric=metric)


def noisy_centred(bits: int, scale: float, residues: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """centre((W + s·N) mod 2^b)/s in float64, per word: ``residues`` W (uint64, each < 2^b), ``noise``
    N (float64, in the words' value units, so s·N grid units), the centred value in [−2^(b−1), 2^(b−1)).

    Exact up to the final two roundings (C + f, then ÷s), for every b ≤ 62: y = s·N (one rounding,
    none when s is a power of two) is reduced with fmod(y, 2^b) (exact in IEEE 754), split into its
    integer part k = trunc(y) (|k| < 2^62: exact in int64) and its fraction f = y − k ∈ (−1, 1)
    (exact: Sterbenz), the integer residue R = (W + k) mod 2^b is computed in int64 (|W + k| < 2^63),
    and the real number R + f ∈ (−1, 2^b) is centred exactly: it is ≥ 2^(b−1) iff R > 2^(b−1), or
    R = 2^(b−1) and f ≥ 0."""
    w = np.asarray(residues)
    if w.dtype != np.uint64 or np.any(w >> np.uint64(bits)):
        raise SecAggError(f"residues must be uint64 words below 2^{bits}")
    modulus, half = 1 << bits, 1 << (bits - 1)
    y = np.fmod(np.asarray(noise, dtype=np.float64) * scale, float(modulus))
    if y.shape != w.shape or not np.all(np.isfinite(y)):
        raise SecAggError("the noise must be finite, one value per residue")
    k = np.trunc(y)
    frac = y - k
    r = np.mod(w.astype(np.int64) + k.astype(np.int64), modulus)  # int64: no overflow for b ≤ 62
    upper = (r > half) | ((r == half) & (frac >= 0.0))
    centred = np.where(upper, r - modulus, r)
    return (centred.astype(np.float64) + frac) / scale


def _noise_margin(std: float, scale: float) -> int:
    """⌈12·σ·s⌉ grid units: the noise a word's residue must have room for (``NOISE_MARGIN_SIGMAS``)."""
    sigma = float(std)
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise SecAggError(f"a noise std must be finite and non-negative, got {std!r}")
    return math.ceil(NOISE_MARGIN_SIGMAS * sigma * scale)


def max_safe_cohort(clip_norm: float, scale: float, bits: int, metric_clip: float | None = None, *,
                    noise_std: float = 0.0, count_noise_std: float = 0.0, metric_noise_std: float = 0.0) -> int:
    """The largest cohort m whose modular sum plus the release's noise cannot leave the centred range
    (but with probability ≤ 3.6·10⁻³³ per word): m·w + ⌈12σ·s⌉ ≤ 2^(b−1) − 1 for each kind of word —
    the update's (|word| ≤ w = ⌈ζ·s⌉, σ = ``noise_std`` the per-coordinate std of its noise in the
    update's units), the bit's (0 or 1, σ = ``count_noise_std`` in counts, s = 1 for it) and the
    metric's of clip L (in [0, ``metric_cap(L, s)``], σ = ``metric_noise_std``)."""
    q_bits = integer("secure-aggregation bits", bits, minimum=MIN_BITS, maximum=MAX_BITS)
    s = positive("secure-aggregation scale", scale)
    room = (1 << (q_bits - 1)) - 1
    words = [(math.ceil(positive("clip_norm", clip_norm) * s), _noise_margin(noise_std, s)),
             (1, _noise_margin(count_noise_std, 1.0))]
    if metric_clip is not None:
        words.append((max(metric_cap(metric_clip, s), 1), _noise_margin(metric_noise_std, s)))
    return min(max(room - margin, 0) // bound for bound, margin in words)


def check_no_wrap(cohort: int, clip_norm: float, scale: float, bits: int, metric_clip: float | None = None, *,
                  noise_std: float = 0.0, count_noise_std: float = 0.0, metric_noise_std: float = 0.0) -> int:
    """``cohort`` if the modular sum of that many clipped, quantized updates (and metric words) plus a
    12σ noise margin cannot wrap (``max_safe_cohort``); else a one-line ``SecAggError`` saying what fits."""
    m = integer("planned cohort", cohort, minimum=1)
    largest = max_safe_cohort(clip_norm, scale, bits, metric_clip, noise_std=noise_std,
                              count_noise_std=count_noise_std, metric_noise_std=metric_noise_std)
    if m > largest:
        noisy = any(v > 0 for v in (noise_std, count_noise_std, metric_noise_std))
        raise SecAggError(f"a secure sum of {m} updates could wrap modulo 2^{bits} with clip_norm {clip_norm} "
                          f"and scale {scale}" + ("" if metric_clip is None else f" (client-metrics-clip {metric_clip})")
                          + (" and a 12σ noise margin" if noisy else "")
                          + f": at most {largest} fit; use more bits or a smaller scale")
    return m
