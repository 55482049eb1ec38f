"""SecAgg+ parameters: checked where they are built, one line per refusal, immutable."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedmf.errors import ConfigError, ConfigTypeError, FedmfError
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.params import (
    COLLUSION_FRACTION,
    SecAggParams,
    exposure,
    graph_for,
    malicious_exposure,
)

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
    2t > k + 1 and t ≤ the shares, both the honest-but-curious exposure P[Bin(k, γ) ≥ t] and the
    deviating server's P[Bin(k, γ) ≥ 2t − 1 − k] ≤ 2^-40 at γ = 5 % (REVIEW-i36-secagg-2 HIGH-1), no
    smaller t meets both, and the sparse k is the smallest even one tolerating k/4 dropouts."""
    assert graph_for(1000) == (28, 22) and graph_for(30) == (28, 22) and graph_for(29) == (28, 22)
    assert [graph_for(n) for n in (2, 3, 5, 10, 11, 12, 13, 20)] == [(2, 2), (2, 3), (4, 5), (10, 10), (10, 11),
                                                                     (12, 12), (12, 12), (20, 17)]
    assert 2.0**-41 < malicious_exposure(28, 22) == exposure(28, 15) <= 2.0**-40 < malicious_exposure(28, 21)
    assert exposure(28, 22) < 2.0**-76 and exposure(8, 5) == pytest.approx(1.5404882812500003e-05, rel=1e-12)
    assert malicious_exposure(8, 5) == pytest.approx(exposure(8, 1)) and malicious_exposure(8, 9) == 0.0

    def both(k: int, t: int) -> bool:  # the two bounds, brute force over the binomial's tail
        tail = lambda c: sum(math.comb(k, i) * 0.05**i * 0.95 ** (k - i) for i in range(max(c, 0), k + 1))  # noqa: E731
        return tail(t) <= 2.0**-40 and tail(2 * t - 1 - k) <= 2.0**-40

    for j in range(2, 28, 2):  # no smaller even k tolerates a quarter of its neighbours dropping
        assert 4 * (j + 1 - next(s for s in range(j // 2 + 1, j + 2) if both(j, s))) < j
    for n in range(2, 120):
        k, t = graph_for(n)
        m = min(k, n - 1)
        assert k % 2 == 0 and 2 * t > k + 1 and 2 * t > m + 1 and 2 <= t <= m + 1
        assert both(m, t) and not any(both(m, s) for s in range((m + 1) // 2 + 1, t))
        assert (n - 1 > k) == (k == 28 and n > 29)
    assert COLLUSION_FRACTION == 0.05


def test_a_graph_below_the_rule_is_accepted_with_both_exposures_logged(caplog):
    with caplog.at_level("WARNING", logger="fedmf.secagg.params"):
        SecAggParams(degree=8, threshold=5, bits=16, scale=1.0)
    assert "k = 8, t = 5: exposure 2^-16.0 (honest-but-curious), 2^-1.6 (deviating server)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedmf.secagg.params"):
        SecAggParams(degree=28, threshold=22, bits=16, scale=1.0)
    assert not caplog.text


def test_derived_parameters_apply_per_round_and_overrides_stay_as_set():
    derived = SecAggParams(degree=0, threshold=0, bits=32, scale=1.0)
    assert derived.derived and derived.for_cohort(50).degree == 28 and derived.for_cohort(50).threshold == 22
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
