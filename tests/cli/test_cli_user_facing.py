"""The CLI a user meets: one round numbering in every output, the summary's time over every
invocation, refused starts that leave nothing behind, errors that name the flag typed, no output
column that is always empty."""

from __future__ import annotations

import csv
import json
import os

import pytest

from fedmf.cli import main
from fedmf.cli.common import name_flags


def test_one_round_numbering_in_every_output(tmp_path, capsys):
    """Rounds are 0-based (ARCHITECTURE.md, Names) in results.json, rounds.jsonl, the audit's JSON and
    CSV and the progress lines; counts of rounds count."""
    out = tmp_path / "sim"
    assert main(["simulate", "--preset", "tiny", "--rounds", "5", "--out", str(out), "--no-plot"]) == 0
    err = capsys.readouterr().err
    n = 5
    expected = list(range(n))
    results = json.loads((out / "results.json").read_text())
    assert [h["round"] for h in results["history"]] == expected and results["rounds_done"] == n
    logged = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [e["round"] for e in logged] == [e["record"]["round"] for e in logged] == expected
    progress = [line for line in err.splitlines() if "  round " in line and ": eps " in line]
    assert [int(line.split("  round ")[1].split(":")[0]) for line in progress] == expected
    assert [line.split("/")[0].split()[-1] for line in progress] == [str(t + 1) for t in expected]  # counts

    csv_path = tmp_path / "rounds.csv"
    assert main(["audit", "--ledger", str(out / "ledger.db"), "--json", "--csv", str(csv_path)]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert [r["round"] for r in audit["rounds"]] == expected
    assert audit["realized"]["last_committed_round"] == n - 1
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == expected
    # no column that is empty in every row (recorded_epsilon_worst_user was: fedmf never records it)
    empty = [c for c in rows[0] if all(r[c] == "" for r in rows)]
    assert not empty, empty
    assert "recorded_epsilon_worst_user" not in rows[0]
    assert all("recorded_epsilon_worst_user" not in r for r in audit["rounds"])


def test_the_summary_time_covers_every_invocation(tmp_path, capsys):
    """A run stopped after 2 of 4 rounds and resumed: the summary's time is both invocations'."""
    from fedmf.config import RunConfig
    from fedmf.run.simulate import ELAPSED_FILE, preset_values, simulate
    from fedmf.tasks import ClientHyper, get_task

    config = RunConfig.from_mapping(preset_values("tiny", {"rounds": 4, "run-dir": str(tmp_path / "run")}))
    task = get_task(config.task, **config.task_options)
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    calls = []

    def stopping_evaluate(model):
        calls.append(1)
        if len(calls) == 3:  # during round 2's release: rounds 0 and 1 were released
            raise KeyboardInterrupt
        return task.evaluate(model)

    with pytest.raises(KeyboardInterrupt):
        simulate(config, model=task.model(), users=task.users(), local_update=task.as_local_update(hyper),
                 evaluate=stopping_evaluate, progress=False, plot=False)
    first = json.loads((tmp_path / "run" / ELAPSED_FILE).read_text())["invocations"]
    assert len(first) == 1 and list(first.values())[0] > 0
    result = simulate(config, model=task.model(), users=task.users(), local_update=task.as_local_update(hyper),
                      evaluate=task.evaluate, progress=False, plot=False)
    entries = json.loads((tmp_path / "run" / ELAPSED_FILE).read_text())["invocations"]
    assert len(entries) == 2 and result.rounds_done == 4
    assert result.seconds_total == pytest.approx(sum(entries.values()))
    assert result.seconds_total == pytest.approx(result.seconds + list(first.values())[0])
    assert json.loads((tmp_path / "run" / "results.json").read_text())["seconds_total"] == \
        pytest.approx(result.seconds_total)
    from fedmf.cli.simulate import _time_line

    assert _time_line(3.0, 10.0) == "10.0 s in all invocations of this run (3.0 s this one)"
    assert _time_line(3.0, 3.0) == "3.0 s"


def _budget_ledger(tmp_path):
    ledger, key = tmp_path / "shared.db", tmp_path / "budget.key"
    assert main(["budget", "default", "5", "--ledger", str(ledger), "--key", str(key)]) == 0
    return ledger, key


def test_a_refused_start_leaves_nothing_behind_and_names_the_flag(tmp_path, capsys):
    """The ledger enforces lifetime budgets and the run lacks --budget-key: refused after the run
    directory's secrets were made; the error names the flag, and the directory is gone again."""
    ledger, _ = _budget_ledger(tmp_path)
    capsys.readouterr()
    out = tmp_path / "new-run"
    argv = ["simulate", "--preset", "tiny", "--rounds", "2", "--ledger", str(ledger), "--out", str(out), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--budget-key" in err and "budget_key" not in err
    assert not out.exists()
    # and the parents it had to make for a nested --out
    nested = tmp_path / "a" / "b" / "run"
    assert main(argv[:-3] + ["--out", str(nested), "--quiet"]) == 2
    capsys.readouterr()
    assert not (tmp_path / "a").exists()
    # a directory that was there keeps what it held, and only that
    out.mkdir(mode=0o700)
    (out / "notes.txt").write_text("mine")
    os.mkdir(out / "secrets", mode=0o700)
    (out / "secrets" / "other").write_text("kept")
    assert main(argv) == 2
    capsys.readouterr()
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert found == ["notes.txt", "secrets", "secrets/other"]


def test_a_refused_resume_keeps_the_run(tmp_path, capsys):
    """A refusal of an existing run (another plan) removes nothing of it."""
    out = tmp_path / "run"
    assert main(["simulate", "--preset", "tiny", "--rounds", "2", "--out", str(out), "--quiet", "--no-plot"]) == 0
    capsys.readouterr()
    before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main(["simulate", "--preset", "tiny", "--rounds", "3", "--out", str(out), "--quiet"]) == 2
    assert "another plan" in capsys.readouterr().err
    after = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(before) <= set(after)


def test_errors_name_the_flags_the_user_typed(tmp_path, capsys):
    flags = {"budget_key": "--budget-key", "budget-key": "--budget-key", "target-epsilon": "--epsilon",
             "rounds": "--rounds", "noise-multiplier": "--noise-multiplier"}
    assert name_flags("give the run its budget secret (budget_key)", flags) == \
        "give the run its budget secret (--budget-key)"
    assert name_flags("set noise-multiplier or target-epsilon (both are 0)", flags) == \
        "set --noise-multiplier or --epsilon (both are 0)"
    assert name_flags("rounds must be an integer in [1, 9], got 0", flags) == \
        "--rounds must be an integer in [1, 9], got 0"
    # prose keeps its words; a flag already named stays as it is
    assert name_flags("the run's 20 rounds are done; --budget-key given", flags) == \
        "the run's 20 rounds are done; --budget-key given"
    out = str(tmp_path / "x")
    for argv, flag in ((["--server-lr", "-1"], "--server-lr"), (["--rounds", "0"], "--rounds")):
        assert main(["simulate", "--preset", "tiny", "--out", out, "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedmf: error: {flag} "), err
    assert not os.path.exists(out)
