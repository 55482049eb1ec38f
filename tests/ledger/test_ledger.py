"""The participation ledger's repository API, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import hashlib
import hmac
import json
import random

import pytest
from sqlalchemy import func, inspect, select, text

from fedmf import FixedEpoch, MinSep
from fedmf.ledger import Ledger, LedgerError, ServerSecret, head_revision
from fedmf.ledger.models import VERSION_TABLE, Base, ClientState, Participation, Round, Run, UpdateNorm
from fedmf.mechanisms.io import load_with_schema
from tests.ledger_helpers import SECRET, dump_database, mechanism_file


def _run(url, tmp_path, schema=MinSep(4, 6), rounds=24, **kwargs):
    ledger = Ledger.open(url, secret=SECRET)
    run = ledger.create_run(mechanism_file(tmp_path, rounds=rounds, schema=schema), noise_multiplier=2.0,
                            clip_norm=1.0, delta=1e-6, target_epsilon=3.0, **kwargs)
    return ledger, run


def _participations(ledger, run_id):
    """(round, key, status, reason, update_norm, clipped): the norms from the diagnostics table."""
    with ledger.engine.connect() as conn:
        return conn.execute(
            select(Participation.round_index, Participation.client_key, Participation.status, Participation.reason,
                   UpdateNorm.update_norm, UpdateNorm.clipped)
            .outerjoin(UpdateNorm, (UpdateNorm.run_id == Participation.run_id)
                       & (UpdateNorm.round_index == Participation.round_index)
                       & (UpdateNorm.client_key == Participation.client_key))
            .where(Participation.run_id == run_id).order_by(Participation.round_index, Participation.client_key)
        ).all()


# ---- keys ---------------------------------------------------------------------------------------

def test_client_key_is_hmac_sha256_under_the_secret_and_salted_per_run():
    secret = ServerSecret(SECRET)
    expected = hmac.new(SECRET, b"fedmf-ledger/v1/client\x00" + b"run-a" + b"\x00" + b"s" + b"alice",
                        hashlib.sha256).digest()
    assert secret.client_key("run-a", "alice") == expected
    assert len(expected) == 32
    assert secret.client_key("run-a", 7) == secret.client_key("run-a", "7")  # Flower node ids
    assert secret.client_key("run-b", "alice") != expected  # unlinkable across runs
    assert ServerSecret(b"another-secret-of-32-bytes-long!").client_key("run-a", "alice") != expected
    assert secret.client_keys("run-a", ["alice", "bob"]) == [expected, secret.client_key("run-a", "bob")]
    assert SECRET.decode() not in repr(secret) and SECRET.decode() not in str(secret)
    assert secret.key_check() == hmac.new(SECRET, b"fedmf-ledger/v1/key-check", hashlib.sha256).hexdigest()
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ServerSecret(b"short")
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(secret)


# ---- schema and migrations ------------------------------------------------------------------------

def test_migrations_create_exactly_the_models(ledger_url):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with Ledger.open(ledger_url) as ledger, ledger.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
        assert context.get_current_revision() == head_revision() == "0005"
        indexes = {ix["name"]: ix["column_names"] for ix in inspect(conn).get_indexes("participations")}
        assert indexes["ix_participations_client"] == ["run_id", "client_key", "status", "round_index"]
    with Ledger.open(ledger_url) as again:  # idempotent: a second open migrates nothing
        assert len(again.runs()) == 0


def test_newer_schema_version_is_refused_and_nothing_is_written(ledger_url, tmp_path):
    with Ledger.open(ledger_url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0099'"))
    before = open(ledger_url, "rb").read() if "://" not in ledger_url else None
    with pytest.raises(LedgerError, match=r"schema version 0099, newer than this fedmf understands \(0005\)") as e:
        Ledger.open(ledger_url, secret=SECRET)
    assert "\n" not in str(e.value)
    if before is not None:
        assert open(ledger_url, "rb").read() == before


def test_unknown_revision_and_foreign_database(tmp_path):
    import sqlite3

    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE runs (x INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(LedgerError, match="is not a fedmf ledger"):
        Ledger.open(str(path))
    path2 = tmp_path / "l.db"
    with Ledger.open(str(path2)) as ledger, ledger.engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'abc123'"))
    with pytest.raises(LedgerError, match="unknown schema version 'abc123'"):
        Ledger.open(str(path2))


@pytest.mark.parametrize("url, message", [
    ("mysql://root@localhost/test", "unsupported ledger database 'mysql'"),
    ("postgresql+asyncpg://u@h/db", "unsupported PostgreSQL driver"),
    ("://nothing", "not a database URL"),
    ("postgresql://postgres:hunter2@127.0.0.1:1/test", r"cannot open ledger postgresql\+psycopg://postgres:\*\*\*@127.0.0.1:1/test"),
])
def test_bad_urls_are_one_line_errors(url, message):
    with pytest.raises(LedgerError, match=message) as e:
        Ledger.open(url)
    assert "\n" not in str(e.value) and "hunter2" not in str(e.value)


def test_missing_directory_is_an_error_and_plain_paths_mean_sqlite(tmp_path):
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger.open(str(tmp_path / "no" / "such" / "ledger.db"))
    with Ledger.open(tmp_path / "x.db") as ledger:
        assert ledger.url.get_backend_name() == "sqlite"
        assert ledger.url.database == str(tmp_path / "x.db")
    assert (tmp_path / "x.db").is_file()


# ---- runs ------------------------------------------------------------------------------------------

def test_create_run_stores_the_plan_and_the_mechanism_verbatim(ledger_url, tmp_path):
    path = mechanism_file(tmp_path, rounds=24, schema=MinSep(4, 6))
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        run = ledger.create_run(path, noise_multiplier=2.5, clip_norm=0.7, delta=1e-5, target_epsilon=4.0,
                                sampling="fixed-order", name="so", config={"lr": 0.1})
        _, _, checksum = load_with_schema(path)
        info = run.info
        assert (info.id, info.rounds, info.noise_multiplier, info.clip_norm, info.delta) == (1, 24, 2.5, 0.7, 1e-5)
        assert info.schema == MinSep(4, 6) and (info.min_sep, info.max_participations) == (4, 6)
        assert info.mechanism_checksum == checksum and info.mechanism_kind == "bsr"
        assert info.config == {"lr": 0.1} and info.name == "so" and info.target_epsilon == 4.0
        with ledger.engine.connect() as conn:
            doc = conn.execute(select(Run.mechanism_document)).scalar_one()
            statuses = conn.execute(select(Round.status, func.count()).group_by(Round.status)).all()
        assert doc == open(path).read()
        assert statuses == [] and run.round(23).status == "planned"  # rounds are recorded when committed
        assert run.next_round == 0
        assert [r.id for r in ledger.runs()] == [1]
        second = ledger.create_run(path, noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, schema=MinSep(6, 4))
        assert second.id == 2 and second.info.schema == MinSep(6, 4)
        assert second.info.uid != info.uid


@pytest.mark.parametrize("kwargs, message", [
    ({"noise_multiplier": 0.0}, "noise_multiplier must be positive"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier must be finite"),
    ({"delta": 1.0}, r"delta must lie in \(0, 1\)"),
    ({"clip_norm": -1.0}, "clip_norm must be positive"),
    ({"schema": MinSep(30, 1)}, "exceeds the number of rounds"),
])
def test_create_run_rejects_bad_plans(tmp_path, kwargs, message):
    args = {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-6, **kwargs}
    with Ledger.open(str(tmp_path / "l.db"), secret=SECRET) as ledger:
        with pytest.raises(ValueError, match=message):
            ledger.create_run(mechanism_file(tmp_path), **args)
        assert ledger.runs() == []
        with pytest.raises(ValueError, match="cannot read mechanism file"):
            ledger.create_run(str(tmp_path / "missing.json"), noise_multiplier=1.0, clip_norm=1.0, delta=1e-6)


def test_writing_needs_the_secret_and_a_resumed_run_needs_the_same_one(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    ledger.close()
    with Ledger.open(ledger_url) as no_secret:
        with pytest.raises(LedgerError, match="needs the server secret"):
            no_secret.run(run.id)
        assert no_secret.observed_pattern(run.id).rounds_by_user == ()  # reading needs no secret
    with Ledger.open(ledger_url, secret=b"a-different-secret-of-enough-len") as other:
        with pytest.raises(LedgerError, match="not the one this run was recorded with") as e:
            other.run(run.id)
        assert "different" not in str(e.value)
    with Ledger.open(ledger_url, secret=SECRET) as same:
        assert same.run(run.id).info == run.info
        with pytest.raises(LedgerError, match="no run with id 99"):
            same.run(99)


# ---- rounds ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("diagnostics", [True, False])
def test_a_round_records_selection_contributions_rejections_and_drops(ledger_url, tmp_path, diagnostics):
    ledger, run = _run(ledger_url, tmp_path, diagnostics=diagnostics)
    with ledger:
        run.open_round(0)
        accepted = run.record_selection(0, ["a", "b", "c", "d", "e"])
        assert accepted == ["a", "b", "c", "d", "e"]
        run.record_contribution(0, "a", 0.5)
        run.record_contribution(0, "b", 2.0)  # clipped: norm > clip_norm 1.0
        run.record_contribution(0, "c", 1.0, clipped=False)
        run.record_rejection(0, "d", "non-finite update")
        run.record_rejection(0, "mallory", "not selected")  # an update nobody asked for
        summary = run.commit_round(0, noise_std=3.5, epsilon_worst_user=0.4, epsilon_planned=0.5)
        assert (summary.status, summary.attempts) == ("committed", 1)
        assert (summary.selected, summary.contributed, summary.dropped, summary.rejected) == (5, 3, 1, 2)
        assert summary.noise_std == 3.5
        rows = _participations(ledger, run.id)
        by_key = {bytes(k): (st, reason, norm, clip) for _, k, st, reason, norm, clip in rows}
        if diagnostics:
            assert summary.clipped == 1 and (summary.norm_min, summary.norm_median, summary.norm_max) == (0.5, 1.0, 2.0)
            assert summary.norm_mean == pytest.approx(3.5 / 3)
            assert by_key[run.key("a")] == ("contributed", None, 0.5, False)
            assert by_key[run.key("b")] == ("contributed", None, 2.0, True)
        else:  # no data-dependent value anywhere in the ledger
            assert (summary.clipped, summary.norm_min, summary.norm_median, summary.norm_mean, summary.norm_max) == \
                (None,) * 5
            assert by_key[run.key("a")] == by_key[run.key("b")] == ("contributed", None, None, None)
            with ledger.engine.connect() as conn:
                assert conn.execute(select(func.count()).select_from(UpdateNorm)).scalar() == 0
        assert by_key[run.key("d")] == ("rejected", "non-finite update", None, None)
        assert by_key[run.key("e")] == ("dropped", "no update received", None, None)
        assert by_key[run.key("mallory")] == ("rejected", "not selected", None, None)
        assert len(rows) == 6
        with ledger.engine.connect() as conn:
            snap = conn.execute(select(Round.epsilon_worst_user, Round.epsilon_planned)).one()
        assert tuple(snap) == (0.4, 0.5) == (summary.epsilon_worst_user, summary.epsilon_planned)
        assert run.next_round == 1


def test_commit_is_atomic_all_rows_or_none(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    with ledger:
        run.open_round(0)
        run.record_selection(0, ["a", "b"])
        run.record_contribution(0, "a", 0.3)
        # break the commit half-way: a row that collides with the primary key
        pending = run._pending
        pending.rejected[run.key("a")] = "duplicate on purpose"
        with pytest.raises(LedgerError, match="cannot write to ledger"):
            run.commit_round(0, noise_std=1.0)
        assert _participations(ledger, run.id) == []
        assert run.round(0).status == "open"  # the round row's update was rolled back too
        del pending.rejected[run.key("a")]
        summary = run.commit_round(0, noise_std=1.0)  # the round is still open: a retry succeeds
        assert (summary.contributed, summary.dropped) == (1, 1)
        assert len(_participations(ledger, run.id)) == 2


def test_abort_discards_the_round_and_it_can_be_reopened(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    with ledger:
        run.open_round(0)
        run.record_selection(0, ["a", "b", "c"])
        run.record_contribution(0, "a", 0.1)
        run.abort_round(0, "too few updates")
        assert _participations(ledger, run.id) == []
        r = run.round(0)
        assert (r.status, r.attempts, r.contributed) == ("aborted", 1, 0)
        assert run.next_round == 0
        with pytest.raises(LedgerError, match="round 0 is not open"):
            run.record_contribution(0, "a", 0.1)
        run.open_round(0)
        assert run.round(0).status == "open"
        run.record_selection(0, ["a", "b", "c"])  # not counted against the plan: round 0 was aborted
        run.record_contributions(0, ["b", "c"], [0.2, 0.3])
        summary = run.commit_round(0)
        assert (summary.attempts, summary.contributed, summary.dropped) == (2, 2, 1)
        assert {bytes(k) for _, k, st, *_ in _participations(ledger, run.id) if st == "contributed"} == {
            run.key("b"), run.key("c")}


def test_round_order_and_misuse_are_refused(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    with ledger:
        with pytest.raises(LedgerError, match="next round to open is 0, not 1"):
            run.open_round(1)
        with pytest.raises(ValueError, match=r"round index must be an integer in \[0, 24\)"):
            run.open_round(24)
        run.open_round(0)
        with pytest.raises(LedgerError, match="round 0 is still open"):
            run.open_round(1)
        run.record_selection(0, ["alice"])
        with pytest.raises(ValueError, match="already selected") as e:
            run.record_selection(0, ["alice"])
        assert "alice" not in str(e.value) and run.key("alice").hex()[:16] in str(e.value)
        with pytest.raises(ValueError, match="listed twice"):
            run.record_selection(0, ["x", "x"])
        with pytest.raises(ValueError, match="was not selected") as e:
            run.record_contribution(0, "bob", 0.1)
        assert "bob" not in str(e.value)
        with pytest.raises(ValueError, match="update_norm must be finite"):
            run.record_contribution(0, "alice", float("inf"))
        run.record_contribution(0, "alice", 0.1)
        with pytest.raises(ValueError, match="already contributed"):
            run.record_contribution(0, "alice", 0.1)
        with pytest.raises(ValueError, match="already contributed"):
            run.record_rejection(0, "alice", "late")
        run.commit_round(0)
        with pytest.raises(LedgerError, match="round 0 is not open"):
            run.commit_round(0)


def test_a_round_left_open_by_a_stopped_server_is_taken_over_on_resume(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    run.open_round(0)
    run.record_selection(0, ["a"])
    run.record_contribution(0, "a", 0.1)
    ledger.close()  # the server stops without committing
    with Ledger.open(ledger_url, secret=SECRET) as again:
        resumed = again.run(run.id)
        r = resumed.round(0)
        assert (r.status, r.attempts) == ("open", 1)  # resuming alone changes nothing
        assert resumed.next_round == 0 and _participations(again, run.id) == []
        resumed.open_round(0)
        assert resumed.round(0).attempts == 2
        resumed.record_selection(0, ["a", "b"])
        resumed.record_contribution(0, "b", 0.1)
        # the stale handle can neither commit nor abort the round it lost
        with pytest.raises(LedgerError, match=r"re-opened by another handle \(attempt 2\)"):
            run.commit_round(0)
        assert _participations(again, run.id) == []
        summary = resumed.commit_round(0)
        assert (summary.attempts, summary.contributed, summary.dropped) == (2, 1, 1)
        with pytest.raises(LedgerError, match="round 0 is committed, not open"):
            run.commit_round(0)


# ---- eligibility -----------------------------------------------------------------------------------

def _brute_eligible(history: dict[str, list[int]], client: str, t: int, b: int, k: int) -> bool:
    rounds = history.get(client, [])
    return len(rounds) < k and all(t - r >= b for r in rounds)


@pytest.mark.parametrize("schema", [MinSep(3, 4), MinSep(5, 2), FixedEpoch(3, 6)])
def test_eligibility_matches_brute_force_under_minsep(ledger_url, tmp_path, schema):
    ledger, run = _run(ledger_url, tmp_path, schema=schema, rounds=18)
    b, k = schema.min_sep, schema.participations(18)
    rng = random.Random(3)
    clients = [f"client-{i}" for i in range(12)]
    history: dict[str, list[int]] = {}
    with ledger:
        for t in range(18):
            verdict = run.eligible(clients, t)
            assert verdict == [_brute_eligible(history, c, t, b, k) for c in clients], t
            candidates = rng.sample(clients, 7)
            run.open_round(t)
            accepted = run.record_selection(t, candidates)
            assert accepted == [c for c in candidates if _brute_eligible(history, c, t, b, k)]
            contributors = [c for c in accepted if rng.random() < 0.8]  # some drop out
            for c in contributors:
                run.record_contribution(t, c, 0.5)
                history.setdefault(c, []).append(t)
            summary = run.commit_round(t)
            assert summary.rejected == len(candidates) - len(accepted)
            assert summary.dropped == len(accepted) - len(contributors)
        observed = run.observed_pattern()
        assert observed.rounds_by_user == tuple(sorted((run.key(c).hex(), tuple(r)) for c, r in history.items()))
        assert schema.participations(18) >= observed.participations(18)
        if observed.min_sep is not None:
            assert observed.min_sep >= b
        reasons = {r for *_, st, reason, _, _ in _participations(ledger, run.id) if st == "rejected"
                   for r in [reason]}
        assert all(r.startswith("ineligible: ") for r in reasons) and reasons


def test_enforce_false_records_plan_breakers_and_eligibility_sees_them(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path, schema=MinSep(4, 2), rounds=12)
    with ledger:
        for t in range(3):
            run.open_round(t)
            assert run.record_selection(t, ["greedy"], enforce=False) == ["greedy"]
            run.record_contribution(t, "greedy", 0.1)
            run.commit_round(t)
        assert run.eligible(["greedy", "new"], 8) == [False, True]  # 3 > k = 2 contributions
        assert run.history([run.key("greedy")]) == {run.key("greedy"): (3, 2)}  # (contributions, last)
        observed = ledger.observed_pattern(run.id)
        assert observed.rounds_by_user == ((run.key("greedy").hex(), (0, 1, 2)),)


def test_only_contributions_count_for_eligibility(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path, schema=MinSep(5, 3), rounds=12)
    with ledger:
        run.open_round(0)
        run.record_selection(0, ["dropper", "rejected", "contributor"])
        run.record_rejection(0, "rejected", "non-finite update")
        run.record_contribution(0, "contributor", 0.2)
        run.commit_round(0)
        assert run.eligible(["dropper", "rejected", "contributor"], 1) == [True, True, False]
        assert run.eligible(["contributor"], 5) == [True]


def test_eligibility_is_an_indexed_query(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path, schema=MinSep(2, 12), rounds=24)
    with ledger:
        keys = [run.key(f"c{i}") for i in range(300)]
        with ledger.engine.begin() as conn:  # 300 clients with 12 contributions each, written in bulk
            conn.execute(ClientState.__table__.insert(), [
                {"run_id": run.id, "client_key": k, "contributions": 12, "last_round": 22} for k in keys])
            conn.exec_driver_sql("ANALYZE")
        sql = "SELECT client_key, contributions, last_round FROM client_state WHERE run_id = 1 AND client_key IN ({})"
        with ledger.engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                plan = " ".join(str(r[-1]) for r in conn.exec_driver_sql(
                    "EXPLAIN QUERY PLAN " + sql.format(", ".join("?" * 3)), tuple(keys[:3])))
                assert "USING PRIMARY KEY (run_id=? AND client_key=?)" in plan
            else:
                conn.exec_driver_sql("SET enable_seqscan = off")  # the table is small; ask for the index path
                plan = " ".join(r[0] for r in conn.exec_driver_sql(
                    "EXPLAIN " + sql.format(", ".join(["%s"] * 3)), tuple(keys[:3])))
                assert "client_state_pkey" in plan and "client_key = ANY" in plan
        assert run.history(keys[:5] + [run.key("newcomer")]) == {k: (12, 22) for k in keys[:5]}
        assert run.eligible(["c1", "newcomer"], 23) == [False, True]  # k = 12 reached


def test_client_state_follows_the_committed_contributions(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path, schema=MinSep(2, 12), rounds=24)
    rng = random.Random(7)
    expected: dict[bytes, list[int]] = {}
    with ledger:
        for t in range(10):
            run.open_round(t)
            chosen = run.record_selection(t, rng.sample([f"c{i}" for i in range(6)], 4))
            for c in chosen[:3]:
                run.record_contribution(t, c, 0.1)
            if t == 4:
                run.abort_round(t)  # an aborted attempt leaves no trace in the client state
                run.open_round(t)
                chosen = run.record_selection(t, rng.sample([f"c{i}" for i in range(6)], 4))
                for c in chosen[:3]:
                    run.record_contribution(t, c, 0.1)
            run.commit_round(t)
            for c in chosen[:3]:
                expected.setdefault(run.key(c), []).append(t)
        with ledger.engine.connect() as conn:
            state = {bytes(k): (n, last) for k, n, last in conn.execute(
                select(ClientState.client_key, ClientState.contributions, ClientState.last_round))}
    assert state == {k: (len(r), max(r)) for k, r in expected.items()}


# ---- privacy of identifiers ---------------------------------------------------------------------------

def test_neither_the_secret_nor_client_ids_reach_the_ledger(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path)
    clients = ["alice@example.org", "node-8417", "bob-the-client"]
    with ledger:
        run.open_round(0)
        run.record_selection(0, clients)
        run.record_contribution(0, clients[0], 0.3)
        run.record_rejection(0, clients[1], "non-finite update")
        run.commit_round(0)
    dump = dump_database(ledger_url)
    if "://" not in ledger_url:
        dump += open(ledger_url, "rb").read()
    for needle in [SECRET, SECRET.hex().encode(), *(c.encode() for c in clients)]:
        assert needle not in dump
    assert ServerSecret(SECRET).client_key(run.info.uid, clients[0]) in dump  # what is stored instead


# ---- concurrent writers --------------------------------------------------------------------------------

def _checkpoint_hash(run_id: int, t: int) -> str:
    return hashlib.sha256(f"checkpoint {run_id}/{t}".encode()).hexdigest()


def _write_rounds(url: str, run_id: int, barrier, errors) -> None:
    """A server process: its own engine, every round of its run committed as fast as it can."""
    try:
        with Ledger.open(url, secret=SECRET) as ledger:
            run = ledger.run(run_id)
            barrier.wait(timeout=30)
            for t in range(run.info.rounds):
                run.open_round(t)
                clients = [f"r{run_id}-t{t}-c{i}" for i in range(3)]
                run.record_selection(t, clients)
                for c in clients[:2]:
                    run.record_contribution(t, c, 0.5)
                run.commit_round(t, noise_std=1.0, checkpoint_sha256=_checkpoint_hash(run_id, t))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"run {run_id}: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


def test_two_processes_commit_rounds_of_two_runs_into_one_sqlite_file(tmp_path):
    import multiprocessing

    url = str(tmp_path / "shared.db")
    path = mechanism_file(tmp_path, rounds=60, schema=MinSep(4, 15))
    with Ledger.open(url, secret=SECRET) as ledger:
        ids = [ledger.create_run(path, noise_multiplier=1.0, clip_norm=1.0, delta=1e-6).id for _ in range(2)]
    ctx = multiprocessing.get_context("fork")
    barrier, errors = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_write_rounds, args=(url, run_id, barrier, errors)) for run_id in ids]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    reported = [errors.get(timeout=1) for _ in range(errors.qsize())] if not errors.empty() else []
    assert reported == [] and [w.exitcode for w in workers] == [0, 0]
    with Ledger.open(url) as ledger:
        for run_id in ids:
            assert len(ledger.observed_pattern(run_id).rounds_by_user) == 2 * 60
            with ledger.engine.connect() as conn:
                rounds = conn.execute(select(Round.round_index, Round.status, Round.contributed, Round.checkpoint_sha256)
                                      .where(Round.run_id == run_id).order_by(Round.round_index)).all()
            assert rounds == [(t, "committed", 2, _checkpoint_hash(run_id, t)) for t in range(60)]


# ---- the plan on the run row, the checkpoint on the round row --------------------------------------------

PLAN = {"mechanism": {"kind": "bsr", "fingerprint": "sha256:" + "ab" * 32}, "clip_norm": 1.0, "noise_multiplier": 2.0,
        "schema": {"name": "min-sep", "min_sep": 4, "max_participations": 6}, "delta": 1e-6}
FINGERPRINT = "sha256:" + "0f" * 32


def test_the_plan_is_stored_on_the_run_and_finds_it_again(ledger_url, tmp_path):
    ledger, run = _run(ledger_url, tmp_path, plan=PLAN, plan_fingerprint=FINGERPRINT)
    with ledger:
        other = ledger.create_run(mechanism_file(tmp_path), noise_multiplier=1.0, clip_norm=1.0, delta=1e-6,
                                  plan_fingerprint="sha256:" + "11" * 32)
        plain = ledger.create_run(mechanism_file(tmp_path), noise_multiplier=1.0, clip_norm=1.0, delta=1e-6)
        assert (run.info.plan, run.info.plan_fingerprint) == (PLAN, FINGERPRINT)
        assert (plain.info.plan, plain.info.plan_fingerprint) == (None, None) and other.info.plan is None
        assert run.info.to_dict()["plan"] == PLAN and run.info.to_dict()["plan_fingerprint"] == FINGERPRINT
        assert ledger.find_runs(FINGERPRINT) == [run.info]
        again = ledger.create_run(mechanism_file(tmp_path), noise_multiplier=2.0, clip_norm=1.0, delta=1e-6,
                                  plan=PLAN, plan_fingerprint=FINGERPRINT)
        assert [r.id for r in ledger.find_runs(FINGERPRINT)] == [run.id, again.id]
        assert ledger.find_runs("sha256:" + "22" * 32) == []
        assert ledger.run(run.id).info.plan == PLAN  # a resumed server reads it back
        with ledger.engine.connect() as conn:
            indexes = {ix["name"]: ix["column_names"] for ix in inspect(conn).get_indexes("runs")}
        assert indexes["ix_runs_plan_fingerprint"] == ["plan_fingerprint"]


@pytest.mark.parametrize("kwargs, message", [
    ({"plan": {"noise_seed": 7}}, "must not carry secrets: remove its key 'noise_seed'"),
    ({"plan": {"nested": [{"Server_Secret": "x"}]}}, "must not carry secrets"),
    ({"plan": {"x": float("nan")}}, "plan must be JSON"),
    ({"plan": {"x": object()}}, "plan must be JSON"),
    ({"plan": [1, 2]}, "plan must be a dict"),
    ({"plan_fingerprint": ""}, "plan_fingerprint must be a non-empty string"),
    ({"plan_fingerprint": "f" * 81}, "at most 80 characters"),
])
def test_bad_plans_are_refused_before_anything_is_written(tmp_path, kwargs, message):
    from fedmf.errors import ConfigError

    with Ledger.open(str(tmp_path / "l.db"), secret=SECRET) as ledger:
        with pytest.raises(ConfigError, match=message) as e:
            ledger.create_run(mechanism_file(tmp_path), noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, **kwargs)
        assert "\n" not in str(e.value) and ledger.runs() == []
        with pytest.raises(ConfigError, match="plan_fingerprint must be"):
            ledger.find_runs(None)


def test_commit_records_the_checkpoint_hash(ledger_url, tmp_path):
    from fedmf.errors import ConfigError

    digest = hashlib.sha256(b"round 0 checkpoint").hexdigest()
    ledger, run = _run(ledger_url, tmp_path)
    with ledger:
        run.open_round(0)
        run.record_selection(0, ["a"])
        run.record_contribution(0, "a", 0.1)
        for bad in (digest.upper(), digest[:-1], "sha256:" + digest, b"\x00" * 32, digest + "0"):
            with pytest.raises(ConfigError, match="checkpoint_sha256 must be 64 lowercase hex digits"):
                run.commit_round(0, checkpoint_sha256=bad)
        assert run.round(0).status == "open" and run.round(0).checkpoint_sha256 is None
        assert run.commit_round(0, noise_std=2.0, checkpoint_sha256=digest).checkpoint_sha256 == digest
        run.open_round(1)
        assert run.commit_round(1).checkpoint_sha256 is None  # optional
        assert Ledger.open(ledger_url, secret=SECRET).run(run.id).round(0).checkpoint_sha256 == digest


def test_no_temporary_files_when_a_run_is_created(tmp_path, monkeypatch):
    import tempfile

    from fedmf import Workload
    from fedmf.mechanisms import build

    path = mechanism_file(tmp_path)
    mechanism = build("bsr", 24, MinSep(4, 6), Workload())

    def refuse(*args, **kwargs):
        raise AssertionError("a temporary file was created")

    for name in ("TemporaryDirectory", "NamedTemporaryFile", "mkstemp", "mkdtemp"):
        monkeypatch.setattr(tempfile, name, refuse)
    with Ledger.open(str(tmp_path / "l.db"), secret=SECRET) as ledger:
        from_file = ledger.create_run(path, noise_multiplier=1.0, clip_norm=1.0, delta=1e-6)
        ledger.create_run(mechanism, noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, schema=MinSep(4, 6))
        assert from_file.info.mechanism_checksum == load_with_schema(path)[2]
        with ledger.engine.connect() as conn:
            docs = conn.execute(select(Run.mechanism_document).order_by(Run.id)).scalars().all()
    assert docs[0] == open(path).read()
    assert docs[1] == docs[0]  # a Mechanism is stored as io.save writes it


# ---- migrating a ledger written at 0001 -------------------------------------------------------------------

def _write_at_0001(url: str, tmp_path) -> dict:
    """A ledger at schema revision 0001 holding one run with two committed rounds, written
    with the 0001 tables as they are in the database (no code of the current models)."""
    import datetime as dt

    from alembic import command
    from sqlalchemy import MetaData

    from fedmf.ledger.db import _alembic_config, current_revision, resolve_url, writer_engine

    path = mechanism_file(tmp_path, rounds=12, schema=MinSep(3, 4))
    document = open(path).read()
    mechanism, schema, checksum = load_with_schema(path)
    secret = ServerSecret(SECRET)
    uid = "0123456789abcdef0123456789abcdef"
    history = {"a": [0, 3], "b": [0], "c": [3]}
    engine = writer_engine(resolve_url(url))
    try:
        with engine.begin() as conn:
            command.upgrade(_alembic_config(conn), "0001")
            assert current_revision(conn) == "0001"
            meta = MetaData()
            meta.reflect(conn)
            assert "plan" not in meta.tables["runs"].c and "checkpoint_sha256" not in meta.tables["rounds"].c
            now = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
            conn.execute(meta.tables["runs"].insert().values(
                id=1, uid=uid, name="old", created_at=now, code_version="fedmf 0.1", config={"lr": 0.5},
                mechanism_kind=mechanism.kind, mechanism_checksum=checksum, mechanism_document=document, rounds=12,
                noise_multiplier=2.0, clip_norm=1.0, delta=1e-6, target_epsilon=None,
                participation_schema=schema.to_dict(12), sampling="fixed-order", key_check=secret.key_check()))
            conn.execute(meta.tables["rounds"].insert(), [
                {"run_id": 1, "round_index": t, "status": "committed" if t in (0, 3) else "planned",
                 "attempts": int(t in (0, 3)), "selected": 0, "contributed": 0, "dropped": 0, "rejected": 0,
                 "clipped": 0, "noise_std": 4.0 if t in (0, 3) else None} for t in range(12)])
            conn.execute(meta.tables["participations"].insert(), [
                {"run_id": 1, "round_index": t, "client_key": secret.client_key(uid, c), "status": "contributed"}
                for c, rounds in history.items() for t in rounds])
            conn.execute(meta.tables["client_state"].insert(), [
                {"run_id": 1, "client_key": secret.client_key(uid, c), "contributions": len(r), "last_round": r[-1]}
                for c, r in history.items()])
    finally:
        engine.dispose()
    return {c: secret.client_key(uid, c).hex() for c in history} | {"history": history}


def test_a_ledger_at_0001_is_upgraded_in_place_with_its_data(ledger_url, tmp_path):
    from fedmf.audit.replay import audit

    keys = _write_at_0001(ledger_url, tmp_path)
    with pytest.raises(LedgerError, match="schema version 0001, older than this fedmf's 0005"):
        audit(ledger_url)  # the read-only audit never migrates
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        with ledger.engine.connect() as conn:
            assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one() == "0005"
        (info,) = ledger.runs()
        assert (info.id, info.name, info.config, info.rounds, info.schema) == (1, "old", {"lr": 0.5}, 12, MinSep(3, 4))
        assert (info.plan, info.plan_fingerprint) == (None, None) and ledger.find_runs(FINGERPRINT) == []
        run = ledger.run(1)
        assert run.observed_pattern().rounds_by_user == tuple(sorted(
            (keys[c], tuple(r)) for c, r in keys["history"].items()))
        assert [run.round(t).noise_std for t in (0, 3)] == [4.0, 4.0] and run.round(0).checkpoint_sha256 is None
        assert run.next_round == 4 and run.eligible(["a", "b", "new"], 4) == [False, True, True]
        run.open_round(4)
        run.record_selection(4, ["b"])
        run.record_contribution(4, "b", 0.2)
        digest = hashlib.sha256(b"checkpoint 4").hexdigest()
        assert run.commit_round(4, checkpoint_sha256=digest).checkpoint_sha256 == digest
    report = audit(ledger_url)
    assert report.realized["contributions"] == 5 and report.realized["client_state_consistent"] is True
    assert [r["checkpoint_sha256"] for r in report.rounds if r["status"] == "committed"] == [None, None, digest]
    assert report.schema_version == "0005"


def test_migration_0003_is_not_downgraded_and_a_refused_downgrade_changes_nothing(tmp_path):
    from alembic import command

    from fedmf.ledger.db import _alembic_config

    url = str(tmp_path / "l.db")
    ledger, run = _run(url, tmp_path, plan=PLAN, plan_fingerprint=FINGERPRINT)
    run.open_round(0)
    run.record_selection(0, ["a"])
    run.record_contribution(0, "a", 0.1)
    run.commit_round(0, checkpoint_sha256="0" * 64)
    with pytest.raises(NotImplementedError, match="cannot be downgraded"), ledger.engine.begin() as conn:
        command.downgrade(_alembic_config(conn), "0002")
    ledger.close()
    with Ledger.open(url, secret=SECRET) as again:
        resumed = again.run(run.id)
        assert resumed.info.plan == PLAN and resumed.round(0).status == "committed"
        assert resumed.observed_pattern() == run.observed_pattern()


# ---- migrating a ledger written at 0002 (update norms on every row, mutable rounds) ------------------------

def _write_at_0002(url: str, tmp_path) -> dict:
    """A ledger at revision 0002 as the 0002 server wrote it: one run of 8 rounds, rounds 0-2 committed
    (round 1 after an aborted attempt) with update norms, clipped flags, norm summaries and ε snapshots,
    round 3 aborted, round 4 left open, the rest planned."""
    import datetime as dt

    from alembic import command
    from sqlalchemy import MetaData

    from fedmf.ledger.db import _alembic_config, resolve_url, writer_engine

    path = mechanism_file(tmp_path, kind="dp-sgd", rounds=8, schema=MinSep(1, 8))
    mechanism, schema, checksum = load_with_schema(path)
    secret = ServerSecret(SECRET)
    uid = "fedcba9876543210fedcba9876543210"
    key = {c: secret.client_key(uid, c) for c in ("a", "b", "c")}
    now = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    engine = writer_engine(resolve_url(url))
    try:
        with engine.begin() as conn:
            command.upgrade(_alembic_config(conn), "0002")
            meta = MetaData()
            meta.reflect(conn)
            conn.execute(meta.tables["runs"].insert().values(
                id=1, uid=uid, name="old", created_at=now, code_version="fedmf 0.2", config={"noise_key_check": "x"},
                mechanism_kind=mechanism.kind, mechanism_checksum=checksum, mechanism_document=open(path).read(),
                rounds=8, noise_multiplier=2.0, clip_norm=1.0, delta=1e-6, target_epsilon=None,
                participation_schema=schema.to_dict(8), sampling="fixed-order", key_check=secret.key_check(),
                plan=PLAN, plan_fingerprint=FINGERPRINT))
            status = {0: "committed", 1: "committed", 2: "committed", 3: "aborted", 4: "open"}
            conn.execute(meta.tables["rounds"].insert(), [
                {"run_id": 1, "round_index": t, "status": status.get(t, "planned"),
                 "attempts": {1: 2, 3: 1, 4: 1}.get(t, int(t < 3)), "selected": 3 if t < 3 else 0,
                 "contributed": 2 if t < 3 else 0, "dropped": 1 if t < 3 else 0, "rejected": 0,
                 "clipped": 1 if t < 3 else 0, "norm_min": 0.5 if t < 3 else None, "norm_max": 2.0 if t < 3 else None,
                 "noise_std": 4.0 if t < 3 else None, "abort_reason": "lost quorum" if t == 3 else None,
                 "checkpoint_sha256": f"{t:064x}" if t < 3 else None,
                 "opened_at": now if t < 5 else None, "closed_at": now if t < 4 else None} for t in range(8)])
            conn.execute(meta.tables["participations"].insert(), [
                {"run_id": 1, "round_index": t, "client_key": key[c], "status": s, "update_norm": n, "clipped": cl,
                 "reason": "no update received" if s == "dropped" else None}
                for t in range(3) for c, s, n, cl in (("a", "contributed", 0.5, False), ("b", "contributed", 2.0, True),
                                                      ("c", "dropped", None, None))])
            conn.execute(meta.tables["client_state"].insert(), [
                {"run_id": 1, "client_key": key[c], "contributions": 3, "last_round": 2} for c in ("a", "b")])
            conn.execute(meta.tables["privacy_snapshots"].insert(), [
                {"run_id": 1, "round_index": t, "epsilon_worst_user": 0.1 * (t + 1), "epsilon_planned": 0.2 * (t + 1),
                 "created_at": now} for t in range(3)])
    finally:
        engine.dispose()
    return key


def test_a_ledger_at_0002_moves_to_append_only_history_and_verifies(ledger_url, tmp_path, capsys):
    from fedmf.audit.replay import audit
    from fedmf.cli import main as fedmf_main

    key = _write_at_0002(ledger_url, tmp_path)
    with pytest.raises(LedgerError, match="schema version 0002, older than this fedmf's 0005"):
        audit(ledger_url)
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        info, = ledger.runs()
        assert info.diagnostics is True and info.plan == PLAN  # its norms were kept, as diagnostics
        run = ledger.run(1)
        assert run.next_round == 3
        summary = run.round(1)
        assert (summary.status, summary.attempts, summary.contributed, summary.dropped) == ("committed", 2, 2, 1)
        assert (summary.epsilon_worst_user, summary.epsilon_planned) == pytest.approx((0.2, 0.4))
        assert (summary.clipped, summary.norm_min, summary.norm_max, summary.norm_mean) == (1, 0.5, 2.0, 1.25)
        assert (run.round(3).status, run.round(3).attempts) == ("aborted", 1)
        assert (run.round(4).status, run.round(5).status) == ("open", "planned")
        assert run.observed_pattern().rounds_by_user == tuple(sorted((key[c].hex(), (0, 1, 2)) for c in ("a", "b")))
        with ledger.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Round)).scalar() == 3
            assert conn.execute(select(func.count()).select_from(UpdateNorm)).scalar() == 6
            assert "privacy_snapshots" not in inspect(conn).get_table_names()
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", ledger_url, "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["ok"] and report["verify"]["rounds_verified"] == 3
    assert [r["status"] for r in report["rounds"]] == ["committed"] * 3 + ["aborted", "open"]
    assert report["realized"]["aborts"] == 2 and report["rounds"][0]["norm_max"] == 2.0
    # the migrated run goes on, chained to the migrated rounds
    with Ledger.open(ledger_url, secret=SECRET) as ledger:
        run = ledger.run(1)
        run.open_round(3)
        run.record_selection(3, ["a", "c"])
        run.record_contribution(3, "a", 0.3)
        run.commit_round(3, noise_std=4.0)
    again = audit(ledger_url, verify=True)
    assert again.chain.ok and again.chain.head_round == 3 and again.realized["contributions"] == 7
