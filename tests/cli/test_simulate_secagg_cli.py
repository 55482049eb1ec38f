"""``fedmf simulate --secure-aggregation``: in process against the central run with the same secrets
(repeatable noise), the audit's record, a resume with other parameters refused, one-line option
errors, and the Flower app's run config."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest
import torch

from fedmf.cli import main
from fedmf.cli.simulate import SECURE_AGGREGATION_GROUP
from fedmf.config import RunConfig
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.run.simulate import preset_values
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import Quantization
from tests import _federated_task as fixed


@pytest.fixture
def secagg_entry_point(tmp_path_factory, monkeypatch):
    """The ``secaggplus`` entry point as pyproject.toml declares it, for an installation made before it
    existed (an editable install reads its entry points from the metadata written at install time)."""
    if not entry_points(group=SECURE_AGGREGATION_GROUP, name="secaggplus"):
        site = tmp_path_factory.mktemp("site")
        info = site / "fedmf_secagg_test-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedmf-secagg-test\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[{SECURE_AGGREGATION_GROUP}]\n"
                                               "secaggplus = server.secagg_inprocess:secaggplus\n")
        monkeypatch.syspath_prepend(str(site))
    assert entry_points(group=SECURE_AGGREGATION_GROUP, name="secaggplus")


def _simulate(out, *extra) -> dict:
    return ["simulate", "--preset", "tiny", "--out", str(out), "--json", "--no-plot", *extra]


def test_secure_simulate_equals_the_central_run_up_to_the_quantization_error(tmp_path, capsys, monkeypatch,
                                                                            secagg_entry_point):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the two runs draw the same noise
    assert main(_simulate(tmp_path / "central", "--rounds", "1")) == 0
    fixed.share_secrets(tmp_path / "central", tmp_path / "secure")
    assert main(_simulate(tmp_path / "secure", "--rounds", "1", "--secure-aggregation")) == 0
    capsys.readouterr()
    # round 0 from the same model with the same users: the releases differ by the quantization only —
    # each coordinate of each update rounded by < 1/s, and σ·(inflation − 1) — and the first step of
    # the server optimizer moves the model by server-lr × the release (tests/flower/test_secure_aggregation.py)
    config = RunConfig.from_mapping(preset_values("tiny", {"rounds": 1}))
    plan = config.build_plan()
    dim = sum(p.numel() for p in torch.load(tmp_path / "central" / "final-model.pt").values())
    q = Quantization(clip_norm=plan.clip_norm, scale=65536.0, bits=32, dim=dim)
    m = plan.expected_users
    bound = config.server_lr * (m / q.scale + (q.inflation - 1.0) * 8 * plan.noise_std) / m
    got = torch.load(tmp_path / "secure" / "final-model.pt")
    want = torch.load(tmp_path / "central" / "final-model.pt")
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert 0 < diff <= bound + 1e-6, (diff, bound)


def test_two_secure_rounds_run_are_audited_and_refuse_other_parameters(tmp_path, capsys, monkeypatch,
                                                                       secagg_entry_point):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")
    assert main(_simulate(tmp_path / "central", "--rounds", "2")) == 0
    fixed.share_secrets(tmp_path / "central", tmp_path / "secure")
    out = tmp_path / "secure"
    assert main(_simulate(out, "--rounds", "2", "--secure-aggregation", "--secagg-degree", "6",
                          "--secagg-threshold", "4")) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rounds_done"] == 2
    got, want = torch.load(out / "final-model.pt"), torch.load(tmp_path / "central" / "final-model.pt")
    assert 0 < max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-3
    assert main(["audit", "--ledger", str(out / "ledger.db"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    secure = report["planned"]["secure_aggregation"]
    assert (secure["degree"], secure["threshold"], secure["bits"], secure["scale"]) == (6, 4, 32, 65536.0)
    assert secure["inflation"] > 1.0
    assert report["planned"]["noise_std"] == pytest.approx(
        report["run"]["noise_multiplier"] * report["run"]["clip_norm"] * secure["inflation"]
        * report["planned"]["sensitivity"], rel=1e-12)
    rows = report["rounds"]
    assert [(r["selected"], r["contributed"], r["dropped"], r["rejected"]) for r in rows] == [(8, 8, 0, 0)] * 2
    # σ as recorded each round is z·ζ_eff·sens exactly: no round below the plan's (ζ_eff) noise
    assert all(r["noise_std"] == pytest.approx(report["planned"]["noise_std"], rel=1e-12) for r in rows)
    assert report["realized"]["rounds_below_planned_noise"] == []
    assert main(["audit", "--ledger", str(out / "ledger.db")]) == 0
    assert "secure aggregation  SecAgg+: degree 6, threshold 4, modulo 2^32" in capsys.readouterr().out
    # a resume with other secure-aggregation parameters, or without it, is another plan: refused
    monkeypatch.delenv(REPEATABLE_NOISE_ENV)
    for extra in (["--secure-aggregation", "--secagg-degree", "6", "--secagg-threshold", "4", "--secagg-scale",
                   "1024"], []):
        assert main(_simulate(out, "--rounds", "2", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "another plan" in err


def test_the_audit_replays_sigma_from_zeta_eff_and_refuses_a_forged_inflation(tmp_path, capsys,
                                                                             secagg_entry_point):
    import shutil
    import sqlite3

    out = tmp_path / "secure"
    assert main(_simulate(out, "--rounds", "2", "--secure-aggregation", "--secagg-scale", "64")) == 0
    capsys.readouterr()
    # round 0 recorded with σ at ζ, not ζ_eff: below the plan's noise, which the audit replays from ζ_eff
    low = tmp_path / "low.db"
    shutil.copy(out / "ledger.db", low)
    with sqlite3.connect(low) as db:
        [(inflation,)] = db.execute("SELECT json_extract(plan, '$.secure_aggregation.inflation') FROM runs")
        assert inflation > 1.001  # a coarse scale: a visible inflation
        db.execute("UPDATE rounds SET noise_std = noise_std / ? WHERE round_index = 0", (inflation,))
    assert main(["audit", "--ledger", str(low), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["realized"]["rounds_below_planned_noise"] == [0]
    forged = tmp_path / "forged.db"
    shutil.copy(out / "ledger.db", forged)
    with sqlite3.connect(forged) as db:
        db.execute("UPDATE runs SET plan = json_set(plan, '$.secure_aggregation.inflation', 1.0)")
    assert main(["audit", "--ledger", str(forged)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "recorded quantization inflation 1.0 is not" in err


@pytest.mark.parametrize("argv, message", [
    (["--secagg-degree", "4"], "--secagg-degree needs --secure-aggregation"),
    (["--secure-aggregation", "--secagg-degree", "3", "--secagg-threshold", "3"], "even"),
    (["--secure-aggregation", "--secagg-degree", "4"], "both 0 (derived from the cohort) or both set"),
    (["--secure-aggregation", "--secagg-threshold", "3"], "threshold"),
    (["--secure-aggregation", "--secagg-bits", "80"], "bits"),
    (["--secure-aggregation", "--secagg-scale", "-1"], "--secagg-scale must be a positive number"),
    (["--secure-aggregation", "--secagg-bits", "12"], "could wrap"),
    (["--secure-aggregation", "--secagg-threshold", "9", "--secagg-degree", "16"], "threshold 9: every round "
                                                                                   "would abort"),
])
def test_a_bad_secure_aggregation_option_is_one_line_and_exit_2(tmp_path, capsys, argv, message,
                                                                secagg_entry_point):
    assert main(_simulate(tmp_path / "bad", "--rounds", "2", *argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_flower_backend_gets_the_apps_secure_aggregation_keys(tmp_path, capsys, monkeypatch):
    import launcher.flower_cli as launcher
    from server.config import APP_DEFAULTS, ServerConfig

    seen = {}

    def spy(root, **kw):
        seen.update(kw["run_config"])
        raise RuntimeError("not launched in this test")

    monkeypatch.setattr(launcher, "run_simulation", spy)
    assert main(_simulate(tmp_path / "fl", "--rounds", "2", "--backend", "flower", "--secure-aggregation",
                          "--secagg-degree", "6", "--secagg-threshold", "4", "--secagg-bits", "40",
                          "--secagg-scale", "4096")) == 2
    assert "could not start" in capsys.readouterr().err
    assert set(seen) == set(APP_DEFAULTS)
    assert (seen["secure-aggregation"], seen["secagg-degree"], seen["secagg-threshold"], seen["secagg-bits"],
            seen["secagg-scale"]) == ("secaggplus", 6, 4, 40, 4096.0)
    assert ServerConfig.from_mapping(seen).secagg == SecAggParams(6, 4, 40, 4096.0, stage_timeout_s=120.0)


def test_the_flower_backend_refuses_a_sum_that_could_wrap_before_any_process(tmp_path, capsys, monkeypatch):
    import launcher.flower_cli as launcher

    monkeypatch.setattr(launcher, "run_simulation", lambda *a, **k: pytest.fail("launched"))
    assert main(_simulate(tmp_path / "fl", "--rounds", "2", "--backend", "flower", "--secure-aggregation",
                          "--secagg-bits", "12")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "could wrap" in err


@pytest.mark.heavy  # a real Flower simulation (SuperLink, Ray, one SuperNode per user): about a minute or more
def test_both_backends_with_secure_aggregation_agree_up_to_the_quantization(tmp_path, capsys, monkeypatch,
                                                                           secagg_entry_point):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the same noise in both backends' runs
    argv = ["--rounds", "2", "--min-sep", "1", "--secure-aggregation", "--secagg-degree", "6",
            "--secagg-threshold", "4"]
    runs = {}
    for backend in ("flower", "inprocess"):
        fixed.write_secrets(tmp_path / backend)
        assert main(_simulate(tmp_path / backend, *argv, "--backend", backend)) == 0, capsys.readouterr().err[-3000:]
        runs[backend] = json.loads(capsys.readouterr().out)
    flower, local = runs["flower"], runs["inprocess"]
    assert flower["rounds_done"] == local["rounds_done"] == 2
    assert [h["contributed"] for h in flower["history"]] == [h["contributed"] for h in local["history"]] == [8, 8]
    a = torch.load(tmp_path / "flower" / "final-model.pt")
    b = torch.load(tmp_path / "inprocess" / "final-model.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-3  # each side rounds its own updates
    for backend in ("flower", "inprocess"):
        assert main(["audit", "--ledger", str(tmp_path / backend / "ledger.db"), "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)["planned"]
        assert (planned["secure_aggregation"]["degree"], planned["secure_aggregation"]["threshold"]) == (6, 4)
