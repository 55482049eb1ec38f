"""Issue-35 review of the sampling split (commit 9efaf4a): the tables the refactor introduced, pinned
to what fedmf/accounting/sampling.py did at 4c6cbb1, and the finding on b-min-sep's planned ε
(docs/reviews/REVIEW-i35-sampling-noise.md)."""

from __future__ import annotations

import pytest

from fedmf.accounting import schemes
from fedmf.accounting.releases import ExtraReleases
from fedmf.errors import ConfigError
from fedmf.mechanisms import plan as plan_mechanism
from fedmf.participation import MinSep
from fedmf.plan import RunPlan
from fedmf.sampling import parse_sampling

FORMS = ("none", "bminsep:0.5", "bminsep:0.5:warm", "cyclic-poisson:0.5", "poisson:0.5")


@pytest.mark.parametrize("form, per_round, guard, composes", [
    ("none", True, True, True),
    ("bminsep:0.5", False, False, False),
    ("bminsep:0.5:warm", False, False, False),
    ("cyclic-poisson:0.5", True, False, True),
    ("poisson:0.5", False, False, False),
])
def test_each_scheme_keeps_the_facts_it_had_before_the_split(form, per_round, guard, composes):
    """4c6cbb1: has_per_round_curve and observed_guard were class attributes; count_release.SUPPORTED
    = (none, cyclic-poisson) composed the count and every other extra release."""
    sampling = parse_sampling(form)
    assert schemes.has_per_round_curve(sampling) is per_round
    assert sampling.observed_guard is guard
    for releases in (None, ExtraReleases.count(3.0)):
        if composes:
            schemes.check_releases(sampling, releases)
        else:
            with pytest.raises(ConfigError, match="sampling none .un-amplified. or cyclic-poisson:Q only"):
                schemes.check_releases(sampling, releases)


def test_only_poisson_refuses_calibration_and_only_bminsep_refuses_a_tiny_delta():
    for form in FORMS:
        sampling = parse_sampling(form)
        if sampling.kind == "poisson":
            with pytest.raises(ConfigError, match="MMCC"):
                schemes.check_calibrate(sampling)
        else:
            schemes.check_calibrate(sampling)
        if sampling.kind == "bminsep":
            with pytest.raises(ConfigError, match="too small for bminsep"):
                schemes.check_delta(sampling, 1e-12)
        else:
            schemes.check_delta(sampling, 1e-12)


def _bminsep_plan() -> RunPlan:
    schema = MinSep(4, 2)
    mechanism, _ = plan_mechanism("bsr", 6, schema)
    return RunPlan.create(mechanism, schema, clip_norm=0.5, delta=1e-3, expected_users=8, noise_multiplier=0.6,
                          target_epsilon=8.0, sampling="bminsep:0.5")


def test_a_bminsep_plans_planned_epsilon_is_the_same_in_every_process():
    assert _bminsep_plan().epsilon() == _bminsep_plan().epsilon()


def test_a_plan_calibrated_by_evr_plans_its_target_and_opens_round_0():
    """EVR's z is (target, δ)-DP (Thm A.1 of arXiv 2602.09338): the plan says so, and its guard never
    refuses round 0 on a second Monte Carlo estimate that landed just above the target."""
    schema = MinSep(4, 2)
    mechanism, _ = plan_mechanism("bsr", 6, schema)
    plan = RunPlan.create(mechanism, schema, clip_norm=0.5, delta=1e-3, expected_users=8, target_epsilon=8.0,
                          sampling="bminsep:0.5")
    assert plan.calibration["accountant"] in ("bminsep-evr", "bminsep-evr-fallback")
    if plan.calibration["accountant"] == "bminsep-evr":
        assert plan.epsilon() == 8.0
    assert plan.epsilon() <= 8.0 * (1 + 1e-9)
    for t in range(plan.rounds):
        plan.guard(t)
