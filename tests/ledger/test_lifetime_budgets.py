"""Lifetime per-user budgets across runs that share one ledger (fedmf.budgets, fedmf.ledger.budgets, fedmf.accounting.gdp).

Every run here is tiny (8 rounds, 12 users, 3 per round): a brute force recomputes, from the ledger's
participations alone, who was over budget in each round, and checks the recorded skips, that no
over-budget user was selected, and that no user's composed μ exceeds their budget."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from scipy.special import ndtr
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fedmf import MinSep, Workload
from fedmf.accounting.gdp import compose, delta_for, epsilon_for, mu_for, run_mu_squared
from fedmf.budgets import RunBudget, user_accounts
from fedmf.errors import ConfigError
from fedmf.ledger import Ledger, LedgerError
from fedmf.ledger.budgets import load_budget_secret, round_skips, set_default, set_user
from fedmf.ledger.models import BudgetCharge, Participation, UserBudget
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.run.federated import train
from tests._federated_task import Tiny, write_secrets

ROUNDS, USERS, PER_ROUND, DELTA = 8, [f"u{i:02d}" for i in range(12)], 3, 1e-10


def _plan(z: float, adaptive: AdaptiveClipping | None = None) -> RunPlan:
    schema = MinSep(2, 3)
    mech = build("bsr", ROUNDS, schema, Workload(momentum=0.0), num_bands=2)
    return RunPlan.create(mech, schema, clip_norm=1.0, delta=1e-5, expected_users=PER_ROUND, noise_multiplier=z,
                          adaptive_clipping=adaptive)


def _update(params, user, t):
    return {name: torch.full_like(p, 0.01) for name, p in params.items()}


def _run(tmp_path, name, z, ledger, key, rounds=None, label=None, on_event=None):
    """A run that plays rounds down to one user (min_clients_per_round 1) and stops before the first
    round no user with budget left can join (fedmf.run.cohort: never a round of noise alone)."""
    directory = tmp_path / name
    write_secrets(directory, (label or name).encode())
    return train(Tiny(), USERS, _plan(z), _update, checkpoint_dir=directory, ledger=ledger, budget_key=key,
                 rounds=rounds, on_event=on_event, repeatable_noise=True, min_clients_per_round=1)


def _epsilon_allowing(mu_squares: list[float]) -> float:
    """An ε whose μ at DELTA sits just above √Σμ² (those runs fit, one more of them does not)."""
    return epsilon_for(math.sqrt(math.fsum(mu_squares)) * (1 + 1e-6), DELTA)


def _history(ledger_url, tmp_path, names):
    """{run name: (run id, {round: set of users with a participation row}, rounds committed)} from the
    ledger, keys mapped back with each run's own secret."""
    out = {}
    with Ledger.open(ledger_url) as book:
        runs = book.runs()
    for info, name in zip(runs, names):
        secret = (tmp_path / name / "secrets" / "ledger_secret").read_bytes()
        with Ledger.open(ledger_url, secret=secret) as book:
            run = book.run(info.id)
            committed = run.next_round
            back = {run.key(u): u for u in USERS}
            with Session(book.engine) as session:
                rows = session.execute(select(Participation.round_index, Participation.client_key)
                                       .where(Participation.run_id == info.id)).all()
        rounds: dict[int, set] = {}
        for t, key in rows:
            rounds.setdefault(int(t), set()).add(back[bytes(key)])
        out[name] = (info.id, rounds, committed)
    return out


