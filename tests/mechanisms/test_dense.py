"""The dense (optimal multi-epoch) mechanism: reference losses, feasibility, duality, structure."""

from __future__ import annotations

import itertools
import json
import math
from functools import cache

import numpy as np
import pytest
import torch

from fedmf.mechanisms.dense import DenseMechanism, corner_signs
from fedmf.mechanisms.dense_optimize import optimize_dense
from fedmf.participation import FixedEpoch, MinSep
from fedmf.sensitivity import fixed_epoch
from fedmf.workloads import Workload
from tests.reference import case_id, check, load_cases

DENSE_CASES = [c for c in load_cases("mechanisms.json") if c["kind"] == "dense"]
MOMENTUM = Workload(0.95, 0.25)
TIGHT = 1e-7


@cache
def solve(n: int, k: int, workload: Workload = Workload(), tolerance: float = TIGHT):
    return optimize_dense(n, FixedEpoch(k, n // k), workload, tolerance=tolerance, device="cpu")


def brute_force_sens_sq(c: np.ndarray, k: int, b: int) -> float:
    """max over patterns and sign vectors of ||C u||^2 (scalar sensitivity, Multi-Epoch MF Sec. 3.2)."""
    best = 0.0
    for j in range(b):
        cols = c[:, [j + e * b for e in range(k)]]
        for signs in itertools.product((1.0, -1.0), repeat=k):
            best = max(best, float(np.sum((cols @ np.array(signs)) ** 2)))
    return best


# ---- reference values ---------------------------------------------------------------------
@pytest.mark.parametrize("case", DENSE_CASES, ids=[case_id(c) for c in DENSE_CASES])
def test_reference_loss(case):
    n, k, b = case["rounds"], case["max_participations"], case["min_sep"]
    assert case["schema"] == "fixed-epoch" and case["metric"] == "loss"
    mech, result = solve(n, k)
    assert result.converged
    check(mech.evaluate(FixedEpoch(k, b))["loss"], case)


# total losses tr(A^T A X^-1) at the optimum (notes on Multi-Epoch MF, Sec. 10.5)
NOTE_TOTALS = [
    (2, 1, Workload(), (3 + math.sqrt(5)) / 2),
    (3, 1, Workload(), 4.607862),
    (4, 1, Workload(), 6.874144),
    (8, 1, Workload(), 17.866177),
    (16, 1, Workload(), 45.665357),
    (6, 3, Workload(), 41.743033),
    (8, 2, Workload(), 36.873868),
    (12, 3, Workload(), 102.51211),
    (12, 4, Workload(), 149.69843),
    (12, 1, MOMENTUM, 456.580436),
    (16, 2, MOMENTUM, 1693.853),
    (12, 3, MOMENTUM, 1336.1637),
]


@pytest.mark.parametrize("n,k,workload,total", NOTE_TOTALS)
def test_dual_optimum_matches_note(n, k, workload, total):
    mech, result = solve(n, k, workload)
    digits = 10 ** -(len(repr(total).split(".")[1]) if "." in repr(total) else 0)
    for value in (result.details["primal_value"] * n, result.details["dual_value"] * n, mech.primal_value):
        assert abs(value - total) <= max(digits, 2e-7 * total), (value, total)


@pytest.mark.parametrize("n,k", [(12, 1), (16, 2)])
def test_momentum_loss_via_evaluate(n, k):
    """k <= 2: fedmf's sensitivity is exact for any sign pattern, so evaluate gives the optimum."""
    mech, result = solve(n, k, MOMENTUM)
    loss = mech.evaluate(FixedEpoch(k, n // k))["loss"]
    assert loss == pytest.approx(result.details["primal_value"], rel=1e-9)


def test_momentum_k3_vector_sensitivity_is_not_below_scalar():
    """For momentum with k = 3 the scalar-optimal X has negative same-pattern entries, so the
    vector-valued sensitivity may exceed the scalar one (notes Sec. 3.2): evaluate >= primal."""
    mech, result = solve(12, 3, MOMENTUM)
    assert brute_force_sens_sq(mech.strategy_matrix(), 3, 4) == pytest.approx(1.0, abs=1e-9)
    assert mech.evaluate(FixedEpoch(3, 4))["loss"] >= result.details["primal_value"] * (1 - 1e-12)


# ---- structure of the mechanism -----------------------------------------------------------
@pytest.mark.parametrize("n,k,workload", [(8, 2, Workload()), (12, 3, Workload()), (12, 4, Workload()), (16, 2, MOMENTUM)])
def test_feasible_triangular_and_inverse(n, k, workload):
    mech, _ = solve(n, k, workload)
    b = n // k
    c = mech.strategy_matrix()
    assert np.array_equal(np.triu(c, 1), np.zeros_like(c))
    assert np.all(np.diag(c) > 0)
    np.testing.assert_allclose(c.T @ c, mech.gram_matrix, rtol=0, atol=1e-12 * np.abs(c).max() ** 2)
    assert brute_force_sens_sq(c, k, b) == pytest.approx(1.0, abs=1e-9)
    sens = fixed_epoch(mech, FixedEpoch(k, b))
    if sens.exact:
        assert sens.value == pytest.approx(1.0, abs=1e-9)
    else:  # k >= 3 with tiny negative same-pattern entries: fedmf's vector-safe bound
        assert 1.0 - 1e-9 <= sens.value <= 1.0 + 1e-6
    inverse = mech.inverse_matrix()
    np.testing.assert_allclose(inverse @ c, np.eye(n), atol=1e-9)
    np.testing.assert_allclose(np.array(list(mech.inverse_rows())), inverse, atol=1e-9)


@pytest.mark.parametrize("n,k,workload", [(12, 3, Workload()), (16, 2, MOMENTUM)])
def test_loss_is_trace_formula(n, k, workload):
    """evaluate's loss = tr(A^T A X^-1)/n with sens normalized to 1 (Multi-Epoch MF, Eq. 6)."""
    mech, _ = solve(n, k, workload)
    a = workload.matrix(n)
    direct = float(np.trace(a.T @ a @ np.linalg.inv(mech.gram_matrix))) / n
    assert mech.evaluate(FixedEpoch(k, n // k))["loss"] == pytest.approx(direct, rel=1e-9)
    assert mech.primal_value / n == pytest.approx(direct, rel=1e-9)


def test_inverse_stream_on_vectors():
    mech, _ = solve(8, 2)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((8, 3, 2))
    stream = mech.inverse_stream()
    out = np.array([stream.step(z[t : t + 1]) for t in range(8)])
    np.testing.assert_allclose(out, np.einsum("ts,sij->tij", mech.inverse_matrix(), z), atol=1e-12)
    with pytest.raises(ValueError, match="past the end"):
        stream.step(z[:1])


# ---- duality gap and optimizer reporting --------------------------------------------------
@pytest.mark.parametrize("tolerance", [1e-3, 1e-6])
@pytest.mark.parametrize("n,k,workload", [(12, 3, Workload()), (12, 4, Workload()), (12, 3, MOMENTUM)])
def test_duality_gap(n, k, workload, tolerance):
    mech, result = solve(n, k, workload, tolerance)
    d = result.details
    assert result.converged
    assert d["relative_duality_gap"] >= 0 and d["duality_gap"] >= 0
    assert d["relative_duality_gap"] <= tolerance
    assert d["primal_value"] >= d["dual_value"]
    assert d["duality_gap"] == pytest.approx(d["primal_value"] - d["dual_value"], rel=1e-9)
    assert result.objective == d["primal_value"]
    assert mech.primal_value / n == pytest.approx(d["primal_value"], rel=1e-12)
    assert mech.dual_value <= mech.primal_value


def test_not_converged_is_reported():
    mech, result = optimize_dense(12, FixedEpoch(4, 3), tolerance=1e-12, max_steps=3, device="cpu")
    assert not result.converged and result.steps == 3
    assert result.details["relative_duality_gap"] > 1e-12
    assert fixed_epoch(mech, FixedEpoch(4, 3)).value == pytest.approx(1.0, abs=1e-9)


def test_progress_updates():
    steps: list = []
    _, result = optimize_dense(12, FixedEpoch(3, 4), tolerance=1e-6, device="cpu", progress=steps.append)
    done = [s.done for s in steps]
    assert done == sorted(done) and done[-1] == result.steps
    assert steps[-1].final and steps[-1].converged is result.converged
    assert steps[-1].objective == pytest.approx(result.objective)
    # the convergence measure is the relative duality gap, against the tolerance it stops at
    assert all(s.tolerance == 1e-6 and s.total == 10000 for s in steps[:-1])
    assert steps[-1].measure == pytest.approx(result.details["relative_duality_gap"]) and steps[-1].measure <= 1e-6
    assert all(s.measure > 1e-6 for s in steps[:-2])  # it reports each step before it stops at the tolerance


# ---- description, determinism -------------------------------------------------------------
def test_params_round_trip_and_determinism():
    mech, _ = solve(12, 3)
    params = mech.params()
    text = json.dumps(params)
    assert len(text) < 2000 and set(params) == {"max_participations", "min_sep", "duals"}
    again = DenseMechanism.from_params(12, Workload(), json.loads(text))
    assert np.array_equal(again.duals, mech.duals)
    assert np.array_equal(again.strategy_matrix(), mech.strategy_matrix())
    other, _ = optimize_dense(12, FixedEpoch(3, 4), tolerance=TIGHT, device="cpu")
    assert np.array_equal(other.duals, mech.duals)
    assert np.array_equal(other.strategy_matrix(), mech.strategy_matrix())


def test_corner_signs():
    s = corner_signs(3)
    assert s.shape == (4, 3) and np.all(s[:, 0] == 1)
    assert len({tuple(r) for r in s} | {tuple(-r) for r in s}) == 8


# ---- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rounds,schema,match",
    [
        (12, FixedEpoch(3, 5), "rounds = k x b"),
        (12, MinSep(4, 3), "FixedEpoch"),
        (0, FixedEpoch(3, 4), "rounds"),
    ],
)
def test_bad_input(rounds, schema, match):
    with pytest.raises(ValueError, match=match):
        optimize_dense(rounds, schema)


@pytest.mark.parametrize(
    "duals,match",
    [
        (np.ones((4, 2)), "shape"),
        (-np.ones((4, 4)), "non-negative"),
        (np.full((4, 4), np.nan), "finite"),
        (np.array([[1.0, 0, 0, 0]] * 4), "span"),
    ],
)
def test_bad_duals(duals, match):
    with pytest.raises(ValueError, match=match):
        DenseMechanism(12, 3, 4, duals)


def test_bad_options():
    with pytest.raises(ValueError, match="tolerance"):
        optimize_dense(4, FixedEpoch(1, 4), tolerance=0.0)
    with pytest.raises(ValueError, match="max_steps"):
        optimize_dense(4, FixedEpoch(1, 4), max_steps=0)


@pytest.mark.heavy
@pytest.mark.parametrize("n,k,workload", [(342, 6, Workload()), (120, 6, MOMENTUM), (128, 2, MOMENTUM)])
def test_larger_cases_converge(n, k, workload):
    """Default tolerance on larger geometries (a minute or more on 2 CPU cores)."""
    mech, result = optimize_dense(n, FixedEpoch(k, n // k), workload, device="cpu")
    assert result.converged and 0 <= result.details["relative_duality_gap"] <= 1e-3
    assert brute_force_sens_sq(mech.strategy_matrix(), k, n // k) == pytest.approx(1.0, abs=1e-9)
    loss = mech.evaluate(FixedEpoch(k, n // k))["loss"]
    assert result.details["primal_value"] * (1 - 1e-12) <= loss


# ---- many participations (k > 12): the block dual (PSD pattern blocks, constant diagonal) ----
# jax_privacy 2.0.0 dense.optimize(n, epochs=k, A=workload) (orthogonality-masked primal, the same
# problem as the block dual), its C evaluated by fedmf (loss with fedmf's exact sensitivity):
# benchmarks/mechanisms.py --kinds dense-many, 2026-11-24
JAX_LOSS = {
    (64, 16, Workload()): 146.15076681484962,
    (64, 16, MOMENTUM): 15497.829907238165,
    (128, 32, Workload()): 527.8238641899545,
    (128, 32, MOMENTUM): 96598.2748578192,
}


def _trace_lower_bound(n: int, b: int, workload: Workload = Workload()) -> float:
    """Any feasible X has tr X <= b: averaging u^T X_pi u <= 1 over the sign vectors gives
    tr X_pi <= 1 per pattern. min tr(A^T A X^-1) s.t. tr X <= b is (sum sigma_i(A))^2 / b, so the
    loss (total / n) is at least that / n."""
    return float(np.linalg.svd(workload.matrix(n), compute_uv=False).sum() ** 2) / (b * n)


def _best_closed_form(n: int, k: int) -> float:
    from fedmf.mechanisms import build

    schema = FixedEpoch(k, n // k)
    losses = []
    for kind in ("bsr", "bisr", "bifr"):
        report = build(kind, n, schema).evaluate(schema)
        assert report["sensitivity_exact"]
        losses.append(report["loss"])
    return min(losses)


def _check_blocks(n: int, k: int, workload: Workload = Workload(), tolerance: float = 1e-3):
    b = n // k
    mech, result = optimize_dense(n, FixedEpoch(k, b), workload, tolerance=tolerance, device="cpu")
    d = result.details
    assert result.converged, result.message
    assert 0 <= d["relative_duality_gap"] <= tolerance
    assert d["dual_value"] <= d["primal_value"] == result.objective
    assert mech.duals.shape == (b, k, k) and d["sensitivity_exact"] is True
    report = mech.evaluate(FixedEpoch(k, b))
    # same-pattern columns of C are orthogonal and each pattern has trace 1: sens = 1, exact, any d
    assert report["sensitivity_exact"] and report["sensitivity"] == pytest.approx(1.0, abs=1e-9)
    x = mech.gram_matrix
    for j in range(b):
        block = x[np.ix_(range(j, n, b), range(j, n, b))]
        assert np.trace(block) == pytest.approx(1.0, abs=1e-12)
        assert np.abs(block - np.diag(np.diag(block))).max() == 0.0
    assert report["loss"] == pytest.approx(d["primal_value"], rel=1e-9)
    assert mech.primal_value / n == pytest.approx(d["primal_value"], rel=1e-12)
    # the dual bounds every factorization with this (any-dimension) sensitivity, jax's included
    assert _trace_lower_bound(n, b, workload) <= d["dual_value"]
    if (n, k, workload) in JAX_LOSS:
        jax_loss = JAX_LOSS[(n, k, workload)]
        assert d["dual_value"] <= jax_loss * (1 + 1e-12)
        assert report["loss"] <= jax_loss * (1 + tolerance)
    # the stored description rebuilds the same mechanism
    again = DenseMechanism.from_params(n, workload, json.loads(json.dumps(mech.params())))
    assert np.array_equal(again.duals, mech.duals)
    np.testing.assert_allclose(again.gram_matrix, mech.gram_matrix, rtol=1e-12, atol=1e-12)
    return mech, result, report


def test_many_participations_k16():
    mech, result, report = _check_blocks(64, 16)
    # n = 64, k = 16, b = 4 (prefix sums): trace bound 66.59, BSR 179.68, dense ~146.15
    assert 66.59 < result.details["dual_value"] <= report["loss"] < 146.3
    assert report["loss"] <= _best_closed_form(64, 16)


def test_many_participations_k32():
    mech, result, report = _check_blocks(128, 32)
    # n = 128, k = 32, b = 4 (prefix sums): trace bound 162.64, BSR 677.83, jax 527.824
    assert 162.63 < result.details["dual_value"] <= report["loss"] < 677.8


@pytest.mark.parametrize("n,k", [(64, 16), (128, 32)])
def test_many_participations_momentum(n, k):
    _check_blocks(n, k, MOMENTUM)


@pytest.mark.heavy
def test_many_participations_n2000_k20():
    """issue 14's large case: n = 2000, k = 20, b = 100 (30-170 s on 2 loaded CPU cores)."""
    _check_blocks(2000, 20)


# structured optimum (notes Sec. 5.5): equal to the +-1 corner optimum for prefix sums; for momentum
# the masked value 1338.7655 (the corner optimum 1336.1637 is scalar-only, d = 1)
BLOCK_TOTALS = [t for t in NOTE_TOTALS if t[2] == Workload() or t[1] <= 2] + [(12, 3, MOMENTUM, 1338.7655)]


@pytest.mark.parametrize("n,k,workload,total", BLOCK_TOTALS)
def test_block_dual_matches_note(n, k, workload, total):
    """The block dual also runs for small k; its optimum is the note's (orthogonality-masked) value."""
    from fedmf.mechanisms.dense_optimize import _optimize_blocks

    mech, result = _optimize_blocks(n, k, n // k, workload, TIGHT, 10000, torch.device("cpu"), None, 0.0)
    assert result.converged and mech.duals.shape == (n // k, k, k)
    digits = 10 ** -(len(repr(total).split(".")[1]) if "." in repr(total) else 0)
    for value in (result.details["primal_value"] * n, result.details["dual_value"] * n, mech.primal_value):
        assert abs(value - total) <= max(digits, 2e-7 * total), (value, total)


@pytest.mark.parametrize("k", [13, 14, 15, 16])
def test_block_sensitivity_is_the_exhaustive_maximum(k):
    """The certified sensitivity of a k > 12 mechanism equals the maximum of ||C u|| over all
    2^(k-1) sign vectors of every pattern (brute force), and the loss uses exactly that."""
    n, b = 2 * k, 2
    mech, result = optimize_dense(n, FixedEpoch(k, b), tolerance=1e-4, device="cpu")
    c = mech.strategy_matrix()
    signs = corner_signs(k)
    brute = max(float(np.max(np.sum((c[:, list(range(j, n, b))] @ signs.T) ** 2, axis=0))) for j in range(b))
    report = mech.evaluate(FixedEpoch(k, b))
    assert report["sensitivity_exact"] and result.details["sensitivity_exact"]
    assert report["sensitivity"] ** 2 == pytest.approx(brute, rel=1e-9)
    assert brute == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(
    "duals,match",
    [
        (np.ones((2, 4)), "shape"),
        (np.ones((2, 13, 12)), "shape"),
        (np.tile(np.diag(np.arange(1.0, 14.0)), (2, 1, 1)), "constant diagonal"),
        (np.tile(np.eye(13) + np.triu(np.full((13, 13), 0.1), 1), (2, 1, 1)), "symmetric"),
        (np.tile(np.ones((13, 13)), (2, 1, 1)), "positive definite"),
        (np.full((2, 13, 13), np.nan), "finite"),
    ],
)
def test_block_duals_validated(duals, match):
    with pytest.raises(ValueError, match=match):
        DenseMechanism(26, 13, 2, duals)


@pytest.mark.parametrize("workload", [Workload(), MOMENTUM], ids=["prefix", "momentum"])
def test_reported_sensitivity_is_an_upper_bound_of_the_exact_one_for_the_stored_c(workload):
    """The sensitivity that calibrates σ must not sit below the exact value for the float C the
    noise really uses, not even by an ulp: each pattern's block of CᵀC is diagonal, so for any
    update dimension sens² = max_j tr(X_j) — computed here exactly, in rationals, from C's floats."""
    from fractions import Fraction

    n, k, b = 64, 16, 4
    mech, _ = optimize_dense(n, FixedEpoch(k, b), workload, device="cpu")
    c = mech.strategy_matrix()
    reported = fixed_epoch(mech, FixedEpoch(k, b)).value
    exact_sq = max(sum(Fraction(float(v)) ** 2 for v in c[:, list(range(j, n, b))].ravel()) for j in range(b))
    assert Fraction(reported) ** 2 >= exact_sq
    assert float(Fraction(reported) ** 2 - exact_sq) < 1e-12  # and only rounding above it
