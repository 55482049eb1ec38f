"""How a server run ended, as data (fedmf/run/outcome.py): ``<run-dir>/outcome.json`` written by the
ServerApp's code path (server.app.run_server, here on a LocalGrid with the real ClientApp: no Flower
process) and read back by the Flower backend of ``fedmf simulate`` instead of log lines."""

from __future__ import annotations

import json

import pytest

from fedmf.errors import FedmfError, OutcomeError, PrivacyBudgetExceeded
from fedmf.run.outcome import OUTCOME_FILE, OUTCOME_FORMAT, RunOutcome, read_outcome, write_outcome


def test_written_and_read_back(tmp_path):
    outcome = RunOutcome(3, 20, "guard: round 20 would spend epsilon 9 as planned", "ledger.db")
    path = write_outcome(tmp_path, outcome)
    assert path == tmp_path / OUTCOME_FILE and path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["format"] == OUTCOME_FORMAT
    assert read_outcome(tmp_path) == outcome
    error = RunOutcome(None, None, "error", None, "the run file is damaged")
    write_outcome(tmp_path, error)
    assert read_outcome(tmp_path) == error


@pytest.mark.parametrize("text, says", [
    (None, "no run outcome"),
    ("{not json", "damaged \\(not JSON\\)"),
    ("[1]", "not a JSON object"),
    ('{"format": 99}', "has format 99"),
    ('{"format": 1, "run_id": 1}', "damaged \\(fields"),
    ('{"format": 1, "run_id": 1, "rounds_done": 2, "stopped": "done", "ledger": null, "error": null}', "stopped must"),
    ('{"format": 1, "run_id": -1, "rounds_done": 2, "stopped": "rounds", "ledger": null, "error": null}', "run_id"),
    ('{"format": 1, "run_id": 1, "rounds_done": 2, "stopped": "rounds", "ledger": null, "error": "x"}',
     "exactly when"),
    ('{"format": 1, "run_id": true, "rounds_done": 2, "stopped": "rounds", "ledger": null, "error": null}', "run_id"),
])
def test_a_missing_damaged_or_foreign_outcome_is_one_line(tmp_path, text, says):
    if text is not None:
        (tmp_path / OUTCOME_FILE).write_text(text)
    with pytest.raises(OutcomeError, match=says) as raised:
        read_outcome(tmp_path)
    assert isinstance(raised.value, FedmfError) and "\n" not in str(raised.value)


def _serve(tmp_path, name, monkeypatch=None):
    from client.app import app as client_app
    from server.app import run_server
    from server.local_grid import LocalGrid, client_node

    values = {"task": "tiny", "task-options": '{"num_users": 6}', "rounds": 3, "min-sep": 1,
              "clients-per-round": 3, "noise-multiplier": 0.7, "client-lr": 0.2, "batch-size": 8,
              "run-dir": str(tmp_path / name), "reply-timeout": 5.0}
    nodes = {100 + i: client_node(client_app, {"partition-id": i}, 100 + i) for i in range(6)}
    run_server(LocalGrid(nodes), values)
    return values


def _result(values):
    from fedmf.tasks import get_task
    from launcher.flower_backend import flower_result
    from server.config import ServerConfig

    tiny = get_task("tiny", num_users=6)
    return flower_result(ServerConfig.from_mapping(values), model=tiny.model(), evaluate=tiny.evaluate, plot=False)


def test_the_server_apps_stop_comes_back_from_its_outcome_file(tmp_path, monkeypatch):
    """A horizon stop and a guard stop of the ServerApp's code path: outcome.json says how each
    ended, and the Flower backend's result takes ``stopped`` from it (no log line read)."""
    values = _serve(tmp_path, "horizon")
    outcome = read_outcome(values["run-dir"])
    assert (outcome.stopped, outcome.rounds_done, outcome.error) == ("horizon", 3, None)
    assert outcome.ledger == str(tmp_path / "horizon" / "ledger.db")
    result = _result(values)
    assert (result.stopped, result.rounds_done, result.run_id) == ("horizon", 3, outcome.run_id)

    from fedmf.plan import RunPlan

    real = RunPlan.guard

    def guard(self, t, observed_epsilon=None):
        if t == 2:
            raise PrivacyBudgetExceeded("round 2 would spend too much (planted)")
        return real(self, t, observed_epsilon)

    monkeypatch.setattr(RunPlan, "guard", guard)
    values = _serve(tmp_path, "guard")
    assert read_outcome(values["run-dir"]).stopped == "guard: round 2 would spend too much (planted)"
    result = _result(values)
    assert (result.stopped, result.rounds_done) == ("guard: round 2 would spend too much (planted)", 2)
    # the result follows the file, whatever the logs said
    write_outcome(values["run-dir"], RunOutcome(result.run_id, 2, "rounds", None))
    assert _result(values).stopped == "rounds"


def test_an_error_stop_is_recorded_with_its_message(tmp_path):
    run_dir = tmp_path / "damaged"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{not json")
    with pytest.raises(FedmfError, match="damaged") as raised:
        _serve(tmp_path, "damaged")
    outcome = read_outcome(run_dir)
    assert outcome.stopped == "error" and outcome.error == str(raised.value) and outcome.run_id is None
    with pytest.raises(FedmfError, match="stopped on an error"):
        _result({"task": "tiny", "task-options": '{"num_users": 6}', "rounds": 3, "min-sep": 1,
                 "clients-per-round": 3, "noise-multiplier": 0.7, "run-dir": str(run_dir)})