def _brute_force(history, names, mu2, limits):
    """Replay the runs in order: per run and committed round, the users over budget (not yet in this
    run, and the earlier runs they took part in plus this run exceed their μ²); checks nobody over
    budget was selected, that every committed round had a participant (no round of noise alone) and
    that a run stopped early only where no user with budget left could join the next round (min-sep
    2: not selected in the round before); returns {run: {round: skipped}} and each user's composed μ²."""
    spent = {u: [] for u in USERS}
    skips = {}
    for name in names:
        _, rounds, committed = history[name]
        seen: set = set()
        skips[name] = {}
        for t in range(committed):
            over = {u for u in USERS if u not in seen and math.fsum(spent[u]) + mu2[name] > limits[u]}
            skips[name][t] = len(over)
            chosen = rounds.get(t, set())
            assert chosen and not chosen & over, (name, t, chosen & over)
            seen |= chosen
        if committed < ROUNDS:
            t = committed
            over = {u for u in USERS if u not in seen and math.fsum(spent[u]) + mu2[name] > limits[u]}
            assert set(USERS) - over - rounds.get(t - 1, set()) == set(), (name, t)
        for u in seen:
            spent[u].append(mu2[name])
    return skips, {u: math.fsum(v) for u, v in spent.items()}


# ---- μ-GDP ------------------------------------------------------------------------------------
def test_gdp_conversion_matches_the_closed_form_and_inverts():
    # δ(0) of μ-GDP is 2Φ(μ/2) − 1 (Dong et al. Cor. 2.13 at ε = 0)
    for mu in (0.1, 1.0, 3.0):
        assert delta_for(mu, 0.0) == pytest.approx(2 * ndtr(mu / 2) - 1, rel=1e-12)
    for mu in (0.05, 0.5, 1.0, 2.5):
        eps = epsilon_for(mu, DELTA)
        assert delta_for(mu, eps) <= DELTA < delta_for(mu, eps * (1 - 1e-6))
        back = mu_for(eps, DELTA)
        assert back <= mu * (1 + 1e-9) and back == pytest.approx(mu, rel=1e-9)
        assert delta_for(back, eps) <= DELTA
    assert compose([0.36, 0.64]) == pytest.approx(1.0)
    # composition is what a single Gaussian of the composed μ gives: 2 runs of μ=1 spend ε(√2)
    assert epsilon_for(compose([1.0, 1.0]), DELTA) == epsilon_for(math.sqrt(2), DELTA)


def test_run_worst_case_adds_the_count_release_of_adaptive_clipping():
    assert run_mu_squared(_plan(0.8)) == 1 / 0.8 ** 2
    adaptive = AdaptiveClipping.create(0.5, expected_users=PER_ROUND, count_noise_std=2.0)
    # k = min(3, ceil(8/2)) = 3 count releases of sensitivity 1 and std 2
    assert run_mu_squared(_plan(0.8, adaptive)) == pytest.approx(1 / 0.8 ** 2 + 3 / 4.0)


# ---- runs sharing a ledger ----------------------------------------------------------------------
def _setup(ledger_url, tmp_path, default_runs, own):
    key = tmp_path / "budget.key"
    secret = load_budget_secret(key, create=True)
    with Ledger.open(ledger_url) as book:
        set_default(book, secret, _epsilon_allowing(default_runs), DELTA)
        for user, runs in own.items():
            set_user(book, secret, user, _epsilon_allowing(runs))
    return key


def _limits(default_runs, own):
    limit = lambda runs: mu_for(_epsilon_allowing(runs), DELTA) ** 2  # noqa: E731
    return {u: limit(own.get(u, default_runs)) for u in USERS}


