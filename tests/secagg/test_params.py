"""SecAgg+ parameters: checked where they are built, one line per refusal, immutable."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedmf.errors import ConfigError, ConfigTypeError, FedmfError
from fedmf.secagg.errors import SecAggAbort, SecAggError
from fedmf.secagg.params import SecAggParams

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
