"""Secure aggregation over real processes on loopback: a SuperLink with TLS and SuperNode
authentication (deploy/make-test-ca.sh), three registered SuperNodes, each a real user proving an
enrolled key, and two runs of 2 rounds of the tiny task on that one federation — the central mode,
then ``secure-aggregation = "secaggplus"`` (derived k = 2, t = 3: the complete graph of 3 clients) — with the
test-only repeatable noise (``REPEATABLE_NOISE_ENV``) and the same secrets, so that the two runs draw
the same noise.

Checked: both runs commit both rounds; the secure run's ledger records the three enrolled users as
its contributors in every round, none dropped or rejected; each SuperNode answered the five SecAgg+
stages of every secure round (the consistency check included, every key signed by an enrolled user's key); the server never held an update (its ledger diagnostics record a norm
for every central contribution and none for a secure one); the released model is finite, moved away
from the initial one, and differs from the central run's by more than nothing (quantization) and at
most the tolerance of tests/flower/test_secure_aggregation.py's several-round comparison; every
process started is gone afterwards, by PID.

Marked heavy: each stage starts a ``flwr-clientapp`` process (Python + torch) per SuperNode, 36 in the
secure run alone. Measured 2026-11-28 on 2 cores shared with other sessions: 272 s in all at a load
of about 5 with four stages (the central run 71 s, the secure run 181 s; the released models differed
by 1.6e-5 at most), 136 s at a load of about 2 with five stages and the enrollment on every node.
"""

from __future__ import annotations

import math
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from fedmf.cli import main as fedmf_main
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from server.secagg_round import STAGES as SECAGG_STAGES
from tests import _federated_task as task

REPO = Path(__file__).resolve().parents[2]
USERS = ("0", "1", "2")
ROUNDS, STAGES = 2, len(SECAGG_STAGES)  # SecAgg+: setup, share keys, collect, consistency check, unmask
# 3 clients: k and t derived from the cohort (the defaults): the complete graph, k = 2, t = 3
SECURE = {"secure-aggregation": "secaggplus", "secagg-stage-timeout": 180.0}
# the several-round tolerance of tests/flower/test_secure_aggregation.py (quantization, 2 rounds)
TOLERANCE = 1e-3


def node_config(tmp_path: Path, user: str) -> str:
    """The ``--node-config`` of user ``user``'s SuperNode: its id, the private key proving it and the
    operator's enrollment (public), with which it checks that its SecAgg+ neighbours' keys are signed by
    enrolled users (enrolled mode: client/secagg_app.py). Two settings only this test needs: a
    neighbourhood of 2 (3 users; an enrolled node asks for 3 by default) and
    ``require-secure-aggregation=false`` (an enrolled node refuses a plain TRAIN by default; this
    federation also runs the central mode, to compare)."""
    return (f"user-id='{user}' user-key='{tmp_path / f'user-{user}.key'}' "
            f"enrollment-file='{tmp_path / 'enrollment.json'}' secagg-min-neighbours=2 "
            "require-secure-aggregation=false")


def _ledger(run_dir: Path) -> tuple[list[tuple], dict[int, dict[bytes, str]], list[tuple], str]:
    """The run's committed rounds, its participations (round → client key → status), its update
    norms (round, key, norm) and the run's uid, read only."""
    con = sqlite3.connect(f"file:{run_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        rounds = con.execute("SELECT round_index, status, attempts, selected, contributed, dropped, rejected "
                             "FROM rounds ORDER BY round_index").fetchall()
        parts: dict[int, dict[bytes, str]] = {}
        for t, key, status in con.execute("SELECT round_index, client_key, status FROM participations"):
            parts.setdefault(t, {})[bytes(key)] = status
        norms = con.execute("SELECT round_index, client_key, update_norm FROM update_norms").fetchall()
        [(uid,)] = con.execute("SELECT uid FROM runs").fetchall()
    finally:
        con.close()
    return rounds, parts, norms, uid


def _models(run_dir: Path) -> tuple[dict, dict]:
    """The run's initial model (its checkpoint, verified against run.json) and its released final model."""
    import json

    import torch

    from fedmf.run.checkpoint import CheckpointStore

    initial_sha = json.loads((run_dir / "run.json").read_text())["initial_sha256"]
    initial = CheckpointStore(run_dir, clean=False).load(-1, initial_sha)["model"]
    return initial, torch.load(run_dir / "final-model.pt", weights_only=True)


