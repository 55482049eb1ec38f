"""Review of issue 34 items 1/3/5: rollback attacks on the release-once invariant (in-process, tiny task).

Run from the worktree root: PYTHONPATH=$PWD python docs/reviews/i34-release-once/attack.py [NAME ...]
Each scenario prints REFUSED (with the one-line reason) or ACCEPTED (and the rounds released again)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from fedmf.errors import FedmfError  # noqa: E402
from fedmf.run.federated import train  # noqa: E402
from tests import _federated_task as task  # noqa: E402

ROUNDS = 6


class Stop(Exception):
    pass


def run(run_dir, *, ledger=None, witness=None, rounds=None, stop=None, stop_eval=None, snap=None):
    """Train/resume (a new run evaluates its initial model first: stop_eval=t+2 stops in round t's
    evaluation); returns (released rounds, evaluated rounds) or raises the refusal."""
    released, evaluated = [], []

    def on_event(name, t):
        if snap is not None and (name, t) in snap:
            snap[(name, t)]()
        if (name, t) == stop:
            raise Stop(f"{name} {t}")

    def evaluate(model):
        evaluated.append(float(model.linear.bias.detach().sum()))
        if stop_eval is not None and len(evaluated) == stop_eval:
            raise Stop("evaluate")
        return {"bias-sum": evaluated[-1]}

    try:
        train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=run_dir,
              ledger=ledger, rounds=rounds, witness=witness, on_event=on_event,
              on_round=lambda r: released.append(r.round), evaluate=evaluate)
    except Stop:
        pass
    return released, evaluated


def copy_sqlite(src, dst):
    import sqlite3
    s, d = sqlite3.connect(src), sqlite3.connect(dst)
    s.backup(d)
    s.close(), d.close()


def restore_sqlite(backup, ledger):
    for suffix in ("-wal", "-shm"):
        Path(str(ledger) + suffix).unlink(missing_ok=True)
    shutil.copy2(backup, ledger)


def outcome(name, fn):
    try:
        again = fn()
        print(f"{name}: ACCEPTED (released again: {again})")
    except FedmfError as e:
        print(f"{name}: REFUSED: {type(e).__name__}: {e}")


def scenarios(tmp: Path):
    out = {}

    def ledger_before_first_commit_outside():
        d, ledger, bk = tmp / "a-run", tmp / "a-ledger.db", tmp / "a-bk.db"
        run(d, ledger=ledger, rounds=3, snap={("selected", 0): lambda: copy_sqlite(ledger, bk)})
        restore_sqlite(bk, ledger)
        return run(d, ledger=ledger, rounds=4)[0]
    out["ledger-before-first-commit"] = ledger_before_first_commit_outside

    def ledger_before_first_commit_clean_rundir():
        d, ledger, bk = tmp / "b-run", tmp / "b-ledger.db", tmp / "b-bk.db"
        run(d, ledger=ledger, rounds=3, snap={("selected", 0): lambda: copy_sqlite(ledger, bk)})
        restore_sqlite(bk, ledger)
        for p in d.iterdir():
            if p.name.startswith(("round-", "noise-")) or p.name == "rounds.jsonl":
                p.unlink()
        return run(d, ledger=ledger, rounds=4)[0]
    out["ledger-and-rundir-before-first-commit"] = ledger_before_first_commit_clean_rundir

    def both_rolled_back_witness_dir_changed():
        d, ledger, bk = tmp / "c-run", tmp / "c-ledger.db", tmp / "c-bk.db"
        snapdir = tmp / "c-run-bk"

        def snapshot():
            copy_sqlite(ledger, bk)
            shutil.copytree(d, snapdir, ignore=shutil.ignore_patterns("run.lock"))
        run(d, ledger=ledger, rounds=3, snap={("guarded", 1): snapshot})
        shutil.rmtree(d)
        shutil.copytree(snapdir, d)
        restore_sqlite(bk, ledger)
        os.environ["XDG_STATE_HOME"] = str(tmp / "other-state")  # e.g. run under systemd instead of a shell
        return run(d, ledger=ledger, rounds=4)[0]
    out["both-rolled-back-witness-dir-changed"] = both_rolled_back_witness_dir_changed

    def witness_parent_world_writable():
        parent = tmp / "shared"
        parent.mkdir(mode=0o777)
        parent.chmod(0o777)  # not sticky: another user may rename the witness directory away
        d = tmp / "d-run"
        run(d, witness=parent / "witness", rounds=1)
        return "opened with a witness under a 0777 non-sticky parent"
    out["witness-parent-world-writable"] = witness_parent_world_writable

    def ledger_one_back_in_eval_window():
        d, ledger, bk = tmp / "e-run", tmp / "e-ledger.db", tmp / "e-bk.db"
        # round 2's evaluation leaves the process (evaluate called), then it crashes before rounds.jsonl
        run(d, ledger=ledger, rounds=4, stop_eval=4, snap={("noised", 2): lambda: copy_sqlite(ledger, bk)})
        restore_sqlite(bk, ledger)
        return run(d, ledger=ledger, rounds=4)[0]
    out["ledger-one-back-eval-window"] = ledger_one_back_in_eval_window

    def ledger_round0_open_eval_window_witness_deleted():
        d, ledger, bk, w = tmp / "f-run", tmp / "f-ledger.db", tmp / "f-bk.db", tmp / "f-witness"
        run(d, ledger=ledger, witness=w, rounds=4, stop_eval=2, snap={("noised", 0): lambda: copy_sqlite(ledger, bk)})
        restore_sqlite(bk, ledger)
        shutil.rmtree(w)
        return run(d, ledger=ledger, witness=w, rounds=2)
    out["ledger-round0-open-eval-window-no-witness"] = ledger_round0_open_eval_window_witness_deleted

    def ledger_round0_open_eval_window():
        d, ledger, bk, w = tmp / "g-run", tmp / "g-ledger.db", tmp / "g-bk.db", tmp / "g-witness"
        run(d, ledger=ledger, witness=w, rounds=4, stop_eval=2, snap={("noised", 0): lambda: copy_sqlite(ledger, bk)})
        restore_sqlite(bk, ledger)
        return run(d, ledger=ledger, witness=w, rounds=2)
    out["ledger-round0-open-eval-window"] = ledger_round0_open_eval_window

    def fork_same_witness():
        d, w = tmp / "h-run", tmp / "h-witness"
        run(d, witness=w, rounds=2)
        shutil.copytree(d, tmp / "h-fork", ignore=shutil.ignore_patterns("run.lock"))
        run(d, witness=w, rounds=3)
        return run(tmp / "h-fork", witness=w, rounds=3)[0]
    out["fork-same-witness"] = fork_same_witness

    def both_rolled_back_genesis_column_edited():
        d, ledger, bk = tmp / "i-run", tmp / "i-ledger.db", tmp / "i-bk.db"
        snapdir = tmp / "i-run-bk"

        def snapshot():
            copy_sqlite(ledger, bk)
            shutil.copytree(d, snapdir, ignore=shutil.ignore_patterns("run.lock"))
        run(d, ledger=ledger, rounds=3, snap={("guarded", 1): snapshot})
        shutil.rmtree(d)
        shutil.copytree(snapdir, d)
        restore_sqlite(bk, ledger)
        import sqlite3
        c = sqlite3.connect(ledger)  # the database owner's edit: the stored genesis column only
        c.execute("UPDATE runs SET genesis_sha256 = ?", ("ab" * 32,))
        c.commit()
        c.close()
        return run(d, ledger=ledger, rounds=4)[0]
    out["both-rolled-back-genesis-column-edited"] = both_rolled_back_genesis_column_edited

    def crash_sweep():
        """Stop at each event of round 1 (and inside its evaluation); then (i) a plain resume releases
        each round once; (ii) the ledger alone restored to a backup taken while round 1 was open, the
        witness lost: accepted only where nothing of round 1 had left (its evaluation not made)."""
        from fedmf.run.private_run import EVENTS
        rows = []
        for stop in [("ev", e) for e in EVENTS] + [("eval", None)]:
            for mode in ("plain", "ledger-rollback"):
                base = tmp / f"sweep-{stop[1]}-{mode}"
                d, ledger, bk, w = base / "run", base / "ledger.db", base / "bk.db", base / "w"
                base.mkdir()
                kw = dict(stop=(stop[1], 1)) if stop[0] == "ev" else dict(stop_eval=3)
                first, evals = run(d, ledger=ledger, witness=w, rounds=3,
                                   snap={("noised", 1): lambda: copy_sqlite(ledger, bk)}, **kw)  # noqa: B023 (run() calls it within this iteration)
                round1_left = len(evals) >= 3  # initial, round 0, round 1
                try:
                    if mode == "ledger-rollback":
                        if not bk.exists():  # stopped before round 1 was open: no such backup
                            rows.append(f"  stop {stop[1]} {mode}: n/a (round 1 never opened)")
                            continue
                        restore_sqlite(bk, ledger)
                        shutil.rmtree(w)
                    again, _ = run(d, ledger=ledger, witness=w, rounds=3)
                    verdict = f"accepted, released {first} then {again}"
                    # plain: no round released twice (a stop at "released" has round 1 in rounds.jsonl
                    # before on_round saw it: on_round misses it, correctly not released again)
                    logged = [json.loads(x)["round"] for x in (d / "rounds.jsonl").read_text().splitlines()]
                    bad = (mode == "plain" and (len(set(first + again)) != len(first + again)
                                                or sorted(logged) != [0, 1, 2])) or (
                        mode == "ledger-rollback" and round1_left)
                except FedmfError as e:
                    verdict, bad = f"refused: {str(e)[:110]}", mode == "plain"
                rows.append(f"  stop {stop[1] or 'in evaluation'} (round 1 evaluated: {round1_left}) {mode}: "
                            f"{verdict}{'  <-- PROBLEM' if bad else ''}")
        return "\n" + "\n".join(rows)
    out["crash-sweep"] = crash_sweep

    return out


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        os.environ["XDG_STATE_HOME"] = str(tmp / "state")
        todo = scenarios(tmp)
        for name in sys.argv[1:] or list(todo):
            os.environ["XDG_STATE_HOME"] = str(tmp / "state")
            outcome(name, todo[name])
