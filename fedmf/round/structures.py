"""The torch interpreters of the streaming descriptions of L = C^{-1}: one per description type
(``fedmf.mechanisms.streaming``, whose numpy interpreters read the same descriptions;
tests/mechanisms/test_streaming.py checks that the two agree on the same draws, for every type).

Each keeps the state its description bounds ("Scaling up BandMF" Alg. 1 for banded C;
"Beyond Square Roots" Sec. 4 for banded C^{-1}; McMahan et al. 2024 for BLT buffers):
  Fir    banded C^{-1} (dp-sgd, bisr, bifr)   p - 1 past fresh draws (or none with regenerate=True);
         none of them in the state: they are regenerated from the seed
  Iir    banded C (bsr, banded-toeplitz, robust, banded)   p - 1 past outputs
  Blt    m buffers
  Tree   O(log n) node estimates
  Dense  nothing: past draws are regenerated, O(t·d) per round
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..mechanisms.streaming import Blt, Dense, Fir, Iir, StreamingInverse, Tree, tree_fresh_rows
from .draws import Draws

__all__ = ["Structure", "FirNoise", "IirNoise", "BltNoise", "TreeNoise", "DenseNoise", "INTERPRETERS", "structure"]


class Structure:
    """Interprets one description of L for the generator: ``step(t, row, out)`` writes (L z)_t
    into ``out`` (fresh draws already carry the noise std). Each subclass is built as
    ``(draws, spec, regenerate)``; ``regenerate`` (regenerate past fresh draws instead of keeping
    them) matters only to the one that keeps draws (``FirNoise``)."""

    def __init__(self, draws: Draws) -> None:
        self.draws = draws

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.draws.hi - self.draws.lo, dtype=self.draws.dtype, device=self.draws.device)

    def _restore(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Checkpointed tensors, copied onto this generator's device and dtype."""
        return [x.to(self.draws.device, self.draws.dtype).clone() for x in tensors]

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        """For each tensor of ``state()`` after t rounds: the round whose ``next()`` produced
        its final value, or None if it changes every round."""
        return {}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        pass

    def slice(self, lo: int, hi: int) -> dict[str, Any]:
        """The state restricted to the flat range [lo, hi) of this structure's range."""
        return {k: [x[lo:hi].clone() for x in v] for k, v in self.state().items()}


class FirNoise(Structure):
    """w_t = sum_{j<p} a_j z_{t-j} (banded lower-triangular Toeplitz L), one fused pass:
    reads the p - 1 kept draws once and writes w_t once."""

    def __init__(self, draws: Draws, spec: Fir, regenerate: bool) -> None:
        super().__init__(draws)
        self.taps = [float(a) for a in spec.taps]
        self.regenerate = regenerate
        self.past: list[torch.Tensor] = []  # z_{t-1}, z_{t-2}, …
        self.spare: torch.Tensor | None = None  # storage of the draw that fell out of the window

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        p = len(self.taps)
        if p == 1 and self.taps[0] == 1.0:
            return self.draws.fill(row, out)
        z = self.spare if self.spare is not None else self._empty()
        self.spare = None
        count = min(p - 1, t)
        past = [self.draws.new(row - j) for j in range(1, count + 1)] if self.regenerate else self.past[:count]
        taps = self.taps

        def kernel(a: int, b: int) -> None:
            piece = torch.mul(z[a:b], taps[0], out=out[a:b])
            for tap, x in zip(taps[1:], past):
                piece.add_(x[a:b], alpha=tap)

        self.draws.run(row, z, kernel)
        if not self.regenerate and p > 1:
            if len(self.past) == p - 1:
                self.spare = self.past.pop()
            self.past.insert(0, z)
        return out

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        # the past fresh draws are regenerated from the seed: nothing to store
        self.spare = None
        if not self.regenerate:
            self.past = [self.draws.new(row - j) for j in range(1, min(len(self.taps) - 1, t) + 1)]


class IirNoise(Structure):
    """y_t = (z_t - sum_{r=1}^{p-1} C[t, t-r] y_{t-r}) / C[t, t] for banded C
    ("Scaling up BandMF", Alg. 1); Toeplitz C has constant bands. One fused pass; y_t
    overwrites the oldest kept output piece by piece once that piece has been read."""

    def __init__(self, draws: Draws, spec: Iir, regenerate: bool = False) -> None:
        super().__init__(draws)
        self.spec = spec
        self.past: list[torch.Tensor] = []  # y_{t-1}, y_{t-2}, …: each unchanged until it leaves the window

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        p = self.spec.num_bands
        coefs = [-self.spec.coefficient(r, t) for r in range(1, len(self.past) + 1)]
        inverse_diagonal = 1.0 / self.spec.coefficient(0, t)
        keep = None
        if p > 1:
            keep = self.past[-1] if len(self.past) == p - 1 else self._empty()
        past = self.past

        def kernel(a: int, b: int) -> None:
            piece = out[a:b]
            for c, y in zip(coefs, past):
                piece.add_(y[a:b], alpha=c)
            piece.mul_(inverse_diagonal)
            if keep is not None:  # y_t overwrites the oldest kept output once this range of it is read
                keep[a:b].copy_(piece)

        self.draws.run(row, out, kernel)
        if keep is not None:
            self.past = [keep] + self.past[: p - 2]
        return out

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"outputs": list(self.past)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        return {"outputs": [t - 1 - j for j in range(min(t, self.spec.num_bands - 1))]}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.past = self._restore(state["outputs"])


