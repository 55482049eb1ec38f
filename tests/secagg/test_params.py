"""SecAgg+ parameters: checked where they are built, one line per refusal, immutable."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedmf.errors import ConfigError, ConfigTypeError, FedmfError
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.params import COLLUSION_FRACTION, SECURITY_BITS, SecAggParams, exposure, graph_for

GOOD = {"degree": 6, "threshold": 4, "bits": 32, "scale": 1024.0}


def test_good_parameters():
    p = SecAggParams(**GOOD)
    assert (p.degree, p.threshold, p.bits, p.scale, p.modulus) == (6, 4, 32, 1024.0, 2**32)
    assert p.beta == math.exp(-0.5) and p.stage_timeout_s > 0
    assert [p.shares(n) for n in (2, 5, 7, 8, 1000)] == [2, 5, 7, 7, 7]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.threshold = 2  # type: ignore[misc]
    assert issubclass(SecAggAbort, SecAggError) and issubclass(SecAggError, FedmfError)


@pytest.mark.parametrize(("change", "error", "words"), [
    ({"degree": 5}, SecAggError, "even"),
    ({"degree": 0}, ConfigError, "degree"),
    ({"degree": True}, ConfigTypeError, "degree"),
    ({"threshold": 3}, SecAggError, "half"),  # 2·3 ≤ 7 shares: a lying server could unmask one client
    ({"threshold": 8}, ConfigError, "threshold"),
    ({"threshold": 4.0}, ConfigTypeError, "threshold"),
    ({"bits": 3}, ConfigError, "bits"),
    ({"bits": 63}, ConfigError, "bits"),
    ({"scale": 0.0}, ConfigError, "scale"),
    ({"scale": float("inf")}, ConfigError, "scale"),
    ({"beta": 1.0}, ConfigError, "beta"),
    ({"stage_timeout_s": -1.0}, ConfigError, "timeout"),
])
def test_bad_parameters_are_refused_in_one_line(change, error, words):
    with pytest.raises(error, match=words) as caught:
        SecAggParams(**(GOOD | change))
    assert "\n" not in str(caught.value)


def test_default_degree_and_threshold_are_derived_from_the_cohort_by_the_stated_rule():
    """``graph_for`` brute-forced: for each cohort n, k even (the complete graph while n ≤ k + 1),
    2t > k + 1 and t ≤ the shares, exposure ≤ 2^-40 at γ = 5 %, and nothing smaller meets the bound
    (a smaller even k at t = k/2 + 1 when sparse, a smaller t ≥ ⌊n/2⌋ + 1 when complete)."""
    assert graph_for(1000) == (28, 15) and graph_for(30) == (28, 15) and graph_for(29) == (28, 15)
    assert [graph_for(n) for n in (2, 3, 5, 10, 11, 20)] == [(2, 2), (2, 3), (4, 5), (10, 10), (10, 10), (20, 13)]
    assert 2.0**-41 < exposure(28, 15) <= 2.0**-40 < exposure(26, 14)
    assert exposure(8, 5) == pytest.approx(1.5404882812500003e-05, rel=1e-12)
    for n in range(2, 120):
        k, t = graph_for(n)
        shares = min(k, n - 1) + 1
        assert k % 2 == 0 and 2 * t > k + 1 and 2 * t > shares and 2 <= t <= shares
        assert exposure(min(k, n - 1), t) <= 2.0**-SECURITY_BITS
        if n - 1 > k:
            assert all(exposure(j, j // 2 + 1) > 2.0**-40 for j in range(2, k, 2))
        else:
            assert k >= n - 1 and all(exposure(n - 1, s) > 2.0**-40 for s in range(n // 2 + 1, t))
    assert COLLUSION_FRACTION == 0.05


def test_derived_parameters_apply_per_round_and_overrides_stay_as_set():
    derived = SecAggParams(degree=0, threshold=0, bits=32, scale=1.0)
    assert derived.derived and derived.for_cohort(50).degree == 28 and derived.for_cohort(50).threshold == 15
    assert derived.for_cohort(7) == SecAggParams(degree=6, threshold=7, bits=32, scale=1.0)
    assert [derived.shares(n) for n in (2, 7, 30, 1000)] == [2, 7, 29, 29]
    fixed = SecAggParams(**GOOD)
    assert not fixed.derived and fixed.for_cohort(1000) is fixed


@pytest.mark.parametrize(("values", "words"), [
    ({"secagg-degree": 8}, "both 0"),
    ({"secagg-threshold": 5}, "both 0"),
    ({"secagg-degree": 8, "secagg-threshold": 4}, "half"),
    ({"secagg-degree": 7, "secagg-threshold": 5}, "even"),
    ({"secagg-degree": -2, "secagg-threshold": 5}, "degree"),
])
def test_overrides_are_validated_at_the_edge_in_one_line(values, words):
    from server.config import ServerConfig

    with pytest.raises(ConfigError, match=words) as caught:
        ServerConfig.from_mapping({"secure-aggregation": "secaggplus", **values})
    assert "\n" not in str(caught.value)
    config = ServerConfig.from_mapping({"secure-aggregation": "secaggplus", "secagg-degree": 8,
                                        "secagg-threshold": 5})
    assert config.secagg is not None and (config.secagg.degree, config.secagg.threshold) == (8, 5)
    assert ServerConfig.from_mapping({"secure-aggregation": "secaggplus"}).secagg.derived
