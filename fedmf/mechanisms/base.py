"""The Mechanism interface: a factorization A = B·C of a workload, with its error metrics.

A mechanism releases x + sigma·L z, where L is a causal left inverse of the strategy C
(L C = I; L = C^{-1} when C is square) and z holds fresh Gaussian noise rows. The model,
a linear function A of the noisy sums, then carries the noise B z with B = A L.

Error metrics (noise multiplier 1, clip norm 1; ARCHITECTURE.md conventions):
    loss = (1/n)·||A L||_F^2·sens^2,  rmse = sqrt(loss),  max_error = max_i ||(A L)_i||·sens.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import checks
from .. import sensitivity as _sens
from ..errors import ConfigError
from ..participation import FixedEpoch, MinSep, Schema
from ..workloads import Workload, WorkloadStream
from .streaming import Dense, InverseStream, StreamingInverse, numpy_stream

if TYPE_CHECKING:
    from .optimize import OptimizationResult

__all__ = ["Mechanism", "InverseStream", "StreamingInverse", "CLOSED_FORM", "OPTIMIZED", "default_bands"]

#: ``Mechanism.made_by``: built from a closed form, or found by numerical optimization
CLOSED_FORM, OPTIMIZED = "closed-form", "optimized"


def check_rounds(rounds: Any) -> int:
    """``rounds`` if it is a positive int, else a one-line ConfigError."""
    return checks.positive_int("rounds", rounds)


def default_bands(rounds: int, schema: Schema) -> int:
    """Bands used when none are given: min(b, 64, n) (b bands is the most a banded C
    may have and keep its exact MinSep sensitivity; 64 bounds the noise memory)."""
    b = schema.min_sep if isinstance(schema, (MinSep, FixedEpoch)) else rounds
    return max(1, min(b, 64, rounds))


class Mechanism(ABC):
    """A factorization mechanism over ``rounds`` rounds for ``workload``.

    Subclasses are immutable descriptions (their parameters); structure-specific fast
    paths are exposed through ``strategy_toeplitz``/``strategy_bands`` (C) and
    ``inverse_toeplitz`` (L), which sensitivity and errors use, and L streams through the
    one description ``streaming_inverse()`` (fedmf.mechanisms.streaming) that both the numpy
    materializer below and the torch noise generator interpret.
    """

    kind: ClassVar[str]
    rounds: int
    workload: Workload

    # ---- what its kind is (``fedmf.mechanisms.plan`` and ``fedmf mechanism`` read these) -------
    #: how ``plan`` makes one (CLOSED_FORM or OPTIMIZED); None: only read from a mechanism file
    made_by: ClassVar[str | None] = None
    #: whether the number of bands p is a parameter (every other kind refuses ``num_bands``)
    banded: ClassVar[bool] = False
    #: whether p may not exceed the min-separation b (a banded C keeps its exact MinSep sensitivity
    #: only up to b bands: disjoint column supports, ``sensitivity.banded_minsep``)
    bands_within_min_sep: ClassVar[bool] = False
    #: the participation schema the kind is planned for (FixedEpoch: rounds = participations x min_sep)
    planned_schema: ClassVar[type[Schema]] = MinSep
    #: whether its optimizer needs a Toeplitz workload (prefix, or momentum without a cooldown)
    toeplitz_workload_only: ClassVar[bool] = False
    #: the options of ``plan`` beyond ``num_bands`` that ``make`` reads (the others do not apply)
    options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[Mechanism, OptimizationResult | None]:
        """Build or optimize one for ``schema`` (``plan`` has checked the facts above and passes
        only ``options`` that were given); the optimizer's report, or None for a closed form. A
        kind whose solver has a module of its own (it imports the class) is made by that module's
        ``make``, which the registry in ``fedmf.mechanisms`` names."""
        if cls.made_by is None:
            raise ConfigError(f"kind {cls.kind!r} is read from a mechanism file, not planned")
        raise NotImplementedError(f"{cls.kind} is made by its solver module (use fedmf.mechanisms.plan)")

    # ---- description -------------------------------------------------------------
    @abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serializable parameters that rebuild this mechanism with ``from_params``."""

    @classmethod
    @abstractmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> Mechanism: ...

    @property
    def fingerprint(self) -> str:
        """"sha256:" + hex digest of the canonical JSON of kind, rounds, workload and params:
        equal for a mechanism and its save/load round trip, different for other parameters."""
        data = {"kind": self.kind, "rounds": self.rounds, "workload": self.workload.to_dict(), "params": self.params()}
        try:
            text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.kind} parameters are not canonical JSON: {exc}") from None
        return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    # ---- strategy C (m x n) ------------------------------------------------------
    @property
    def strategy_toeplitz(self) -> np.ndarray | None:
        """Coefficients c_0, c_1, … when C is lower-triangular Toeplitz (zero beyond)."""
        return None

    @property
    def strategy_bands(self) -> int | None:
        """Number of bands when C is banded lower-triangular."""
        return None

    @abstractmethod
    def strategy_matrix(self) -> np.ndarray:
        """Dense C, shape (noise_rows, rounds)."""

    def strategy_columns(self, indices: Sequence[int]) -> np.ndarray:
        coef = self.strategy_toeplitz
        if coef is None:
            return self.strategy_matrix()[:, list(indices)]
        n = self.rounds
        c = np.zeros(n)
        c[: min(n, coef.size)] = coef[:n]
        out = np.zeros((n, len(indices)))
        for col, j in enumerate(indices):
            out[j:, col] = c[: n - j]
        return out

    def column_norms_sq(self) -> np.ndarray:
        coef = self.strategy_toeplitz
        if coef is None:
            return np.sum(self.strategy_matrix() ** 2, axis=0)
        c = np.zeros(self.rounds)
        c[: min(self.rounds, coef.size)] = coef[: self.rounds]
        return np.cumsum(c**2)[::-1].copy()  # column j holds c_0..c_{n-1-j}

    def gram(self) -> np.ndarray:
        c = self.strategy_matrix()
        return c.T @ c

    # ---- inverse L (n x m) ---------------------------------------------------------
    @property
    def noise_rows(self) -> int:
        """m: the number of Gaussian noise rows the mechanism consumes over the run."""
        return self.rounds

    def fresh_rows(self, t: int) -> int:
        """How many fresh noise rows round t consumes."""
        return 1

    @property
    def inverse_toeplitz(self) -> np.ndarray | None:
        """Coefficients of L when it is lower-triangular Toeplitz (length n)."""
        return None

    def streaming_inverse(self) -> StreamingInverse:
        """The one streaming description of L (each family overrides this); by default the
        explicit inverse of a square lower-triangular C."""
        c = self.strategy_matrix()
        if c.shape != (self.rounds, self.rounds):
            raise NotImplementedError(f"{type(self).__name__} must describe its left inverse (C has shape {c.shape})")
        from scipy.linalg import solve_triangular

        return Dense(solve_triangular(c, np.eye(self.rounds), lower=True))

    def inverse_stream(self) -> InverseStream:
        """A fresh numpy applicator of L, interpreting ``streaming_inverse()``."""
        return numpy_stream(self.streaming_inverse())

    def inverse_rows(self) -> Iterator[np.ndarray]:
        """Rows of L one at a time (each of length m), by streaming the identity."""
        stream = self.inverse_stream()
        eye_offset = 0
        m = self.noise_rows
        for t in range(self.rounds):
            r = self.fresh_rows(t)
            z = np.zeros((r, m))
            z[np.arange(r), eye_offset + np.arange(r)] = 1.0
            eye_offset += r
            yield np.array(stream.step(z), dtype=np.float64)

    def inverse_matrix(self) -> np.ndarray:
        """Dense L, shape (rounds, noise_rows)."""
        coef = self.inverse_toeplitz
        if coef is not None:
            n = self.rounds
            out = np.zeros((n, n))
            for j in range(n):
                out[j:, j] = coef[: n - j]
            return out
        return np.array(list(self.inverse_rows()))

    # ---- errors ----------------------------------------------------------------------
    @cached_property
    def decoder_row_norms_sq(self) -> np.ndarray:
        """||(A L)_i||^2 for every round i (unit noise)."""
        coef = self.inverse_toeplitz
        n = self.rounds
        if coef is not None:
            return self.workload.toeplitz_row_norms_sq(coef[:n])
        stream = WorkloadStream(self.workload, self.noise_rows, n)
        return np.array([float(np.dot(row, row)) for row in map(stream.step, self.inverse_rows())])

    def sensitivity(self, schema: Schema) -> _sens.Sensitivity:
        return _sens.sensitivity(self, schema)

    def evaluate(self, schema: Schema) -> dict[str, Any]:
        """loss, rmse, max_error and sensitivity under ``schema``."""
        sens = self.sensitivity(schema)
        norms = self.decoder_row_norms_sq
        loss = float(np.mean(norms)) * sens.value**2
        return {
            "loss": loss,
            "rmse": float(np.sqrt(loss)),
            "max_error": float(np.sqrt(np.max(norms))) * sens.value,
            **sens.to_dict(),
        }

    def loss(self, schema: Schema) -> float:
        return self.evaluate(schema)["loss"]

    def rmse(self, schema: Schema) -> float:
        return self.evaluate(schema)["rmse"]

    def max_error(self, schema: Schema) -> float:
        return self.evaluate(schema)["max_error"]
