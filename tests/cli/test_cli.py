"""End-to-end and in-process tests of the ``fedmf`` command line (mechanism, evaluate).

Fast cases call ``fedmf.cli.main`` with capsys; a representative set runs the real
process (``python -m fedmf.cli`` and the ``fedmf`` console script) to check exit codes,
streams and the absence of tracebacks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedmf import FixedEpoch, MinSep
from fedmf.cli import main
from fedmf.mechanisms import CLOSED_FORM_KINDS as KINDS
from fedmf.mechanisms import build
from fedmf.mechanisms.io import _checksum, load_with_schema, save
from fedmf.mechanisms.toeplitz import BandedInverseToeplitz, BandedToeplitz
from fedmf.sensitivity import exhaustive_minsep
from fedmf.workloads import parse_workload

REQUIRED = ("kind", "rounds", "participations", "min_sep", "schema", "loss", "rmse", "max_error", "sensitivity", "seconds")
METRICS = ("loss", "rmse", "max_error", "sensitivity")
WORKLOADS = ("prefix", "momentum:0.9", "momentum:0.95:cooldown=0.25")


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def run_main(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *args: str) -> dict:
    rc, out, err = run_main(capsys, *args, "--json")
    assert rc == 0, err
    assert err == ""
    return parse_one_json(out)


def parse_one_json(out: str) -> dict:
    """stdout must hold exactly one JSON object (one line)."""
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line of JSON, got {out!r}"
    report = json.loads(lines[0])
    assert isinstance(report, dict)
    for key in REQUIRED:
        assert key in report, f"missing {key!r} in {report}"
    assert report["rmse"] == math.sqrt(report["loss"])
    assert isinstance(report["seconds"], (int, float)) and report["seconds"] >= 0
    return report


def run_process(*args: str, script: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [shutil.which("fedmf")] if script else [sys.executable, "-m", "fedmf.cli"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def assert_usage_error(rc: int, out: str, err: str) -> str:
    assert rc == 2, (rc, out, err)
    assert out == "", f"nothing may be printed on stdout, got {out!r}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {err!r}"
    assert lines[0].startswith("fedmf: error:"), err
    return lines[0]


def dense_metrics(mechanism, sens: float) -> dict:
    """loss, rmse, max_error from the definitions, with dense A and C^-1."""
    n = mechanism.rounds
    decoder = mechanism.workload.matrix(n) @ mechanism.inverse_matrix()
    rows = np.sum(decoder**2, axis=1)
    loss = float(np.sum(rows)) / n * sens**2
    return {"loss": loss, "rmse": math.sqrt(loss), "max_error": float(np.sqrt(np.max(rows))) * sens}


def minsep_args(k, b) -> list[str]:
    out = []
    if k is not None:
        out += ["--participations", str(k)]
    if b is not None:
        out += ["--min-sep", str(b)]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Mechanism files written by ``fedmf mechanism --out`` (one per kind) and two
    arbitrary-coefficient Toeplitz files written by the library."""
    d = tmp_path_factory.mktemp("saved")
    files = {}
    for kind in KINDS:
        path = d / f"{kind}.json"
        argv = ["mechanism", kind, "--rounds", "60", "--participations", "4", "--min-sep", "15", "--out", str(path)]
        assert main(argv) == 0
        files[kind] = path
    schema = MinSep(15, 4)
    files["banded-toeplitz"] = d / "bt.json"
    save(BandedToeplitz(60, [1.0, 0.4375, -0.1234567890123, 0.0625]), files["banded-toeplitz"], schema)
    files["banded-inverse-toeplitz"] = d / "bit.json"
    save(BandedInverseToeplitz(60, [1.0, -0.51234567, -0.125, 0.03125]), files["banded-inverse-toeplitz"], schema)
    return files