class BltNoise(Structure):
    """C^{-1} as a BLT: x_t = z_t + sum_i w_i buf_i ; buf_i <- d_i buf_i + z_t, where
    C^{-1} has coefficients 1, sum_i w_i d_i^(t-1) (McMahan et al. 2024, arXiv 2408.08868, Alg. 2).
    One fused pass over z and the m buffers."""

    def __init__(self, draws: Draws, spec: Blt, regenerate: bool = False) -> None:
        super().__init__(draws)
        self.decay = [float(x) for x in spec.decay]
        self.scale = [float(x) for x in spec.scale]
        self.buffers = [self._empty().zero_() for _ in self.decay]
        self.z: torch.Tensor | None = None

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        if self.z is None:
            self.z = self._empty()
        z, buffers, scale, decay = self.z, self.buffers, self.scale, self.decay

        def kernel(a: int, b: int) -> None:
            zs, piece = z[a:b], out[a:b]
            piece.copy_(zs)
            for w, buf in zip(scale, buffers):
                piece.add_(buf[a:b], alpha=w)
            for d, buf in zip(decay, buffers):
                buf[a:b].mul_(d).add_(zs)

        self.draws.run(row, self.z, kernel)
        return out

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"buffers": list(self.buffers)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        return {"buffers": [None] * len(self.buffers)}  # every buffer is updated every round

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.buffers = self._restore(state["buffers"])


class TreeNoise(Structure):
    """Online Honaker estimates (fedmf.mechanisms.tree): a stack of node estimates. An estimate
    is written only in the round that completes its node and is never modified while on the
    stack (a merge pops it first)."""

    def __init__(self, draws: Draws, spec: Tree, regenerate: bool = False) -> None:
        super().__init__(draws)
        self.alpha = [float(a) for a in spec.alpha]
        self.stack: list[torch.Tensor] = []

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        height = tree_fresh_rows(t) - 1
        estimate = self.draws.new(row)
        removed = None
        for h in range(1, height + 1):
            left = self.stack.pop()
            removed = left if removed is None else removed.add_(left)
            estimate.add_(left).mul_(1 - self.alpha[h]).add_(self.draws.new(row + h), alpha=self.alpha[h])
        self.stack.append(estimate)
        return out.copy_(estimate) if removed is None else torch.sub(estimate, removed, out=out)

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"stack": list(self.stack)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        # after t rounds the stack holds the dyadic blocks of [0, t), largest first (one per set
        # bit of t); the block ending at e (exclusive) was completed by round e - 1
        labels, end = [], 0
        for bit in reversed(range(t.bit_length())):
            if t >> bit & 1:
                end += 1 << bit
                labels.append(end - 1)
        return {"stack": labels}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.stack = self._restore(state["stack"])


class DenseNoise(Structure):
    """w_t = sum_{s<=t} L[t, s] z_s with every past draw regenerated: O(d) memory, O(t·d) time."""

    def __init__(self, draws: Draws, spec: Dense, regenerate: bool = False) -> None:
        super().__init__(draws)
        self.inverse = spec.inverse

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        scratch = torch.empty_like(out)
        for s in np.flatnonzero(self.inverse[t]):
            out.add_(self.draws.fill(int(s), scratch), alpha=float(self.inverse[t, s]))
        return out


#: the torch interpreter of each description type (fedmf.mechanisms.streaming has the numpy ones)
INTERPRETERS: dict[type[StreamingInverse], type[Structure]] = {
    Fir: FirNoise, Iir: IirNoise, Blt: BltNoise, Tree: TreeNoise, Dense: DenseNoise,
}


def structure(spec: StreamingInverse, draws: Draws, regenerate: bool) -> Structure:
    """The interpreter of ``spec``, chosen by the description's type."""
    try:
        make = INTERPRETERS[type(spec)]
    except KeyError:
        raise TypeError(f"no noise interpreter for {type(spec).__name__}") from None
    return make(draws, spec, regenerate)
