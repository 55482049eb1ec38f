"""REVIEW-i36-last-fixes part 1: for_cohort sets graph_for's k and t without _check_graph, so
graph_for must meet every rule _check_graph enforces, for the neighbourhood a round actually has."""
from __future__ import annotations

import logging

from fedmf.secagg.params import SecAggParams, graph_for, min_threshold


def test_graph_for_meets_the_check_for_every_cohort_up_to_2000():
    for cohort in range(2, 2001):
        k, t = graph_for(cohort)
        used = min(k, cohort - 1)  # a Harary graph with k >= cohort - 1 is the complete graph
        assert k >= 2 and k % 2 == 0, cohort
        assert 2 <= t <= k + 1 and 2 * t > k + 1, cohort
        assert t <= used + 1 and 2 * t > used + 1, cohort
        assert t >= min_threshold(used), cohort


def test_for_cohort_logs_nothing_and_matches_graph_for(caplog):
    params = SecAggParams(degree=0, threshold=0, bits=32, scale=65536.0)
    with caplog.at_level(logging.WARNING, logger="fedmf.secagg.params"):
        for cohort in (2, 3, 4, 5, 8, 11, 14, 23, 25, 29, 30, 500):
            p = params.for_cohort(cohort)
            assert (p.degree, p.threshold) == graph_for(cohort)
            assert (p.bits, p.scale, p.beta, p.stage_timeout_s) == (params.bits, params.scale, params.beta,
                                                                    params.stage_timeout_s)
    assert caplog.records == []
    assert params.derived and params.degree == 0  # the original is untouched
