"""The read-only audit: every number against brute force or a reference value."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import pytest
from sqlalchemy import text

from fedmf import FixedEpoch, MinSep, Observed, Workload
from fedmf.accounting.run_privacy import release_rows, run_privacy
from fedmf.audit.replay import audit
from fedmf.ledger import Ledger, LedgerError
from fedmf.ledger.db import reader_engine, resolve_url
from fedmf.mechanisms import build
from fedmf.sensitivity import exhaustive_minsep, pattern_sensitivity, sensitivity
from tests.ledger_helpers import SECRET, mechanism_file


def _check_epsilon(eps: float, z: float, delta: float = 1e-6) -> None:
    """eps is the epsilon at delta of a Gaussian with multiplier z: dp_accounting's exact
    delta(eps) curve crosses delta there (independent of fedmf.accounting)."""
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    loss = GaussianPrivacyLoss(z, sensitivity=1.0)
    assert loss.get_delta_for_epsilon(eps) <= delta * (1 + 1e-9)
    assert loss.get_delta_for_epsilon(max(eps - 1e-7 * max(eps, 1.0), 0.0)) > delta


def _pld_epsilon(z: float, delta: float) -> float:
    """dp_accounting's PLD accountant, independent of fedmf.accounting."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.pld import PLDAccountant

    if not np.isfinite(z):
        return 0.0
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(GaussianDpEvent(z))
    return acc.get_epsilon(delta)


def record(url, tmp_path, kind, n, schema, *, z=2.0, clients=8, per_round=4, seed=0, enforce=True,
           schedule=None, **build_kwargs):
    """A run recorded through the API: random candidates each round (or ``schedule``:
    client -> rounds, with enforce off). Returns (run info, {client: rounds contributed})."""
    path = mechanism_file(tmp_path, kind=kind, rounds=n, schema=schema, **build_kwargs)
    rng = random.Random(seed)
    history: dict[str, list[int]] = {}
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.create_run(path, noise_multiplier=z, clip_norm=1.0, delta=1e-6)
        sigma = z * 1.0 * sensitivity(build(kind, n, schema, Workload(), **build_kwargs), schema).value
        for t in range(n):
            run.open_round(t)
            if schedule is None:
                candidates = rng.sample([f"c{i}" for i in range(clients)], per_round)
            else:
                candidates = [c for c, rounds in schedule.items() if t in rounds]
            for c in run.record_selection(t, candidates, enforce=enforce and schedule is None):
                run.record_contribution(t, c, rng.uniform(0.1, 2.0))
                history.setdefault(c, []).append(t)
            run.commit_round(t, noise_std=sigma)
        return run.info, history, run


def _prefix(c: np.ndarray, rows: np.ndarray, pattern, t: int) -> float:
    """|| C[:R(t), pi<=t] · 1 ||: a user's prefix sensitivity for C >= 0, directly."""
    cols = [i for i in pattern if i <= t]
    return float(np.linalg.norm(c[: rows[t], cols].sum(axis=1)))


