"""Property tests for fedmf.filters (lower-triangular Toeplitz products and solves) and
fedmf.workloads (the workload matrix A, its fast paths and its parser), against dense
numpy linear algebra and the explicit formulas."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.linalg import solve_triangular

from fedmf.filters import lower_toeplitz, series_inverse, toeplitz_multiply, toeplitz_solve
from fedmf.workloads import Workload, WorkloadStream, parse_workload

# reproducible in CI: no randomness across runs, no timing-based failures
SETTINGS = settings(
    derandomize=True, database=None, deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)

SIZES = st.sampled_from([1, 2, 3, 7, 16, 127, 128, 129, 200, 300])


def dense_lower_toeplitz(t: np.ndarray, n: int) -> np.ndarray:
    """T[i, j] = t_{i-j} for i >= j, as a sum of shifted identities (independent of
    fedmf.filters.lower_toeplitz)."""
    out = np.zeros((n, n))
    for d, value in enumerate(np.asarray(t, dtype=np.float64)[:n]):
        out += value * np.eye(n, k=-d)
    return out


def stable_coefficients(rng: np.random.Generator, q: int) -> np.ndarray:
    """a_0 in [1, 2], sum_{j>=1} |a_j| < a_0: T(a) is well conditioned for any n."""
    a = np.zeros(q + 1)
    a[0] = rng.uniform(1.0, 2.0)
    if q:
        a[1:] = rng.uniform(-1.0, 1.0, q)
        a[1:] *= 0.9 * a[0] / max(np.abs(a[1:]).sum(), 1e-300)
    return a


def workload_dense(w: Workload, n: int) -> np.ndarray:
    """A[i, j] = sum_{s=j}^{i} lr_s beta^(s-j) by the formula, with the lr schedule written out."""
    lr = np.ones(n)
    c = int(np.floor(w.cooldown * n))
    if c > 0:
        lr[n - c :] = np.linspace(1.0, w.cooldown_final, c)
    a = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            a[i, j] = sum(lr[s] * w.momentum ** (s - j) for s in range(j, i + 1))
    return a


WORKLOADS = st.sampled_from(
    [
        Workload(),
        Workload(0.9),
        Workload(0.95),
        Workload(0.9, 0.25),
        Workload(0.95, 0.25),
        Workload(0.0, 0.5),
        Workload(0.5, 1.0, 0.1),
        Workload(0.99, 0.1, 1.0),
    ]
)


# ---------------------------------------------------------------------------------------
# filters
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 40), length=st.integers(1, 50))
def test_lower_toeplitz_matches_definition(seed, size, length):
    t = np.random.default_rng(seed).normal(size=length)
    np.testing.assert_array_equal(lower_toeplitz(t, size), dense_lower_toeplitz(t, size))


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=SIZES,
    q=st.sampled_from([0, 1, 2, 5, 31, 127, 128, 129, 250]),
    shape=st.sampled_from([(), (3,), (2, 2)]),
    block=st.sampled_from([1, 2, 7, 128]),
)
def test_toeplitz_solve_matches_dense_solve(seed, n, q, shape, block):
    rng = np.random.default_rng(seed)
    a = stable_coefficients(rng, q)
    x = rng.normal(size=(n,) + shape)
    y = toeplitz_solve(a, x, block=block)
    assert y.shape == x.shape
    t = dense_lower_toeplitz(a, n)
    expected = solve_triangular(t, x.reshape(n, -1), lower=True).reshape(x.shape)
    np.testing.assert_allclose(y, expected, rtol=1e-9, atol=1e-10)
    # and it really solves the system
    np.testing.assert_allclose(np.tensordot(t, y, axes=1), x, rtol=1e-9, atol=1e-10)


def test_toeplitz_solve_with_long_band_and_default_block():
    rng = np.random.default_rng(7)
    for n, q in [(1, 0), (1, 300), (128, 200), (129, 128), (400, 300), (300, 129)]:
        a = stable_coefficients(rng, q)
        x = rng.normal(size=(n, 3))
        expected = solve_triangular(dense_lower_toeplitz(a, n), x, lower=True)
        np.testing.assert_allclose(toeplitz_solve(a, x), expected, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(toeplitz_solve(a, x[:, 0]), expected[:, 0], rtol=1e-9, atol=1e-10)


def test_toeplitz_solve_ignores_trailing_zeros_and_rejects_zero_diagonal():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 2))
    a = np.array([1.5, -0.3, 0.2])
    padded = np.concatenate([a, np.zeros(200)])
    np.testing.assert_allclose(toeplitz_solve(padded, x), toeplitz_solve(a, x), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(toeplitz_solve([2.0], x), x / 2.0)
    for bad in ([0.0, 1.0], [0.0], [], [0.0, 0.0]):
        with pytest.raises(ValueError):
            toeplitz_solve(bad, x)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=SIZES,
    length=st.sampled_from([1, 2, 5, 32, 33, 64, 129, 400]),
    shape=st.sampled_from([(), (3,), (2, 2)]),
)
def test_toeplitz_multiply_matches_dense(seed, n, length, shape):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=length)
    x = rng.normal(size=(n,) + shape)
    y = toeplitz_multiply(t, x)
    assert y.shape == x.shape
    expected = np.tensordot(dense_lower_toeplitz(t, n), x, axes=1)
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=SIZES, q=st.sampled_from([0, 1, 3, 64, 130]))
def test_series_inverse_is_the_first_column_of_the_inverse(seed, n, q):
    rng = np.random.default_rng(seed)
    a = stable_coefficients(rng, q)
    inv = series_inverse(a, n)
    assert inv.shape == (n,)
    expected = solve_triangular(dense_lower_toeplitz(a, n), np.eye(n)[:, 0], lower=True)
    np.testing.assert_allclose(inv, expected, rtol=1e-9, atol=1e-11)
    # T(a) T(inv) = I (the inverse of a lower-triangular Toeplitz matrix is Toeplitz)
    prod = dense_lower_toeplitz(a, n) @ dense_lower_toeplitz(inv, n)
    np.testing.assert_allclose(prod, np.eye(n), atol=1e-9)


def test_series_inverse_known_closed_forms():
    n = 300
    np.testing.assert_allclose(series_inverse([1.0, -1.0], n), np.ones(n), atol=1e-12)  # 1/(1-x)
    beta = 0.9
    np.testing.assert_allclose(series_inverse([1.0, -beta], n), beta ** np.arange(n), rtol=1e-10, atol=1e-15)
    # 1/(1-x)^2 = sum (j+1) x^j
    np.testing.assert_allclose(series_inverse([1.0, -2.0, 1.0], n), np.arange(1, n + 1), rtol=1e-10)


# ---------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(w=WORKLOADS, n=st.integers(1, 30))
def test_workload_matrix_matches_formula(w, n):
    a = w.matrix(n)
    np.testing.assert_allclose(a, workload_dense(w, n), rtol=1e-12, atol=1e-12)
    assert np.all(np.triu(a, 1) == 0)


@SETTINGS
@given(beta=st.floats(0.0, 0.99), n=st.integers(1, 30))
def test_workload_matrix_random_momentum(beta, n):
    w = Workload(beta)
    np.testing.assert_allclose(w.matrix(n), workload_dense(w, n), rtol=1e-11, atol=1e-11)


def test_learning_rates_cooldown_schedule():
    lr = Workload(0.95, 0.25).learning_rates(12)
    np.testing.assert_allclose(lr, [1.0] * 9 + [1.0, 0.525, 0.05], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(Workload(0.9).learning_rates(5), np.ones(5))
    # floor(0.25 * 3) = 0 rounds of cooldown
    np.testing.assert_array_equal(Workload(0.9, 0.25).learning_rates(3), np.ones(3))
    np.testing.assert_allclose(Workload(0.0, 1.0, 0.1).learning_rates(4), np.linspace(1, 0.1, 4))


def test_prefix_workload_is_lower_triangular_ones():
    np.testing.assert_array_equal(Workload().matrix(6), np.tril(np.ones((6, 6))))
    assert Workload().is_prefix and Workload.prefix() == Workload()
    assert not Workload(0.9).is_prefix and not Workload(0.0, 0.25).is_prefix


@SETTINGS
@given(w=WORKLOADS, seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), shape=st.sampled_from([(), (2,), (3, 2)]))
def test_apply_matches_dense(w, seed, n, shape):
    rows = np.random.default_rng(seed).normal(size=(n,) + shape)
    expected = np.tensordot(workload_dense(w, n), rows, axes=1)
    np.testing.assert_allclose(w.apply(rows), expected, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(beta=st.sampled_from([0.0, 0.5, 0.9, 0.95]), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40),
       length=st.integers(1, 45))
def test_apply_toeplitz_is_first_column_of_a_times_t(beta, seed, n, length):
    w = Workload(beta)
    t = np.zeros(n)
    coef = np.random.default_rng(seed).normal(size=length)[:n]
    t[: coef.size] = coef
    out = w.apply_toeplitz(t)
    dense = workload_dense(w, n) @ dense_lower_toeplitz(t, n)
    np.testing.assert_allclose(out, dense[:, 0], rtol=1e-10, atol=1e-10)
    # A·T is Toeplitz again (both are), so the first column determines it
    np.testing.assert_allclose(dense_lower_toeplitz(out, n), dense, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(beta=st.floats(0.0, 0.99), n=st.integers(1, 50))
def test_toeplitz_coefficients_closed_form(beta, n):
    w = Workload(beta)
    j = np.arange(n)
    expected = (1 - beta ** (j + 1)) / (1 - beta) if beta else np.ones(n)
    np.testing.assert_allclose(w.toeplitz_coefficients(n), expected, rtol=1e-11)
    np.testing.assert_allclose(w.toeplitz_coefficients(n), w.matrix(n)[:, 0], rtol=1e-11)


def test_toeplitz_coefficients_rejects_cooldown():
    assert not Workload(0.9, 0.25).is_toeplitz and Workload(0.9).is_toeplitz
    with pytest.raises(ValueError):
        Workload(0.9, 0.25).toeplitz_coefficients(10)


@SETTINGS
@given(
    w=WORKLOADS,
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    length=st.integers(1, 45),
    block=st.sampled_from([1, 2, 3, 5, 16, 512]),
)
def test_toeplitz_row_norms_sq_matches_dense(w, seed, n, length, block):
    t = np.zeros(n)
    coef = np.random.default_rng(seed).normal(size=length)[:n]
    t[: coef.size] = coef
    dense = workload_dense(w, n) @ dense_lower_toeplitz(t, n)
    expected = np.sum(dense**2, axis=1)
    out = w.toeplitz_row_norms_sq(t, block=block)
    assert out.shape == (n,)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10)


def test_toeplitz_row_norms_sq_larger_than_block():
    rng = np.random.default_rng(11)
    n = 300
    t = rng.normal(size=n) / np.arange(1, n + 1)
    for w in (Workload(0.9, 0.25), Workload(0.0, 0.5, 0.2)):
        expected = np.sum((w.matrix(n) @ dense_lower_toeplitz(t, n)) ** 2, axis=1)
        for block in (7, 128, 512):
            np.testing.assert_allclose(w.toeplitz_row_norms_sq(t, block=block), expected, rtol=1e-9)


@SETTINGS
@given(w=WORKLOADS, seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30), width=st.integers(1, 4))
def test_workload_stream_matches_dense(w, seed, n, width):
    m = np.random.default_rng(seed).normal(size=(n, width))
    expected = workload_dense(w, n) @ m
    stream = WorkloadStream(w, width, n)
    for t in range(n):
        row = np.array(stream.step(m[t]), copy=True)  # copy: see the aliasing test below
        np.testing.assert_allclose(row, expected[t], rtol=1e-10, atol=1e-10)


def test_workload_stream_rows_are_not_overwritten_by_later_steps():
    n, width = 4, 2
    m = np.arange(n * width, dtype=float).reshape(n, width) + 1.0
    stream = WorkloadStream(Workload(), width, n)
    rows = [stream.step(m[t]) for t in range(n)]
    np.testing.assert_allclose(np.array(rows), np.cumsum(m, axis=0))


# ---------------------------------------------------------------------------------------
# parse_workload, validation, round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("prefix", Workload()),
        ("  prefix ", Workload()),
        ("momentum:0.9", Workload(0.9)),
        ("momentum:0.95", Workload(0.95)),
        ("momentum:0", Workload(0.0)),
        ("momentum:0.9:cooldown=0.25", Workload(0.9, 0.25)),
        ("momentum:0.9:cooldown=0.25:final=0.1", Workload(0.9, 0.25, 0.1)),
        ("momentum:0.9:final=0.1:cooldown=0.25", Workload(0.9, 0.25, 0.1)),
    ],
)
def test_parse_workload_accepts(text, expected):
    w = parse_workload(text)
    assert w == expected
    assert isinstance(w.momentum, float)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "junk",
        "Prefix",
        "prefix:0.9",
        "momentum",
        "momentum:",
        "momentum:abc",
        "momentum:1.0",
        "momentum:1.5",
        "momentum:-0.1",
        "momentum:nan",
        "momentum:inf",
        "momentum:0.9:cooldown=abc",
        "momentum:0.9:cooldown=1.5",
        "momentum:0.9:cooldown=-0.1",
        "momentum:0.9:cooldown=0.25:final=0",
        "momentum:0.9:cooldown=0.25:final=2",
        "momentum:0.9:foo=1",
        "momentum:0.9:cooldown=0.25:cooldown=0.5",
        "sgd:0.9",
    ],
)
def test_parse_workload_rejects(text):
    with pytest.raises(ValueError):
        parse_workload(text)


@pytest.mark.parametrize(
    "w", [Workload(), Workload(0.9), Workload(0.95, 0.25), Workload(0.9, 0.25, 0.1), Workload(0.5, 1.0, 1.0)]
)
def test_name_and_dict_round_trip(w):
    assert parse_workload(w.name) == w
    assert Workload.from_dict(w.to_dict()) == w


@pytest.mark.parametrize(
    "kwargs", [dict(momentum=1.0), dict(momentum=-0.1), dict(cooldown=1.1), dict(cooldown=-0.5),
               dict(cooldown=0.25, cooldown_final=0.0), dict(cooldown=0.25, cooldown_final=1.5)]
)
def test_workload_validation(kwargs):
    with pytest.raises(ValueError):
        Workload(**kwargs)
