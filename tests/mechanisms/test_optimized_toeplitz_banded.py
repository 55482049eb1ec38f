"""banded-toeplitz, banded (BandMF) and robust: objectives, gradients, optima, guarantees."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedmf.cli import main
from fedmf.filters import lower_toeplitz
from fedmf.mechanisms import plan
from fedmf.mechanisms.banded import BandedObjective, ColumnNormalizedBanded, optimize_banded
from fedmf.mechanisms.banded_toeplitz import ToeplitzObjective, optimize_banded_toeplitz
from fedmf.mechanisms.io import load, save
from fedmf.mechanisms.robust import optimize_robust, rmse_by_min_sep, separation_grid, taper
from fedmf.mechanisms.toeplitz import BandedSquareRoot, BandedToeplitz
from fedmf.participation import MinSep
from fedmf.sensitivity import exhaustive_minsep
from fedmf.workloads import Workload

WORKLOADS = [Workload(), Workload(0.9)]


def _finite_difference(f, x, eps=1e-6):
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        out[idx] = (f(x + e) - f(x - e)) / (2 * eps)
    return out


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
@pytest.mark.parametrize("error", ["mean", "max"])
def test_toeplitz_objective_matches_dense_and_gradient(workload, error):
    n, b, k = 40, 6, 5
    theta = np.array([1.0, 0.7, -0.2, 0.4, 0.1])
    objective = ToeplitzObjective(n, workload, b, k, error)
    loss, grad = objective(theta)
    c = lower_toeplitz(theta, n)
    rows = np.sum((workload.matrix(n) @ np.linalg.inv(c)) ** 2, axis=1)
    err = rows.mean() if error == "mean" else rows.max()
    sens2 = BandedToeplitz(n, theta).sensitivity(MinSep(b, k)).value ** 2
    assert loss == pytest.approx(err * sens2, rel=1e-10)
    np.testing.assert_allclose(grad, _finite_difference(lambda t: objective(t)[0], theta), rtol=1e-5, atol=1e-6)


def test_toeplitz_objective_rejects_cooldown():
    with pytest.raises(ValueError, match="Toeplitz workload"):
        ToeplitzObjective(10, Workload(0.9, 0.25), 2, 3)


@pytest.mark.parametrize("n,k,b,p", [(64, 4, 16, 16), (100, 2, 50, 8)])
def test_banded_toeplitz_beats_bsr_and_is_deterministic(n, k, b, p):
    schema = MinSep(b, k)
    first, result = optimize_banded_toeplitz(n, p, schema)
    second, _ = optimize_banded_toeplitz(n, p, schema)
    assert result.converged
    np.testing.assert_array_equal(first.coefficients, second.coefficients)
    assert first.rmse(schema) <= BandedSquareRoot(n, p).rmse(schema) * (1 + 1e-12)
    # the optimum is a stationary point: no coordinate direction improves it
    objective = ToeplitzObjective(n, Workload(), b, k)
    base = objective(first.coefficients)[0]
    for i in range(p):
        for step in (1e-4, -1e-4):
            t = first.coefficients.copy()
            t[i] += step
            assert objective(t)[0] >= base * (1 - 1e-9)


def test_banded_toeplitz_refuses_more_bands_than_min_sep():
    with pytest.raises(ValueError, match="p <= min_sep"):
        optimize_banded_toeplitz(100, 20, MinSep(10, 5))


def test_banded_objective_matches_dense_and_gradient():
    rng = np.random.default_rng(3)
    for workload in (Workload(), Workload(0.9, 0.25)):
        n, p = 19, 3
        theta = np.abs(rng.normal(size=(p, n))) + np.eye(p, 1) * 2
        objective = BandedObjective(n, workload, block=4)
        value, grad = objective(theta)
        mech = ColumnNormalizedBanded(n, theta, workload)
        dense = workload.matrix(n) @ np.linalg.inv(mech.strategy_matrix())
        assert value == pytest.approx(np.sum(dense**2), rel=1e-12)
        np.testing.assert_allclose(mech.decoder_row_norms_sq, np.sum(dense**2, axis=1), rtol=1e-12)
        mask = (np.arange(p)[:, None] + np.arange(n)[None, :]) < n
        fd = _finite_difference(lambda t: objective(t)[0], theta)  # noqa: B023 (called within this iteration)
        np.testing.assert_allclose(grad[mask], fd[mask], rtol=1e-5, atol=1e-6)


def test_banded_reproduces_the_papers_nine_by_nine_optimum():
    """"Scaling up BandMF", App. B.1: the optimal 3-banded strategy for n = 9 has
    ||A C^{-1}||_F^2 = 24.8809 and the printed entries."""
    mech, result = optimize_banded(9, 3, MinSep(3, 3))
    assert result.converged
    assert np.sum(mech.decoder_row_norms_sq) == pytest.approx(24.8809, abs=1e-4)
    c = mech.strategy_matrix()
    assert c[0, 0] == pytest.approx(0.740, abs=1e-3)
    assert c[2, 0] == pytest.approx(0.450, abs=1e-3)
    assert c[3, 2] == pytest.approx(0.395, abs=1e-3)
    assert c[8, 8] == pytest.approx(1.000, abs=1e-3)
    np.testing.assert_allclose(np.linalg.norm(c, axis=0), 1.0, rtol=1e-12)
    # p <= b: sensitivity is exactly sqrt(k) and equals brute force
    sens = mech.sensitivity(MinSep(3, 3))
    assert sens.exact and sens.value == pytest.approx(np.sqrt(3), rel=1e-12)
    assert sens.value == pytest.approx(exhaustive_minsep(c, 3, 3), rel=1e-12)


def test_banded_at_least_as_good_as_banded_toeplitz():
    schema = MinSep(8, None)
    toeplitz, _ = optimize_banded_toeplitz(96, 8, schema)
    banded, result = optimize_banded(96, 8, schema)
    assert result.converged
    assert banded.rmse(schema) <= toeplitz.rmse(schema) * (1 + 1e-9)
    assert banded.rmse(schema) < toeplitz.rmse(schema)  # column normalization strictly helps


def test_banded_with_cooldown_workload_and_file_round_trip(tmp_path):
    workload = Workload(0.9, 0.25)
    schema = MinSep(4, 6)
    mech, result = optimize_banded(24, 4, schema, workload)
    assert result.converged
    path = tmp_path / "banded.json"
    save(mech, path, schema)
    again = load(path)
    np.testing.assert_array_equal(again.bands, mech.bands)
    assert again.evaluate(schema) == mech.evaluate(schema)
    z = np.random.default_rng(0).normal(size=(24, 1, 2))
    stream = mech.inverse_stream()
    streamed = np.array([stream.step(z[t]) for t in range(24)])
    np.testing.assert_allclose(streamed, mech.inverse_matrix() @ z[:, 0], atol=1e-12)


def test_taper_follows_appendix_h():
    theta = np.ones(10)
    out = taper(theta, 4, 10) * np.linalg.norm(taper(theta, 4, 10)) ** 0  # normalized
    expected = np.array([1, 1, 1, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])  # i = 1..9; i = 10 -> 0
    np.testing.assert_allclose(out, expected / np.linalg.norm(expected), rtol=1e-12)


def test_separation_grid():
    assert separation_grid(200, 400, 5) == [200, 250, 300, 350, 400]
    assert separation_grid(7, 7) == [7]
    with pytest.raises(ValueError):
        separation_grid(5, 4)


def test_robust_is_at_least_as_good_as_each_competitor_in_the_worst_case():
    n, k, b0, b1 = 240, 4, 24, 48
    seps = separation_grid(b0, b1, 5)
    robust, result = optimize_robust(n, b0, b1, participations=k)
    assert result.converged
    worst = max(rmse_by_min_sep(robust, seps, k).values())
    bt1, _ = optimize_banded_toeplitz(n, b1, MinSep(b1, k))
    bt0, _ = optimize_banded_toeplitz(n, b0, MinSep(b0, k))
    tapered = BandedToeplitz(n, taper(bt1.coefficients, b0, b1))
    for competitor in (bt1, bt0, tapered):
        assert worst <= max(rmse_by_min_sep(competitor, seps, k).values()) * (1 + 1e-9)
    # every separation in the range is accounted exactly (non-negative, non-increasing C)
    for s in seps:
        assert robust.sensitivity(MinSep(s, k)).exact
    # the worst case over the range is at its smallest separation
    by_sep = rmse_by_min_sep(robust, list(range(b0, b1 + 1, 4)), k)
    assert max(by_sep.values()) == pytest.approx(by_sep[b0], rel=1e-12)


def test_robust_mean_weighting_trades_worst_case_for_average():
    n, k, b0, b1 = 240, 4, 24, 48
    seps = separation_grid(b0, b1, 9)
    worst, _ = optimize_robust(n, b0, b1, participations=k, weighting="worst")
    mean, _ = optimize_robust(n, b0, b1, participations=k, weighting="mean")
    avg = lambda m: np.mean([m.loss(MinSep(s, k)) for s in seps])  # noqa: E731
    assert avg(mean) <= avg(worst) * (1 + 1e-9)
    assert max(rmse_by_min_sep(worst, seps, k).values()) <= max(rmse_by_min_sep(mean, seps, k).values()) * (1 + 1e-9)


def _cli_json(capsys, *args):
    code = main([*map(str, args), "--json", "--quiet"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_cli_robust_reports_rmse_by_min_sep(capsys):
    code, report, err = _cli_json(capsys, "mechanism", "robust", "--rounds", 240, "--participations", 4,
                                  "--min-sep-range", "24:48")
    assert code == 0, err
    assert report["kind"] == "robust" and report["converged"] is True
    by_sep = {int(s): v for s, v in report["rmse_by_min_sep"].items()}
    assert sorted(by_sep) == [24, 30, 36, 42, 48]
    assert report["worst_case_rmse"] == pytest.approx(max(by_sep.values()))
    assert report["min_sep"] == 48 and report["participations"] == 4


def test_cli_taper(capsys):
    code, report, err = _cli_json(capsys, "mechanism", "robust", "--rounds", 240, "--participations", 4,
                                  "--min-sep-range", "24:48", "--taper")
    assert code == 0, err
    assert report["num_bands"] == 47  # the last band tapers to zero


def test_cli_progress_goes_to_stderr(capsys):
    code = main(["mechanism", "banded-toeplitz", "--rounds", "64", "--participations", "4", "--min-sep", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["converged"] is True
    assert "step" in err and "objective" in err


def test_cli_unconverged_is_reported_and_not_saved(capsys, tmp_path):
    path = tmp_path / "m.json"
    code = main(["mechanism", "banded-toeplitz", "--rounds", "256", "--min-sep", "32", "--max-steps", "1",
                 "--quiet", "--json", "--out", str(path)])
    out, err = capsys.readouterr()
    assert code == 1
    report = json.loads(out)
    assert report["converged"] is False and report["file"] is None
    assert "did not converge" in err and not path.exists()
    code = main(["mechanism", "banded-toeplitz", "--rounds", "256", "--min-sep", "32", "--max-steps", "1",
                 "--quiet", "--json", "--out", str(path), "--save-unconverged"])
    capsys.readouterr()
    assert code == 0 and path.exists()
    assert json.loads(path.read_text())["body"]["extra"]["converged"] is False


@pytest.mark.parametrize(
    "args",
    [
        ["banded-toeplitz", "--rounds", "100", "--min-sep", "10", "--bands", "11"],
        ["banded", "--rounds", "100", "--min-sep", "10", "--bands", "11"],
        ["robust", "--rounds", "100", "--min-sep-range", "40:20"],
        ["robust", "--rounds", "100", "--min-sep-range", "20:200"],
        ["robust", "--rounds", "100", "--min-sep-range", "x"],
        ["robust", "--rounds", "100"],
        ["bisr", "--rounds", "100", "--min-sep-range", "10:20"],
        ["banded-toeplitz", "--rounds", "100", "--workload", "momentum:0.9:cooldown=0.25"],
    ],
)
def test_cli_bad_optimized_input(capsys, args):
    code = main(["mechanism", *args, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("fedmf: error:") and err.count("\n") == 1


def test_plan_rejects_gamma_for_optimized_kinds():
    with pytest.raises(ValueError, match="gamma"):
        plan("banded-toeplitz", 32, MinSep(8), gamma=0.5)
