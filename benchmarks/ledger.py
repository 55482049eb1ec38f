"""The participation ledger at scale: SQLite and PostgreSQL side by side.

    python benchmarks/ledger.py                 # 10^5 clients x 2000 rounds x 1000 per round (2·10^6 rows)
    python benchmarks/ledger.py --small         # 10^4 clients x 200 rounds x 100 per round
    python benchmarks/ledger.py --backends sqlite --json

A synthetic run (mechanism: BISR with n rounds, planned for MinSep(b, k) with
b = clients / (2 per_round) and k = ceil(n / b)): in every round the server picks per_round
clients at random among those eligible (about half of all clients), so every client has
its own pattern (about n·per_round/clients participations). The rounds are written into
the ledger's tables in batches of whole committed rounds through the driver's bulk path
(executemany / COPY). Then, on that full ledger:
  * record one round: open_round + record_selection (eligibility enforced: one indexed
    query for the candidates) + record_contribution x per_round + commit_round (targets on
    SQLite: < 0.5 s for 1000 participants);
  * the eligibility query for per_round candidates (target < 50 ms);
  * a full `fedmf audit` of the ledger, with CSV and PNG (target < 30 s).
PostgreSQL: FEDMF_BENCH_POSTGRES_URL or --postgres-url (default the local server); the
benchmark works in a schema of its own and drops it afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, insert, text

from fedmf import MinSep, Workload
from fedmf.audit.replay import audit
from fedmf.ledger import Ledger
from fedmf.ledger.chain import round_sha256
from fedmf.ledger.models import Participation, Round
from fedmf.mechanisms import build

SECRET = b"benchmark-secret-not-for-production!"
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def geometry(small: bool) -> dict:
    if small:
        return {"clients": 10_000, "rounds": 200, "per_round": 100}
    return {"clients": 100_000, "rounds": 2000, "per_round": 1000}


def schedule(g: dict, b: int, k: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each round's clients, picked at random among the eligible; and, before the last
    round, each client's contributions so far and last round (for checking eligibility)."""
    rng = np.random.default_rng(seed)
    last = np.full(g["clients"], -(10**9))
    count = np.zeros(g["clients"], dtype=np.int64)
    rounds = []
    for t in range(g["rounds"]):
        eligible = np.flatnonzero((t - last >= b) & (count < k))
        chosen = np.sort(rng.choice(eligible, g["per_round"], replace=False))
        rounds.append(chosen)
        last[chosen] = t
        count[chosen] += 1
    return rounds


def fill(ledger: Ledger, run, keys: list[bytes], g: dict, plan: list[np.ndarray], upto: int, batch_rounds: int,
         noise_std: float) -> float:
    """Write rounds [0, upto) as committed (their records chained as ``commit_round`` chains them),
    ``batch_rounds`` rounds per transaction, through the driver's bulk path for the participations
    (executemany on SQLite, COPY on PostgreSQL), with the usual bulk-load
    recipe: the eligibility index (and on PostgreSQL the foreign key to rounds) is dropped first
    and rebuilt at the end; returns seconds."""
    started = time.perf_counter()
    index = next(ix for ix in Participation.__table__.indexes if ix.name == "ix_participations_client")
    postgres = ledger.engine.dialect.name == "postgresql"
    with ledger.engine.begin() as conn:
        index.drop(conn)
        if postgres:  # its per-row trigger costs more than the rows (SQLite checks FKs cheaply)
            conn.exec_driver_sql("ALTER TABLE participations DROP CONSTRAINT fk_participations_round")
    sql = ("INSERT INTO participations (run_id, round_index, client_key, status, reason) "
           "VALUES (?, ?, ?, 'contributed', NULL)")
    previous = run.info.genesis_sha256
    for t0 in range(0, upto, batch_rounds):
        t1 = min(upto, t0 + batch_rounds)
        rows, records = [], []
        for t in range(t0, t1):
            chosen = [keys[c] for c in plan[t].tolist()]
            rows.extend((run.id, t, key) for key in chosen)
            record = {"run_id": run.id, "round_index": t, "status": "committed", "attempts": 1,
                      "selected": g["per_round"], "contributed": g["per_round"], "dropped": 0, "rejected": 0,
                      "noise_std": noise_std, "checkpoint_sha256": None, "epsilon_worst_user": None,
                      "epsilon_planned": None}
            previous = round_sha256(previous, record, [(k, "contributed", None) for k in chosen])
            record["chain_sha256"] = previous
            records.append(record)
        with ledger.engine.begin() as conn:
            conn.execute(insert(Round), records)
            raw = conn.connection.dbapi_connection
            if conn.dialect.name == "sqlite":
                raw.executemany(sql, rows)
            else:
                with raw.cursor() as cur, cur.copy(
                    "COPY participations (run_id, round_index, client_key, status) FROM STDIN"
                ) as copy:
                    for run_id, t, key in rows:
                        copy.write_row((run_id, t, key, "contributed"))
    with ledger.engine.begin() as conn:
        index.create(conn)
        conn.exec_driver_sql(  # what commit_round maintains row by row
            "INSERT INTO client_state (run_id, client_key, contributions, last_round) "
            f"SELECT run_id, client_key, count(*), max(round_index) FROM participations WHERE run_id = {run.id} "
            "AND status = 'contributed' GROUP BY run_id, client_key")
        if postgres:  # re-added and validated over every row in one pass
            conn.exec_driver_sql(
                "ALTER TABLE participations ADD CONSTRAINT fk_participations_round FOREIGN KEY "
                "(run_id, round_index) REFERENCES rounds (run_id, round_index) ON DELETE CASCADE")
    if postgres:  # what autovacuum does on PostgreSQL once an insert-only table grew
        with ledger.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    else:
        with ledger.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
    return time.perf_counter() - started


