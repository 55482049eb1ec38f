"""Toeplitz mechanisms with banded C (bsr, banded-toeplitz) or banded C^{-1} (bisr, bifr).

Conventions ("Beyond Square Roots", Sec. 2): a lower-triangular Toeplitz T has
T[i, j] = t_{i-j}. C's coefficients are c_j, C^{-1}'s are a_j.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .. import checks
from ..errors import ConfigError
from ..filters import series_inverse
from ..participation import Schema
from ..workloads import Workload
from .base import CLOSED_FORM, OPTIMIZED, Mechanism, check_rounds, default_bands
from .optimize import grid_then_golden
from .streaming import Fir, Iir

__all__ = [
    "fractional_power_coefficients",
    "series_inverse",
    "BandedToeplitz",
    "BandedSquareRoot",
    "BandedInverseToeplitz",
    "BandedInverseSquareRoot",
    "BandedInverseFractionalRoot",
    "optimal_gamma",
]


def fractional_power_coefficients(gamma: float, count: int) -> np.ndarray:
    """First ``count`` coefficients of (1 - x)^gamma: a_0 = 1, a_j = a_{j-1}(j - 1 - gamma)/j
    ("Beyond Square Roots", Eq. 9 and its recurrence)."""
    a = np.ones(count)
    for j in range(1, count):
        a[j] = a[j - 1] * (j - 1 - gamma) / j
    return a


def _check_bands(num_bands: int, rounds: int) -> None:
    checks.positive_int("bands", num_bands)
    check_rounds(rounds)
    if num_bands > rounds:
        raise ConfigError(f"bands p={num_bands} exceeds the number of rounds n={rounds}")


def _frozen(values: Any) -> np.ndarray:
    arr = np.array(values, dtype=np.float64)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class BandedToeplitz(Mechanism):
    """C = banded lower-triangular Toeplitz with the given coefficients; C^{-1} is dense
    and streams through the recursion of "Scaling up BandMF", Alg. 1."""

    kind = "banded-toeplitz"
    made_by = OPTIMIZED
    banded = bands_within_min_sep = toeplitz_workload_only = True
    options = ("error", "tolerance", "max_steps", "progress")
    rounds: int
    coefficients: np.ndarray
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", _frozen(self.coefficients))
        _check_bands(self.coefficients.size, self.rounds)
        if not np.all(np.isfinite(self.coefficients)) or self.coefficients[0] <= 0:
            raise ConfigError("banded Toeplitz coefficients must be finite with c_0 > 0")

    def params(self) -> dict[str, Any]:
        return {"coefficients": self.coefficients.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BandedToeplitz:
        return cls(rounds, np.asarray(params["coefficients"], dtype=np.float64), workload)

    @property
    def num_bands(self) -> int:
        return int(self.coefficients.size)

    @property
    def strategy_toeplitz(self) -> np.ndarray:
        return self.coefficients

    @property
    def strategy_bands(self) -> int:
        return self.num_bands

    def strategy_matrix(self) -> np.ndarray:
        return self.strategy_columns(range(self.rounds))

    @cached_property
    def inverse_toeplitz(self) -> np.ndarray:
        return series_inverse(self.coefficients, self.rounds)

    def streaming_inverse(self) -> Iir:
        return Iir(self.coefficients)  # banded Toeplitz C ("Scaling up BandMF", Alg. 1)


@dataclass(frozen=True, eq=False, init=False)
class BandedSquareRoot(BandedToeplitz):
    """BSR: C = first p coefficients of (1 - x)^{-1/2} (Kalinin & Lampert 2024)."""

    kind = "bsr"
    made_by = CLOSED_FORM
    bands_within_min_sep = toeplitz_workload_only = False
    options = ()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[BandedSquareRoot, None]:
        return cls(rounds, default_bands(rounds, schema) if num_bands is None else num_bands, workload), None

    def __init__(self, rounds: int, num_bands: int, workload: Workload = Workload()) -> None:
        _check_bands(num_bands, rounds)
        object.__setattr__(self, "rounds", rounds)
        object.__setattr__(self, "workload", workload)
        object.__setattr__(self, "coefficients", fractional_power_coefficients(-0.5, num_bands))
        BandedToeplitz.__post_init__(self)

    def params(self) -> dict[str, Any]:
        return {"num_bands": self.num_bands}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BandedSquareRoot:
        return cls(rounds, params["num_bands"], workload)


@dataclass(frozen=True, eq=False)
class BandedInverseToeplitz(Mechanism):
    """C^{-1} = banded lower-triangular Toeplitz with the given coefficients a_0..a_{p-1};
    C is dense Toeplitz (series inverse). Noise needs only the last p-1 fresh draws."""

    kind = "banded-inverse-toeplitz"
    rounds: int
    inverse_coefficients: np.ndarray
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inverse_coefficients", _frozen(self.inverse_coefficients))
        _check_bands(self.inverse_coefficients.size, self.rounds)
        if not np.all(np.isfinite(self.inverse_coefficients)) or self.inverse_coefficients[0] <= 0:
            raise ConfigError("banded inverse coefficients must be finite with a_0 > 0")

    def params(self) -> dict[str, Any]:
        return {"inverse_coefficients": self.inverse_coefficients.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BandedInverseToeplitz:
        return cls(rounds, np.asarray(params["inverse_coefficients"], dtype=np.float64), workload)

    @property
    def num_bands(self) -> int:
        return int(self.inverse_coefficients.size)

    @cached_property
    def strategy_toeplitz(self) -> np.ndarray:
        return series_inverse(self.inverse_coefficients, self.rounds)

    def strategy_matrix(self) -> np.ndarray:
        return self.strategy_columns(range(self.rounds))

    @cached_property
    def inverse_toeplitz(self) -> np.ndarray:
        out = np.zeros(self.rounds)
        out[: self.num_bands] = self.inverse_coefficients
        return out

    def streaming_inverse(self) -> Fir:
        return Fir(self.inverse_coefficients)  # banded Toeplitz C^{-1} ("Beyond Square Roots", Sec. 4)


@dataclass(frozen=True, eq=False, init=False)
class BandedInverseFractionalRoot(BandedInverseToeplitz):
    """gamma-BIFR: C^{-1} = first p diagonals of (I - S)^gamma ("Beyond Square Roots",
    Definition 2). gamma = 1/2 is BISR, p = 2 is DP-lambda-CGD, p = 1 is DP-SGD."""

    kind = "bifr"
    made_by = CLOSED_FORM
    banded = True
    options = ("gamma",)
    gamma: float = 0.5

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[BandedInverseFractionalRoot, None]:
        """With ``gamma``, that BIFR; without, the gamma best for ``schema`` (``optimal_gamma``)."""
        p = default_bands(rounds, schema) if num_bands is None else num_bands
        if options.get("gamma") is not None:
            return cls(rounds, p, options["gamma"], workload), None
        return optimal_gamma(rounds, p, schema, workload), None

    def __init__(self, rounds: int, num_bands: int, gamma: float, workload: Workload = Workload()) -> None:
        _check_bands(num_bands, rounds)
        if not 0.0 < gamma < 1.0:
            raise ConfigError(f"gamma must lie in (0, 1), got {gamma}")
        object.__setattr__(self, "rounds", rounds)
        object.__setattr__(self, "workload", workload)
        object.__setattr__(self, "gamma", float(gamma))
        object.__setattr__(self, "inverse_coefficients", fractional_power_coefficients(gamma, num_bands))
        BandedInverseToeplitz.__post_init__(self)

    def params(self) -> dict[str, Any]:
        return {"num_bands": self.num_bands, "gamma": self.gamma}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BandedInverseFractionalRoot:
        return cls(rounds, params["num_bands"], checks.number("gamma", params["gamma"]), workload)


@dataclass(frozen=True, eq=False, init=False)
class BandedInverseSquareRoot(BandedInverseFractionalRoot):
    """BISR: gamma-BIFR with gamma = 1/2 (Kalinin et al. 2026, "Back to Square Roots")."""

    kind = "bisr"
    options = ()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[BandedInverseSquareRoot, None]:
        return cls(rounds, default_bands(rounds, schema) if num_bands is None else num_bands, workload), None

    def __init__(self, rounds: int, num_bands: int, workload: Workload = Workload()) -> None:
        super().__init__(rounds, num_bands, 0.5, workload)

    def params(self) -> dict[str, Any]:
        return {"num_bands": self.num_bands}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> BandedInverseSquareRoot:
        return cls(rounds, params["num_bands"], workload)


def optimal_gamma(
    rounds: int, num_bands: int, schema: Schema, workload: Workload = Workload(), xatol: float = 1e-7
) -> BandedInverseFractionalRoot:
    """gamma-BIFR with gamma minimizing rmse under ``schema``: a grid over (0, 1) then a
    golden-section refinement around the best grid point ("Beyond Square Roots", Sec. 12:
    gamma is chosen by a 1-D search on the deployed objective)."""

    def rmse(g: float) -> float:
        return BandedInverseFractionalRoot(rounds, num_bands, g, workload).rmse(schema)

    if num_bands == 1:  # gamma has no effect: C = I
        return BandedInverseFractionalRoot(rounds, 1, 0.5, workload)
    best, _ = grid_then_golden(rmse, 1e-4, 1 - 1e-4, grid_points=25, xatol=xatol)
    return BandedInverseFractionalRoot(rounds, num_bands, best, workload)
