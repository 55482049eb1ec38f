"""deploy/: the PostgreSQL roles (server read/write, auditor read-only) and, marked heavy, a federation
with TLS and SuperNode authentication (deploy/make-test-ca.sh) writing its ledger on PostgreSQL.

PostgreSQL: FEDMF_TEST_POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432/test), a superuser; each
test creates a database and two roles of its own and drops them afterwards. Unreachable: skip, or fail
with CI=true (the ``pg_admin`` fixture in conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import ssl
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from fedmf import MinSep
from fedmf.cli import main as fedmf_main
from fedmf.ledger import Ledger
from tests.ledger_helpers import SECRET, mechanism_file

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
ROLES_SQL = DEPLOY / "postgres-roles.sql"
MAKE_CA = DEPLOY / "make-test-ca.sh"
PG_URL = os.environ.get("FEDMF_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
HISTORY_TABLES = ("runs", "rounds", "participations", "update_norms")  # the server may only append
MUTABLE_TABLES = ("round_state", "client_state")
LEDGER_TABLES = HISTORY_TABLES + MUTABLE_TABLES


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _url(database: str, user: str | None = None, password: str | None = None) -> str:
    url = make_url(PG_URL).set(drivername="postgresql+psycopg", database=database)
    if user is not None:
        url = url.set(username=user, password=password)
    return url.render_as_string(hide_password=False)


def _libpq_url(database: str) -> str:
    return make_url(_url(database)).set(drivername="postgresql").render_as_string(hide_password=False)


def _psql() -> str:
    """psql, which runs deploy/postgres-roles.sql (skip without it, fail under CI=true)."""
    psql = shutil.which("psql")
    if psql is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("psql is not installed: deploy/postgres-roles.sql cannot run as documented")
        pytest.skip("psql is not installed")
    return psql


def run_roles_sql(database: str, variables: dict[str, str], passwords: dict[str, str], directory: Path):
    """deploy/postgres-roles.sql as deploy/README.md runs it: psql as the superuser, the passwords in 0600
    files whose paths (never the passwords) are on the command line. Returns the finished process."""
    argv = [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", _libpq_url(database)]
    for k, v in variables.items():
        argv += ["-v", f"{k}={v}"]
    for name, password in passwords.items():
        path = directory / f"{name}.pw"
        path.touch(mode=0o600)
        path.write_text(password + "\n")
        argv += ["-v", f"{name}_file={path}"]
    argv += ["-f", str(ROLES_SQL)]
    assert not any(p in arg for p in passwords.values() for arg in argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def scram_matches(verifier: str, password: str) -> bool:
    """Whether a SCRAM-SHA-256 verifier (pg_authid.rolpassword) was made from ``password`` (RFC 5802 / 7677:
    StoredKey = H(HMAC(PBKDF2(password, salt, i), "Client Key")))."""
    import base64
    import hashlib
    import hmac

    method, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$", 1)
    iterations, salt = iterations_salt.split(":")
    stored = keys.split(":")[0]
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    client = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    return method == "SCRAM-SHA-256" and hashlib.sha256(client).digest() == base64.b64decode(stored)


@pytest.fixture
def roles_db(pg_admin, tmp_path):
    """A fresh database, migrated by fedmf as the admin, with deploy/postgres-roles.sql applied.

    Yields a dict: database, server/auditor role names and passwords, and their URLs. Drops the
    database and both roles afterwards (even when the test failed)."""
    suffix = uuid.uuid4().hex[:10]
    d = {"database": f"fedmf_deploy_{suffix}", "server": f"fedmf_server_{suffix}",
         "auditor": f"fedmf_auditor_{suffix}", "server_password": "srv-" + uuid.uuid4().hex,
         "auditor_password": "aud-" + uuid.uuid4().hex}
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{d["database"]}"'))
    try:
        Ledger.open(_url(d["database"]), secret=SECRET).close()  # fedmf migrates the empty database
        (tmp_path / "pw").mkdir(mode=0o700)
        r = run_roles_sql(d["database"], {"schema": "public", "server_role": d["server"], "auditor_role": d["auditor"]},
                          {"server_password": d["server_password"], "auditor_password": d["auditor_password"]},
                          tmp_path / "pw")
        assert r.returncode == 0, r.stderr
        d["admin_url"] = _url(d["database"])
        d["server_url"] = _url(d["database"], d["server"], d["server_password"])
        d["auditor_url"] = _url(d["database"], d["auditor"], d["auditor_password"])
        yield d
    finally:
        with pg_admin.connect() as conn:
            conn.execute(text("SET lock_timeout = '20s'"))
            conn.execute(text(f'DROP DATABASE IF EXISTS "{d["database"]}" WITH (FORCE)'))
            for role in (d["server"], d["auditor"]):
                conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
            left = conn.execute(text("SELECT count(*) FROM pg_roles WHERE rolname IN (:a, :b)"),
                                {"a": d["server"], "b": d["auditor"]}).scalar()
            assert left == 0


def _write_rounds(url: str, tmp_path: Path, rounds: int = 3) -> None:
    """Everything the server does to a ledger: a run with diagnostics, rounds committed, an aborted attempt,
    a round taken over after a restart, a resume that reads next_round and the checkpoint hash."""
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.create_run(mechanism_file(tmp_path, kind="dp-sgd", rounds=rounds + 1, schema=MinSep(3, 4)),
                                noise_multiplier=10.0, clip_norm=1.0, delta=1e-6, name="deploy", diagnostics=True)
        for t in range(rounds):
            run.open_round(t)
            if t == 1:
                run.record_selection(t, ["dave"])
                run.abort_round(t, "lost quorum")
                run.open_round(t)
            for c in run.record_selection(t, ["alice", "bob", "carol"]):
                run.record_contribution(t, c, 0.5)
            run.commit_round(t, noise_std=20.0, epsilon_worst_user=0.1, epsilon_planned=0.2,
                             checkpoint_sha256=f"{t:064x}")
        run.open_round(rounds)  # left open by a server that stopped
    with Ledger.open(url, secret=SECRET) as ledger:
        run = ledger.run(1)
        assert run.next_round == rounds and run.round(rounds - 1).checkpoint_sha256 == f"{rounds - 1:064x}"
        run.open_round(rounds)  # taken over
        run.abort_round(rounds, "the server stopped during the round")


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None)


# ----------------------------------------------------------------------------------------------
# (a) PostgreSQL roles
# ----------------------------------------------------------------------------------------------


def test_server_role_writes_rounds_and_cannot_change_the_schema(roles_db, tmp_path):
    _write_rounds(roles_db["server_url"], tmp_path)  # Ledger.open sees the head revision: no DDL needed
    engine = create_engine(roles_db["server_url"])
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM rounds WHERE status = 'committed'")).scalar() == 3
            assert conn.execute(text("SELECT count(*) FROM participations")).scalar() == 9
            assert conn.execute(text("SELECT attempts FROM round_state WHERE round_index = 3")).scalar() == 2
        history = [f"UPDATE {table} SET {column} = {column}" for table, column in (
            ("runs", "noise_multiplier"), ("rounds", "noise_std"), ("participations", "status"),
            ("update_norms", "update_norm"))] + [f"{verb} {table}" for table in HISTORY_TABLES
                                                  for verb in ("DELETE FROM", "TRUNCATE")]
        for stmt in ("CREATE TABLE evil (x int)", "DROP TABLE rounds", "ALTER TABLE rounds ADD COLUMN x int",
                     "UPDATE fedmf_ledger_version SET version_num = 'x'", "DELETE FROM fedmf_ledger_version",
                     "DELETE FROM round_state", "DELETE FROM client_state", *history):
            with pytest.raises(Exception) as e, engine.begin() as conn:
                conn.execute(text(stmt))
            assert _sqlstate(e.value) == "42501", (stmt, e.value)  # insufficient_privilege (or not owner)
    finally:
        engine.dispose()


def test_server_role_charges_lifetime_budgets_and_cannot_change_them(roles_db, tmp_path):
    """The admin sets the budgets; the server role reads them, charges users and records skips,
    and may not change a budget or a charge."""
    from fedmf.budgets import RunBudget
    from fedmf.ledger.budgets import load_budget_secret, set_default, set_user

    secret = load_budget_secret(tmp_path / "budget.key", create=True)
    with Ledger.open(roles_db["admin_url"]) as admin:
        set_default(admin, secret, 50.0)
        set_user(admin, secret, "bob", 0.0)
    plan = SimpleNamespace(noise_multiplier=1.0, adaptive_clipping=None, count_noise_std=None, extra_noise_std=None)
    with Ledger.open(roles_db["server_url"], secret=SECRET) as ledger:
        run = ledger.create_run(mechanism_file(tmp_path, kind="dp-sgd", rounds=4, schema=MinSep(1, 4)),
                                noise_multiplier=1.0, clip_norm=1.0, delta=1e-6)
        budget = RunBudget.open(ledger, secret, plan, run.id)
        assert budget.admissible(0, ["alice", "bob"]) == ["alice"] and budget.skipped == 1
        budget.charge(0, ["alice"])
        budget.charge(0, ["alice"])  # a redone round rewrites its skip count
    engine = create_engine(roles_db["server_url"])
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM budget_charges")).scalar() == 1
            assert conn.execute(text("SELECT skipped FROM budget_skips")).scalar() == 1
        for stmt in ("UPDATE budget_settings SET default_epsilon = 1e9", "UPDATE user_budgets SET epsilon = 1e9",
                     "DELETE FROM user_budgets", "INSERT INTO user_budgets VALUES ('\\x00', 1e9)",
                     "UPDATE budget_charges SET mu_squared = 0", "DELETE FROM budget_charges"):
            with pytest.raises(Exception) as e, engine.begin() as conn:
                conn.execute(text(stmt))
            assert _sqlstate(e.value) == "42501", (stmt, e.value)
    finally:
        engine.dispose()


def test_auditor_role_audits_and_cannot_write(roles_db, tmp_path, capsys):
    _write_rounds(roles_db["server_url"], tmp_path)
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", roles_db["auditor_url"], "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"]["name"] == "deploy" and report["verify"]["rounds_verified"] == 3

    engine = create_engine(roles_db["auditor_url"])
    writes = ["INSERT INTO round_state (run_id, round_index, status, attempts) VALUES (1, 99, 'open', 1)",
              "UPDATE round_state SET status = 'aborted'",
              "UPDATE rounds SET noise_std = 0",
              "DELETE FROM participations",
              "UPDATE runs SET name = 'forged'",
              "DELETE FROM fedmf_ledger_version"]
    try:
        with engine.connect() as conn:
            for table in (*LEDGER_TABLES, "fedmf_ledger_version"):
                conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
        for stmt in writes:
            # the role's sessions are read-only by default ...
            with pytest.raises(Exception) as e, engine.begin() as conn:
                conn.execute(text(stmt))
            assert _sqlstate(e.value) == "25006", (stmt, e.value)  # read_only_sql_transaction
            # ... and a session that turns that off still lacks the privilege
            with pytest.raises(Exception) as e, engine.begin() as conn:
                conn.execute(text("SET TRANSACTION READ WRITE"))
                conn.execute(text(stmt))
            assert _sqlstate(e.value) == "42501", (stmt, e.value)
            assert "permission denied" in str(e.value)
        with pytest.raises(Exception) as e, engine.begin() as conn:
            conn.execute(text("SET TRANSACTION READ WRITE"))
            conn.execute(text("CREATE TABLE evil (x int)"))
        assert _sqlstate(e.value) == "42501"
    finally:
        engine.dispose()
    with create_engine(roles_db["admin_url"]).connect() as conn:  # nothing changed
        assert conn.execute(text("SELECT count(*) FROM rounds")).scalar() == 3
        assert conn.execute(text("SELECT count(*) FROM runs WHERE name = 'deploy'")).scalar() == 1


def test_public_cannot_connect_to_the_ledger_database(roles_db, pg_admin):
    other = f"fedmf_other_{uuid.uuid4().hex[:10]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE \"{other}\" LOGIN PASSWORD 'x'"))
    engine = create_engine(_url(roles_db["database"], other, "x"))
    try:
        with pytest.raises(Exception) as e, engine.connect():
            pass
        assert "permission denied" in str(e.value)
    finally:
        engine.dispose()
        with pg_admin.connect() as conn:
            conn.execute(text(f'DROP ROLE "{other}"'))


def _verifier(pg_admin, role: str) -> str | None:
    with pg_admin.connect() as conn:
        return conn.execute(text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": role}).scalar()


def test_roles_get_the_passwords_from_their_files_and_a_rerun_rotates_them(roles_db, pg_admin, tmp_path):
    """The passwords reach PostgreSQL only through the files (checked against the stored SCRAM verifiers);
    running the script again, with roles that exist, sets the new passwords and keeps the grants."""
    for role in ("server", "auditor"):
        verifier = _verifier(pg_admin, roles_db[role])
        assert scram_matches(verifier, roles_db[f"{role}_password"]) and not scram_matches(verifier, "other")
    new = {"server_password": "new-srv-" + uuid.uuid4().hex, "auditor_password": "new-aud-" + uuid.uuid4().hex}
    (tmp_path / "rotate").mkdir(mode=0o700)
    r = run_roles_sql(roles_db["database"], {"schema": "public", "server_role": roles_db["server"],
                                             "auditor_role": roles_db["auditor"]}, new, tmp_path / "rotate")
    assert r.returncode == 0, r.stderr
    assert scram_matches(_verifier(pg_admin, roles_db["server"]), new["server_password"])
    assert scram_matches(_verifier(pg_admin, roles_db["auditor"]), new["auditor_password"])
    _write_rounds(roles_db["server_url"], tmp_path)  # the grants still hold


def test_a_missing_password_file_stops_the_script_before_any_role_exists(pg_admin, tmp_path):
    database = f"fedmf_deploy_{uuid.uuid4().hex[:10]}"
    suffix = uuid.uuid4().hex[:10]
    roles = {"server_role": f"fedmf_server_{suffix}", "auditor_role": f"fedmf_auditor_{suffix}"}
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{database}"'))
    try:
        Ledger.open(_url(database), secret=SECRET).close()
        argv = [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", _libpq_url(database), "-v", "schema=public",
                "-v", f"server_role={roles['server_role']}", "-v", f"auditor_role={roles['auditor_role']}",
                "-v", f"server_password_file={tmp_path / 'missing.pw'}",
                "-v", f"auditor_password_file={tmp_path / 'missing.pw'}", "-f", str(ROLES_SQL)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "a password file is missing or empty" in r.stderr
        with pg_admin.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pg_roles WHERE rolname IN (:a, :b)"),
                                {"a": roles["server_role"], "b": roles["auditor_role"]}).scalar() == 0
    finally:
        with pg_admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


# ----------------------------------------------------------------------------------------------
# make-test-ca.sh
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory):
    out = tmp_path_factory.mktemp("ca") / "pki"
    r = subprocess.run(["bash", str(MAKE_CA), str(out), "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_make_test_ca_files_and_modes(test_ca):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    assert (test_ca.stat().st_mode & 0o777) == 0o700
    secret = ["ca.key", "server.key", "supernode-0", "supernode-1", "supernode-2"]
    for name in secret:
        assert ((test_ca / name).stat().st_mode & 0o777) == 0o600, name
    for name in ("ca.crt", "server.crt", "supernode-0.pub"):
        assert ((test_ca / name).stat().st_mode & 0o077) == 0o044, name
    ca = x509.load_pem_x509_certificate((test_ca / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((test_ca / "server.crt").read_bytes())
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for i in range(3):  # what flower-supernode --auth-supernode-private-key and flwr supernode register load
        key = load_ssh_private_key((test_ca / f"supernode-{i}").read_bytes(), None)
        pub = load_ssh_public_key((test_ca / f"supernode-{i}.pub").read_bytes())
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert key.public_key().public_numbers() == pub.public_numbers()
    # refuses to overwrite an existing CA
    r = subprocess.run(["bash", str(MAKE_CA), str(test_ca), "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refusing" in r.stderr


def test_make_test_ca_tls_handshake(test_ca):
    """The server certificate verifies against the CA for 127.0.0.1 and localhost (a TLS handshake
    through Python's ssl, as the SuperNode's HTTP client does)."""
    import socket
    import threading

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(test_ca / "server.crt", test_ca / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(test_ca / "ca.crt"))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(2)
        port = srv.getsockname()[1]

        def serve():
            for _ in range(2):
                conn, _ = srv.accept()
                with contextlib.suppress(OSError), server_ctx.wrap_socket(conn, server_side=True) as s:
                    s.recv(1)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        for host in ("127.0.0.1", "localhost"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    client_ctx.wrap_socket(raw, server_hostname=host) as s:
                assert s.version()
                s.sendall(b"x")
        t.join(10)


# ----------------------------------------------------------------------------------------------
# (b) a federation with TLS and SuperNode authentication, ledger on PostgreSQL (heavy: ~60 s)
# ----------------------------------------------------------------------------------------------


def _wait_https_health(port: int, cafile: Path, proc: subprocess.Popen, timeout: float, log: str) -> None:
    ctx = ssl.create_default_context(cafile=str(cafile))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}:\n{log[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=1, context=ctx) as r:
                if 200 <= r.status < 300:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"SuperLink on https://127.0.0.1:{port} not healthy after {timeout}s")


def _nodes(tracker, exe) -> list[dict]:
    rc, out, _err, _ = tracker.run([exe("flwr"), "supernode", "ls", "deploy", "--format", "json"], timeout=60)
    with contextlib.suppress(ValueError):
        return list(json.loads(out[out.index("{"):]).get("nodes", []))
    return []


def start_tls_superlink(tracker, pki: Path, tmp_path: Path, env: dict, registered: int) -> tuple[int, list[str]]:
    """A SuperLink with TLS and SuperNode authentication on a free loopback port (the ``deploy``
    connection of ``env``'s FLWR_HOME), with the keys ``pki/supernode-0 … registered-1`` registered;
    returns the port and the registered node ids."""
    from launcher.flower_cli import _exe, free_port

    ca = pki / "ca.crt"
    port = free_port()
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(
        '[superlink]\ndefault = "deploy"\n\n[superlink.local]\naddress = ":local:"\n\n'
        f'[superlink.deploy]\naddress = "127.0.0.1:{port}"\nroot-certificates = "{ca}"\n')
    superlink = tracker.spawn("superlink", [
        _exe("flower-superlink"), "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(pki / "server.crt"),
        "--ssl-keyfile", str(pki / "server.key"), "--enable-supernode-auth",
        "--disable-runtime-dependency-installation", "--database", str(tmp_path / "superlink-state.db"),
        "--host", "127.0.0.1", "--port", str(port)])
    _wait_https_health(port, ca, superlink, 90, tracker.log_text("superlink"))
    node_ids = []
    for i in range(registered):
        rc, out, err, _ = tracker.run([_exe("flwr"), "supernode", "register", str(pki / f"supernode-{i}.pub"),
                                       "deploy", "--format", "json"], timeout=60)
        assert rc == 0, out + err
        node_ids.append(str(json.loads(out[out.index("{"):])["node-id"]))
    return port, node_ids


@pytest.mark.heavy
def test_tls_node_auth_federation_with_postgres_ledger(roles_db, test_ca, tmp_path, capsys):
    """The deploy/README.md walk-through on loopback: SuperLink with TLS + --enable-supernode-auth, two
    SuperNodes whose public keys were registered, an impostor without a key claiming user 1 and an intruder
    with an unregistered key claiming user 0 (both refused, never given a node id, so never selected), a
    2-round run of the tiny task (users proving keys enrolled with `fedmf user`) writing its ledger as the
    server role, `fedmf audit` as the auditor."""
    from launcher.flower_cli import _exe, flower_env, free_port
    from launcher.processes import ProcessTracker

    env = flower_env(tmp_path)
    tracker = ProcessTracker(env, tmp_path / "flwr-logs")
    ca = test_ca / "ca.crt"
    try:
        port, registered = start_tls_superlink(tracker, test_ca, tmp_path, env, registered=2)
        registered = set(registered)

        # each data owner makes a user key pair (fedmf user keygen); the operator enrolls the public keys
        enrollment = tmp_path / "enrollment.json"
        for user in (0, 1):
            assert fedmf_main(["user", "keygen", "--out", str(tmp_path / f"user-{user}.key")]) == 0
            assert fedmf_main(["user", "enroll", "--enrollment", str(enrollment), "--user", str(user),
                               "--public-key", str(tmp_path / f"user-{user}.key.pub")]) == 0

        def supernode(name, user, key=None, retries=()):
            argv = [_exe("flower-supernode"), "--root-certificates", str(ca), "--superlink", f"127.0.0.1:{port}",
                    "--port", str(free_port()), "--node-config",
                    f"user-id='{user}' user-key='{tmp_path / f'user-{user}.key'}'", *retries]
            if key is not None:
                argv += ["--auth-supernode-private-key", str(test_ca / key)]
            return tracker.spawn(name, argv)

        nodes = [supernode("supernode0", 0, "supernode-0"), supernode("supernode1", 1, "supernode-1")]
        impostor = supernode("impostor", 1, None, ("--max-retries", "1"))
        intruder = supernode("intruder", 0, "supernode-2", ("--max-retries", "1"))
        for proc, name in ((impostor, "impostor"), (intruder, "intruder")):
            proc.wait(timeout=120)
            assert proc.returncode == 1, (name, proc.returncode)  # deploy/README.md, step 5: Flower exits 1
            assert "Exit Code: 305" in tracker.log_text(name), tracker.log_text(name)[-2000:]
        assert "SuperNode authentication is enabled. All SuperNodes must be registered" in tracker.log_text("impostor")
        assert "Failed to activate SuperNode" in tracker.log_text("intruder")
        end = time.monotonic() + 90
        while len([n for n in _nodes(tracker, _exe) if n.get("status") == "online"]) < 2:
            assert all(p.poll() is None for p in nodes), [tracker.log_text(f"supernode{i}")[-2000:] for i in (0, 1)]
            assert time.monotonic() < end, "registered SuperNodes not online"
            time.sleep(0.5)

        ledger_url = make_url(roles_db["server_url"]).set(drivername="postgresql").render_as_string(
            hide_password=False)
        import tomli_w  # a dependency of flwr

        run_toml = tmp_path / "run.toml"
        run_toml.write_text(tomli_w.dumps({
            "run-dir": str(tmp_path / "run"), "task-options": '{"num_users": 2}', "clients-per-round": 1,
            "min-sep": 1, "rounds": 2, "ledger-url": ledger_url, "user-enrollment": str(enrollment),
            "identity-timeout": 60.0}))
        # deploy/fedmf-run.sh (what systemd/fedmf-run.service runs): flwr run + the run's real status
        rc, out, err, timed_out = tracker.run(["bash", str(DEPLOY / "fedmf-run.sh"), str(REPO), "deploy",
                                               str(run_toml)], timeout=400)
        assert rc == 0 and not timed_out, (out + err)[-4000:]
        assert "2 rounds committed" in out and "finished:completed" in err, (out + err)[-4000:]
        # only the two registered keys ever had a node id: the impostor/intruder could not be selected
        all_nodes = _nodes(tracker, _exe)
        assert {str(n["node-id"]) for n in all_nodes} == registered, all_nodes
        for name in ("impostor", "intruder"):
            assert "SuperNode ID:" not in tracker.log_text(name)
        ids = {m for i in (0, 1) for m in re.findall(r"SuperNode ID: (\d+)", tracker.log_text(f"supernode{i}"))}
        assert ids == registered
        # secrets beside the run's checkpoints are private
        for p in (tmp_path / "run").rglob("*"):
            if "secret" in p.name and p.is_file():
                assert (p.stat().st_mode & 0o077) == 0, p
    finally:
        tracker.cleanup()
    assert not tracker.live_pids()

    # the ledger, read as the auditor: 2 committed rounds, no rejected reply, a clean audit
    engine = create_engine(roles_db["auditor_url"])
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT round_index, status, selected, contributed, rejected FROM rounds "
                                     "ORDER BY round_index")).all()
            assert [r.status for r in rows] == ["committed", "committed"], rows
            assert all(r.rejected == 0 and r.contributed == r.selected == 1 for r in rows), rows
            assert conn.execute(text("SELECT count(*) FROM participations WHERE status <> 'contributed'")).scalar() == 0
    finally:
        engine.dispose()
    capsys.readouterr()
    assert fedmf_main(["audit", "--ledger", roles_db["auditor_url"]]) == 0


# ----------------------------------------------------------------------------------------------
# deploy files: scripts, flags, compose
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, rc", [("finished:completed", 0), ("finished:failed", 1)])
def test_fedmf_run_sh_exits_with_the_runs_real_status(tmp_path, status, rc):
    """`flwr run` exits 0 even when the ServerApp failed; fedmf-run.sh asks `flwr ls` (a fake flwr here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "flwr"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1" = run ]; then echo "Successfully started run 4242"; exit 0; fi\n'
                    f'if [ "$1" = ls ]; then echo \'{{"success": true, "runs": [{{"run-id": 4242, "status": "{status}"}}]}}\'; fi\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(DEPLOY / "fedmf-run.sh"), ".", "deploy", "run.toml", "5"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == rc, r.stdout + r.stderr
    assert f"Flower run 4242: {status}" in r.stderr


def test_deploy_files_use_only_flags_flower_141_has():
    """Every --flag given to flower-superlink / flower-supernode in the units, compose.yaml and the
    README exists in this Flower's --help, and none of them is a deprecated one."""
    import yaml

    helps = {}
    for exe in ("flower-superlink", "flower-supernode"):
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})
        helps[exe] = r.stdout + r.stderr
    texts = [p.read_text() for p in (*sorted((DEPLOY / "systemd").glob("*.service")), DEPLOY / "compose.yaml",
                                     DEPLOY / "README.md")]
    seen = 0
    for t in texts:
        t = t.replace("\\\n", " ")
        for exe in helps:
            for m in re.finditer(rf"{exe}\b([^\n\]]*)", t):
                for flag in re.findall(r"(--[a-z][a-z0-9-]+)", m.group(1)):
                    seen += 1
                    assert re.search(rf"\[{re.escape(flag)}\b", helps[exe]), (exe, flag)
                    assert flag not in ("--insecure", "--auth-list-public-keys", "--auth-supernode-public-key",
                                        "--fleet-api-address", "--fleet-api-type"), flag
    assert seen > 20
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"postgres", "superlink", "supernode-0", "supernode-1", "run", "audit"} <= set(compose["services"])
    for script in ("make-test-ca.sh", "fedmf-run.sh"):
        assert os.access(DEPLOY / script, os.X_OK)
        assert subprocess.run(["bash", "-n", str(DEPLOY / script)], timeout=30).returncode == 0
