"""benchmarks/secagg_cost.py's core at a tiny size: it times a real SecAgg+ round (the decoded secure
sum is the sum of the survivors' clipped updates, up to the quantization, and bit-equal to the plain
sum of their quantized words), its simulation path runs the protocol for real too, and every time
it reports is positive."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from fedmf.secagg.messages import CONSISTENCY_CHECK

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "secagg_cost.py"
_SPEC = importlib.util.spec_from_file_location("secagg_cost", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("secagg_cost", bench)
_SPEC.loader.exec_module(bench)

LAYOUT = {"w": (6, 5), "b": (5,)}
DIM = 35
STAGES = [Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, CONSISTENCY_CHECK, Stage.UNMASK]
FIXED = bench.secagg_params(8, 5)


def _clipped_sum(pool: list[np.ndarray], users: list[int]) -> np.ndarray:
    total = np.zeros(DIM)
    for u in users:
        x = pool[u % len(pool)].astype(np.float64)
        total += x * min(1.0, bench.CLIP_NORM / float(np.linalg.norm(x)))
    return total


def test_a_measured_secure_round_is_a_real_round_with_dropouts():
    pool = bench.make_pool(DIM, 4, seed=1)
    users, dropout = 12, 0.25
    r = bench.secure_round(DIM, pool, users, dropout, seed=3, privatize_layout=LAYOUT, params=FIXED)
    assert (r["degree"], r["threshold"]) == (8, 5)
    assert r["dropped"] == 3 and r["survivors"] == 9 and len(r["contributors"]) == 9
    assert r["sum_equal"]
    # each coordinate of each survivor's update is rounded by less than one grid step 1/s
    err = np.max(np.abs(r["sum"] - _clipped_sum(pool, r["contributors"])))
    assert err <= 9 / bench.SCALE + 1e-9, err
    assert r["dropped_pairs"] > 0  # the dropped users' pairwise masks were removed
    assert r["stages"] == [*STAGES, "decode+privatize"]
    assert all(t > 0 for t in r["server_s"].values()), r["server_s"]
    assert all(t > 0 for t in r["client_s"].values()), r["client_s"]
    assert r["quantize_s"] > 0
    # the collect reply carries the masked words: 8 bytes per word at least
    assert r["rep_bytes"][Stage.COLLECT_MASKED_VECTORS] >= 8 * DIM
    assert all(b > 0 for b in r["req_bytes"].values())
    # the consistency reply carries an Ed25519 signature (64 bytes)
    assert r["rep_bytes"][CONSISTENCY_CHECK] >= 64
    assert r["held_bytes"] == 9 * DIM * 8


def test_the_derived_defaults_and_enrolled_keys():
    # a cohort of 32: k = 28, t = 22 (graph_for); enrolled signing keys run the same five stages
    r = bench.short_round(32, 0.1, 8, seed=1, enrolled=True)
    assert (r["degree"], r["threshold"]) == (28, 22) and r["sum_equal"] and r["survivors"] == 29
    assert r["stages"] == [*STAGES, "decode+privatize"]
    # 10 users: the complete graph with t = 10, so any dropout aborts; no dropout never does
    assert bench.abort_probability(10, 0.1, 20) == 1.0
    assert bench.abort_probability(10, 0.0, 20) == 0.0
    # Flower's legacy workflow needs t < shares ≤ users
    assert bench.flower_graph(10) == (10, 9) and bench.flower_graph(100) == (29, 22)


def test_the_central_and_simulated_paths_report_positive_costs():
    pool = bench.make_pool(DIM, 4, seed=2)
    central = bench.central_round(LAYOUT, pool, 7)
    assert central["server_s"] > 0 and central["up_bytes"] >= 4 * DIM
    full = bench.secure_round(DIM, pool, 9, 0.0, seed=5, privatize_layout=LAYOUT, params=FIXED)
    short = bench.short_round(14, 0.2, 16, seed=4, params=FIXED)
    assert short["sum_equal"] and short["survivors"] == 11
    sim = bench.simulated_round(LAYOUT, full, bench.mask_cost(DIM), short, seed=4)
    assert all(t > 0 for t in sim["server_s"].values()), sim["server_s"]
    # the collect stage costs the short round's plus the survivors' full-dimension vectors
    collect = Stage.COLLECT_MASKED_VECTORS
    assert sim["server_s"][collect] > short["server_s"][collect]
    assert sim["client_s"][collect] == full["client_s"][collect]
