"""Per-round spend (fedmf.accounting.per_round): sens_t of the first t rows under the
schema restricted to rounds < t, against brute force on explicit prefix matrices; the
curve is non-decreasing and ends at the planned epsilon."""

from __future__ import annotations

import numpy as np
import pytest

from fedmf import FixedEpoch, MinSep, Observed
from fedmf.accounting import cyclic_poisson, epsilon, epsilon_by_round, gaussian
from fedmf.accounting.per_round import prefix_sensitivities
from fedmf.mechanisms import build
from fedmf.mechanisms.banded import ColumnNormalizedBanded
from fedmf.mechanisms.toeplitz import BandedToeplitz
from fedmf.sensitivity import exhaustive_minsep

N = 12
SCHEMA = MinSep(3, 3)


def prefix(mechanism, t):
    rows = sum(mechanism.fresh_rows(s) for s in range(t))
    return mechanism.strategy_matrix()[:rows, :t]


def brute(mechanism, schema, t):
    """Scalar brute force over every pattern of the restricted schema (exact when the
    prefix Gram matrix is non-negative, as for all strategies used here)."""
    return exhaustive_minsep(prefix(mechanism, t), schema.min_sep, schema.max_participations)


MECHANISMS = {
    "dp-sgd": lambda: build("dp-sgd", N, SCHEMA),
    "bsr": lambda: build("bsr", N, SCHEMA, num_bands=3),
    "bsr-overlapping": lambda: build("bsr", N, SCHEMA, num_bands=5),  # 5 bands > b: Toeplitz closed form
    "bisr": lambda: build("bisr", N, SCHEMA, num_bands=2),
    "banded-toeplitz": lambda: BandedToeplitz(N, [1.0, 0.2, 0.7]),  # not monotone, 3 <= b bands
    "banded": lambda: ColumnNormalizedBanded(N, np.abs(np.random.default_rng(0).normal(1.0, 0.5, (3, N))) + 0.1),
    "tree": lambda: build("tree", N, SCHEMA),
}


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_prefix_sensitivities_against_brute_force(name):
    mechanism = MECHANISMS[name]()
    sens, method = prefix_sensitivities(mechanism, SCHEMA)
    expected = np.array([brute(mechanism, SCHEMA, t) for t in range(1, N + 1)])
    if name == "tree":  # general strategy: the sound Gram bound
        assert method.startswith("checkpoints")
        assert np.all(sens >= expected * (1 - 1e-12))
    else:
        assert method in ("toeplitz-closed-form", "banded-exact")
        assert np.allclose(sens, expected, rtol=1e-12, atol=0)
    assert sens[-1] == pytest.approx(mechanism.sensitivity(SCHEMA).value, rel=1e-12)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_curve_is_non_decreasing_and_ends_at_planned(name):
    mechanism = MECHANISMS[name]()
    by_round = epsilon_by_round(mechanism, 1.3, 1e-6, SCHEMA)
    planned = epsilon(mechanism, 1.3, 1e-6, SCHEMA).epsilon
    eps = by_round.epsilons
    assert eps.shape == (N,)
    assert np.all(np.diff(eps) >= 0)
    assert eps[-1] == planned
    assert eps[0] < planned or mechanism.kind == "dp-sgd" and SCHEMA.participations(1) == 1
    # epsilon_t is the Gaussian epsilon at z·sens/sens_t
    if by_round.method != "toeplitz-closed-form" or name != "bsr":
        return
    sens = mechanism.sensitivity(SCHEMA).value
    ref = gaussian.epsilons(1.3 * sens / by_round.sensitivities, 1e-6)
    assert np.allclose(eps[:-1], ref[:-1], rtol=1e-9)


def test_more_rounds_more_epsilon_at_fixed_noise():
    mechanism = build("bsr", 64, MinSep(8, 8), num_bands=8)
    eps = epsilon_by_round(mechanism, 1.0, 1e-6, MinSep(8, 8)).epsilons
    # every new participation slot (rounds 8, 16, …) strictly raises the spend
    assert np.all(eps[8::8] > eps[7:-1:8])