@pytest.mark.parametrize("zs", [(0.8, 0.8), (0.8, 1.0, 1.25)], ids=["two-runs", "three-runs"])
def test_runs_sharing_a_ledger_never_overspend(ledger_url, tmp_path, zs):
    names = [f"run{i}" for i in range(len(zs))]
    mu2 = {n: 1 / z ** 2 for n, z in zip(names, zs)}
    # heterogeneous: by default room for the first run only; some users for two, one for all, one for none
    default = [mu2["run0"]]
    own = {"u00": [mu2["run0"], mu2["run1"]], "u01": [mu2["run0"], mu2["run1"]], "u02": list(mu2.values()),
           "u03": [min(mu2.values()) * 0.5]}
    key = _setup(ledger_url, tmp_path, default, own)
    for name, z in zip(names, zs):
        _run(tmp_path, name, z, ledger_url, key)
    history = _history(ledger_url, tmp_path, names)
    limits = _limits(default, own)
    skips, spent = _brute_force(history, names, mu2, limits)
    with Ledger.open(ledger_url) as book:
        for name in names:
            run_id = history[name][0]
            recorded = round_skips(book.engine, run_id)
            assert recorded == skips[name], name
        accounts = {a.label: a for a in user_accounts(book.engine)}
    for u in USERS:
        assert spent[u] <= limits[u]  # no user over their lifetime budget, recomputed from participations
    assert spent["u03"] == 0  # a budget below one run: never selected
    later = set().union(*[set().union(*history[n][1].values()) for n in names[1:]])
    assert later == {"u00", "u01", "u02"}  # the others reached their limit after the first run
    if len(names) == 3:  # only u02 has room for the third run
        assert set().union(*history["run2"][1].values()) == {"u02"}
    assert sum(skips[names[1]].values()) > 0
    # the accounts (by key prefix) agree with the brute force
    secret = load_budget_secret(key)
    for u in USERS:
        label = secret.lifetime_key(u).hex()[:16]
        if spent[u] or u in own:
            a = accounts[label]
            assert a.mu == pytest.approx(math.sqrt(spent[u]), rel=1e-12)
            assert a.spent_epsilon == epsilon_for(math.sqrt(spent[u]), DELTA)
            assert a.remaining_epsilon >= 0


def test_resume_selects_and_skips_as_an_uninterrupted_run(tmp_path):
    zs = (0.8, 0.8)
    default, own = [1 / 0.64], {"u00": [1 / 0.64, 1 / 0.64], "u05": [1 / 0.64, 1 / 0.64]}
    results = []
    for case in ("straight", "resumed"):
        base = tmp_path / case
        base.mkdir()
        url = str(base / "ledger.db")
        key = _setup(url, base, default, own)
        _run(base, "run0", zs[0], url, key, label="a")
        if case == "resumed":
            def crash(event, t):
                if event == "noised" and t == 0:
                    raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                _run(base, "run1", zs[1], url, key, label="b", on_event=crash)
            # resumed from the same directory (same secrets): round 0 redone
            train(Tiny(), USERS, _plan(zs[1]), _update, checkpoint_dir=base / "run1", ledger=url, budget_key=key,
                  repeatable_noise=True, min_clients_per_round=1)
        else:
            _run(base, "run1", zs[1], url, key, label="b")
        history = _history(url, base, ["run0", "run1"])
        with Ledger.open(url) as book:
            skips = round_skips(book.engine, history["run1"][0])
        results.append((history["run0"][1], history["run1"][1], skips))
    assert results[0] == results[1]


def test_a_ledger_with_budgets_refuses_a_run_without_its_secret(tmp_path):
    url = str(tmp_path / "ledger.db")
    key = _setup(url, tmp_path, [1.0], {})
    with pytest.raises(ConfigError, match="enforces lifetime budgets"):
        _run(tmp_path, "a", 0.8, url, None)
    with Ledger.open(url) as book:
        assert book.runs() == []  # refused before the run was recorded
    other = tmp_path / "other.key"
    with pytest.raises(LedgerError, match="budget secret is not the one"):
        _run(tmp_path, "b", 0.8, url, other if load_budget_secret(other, create=True) else None)
    bare = str(tmp_path / "bare.db")
    with pytest.raises(ConfigError, match="has no lifetime budgets"):
        _run(tmp_path, "c", 0.8, bare, key)
    _run(tmp_path, "d", 0.8, str(tmp_path / "bare2.db"), None)  # no budgets, no secret: as before


