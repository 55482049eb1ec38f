"""experiments/run.py's report: best rate per configuration, and the tuned-against-tuned table."""

import importlib.util
from pathlib import Path

import pytest
from scipy import stats

_SPEC = importlib.util.spec_from_file_location("experiments_run",
                                               Path(__file__).resolve().parents[2] / "experiments" / "run.py")
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)


def _record(method, eps, lr, seed, accuracy):
    job = dict(dataset="so-small", method=method, epsilon=eps, server_lr=lr, seed=seed)
    return {"job": job, "history": [{"round": 10, "accuracy": 0.01}, {"round": 20, "accuracy": accuracy}]}


def test_welch_t_equals_scipys_unequal_variance_t():
    a, b = [0.161, 0.155, 0.149, 0.158], [0.137, 0.129, 0.141]
    assert run.welch_t(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).statistic, rel=1e-12)
    assert run.welch_t([0.1], b) is None and run.welch_t([0.1, 0.1], [0.2, 0.2]) is None


def test_versus_table_compares_each_method_at_its_own_best_rate():
    results = [
        _record("dp-fedavg", 2.0, 0.0625, 0, 0.14), _record("dp-fedavg", 2.0, 0.5, 0, 0.05),  # best: 1/16
        _record("dp-fedavg", 2.0, 0.0625, 1, 0.12), _record("dp-fedavg", 2.0, 0.0625, 2, 0.13),
        _record("dp-fedavg", 2.0, 0.5, 1, 0.30),  # a seed at a rate seed 0 did not pick: not counted
        _record("blt", 2.0, 0.25, 0, 0.16), _record("blt", 2.0, 0.5, 0, 0.15),  # best: 1/4
        _record("blt", 2.0, 0.25, 1, 0.15), _record("blt", 2.0, 0.25, 2, 0.17),
        _record("dense", 2.0, 0.5, 0, 0.10),
    ]
    finals = run._finals(results)
    assert sorted(r["job"]["seed"] for r in finals[("so-small", "dp-fedavg", 2.0)]) == [0, 1, 2]
    rows = {line.split(" | ")[2]: line for line in run.versus_table(finals).splitlines()[2:]}
    assert set(rows) == {"blt", "dense"}
    t = stats.ttest_ind([0.16, 0.15, 0.17], [0.14, 0.12, 0.13], equal_var=False).statistic
    assert "(lr 0.25, 3 seeds)" in rows["blt"] and "(lr 0.0625, 3 seeds)" in rows["blt"]
    assert rows["blt"].endswith(f"| +0.0300 | {t:.1f} |")
    assert rows["dense"].endswith("| -0.0300 | — |") and "(lr 0.5, 1 seed)" in rows["dense"]
