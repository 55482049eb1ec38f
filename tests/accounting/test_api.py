"""fedmf.accounting.epsilon / calibrate: the noise convention (std = z·ζ·sens), the
un-amplified reduction to one Gaussian, cyclic-Poisson amplification, monotonicity."""

from __future__ import annotations

import time

import pytest

from fedmf import FixedEpoch, MinSep
from fedmf.accounting import calibrate, cyclic_poisson, epsilon, gaussian
from fedmf.mechanisms import build
from fedmf.mechanisms.identity import DpSgd
from fedmf.sampling import Sampling, parse_sampling
from tests.reference import load_cases

CASES = load_cases("accounting.json")


def test_unamplified_is_one_gaussian_with_multiplier_z():
    # noise std z·sens for the accounted schema: privacy of a Gaussian with multiplier z
    for kind in ("dp-sgd", "bsr", "tree", "bisr"):
        mechanism = build(kind, 32, MinSep(4, 6))
        result = epsilon(mechanism, 1.7, 1e-6, MinSep(4, 6))
        assert result.epsilon == gaussian.epsilon(1.7, 1e-6)
        assert result.noise_std_per_clip_norm == pytest.approx(1.7 * mechanism.sensitivity(MinSep(4, 6)).value)
        assert result.accountant == "gaussian-pld"


def test_larger_sensitivity_at_fixed_noise_means_more_epsilon():
    mechanism = build("bsr", 64, MinSep(8, 4), num_bands=8)
    planned = mechanism.sensitivity(MinSep(8, 4)).value
    by_k = [epsilon(mechanism, 1.0, 1e-6, MinSep(8, k), noise_sensitivity=planned).epsilon for k in (2, 4, 6, 8)]
    assert by_k == sorted(by_k) and len(set(by_k)) == 4  # more participations => larger epsilon
    # a user with sensitivity s_u has multiplier z·sens/s_u
    s6 = mechanism.sensitivity(MinSep(8, 6)).value
    assert by_k[2] == pytest.approx(gaussian.epsilon(planned / s6, 1e-6), rel=1e-12)
    assert by_k[1] == pytest.approx(gaussian.epsilon(1.0, 1e-6), rel=1e-12)
    by_z = [epsilon(mechanism, z, 1e-6, MinSep(8, 4)).epsilon for z in (2.0, 1.0, 0.5)]
    assert by_z == sorted(by_z)  # less noise => larger epsilon


def test_calibrate_unamplified():
    mechanism = build("bsr", 64, MinSep(8, 4), num_bands=8)
    result = calibrate(mechanism, 2.0, 1e-6, MinSep(8, 4))
    assert result.noise_multiplier == gaussian.calibrate(2.0, 1e-6)
    assert epsilon(mechanism, result.noise_multiplier, 1e-6, MinSep(8, 4)).epsilon <= 2.0
    rdp = calibrate(mechanism, 2.0, 1e-6, MinSep(8, 4), accountant="rdp")
    assert rdp.noise_multiplier > result.noise_multiplier and rdp.accountant == "gaussian-rdp"


def test_banded_calibration_n2048_is_instant_after_the_first_call():
    mechanism = build("bsr", 2048, MinSep(64, 32), num_bands=64)
    calibrate(mechanism, 4.0, 1e-6, MinSep(64, 32))
    started = time.perf_counter()
    result = calibrate(mechanism, 4.0, 1e-6, MinSep(64, 32))
    assert time.perf_counter() - started < 1.0
    assert result.sensitivity == pytest.approx(32**0.5 * mechanism.sensitivity(MinSep(64, 1)).value, rel=1e-12)


def test_reference_dpsgd_poisson_through_the_mechanism_api():
    case = next(c for c in CASES if c["name"] == "dp-sgd poisson" and c["rounds"] == 512)
    mechanism = DpSgd(case["rounds"])
    # one participation's sensitivity is 1, so the noise std is z (C = I, b = 1: DP-SGD)
    result = epsilon(mechanism, case["noise_multiplier"], case["delta"], MinSep(1, 1),
                     sampling=f"cyclic-poisson:{case['sampling_probability']}")
    assert result.epsilon == pytest.approx(case["epsilon"], rel=case["tol"])
    assert result.details["steps"] == 512 and result.accountant == "cyclic-poisson-pld"


def test_cyclic_poisson_bandmf():
    mechanism = build("bsr", 64, MinSep(16, 4), num_bands=8)
    schema = MinSep(16, 4)
    result = epsilon(mechanism, 1.0, 1e-6, schema, sampling="cyclic-poisson:0.25")
    col = max(mechanism.column_norms_sq()) ** 0.5
    sens = mechanism.sensitivity(schema).value
    assert result.details["steps"] == 4
    assert result.epsilon == cyclic_poisson.epsilon(sens / col, 0.25, 4, 1e-6)
    assert result.epsilon < epsilon(mechanism, 1.0, 1e-6, schema).epsilon  # amplification helps
    cal = calibrate(mechanism, result.epsilon, 1e-6, schema, sampling="cyclic-poisson:0.25")
    assert cal.noise_multiplier == pytest.approx(1.0, rel=1e-3)
    assert epsilon(mechanism, cal.noise_multiplier, 1e-6, schema, sampling="cyclic-poisson:0.25").epsilon <= \
        result.epsilon * (1 + 1e-9)
    # fixed epochs are cyclic groups too
    fixed = epsilon(mechanism, 1.0, 1e-6, FixedEpoch(4, 16), sampling="cyclic-poisson:0.25")
    assert fixed.details["steps"] == 4


def test_cyclic_poisson_needs_a_banded_strategy():
    with pytest.raises(ValueError, match="banded"):
        epsilon(build("tree", 16, MinSep(4)), 1.0, 1e-6, MinSep(4), sampling="cyclic-poisson:0.1")
    with pytest.raises(ValueError, match="bands"):
        epsilon(build("bsr", 16, MinSep(4), num_bands=6), 1.0, 1e-6, MinSep(4), sampling="cyclic-poisson:0.1")


def test_parse_sampling():
    assert parse_sampling("none") == Sampling()
    assert parse_sampling("bminsep:0.25") == Sampling("bminsep", 0.25)
    assert parse_sampling("bminsep:0.25:warm") == Sampling("bminsep", 0.25, True)
    assert str(parse_sampling("cyclic-poisson:0.5")) == "cyclic-poisson:0.5"
    assert parse_sampling("poisson:0.1") == Sampling("poisson", 0.1)
    for bad in ("bminsep", "bminsep:x", "poisson", "poisson:0.1:warm", "cyclic-poisson:0.1:warm", "bminsep:0",
                "none:1", "uniform:0.1"):
        with pytest.raises(ValueError):
            parse_sampling(bad)


@pytest.mark.parametrize("call", [
    lambda m: epsilon(m, 0.0, 1e-6, MinSep(4)),
    lambda m: epsilon(m, 1.0, 1.0, MinSep(4)),
    lambda m: epsilon(m, 1.0, 1e-6, MinSep(4), accountant="moments"),
    lambda m: calibrate(m, -1.0, 1e-6, MinSep(4)),
    lambda m: calibrate(m, 1.0, 0.0, MinSep(4)),
    lambda m: epsilon(m, 1.0, 1e-6, MinSep(4), noise_sensitivity=0.0),
])
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call(build("bsr", 16, MinSep(4), num_bands=4))