def test_charge_rechecks_the_budget_in_its_transaction(ledger_url, tmp_path):
    """Two runs that both found a user admissible: the second charge is refused (no overspending
    by concurrent runs)."""
    url = ledger_url
    key = _setup(url, tmp_path, [1 / 0.64], {})
    secret = load_budget_secret(key)
    plan = _plan(0.8)
    with Ledger.open(url, secret=b"s" * 16) as book:
        ids = [book.create_run(plan.mechanism, noise_multiplier=0.8, clip_norm=1.0, delta=1e-5,
                               schema=plan.schema).id for _ in range(2)]
        first, second = (RunBudget.open(book, secret, plan, i) for i in ids)
        assert first.admissible(0, ["u01", "u02"]) == ["u01", "u02"]
        assert second.admissible(0, ["u01", "u02"]) == ["u01", "u02"]
        first.charge(0, ["u01"])
        with pytest.raises(LedgerError, match="concurrent run"):
            second.charge(0, ["u01"])
        second.charge(0, ["u02"])
        assert second.admissible(1, ["u01", "u02"]) == ["u02"] and second.skipped == 1
        first.charge(1, ["u01"])  # charged once per run
        with Session(book.engine) as session:
            assert session.query(BudgetCharge).count() == 2


# ---- the command line ----------------------------------------------------------------------------
def _fedmf(*args):
    return subprocess.run([sys.executable, "-m", "fedmf.cli", *args], capture_output=True, text=True)


def test_budget_cli(tmp_path):
    from fedmf.cli import main

    url, key = str(tmp_path / "ledger.db"), str(tmp_path / "budget.key")
    assert main(["budget", "default", "2.5", "--ledger", url, "--key", key]) == 0
    assert main(["budget", "set", "u01", "9", "--ledger", url, "--key", key]) == 0
    assert main(["budget", "default", "-1", "--ledger", url, "--key", key]) == 2
    assert main(["budget", "set", "u01", "1", "--ledger", url, "--key", str(tmp_path / "missing.key")]) == 2
    _run(tmp_path, "run0", 0.8, url, key)
    r = _fedmf("audit", "--users", "--ledger", url, "--json")
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(r.stdout)
    assert data["budgets"] == {"default_epsilon": 2.5, "delta": 1e-10}
    secret = load_budget_secret(key)
    by_label = {u["label"]: u for u in data["users"]}
    mine = by_label[secret.lifetime_key("u01").hex()[:16]]
    assert mine["budget_epsilon"] == 9.0 and mine["runs"] == 1
    assert mine["spent_epsilon"] == epsilon_for(1 / 0.8, DELTA)
    assert "u01" not in r.stdout
    r = _fedmf("audit", "--ledger", url)
    # ε = 2.5 at δ = 1e-10 is below one run's μ = 1.25: every user but u01 is skipped; u01 plays round 0
    # alone and min-sep 2 keeps them out of round 1, which no one can join: the run stops before it
    assert mu_for(2.5, DELTA) < 1 / 0.8
    assert r.returncode == 0, r.stderr
    assert "budget skips        11 " in r.stdout and "0: 11" in r.stdout
    r = _fedmf("audit", "--ledger", url, "--json")
    assert json.loads(r.stdout)["budget_skips"] == {"0": 11}