@pytest.mark.parametrize("kind, n, schema, kwargs", [
    ("dp-sgd", 12, MinSep(3, 3), {}),
    ("bsr", 12, MinSep(3, 4), {"num_bands": 3}),
    ("bisr", 12, MinSep(2, 4), {}),
    ("tree", 12, MinSep(4, 3), {}),
    ("bsr", 12, MinSep(12, 1), {"num_bands": 4}),  # single participation
])
def test_epsilon_by_round_matches_brute_force(tmp_path, kind, n, schema, kwargs):
    url = str(tmp_path / "l.db")
    info, history, _ = record(url, tmp_path, kind, n, schema, z=1.5, **kwargs)
    report = audit(url)
    mech = build(kind, n, schema, Workload(), **kwargs)
    c, rows = mech.strategy_matrix(), release_rows(mech)
    assert c.min() >= 0
    s_plan = sensitivity(mech, schema).value
    b, k = schema.min_sep, schema.participations(n)
    assert report.planned["sensitivity"] == pytest.approx(s_plan, rel=1e-12)
    assert [r["round"] for r in report.rounds] == list(range(n))
    for r in report.rounds:
        t = r["round"]
        worst = max(_prefix(c, rows, p, t) for p in history.values())
        assert r["sensitivity_worst_user"] == pytest.approx(worst, rel=1e-10), t
        _check_epsilon(r["epsilon_worst_user"], 1.5 * s_plan / worst)
        _check_epsilon(r["epsilon_planned"], 1.5 * s_plan / r["sensitivity_planned"])
        # the plan: brute force over every pattern MinSep(b, k) allows within the prefix
        brute = exhaustive_minsep(c[: rows[t], : t + 1], b, k)
        if report.planned["curve_exact"]:
            assert r["sensitivity_planned"] == pytest.approx(brute, rel=1e-10), t
        else:  # the full-horizon value: a sound upper bound
            assert r["sensitivity_planned"] >= brute - 1e-12
        assert r["sensitivity_worst_user"] <= r["sensitivity_planned"] * (1 + 1e-12)  # enforced
    assert report.planned["curve_exact"] == (kind != "tree")  # the tree's prefixes have no closed form
    # the last round: the worst user over the whole run, as fedmf.sensitivity computes it
    observed = Ledger.open(url).observed_pattern(info.id)
    assert report.realized["worst_user_sensitivity"] == pytest.approx(sensitivity(mech, observed).value, rel=1e-10)
    assert report.planned["epsilon"] == pytest.approx(_pld_epsilon(1.5, 1e-6), rel=2e-3)
    assert report.realized["flagged_users"] == 0 and report.flagged == []


def test_worst_pattern_reproduces_the_reference_gaussian_epsilon(ledger_url, tmp_path):
    # DP-SGD (C = I), MinSep(3, 4) over 12 rounds: sens = sqrt(4); a user in rounds 0, 3, 6, 9
    # has exactly the planned sensitivity, so after round 9 it spent eps(z = 10) = 0.396857
    # (tests/data/accounting.json, single Gaussian, delta 1e-6).
    schedule = {"worst": [0, 3, 6, 9], "light": [1, 7], "never-twice": [5]}
    _, history, _ = record(ledger_url, tmp_path, "dp-sgd", 12, MinSep(3, 4), z=10.0, schedule=schedule)
    report = audit(ledger_url)
    assert history == schedule
    by_round = {r["round"]: r for r in report.rounds}
    assert by_round[9]["epsilon_worst_user"] == pytest.approx(0.396857, abs=1e-4)
    assert by_round[11]["epsilon_worst_user"] == pytest.approx(0.396857, abs=1e-4)
    assert report.planned["epsilon"] == pytest.approx(0.396857, abs=1e-4)
    # after round 0: one participation of four, z_eff = 10 * 2 = 20 -> 0.189213 (same reference file)
    assert by_round[0]["epsilon_worst_user"] == pytest.approx(0.189213, abs=1e-4)
    assert by_round[0]["sensitivity_worst_user"] == 1.0 and by_round[3]["sensitivity_worst_user"] == pytest.approx(2**0.5)
    r = report.realized
    assert (r["users"], r["contributions"], r["min_separation"], r["max_participations"]) == (3, 7, 3, 4)
    assert report.histogram == {1: 1, 2: 1, 4: 1}
    assert [x["min_separation"] for x in report.rounds] == [None] * 3 + [3] * 9
    assert [x["max_participations"] for x in report.rounds] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert r["rounds_committed"] == 12 and r["last_committed_round"] == 11 and r["flagged_users"] == 0
    assert r["client_state_consistent"] is True
    # ρ-zCDP beside ε (Bun & Steinke 2016, Prop. 1.6): multiplier 10 for the plan and the worst user
    assert report.planned["rho"] == pytest.approx(0.5 / 10**2, rel=1e-12)
    assert r["rho_worst_user_at_end"] == pytest.approx(0.5 / 10**2, rel=1e-12)
    assert "ρ-zCDP = 0.005" in "\n".join(report.lines())


