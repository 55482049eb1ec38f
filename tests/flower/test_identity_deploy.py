"""Users proven over real processes on loopback: a SuperLink with TLS and SuperNode authentication
(deploy/make-test-ca.sh), four registered SuperNodes — two real users with enrolled keys, an impostor
declaring a real user's id without a user key, and a silent node (``--isolation process`` with no
ClientApp process: it receives messages and never answers) — and a 3-round run of the tiny task.

In the default run (about 1.5 minutes on 2 shared cores: the one TLS + node-authentication federation
that CI runs). Checked: the impostor is refused (logged once) and never sent a TRAIN message, both real users take
part in every round, the silent node was queried once per backoff period (not once per round) and
the run never waited for a reply timeout.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from fedmf.cli import main as fedmf_main

REPO = Path(__file__).resolve().parents[2]
# identity-timeout: a ClientApp process starts per message (python + torch) and 4 start at once on 2 cores
ROUNDS, IDENTITY_TIMEOUT_S, REPLY_TIMEOUT_S = 2, 20.0, 400.0


def test_an_impostor_is_refused_and_a_silent_node_costs_one_identity_timeout_per_backoff(tmp_path, capsys):
    import sqlite3

    from launcher.flower_cli import _exe, flower_env, flwr_run, free_port
    from launcher.processes import ProcessTracker
    from server.identity import BACKOFF_S
    from tests.flower.test_deploy import _nodes, start_tls_superlink

    pki = tmp_path / "pki"
    r = subprocess.run(["bash", str(REPO / "deploy" / "make-test-ca.sh"), str(pki), "4"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    enrollment = tmp_path / "enrollment.json"
    for user in ("0", "1"):  # each data owner makes a key pair; the operator enrolls the public keys
        assert fedmf_main(["user", "keygen", "--out", str(tmp_path / f"user-{user}.key")]) == 0
        assert fedmf_main(["user", "enroll", "--enrollment", str(enrollment), "--user", user,
                           "--public-key", str(tmp_path / f"user-{user}.key.pub")]) == 0
    capsys.readouterr()

    env = flower_env(tmp_path)
    tracker = ProcessTracker(env, tmp_path / "flwr-logs")
    ca = pki / "ca.crt"
    try:
        port, _ = start_tls_superlink(tracker, pki, tmp_path, env, registered=4)  # every SuperNode below is registered

        def supernode(name: str, i: int, node_config: str, *extra: str):
            return tracker.spawn(name, [
                _exe("flower-supernode"), "--root-certificates", str(ca), "--superlink", f"127.0.0.1:{port}",
                "--auth-supernode-private-key", str(pki / f"supernode-{i}"), "--port", str(free_port()),
                "--node-config", node_config, *extra])

        procs = [supernode("user0", 0, f"user-id='0' user-key='{tmp_path / 'user-0.key'}'"),
                 supernode("user1", 1, f"user-id='1' user-key='{tmp_path / 'user-1.key'}'"),
                 supernode("impostor", 2, "user-id='0'"),  # a real user's id, no user key
                 supernode("silent", 3, "user-id='1'", "--isolation", "process")]
        end = time.monotonic() + 120
        while len([n for n in _nodes(tracker, _exe) if n.get("status") == "online"]) < 4:
            assert all(p.poll() is None for p in procs), {n: tracker.log_text(n)[-1500:] for n in tracker.logs}
            assert time.monotonic() < end, "SuperNodes not online"
            time.sleep(0.5)
        node_id = {name: int(re.search(r"SuperNode ID: (\d+)", tracker.log_text(name)).group(1))
                   for name in ("user0", "user1", "impostor", "silent")}

        run_dir = tmp_path / "run"
        result = flwr_run(tracker, REPO, "deploy", federation_config=None, timeout=500, run_config={
            "run-dir": str(run_dir), "task-options": '{"num_users": 2}', "clients-per-round": 2, "min-sep": 1,
            "rounds": ROUNDS, "user-enrollment": str(enrollment), "identity-timeout": IDENTITY_TIMEOUT_S,
            "reply-timeout": REPLY_TIMEOUT_S})
        logs = {name: tracker.log_text(name) for name in ("user0", "user1", "impostor", "silent")}
    finally:
        tracker.cleanup()
    assert not tracker.live_pids()
    assert result.rc == 0, result.output[-4000:]
    out = result.output
    assert f"{ROUNDS} rounds committed" in out, out[-3000:]

    # the impostor: refused once (one log line naming its node), never sent a TRAIN message
    refused = [ln for ln in out.splitlines() if f"node {node_id['impostor']} not identified" in ln]
    assert len(refused) == 1 and "no valid proof" in refused[0], refused
    assert "Receiving: train" not in logs["impostor"]
    # both real users took part in every round, on their own nodes
    for name in ("user0", "user1"):
        assert logs[name].count("Receiving: train message") == ROUNDS, name
    con = sqlite3.connect(f"file:{run_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT round_index, status, selected, contributed, rejected, opened_at, closed_at "
                           "FROM rounds ORDER BY round_index").fetchall()
    finally:
        con.close()
    assert [r[:5] for r in rows] == [(t, "committed", 2, 2, 0) for t in range(ROUNDS)], rows

    # the silent node: asked once per backoff period at most, never waited for with reply-timeout
    asked = logs["silent"].count("Receiving: query message")
    assert asked >= 1, logs["silent"][-2000:]
    assert asked <= 1 + result.duration_s / BACKOFF_S, (asked, result.duration_s)
    assert result.duration_s < REPLY_TIMEOUT_S, result.duration_s
    silent = [ln for ln in out.splitlines() if f"node {node_id['silent']} not identified" in ln]
    assert len(silent) == 1 and f"no identity reply within {IDENTITY_TIMEOUT_S:g} s" in silent[0], silent
