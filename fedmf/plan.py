"""RunPlan: the immutable description of one private run, and what follows from it.

A plan names the mechanism (by its parameter fingerprint), the planned participation schema,
how users are sampled, the clip norm ζ, the noise multiplier z (given, or calibrated once for
a target (ε, δ)), δ, the expected number of users per round (the divisor of the noisy sum),
the ℓ∞ zeroing threshold and the accountant. Derived: the sensitivity of C under the schema,
the absolute noise std σ = z·ζ·sens ("Multi-Epoch Matrix Factorization Mechanisms", Thm 2.2:
releasing x + σ·C⁻¹Z is (ε, δ)-DP with the Gaussian mechanism's ε at multiplier z), ε in
total and after each round.

With secure aggregation (``with_secure_aggregation``) the plan also records the SecAgg+
parameters, the update's dimension and the quantization's norm inflation: σ is then computed from
ζ_eff = ζ·inflation (``effective_noise_std``; ε is unchanged, the noise larger).

The ledger's run row and every checkpoint carry ``to_dict()`` and ``fingerprint``; a
checkpoint or ledger written for another plan is refused (``check_fingerprint``): a run resumed
with other secure-aggregation parameters, or without them, is refused like any other change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from . import checks
from .accounting.schemes import check_delta, check_releases, has_per_round_curve
from .errors import ConfigError, HorizonReached, PlanMismatch, PrivacyBudgetExceeded
from .participation import FixedEpoch, MinSep, schema_from_dict
from .round.adaptive_clipping import AdaptiveClipping
from .round.client_metrics import ClientMetricRelease
from .sampling import Sampling, parse_sampling
from .secagg.params import SecAggParams, SecureAggregation

if TYPE_CHECKING:
    from .mechanisms.base import Mechanism
    from .sensitivity import Sensitivity

__all__ = ["RunPlan", "DEFAULT_ZERO_FACTOR", "PLAN_FORMAT"]

PLAN_FORMAT = 1
#: "Multi-Epoch MF" StackOverflow recipe: an update whose ℓ∞ norm exceeds 100·ζ is zeroed
DEFAULT_ZERO_FACTOR = 100.0
_ACCOUNTANTS = ("pld", "rdp")
_EPS_RTOL = 1e-9  # a planned ε this close above the target is the calibration's rounding


def _canonical(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class RunPlan:
    """One private run. Build it with ``RunPlan.create`` (validates, resolves defaults and
    calibrates z once for a target ε); ``from_dict`` rebuilds it from ``to_dict``."""

    mechanism: Mechanism
    schema: MinSep | FixedEpoch
    sampling: Sampling
    clip_norm: float
    noise_multiplier: float
    delta: float
    expected_users: float
    zero_threshold: float | None
    accountant: str = "pld"
    target_epsilon: float | None = None
    calibration: dict[str, Any] = field(default_factory=dict, compare=False)
    #: None: ζ is fixed; else ζ₀ = clip_norm adapts each round (fedmf.round.adaptive_clipping)
    adaptive_clipping: AdaptiveClipping | None = None
    #: None: nothing of the clients' reported metrics is released; else their private release
    #: (fedmf.round.client_metrics), composed into the accounting
    client_metrics: ClientMetricRelease | None = None
    #: None: the central mode; else secure aggregation's record (``with_secure_aggregation``)
    secure_aggregation: SecureAggregation | None = None

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def create(cls, mechanism: Mechanism, schema: MinSep | FixedEpoch, *, clip_norm: float, delta: float,
               expected_users: float, noise_multiplier: float | None = None, target_epsilon: float | None = None,
               sampling: Sampling | str | None = None, zero_threshold: float | None | str = "default",
               accountant: str = "pld", adaptive_clipping: AdaptiveClipping | None = None,
               client_metrics: ClientMetricRelease | None = None) -> RunPlan:
        """Validate every value once; with ``target_epsilon`` (and no ``noise_multiplier``)
        calibrate z for (ε, δ) with the plan's accountant and sampling (cached by fedmf.accounting)."""
        from .mechanisms.base import Mechanism

        if not isinstance(mechanism, Mechanism):
            raise ConfigError(f"mechanism must be a fedmf Mechanism, got {type(mechanism).__name__}")
        if not isinstance(schema, (MinSep, FixedEpoch)):
            raise ConfigError(f"a run is planned for MinSep or FixedEpoch participation, not {type(schema).__name__}")
        schema.validate(mechanism.rounds)
        sampling = parse_sampling(sampling)
        zeta = checks.positive("clip_norm", clip_norm)
        delta = checks.open_unit("delta", delta)
        m = checks.positive("expected_users", expected_users)
        if accountant not in _ACCOUNTANTS:
            raise ConfigError(f"accountant must be one of {', '.join(_ACCOUNTANTS)}, got {accountant!r}")
        if isinstance(zero_threshold, str):
            if zero_threshold != "default":
                raise ConfigError(f"zero_threshold must be a number, None or 'default', got {zero_threshold!r}")
            zero_threshold = DEFAULT_ZERO_FACTOR * zeta
        threshold = None if zero_threshold is None else checks.positive("zero_threshold", zero_threshold)
        eps = None if target_epsilon is None else checks.positive("target_epsilon", target_epsilon)
        z = None if noise_multiplier is None else checks.positive("noise_multiplier", noise_multiplier)
        sampling.check_schema(schema)
        check_delta(sampling, delta)
        if adaptive_clipping is not None and not isinstance(adaptive_clipping, AdaptiveClipping):
            raise ConfigError(f"adaptive_clipping must be an AdaptiveClipping, got {type(adaptive_clipping).__name__}")
        if client_metrics is not None and not isinstance(client_metrics, ClientMetricRelease):
            raise ConfigError(f"client_metrics must be a ClientMetricRelease, got {type(client_metrics).__name__}")
        releases = _extra_releases(adaptive_clipping, client_metrics)
        if releases is not None:
            check_releases(sampling, releases)
        calibration: dict[str, Any] = {}
        if z is None:
            if eps is None:
                raise ConfigError("give a noise_multiplier or a target_epsilon")
            from .accounting import calibrate

            result = calibrate(mechanism, eps, delta, schema, sampling=sampling, accountant=accountant,
                               releases=releases)
            z = float(result.noise_multiplier)
            calibration = {"accountant": result.accountant, "guarantee": result.guarantee}
        plan = cls(mechanism, schema, sampling, zeta, z, delta, m, threshold, accountant, eps, calibration,
                   adaptive_clipping, client_metrics)
        if not plan.sensitivity.value > 0:
            raise ConfigError("the mechanism has zero sensitivity under this schema")
        return plan

    def with_secure_aggregation(self, params: SecAggParams, dim: int) -> RunPlan:
        """This plan under SecAgg+ with ``params`` for updates of ``dim`` values: the same z and ε,
        and the quantization's inflation recorded (``fedmf.secagg.quantize``: clip norm ζ, or 1 for
        the normalized updates of adaptive clipping; scale, bits, β of ``params``)."""
        from .secagg.quantize import Quantization

        if not isinstance(params, SecAggParams):
            raise ConfigError(f"params must be SecAggParams, got {type(params).__name__}")
        adaptive = self.adaptive_clipping is not None
        q = Quantization(clip_norm=1.0 if adaptive else self.clip_norm, scale=params.scale, bits=params.bits,
                         dim=dim, beta=params.beta, with_bit=adaptive)
        params = dataclasses.replace(params, stage_timeout_s=SecAggParams.stage_timeout_s)  # not part of the plan
        return dataclasses.replace(self, secure_aggregation=SecureAggregation(params, q.dim, q.inflation))

    # ---- derived ---------------------------------------------------------------------
    @property
    def noise_inflation(self) -> float:
        """The factor on σ: secure aggregation's quantization inflation, 1 in the central mode."""
        return 1.0 if self.secure_aggregation is None else self.secure_aggregation.inflation

    @property
    def effective_clip_norm(self) -> float:
        """ζ_eff = ζ·inflation (``fedmf.secagg.sensitivity``), ζ in the central mode."""
        return self.clip_norm * self.noise_inflation

    @property
    def effective_noise_std(self) -> float:
        """σ as the rounds draw it: z·ζ_eff·sens (= ``noise_std`` in the central mode; at ζ₀ when ζ adapts)."""
        return self.noise_std * self.noise_inflation

    @property
    def rounds(self) -> int:
        return self.mechanism.rounds

    @cached_property
    def sensitivity(self) -> Sensitivity:
        """Sensitivity of C under the planned schema (``.value``, ``.exact``, ``.method``)."""
        return self.mechanism.sensitivity(self.schema)

    @property
    def noise_std(self) -> float:
        """Absolute noise std σ = z·ζ·sens ("Multi-Epoch MF", Thm 2.2; ARCHITECTURE.md)."""
        return self.noise_multiplier * self.clip_norm * self.sensitivity.value

    @property
    def std_per_clip(self) -> float:
        """σ per unit clip norm, z·sens: the noise std on the normalized sum Σ clip(Δ, ζ)/ζ."""
        return self.noise_multiplier * self.sensitivity.value

    def noise_std_at(self, clip_norm: float) -> float:
        """Absolute noise std of a round clipped at ``clip_norm``: z·ζₜ·sens (= ``noise_std`` at ζ₀)."""
        return self.noise_multiplier * clip_norm * self.sensitivity.value

    def zero_threshold_at(self, clip_norm: float) -> float | None:
        """The ℓ∞ zeroing threshold of a round clipped at ``clip_norm``: planned for ζ₀, it follows ζₜ
        in proportion when ζ adapts (100·ζₜ by default)."""
        if self.zero_threshold is None or self.adaptive_clipping is None:
            return self.zero_threshold
        return self.zero_threshold * (clip_norm / self.clip_norm)

    @property
    def count_noise_std(self) -> float | None:
        """σ_b of adaptive clipping's count release (None: ζ is fixed, no count is released)."""
        return None if self.adaptive_clipping is None else self.adaptive_clipping.count_noise_std

    @property
    def extra_releases(self):
        """The Gaussian releases of each participation besides the MF mechanism (adaptive clipping's
        count, the private client-metric release) as the accountant reads them
        (``fedmf.accounting.releases.ExtraReleases``), or None."""
        return _extra_releases(self.adaptive_clipping, self.client_metrics)

    @property
    def extra_noise_std(self) -> float | None:
        """σ_unit of the extra releases (``fedmf.accounting.releases`` (R); σ_b with the count alone), or None."""
        releases = self.extra_releases
        return None if releases is None else releases.unit_std

    @cached_property
    def _accounting(self):
        from .accounting import MonteCarloOptions, epsilon

        # the b-min-sep Monte Carlo accountant's seed comes from the plan's public fingerprint: the planned ε
        # (and so the guard and results.json) is one number in every process that plans this run
        seed = int.from_bytes(hashlib.sha256(self.fingerprint.encode()).digest()[:8], "big")
        return epsilon(self.mechanism, self.noise_multiplier, self.delta, self.schema, sampling=self.sampling,
                       accountant=self.accountant, releases=self.extra_releases,
                       monte_carlo=MonteCarloOptions(seed=seed))

    def epsilon(self) -> float:
        """ε of the whole run at δ (as planned; with adaptive clipping's count release composed in). A z
        that Estimate-Verify-Release calibrated for the target is (target, δ)-DP (Thm A.1 of arXiv
        2602.09338): the target is the planned ε, not a second Monte Carlo estimate at that z, which lands
        on either side of it."""
        if self.calibration.get("accountant") == "bminsep-evr":
            return float(self.target_epsilon)
        return float(self._accounting.epsilon)

    def rho(self) -> float | None:
        """ρ-zCDP of the whole run (un-amplified accounting only; None where the accountant is amplified)."""
        return self._accounting.rho

    @cached_property
    def _curve(self):
        from .accounting import epsilon_by_round

        return epsilon_by_round(self.mechanism, self.noise_multiplier, self.delta, self.schema,
                                sampling=self.sampling, accountant=self.accountant, final=self.epsilon(),
                                releases=self.extra_releases)

    @cached_property
    def _epsilon_by_round(self) -> np.ndarray:
        total = self.epsilon()
        if not has_per_round_curve(self.sampling):
            # no per-round curve for this scheme's accountant: every round is charged the whole run's ε
            return np.full(self.rounds, total)
        return np.minimum(np.asarray(self._curve.epsilons, dtype=np.float64), total)

    def rho_after(self, t: int) -> float | None:
        """Planned ρ-zCDP once round t is done (None where the accountant is amplified)."""
        if self.rho() is None:
            return None
        return float(min(self._curve.rhos[t], self.rho()))

    def epsilon_by_round(self) -> np.ndarray:
        """ε spent after rounds 0..t for every t (planned; non-decreasing, ends at ``epsilon()``)."""
        return self._epsilon_by_round.copy()

    def epsilon_after(self, t: int) -> float:
        """Planned ε once round t is done."""
        return float(self._epsilon_by_round[t])

    # ---- the guard -------------------------------------------------------------------
    def guard(self, t: int, observed_epsilon: float | None = None) -> None:
        """Refuse to open round t past the horizon, or when it would exceed the target ε
        (planned; and ``observed_epsilon``: the worst user's ε so far, from the ledger)."""
        if t >= self.rounds:
            raise HorizonReached(f"round {t} is past the mechanism's horizon of {self.rounds} rounds")
        if self.target_epsilon is None:
            return
        limit = self.target_epsilon * (1 + _EPS_RTOL)
        planned = self.epsilon_after(t)
        if planned > limit:
            raise PrivacyBudgetExceeded(f"round {t} would spend epsilon {planned:.6g} as planned, "
                                        f"above the target {self.target_epsilon:g}")
        if observed_epsilon is not None and observed_epsilon > limit:
            raise PrivacyBudgetExceeded(f"a user has already spent epsilon {observed_epsilon:.6g}, "
                                        f"above the target {self.target_epsilon:g}; round {t} is not opened")

    def check_population(self, users: int) -> None:
        """Refuse (one-line ``ConfigError``) a population of ``users`` smaller than the expected users
        per round: every update is divided by that m, which no round could reach."""
        if self.expected_users > users:
            raise ConfigError(f"clients-per-round (expected users per round) {self.expected_users:g} exceeds the "
                              f"population of {users} users: no round can reach it")

    # ---- serialization ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description; the mechanism appears as its kind and fingerprint (a plan
        without adaptive clipping has no ``adaptive_clipping`` key, one without a client-metric release no
        ``client_metrics`` key: their fingerprints are unchanged)."""
        out = {
            "format": PLAN_FORMAT,
            "mechanism": {"kind": self.mechanism.kind, "rounds": self.rounds,
                          "fingerprint": self.mechanism.fingerprint},
            "schema": self.schema.to_dict(self.rounds),
            "sampling": str(self.sampling),
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "expected_users": self.expected_users,
            "zero_threshold": self.zero_threshold,
            "accountant": self.accountant,
        }
        if self.adaptive_clipping is not None:
            out["adaptive_clipping"] = self.adaptive_clipping.to_dict()
        if self.client_metrics is not None:
            out["client_metrics"] = self.client_metrics.to_dict()
        if self.secure_aggregation is not None:
            out["secure_aggregation"] = self.secure_aggregation.to_dict()
        return out

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical ``to_dict()``: equal plans, equal fingerprints."""
        return "sha256:" + hashlib.sha256(_canonical(self.to_dict())).hexdigest()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], mechanism: Mechanism) -> RunPlan:
        """Rebuild a plan written by ``to_dict`` for ``mechanism`` (its fingerprint must match)."""
        checks.state_format(data, "run plan", PLAN_FORMAT, error=PlanMismatch)
        try:
            recorded = data["mechanism"]["fingerprint"]
            if recorded != mechanism.fingerprint:
                raise PlanMismatch("the plan was made for another mechanism (fingerprints differ)")
            schema = schema_from_dict(data["schema"])
            adaptive = data.get("adaptive_clipping")
            adaptive = None if adaptive is None else AdaptiveClipping.from_dict(adaptive)
            metrics = data.get("client_metrics")
            metrics = None if metrics is None else ClientMetricRelease.from_dict(metrics)
            plan = cls.create(mechanism, schema, clip_norm=data["clip_norm"], delta=data["delta"],
                              expected_users=data["expected_users"], noise_multiplier=data["noise_multiplier"],
                              target_epsilon=data["target_epsilon"], sampling=data["sampling"],
                              zero_threshold=data["zero_threshold"], accountant=data["accountant"],
                              adaptive_clipping=adaptive, client_metrics=metrics)
            secure = data.get("secure_aggregation")
            if secure is not None:
                from .secagg.errors import SecAggError

                try:
                    params, dim = SecureAggregation.params_from_dict(secure)
                except SecAggError as e:
                    raise PlanMismatch(f"malformed run plan: {e}") from None
                plan = plan.with_secure_aggregation(params, dim)
                if plan.secure_aggregation.inflation != secure.get("inflation"):
                    raise PlanMismatch("the plan's recorded quantization inflation is not what its parameters give")
            return plan
        except (KeyError, TypeError) as e:
            raise PlanMismatch(f"malformed run plan (missing or bad field {e})") from None

    def check_fingerprint(self, recorded: str | None, where: str) -> None:
        """Refuse ``where`` (a checkpoint, a ledger run) written for another plan."""
        if recorded != self.fingerprint:
            raise PlanMismatch(f"{where} was written for another plan than the one configured "
                               f"({recorded or 'none'} != {self.fingerprint}); use the original configuration "
                               "or a new checkpoint directory / ledger run")

    def summary(self) -> dict[str, Any]:
        """The plan with its derived values (for logs, metrics and the CLI)."""
        out = {**self.to_dict(), "sensitivity": self.sensitivity.value, "sensitivity_exact": self.sensitivity.exact,
               "noise_std": self.noise_std, "epsilon": self.epsilon(), "rho": self.rho(),
               "fingerprint": self.fingerprint}
        if self.secure_aggregation is not None:  # σ drawn: z·ζ_eff·sens (fedmf.secagg.sensitivity)
            out.update(clip_norm_effective=self.effective_clip_norm, noise_std_effective=self.effective_noise_std)
        if self.rho() is None:
            out["rho_note"] = self._accounting.details["rho_note"]
        if "privacy_split" in self._accounting.details:
            # fractions of μ² (of ρ): the MF mechanism, the count, the client-metric release
            out["privacy_split"] = self._accounting.details["privacy_split"]
        return out


def _extra_releases(adaptive: AdaptiveClipping | None, metrics: ClientMetricRelease | None):
    from .accounting.releases import COUNT, ExtraReleases, GaussianRelease

    count = None if adaptive is None else GaussianRelease(COUNT, 1.0, adaptive.count_noise_std)
    return ExtraReleases.of(count, None if metrics is None else metrics.release())
