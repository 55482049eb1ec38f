"""The sampling schemes as descriptions (``fedmf.sampling``: string form, observed guard, schemas) and
what their interpreters read from them: the scheduler (``fedmf.schedule``), the accountant's per-round
curve (``fedmf.accounting.schemes``); every scheme has one of each."""

from __future__ import annotations

import pickle
import re

import pytest

from fedmf.accounting.schemes import ACCOUNTANTS, has_per_round_curve
from fedmf.errors import ConfigError
from fedmf.participation import FixedEpoch, MinSep
from fedmf.sampling import (
    GRAMMAR,
    NONE,
    BMinSepSampling,
    CyclicPoissonSampling,
    NoSampling,
    PlainPoissonSampling,
    Sampling,
    parse_sampling,
)
from fedmf.sampling import (
    SCHEMES as BY_KIND,
)
from fedmf.schedule import (
    BMinSepPoisson,
    CyclicPoisson,
    FixedEpochOrder,
    MinSepSelection,
    PoissonSampling,
    make_scheduler,
)
from fedmf.schedule.factory import BUILDERS

KEY = bytes(range(32))
SCHEMES = [
    # text, class, amplified, per-round curve, scheduler under MinSep(1) (users_per_round for none)
    ("none", NoSampling, False, True, MinSepSelection),
    ("bminsep:0.25", BMinSepSampling, True, False, BMinSepPoisson),
    ("bminsep:0.25:warm", BMinSepSampling, True, False, BMinSepPoisson),
    ("cyclic-poisson:0.5", CyclicPoissonSampling, True, True, CyclicPoisson),
    ("poisson:0.1", PlainPoissonSampling, True, False, PoissonSampling),
]


@pytest.mark.parametrize("text, cls, amplified, curve, scheduler", SCHEMES)
def test_what_a_scheme_knows(text, cls, amplified, curve, scheduler):
    scheme = parse_sampling(text)
    assert type(scheme) is cls and isinstance(scheme, Sampling)
    assert str(scheme) == text and parse_sampling(str(scheme)) == scheme
    assert Sampling(scheme.kind, scheme.probability, scheme.warm_start) == scheme
    assert pickle.loads(pickle.dumps(scheme)) == scheme and hash(scheme) == hash(parse_sampling(text))
    assert scheme.amplified is amplified and scheme.observed_guard is (not amplified)
    assert has_per_round_curve(scheme) is curve
    upr = None if amplified else 2
    made = make_scheduler(MinSep(1), scheme, key=KEY, users_per_round=upr, population=range(5))
    assert type(made) is scheduler and made.max_participations is None
    with pytest.raises(AttributeError):
        scheme.kind = "none"  # a class constant
    if amplified:
        with pytest.raises(AttributeError):
            scheme.probability = 0.5  # frozen


def test_the_schemas_a_scheme_follows():
    fixed = FixedEpoch(2, 4)
    for text in ("none", "cyclic-poisson:0.5"):
        parse_sampling(text).check_schema(fixed)
    assert parse_sampling("cyclic-poisson:0.5").min_sep_of(fixed) == 4
    for text in ("bminsep:0.5", "poisson:0.5"):
        with pytest.raises(ConfigError, match="fixed-epoch order"):
            make_scheduler(fixed, parse_sampling(text), key=KEY, population=range(8))
    with pytest.raises(ConfigError, match="MinSep"):
        parse_sampling("bminsep:0.5").check_schema(fixed)
    with pytest.raises(ConfigError, match=r"MinSep\(1, n\)"):
        parse_sampling("poisson:0.5").check_schema(MinSep(2))
    with pytest.raises(ConfigError, match="min-sep schema"):
        parse_sampling("bminsep:0.5").min_sep_of(fixed)
    assert type(make_scheduler(fixed, NONE, key=KEY, population=range(8))) is FixedEpochOrder


def test_the_compat_constructor_checks_its_parts():
    assert Sampling() == NONE == NoSampling()
    with pytest.raises(ConfigError, match="unknown sampling"):
        Sampling("uniform", 0.1)
    with pytest.raises(ConfigError, match="takes no probability"):
        Sampling("none", 0.1)
    with pytest.raises(ConfigError, match="warm start applies to bminsep"):
        Sampling("poisson", 0.1, True)
    with pytest.raises(ConfigError, match="probability"):
        BMinSepSampling(0.0)


def test_every_scheme_has_one_scheduler_and_one_accountant_and_a_place_in_the_grammar():
    """The sampler is the accountant's (ARCHITECTURE.md, rule 3): each description has both interpreters."""
    assert set(BY_KIND.values()) == set(BUILDERS) == set(ACCOUNTANTS)
    assert GRAMMAR == "none | bminsep:P[:warm] | cyclic-poisson:Q | poisson:P"
    for bad in ("uniform:0.1", "none:0.1", "poisson:0.1:warm", "bminsep"):
        with pytest.raises(ConfigError, match=re.escape(f"sampling must be {GRAMMAR}, got")):
            parse_sampling(bad)
