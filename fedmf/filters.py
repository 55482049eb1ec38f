"""Products and solves with lower-triangular Toeplitz matrices, along axis 0.

T(t) denotes the lower-triangular Toeplitz matrix with T[i, j] = t_{i-j}. Multiplying by
T(t) is a causal FIR filter; solving T(a) y = x (a banded) is the IIR recursion
y_i = (x_i - sum_{j>=1} a_j y_{i-j}) / a_0 ("Scaling up BandMF", Alg. 1). The solve runs
in blocks: inside a block of L rows the recursion equals a product with the block's
impulse response, so the cost is O(n·L) in numpy instead of n Python steps.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError

__all__ = ["toeplitz_multiply", "toeplitz_solve", "series_inverse", "lower_toeplitz"]


def lower_toeplitz(coefficients: np.ndarray, size: int) -> np.ndarray:
    """Dense size x size T(t) (coefficients beyond the array are 0)."""
    t = np.zeros(size)
    c = np.asarray(coefficients, dtype=np.float64)[:size]
    t[: c.size] = c
    idx = np.arange(size)
    diff = idx[:, None] - idx[None, :]
    return np.where(diff >= 0, t[np.clip(diff, 0, size - 1)], 0.0)


def toeplitz_multiply(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    """T(t) @ x along axis 0 (x of shape (n,) or (n, ...))."""
    t = np.asarray(coefficients, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    if x.ndim == 1 and t.size > 32:
        return np.convolve(t[:n], x)[:n]
    out = np.zeros_like(x)
    for j, tj in enumerate(t[:n]):
        if tj:
            out[j:] += tj * x[: n - j]
    return out


def _impulse_response(a: np.ndarray, length: int) -> np.ndarray:
    q = a.size - 1
    h = np.zeros(length)
    h[0] = 1.0 / a[0]
    for i in range(1, length):
        m = min(i, q)
        h[i] = -np.dot(a[1 : m + 1], h[i - 1 :: -1][:m]) / a[0]
    return h


def toeplitz_solve(coefficients: np.ndarray, x: np.ndarray, block: int = 128) -> np.ndarray:
    """Solve T(a) y = x along axis 0 for a banded a with a_0 != 0."""
    a = np.trim_zeros(np.asarray(coefficients, dtype=np.float64), "b")
    if a.size == 0 or a[0] == 0.0:
        raise ConfigError("a lower-triangular Toeplitz matrix with zero diagonal is not invertible")
    x = np.asarray(x, dtype=np.float64)
    q = a.size - 1
    if q == 0:
        return x / a[0]
    n = x.shape[0]
    size = max(block, q)
    h = lower_toeplitz(_impulse_response(a, size), size)
    # R[i, m] = a_{i+q-m} (m >= i): the carry of the previous q outputs into a block's first q rows
    i, m = np.arange(q)[:, None], np.arange(q)[None, :]
    carry = np.where(m >= i, a[np.clip(i + q - m, 0, q)], 0.0)
    tail = x.shape[1:]
    padded = np.zeros((q + n,) + tail)  # y with q leading zeros
    y = padded[q:]
    for s in range(0, n, size):
        e = min(s + size, n)
        rhs = x[s:e].copy()
        r = np.tensordot(carry, padded[s : s + q], axes=1)
        rhs[: min(q, e - s)] -= r[: e - s]
        y[s:e] = np.tensordot(h[: e - s, : e - s], rhs, axes=1)
    return y


def series_inverse(coefficients: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of 1 / sum_j t_j x^j, i.e. of T(t)^{-1} ("Beyond Square Roots", Eq. 41)."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return toeplitz_solve(coefficients, impulse)
