"""The private release of a client-reported metric (the clients' training loss): the only way a
client-reported value leaves the server.

A client's reported training loss is a function of its private data; the server never publishes it
as received (not in metrics, log lines, the round log, results.json or outcome.json), nor the
example counts clients report. With ``client-metrics = "private"`` each round releases instead

    noisy-train-loss = ( Σ_{i contributed} clip(vᵢ, 0, L) + N(0, σ_m²) ) / m

* vᵢ: the training loss user i reported with its update; a user whose update was not summed
  (dropped, rejected), or whose value is missing or not finite, adds 0 (a zero-out neighbour's
  contribution). Every user weighs the same: no example-count weighting (a reported count would
  let one user scale its own weight, e.g. a sybil reporting num-examples = 1e-300).
* clip to [0, L]: one participation changes the sum by at most L (zero-out adjacency: vᵢ vs 0), so
  the release is a Gaussian mechanism of sensitivity L and std σ_m, multiplier σ_m/L, composed into the
  accountant with the run's other Gaussian releases (``fedmf.accounting.releases``; Bun & Steinke
  2016, Prop. 1.6 and Lemma 1.7).
* m: the plan's expected users per round, never the number received (ARCHITECTURE.md rule 2). The
  released value is therefore not a mean of the reporters: rounds with dropouts read low.
* the noise comes from ``fedmf.round.count_noise.metric_noise``: keyed by the run's noise secret, the round
  and the round's noise salt (a redone round draws fresh noise; never ``np.random``).

This module is the description (``ClientMetricRelease``, frozen) and the arithmetic; the privatizer
applies it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..errors import ConfigError

__all__ = ["ClientMetricRelease", "METRIC", "RELEASED", "MODES", "DEFAULT_CLIP", "DEFAULT_NOISE_FRACTION"]

#: the metric a client reports with its update (client/app.py; fedmf.tasks LocalResult.metrics)
METRIC = "train-loss"
#: the released metric's key in the round's metrics, the round log and results.json
RELEASED = "noisy-train-loss"
#: run-config ``client-metrics``: "none" publishes nothing of the clients; "private" the release above
MODES = ("none", "private")
#: L: a cross-entropy above 10 nats is clipped (ln 10000 ≈ 9.2 for the text tasks' vocabulary)
DEFAULT_CLIP = 10.0
#: σ_m = L·m/20 by default: per participation the same multiplier m/20 as adaptive clipping's count
#: default σ_b = m/20 (Andrew et al. 2021, Sec. 3.1)
DEFAULT_NOISE_FRACTION = 1.0 / 20.0


@dataclass(frozen=True)
class ClientMetricRelease:
    """``clip`` L > 0 (each value is clipped to [0, L]) and ``noise_std`` σ_m > 0 (absolute std of the
    noise on the sum)."""

    clip: float
    noise_std: float

    @classmethod
    def create(cls, clip: float = DEFAULT_CLIP, noise_std: float | None = None, *,
               expected_users: float) -> ClientMetricRelease:
        """Validated; ``noise_std`` defaults to L·m/20."""
        L = checks.positive("client-metrics-clip", clip)
        m = checks.positive("expected_users", expected_users)
        sigma = L * m * DEFAULT_NOISE_FRACTION if noise_std is None else checks.positive("client-metrics-noise",
                                                                                         noise_std)
        if not (math.isfinite(L) and math.isfinite(sigma)):
            raise ConfigError("client-metrics-clip and client-metrics-noise must be finite")
        return cls(float(L), float(sigma))

    def release(self):
        """Its entry in the round's extra Gaussian releases: sensitivity L, std σ_m."""
        from ..accounting.releases import CLIENT_METRICS, GaussianRelease

        return GaussianRelease(CLIENT_METRICS, self.clip, self.noise_std)

    def clipped(self, value: Any) -> float:
        """One user's value clipped to [0, L]; missing, non-numeric or non-finite: 0."""
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            return 0.0
        if not math.isfinite(v):
            return 0.0
        return min(max(v, 0.0), self.clip)

    def noisy_mean(self, values: Iterable[Any], noise: float, expected_users: float) -> float:
        """(Σ clip(vᵢ, 0, L) + ``noise``) / m (``noise``: the round's N(0, σ_m²) draw)."""
        total = math.fsum(self.clipped(v) for v in values)
        return (total + noise) / expected_users

    def to_dict(self) -> dict[str, Any]:
        return {"metric": METRIC, "clip": self.clip, "noise_std": self.noise_std}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClientMetricRelease:
        if not isinstance(data, Mapping) or data.get("metric") != METRIC:
            raise ConfigError(f"client_metrics must be a mapping for the metric {METRIC!r}, got {data!r}")
        try:
            return cls.create(data["clip"], data["noise_std"], expected_users=1.0)
        except KeyError as e:
            raise ConfigError(f"client_metrics lacks {e}") from None