# ---------------------------------------------------------------------------------------
# fedmf mechanism: JSON values
# ---------------------------------------------------------------------------------------
def test_dpsgd_issue_example_subprocess():
    """n=1000, k=4, b=250: loss = k(n+1)/2 = 2002 exactly; one JSON object on stdout."""
    proc = run_process("mechanism", "dp-sgd", "--rounds", "1000", "--participations", "4", "--min-sep", "250", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    report = parse_one_json(proc.stdout)
    assert report["kind"] == "dp-sgd"
    assert (report["rounds"], report["participations"], report["min_sep"]) == (1000, 4, 250)
    assert report["schema"] == "min-sep"
    assert report["loss"] == pytest.approx(2002.0, rel=1e-12)
    assert report["sensitivity"] == pytest.approx(2.0, rel=1e-12)
    assert report["max_error"] == pytest.approx(math.sqrt(1000 * 4), rel=1e-12)


@pytest.mark.skipif(shutil.which("fedmf") is None, reason="console script not on PATH")
def test_console_script():
    proc = run_process("mechanism", "dp-sgd", "--rounds", "1000", "--participations", "4", "--min-sep", "250",
                       "--json", script=True)
    assert proc.returncode == 0, proc.stderr
    assert parse_one_json(proc.stdout)["loss"] == pytest.approx(2002.0, rel=1e-12)
    bad = run_process("mechanism", "dp-sgd", "--rounds", "0", script=True)
    assert_usage_error(bad.returncode, bad.stdout, bad.stderr)


@pytest.mark.parametrize(
    "n, k, b, k_eff, b_eff",
    [
        (1000, 4, 250, 4, 250),
        (100, None, None, 1, 100),  # neither: b = n, k = 1
        (100, None, 30, 4, 30),  # only b: k = ceil(n/b)
        (100, None, 25, 4, 25),
        (100, 3, None, 3, 33),  # only k: b = n // k
        (1000, 7, None, 7, 142),
        (10, 10, 1, 10, 1),
        (1, None, None, 1, 1),
        (37, 2, 5, 2, 5),  # k smaller than what fits
    ],
)
def test_dpsgd_closed_forms_and_defaults(capsys, n, k, b, k_eff, b_eff):
    report = run_json(capsys, "mechanism", "dp-sgd", "--rounds", n, *minsep_args(k, b))
    assert (report["rounds"], report["participations"], report["min_sep"]) == (n, k_eff, b_eff)
    assert report["schema"] == "min-sep"
    assert report["loss"] == pytest.approx(k_eff * (n + 1) / 2, rel=1e-12)
    assert report["sensitivity"] == pytest.approx(math.sqrt(k_eff), rel=1e-12)
    assert report["max_error"] == pytest.approx(math.sqrt(n * k_eff), rel=1e-12)
    assert report["rmse"] == math.sqrt(report["loss"])


@pytest.mark.parametrize(
    "k, b, k_eff, b_eff",
    [(None, None, 1, 64), (None, 10, 7, 10), (None, 16, 4, 16), (5, None, 5, 12), (4, 16, 4, 16)],
)
@pytest.mark.parametrize("kind", KINDS)
def test_defaults_every_kind(capsys, kind, k, b, k_eff, b_eff):
    report = run_json(capsys, "mechanism", kind, "--rounds", 64, *minsep_args(k, b))
    assert (report["kind"], report["rounds"]) == (kind, 64)
    assert (report["participations"], report["min_sep"]) == (k_eff, b_eff)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("kind", KINDS)
def test_json_matches_library(capsys, kind, workload):
    n, k, b = 48, 4, 12
    report = run_json(capsys, "mechanism", kind, "--rounds", n, "--participations", k, "--min-sep", b,
                      "--workload", workload)
    schema = MinSep(b, k)
    mechanism = build(kind, n, schema, parse_workload(workload))
    expected = mechanism.evaluate(schema)
    for key in METRICS:
        assert report[key] == pytest.approx(expected[key], rel=1e-12), key
    assert report["sensitivity_method"] == expected["sensitivity_method"]
    assert report["sensitivity_exact"] == expected["sensitivity_exact"]
    assert report["workload"] == mechanism.workload.name
    if kind == "bifr":
        assert report["gamma"] == pytest.approx(mechanism.gamma, rel=1e-12)
    # and against the definitions, with dense A and C^-1
    dense = dense_metrics(mechanism, report["sensitivity"])
    for key in ("loss", "rmse", "max_error"):
        assert report[key] == pytest.approx(dense[key], rel=1e-9), key


@pytest.mark.parametrize("kind", KINDS)
def test_sensitivity_against_brute_force(capsys, kind):
    """Exact sensitivities equal the brute force over every (k, b) pattern and sign (d = 1);
    bounds are never below it."""
    n, k, b = 12, 4, 3
    report = run_json(capsys, "mechanism", kind, "--rounds", n, "--participations", k, "--min-sep", b)
    mechanism = build(kind, n, MinSep(b, k))
    brute = exhaustive_minsep(mechanism.strategy_matrix(), b, k)
    if report["sensitivity_exact"]:
        assert report["sensitivity"] == pytest.approx(brute, rel=1e-9)
    else:
        assert report["sensitivity"] >= brute * (1 - 1e-12)


def test_tree_single_participation_closed_form(capsys):
    """n = 2^h, one participation: leaf 0 lies in h+1 nodes, so sens = sqrt(h+1)."""
    report = run_json(capsys, "mechanism", "tree", "--rounds", 64)
    assert report["sensitivity"] == pytest.approx(math.sqrt(7), rel=1e-12)


def test_bifr_given_gamma_and_bands(capsys):
    report = run_json(capsys, "mechanism", "bifr", "--rounds", 100, "--min-sep", 20, "--bands", 7, "--gamma", 0.3)
    assert report["gamma"] == 0.3 and report["num_bands"] == 7
    mechanism = build("bifr", 100, MinSep(20), num_bands=7, gamma=0.3)
    assert report["loss"] == pytest.approx(mechanism.loss(MinSep(20)), rel=1e-12)


def test_bifr_gamma_half_equals_bisr(capsys):
    a = run_json(capsys, "mechanism", "bifr", "--rounds", 90, "--min-sep", 9, "--gamma", 0.5)
    b = run_json(capsys, "mechanism", "bisr", "--rounds", 90, "--min-sep", 9)
    for key in METRICS:
        assert a[key] == pytest.approx(b[key], rel=1e-12)


def test_optimized_gamma_beats_bisr(capsys):
    a = run_json(capsys, "mechanism", "bifr", "--rounds", 120, "--min-sep", 10)
    b = run_json(capsys, "mechanism", "bisr", "--rounds", 120, "--min-sep", 10)
    assert 0 < a["gamma"] < 1
    assert a["rmse"] <= b["rmse"] * (1 + 1e-9)


def test_bands_default(capsys):
    assert run_json(capsys, "mechanism", "bsr", "--rounds", 1000, "--min-sep", 10)["num_bands"] == 10
    assert run_json(capsys, "mechanism", "bisr", "--rounds", 1000, "--min-sep", 500)["num_bands"] == 64


def test_table_output(capsys):
    rc, out, err = run_main(capsys, "mechanism", "bifr", "--rounds", 100, "--min-sep", 10, "--gamma", 0.4)
    assert rc == 0 and err == ""
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["kind"] == ["bifr"]
    for key in ("rounds", "participations", "min_sep", "loss", "rmse", "max_error", "sensitivity"):
        assert key in rows, key
    report = run_json(capsys, "mechanism", "bifr", "--rounds", 100, "--min-sep", 10, "--gamma", 0.4)
    assert float(rows["rmse"][0]) == pytest.approx(report["rmse"], rel=1e-5)
    assert int(rows["rounds"][0]) == 100


def test_out_writes_loadable_file(capsys, tmp_path):
    path = tmp_path / "m.json"
    report = run_json(capsys, "mechanism", "bisr", "--rounds", 80, "--participations", 4, "--min-sep", 20,
                      "--out", path)
    assert path.exists()
    document = json.loads(path.read_text())
    assert report["checksum"] == document["checksum"] == _checksum(document["body"])
    mechanism, schema, checksum = load_with_schema(path)
    assert checksum == report["checksum"]
    assert mechanism.kind == "bisr" and mechanism.rounds == 80
    assert schema.min_sep == 20 and schema.participations(80) == 4
    assert mechanism.evaluate(schema)["loss"] == report["loss"]
    assert sorted(os.listdir(tmp_path)) == ["m.json"]  # no temp files left


def test_perf_sanity_bisr_1024():
    proc = run_process("mechanism", "bisr", "--rounds", "1024", "--participations", "64", "--min-sep", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    report = parse_one_json(proc.stdout)
    assert report["kind"] == "bisr"
    assert (report["rounds"], report["participations"], report["min_sep"]) == (1024, 64, 16)
    assert report["sensitivity_method"] == "toeplitz-closed-form"
    expected = build("bisr", 1024, MinSep(16, 64)).evaluate(MinSep(16, 64))
    assert report["loss"] == pytest.approx(expected["loss"], rel=1e-12)


# ---------------------------------------------------------------------------------------
# fedmf evaluate
# ---------------------------------------------------------------------------------------
ALL_SAVED = KINDS + ("banded-toeplitz", "banded-inverse-toeplitz")


@pytest.mark.parametrize("kind", ALL_SAVED)
def test_evaluate_planned_schema_reproduces_build(capsys, saved, kind):
    path = saved[kind]
    mechanism, planned, checksum = load_with_schema(path)
    report = run_json(capsys, "evaluate", "--mechanism", path)
    assert report["kind"] == kind
    assert (report["rounds"], report["participations"], report["min_sep"], report["schema"]) == (60, 4, 15, "min-sep")
    assert report["checksum"] == checksum
    if kind in KINDS:
        built = run_json(capsys, "mechanism", kind, "--rounds", 60, "--participations", 4, "--min-sep", 15)
        for key in METRICS + ("sensitivity_method", "participations", "min_sep", "schema"):
            assert report[key] == built[key], key
    expected = mechanism.evaluate(MinSep(15, 4))
    for key in METRICS:
        assert report[key] == pytest.approx(expected[key], rel=1e-12)


@pytest.mark.parametrize("kind", ALL_SAVED)
@pytest.mark.parametrize("min_sep", [1, 5, 14])
def test_evaluate_smaller_min_sep_not_less_sensitive(capsys, saved, kind, min_sep):
    planned = run_json(capsys, "evaluate", "--mechanism", saved[kind])
    report = run_json(capsys, "evaluate", "--mechanism", saved[kind], "--min-sep", min_sep)
    assert report["min_sep"] == min_sep
    assert report["participations"] == 4  # k keeps its planned value
    assert report["sensitivity"] >= planned["sensitivity"] * (1 - 1e-12)
    mechanism = load_with_schema(saved[kind])[0]
    assert report["sensitivity"] == pytest.approx(mechanism.sensitivity(MinSep(min_sep, 4)).value, rel=1e-12)


@pytest.mark.parametrize("kind", ALL_SAVED)
def test_evaluate_fixed_epoch(capsys, saved, kind):
    mechanism = load_with_schema(saved[kind])[0]
    report = run_json(capsys, "evaluate", "--mechanism", saved[kind], "--fixed-epoch")  # planned k = 4 divides 60
    assert report["schema"] == "fixed-epoch"
    assert (report["participations"], report["min_sep"]) == (4, 15)
    expected = mechanism.evaluate(FixedEpoch(4, 15))
    for key in METRICS:
        assert report[key] == pytest.approx(expected[key], rel=1e-12)
    report = run_json(capsys, "evaluate", "--mechanism", saved[kind], "--fixed-epoch", "--participations", 3)
    assert (report["schema"], report["participations"], report["min_sep"]) == ("fixed-epoch", 3, 20)
    assert report["loss"] == pytest.approx(mechanism.loss(FixedEpoch(3, 20)), rel=1e-12)


def test_evaluate_participations_override(capsys, saved):
    report = run_json(capsys, "evaluate", "--mechanism", saved["bisr"], "--participations", 2)
    assert (report["participations"], report["min_sep"]) == (2, 15)
    mechanism = load_with_schema(saved["bisr"])[0]
    assert report["loss"] == pytest.approx(mechanism.loss(MinSep(15, 2)), rel=1e-12)


def test_evaluate_table(capsys, saved):
    rc, out, err = run_main(capsys, "evaluate", "--mechanism", saved["bsr"])
    assert rc == 0 and err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["kind"] == ["bsr"] and "rmse" in rows


def test_evaluate_subprocess(saved):
    proc = run_process("evaluate", "--mechanism", saved["bifr"], "--min-sep", "10", "--json")
    assert proc.returncode == 0, proc.stderr
    report = parse_one_json(proc.stdout)
    assert (report["kind"], report["min_sep"], report["participations"]) == ("bifr", 10, 4)


def test_evaluate_planned_fixed_epoch_file(capsys, tmp_path):
    schema = FixedEpoch(4, 25)
    mechanism = build("bisr", 100, schema)
    path = tmp_path / "fe.json"
    save(mechanism, path, schema)
    report = run_json(capsys, "evaluate", "--mechanism", path)
    expected = mechanism.evaluate(schema)
    assert report["sensitivity"] == pytest.approx(expected["sensitivity"], rel=1e-12)
    assert (report["schema"], report["participations"], report["min_sep"]) == ("fixed-epoch", 4, 25)


# ---------------------------------------------------------------------------------------
# bad input: one line on stderr, exit 2, nothing on stdout, no file
# ---------------------------------------------------------------------------------------
BAD_MECHANISM = {
    "rounds-zero": ["dp-sgd", "--rounds", "0"],
    "rounds-negative": ["bisr", "--rounds", "-5"],
    "rounds-float": ["bisr", "--rounds", "1.5"],
    "rounds-word": ["bisr", "--rounds", "ten"],
    "rounds-missing": ["bisr"],
    "b-gt-n": ["bisr", "--rounds", "10", "--min-sep", "11"],
    "b-gt-n-with-k": ["dp-sgd", "--rounds", "10", "--participations", "1", "--min-sep", "11"],
    "b-zero": ["bisr", "--rounds", "10", "--min-sep", "0"],
    "k-zero": ["bisr", "--rounds", "10", "--participations", "0"],
    "k-gt-n": ["bisr", "--rounds", "10", "--participations", "11"],
    "gamma-0": ["bifr", "--rounds", "10", "--gamma", "0"],
    "gamma-1": ["bifr", "--rounds", "10", "--gamma", "1"],
    "gamma-1.5": ["bifr", "--rounds", "10", "--gamma", "1.5"],
    "gamma-neg": ["bifr", "--rounds", "10", "--gamma=-0.1"],
    "gamma-neg-separate": ["bifr", "--rounds", "10", "--gamma", "-0.1"],
    "gamma-nan": ["bifr", "--rounds", "10", "--gamma", "nan"],
    "gamma-word": ["bifr", "--rounds", "10", "--gamma", "half"],
    "bands-gt-n": ["bisr", "--rounds", "10", "--bands", "11"],
    "bands-gt-n-bsr": ["bsr", "--rounds", "10", "--bands", "11"],
    "bands-gt-n-bifr": ["bifr", "--rounds", "10", "--bands", "11"],
    "bands-zero": ["bisr", "--rounds", "10", "--bands", "0"],
    "bands-negative": ["bsr", "--rounds", "10", "--bands=-2"],
    "bands-for-dpsgd": ["dp-sgd", "--rounds", "10", "--bands", "2"],
    "bands-for-blt": ["blt", "--rounds", "10", "--min-sep", "5", "--bands", "2", "--quiet"],
    "bands-for-dense": ["dense", "--rounds", "8", "--participations", "2", "--bands", "2", "--quiet"],
    "unknown-kind": ["foo", "--rounds", "10"],
    "unloadable-kind": ["banded-inverse-toeplitz", "--rounds", "10"],
    "unknown-workload": ["bisr", "--rounds", "10", "--workload", "adam"],
    "bad-momentum": ["bisr", "--rounds", "10", "--workload", "momentum:abc"],
    "momentum-ge-1": ["bisr", "--rounds", "10", "--workload", "momentum:1.5"],
    "bad-workload-option": ["bisr", "--rounds", "10", "--workload", "momentum:0.9:warmup=0.1"],
    "bad-cooldown": ["bisr", "--rounds", "10", "--workload", "momentum:0.9:cooldown=2"],
    "gamma-bsr": ["bsr", "--rounds", "10", "--gamma", "0.5"],
    "gamma-bisr": ["bisr", "--rounds", "10", "--gamma", "0.5"],
    "gamma-dpsgd": ["dp-sgd", "--rounds", "10", "--gamma", "0.5"],
    "gamma-tree": ["tree", "--rounds", "10", "--gamma", "0.3"],
    "unknown-option": ["bisr", "--rounds", "10", "--frobnicate"],
    "final-without-cooldown": ["bisr", "--rounds", "10", "--workload", "momentum:0.9:final=0.1"],
    "tolerance-negative": ["banded-toeplitz", "--rounds", "10", "--min-sep", "5", "--tolerance=-1", "--quiet"],
    "tolerance-nan": ["banded-toeplitz", "--rounds", "10", "--min-sep", "5", "--tolerance", "nan", "--quiet"],
    "max-steps-zero": ["blt", "--rounds", "10", "--min-sep", "5", "--max-steps", "0", "--quiet"],
    "dense-tolerance-zero": ["dense", "--rounds", "8", "--participations", "2", "--tolerance", "0", "--quiet"],
    "robust-cooldown": ["robust", "--rounds", "100", "--min-sep-range", "10:20", "--workload",
                        "momentum:0.9:cooldown=0.25", "--quiet"],
    "blt-cooldown-past-dense-limit": ["blt", "--rounds", "5000", "--min-sep", "1000", "--workload",
                                      "momentum:0.9:cooldown=0.25", "--quiet"],
}


@pytest.mark.parametrize("args", list(BAD_MECHANISM.values()), ids=list(BAD_MECHANISM))
@pytest.mark.parametrize("json_flag", [False, True], ids=["table", "json"])
def test_bad_mechanism_input(capsys, tmp_path, args, json_flag):
    out_file = tmp_path / "never.json"
    argv = ["mechanism", *args, "--out", str(out_file)] + (["--json"] if json_flag else [])
    assert_usage_error(*run_main(capsys, *argv))
    assert not out_file.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [[], ["--json"], ["frobnicate"], ["mechanism"], ["evaluate"]],
                         ids=["none", "json-only", "unknown-command", "mechanism-no-kind", "evaluate-no-file"])
def test_bad_command(capsys, argv):
    assert_usage_error(*run_main(capsys, *argv))


def test_error_messages_name_the_problem(capsys):
    line = assert_usage_error(*run_main(capsys, "mechanism", "foo", "--rounds", "10"))
    assert "foo" in line
    line = assert_usage_error(*run_main(capsys, "mechanism", "bifr", "--rounds", "10", "--gamma", "1.5"))
    assert "gamma" in line
    line = assert_usage_error(*run_main(capsys, "mechanism", "bisr", "--rounds", "10", "--min-sep", "11"))
    assert "11" in line
    line = assert_usage_error(*run_main(capsys, "mechanism", "bisr", "--rounds", "10", "--workload", "adam"))
    assert "adam" in line


@pytest.mark.parametrize(
    "args",
    [
        ["mechanism", "dp-sgd", "--rounds", "0"],
        ["mechanism", "bisr", "--rounds", "ten"],
        ["mechanism", "bifr", "--rounds", "10", "--gamma", "1.5"],
        ["mechanism", "bisr", "--rounds", "10", "--workload", "adam"],
        ["mechanism", "bsr", "--rounds", "10", "--gamma", "0.5", "--json"],
        ["mechanism", "foo", "--rounds", "10"],
        [],
    ],
    ids=["rounds-zero", "rounds-word", "gamma", "workload", "gamma-non-bifr", "kind", "no-subcommand"],
)
def test_bad_input_subprocess(tmp_path, args):
    out_file = tmp_path / "never.json"
    if args and args[0] == "mechanism":
        args = args + ["--out", str(out_file)]
    proc = run_process(*args)
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr)
    assert not out_file.exists()
    assert os.listdir(tmp_path) == []


