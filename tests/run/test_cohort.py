"""No silent noise-only rounds (fedmf.run.cohort): a round too few users can join is not played — in
process the run stops with one line, a deployment's server waits and says so — before anything of it
is recorded; amplified samplers keep their empty rounds and the summary counts them."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fedmf import FixedEpoch, MinSep, Workload
from fedmf.accounting.gdp import epsilon_for, run_mu_squared
from fedmf.config import RunConfig
from fedmf.errors import ConfigError
from fedmf.ledger import Ledger
from fedmf.ledger.budgets import load_budget_secret, round_skips, set_default, set_user
from fedmf.ledger.models import BudgetCharge, Participation
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.run.cohort import counts, resolve_min_cohort, summary_line
from fedmf.run.federated import train
from fedmf.run.private_run import PrivateRun
from fedmf.schedule import FixedEpochOrder, MinSepSelection
from server.config import ServerConfig
from tests import _federated_task as task

ROUNDS, PER_ROUND, DELTA = 8, 4, 1e-10
USERS = [f"u{i:02d}" for i in range(20)]


def _plan(sampling: str | None = None) -> RunPlan:
    schema = MinSep(2, 4) if sampling is None else MinSep(1, ROUNDS)
    mech = build("bsr", ROUNDS, schema, Workload(momentum=0.0), num_bands=schema.min_sep)
    return RunPlan.create(mech, schema, clip_norm=1.0, delta=1e-5, expected_users=PER_ROUND if sampling is None
                          else 0.05 * len(USERS), noise_multiplier=0.8, sampling=sampling)


def _update(params, user, t):
    return {name: torch.full_like(p, 0.01) for name, p in params.items()}


def _room_for(runs: int, plan: RunPlan) -> float:
    """A lifetime ε whose μ at DELTA just fits ``runs`` runs of ``plan``."""
    return epsilon_for(math.sqrt(runs * run_mu_squared(plan)) * (1 + 1e-6), DELTA)


def _run(tmp_path, name, plan, url, key, **kw):
    directory = tmp_path / name
    if not directory.exists():
        task.write_secrets(directory, name.encode())
    return train(task.Tiny(), USERS, plan, _update, checkpoint_dir=directory, ledger=url, budget_key=key,
                 repeatable_noise=True, **kw)


def _participants(url, tmp_path, name, run_id) -> set[str]:
    """The users with a participation row in run ``run_id`` (keys mapped back with the run's secret)."""
    secret = (tmp_path / name / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(url, secret=secret) as book:
        run = book.run(run_id)
        with Session(book.engine) as session:
            keys = {bytes(k) for k in session.scalars(select(Participation.client_key)
                                                       .where(Participation.run_id == run_id))}
        return {u for u in USERS if run.key(u) in keys}


def _ledger_rounds(url, tmp_path, name, run_id):
    secret = (tmp_path / name / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(url, secret=secret) as book:
        run = book.run(run_id)
        rounds = [run.round(t) for t in range(ROUNDS)]
        with Session(book.engine) as session:
            rows = session.execute(select(Participation.round_index, func.count())
                                   .where(Participation.run_id == run_id).group_by(Participation.round_index)).all()
            charged = session.scalar(select(func.count()).select_from(BudgetCharge)
                                     .where(BudgetCharge.run_id == run_id))
        skips = round_skips(book.engine, run_id)
    return rounds, dict(rows), charged, skips


def test_a_run_out_of_budget_stops_before_a_round_it_cannot_fill_and_resumes_exactly(tmp_path):
    """The README's budget example in small: everyone has room for one run, u00-u04 for two. Run b
    plays round 1 with 4 of the 5 and stops before round 2 (1 user can take part, 4 needed): nothing
    of round 2 is recorded, charged or released. Budgets raised, the same call resumes it to the end."""
    plan, url, key = _plan(), str(tmp_path / "ledger.db"), tmp_path / "budget.key"
    secret = load_budget_secret(key, create=True)
    with Ledger.open(url) as book:
        set_default(book, secret, _room_for(1, plan), DELTA)
        for user in USERS[:5]:
            set_user(book, secret, user, _room_for(2, plan))
    a = _run(tmp_path, "a", plan, url, key)
    assert (a.stopped, a.rounds_done, a.min_cohort) == ("horizon", ROUNDS, PER_ROUND)
    # who has room for run b, by brute force: u00-u04, and whoever run a never selected
    room = set(USERS[:5]) | (set(USERS) - _participants(url, tmp_path, "a", a.run_id))
    assert PER_ROUND <= len(room) < 2 * PER_ROUND  # these secrets: run b can fill round 1, not round 2
    b = _run(tmp_path, "b", plan, url, key)
    assert b.rounds_done == 1 and b.stopped.startswith("cohort: ")
    line = b.stopped.removeprefix("cohort: ")
    assert "\n" not in line
    assert line.startswith(f"round 1 (1/{ROUNDS} done) not played: {len(room) - PER_ROUND} users can take part, {PER_ROUND} "
                           f"needed (min-clients-per-round): {20 - len(room)} of 20 users have no budget left for this "
                           f"run, {PER_ROUND} took part in the last 1 rounds"), line
    assert _participants(url, tmp_path, "b", b.run_id) < room
    rounds, rows, charged, skips = _ledger_rounds(url, tmp_path, "b", b.run_id)
    assert [r.status for r in rounds] == ["committed"] + ["planned"] * (ROUNDS - 1)  # round 2: no row, no attempt
    assert rounds[0].contributed == rounds[0].selected == PER_ROUND and rows == {0: PER_ROUND}
    assert rounds[0].epsilon_planned == plan.epsilon_after(0)  # the committed round is accounted as planned
    assert rounds[0].noise_std == pytest.approx(plan.noise_std)
    assert charged == PER_ROUND and skips == {0: 20 - len(room)}  # only round 1's users charged; round 2 left no skip row
    with PrivateRun.open(task.Tiny(), plan, tmp_path / "b", ledger=url, budget_key=key) as run:
        assert run.next_round == 1 and run.scheduler.next_round == 1  # the scheduler did not decide round 2
    with Ledger.open(url) as book:  # budgets raised: the same run resumes from round 2 and plays to the end
        set_default(book, secret, _room_for(2, plan), DELTA)
    resumed = _run(tmp_path, "b", plan, url, key)
    assert (resumed.stopped, resumed.rounds_done) == ("horizon", ROUNDS)
    rounds, rows, charged, _ = _ledger_rounds(url, tmp_path, "b", b.run_id)
    assert all(r.status == "committed" and r.contributed == PER_ROUND for r in rounds)
    assert rows == {t: PER_ROUND for t in range(ROUNDS)}
    assert [r.epsilon_planned for r in rounds] == [plan.epsilon_after(t) for t in range(ROUNDS)]


def test_the_minimum_is_checked_before_the_scheduler_decides():
    """eligible() decides nothing: the same selection follows whether or not it was asked first."""
    key = bytes(range(32))
    asked, plain = (MinSepSelection(2, 4, 3, key) for _ in range(2))
    users = USERS[:7]
    for t in range(5):
        eligible = asked.eligible(t, users)
        assert eligible == (7 if t == 0 else 4)  # min-sep 2: the 3 selected in round t-1 wait one round
        assert asked.select(t, users) == plain.select(t, users)
    order = FixedEpochOrder(2, 2, USERS[:6], key)
    slot = [u for u in USERS[:6] if order.slot_of(u) == 1]
    assert order.eligible(1, slot[:2]) == 2 and order.eligible(1, USERS[:6]) == 3 and order.eligible(4, USERS) is None


def test_the_default_minimum_and_what_is_refused():
    assert resolve_min_cohort(_plan(), None) == PER_ROUND
    assert resolve_min_cohort(_plan(), 0) == PER_ROUND
    assert resolve_min_cohort(_plan(), 2) == 2
    with pytest.raises(ConfigError, match="exceeds clients-per-round 4"):
        resolve_min_cohort(_plan(), 5)
    poisson = _plan("poisson:0.05")
    assert resolve_min_cohort(poisson, None) is None
    with pytest.raises(ConfigError, match="applies to sampling none.*poisson:0.05 keeps the rounds it draws"):
        resolve_min_cohort(poisson, 1)
    schema = FixedEpoch(2, 2)  # the order fixes each round's slot: only a round nobody of it can join is refused
    fixed = RunPlan.create(build("bsr", 4, schema, Workload(momentum=0.0), num_bands=2), schema, clip_norm=1.0,
                           delta=1e-5, expected_users=10, noise_multiplier=0.8)
    assert resolve_min_cohort(fixed, None, 20) == 1 and resolve_min_cohort(fixed, 10, 20) == 10
    with pytest.raises(ConfigError, match="exceeds the smallest fixed-epoch slot"):
        resolve_min_cohort(fixed, 11, 21)
    config = RunConfig.from_mapping({"min-clients-per-round": 3, "stop-when-diverging": "true"})
    assert config.min_clients_per_round == 3 and config.stop_when_diverging is True
    assert RunConfig.from_mapping({}).min_clients_per_round is None
    with pytest.raises(ConfigError, match="min-clients-per-round"):
        RunConfig.from_mapping({"min-clients-per-round": -1})


def test_users_who_drop_out_after_selection_do_not_stop_the_run(tmp_path):
    """The rule counts who can be selected, not who replies: a selected user who drops out still
    counts as sampled, and a round whose selected users all drop out is played (and counted)."""
    def half_drop_out(params, user, t):
        return None if user < "u10" else _update(params, user, t)

    task.write_secrets(tmp_path / "d", b"dropouts")
    result = train(task.Tiny(), USERS, _plan(), half_drop_out, checkpoint_dir=tmp_path / "d", repeatable_noise=True)
    assert (result.stopped, result.rounds_done) == ("horizon", ROUNDS)
    assert all(r.selected == PER_ROUND and r.contributed + r.dropped == PER_ROUND for r in result.history)
    contributed = [r.contributed for r in result.history]
    assert any(c < PER_ROUND for c in contributed)
    cohorts = counts([{"contributed": c} for c in contributed], _plan(), result.min_cohort)
    assert cohorts["below_expected"] == sum(c < PER_ROUND for c in contributed)
    assert cohorts["no_contribution"] == contributed.count(0) and cohorts["min_clients_per_round"] == PER_ROUND


def test_poisson_keeps_its_empty_rounds_and_the_summary_counts_them(tmp_path):
    plan = _plan("poisson:0.05")
    task.write_secrets(tmp_path / "p", b"poisson")
    result = train(task.Tiny(), USERS, plan, _update, checkpoint_dir=tmp_path / "p", repeatable_noise=True)
    assert (result.stopped, result.rounds_done, result.min_cohort) == ("horizon", ROUNDS, None)
    contributed = [r.contributed for r in result.history]
    empty = contributed.count(0)
    assert empty >= 1 and any(contributed)  # the secrets above draw both (P(empty) = 0.95^20 = 0.36)
    secret = (tmp_path / "p" / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(tmp_path / "p" / "ledger.db", secret=secret) as book:  # the empty rounds were committed as drawn
        run = book.run(result.run_id)
        assert [run.round(t).contributed for t in range(ROUNDS)] == contributed
    cohorts = counts([{"contributed": c} for c in contributed], plan, result.min_cohort)
    assert cohorts == {"rounds": ROUNDS, "no_contribution": empty, "below_expected": sum(c < 1 for c in contributed),
                       "expected_users": 1.0, "fewest": 0, "min_clients_per_round": None, "sampling": "poisson:0.05"}
    assert summary_line(cohorts).startswith(f"{empty} of {ROUNDS} rounds had no contribution (noise only)")
    assert summary_line(cohorts).endswith("sampling poisson:0.05 draws them (its accountant assumes them)")


def _cli(*args):
    from fedmf.cli import main

    return main(list(args))


def test_the_cli_ends_with_one_line_and_reports_cohorts(tmp_path, capsys):
    """``fedmf simulate`` where only users 0-9 have budget left (the README's run b, whatever the earlier
    run selected): it stops before round 2 with the line; results.json counts the rounds it played."""
    url, key = str(tmp_path / "budgets.db"), str(tmp_path / "budget.key")
    assert _cli("budget", "default", "0", "--ledger", url, "--key", key) == 0
    for u in range(10):
        assert _cli("budget", "set", str(u), "12", "--ledger", url, "--key", key) == 0
    capsys.readouterr()
    assert _cli("simulate", "--preset", "tiny", "--rounds", "4", "--epsilon", "4", "--ledger", url, "--budget-key",
                key, "--quiet", "--no-plot", "--out", str(tmp_path / "run-b")) == 0
    out = capsys.readouterr().out
    stopped = [line for line in out.splitlines() if line.startswith("stopped ")]
    assert len(stopped) == 1 and re.search(r"round 1 \(1/4 done\) not played: 2 users can take part, 8 needed "
                                           r"\(min-clients-per-round\): 30 of 40 users have no budget left", stopped[0])
    assert "tiny (tiny), 1 rounds (cohort)" in out
    results = json.loads((tmp_path / "run-b" / "results.json").read_text())
    assert results["rounds_done"] == 1 and results["stopped"].startswith("cohort: round 1 (1/4 done) not played")
    assert results["cohorts"] == {"rounds": 1, "no_contribution": 0, "below_expected": 0, "expected_users": 8.0,
                                  "fewest": 8, "min_clients_per_round": 8, "sampling": "none"}
    assert [h["contributed"] for h in results["history"]] == [8]


# ---- a deployment waits (the Flower strategy over in-process nodes) -----------------------------
def test_a_deployment_waits_for_users_and_says_so(tmp_path, caplog):
    from server.local_grid import LocalGrid
    from server.strategy import DPMFStrategy
    from tests.flower.test_server_strategy import honest_node

    nodes = {7000 + i: honest_node(u) for i, u in enumerate(task.users())}
    few = dict(list(nodes.items())[:8])
    config = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 0.2, "task-options": "{}"})
    plan = task.plan(rounds=4)
    # never enough users: it polls for the reply timeout, then stops; nothing of round 1 exists
    task.write_secrets(tmp_path / "short", b"deployment")
    with caplog.at_level(logging.INFO, logger="fedmf.server"), \
            PrivateRun.open(task.Tiny(), plan, tmp_path / "short", population=task.users(),
                            repeatable_noise=True) as run:
        strategy = DPMFStrategy(run, config)
        strategy.cohort_poll_s = 0.02
        strategy.start(LocalGrid(few))
        assert run.next_round == 0 and run.scheduler.next_round == 0
    assert strategy.stopped.startswith("cohort: round 0 (0/4 done) not played: 8 users can take part, 10 needed "
                                       "(min-clients-per-round): 52 of 60 are not connected"), strategy.stopped
    waits = [r.getMessage() for r in caplog.records if "waiting for users" in r.getMessage()]
    assert len(waits) == 1 and "trying again every 0.02 s for up to 0.2 s" in waits[0]
    secret = (tmp_path / "short" / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(tmp_path / "short" / "ledger.db", secret=secret) as book:
        assert book.run(strategy.run.run_id).round(0).status == "planned"  # not opened, no attempt
        with Session(book.engine) as session:
            assert session.scalar(select(func.count()).select_from(Participation)) == 0
    from fedmf.run.outcome import RunOutcome
    from server.app import _stopped

    assert RunOutcome(1, 0, _stopped(strategy)).stopped.startswith("cohort: round 0 (0/4 done)")
    # the users connect while it waits: the round is played, as if they had been there from the start
    caplog.clear()
    grid = LocalGrid(few)
    task.write_secrets(tmp_path / "late", b"deployment")
    task.write_secrets(tmp_path / "full", b"deployment")
    tries = []
    with caplog.at_level(logging.INFO, logger="fedmf.server"), \
            PrivateRun.open(task.Tiny(), plan, tmp_path / "late", population=task.users(),
                            repeatable_noise=True) as run:
        late = DPMFStrategy(run, ServerConfig.from_mapping({**{"noise-multiplier": 0.8, "task-options": "{}"},
                                                         "reply-timeout": 60.0}))
        late.cohort_poll_s = 0.0
        available = late._available

        def arriving(g, t):  # the third look finds everyone connected
            tries.append(t)
            if len(tries) == 3:
                grid.nodes.update(nodes)
            return available(g, t)

        late._available = arriving
        late.start(grid)
        late_model = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert late.stopped == "horizon" and tries[:3] == [0, 0, 0]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("waiting for users" in m for m in messages) == 1
    assert any(m.startswith("fedmf round 0: enough users after waiting") for m in messages)
    with PrivateRun.open(task.Tiny(), plan, tmp_path / "full", population=task.users(), repeatable_noise=True) as run:
        DPMFStrategy(run, ServerConfig.from_mapping({"noise-multiplier": 0.8, "task-options": "{}"})).start(
            LocalGrid(nodes))
        for name, value in run.model.state_dict().items():
            assert torch.equal(value, late_model[name]), name
    secret = (tmp_path / "late" / "secrets" / "ledger_secret").read_bytes()
    with Ledger.open(tmp_path / "late" / "ledger.db", secret=secret) as book:
        assert [book.run(late.run.run_id).round(t).attempts for t in range(4)] == [1] * 4  # no aborted attempt
