"""Progress of long work (fedmf/run/progress.py): the bar's rate and time left, a live bar on a terminal
and plain lines on a pipe, the optimizers' reports, and ``fedmf simulate``'s progress."""

from __future__ import annotations

import io
import math

import pytest

from fedmf.cli import main
from fedmf.run.progress import ProgressBar, Step, eta_seconds, format_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_from_the_step_limit_and_from_the_convergence_trend():
    assert eta_seconds(4, 10, 2.0) == (3.0, "limit")  # 6 steps left at 2 steps/s
    assert math.isnan(eta_seconds(4, 10, math.nan)[0])
    # a measure that falls tenfold per step from 1e-1 reaches 1e-6 three steps after 1e-3
    trend = [(1, 1e-1), (2, 1e-2), (3, 1e-3)]
    seconds, how = eta_seconds(3, 1000, 2.0, trend, 1e-6)
    assert how == "trend" and seconds == pytest.approx(1.5)
    # a measure that does not fall says nothing: the step limit bounds the time
    assert eta_seconds(3, 1000, 2.0, [(1, 1e-3), (2, 1e-3), (3, 1e-3)], 1e-6) == (498.5, "limit")
    assert [format_seconds(s) for s in (0, 59.4, 61, 3599, 3600 * 5 + 60 * 7, 86400 * 3 + 3600 * 4)] == \
        ["0s", "59s", "1m01s", "59m59s", "5h07m", "3d04h"]


def test_plain_lines_on_a_pipe_at_most_every_few_seconds_and_the_last_always():
    clock, out = Clock(), io.StringIO()
    bar = ProgressBar("opt", stream=out, clock=clock, every_s=10.0)
    assert not bar.live  # a StringIO is no terminal
    bar.begin(0)
    for step in range(1, 31):  # one step per second
        clock.now += 1.0
        bar(Step(step, 100, objective=1.0 / step))
    clock.now += 1.0
    bar(Step(31, 100, objective=0.5, final=True, converged=True))
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    # steps 1, 11, 21 (10 s apart) and the final one
    assert [line.split()[2] for line in lines] == ["1/100", "11/100", "21/100", "31/100"]
    assert "1 steps/s" in lines[1] and "ETA 1m29s" in lines[1]  # 89 steps left at 1 step/s
    assert "took 31s" in lines[-1] and lines[-1].endswith("converged")


def test_a_live_bar_rewrites_its_line_and_ends_it():
    clock, out = Clock(), io.StringIO()
    bar = ProgressBar("sim", unit="rounds", stream=out, live=True, clock=clock)
    bar.begin(2)  # a resumed run: 2 rounds were done before
    for done in (3, 4):
        clock.now += 2.0
        bar(Step(done, 10, note=f"round {done - 1}", start=2))
    bar.message("a warning")
    bar.close()
    text = out.getvalue()
    assert text.startswith("\r\x1b[Ksim  [######..............] 3/10 rounds  2 s/round  ETA 14s  round 2")
    assert "\r\x1b[Ksim  [########............] 4/10 rounds  2 s/round  ETA 12s  round 3" in text
    assert text.endswith("\r\x1b[Ka warning\n")  # the warning on its own line, not over the bar


def test_lbfgs_reports_each_step_with_its_measure_and_the_end():
    from fedmf.mechanisms.banded_toeplitz import optimize_banded_toeplitz
    from fedmf.participation import MinSep

    steps: list[Step] = []
    _, result = optimize_banded_toeplitz(64, 8, MinSep(16, 4), progress=steps.append, max_steps=500)
    final = steps[-1]
    assert final.final and final.converged is result.converged is True
    assert final.done == result.steps and final.objective == pytest.approx(result.objective)
    running = steps[:-1]
    assert running and all(s.total == 500 and s.tolerance == 1e-12 and not s.final for s in running)
    # within one start the steps count up; the measure is L-BFGS-B's relative decrease (>= 0)
    assert {s.note for s in running} <= {"start 1/2", "start 2/2"}
    for note in {s.note for s in running}:
        done = [s.done for s in running if s.note == note]
        assert done == list(range(1, len(done) + 1))
    assert all(s.measure is None or s.measure >= 0 for s in running)
    assert [s.measure for s in running if s.measure is not None][-1] < 1e-6


def test_mechanism_cli_progress_on_a_pipe_has_no_carriage_return(capsys):
    assert main(["mechanism", "blt", "--rounds", "32", "--min-sep", "8", "--buffers", "2"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("fedmf mechanism blt  ") and "steps" in last and "converged" in last


def test_simulate_shows_rounds_per_second_and_time_left(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--preset", "tiny", "--rounds", "4", "--out", str(out), "--no-plot"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("fedmf simulate  [")]
    assert lines[0].endswith("0/4 rounds  starting")
    # one plain line per round, each naming its round 0-based and counting the rounds done
    for t, line in enumerate(lines[1:]):
        assert f" {t + 1}/4 rounds  " in line and f"  round {t}: eps " in line, line
    assert all("ETA " in line for line in lines[1:-1]) and "took " in lines[-1]
    assert any("rounds/s" in line or "s/round" in line for line in lines[1:])