def test_out_is_a_directory(capsys, tmp_path):
    line = assert_usage_error(*run_main(capsys, "mechanism", "dp-sgd", "--rounds", "10", "--out", tmp_path))
    assert "is a directory" in line and os.listdir(tmp_path) == []


def test_only_fedmf_errors_are_usage_errors(capsys, monkeypatch):
    """A FedmfError is one line and exit 2; any other ValueError is a bug and stays a traceback."""
    from fedmf.errors import PlanMismatch

    def fails_with(error):
        def command(args):
            raise error
        return command

    monkeypatch.setattr("fedmf.cli.mechanism.cmd_mechanism", fails_with(PlanMismatch("another plan\ndetails")))
    assert assert_usage_error(*run_main(capsys, "mechanism", "bsr", "--rounds", "8")) == "fedmf: error: another plan"
    monkeypatch.setattr("fedmf.cli.mechanism.cmd_mechanism", fails_with(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        main(["mechanism", "bsr", "--rounds", "8"])


def test_out_into_missing_directory(tmp_path):
    target = tmp_path / "missing" / "m.json"
    proc = run_process("mechanism", "dp-sgd", "--rounds", "10", "--out", target)
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr)
    assert not target.exists()


# ---- evaluate: bad files ---------------------------------------------------------------
def _doc(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _write(path: Path, document, recompute: bool = False) -> Path:
    if recompute:
        document["checksum"] = _checksum(document["body"])
    path.write_text(json.dumps(document, indent=1))
    return path


def _bad_file(case: str, saved: dict, tmp: Path) -> tuple[Path, str | None]:
    """A bad mechanism file for ``case`` and a word its error line must contain (or None)."""
    p = tmp / f"{case}.json"
    if case == "missing":
        return tmp / "no-such-file.json", "no-such-file"
    if case == "directory":
        return tmp, None
    if case == "empty":
        p.write_text("")
        return p, "not a mechanism"
    if case == "not-json":
        p.write_text("hello, this is not JSON\n")
        return p, "not a mechanism"
    if case == "binary":
        p.write_bytes(bytes(range(256)) * 4)
        return p, None
    if case == "truncated":
        text = saved["bifr"].read_text()
        p.write_text(text[: len(text) // 2])
        return p, "truncated"
    if case == "truncated-coefficients":
        text = saved["banded-toeplitz"].read_text()
        p.write_text(text[: len(text) // 2])
        return p, "truncated"
    if case.startswith("tamper-"):
        doc = _doc(saved["bifr" if case != "tamper-coefficient" else "banded-toeplitz"])
        body = doc["body"]
        if case == "tamper-gamma":
            text = repr(body["params"]["gamma"])  # "0.dddd": change the first decimal digit
            body["params"]["gamma"] = float(text[:2] + str((int(text[2]) + 1) % 10) + text[3:])
        elif case == "tamper-bands":
            body["params"]["num_bands"] -= 1
        elif case == "tamper-rounds":
            body["rounds"] = 59
        elif case == "tamper-coefficient":
            body["params"]["coefficients"][1] = 0.4376
        elif case == "tamper-schema":
            body["schema"]["min_sep"] = 16
        elif case == "tamper-kind":
            body["kind"] = "bisr"
        elif case == "tamper-checksum":
            doc["checksum"] = doc["checksum"][:-1] + ("0" if doc["checksum"][-1] != "0" else "1")
        return _write(p, doc), "checksum"
    if case == "edit-rounds-text":
        text = saved["bifr"].read_text()
        body_at = text.index('"rounds": 60')
        return _write_text(p, text[:body_at] + text[body_at:].replace('"rounds": 60', '"rounds": 61', 1)), "checksum"
    if case in ("version-2", "version-2-recomputed", "version-0"):
        doc = _doc(saved["bisr"])
        doc["version"] = 0 if case == "version-0" else 2
        return _write(p, doc, recompute=case.endswith("recomputed")), "version " + str(doc["version"])
    if case == "other-format":
        return _write(p, {"format": "something-else", "version": 1, "body": {}}), "not a fedmf mechanism"
    if case == "json-list":
        return _write(p, [1, 2, 3]), "not a fedmf mechanism"
    if case == "json-null":
        p.write_text("null")
        return p, "not a fedmf mechanism"
    if case == "json-object":
        return _write(p, {"hello": "world"}), "not a fedmf mechanism"
    if case == "no-body":
        doc = _doc(saved["bisr"])
        del doc["body"]
        return _write(p, doc), None
    if case == "nan-coefficient":
        text = saved["banded-toeplitz"].read_text()
        return _write_text(p, text.replace("0.4375", "NaN", 1)), None
    if case == "invalid-content":  # checksum recomputed, content invalid
        doc = _doc(saved["bisr"])
        doc["body"]["params"]["num_bands"] = 1000
        return _write(p, doc, recompute=True), "invalid"
    raise AssertionError(case)


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_FILES = [
    "missing", "directory", "empty", "not-json", "binary", "truncated", "truncated-coefficients",
    "tamper-gamma", "tamper-bands", "tamper-rounds", "tamper-coefficient", "tamper-schema", "tamper-kind",
    "tamper-checksum", "edit-rounds-text", "version-2", "version-2-recomputed", "version-0", "other-format",
    "json-list", "json-null", "json-object", "no-body", "nan-coefficient", "invalid-content",
]


@pytest.mark.parametrize("case", BAD_FILES)
@pytest.mark.parametrize("json_flag", [False, True], ids=["table", "json"])
def test_evaluate_bad_file(capsys, saved, tmp_path, case, json_flag):
    path, word = _bad_file(case, saved, tmp_path)
    line = assert_usage_error(*run_main(capsys, "evaluate", "--mechanism", path, *(["--json"] if json_flag else [])))
    if word is not None:
        assert word in line, line


@pytest.mark.parametrize("case", ["truncated", "tamper-coefficient", "version-2", "other-format", "not-json", "missing"])
def test_evaluate_bad_file_subprocess(saved, tmp_path, case):
    path, word = _bad_file(case, saved, tmp_path)
    proc = run_process("evaluate", "--mechanism", path, "--json")
    line = assert_usage_error(proc.returncode, proc.stdout, proc.stderr)
    assert word in line


def test_evaluate_deeply_nested_json(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    proc = run_process("evaluate", "--mechanism", path)
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize(
    "extra",
    [
        ["--fixed-epoch", "--participations", "7"],  # 7 does not divide 60
        ["--fixed-epoch", "--participations", "0"],
        ["--fixed-epoch", "--participations", "-3"],
        ["--fixed-epoch", "--min-sep", "15"],  # mutually exclusive
        ["--min-sep", "61"],  # b > n
        ["--min-sep", "0"],
        ["--participations", "0"],
        ["--participations", "x"],
    ],
    ids=["k-not-dividing", "k-zero", "k-negative", "fixed-and-min-sep", "b-gt-n", "b-zero", "k-zero-minsep", "k-word"],
)
def test_evaluate_bad_options(capsys, saved, extra):
    assert_usage_error(*run_main(capsys, "evaluate", "--mechanism", saved["bisr"], *extra, "--json"))


def test_evaluate_fixed_epoch_planned_k_not_dividing(capsys, tmp_path):
    """Planned k = ceil(50/15) = 4 does not divide 50: --fixed-epoch without k is an error."""
    path = tmp_path / "m.json"
    assert run_main(capsys, "mechanism", "bisr", "--rounds", 50, "--min-sep", 15, "--out", path)[0] == 0
    line = assert_usage_error(*run_main(capsys, "evaluate", "--mechanism", path, "--fixed-epoch"))
    assert "fixed-epoch" in line
    proc = run_process("evaluate", "--mechanism", path, "--fixed-epoch", "--participations", "3")
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr)