def bench_backend(name: str, url: str, g: dict, timed_rounds: int, work: Path, plot: bool) -> dict:
    n, per, clients = g["rounds"], g["per_round"], g["clients"]
    b = clients // (2 * per)
    schema = MinSep(b)
    k = schema.participations(n)
    mech = build("bisr", n, schema, Workload())
    sigma = 1.0 * 1.0 * mech.sensitivity(schema).value  # z · clip · sens: the plan's noise
    plan = schedule(g, b, k)
    out: dict = {"backend": name}
    t = time.perf_counter()
    ledger = Ledger.open(url, secret=SECRET)
    run = ledger.create_run(mech, noise_multiplier=1.0, clip_norm=1.0, delta=1e-6, schema=schema,
                            name=f"bench-{name}")
    out["create_run_s"] = time.perf_counter() - t
    client_ids = [f"client-{i}" for i in range(clients)]
    keys = run.keys(client_ids)  # HMAC-SHA256 under the server secret, as the API computes them
    upto = n - timed_rounds
    out["fill_s"] = fill(ledger, run, keys, g, plan, upto, max(1, 50_000 // per), sigma)
    out["fill_rows"] = upto * per
    out["fill_rows_per_s"] = out["fill_rows"] / out["fill_s"]

    # eligibility at round `upto` of per_round random clients, checked against the schedule
    last = np.full(clients, -(10**9))
    count = np.zeros(clients, dtype=np.int64)
    for t_round in range(upto):
        last[plan[t_round]] = t_round
        count[plan[t_round]] += 1
    rng = np.random.default_rng(2)
    times = []
    for _ in range(15):
        cands = rng.choice(clients, per, replace=False)
        t = time.perf_counter()
        verdict = run.eligible([client_ids[c] for c in cands], upto)
        times.append(time.perf_counter() - t)
        expected = ((upto - last[cands] >= b) & (count[cands] < k)).tolist()
        assert verdict == expected
    out["eligible_ms_median"] = 1e3 * statistics.median(times)
    out["eligible_ms_max"] = 1e3 * max(times)
    out["eligible_fraction"] = sum(verdict) / per

    # record rounds through the API (eligibility enforced), on top of the full ledger
    rng = np.random.default_rng(1)
    rec, commit = [], []
    for t_round in range(upto, n):
        cands = [client_ids[c] for c in plan[t_round]]
        norms = rng.uniform(0.2, 1.5, per)
        t = time.perf_counter()
        run.open_round(t_round)
        accepted = run.record_selection(t_round, cands)
        for c, norm in zip(accepted, norms):
            run.record_contribution(t_round, c, float(norm))
        tc = time.perf_counter()
        summary = run.commit_round(t_round, noise_std=sigma,
                                   checkpoint_sha256=hashlib.sha256(f"checkpoint {t_round}".encode()).hexdigest())
        done = time.perf_counter()
        rec.append(done - t)
        commit.append(done - tc)
        assert summary.contributed == per, summary
    out["record_round_s_median"] = statistics.median(rec)
    out["record_round_s_max"] = max(rec)
    out["commit_round_s_median"] = statistics.median(commit)

    # the audit, read-only: in this process (modules already imported), then as the command
    # `fedmf audit --ledger URL --csv --plot` in a fresh interpreter (imports included)
    t = time.perf_counter()
    report = audit(url)
    out["audit_s"] = time.perf_counter() - t
    t = time.perf_counter()
    verified = audit(url, verify=True).chain
    out["audit_verify_s"] = time.perf_counter() - t  # the audit plus every participation re-hashed
    assert verified.ok and verified.rounds_verified == n, verified
    t = time.perf_counter()
    report.write_csv(work / f"audit-{name}.csv")
    if plot:
        report.plot(work / f"audit-{name}.png")
    out["audit_outputs_s"] = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedmf.cli", "audit", "--ledger", url, "--json",
                    "--csv", str(work / f"cli-{name}.csv"), "--plot", str(work / f"cli-{name}.png")],
                   check=True, stdout=subprocess.DEVNULL)
    out["audit_cli_s"] = time.perf_counter() - t
    r = report.realized
    out["audit_users"] = r["users"]
    out["audit_contributions"] = r["contributions"]
    out["audit_min_separation"] = r["min_separation"]
    out["audit_max_participations"] = r["max_participations"]
    out["audit_epsilon_worst_user"] = r["epsilon_worst_user"]
    out["audit_epsilon_planned"] = report.planned["epsilon"]
    out["audit_flagged"] = r["flagged_users"]
    out["audit_rounds_below_plan_noise"] = len(r["rounds_below_planned_noise"])
    out["audit_client_state_consistent"] = r["client_state_consistent"]
    with ledger.engine.connect() as conn:
        if name == "sqlite":
            out["size_mb"] = os.path.getsize(ledger.url.database) / 2**20
        else:
            out["size_mb"] = conn.execute(text(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace s "
                "ON s.oid = c.relnamespace WHERE s.nspname = current_schema() AND c.relkind = 'r'"
            )).scalar() / 2**20
    ledger.close()
    return out