def test_dpsgd_rounds_match_participations():
    # C = I under MinSep(b, k): after t rounds a user took part at most ceil(t/b) times
    mechanism = build("dp-sgd", 20, MinSep(5, 4))
    by_round = epsilon_by_round(mechanism, 1.0, 1e-6, MinSep(5, 4))
    counts = -(-np.arange(1, 21) // 5)
    assert np.allclose(by_round.sensitivities, np.sqrt(counts))


def test_fixed_epoch_and_observed_schemas():
    mechanism = build("bsr", N, MinSep(4, 3), num_bands=4)
    fixed = FixedEpoch(3, 4)
    eps = epsilon_by_round(mechanism, 1.0, 1e-6, fixed).epsilons
    assert np.all(np.diff(eps) >= 0) and eps[-1] == epsilon(mechanism, 1.0, 1e-6, fixed).epsilon
    observed = Observed.from_mapping({"a": [0, 4, 8], "b": [1, 2]})
    eps = epsilon_by_round(mechanism, 1.0, 1e-6, observed).epsilons
    assert np.all(np.diff(eps) >= 0) and eps[-1] == epsilon(mechanism, 1.0, 1e-6, observed).epsilon


def test_checkpoints_are_upper_bounds():
    mechanism = build("tree", 40, MinSep(5, 4))
    exact, _ = prefix_sensitivities(mechanism, MinSep(5, 4), max_points=64)
    coarse, method = prefix_sensitivities(mechanism, MinSep(5, 4), max_points=6)
    assert "upper-bound" in method and np.all(coarse >= exact - 1e-12)


def test_cyclic_poisson_per_round():
    mechanism = build("bsr", 40, MinSep(8), num_bands=8)
    result = epsilon(mechanism, 2.0, 1e-6, MinSep(8), sampling="cyclic-poisson:0.2", per_round=True)
    eps = np.array(result.epsilon_by_round)
    assert eps[-1] == result.epsilon and np.all(np.diff(eps) >= 0)
    z_step = result.details["step_noise_multiplier"]
    # rounds 9..16: the worst group was active twice
    assert eps[8] == pytest.approx(cyclic_poisson.epsilon(z_step, 0.2, 2, 1e-6))
    assert eps[0] == eps[7]


def test_validation():
    mechanism = build("bsr", N, SCHEMA, num_bands=3)
    with pytest.raises(ValueError, match="bminsep"):
        epsilon_by_round(mechanism, 1.0, 1e-6, SCHEMA, sampling="bminsep:0.1")
    with pytest.raises(ValueError, match="delta"):
        epsilon_by_round(mechanism, 1.0, 0.0, SCHEMA)
    with pytest.raises(ValueError, match="noise"):
        epsilon_by_round(mechanism, -1.0, 1e-6, SCHEMA)


def test_bound_checkpoints_are_not_labelled_exact():
    """Tree under MinSep(5, 4): for t > 5 (k_t > 1) sens_t is the Gram upper bound, so the
    curve must not claim exactness even with a checkpoint at every round; rounds with one
    possible participation (max column norm) are exact, as brute force confirms."""
    schema = MinSep(5, 4)
    mechanism = build("tree", 40, schema)
    sens, method = prefix_sensitivities(mechanism, schema, max_points=64)
    assert method == "checkpoints-upper-bound"
    by_round = epsilon_by_round(mechanism, 1.0, 1e-6, schema)
    assert by_round.exact[:5].all() and not by_round.exact[5:].any()
    assert by_round.to_dict()["per_round_exact"] is False
    for t in range(1, 6):
        assert sens[t - 1] == pytest.approx(brute(mechanism, schema, t), rel=1e-12)
    assert epsilon(mechanism, 1.0, 1e-6, schema, per_round=True).details["per_round_exact"] is False


def test_closed_forms_are_labelled_exact():
    by_round = epsilon_by_round(MECHANISMS["bsr"](), 1.0, 1e-6, SCHEMA)
    assert by_round.method == "toeplitz-closed-form" and by_round.exact.all()
    assert epsilon(MECHANISMS["bsr"](), 1.0, 1e-6, SCHEMA, per_round=True).details["per_round_exact"] is True