def test_a_client_state_that_disagrees_with_the_participations_is_reported(tmp_path):
    url = str(tmp_path / "l.db")
    record(url, tmp_path, "dp-sgd", 6, MinSep(2, 3))
    assert audit(url).realized["client_state_consistent"] is True
    with Ledger.open(url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text("UPDATE client_state SET contributions = contributions - 1"))
    report = audit(url)
    assert report.realized["client_state_consistent"] is False
    assert any("client_state" in line for line in report.lines())


def test_users_who_broke_the_plan_are_flagged(ledger_url, tmp_path):
    schedule = {"too-close": [0, 2, 8], "too-often": [1, 5, 9, 13, 17], "fine": [3, 11]}
    info, _, run = record(ledger_url, tmp_path, "bsr", 20, MinSep(4, 4), z=3.0, schedule=schedule,
                          num_bands=4)
    report = audit(ledger_url)
    key = {c: run.key(c).hex()[:16] for c in schedule}
    flagged = {f["user"]: f for f in report.flagged}
    assert set(flagged) == {key["too-close"], key["too-often"]}
    # the reasons are fedmf.accounting.posthoc's (the audit accounts flagged users through it)
    assert flagged[key["too-close"]]["reasons"] == ["two participations 2 rounds apart < min_sep 4"]
    assert flagged[key["too-close"]]["rounds"] == [0, 2, 8] and flagged[key["too-close"]]["min_separation"] == 2
    assert flagged[key["too-often"]]["reasons"] == ["5 participations > 4"]
    mech = build("bsr", 20, MinSep(4, 4), Workload(), num_bands=4)
    s_plan = report.planned["sensitivity"]
    for client in ("too-close", "too-often"):
        f = flagged[key[client]]
        s_user = sensitivity(mech, Observed.from_mapping({"u": schedule[client]})).value
        assert f["sensitivity"] == pytest.approx(s_user, rel=1e-10) and f["sensitivity_exact"]
        _check_epsilon(f["epsilon"], 3.0 * s_plan / s_user)
    # five participations exceed what the plan's noise covers; three too close together do not
    assert flagged[key["too-often"]]["sensitivity"] > s_plan
    assert flagged[key["too-often"]]["epsilon"] > report.planned["epsilon"]
    assert flagged[key["too-close"]]["sensitivity"] < s_plan
    assert report.flagged[0]["epsilon"] >= report.flagged[1]["epsilon"]  # worst first
    r = report.realized
    assert (r["min_separation"], r["max_participations"], r["flagged_users"]) == (2, 5, 2)
    assert report.histogram == {2: 1, 3: 1, 5: 1}
    assert r["epsilon_worst_user"] > report.planned["epsilon"]
    dumped = str(report.to_dict())
    assert not any(name in dumped for name in schedule)  # only key prefixes, never identifiers


def test_fixed_epoch_plan_curve_is_the_worst_of_its_patterns(tmp_path):
    url = str(tmp_path / "l.db")
    schema = FixedEpoch(3, 4)  # n = 12, patterns {j, j+4, j+8}
    schedule = {f"slot{j}": [j, j + 4, j + 8] for j in range(4)}
    record(url, tmp_path, "bisr", 12, schema, schedule=schedule)
    report = audit(url)
    mech = build("bisr", 12, schema, Workload())
    c, rows = mech.strategy_matrix(), release_rows(mech)
    for r in report.rounds:
        t = r["round"]
        expected = max(_prefix(c, rows, p, t) for p in schema.patterns())
        assert r["sensitivity_planned"] == pytest.approx(expected, rel=1e-12)
        assert r["sensitivity_worst_user"] == pytest.approx(expected, rel=1e-12)  # every slot is used
    assert report.planned["sensitivity"] == pytest.approx(sensitivity(mech, schema).value)
    assert report.flagged == [] and report.planned["schema"] == "fixed-epoch"


