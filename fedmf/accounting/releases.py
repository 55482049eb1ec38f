"""The Gaussian releases a round makes beside the MF mechanism's noisy sum, as one description.

Besides xₜ + σ·(C⁻¹Z)ₜ a round may release scalars, each with its own independent Gaussian noise:

    "count"           adaptive clipping's count of unclipped updates: sensitivity 1 per participation,
                      std σ_b (``fedmf.round.adaptive_clipping``, ``fedmf.round.count_noise``)
    "client-metrics"  the private client-metric release: each contributing user's value clipped to
                      [0, L] and summed, sensitivity L per participation, std σ_m (``fedmf.round.client_metrics``)

Each is, per participation, a Gaussian mechanism with multiplier σⱼ/Δⱼ (ρ = Δⱼ²/(2σⱼ²)-zCDP, Bun &
Steinke, "Concentrated Differential Privacy", TCC 2016, Prop. 1.6), and zCDP composes additively
(ibid., Lemma 1.7; equivalently μ² of μ-GDP adds, Dong, Roth, Su, arXiv 1905.02383, Cor. 3.3). So
the releases of one participation together are one Gaussian mechanism of sensitivity 1 and std

    σ_unit = (Σⱼ Δⱼ²/σⱼ²)^(-1/2),                                                             (R)

which is what the accountant composes with the MF mechanism: ``count_release``'s formulas (1) and (2)
with σ_b replaced by σ_unit (with the count alone σ_unit = σ_b exactly, so those results are
unchanged). In a cyclic-Poisson step the user's column of C and every release of the participation
depend on the one sampling decision; the shift of the joint Gaussian has squared norm
col²/σ_u² + Σⱼ Δⱼ²/σⱼ², i.e. (2) with σ_unit. ``ExtraReleases`` is that description; the
accountant (``fedmf.accounting.accountant``), the ledger's lifetime budgets and the audit read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..errors import ConfigError

__all__ = ["GaussianRelease", "ExtraReleases", "COUNT", "CLIENT_METRICS"]

COUNT = "count"
CLIENT_METRICS = "client-metrics"
_WHAT = {COUNT: "adaptive clipping's count release", CLIENT_METRICS: "the private client-metric release"}
#: the run-config keys that set each release's std (for one-line errors)
_KEY = {COUNT: "adaptive-clipping-count-noise", CLIENT_METRICS: "client-metrics-noise"}
#: the largest Δ/σ accepted: the formulas square it times k (count_release (1), (2)), which must stay finite in
#: float64; a release this exact spends ε beyond 1e150 anyway
MAX_INVERSE_MULTIPLIER = 1e150


@dataclass(frozen=True)
class GaussianRelease:
    """One scalar released each round with N(0, ``noise_std``²) noise, whose value one participation
    changes by at most ``sensitivity``."""

    name: str
    sensitivity: float
    noise_std: float

    def __post_init__(self) -> None:
        if self.name not in _WHAT:
            raise ConfigError(f"unknown release {self.name!r} (known: {', '.join(_WHAT)})")
        checks.positive(f"{self.name} sensitivity", self.sensitivity)
        checks.positive(f"{self.name} noise std", self.noise_std)
        if not self.sensitivity / self.noise_std <= MAX_INVERSE_MULTIPLIER:  # also inf: σ/Δ underflows to 0
            raise ConfigError(f"{_KEY[self.name]}: noise std {self.noise_std:g} is too small for sensitivity "
                              f"{self.sensitivity:g} (at least {1 / MAX_INVERSE_MULTIPLIER:g} times it)")

    @property
    def unit_std(self) -> float:
        """σ/Δ: the std of the same mechanism rescaled to sensitivity 1."""
        return self.noise_std / self.sensitivity


@dataclass(frozen=True)
class ExtraReleases:
    """The Gaussian releases of each participation besides the MF mechanism (at least one)."""

    releases: tuple[GaussianRelease, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.releases]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"extra releases must be distinct and at least one, got {names}")

    @classmethod
    def of(cls, *releases: GaussianRelease | None) -> ExtraReleases | None:
        """The description of the releases given (None entries skipped); None when there are none."""
        kept = tuple(r for r in releases if r is not None)
        return cls(kept) if kept else None

    @classmethod
    def count(cls, count_noise_std: float) -> ExtraReleases:
        """Adaptive clipping's count alone (sensitivity 1, std σ_b)."""
        return cls((GaussianRelease(COUNT, 1.0, float(count_noise_std)),))

    @property
    def count_only(self) -> bool:
        return len(self.releases) == 1 and self.releases[0].name == COUNT

    @property
    def unit_std(self) -> float:
        """σ_unit of (R): one release alone is σ/Δ exactly (σ_b for the count); several compose by
        1/σ_unit² = Σ Δⱼ²/σⱼ² (inf when every term underflows)."""
        if len(self.releases) == 1:
            return self.releases[0].unit_std
        norm = math.hypot(*(1.0 / r.unit_std for r in self.releases))  # √Σ (Δⱼ/σⱼ)², no overflow
        return math.inf if norm == 0.0 else 1.0 / norm

    def shares(self) -> dict[str, float]:
        """Each release's fraction of Σ Δⱼ²/σⱼ² (sum 1)."""
        terms = {r.name: (1.0 / r.unit_std) ** 2 for r in self.releases}
        total = math.fsum(terms.values())
        return {name: (term / total if total > 0 else 1.0 / len(terms)) for name, term in terms.items()}

    def what(self) -> str:
        """The releases in words, for one-line errors."""
        return " and ".join(_WHAT[r.name] for r in self.releases)

    def to_list(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "sensitivity": r.sensitivity, "noise_std": r.noise_std} for r in self.releases]

    def label(self, details: dict[str, Any]) -> None:
        """Name the releases in an accountant's ``details``, which the formulas fill in as one "count" of
        std σ_unit: unchanged for the count alone; otherwise ``extra_releases`` lists them, σ_unit is
        ``extra_noise_std_per_unit`` and ``privacy_split``'s "count" is split by ``shares``."""
        if self.count_only:
            return
        unit = details.pop("count_noise_std", None)
        if unit is not None:
            details["extra_noise_std_per_unit"] = unit
        if "count_participations" in details:
            details["release_participations"] = details.pop("count_participations")
        details["extra_releases"] = self.to_list()
        split = details.get("privacy_split")
        if isinstance(split, dict) and "count" in split:
            extra = split.pop("count")
            details["privacy_split"] = {"mf": split["mf"], **{n: extra * s for n, s in self.shares().items()}}
