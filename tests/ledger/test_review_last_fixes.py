"""REVIEW-i36-last-fixes LOW-1: a secure sum records clipped as unknown (None), but the ledger's
norm summary counts None as not clipped, so `fedmf audit` and results.json rebuilt from the ledger
say 0 clipped where the round log says unknown."""
from __future__ import annotations

from fedmf.ledger.queries import norm_summary


def test_norm_summary_known_values():
    out = norm_summary([(1.0, True), (3.0, False), (2.0, True)])
    assert out["clipped"] == 2 and out["norm_min"] == 1.0 and out["norm_median"] == 2.0 and out["norm_max"] == 3.0


def test_norm_summary_of_a_secure_round_says_unknown():
    out = norm_summary([(None, None), (None, None), (None, None)])
    assert out["clipped"] is None
