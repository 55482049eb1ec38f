"""Binary-tree aggregation (DP-FTRL, Kairouz et al. 2021) with Honaker's decoder.

Strategy C: one noisy release per dyadic node (h, j) covering rounds [j·2^h, (j+1)·2^h),
released when it completes, at round (j+1)·2^h - 1 (children before parents). Only nodes
that complete within n rounds exist, so every row of C is used.

Decoder: each node is estimated "from below" by inverse-variance weighting of its own
release and the sum of its children's estimates (Honaker 2015; Multi-Epoch MF App. D.2):
    e(h) = alpha_h·y(h) + (1 - alpha_h)·(e_left + e_right),
    v_0 = 1, alpha_h = 2 v_{h-1} / (2 v_{h-1} + 1), v_h = alpha_h   (so v_h = 2^h / (2^{h+1} - 1)).
The prefix sum after round t is the sum of the estimates of the dyadic decomposition of
[0, t]. This is the minimum-variance unbiased estimate from the nodes released so far,
i.e. the optimal causal decoder. The noise added in round t is the difference of two
consecutive prefix estimates, so streaming keeps O(log n) node estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..participation import Schema
from ..workloads import Workload
from .base import CLOSED_FORM, Mechanism, check_rounds
from .streaming import Tree

__all__ = ["TreeAggregation", "honaker_weights"]


def honaker_weights(height: int) -> np.ndarray:
    """alpha_0..alpha_height: the weight of a node's own release in its estimate."""
    alpha = np.ones(height + 1)
    v = 1.0
    for h in range(1, height + 1):
        alpha[h] = 2 * v / (2 * v + 1)
        v = alpha[h]
    return alpha


def _trailing_zeros(x: int) -> int:
    return (x & -x).bit_length() - 1


@dataclass(frozen=True, eq=False)
class TreeAggregation(Mechanism):
    """Binary-tree aggregation with the optimal causal (Honaker) decoder."""

    kind = "tree"
    made_by = CLOSED_FORM
    rounds: int
    workload: Workload = Workload()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[TreeAggregation, None]:
        return cls(rounds, workload), None

    def __post_init__(self) -> None:
        check_rounds(self.rounds)

    def params(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> TreeAggregation:
        return cls(rounds, workload)

    @property
    def height(self) -> int:
        return self.rounds.bit_length() - 1

    @cached_property
    def nodes(self) -> list[tuple[int, int]]:
        """(height, index) of every noise row, in release order."""
        out = []
        for t in range(self.rounds):
            j = t + 1
            for h in range(_trailing_zeros(j) + 1):
                out.append((h, (j >> h) - 1))
        return out

    @property
    def noise_rows(self) -> int:
        return len(self.nodes)

    def fresh_rows(self, t: int) -> int:
        return _trailing_zeros(t + 1) + 1

    def strategy_matrix(self) -> np.ndarray:
        c = np.zeros((self.noise_rows, self.rounds))
        for row, (h, j) in enumerate(self.nodes):
            c[row, j << h : (j + 1) << h] = 1.0
        return c

    def column_norms_sq(self) -> np.ndarray:
        # leaf i lies in the complete nodes (h, i >> h) with ((i >> h) + 1)·2^h <= n
        i = np.arange(self.rounds)
        return np.array(
            [sum(1 for h in range(self.height + 1) if (((x >> h) + 1) << h) <= self.rounds) for x in i], dtype=float
        )

    def streaming_inverse(self) -> Tree:
        return Tree(honaker_weights(self.height))

    @cached_property
    def decoder_row_norms_sq(self) -> np.ndarray:
        if not self.workload.is_prefix:
            return Mechanism.decoder_row_norms_sq.func(self)
        # prefix: the estimates of disjoint nodes are independent, Var e(h) = v_h = alpha_h
        alpha = honaker_weights(self.height)
        t = np.arange(1, self.rounds + 1)
        return np.array([sum(alpha[h] for h in range(self.height + 1) if (x >> h) & 1) for x in t], dtype=float)