def test_snapshots_aborts_and_noise_below_the_plan_are_reported(ledger_url, tmp_path):
    path = mechanism_file(tmp_path, kind="dp-sgd", rounds=8, schema=MinSep(2, 4))
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        run = ledger.create_run(path, noise_multiplier=2.0, clip_norm=0.5, delta=1e-6, target_epsilon=5.0)
        sigma = 2.0 * 0.5 * 2.0  # z · clip · sqrt(k)
        for t, client in enumerate(["a", "b", "a"]):
            run.open_round(t)
            run.record_selection(t, [client])
            run.record_contribution(t, client, 0.3)
            if t == 1:
                run.abort_round(t, "lost quorum")
                run.open_round(t)
                run.record_selection(t, [client])
                run.record_contribution(t, client, 0.4)
            run.commit_round(t, noise_std=sigma if t != 2 else 0.9 * sigma,
                             epsilon_worst_user=0.1 * (t + 1), epsilon_planned=0.2 * (t + 1))
        run.open_round(3)  # left open: the audit sees it but counts nothing from it
        run.record_selection(3, ["a"])
        report = audit(ledger_url)
    by_round = {r["round"]: r for r in report.rounds}
    assert [r["status"] for r in report.rounds] == ["committed", "committed", "committed", "open"]
    assert by_round[1]["attempts"] == 2 and report.realized["aborts"] == 1
    assert by_round[2]["recorded_epsilon_worst_user"] == pytest.approx(0.3)
    assert by_round[2]["recorded_epsilon_planned"] == pytest.approx(0.6)
    assert by_round[3]["epsilon_worst_user"] is None and by_round[3]["contributed"] == 0
    assert report.realized["rounds_below_planned_noise"] == [2]
    assert report.planned["noise_std"] == pytest.approx(sigma)
    assert report.realized["rounds_open"] == 1 and report.realized["rounds_committed"] == 3
    assert report.run["target_epsilon"] == 5.0
    # a: rounds 0 and 2; b: round 1 -> worst after round 2 is a with sqrt(2) (C = I)
    assert by_round[2]["sensitivity_worst_user"] == pytest.approx(2**0.5)
    assert report.histogram == {1: 1, 2: 1}