@pytest.mark.heavy
def test_secure_aggregation_over_tls_with_enrolled_users(tmp_path, capsys):
    from fedmf.ledger.keys import ServerSecret
    from launcher.flower_cli import _exe, flower_env, flwr_run, free_port
    from launcher.processes import ProcessTracker, pid_alive
    from tests.flower.test_deploy import _nodes, start_tls_superlink

    started = time.monotonic()
    pki = tmp_path / "pki"
    r = subprocess.run(["bash", str(REPO / "deploy" / "make-test-ca.sh"), str(pki), str(len(USERS))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    enrollment = tmp_path / "enrollment.json"
    for user in USERS:  # each data owner makes a key pair; the operator enrolls the public keys
        assert fedmf_main(["user", "keygen", "--out", str(tmp_path / f"user-{user}.key")]) == 0
        assert fedmf_main(["user", "enroll", "--enrollment", str(enrollment), "--user", user,
                           "--public-key", str(tmp_path / f"user-{user}.key.pub")]) == 0
    capsys.readouterr()

    env = flower_env(tmp_path)
    env[REPEATABLE_NOISE_ENV] = "1"  # tests only, in the ServerApp's environment: both runs draw the same noise
    tracker = ProcessTracker(env, tmp_path / "flwr-logs")
    ca = pki / "ca.crt"
    runs = {"central": tmp_path / "central", "secure": tmp_path / "secure"}
    for run_dir in runs.values():  # the same seed, schedule and ledger keys in both runs
        task.write_secrets(run_dir, b"secure-deploy")
    results = {}
    try:
        port, _ = start_tls_superlink(tracker, pki, tmp_path, env, registered=len(USERS))
        procs = [tracker.spawn(f"user{user}", [
            _exe("flower-supernode"), "--root-certificates", str(ca), "--superlink", f"127.0.0.1:{port}",
            "--auth-supernode-private-key", str(pki / f"supernode-{i}"), "--port", str(free_port()),
            "--node-config", node_config(tmp_path, user)]) for i, user in enumerate(USERS)]
        end = time.monotonic() + 120
        while len([n for n in _nodes(tracker, _exe) if n.get("status") == "online"]) < len(USERS):
            assert all(p.poll() is None for p in procs), {n: tracker.log_text(n)[-1500:] for n in tracker.logs}
            assert time.monotonic() < end, "SuperNodes not online"
            time.sleep(0.5)
        for mode, run_dir in runs.items():
            results[mode] = flwr_run(tracker, REPO, "deploy", federation_config=None, timeout=900, run_config={
                "run-dir": str(run_dir), "witness": str(tmp_path / "witness"),
                "task-options": f'{{"num_users": {len(USERS)}}}', "clients-per-round": len(USERS),
                "min-sep": 1, "rounds": ROUNDS, "user-enrollment": str(enrollment), "identity-timeout": 60.0,
                "reply-timeout": 400.0, "ledger-diagnostics": True, **(SECURE if mode == "secure" else {})})
            assert results[mode].rc == 0, (mode, results[mode].output[-4000:])
        logs = {user: tracker.log_text(f"user{user}") for user in USERS}
    finally:
        tracker.cleanup()
    # every process started (SuperLink, SuperNodes, SuperExecs, ServerApps, ClientApps) is gone, by PID
    assert len(tracker.seen) > 2 * len(USERS) and not [p for p in tracker.seen if pid_alive(p)]
    central, secure = results["central"].output, results["secure"].output
    for out in (central, secure):
        assert f"{ROUNDS} rounds committed" in out, out[-3000:]
    assert "secure aggregation (SecAgg+)" in secure and "secure aggregation" not in central
    # each user's SuperNode: one TRAIN message a central round, one per SecAgg+ stage a secure round
    for user in USERS:
        assert logs[user].count("Receiving: train message") == ROUNDS * (1 + STAGES), user

    secret = ServerSecret((runs["secure"] / "secrets" / "ledger_secret").read_bytes()[:32])
    for mode, run_dir in runs.items():
        rounds, parts, norms, uid = _ledger(run_dir)
        assert [r[:3] for r in rounds] == [(t, "committed", 1) for t in range(ROUNDS)], (mode, rounds)
        assert [r[3:] for r in rounds] == [(len(USERS), len(USERS), 0, 0)] * ROUNDS, (mode, rounds)
        enrolled = {secret.client_key(uid, user): "contributed" for user in USERS}
        assert parts == {t: enrolled for t in range(ROUNDS)}, mode  # the three enrolled users, every round
        # diagnostics: the central server measured every update it received; the secure server held none
        assert sorted((t, bytes(k)) for t, k, _ in norms) == sorted((t, k) for t in range(ROUNDS) for k in enrolled)
        if mode == "central":
            assert all(norm is not None and 0 < norm < math.inf for _, _, norm in norms), norms
        else:
            assert all(norm is None for _, _, norm in norms), norms

    (initial, got), (initial_c, want) = _models(runs["secure"]), _models(runs["central"])
    assert all(bool((initial[k] == initial_c[k]).all()) for k in initial)  # the same start
    assert all(bool(v.isfinite().all()) for v in got.values())
    moved = max(float((got[k] - initial[k]).abs().max()) for k in initial)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    # the same users, noise and local training: the releases differ by the quantization only
    assert 0 < diff <= TOLERANCE and moved > diff, (diff, moved)
    print(f"secure aggregation deploy test: {time.monotonic() - started:.0f} s; secure run "
          f"{results['secure'].duration_s:.0f} s, central run {results['central'].duration_s:.0f} s; "
          f"model moved {moved:.3g}, secure vs central {diff:.3g}")
