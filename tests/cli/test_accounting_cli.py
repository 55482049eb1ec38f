"""``fedmf epsilon`` and ``fedmf calibrate`` (fedmf.cli.accounting), through ``fedmf.cli.main``."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from fedmf import MinSep
from fedmf.accounting import gaussian
from fedmf.cli import build_parser, main
from fedmf.mechanisms import build
from fedmf.mechanisms.io import save

REQUIRED = ("epsilon", "delta", "noise_multiplier", "sensitivity", "noise_std_per_clip_norm", "accountant", "seconds")


@pytest.fixture(scope="module")
def mechanism_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "bsr.json"
    save(build("bsr", 64, MinSep(8, 4), num_bands=8), path, MinSep(8, 4))
    return str(path)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    for key in REQUIRED:
        assert key in report
    return report


def test_commands_are_registered():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"mechanism", "evaluate", "epsilon", "calibrate", "audit"} <= set(sub.choices)


def test_epsilon(capsys, mechanism_file):
    report = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.5",
                      "--delta", "1e-6")
    assert report["epsilon"] == gaussian.epsilon(1.5, 1e-6)
    assert report["participations"] == 4 and report["min_sep"] == 8 and report["accountant"] == "gaussian-pld"
    # z·sens: the absolute noise std divided by the clip norm; "noise_std" is reserved for the absolute std
    assert report["noise_std_per_clip_norm"] == pytest.approx(1.5 * report["sensitivity"], rel=1e-15)
    assert "noise_std" not in report
    # the schema options override the planned schema
    more = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.5",
                    "--delta", "1e-6", "--participations", "6")
    assert more["participations"] == 6 and more["sensitivity"] > report["sensitivity"]


def test_epsilon_per_round(capsys, mechanism_file):
    report = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.0",
                      "--delta", "1e-6", "--per-round")
    eps = report["epsilon_by_round"]
    assert len(eps) == 64 and eps[-1] == report["epsilon"] and np.all(np.diff(eps) >= 0)


def test_calibrate(capsys, mechanism_file):
    report = run_json(capsys, "calibrate", "--mechanism", mechanism_file, "--epsilon", "2", "--delta", "1e-6")
    assert report["noise_multiplier"] == gaussian.calibrate(2.0, 1e-6) and report["epsilon"] == 2.0
    assert report["noise_std_per_clip_norm"] == pytest.approx(report["noise_multiplier"] * report["sensitivity"])
    amplified = run_json(capsys, "calibrate", "--mechanism", mechanism_file, "--epsilon", "2", "--delta",
                         "1e-6", "--sampling", "cyclic-poisson:0.5")
    assert amplified["noise_multiplier"] < report["noise_multiplier"]
    assert amplified["accountant"] == "cyclic-poisson-pld" and amplified["sampling"] == "cyclic-poisson:0.5"


def test_bminsep_epsilon_and_calibrate(capsys, mechanism_file):
    common = ("--mechanism", mechanism_file, "--delta", "0.02", "--sampling", "bminsep:0.05", "--seed", "3")
    report = run_json(capsys, "epsilon", "--noise-multiplier", "0.7", *common)
    assert report["accountant"] == "bminsep-monte-carlo" and report["epsilon"] < report["epsilon_unamplified"]
    cal = run_json(capsys, "calibrate", "--epsilon", "1.0", *common)
    assert cal["accountant"] in ("bminsep-evr", "bminsep-evr-fallback") and cal["evr"]["overall_delta"] <= 0.02


def test_text_output(capsys, mechanism_file):
    rc, out, err = run(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1",
                       "--delta", "1e-6")
    assert rc == 0 and err == "" and out.splitlines()[0].split()[0] == "epsilon"


@pytest.mark.parametrize("argv", [
    ("epsilon", "--noise-multiplier", "1", "--delta", "0"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "-0.5"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "nan"),
    ("epsilon", "--noise-multiplier", "0", "--delta", "1e-6"),
    ("epsilon", "--noise-multiplier", "-2", "--delta", "1e-6"),
    ("epsilon", "--noise-multiplier", "x", "--delta", "1e-6"),
    ("calibrate", "--epsilon", "0", "--delta", "1e-6"),
    ("calibrate", "--epsilon", "-1", "--delta", "1e-6"),
    ("calibrate", "--epsilon", "1", "--delta", "2"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--sampling", "bminsep:1.5"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--sampling", "poisson"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--sampling", "bminsep:0.1", "--per-round"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--min-sep", "0"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--min-sep", "65"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--sampling", "cyclic-poisson:0.1", "--min-sep", "4"),
    ("calibrate", "--epsilon", "1", "--delta", "1e-6", "--samples", "0"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-3", "--sampling", "bminsep:0.1", "--samples", "10"),
    ("calibrate", "--epsilon", "1", "--delta", "1e-3", "--sampling", "bminsep:0.1", "--samples", "10"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--accountant", "rdp", "--sampling", "poisson:0.1"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--count-noise-std", "0"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--count-noise-std", "inf"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--count-noise-std", "5", "--sampling", "bminsep:0.1"),
    ("calibrate", "--epsilon", "0.5", "--delta", "1e-6", "--count-noise-std", "0.5"),
    ("epsilon", "--noise-multiplier", "1", "--delta", "1e-12", "--sampling", "bminsep:0.1"),
])
def test_bad_input_exits_2_with_one_line(capsys, mechanism_file, argv):
    rc, out, err = run(capsys, *argv[:1], "--mechanism", mechanism_file, *argv[1:])
    assert rc == 2
    assert out == ""
    assert err.startswith("fedmf: error: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_count_noise_std_and_rho(capsys, mechanism_file):
    plain = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.5", "--delta", "1e-12")
    assert plain["rho"] == pytest.approx(0.5 / 1.5**2, rel=1e-12) and "privacy_split" not in plain
    report = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.5",
                      "--delta", "1e-12", "--count-noise-std", "4")
    # k = 4 counts, each of sensitivity 1 and std 4: 1/z_eff² = 1/1.5² + 4/16 (GDP composition)
    assert report["epsilon"] == gaussian.epsilon((1 / 1.5**2 + 0.25) ** -0.5, 1e-12)
    assert report["rho"] == pytest.approx(0.5 / 1.5**2 + 4 / 32, rel=1e-12)
    assert report["privacy_split"]["count"] == pytest.approx(0.25 / (1 / 1.5**2 + 0.25), rel=1e-12)
    cal = run_json(capsys, "calibrate", "--mechanism", mechanism_file, "--epsilon", str(report["epsilon"]),
                   "--delta", "1e-12", "--count-noise-std", "4")
    assert cal["noise_multiplier"] == pytest.approx(1.5, rel=1e-9)
    amplified = run_json(capsys, "epsilon", "--mechanism", mechanism_file, "--noise-multiplier", "1.5",
                         "--delta", "1e-6", "--sampling", "cyclic-poisson:0.5", "--count-noise-std", "4")
    assert amplified["rho"] is None and amplified["rho_note"]


def test_not_a_mechanism_file(capsys, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    for path in (bad, tmp_path / "missing.json"):
        rc, out, err = run(capsys, "epsilon", "--mechanism", str(path), "--noise-multiplier", "1", "--delta", "1e-6")
        assert rc == 2 and err.startswith("fedmf: error: ") and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def small_mechanism_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "bsr16.json"
    save(build("bsr", 16, MinSep(4, 4), num_bands=4), path, MinSep(4, 4))
    return str(path)


def test_poisson_sampling_is_accounted_by_mmcc(capsys, small_mechanism_file):
    from fedmf.accounting import mmcc
    from fedmf.mechanisms.io import load

    report = run_json(capsys, "epsilon", "--mechanism", small_mechanism_file, "--noise-multiplier", "3",
                      "--delta", "1e-6", "--sampling", "poisson:0.1")
    mech = load(small_mechanism_file)
    direct = mmcc.epsilon(mech, 0.1, 3 * report["sensitivity"], 1e-6)
    assert report["accountant"] == "mmcc-pld" and report["epsilon"] == pytest.approx(direct.epsilon, rel=1e-12)
    unamplified = run_json(capsys, "epsilon", "--mechanism", small_mechanism_file, "--noise-multiplier",
                           "3", "--delta", "1e-6")
    assert report["epsilon"] < unamplified["epsilon"]
    for argv in (("epsilon", "--noise-multiplier", "3", "--per-round"), ("calibrate", "--epsilon", "1")):
        rc, out, err = run(capsys, *argv[:1], "--mechanism", small_mechanism_file, *argv[1:],
                           "--delta", "1e-6", "--sampling", "poisson:0.1")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "poisson" in err


def test_amplification_of_a_negative_strategy_is_refused(capsys, tmp_path):
    """MMCC and b-min-sep need C >= 0: a user's choice of mechanism, so one line and exit 2."""
    from fedmf.mechanisms.toeplitz import BandedToeplitz

    path = tmp_path / "negative.json"
    save(BandedToeplitz(16, np.array([1.0, -0.3])), path, MinSep(4, 4))
    for sampling, words in (("poisson:0.1", "non-negative C"), ("bminsep:0.1", "non-negative coefficients")):
        rc, out, err = run(capsys, "epsilon", "--mechanism", str(path), "--noise-multiplier", "1", "--delta", "0.02",
                           "--sampling", sampling)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err