def test_a_run_without_committed_rounds(ledger_url, tmp_path):
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        ledger.create_run(mechanism_file(tmp_path), noise_multiplier=1.0, clip_norm=1.0, delta=1e-6)
    report = audit(ledger_url, 1)
    r = report.realized
    assert (r["users"], r["rounds_committed"], r["epsilon_worst_user"], r["min_separation"]) == (0, 0, None, None)
    assert report.rounds == [] and report.histogram == {} and report.flagged == []
    report.plot(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_audit_never_writes(ledger_url, tmp_path):
    record(ledger_url, tmp_path, "bsr", 12, MinSep(3, 4), num_bands=3)
    if "://" not in ledger_url:
        before = hashlib.sha256(open(ledger_url, "rb").read()).hexdigest()
        mtime = os.stat(ledger_url).st_mtime_ns
        audit(ledger_url)
        assert hashlib.sha256(open(ledger_url, "rb").read()).hexdigest() == before
        assert os.stat(ledger_url).st_mtime_ns == mtime
        assert not os.path.exists(ledger_url + "-journal")
        # WAL mode, closed by the server: read as immutable, no WAL index is created beside it
        assert not os.path.exists(ledger_url + "-wal") and not os.path.exists(ledger_url + "-shm")
        message = "readonly database"
    else:
        message = "read-only transaction"
    engine = reader_engine(resolve_url(ledger_url))
    try:
        with engine.connect() as conn:
            with pytest.raises(Exception, match=message):
                conn.execute(text("UPDATE rounds SET selected = 99"))
    finally:
        engine.dispose()
    assert all(r["selected"] != 99 for r in audit(ledger_url).rounds)


def test_audit_errors(ledger_url, tmp_path):
    record(ledger_url, tmp_path, "dp-sgd", 6, MinSep(2, 3))
    with pytest.raises(LedgerError, match="no run with id 5"):
        audit(ledger_url, 5)
    with Ledger.open(ledger_url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text("UPDATE fedmf_ledger_version SET version_num = '0007'"))
    with pytest.raises(LedgerError, match="newer than this fedmf"):
        audit(ledger_url)


def test_a_tampered_mechanism_is_refused(tmp_path):
    url = str(tmp_path / "l.db")
    record(url, tmp_path, "dp-sgd", 6, MinSep(2, 3))
    with Ledger.open(url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET mechanism_document = replace(mechanism_document, '\"rounds\": 6', "
                          "'\"rounds\": 7')"))
    with pytest.raises(LedgerError, match="failed its checksum"):
        audit(url)


def test_negative_strategies_get_sound_bounds():
    """C with negative entries: (1) with |C| is an upper bound, tightened per user by
    pattern_sensitivity on the Gram matrix; never below the brute-force sensitivity."""
    from fedmf.mechanisms.identity import DpSgd

    rng = np.random.default_rng(4)
    c = np.tril(rng.normal(size=(8, 8))) + 3 * np.eye(8)

    class Signed(DpSgd):
        def strategy_matrix(self):
            return c.copy()

        @property
        def strategy_toeplitz(self):
            return None

        @property
        def strategy_bands(self):
            return None

        def column_norms_sq(self):
            return np.sum(c**2, axis=0)

    mech = Signed(8, Workload())
    patterns = [[0, 3, 6], [1, 5], [2, 4, 7]]
    users = np.repeat(np.arange(3), [len(p) for p in patterns])
    rounds = np.concatenate(patterns)
    priv = run_privacy(mech, MinSep(2, 3), 2.0, 1e-6, users, rounds, 3)
    assert not priv.observed_exact and not priv.plan_curve_exact
    for u, p in enumerate(patterns):
        brute = exhaustive_minsep(c[:, p], 1)  # max over sign vectors: the true (d = 1) value
        upper = np.linalg.norm(np.abs(c[:, p]).sum(axis=1))
        tighter = pattern_sensitivity((c.T @ c)[np.ix_(p, p)]).value
        assert priv.user_sensitivity[u] == pytest.approx(min(upper, tighter), rel=1e-12)
        assert priv.user_sensitivity[u] >= brute - 1e-9
    assert priv.sensitivity_plan == pytest.approx(sensitivity(mech, MinSep(2, 3)).value)
    assert priv.plan_by_round[-1] == pytest.approx(priv.sensitivity_plan)
    assert np.all(np.diff(priv.plan_by_round) >= -1e-12)
    for u in range(3):
        _check_epsilon(priv.epsilon_user[u], 2.0 * priv.sensitivity_plan / priv.user_sensitivity[u])


def test_the_audits_per_user_epsilon_is_account_observed(ledger_url, tmp_path):
    """One implementation of post-hoc accounting: the audit's values for every user are
    fedmf.accounting.posthoc.account_observed's on the run's observed pattern."""
    from fedmf.accounting import account_observed
    from fedmf.ledger.queries import fetch_contributions

    schema = MinSep(4, 4)
    schedule = {"too-often": [1, 5, 9, 13, 17], "fine": [3, 11], "close": [0, 2, 8], "once": [6], "two": [4, 19]}
    info, _, _ = record(ledger_url, tmp_path, "bsr", 20, schema, z=3.0, schedule=schedule, num_bands=6)
    mech = build("bsr", 20, schema, Workload(), num_bands=6)
    with Ledger.open(ledger_url) as ledger:
        expected = account_observed(mech, 3.0, 1e-6, ledger.observed_pattern(info.id), schema)
        with ledger.engine.connect() as conn:
            keys, users, rounds = fetch_contributions(conn, info.id)  # what the audit reads
    priv = run_privacy(mech, schema, 3.0, 1e-6, users, rounds, len(keys), [k.tobytes().hex() for k in keys])
    assert priv.posthoc.users == expected.users
    assert priv.epsilon_user.tolist() == expected.epsilons().tolist()
    report = audit(ledger_url)
    assert report.realized["epsilon_worst_user_at_end"] == expected.epsilon
    assert report.realized["worst_user_sensitivity"] == max(u.sensitivity for u in expected.users)
    assert {f["user"]: (f["epsilon"], f["sensitivity"], f["reasons"]) for f in report.flagged} == {
        u.user[:16]: (u.epsilon, u.sensitivity, [u.violation]) for u in expected.violators}
    assert len(report.flagged) == 2


def test_a_ledger_in_a_directory_the_auditor_cannot_write(tmp_path, monkeypatch):
    """SQLite cannot create the WAL index beside a read-only ledger: with no server holding it
    open (no -wal), the audit reads it as immutable, creating nothing."""
    url = str(tmp_path / "l.db")
    record(url, tmp_path, "dp-sgd", 6, MinSep(2, 3))
    expected = audit(url).to_dict()
    for suffix in ("-wal", "-shm"):
        if os.path.exists(url + suffix):
            os.unlink(url + suffix)
    monkeypatch.setattr("fedmf.ledger.db.os.access", lambda path, mode: False)
    assert audit(url).to_dict() == expected
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("l.db")) == ["l.db"]


