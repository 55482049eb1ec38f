"""Client-reported metrics (issue 34, item 2): nothing a client reports leaves the server as sent; the
opt-in private release (fedmf.round.client_metrics) is exactly (Σ clip(vᵢ, 0, L) + N(0, σ_m²)) / m, and its
privacy is composed into the accountant, the calibration, ρ, the lifetime budgets and the audit —
each checked against an independent computation (the analytic Gaussian in mpmath, dp_accounting)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from flwr.app import MessageType, MetricRecord

from fedmf import MinSep
from fedmf.accounting import calibrate, epsilon, epsilon_by_round
from fedmf.accounting.gdp import run_mu_squared
from fedmf.accounting.releases import CLIENT_METRICS, COUNT, ExtraReleases, GaussianRelease
from fedmf.audit.replay import audit
from fedmf.config import RunConfig
from fedmf.errors import ConfigError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.count_noise import count_noise, metric_noise
from fedmf.round.draws import key_of
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.tasks.base import LocalResult
from server.config import ServerConfig
from tests import _federated_task as task
from tests.accounting.test_count_release import analytic_epsilon, check_cyclic, pld_of

SCHEMA = MinSep(8, 4)  # k = 4 participations in n = 64 rounds
CYCLIC = MinSep(16, 4)
K = 4


@pytest.fixture(scope="module")
def bsr():
    return build("bsr", 64, SCHEMA, num_bands=8)


def metric(clip: float, std: float) -> GaussianRelease:
    return GaussianRelease(CLIENT_METRICS, clip, std)


# ---- accounting: 1/z_eff² = 1/z² + k·(1/σ_b² + L²/σ_m²) ------------------------------------------------
@pytest.mark.parametrize("z,clip,sigma_m,sigma_b,delta", [(1.0, 3.0, 20.0, None, 1e-6), (0.8, 1.0, 4.0, 2.0, 1e-10),
                                                           (2.5, 10.0, 50.0, 10.0, 1e-12)])
def test_unamplified_metric_release_is_the_analytic_gaussian(bsr, z, clip, sigma_m, sigma_b, delta):
    count = None if sigma_b is None else GaussianRelease(COUNT, 1.0, sigma_b)
    releases = ExtraReleases.of(count, metric(clip, sigma_m))
    result = epsilon(bsr, z, delta, SCHEMA, releases=releases)
    count_term = 0.0 if sigma_b is None else K / sigma_b**2
    metric_term = K * clip**2 / sigma_m**2
    mu2 = 1 / z**2 + count_term + metric_term
    assert result.epsilon == pytest.approx(analytic_epsilon(math.sqrt(mu2), delta), rel=1e-9)
    assert result.rho == pytest.approx(mu2 / 2, rel=1e-12)  # zCDP adds: Bun & Steinke 2016, Lemma 1.7
    split = result.details["privacy_split"]
    assert split[CLIENT_METRICS] == pytest.approx(metric_term / mu2, rel=1e-12)
    assert split["mf"] == pytest.approx((1 / z**2) / mu2, rel=1e-12)
    assert split.get(COUNT, 0.0) == pytest.approx(count_term / mu2, rel=1e-12)
    assert sum(split.values()) == pytest.approx(1.0, rel=1e-14)
    assert result.details["extra_releases"][-1] == {"name": CLIENT_METRICS, "sensitivity": clip, "noise_std": sigma_m}
    assert "count_noise_std" not in result.details  # σ_unit is not σ_b here: it is named for what it is


def test_the_metric_release_matches_dp_accounting_of_the_separate_gaussians(bsr):
    z, clip, sigma_m, delta = 1.2, 2.0, 9.0, 1e-8
    releases = ExtraReleases.of(metric(clip, sigma_m))
    events = [dp_accounting.GaussianDpEvent(z)] + [dp_accounting.GaussianDpEvent(sigma_m / clip)] * K
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.ComposedDpEvent(events))
    ours = epsilon(bsr, z, delta, SCHEMA, releases=releases, accountant="rdp").epsilon
    assert ours == pytest.approx(float(rdp.get_epsilon(delta)), rel=1e-9)  # RDP of Gaussians adds exactly


def test_the_count_alone_is_unchanged_through_the_description(bsr):
    """A description holding only the count gives the very numbers count_noise_std gives (bit for bit)."""
    for sampling, schema in (("none", SCHEMA), ("cyclic-poisson:0.25", CYCLIC)):
        a = epsilon(bsr, 1.1, 1e-6, schema, sampling=sampling, count_noise_std=3.0)
        b = epsilon(bsr, 1.1, 1e-6, schema, sampling=sampling, releases=ExtraReleases.count(3.0))
        assert a.epsilon == b.epsilon and a.details == b.details and a.rho == b.rho
    a = calibrate(bsr, 2.0, 1e-6, SCHEMA, count_noise_std=10.0)
    b = calibrate(bsr, 2.0, 1e-6, SCHEMA, releases=ExtraReleases.count(10.0))
    assert a.noise_multiplier == b.noise_multiplier


def _cyclic_case(bsr):
    """Our cyclic-Poisson ε with the count and the metric release, and the per-step event built here:
    PoissonSampled(q, Gaussian(z_step)) with 1/z_step² = col²/σ_u² + 1/σ_b² + L²/σ_m²."""
    z, clip, sigma_m, sigma_b, q, delta = 1.0, 2.0, 10.0, 5.0, 0.25, 1e-6
    releases = ExtraReleases.of(GaussianRelease(COUNT, 1.0, sigma_b), metric(clip, sigma_m))
    result = epsilon(bsr, z, delta, CYCLIC, sampling=f"cyclic-poisson:{q}", releases=releases)
    c = bsr.strategy_matrix()
    col = float(np.sqrt((c**2).sum(axis=0)).max())
    std = z * bsr.sensitivity(CYCLIC).value
    z_step = 1 / math.sqrt(col**2 / std**2 + 1 / sigma_b**2 + clip**2 / sigma_m**2)
    return result, dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z_step)), delta


def test_cyclic_poisson_composes_the_metric_per_step(bsr):
    result, step, delta = _cyclic_case(bsr)
    # dp_accounting's PLD of the step composed with itself over the 4 steps (the full check_cyclic of
    # test_accounting_count — step by step and RDP too — is the heavy variant below)
    assert result.epsilon == pytest.approx(pld_of([dp_accounting.SelfComposedDpEvent(step, 4)], delta), rel=1e-9)
    assert result.rho is None


@pytest.mark.heavy
def test_cyclic_poisson_composes_the_metric_per_step_in_full(bsr):
    result, step, delta = _cyclic_case(bsr)
    check_cyclic(result.epsilon, step, 4, delta)


def test_calibration_inverts_epsilon_with_the_metric_release(bsr):
    releases = ExtraReleases.of(metric(4.0, 100.0))
    for target, delta in ((2.0, 1e-6), (1.0, 1e-12)):
        result = calibrate(bsr, target, delta, SCHEMA, releases=releases)
        spent = epsilon(bsr, result.noise_multiplier, delta, SCHEMA, releases=releases).epsilon
        assert spent <= target and spent == pytest.approx(target, rel=1e-9)
        assert result.noise_multiplier > calibrate(bsr, target, delta, SCHEMA).noise_multiplier
    with pytest.raises(ConfigError, match="client-metric release alone would spend") as info:
        calibrate(bsr, 0.5, 1e-6, SCHEMA, releases=ExtraReleases.of(metric(4.0, 1.0)))
    assert "\n" not in str(info.value)


def test_the_per_round_curve_composes_the_releases_so_far(bsr):
    z, clip, sigma_m, delta = 1.0, 3.0, 12.0, 1e-6
    releases = ExtraReleases.of(metric(clip, sigma_m))
    curve = epsilon_by_round(bsr, z, delta, SCHEMA, releases=releases)
    assert curve.epsilons[-1] == pytest.approx(epsilon(bsr, z, delta, SCHEMA, releases=releases).epsilon, rel=1e-12)
    col0 = float(np.linalg.norm(bsr.strategy_matrix()[:1, 0]))
    std = z * bsr.sensitivity(SCHEMA).value
    mu1 = math.sqrt(col0**2 / std**2 + clip**2 / sigma_m**2)  # round 1: one column, one metric release
    assert curve.epsilons[0] == pytest.approx(analytic_epsilon(mu1, delta), rel=1e-9)


# ---- the plan, the refused samplers, the budgets and the audit -----------------------------------------
def _plan(bsr, **kw) -> RunPlan:
    return RunPlan.create(bsr, SCHEMA, clip_norm=1.0, delta=1e-6, expected_users=10, **kw)


def test_the_plan_accounts_the_release_and_keeps_old_fingerprints(bsr):
    release = ClientMetricRelease.create(5.0, 25.0, expected_users=10)
    plan = _plan(bsr, noise_multiplier=1.3, client_metrics=release)
    mu2 = 1 / 1.3**2 + K * 5.0**2 / 25.0**2
    assert plan.epsilon() == pytest.approx(analytic_epsilon(math.sqrt(mu2), 1e-6), rel=1e-9)
    assert plan.rho() == pytest.approx(mu2 / 2, rel=1e-12)
    assert run_mu_squared(plan) == pytest.approx(mu2, rel=1e-12)  # what a lifetime budget charges
    summary = plan.summary()
    assert summary["client_metrics"] == {"metric": "train-loss", "clip": 5.0, "noise_std": 25.0}
    assert summary["privacy_split"][CLIENT_METRICS] == pytest.approx(K * 5.0**2 / 25.0**2 / mu2, rel=1e-12)
    assert RunPlan.from_dict(plan.to_dict(), bsr).fingerprint == plan.fingerprint
    plain = _plan(bsr, noise_multiplier=1.3)
    assert "client_metrics" not in plain.to_dict() and plain.fingerprint != plan.fingerprint
    assert plain.epsilon() < plan.epsilon()
    # with a target ε, z is solved with the release composed in; the whole run meets the target
    target = _plan(bsr, target_epsilon=3.0, client_metrics=release)
    assert target.epsilon() <= 3.0 and target.epsilon() == pytest.approx(3.0, rel=1e-9)
    # default noise: σ_m = L·m/20
    assert ClientMetricRelease.create(5.0, expected_users=10).noise_std == 5.0 * 10 / 20


@pytest.mark.parametrize("sampling,schema", [("bminsep:0.1", SCHEMA), ("poisson:0.1", MinSep(1, 64))])
def test_samplers_the_count_refuses_refuse_the_metric_release(sampling, schema):
    mechanism = build("bsr", 64, SCHEMA, num_bands=8) if sampling.startswith("bminsep") else build("dp-sgd", 64,
                                                                                                   schema)
    release = ClientMetricRelease.create(2.0, 10.0, expected_users=100)
    with pytest.raises(ConfigError, match="client-metric release is accounted with sampling none") as info:
        RunPlan.create(mechanism, schema, clip_norm=1.0, delta=1e-6, expected_users=100, noise_multiplier=1.0,
                       sampling=sampling, client_metrics=release)
    assert "\n" not in str(info.value)


def test_the_budget_charge_includes_the_release(tmp_path, bsr):
    from fedmf.budgets import RunBudget
    from fedmf.ledger import Ledger
    from fedmf.ledger.budgets import load_budget_secret, set_default

    secret = load_budget_secret(tmp_path / "budget.key", create=True)
    url = str(tmp_path / "ledger.db")
    adaptive = AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=3.0)
    plan = _plan(bsr, noise_multiplier=1.3, adaptive_clipping=adaptive,
                 client_metrics=ClientMetricRelease.create(5.0, 25.0, expected_users=10))
    expected = 1 / 1.3**2 + K / 3.0**2 + K * 5.0**2 / 25.0**2
    with Ledger.open(url, secret=b"s" * 32) as ledger:
        set_default(ledger, secret, 50.0)
        run = ledger.create_run(bsr, noise_multiplier=1.3, clip_norm=1.0, delta=1e-6, schema=SCHEMA)
        budget = RunBudget.open(ledger, secret, plan, run.id)
        assert budget.mu_squared == pytest.approx(expected, rel=1e-12)


def test_the_audit_shows_the_release_and_its_share(tmp_path):
    plan = task.plan(rounds=6, client_metrics=ClientMetricRelease.create(2.0, 8.0, expected_users=10))
    result = train(task.Tiny(), task.users(), plan, task.local_update, checkpoint_dir=tmp_path / "run")
    report = audit(result.ledger, result.run_id)
    k = plan.schema.participations(plan.rounds)
    mu2 = 1 / plan.noise_multiplier**2 + k * 2.0**2 / 8.0**2
    assert report.planned["epsilon"] == pytest.approx(plan.epsilon(), rel=1e-9)
    assert report.planned["privacy_split"][CLIENT_METRICS] == pytest.approx(k * 2.0**2 / 8.0**2 / mu2, rel=1e-12)
    text = "\n".join(report.lines())
    assert "client-metric release, clip L = 2, σ_m = 8" in text and "privacy split" in text


# ---- the release itself: exactly (Σ clip(vᵢ, 0, L) + N(0, σ_m²)) / m ----------------------------------
LAYOUT = {"w": (3,)}
SEED = 1234


def _privatizer(release, repeatable=True, seed=SEED):
    plan = task.plan(rounds=4, client_metrics=release)
    return plan, RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=seed, repeatable_noise=repeatable)


def test_the_release_is_the_clipped_sum_plus_the_keyed_noise_over_the_planned_users():
    release = ClientMetricRelease.create(2.0, 0.75, expected_users=10)
    plan, privatizer = _privatizer(release)
    users = ["a", "b", "c", "d", "e", "f", "g", "h"]
    updates = {u: {"w": torch.ones(3, dtype=torch.float64)} for u in users}
    updates["h"] = {"w": torch.tensor([float("nan"), 0.0, 0.0], dtype=torch.float64)}  # rejected: its value too
    values = {"a": 0.5, "b": 7.0, "c": -3.0, "d": float("nan"), "e": float("inf"), "f": "x", "h": 1.0,
              "z": 1.5}  # g reports nothing; z was not selected
    _, report = privatizer.privatize(0, updates, selected=users, values=values)
    clipped = 0.5 + 2.0 + 0.0 + 0.0 + 0.0 + 0.0 + 0.0  # a, b → L, c → 0, d/e non-finite → 0, f non-numeric → 0
    noise = metric_noise(key_of(SEED), 0, b"", 0.75)
    assert report.noisy_client_metric == (clipped + noise) / plan.expected_users  # exactly
    assert noise != 0.0 and noise != count_noise(key_of(SEED), 0, b"", 0.75)  # its own stream
    # a salted privatizer (every real run) draws fresh noise for a redone round
    draws = set()
    for _ in range(2):
        _, salted = _privatizer(release, repeatable=False)
        draws.add(salted.privatize(0, updates, selected=users, values=values)[1].noisy_client_metric)
    assert len(draws) == 2


def test_one_user_alone_shifts_the_release_by_l_over_m_against_noise_sigma_over_m():
    """The published value's distribution given the one user's loss 0 or L (whatever num-examples it
    reports: none is read): N(0, σ_m²)/m vs N(L, σ_m²)/m over many keyed draws, and exactly shifted by
    L/m under the same key."""
    release = ClientMetricRelease.create(3.0, 1.5, expected_users=10)
    m, n = 10.0, 4000
    low = np.array([release.noisy_mean([0.0], metric_noise(key_of(i + 1), 0, b"", 1.5), m) for i in range(n)])
    high = np.array([release.noisy_mean([1e9], metric_noise(key_of(i + 1), 0, b"", 1.5), m) for i in range(n)])
    sd = 1.5 / m
    assert abs(low.mean()) < 4 * sd / math.sqrt(n)
    assert abs(high.mean() - 3.0 / m) < 4 * sd / math.sqrt(n)
    assert low.std() == pytest.approx(sd, rel=0.05) and high.std() == pytest.approx(sd, rel=0.05)
    assert np.allclose(high - low, 3.0 / m, rtol=0, atol=1e-15)
    # the privatizer's release for that one user is this very draw
    plan, privatizer = _privatizer(ClientMetricRelease.create(3.0, 1.5, expected_users=10))
    _, report = privatizer.privatize(0, {"u": {"w": torch.zeros(3, dtype=torch.float64)}}, selected=["u"],
                                     values={"u": 2.718281828})
    assert report.noisy_client_metric == release.noisy_mean([2.718281828], metric_noise(key_of(SEED), 0, b"", 1.5), m)


def test_in_process_training_releases_only_the_private_value(tmp_path):
    def with_loss(params, user, t):
        update = task.local_update(params, user, t)
        return None if update is None else LocalResult(update, 8, {"train-loss": 2.718281828})

    for name, release in (("none", None), ("private", ClientMetricRelease.create(4.0, 2.0, expected_users=10))):
        plan = task.plan(rounds=4, client_metrics=release)
        result = train(task.Tiny(), task.users(), plan, with_loss, checkpoint_dir=tmp_path / name)
        logged = (tmp_path / name / "rounds.jsonl").read_text()
        assert "2.718281828" not in logged and '"train-loss"' not in logged
        for record in result.history:
            assert ("noisy-train-loss" in record.metrics) == (release is not None)
            assert "train-loss" not in record.metrics


# ---- the Flower ServerApp path (LocalGrid, the real ClientApp): nothing by default ---------------------
SYBIL_LOSS = 2.718281828


def _serve(tmp_path: Path, name: str, monkeypatch, num_examples: float, **over):
    """The ServerApp's code path over in-process nodes running the real ClientApp, with node 100's user a
    sybil reporting ``num_examples`` and the loss e; returns (Result, run dir, log text, results.json)."""
    from client.app import app as client_app
    from fedmf.tasks import get_task
    from launcher.flower_backend import flower_result
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node
    from server.strategy import DPMFStrategy

    values = {"task": "tiny", "task-options": '{"num_users": 6}', "rounds": 3, "min-sep": 2,
              "clients-per-round": 3, "noise-multiplier": 0.7, "client-lr": 0.2, "batch-size": 8,
              "run-dir": str(tmp_path / name), "reply-timeout": 5.0, **over}
    nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(6)}
    honest = nodes[100]

    def sybil(message):
        reply = honest(message)
        if message.metadata.message_type == MessageType.TRAIN and reply is not None and reply.has_content():
            reply.content["metrics"] = MetricRecord({"num-examples": num_examples, "train-loss": SYBIL_LOSS})
        return reply

    nodes[100] = sybil
    results = []
    start = DPMFStrategy.start

    def keep(self, *args, **kw):
        results.append(start(self, *args, **kw))
        return results[-1]

    monkeypatch.setattr(DPMFStrategy, "start", keep)
    logger = logging.getLogger("fedmf.server")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not .level =: it clears the logger's cached isEnabledFor answers
    try:
        run_server(LocalGrid(nodes), values)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    config = ServerConfig.from_mapping(values)
    tiny = get_task("tiny", num_users=6)
    flower_result(config, model=tiny.model(), evaluate=tiny.evaluate, plot=False)
    return results[0], tmp_path / name, "\n".join(records)


def _outputs(run_dir: Path) -> str:
    return "\n".join((run_dir / f).read_text() for f in ("rounds.jsonl", "results.json", "outcome.json"))


def test_the_server_app_publishes_no_client_metric_by_default(tmp_path, monkeypatch):
    result, run_dir, log = _serve(tmp_path, "default", monkeypatch, 1e-300)
    released = {k for metrics in result.train_metrics_clientapp.values() for k in metrics}
    assert released and not {k for k in released if "loss" in k or "example" in k}
    assert released <= {"epsilon", "rho", "selected", "received", "rejected", "dropped", "epsilon-worst-user-run"}
    history = json.loads((run_dir / "results.json").read_text())["history"]
    assert len(history) == 3
    for h in history:  # only the server's own evaluation on its held-out data, and the run's ε
        assert set(h["metrics"]) <= {"accuracy", "loss", "epsilon-worst-user-run"}, h["metrics"]
    # not the sybil's exact loss, nor any client's: no metric the clients reported, in any output or log line
    text = _outputs(run_dir) + log
    assert str(SYBIL_LOSS) not in text and "train-loss" not in text and "num-examples" not in text
    assert "fedmf round 2 (3/3 done)" in log  # the progress lines were captured


def test_the_server_apps_private_release_ignores_num_examples_and_hides_the_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the two runs draw the same noise
    private = {"client-metrics": "private", "client-metrics-clip": 4.0, "client-metrics-noise": 0.5}
    first, run_dir, log = _serve(tmp_path, "a", monkeypatch, 1e-300, **private)
    task.share_secrets(run_dir, tmp_path / "b")
    second, other_dir, _ = _serve(tmp_path, "b", monkeypatch, 8.0, **private)
    one = [m["noisy-train-loss"] for m in first.train_metrics_clientapp.values()]
    two = [m["noisy-train-loss"] for m in second.train_metrics_clientapp.values()]
    assert len(one) == 3 and one == two  # num-examples = 1e-300 weighs nothing: it is never read
    history = json.loads((run_dir / "results.json").read_text())["history"]
    assert [h["metrics"]["noisy-train-loss"] for h in history] == one
    text = _outputs(run_dir) + log
    assert str(SYBIL_LOSS) not in text and '"train-loss"' not in text and " train-loss " not in text
    for secret in (run_dir / "secrets").iterdir():  # the keys of the noise streams never appear
        if secret.is_file():
            data = secret.read_bytes()
            assert data.hex() not in text and data[:16].hex() not in text


# ---- configuration and CLI -----------------------------------------------------------------------------
def test_config_keys_build_the_release_and_refuse_bad_values():
    config = RunConfig.from_mapping({"client-metrics": "private", "client-metrics-clip": 3.0,
                                     "client-metrics-noise": 0.4, "rounds": 4})
    plan = config.build_plan()
    assert plan.client_metrics == ClientMetricRelease(3.0, 0.4)
    default = RunConfig.from_mapping({"client-metrics": "private", "rounds": 4}).build_plan()
    assert default.client_metrics == ClientMetricRelease(10.0, 10.0 * 5 / 20)  # L = 10, σ_m = L·m/20
    assert RunConfig.from_mapping({"rounds": 4}).build_plan().client_metrics is None  # the default: none
    for bad in ({"client-metrics": "exact"}, {"client-metrics-clip": 0.0}, {"client-metrics-noise": -1.0},
                {"client-metrics-clip": "inf"}):
        with pytest.raises(ConfigError) as info:
            RunConfig.from_mapping(bad)
        assert "client-metrics" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [["--client-metrics", "exact"], ["--client-metrics-clip", "2"],
                                  ["--client-metrics", "private", "--client-metrics-noise", "0"],
                                  ["--client-metrics", "private", "--client-metrics-clip", "-1"]])
def test_bad_client_metric_flags_exit_2_with_one_line(tmp_path, argv, capsys):
    from fedmf.cli import main

    try:
        code = main(["simulate", "--preset", "tiny", "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:  # argparse: a choice it does not know
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (err.startswith("fedmf: error:") and len(err.strip().splitlines()) == 1) or "usage:" in err
    assert not (tmp_path / "o").exists()


def test_simulate_with_private_client_metrics_writes_only_the_noisy_value(tmp_path, capsys):
    from fedmf.cli import main

    out = tmp_path / "o"
    assert main(["simulate", "--preset", "tiny", "--rounds", "4", "--out", str(out), "--no-plot", "--quiet",
                 "--client-metrics", "private", "--client-metrics-clip", "3", "--client-metrics-noise", "6"]) == 0
    history = json.loads((out / "results.json").read_text())["history"]
    assert len(history) == 4
    for h in history:
        assert "noisy-train-loss" in h["metrics"] and "train-loss" not in h["metrics"]
    report = audit(str(out / "ledger.db"), 1)
    assert report.planned["extra_releases"] == [{"name": CLIENT_METRICS, "sensitivity": 3.0, "noise_std": 6.0}]