@pytest.mark.heavy
def test_readme_budget_block_runs_as_written(tmp_path):
    """README's "Budgets across runs" block, run with bash (``fedmf`` is this checkout's CLI)."""
    import os
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```", readme, flags=re.M | re.S) if "fedmf budget default" in b]
    assert len(blocks) == 1
    script = f'fedmf() {{ "{sys.executable}" -m fedmf.cli "$@"; }}\nset -e\n' + blocks[0]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # run b: the 30 users without a budget of their own have no room left; it plays round 1 with 8 of
    # users 0-9 and stops before round 2, which the other 2 cannot fill (fedmf.run.cohort)
    assert "budget skips        30 " in r.stdout
    assert "round 1 (1/20 done) not played: 2 users can take part, 8 needed" in r.stdout
    with Ledger.open(tmp_path / "budgets.db") as book:
        accounts = user_accounts(book.engine)
    assert sorted(a.runs for a in accounts) == [1] * 32 + [2] * 8
    assert all(a.remaining_epsilon >= 0 for a in accounts)
    secret = load_budget_secret(tmp_path / "budget.key")
    twice = {a.label for a in accounts if a.runs == 2}
    assert twice < {secret.lifetime_key(str(u)).hex()[:16] for u in range(10)}



def test_budget_set_many_users_in_one_call_and_look_one_up_by_id(tmp_path, capsys):
    """``fedmf budget set`` takes several ids and a file of them (own ε per line), in one transaction;
    ``fedmf budget show --user ID --key FILE`` finds that user's account, the same as the pseudonymous
    listing's row under their lifetime key, after a run charged them."""
    import json

    from fedmf.cli import main

    url, key = str(tmp_path / "ledger.db"), str(tmp_path / "budget.key")
    assert main(["budget", "default", "2.5", "--ledger", url, "--key", key]) == 0
    users_file = tmp_path / "users.txt"
    users_file.write_text("# id [eps]\nu02\nu03, 9.5\n\nu04 none\nu05\t8.5\n")
    assert main(["budget", "set", "u00", "u01", "9", "--users-file", str(users_file), "--ledger", url,
                 "--key", key]) == 0
    assert "lifetime budgets of 6 users set" in capsys.readouterr().out
    secret = load_budget_secret(key)
    own = {"u00": 9.0, "u01": 9.0, "u02": 9.0, "u03": 9.5, "u05": 8.5}  # u04: back to the default
    with Ledger.open(url) as book, Session(book.engine) as session:
        stored = {bytes(k): e for k, e in session.execute(select(UserBudget.lifetime_key, UserBudget.epsilon))}
    assert stored == {secret.lifetime_key(u): e for u, e in own.items()}
    # all or none: a bad line anywhere sets nobody
    users_file.write_text("u06 1\nu07 -3\n")
    assert main(["budget", "set", "u08", "1", "--users-file", str(users_file), "--ledger", url, "--key", key]) == 2
    assert "line 2" in capsys.readouterr().err
    with Ledger.open(url) as book, Session(book.engine) as session:
        assert session.scalar(select(func.count()).select_from(UserBudget)) == len(own)

    _run(tmp_path, "run0", 0.8, url, key)  # charges the users it selects
    capsys.readouterr()
    assert main(["budget", "show", "--ledger", url, "--json"]) == 0
    listing = {u["label"]: u for u in json.loads(capsys.readouterr().out)["users"]}
    assert main(["budget", "show", "--ledger", url, "--key", key, "--user", "u03", "--user", "u04", "--user",
                 "nobody", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["users"]
    assert [u["user"] for u in found] == ["u03", "u04", "nobody"]
    for u in found:
        label = secret.lifetime_key(u["user"]).hex()[:16]
        assert u["label"] == label
        if label in listing:
            assert {k: v for k, v in u.items() if k != "user"} == listing[label]
    assert found[0]["budget_epsilon"] == 9.5 and found[1]["budget_epsilon"] == 2.5
    assert found[2] == {"user": "nobody", "label": secret.lifetime_key("nobody").hex()[:16], "runs": 0, "mu": 0.0,
                        "spent_epsilon": 0.0, "budget_epsilon": 2.5, "remaining_epsilon": 2.5}
    # ε 9.5 admits one run's μ = 1.25 at δ = 1e-10, the default 2.5 does not: u03 was charged, u04 never
    assert mu_for(9.5, DELTA) > 1 / 0.8 > mu_for(2.5, DELTA)
    assert found[0]["runs"] == 1 and found[0]["spent_epsilon"] == epsilon_for(1 / 0.8, DELTA)
    assert found[0]["remaining_epsilon"] == 9.5 - found[0]["spent_epsilon"] and found[1]["runs"] == 0
    # the lookup needs the ledger's own budget secret
    other = str(tmp_path / "other.key")
    assert main(["budget", "default", "1", "--ledger", str(tmp_path / "other.db"), "--key", other]) == 0
    assert main(["budget", "show", "--ledger", url, "--key", other, "--user", "u03"]) == 2
    assert "not the one" in capsys.readouterr().err
    assert main(["budget", "show", "--ledger", url, "--user", "u03"]) == 2
    assert "--user needs --key" in capsys.readouterr().err