def main(argv=None) -> int:
    import fedmf.accounting.per_round  # noqa: F401 - import once, outside the timings
    import fedmf.accounting.posthoc  # noqa: F401

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="10^4 clients x 200 rounds x 100 per round")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--postgres-url", default=os.environ.get("FEDMF_BENCH_POSTGRES_URL", DEFAULT_PG))
    ap.add_argument("--timed-rounds", type=int, default=5, help="rounds recorded through the API at the end")
    ap.add_argument("--dir", help="where the SQLite file, CSV and PNG go (default: a temporary directory)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--keep-postgres", action="store_true", help="keep the PostgreSQL schema (its name is printed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    g = geometry(args.small)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for backend in args.backends.split(","):
            if backend == "sqlite":
                path = work / "ledger-bench.db"
                path.unlink(missing_ok=True)
                results.append(bench_backend("sqlite", str(path), g, args.timed_rounds, work, not args.no_plot))
            elif backend == "postgresql":
                schema = f"fedmf_bench_{uuid.uuid4().hex[:10]}"
                admin = create_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
                with admin.connect() as conn:
                    conn.execute(text(f"CREATE SCHEMA {schema}"))
                try:
                    from sqlalchemy.engine import make_url

                    url = make_url(args.postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
                    results.append(bench_backend("postgresql", url.render_as_string(hide_password=False), g,
                                                 args.timed_rounds, work, not args.no_plot))
                finally:
                    if args.keep_postgres:
                        print(f"kept PostgreSQL schema {schema}", file=sys.stderr)
                    else:
                        with admin.connect() as conn:
                            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
                    admin.dispose()
            else:
                raise SystemExit(f"unknown backend {backend!r}")
    if args.json:
        print(json.dumps({"geometry": g, "results": results}))
    else:
        print(f"geometry: {g['clients']} clients x {g['rounds']} rounds x {g['per_round']} per round "
              f"({g['rounds'] * g['per_round']} participation rows)")
        keys = [k for k in results[0] if k != "backend"]
        print(f"{'':32}" + "".join(f"{r['backend']:>16}" for r in results))
        for k in keys:
            cells = []
            for r in results:
                v = r.get(k)
                cells.append(f"{v:>16.4g}" if isinstance(v, float) else f"{v!s:>16}")
            print(f"{k:32}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
