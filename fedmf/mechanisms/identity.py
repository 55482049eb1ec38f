"""DP-SGD / DP-FedAvg: independent noise every round (C = I)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..participation import Schema
from ..workloads import Workload
from .base import CLOSED_FORM, Mechanism, check_rounds
from .streaming import Fir

__all__ = ["DpSgd"]


@dataclass(frozen=True, eq=False)
class DpSgd(Mechanism):
    """C = L = I: the baseline. Under MinSep(b, k) its prefix loss is k(n+1)/2."""

    kind = "dp-sgd"
    made_by = CLOSED_FORM
    rounds: int
    workload: Workload = Workload()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[DpSgd, None]:
        return cls(rounds, workload), None

    def __post_init__(self) -> None:
        check_rounds(self.rounds)

    def params(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> DpSgd:
        return cls(rounds, workload)

    @property
    def strategy_toeplitz(self) -> np.ndarray:
        return np.ones(1)

    @property
    def strategy_bands(self) -> int:
        return 1

    def strategy_matrix(self) -> np.ndarray:
        return np.eye(self.rounds)

    @property
    def inverse_toeplitz(self) -> np.ndarray:
        return np.eye(1, self.rounds).ravel()

    def streaming_inverse(self) -> Fir:
        return Fir(np.ones(1))  # L = I