def test_rounds_carry_the_checkpoint_hash_and_the_absolute_noise_std(tmp_path):
    url = str(tmp_path / "l.db")
    path = mechanism_file(tmp_path, kind="dp-sgd", rounds=4, schema=MinSep(2, 2))
    digest = hashlib.sha256(b"checkpoint 0").hexdigest()
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.create_run(path, noise_multiplier=3.0, clip_norm=0.25, delta=1e-6)
        sigma = 3.0 * 0.25 * 2**0.5  # z · clip_norm · sens; z · sens alone (4.24) would be a different unit
        for t, (client, noise) in enumerate([("a", sigma), ("b", 3.0 * 2**0.5 * 0.2)]):
            run.open_round(t)
            run.record_selection(t, [client])
            run.record_contribution(t, client, 0.1)
            run.commit_round(t, noise_std=noise, checkpoint_sha256=digest if t == 0 else None)
    report = audit(url)
    assert report.planned["noise_std"] == pytest.approx(sigma, rel=1e-12)
    assert report.realized["rounds_below_planned_noise"] == [1]
    assert [r["checkpoint_sha256"] for r in report.rounds] == [digest, None]
    report.write_csv(tmp_path / "rounds.csv")
    import csv

    with open(tmp_path / "rounds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["checkpoint_sha256"] for r in rows] == [digest, ""]
    assert "norm_max" not in rows[0] and "clipped" not in rows[0]  # no diagnostics recorded: none exported


def test_an_adaptively_clipped_round_is_checked_against_its_own_clip_norm(tmp_path):
    # σₜ = z · ζₜ · sens: a round clipped at ζₜ = ζ₀/2 is noised at half the plan's σ (for ζ₀) and is not
    # below its plan; without rounds.clip_norm the same σ is below the plan's
    url = str(tmp_path / "l.db")
    path = mechanism_file(tmp_path, kind="dp-sgd", rounds=8, schema=MinSep(2, 4))
    with Ledger.open(url, secret=SECRET) as ledger:
        adaptive = {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_std": 1.0}
        run = ledger.create_run(path, noise_multiplier=2.0, clip_norm=0.5, delta=1e-6,
                                plan={"adaptive_clipping": adaptive})  # only an adaptive run's ζₜ is read
        for t, client in enumerate(["a", "b"]):
            run.open_round(t)
            run.record_selection(t, [client])
            run.record_contribution(t, client, 0.3)
            run.commit_round(t, noise_std=2.0 * 0.25 * 2.0)  # z · ζₜ · sqrt(k), ζₜ = 0.25
        assert audit(url).realized["rounds_below_planned_noise"] == [0, 1]
        with ledger.engine.begin() as conn:
            conn.execute(text("UPDATE rounds SET clip_norm = 0.25 WHERE round_index = 0"))
        assert audit(url).realized["rounds_below_planned_noise"] == [1]
