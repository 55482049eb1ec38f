"""No secret leaves its file (issue 13 item 8).

A short private run in process (``fedmf.run.federated.train``, with an injected mid-round fault and
a resume) and two through the strategy (the ServerApp's ``run_server`` with the real ClientApp,
and ``DPMFStrategy.start`` for its ``Result``) all run with every log line captured (our own
handlers on the root, ``fedmf.server`` and ``flwr`` loggers, and the process's stdout/stderr file
descriptors). Then everything they wrote or released is read — every file under the run
directories except the three secret files (raw bytes; checkpoints also through ``torch.load`` and
a walk of the structure; run.json parsed; the SQLite ledger also as ``iterdump`` SQL), the logs,
``fedmf audit``'s output, the strategy's metrics, history and ``Result``, every message the
server sent to the clients, the reprs of the run's objects, and the messages and tracebacks of
every error we can provoke (bad configuration, plan mismatch, wrong secrets, tampered and
damaged files, loose permissions) — and no secret (noise seed, schedule key, ledger HMAC
secret, read from ``secrets/``), nor a per-chunk noise seed derived from the noise seed, may
appear in raw, hex (lower, upper), base64 (standard, urlsafe; with and without padding),
Python-repr or decimal form.

Also: a secret file readable by group or others is refused at start with one line, before
anything is written; a run directory is 0700 and a 0755 one is refused.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import sqlite3
import stat
import traceback
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedmf.config import RunConfig
from fedmf.errors import CheckpointError, ConfigError, FedmfError, PlanMismatch
from fedmf.ledger.keys import ServerSecret
from fedmf.round.draws import Draws
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from fedmf.run.outcome import OUTCOME_FILE, read_outcome
from fedmf.run.private_run import PrivateRun
from server.config import ServerConfig
from server.local_grid import LocalGrid, client_node
from server.strategy import DPMFStrategy
from tests import _federated_task as task

SECRET_FILES = ("noise_seed", "schedule_key", "ledger_secret")
ROUNDS = 6
CONFIG = ServerConfig.from_mapping({"noise-multiplier": 0.8, "reply-timeout": 5.0,
                                 "task-options": "{}"})  # the task options the strategy sends its clients
APP_USERS = 12


# ---- what a secret looks like --------------------------------------------------------------------
def forms(secret: bytes) -> dict[str, bytes]:
    """The ways a secret could be written down."""
    b64, url = base64.b64encode(secret), base64.urlsafe_b64encode(secret)
    out = {"raw": secret, "hex": secret.hex().encode(), "HEX": secret.hex().upper().encode(),
           "base64": b64, "base64 unpadded": b64.rstrip(b"="), "urlsafe base64": url,
           "urlsafe base64 unpadded": url.rstrip(b"="), "python repr": repr(secret)[2:-1].encode(),
           "decimal (big-endian)": str(int.from_bytes(secret, "big")).encode(),
           "decimal (little-endian)": str(int.from_bytes(secret, "little")).encode()}
    for label, part in (("first half", secret[: len(secret) // 2]), ("second half", secret[len(secret) // 2:])):
        out[f"{label} raw"] = part
        out[f"{label} hex"] = part.hex().encode()
        out[f"{label} HEX"] = part.hex().upper().encode()
    head = secret[:15]  # base64 of a prefix whose length is a multiple of 3 starts every base64 of the whole
    out["base64 of the first 15 bytes"] = base64.b64encode(head)
    out["urlsafe base64 of the first 15 bytes"] = base64.urlsafe_b64encode(head)
    assert all(len(v) >= 16 for v in out.values())
    return out


def derived_noise_seeds(noise_seed: bytes, salts: list[bytes]) -> dict[str, bytes]:
    """The per-(row, chunk) seeds of the noise generator (anyone holding one can subtract that
    chunk's noise): they must not leave the process either. Rows 0..len(salts), chunk 0 (the
    models here fit in one chunk), each keyed by the run's salt of that row and without salt."""
    rows = len(salts) + 1
    out = {}
    for row, salt in [(r, b"") for r in range(rows)] + list(enumerate(salts)):
        seed = Draws._seed(SimpleNamespace(key=noise_seed, salts=[salt] * rows), row, 0)
        row = f"{row}{', salted' if salt else ''}"
        out[f"noise chunk seed (row {row}) decimal"] = str(seed).encode()
        out[f"noise chunk seed (row {row}) decimal, 63 bits"] = str(seed & ((1 << 63) - 1)).encode()
        out[f"noise chunk seed (row {row}) bytes"] = seed.to_bytes(16, "little")
        out[f"noise chunk seed (row {row}) hex"] = seed.to_bytes(16, "little").hex().encode()
    return out


def read_secrets(run_dir: Path) -> dict[str, bytes]:
    # [:32]: a used noise seed's file also holds its (not secret) binding to the run
    return {f"{run_dir.name}/{name}": (run_dir / "secrets" / name).read_bytes()[:32] for name in SECRET_FILES}


class Haystack:
    """Everything written or released, as (where, bytes)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []

    def add(self, where: str, blob: bytes | str) -> None:
        self.items.append((where, blob.encode("utf-8", "backslashreplace") if isinstance(blob, str) else bytes(blob)))

    def add_object(self, where: str, obj: Any, depth: int = 0, seen: set[int] | None = None) -> None:
        """``obj`` and, walking it, everything inside (tensor bytes, ints in decimal and binary)."""
        seen = set() if seen is None else seen
        if depth > 40 or id(obj) in seen:
            return
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            self.add(where, t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            if t.numel() <= 4096:
                self.add(where, repr(t.tolist()))
            return
        if isinstance(obj, np.ndarray):
            self.add(where, obj.tobytes() if obj.dtype != object else repr(obj))
            return
        if isinstance(obj, (bytes, bytearray, memoryview)):
            self.add(where, bytes(obj))
            return
        if isinstance(obj, str):
            self.add(where, obj)
            return
        if isinstance(obj, bool) or obj is None:
            return
        if isinstance(obj, int):
            self.add(where, str(obj))
            if 0 < obj.bit_length() <= 1024:
                n, v = (obj.bit_length() + 7) // 8, abs(obj)
                self.add(where, v.to_bytes(n, "little") + b"|" + v.to_bytes(n, "big"))
            return
        if isinstance(obj, float):
            self.add(where, repr(obj))
            return
        seen.add(id(obj))
        self.add(where, repr(obj))
        if isinstance(obj, dict) or hasattr(obj, "items") and callable(obj.items):
            try:
                pairs = list(obj.items())
            except Exception:  # noqa: BLE001 - a mapping-like that cannot list itself: its repr was taken
                return
            for key, value in pairs:
                self.add_object(where, key, depth + 1, seen)
                self.add_object(f"{where}[{key!r}]", value, depth + 1, seen)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                self.add_object(where, item, depth + 1, seen)
        elif is_dataclass(obj):
            for f in fields(obj):
                self.add_object(f"{where}.{f.name}", getattr(obj, f.name), depth + 1, seen)

    def add_file(self, path: Path, label: str) -> None:
        data = path.read_bytes()
        self.add(label, data)
        if path.suffix == ".pt":
            self.add_object(f"{label} (torch.load)", torch.load(io.BytesIO(data), map_location="cpu",
                                                                 weights_only=True))
        elif path.suffix == ".json":
            self.add_object(f"{label} (json)", json.loads(data))
        elif data.startswith(b"SQLite format 3\x00"):
            connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                self.add(f"{label} (iterdump)", "\n".join(connection.iterdump()))
            finally:
                connection.close()

    def add_run_directory(self, run_dir: Path) -> list[str]:
        """Every file under ``run_dir`` but the secret files themselves; returns their names."""
        names = []
        for path in sorted(run_dir.rglob("*")):
            relative = path.relative_to(run_dir)
            if path.is_dir() or (relative.parts[0] == "secrets" and relative.name in SECRET_FILES):
                continue
            names.append(str(relative))
            self.add_file(path, f"{run_dir.name}/{relative}")
        return names

    def add_exception(self, where: str, error: BaseException) -> None:
        """The message, repr and formatted traceback, and the same for every cause and context
        (a ``from None`` hides the context from the traceback, not from the object)."""
        chain = 0
        while error is not None and chain < 10:
            self.add(f"{where} (str)", str(error))
            self.add(f"{where} (repr)", repr(error))
            self.add(f"{where} (traceback)", "".join(traceback.format_exception(error)))
            self.add_object(f"{where} (args)", error.args)
            error = error.__cause__ or error.__context__
            chain += 1

    def leaks(self, secrets: dict[str, bytes]) -> list[str]:
        found = []
        for name, secret in secrets.items():
            for form, needle in (forms(secret) if len(secret) >= 32 else {"raw": secret}).items():
                for where, blob in self.items:
                    if needle in blob:
                        found.append(f"{name} as {form} in {where}")
        return found


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        lines = []
        for r in self.records:
            lines.append(f"{r.name} {r.levelname} {r.getMessage()} args={r.args!r}")
            if r.exc_info:
                lines.append("".join(traceback.format_exception(*r.exc_info)))
        return "\n".join(lines)


@contextlib.contextmanager
def all_logs() -> Iterator[Capture]:
    """Every log record at DEBUG of the root, fedmf, fedmf.server and flwr loggers (each gets the
    handler: some turn propagation off)."""
    handler = Capture()
    loggers = [logging.getLogger(n) for n in ("", "fedmf", "fedmf.server", "flwr")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _dedupe(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return list({id(r): r for r in records}.values())


def honest_node(user: str):
    def node(message: Message):
        if message.metadata.message_type == MessageType.QUERY:
            return Message(RecordDict({"identity": ConfigRecord({"user-id": user})}), reply_to=message)
        config = message.content.config_records["config"]
        params = message.content.array_records["arrays"].to_torch_state_dict()
        update = task.local_update(params, user, config["round"])
        if update is None:
            return None
        return Message(RecordDict({"arrays": ArrayRecord(update),
                                   "config": ConfigRecord({"round": config["round"], "user-id": user,
                                                           "run-nonce": config["run-nonce"]}),
                                   "metrics": MetricRecord({"num-examples": 8, "train-loss": 0.25})}),
                       reply_to=message)

    return node


def app_config(run_dir: Path, **over: Any) -> dict[str, Any]:
    values = {"task": "tiny", "task-options": f'{{"num_users": {APP_USERS}}}', "mechanism": "bsr", "rounds": 4,
              "min-sep": 2, "clients-per-round": 4, "noise-multiplier": 0.7, "client-lr": 0.2, "batch-size": 8,
              "run-dir": str(run_dir), "reply-timeout": 5.0}
    values.update(over)
    return values


def app_nodes():
    from client.app import app as client_app

    return {9000 + i: client_node(client_app, {"partition-id": i, "num-partitions": APP_USERS}, 9000 + i)
            for i in range(APP_USERS)}


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)  # copies the modes too (0700 / 0600)
    return target


def replace_secret(run_dir: Path, name: str, value: bytes) -> None:
    path = run_dir / "secrets" / name
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, value)
    os.close(fd)


def provoke(hay: Haystack, label: str, fn, *expected: type[BaseException]) -> BaseException:
    with pytest.raises(expected or (Exception,)) as caught:
        fn()
    hay.add_exception(label, caught.value)
    return caught.value


# ---- the test ------------------------------------------------------------------------------------
def test_no_secret_appears_in_anything_a_run_writes_logs_releases_or_raises(tmp_path, capfd):
    loop_dir, app_dir, strat_dir = tmp_path / "loop", tmp_path / "app", tmp_path / "strategy"
    hay = Haystack()
    with all_logs() as logs:
        # 1. in process, with a fault injected after round 2's noise (the round is aborted) and a resume
        fired = []

        def fault(event: str, t: int) -> None:
            if (event, t) == ("noised", 2) and not fired:
                fired.append(t)
                raise RuntimeError("injected fault after the noise of round 2")

        def evaluate(m: torch.nn.Module) -> dict[str, float]:
            return {"norm": float(m.linear.weight.detach().norm())}

        model = task.Tiny()
        provoke(hay, "injected fault", lambda: train(model, task.users(), task.plan(rounds=ROUNDS), task.local_update,
                                                     checkpoint_dir=loop_dir, progress=True, on_event=fault,
                                                     evaluate=evaluate), RuntimeError)
        result = train(model, task.users(), task.plan(rounds=ROUNDS), task.local_update, checkpoint_dir=loop_dir,
                       progress=True, evaluate=evaluate)
        assert result.rounds_done == ROUNDS
        hay.add_object("TrainResult", result)
        hay.add("TrainResult audit command", result.audit_command())
        hay.add_object("in-process model", model.state_dict())

        # 2. the ServerApp's code path with the real ClientApp (writes final-model.pt)
        from server.app import run_server

        app_grid = LocalGrid(app_nodes())
        app_strategy = run_server(app_grid, app_config(app_dir))
        assert len(app_strategy.history) == 4

        # 3. the strategy's own loop, for its Result
        with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), strat_dir, population=task.users()) as run:
            grid = LocalGrid({7000 + i: honest_node(u) for i, u in enumerate(task.users())})
            strategy = DPMFStrategy(run, CONFIG)
            result_flower = strategy.start(grid)
            for label, obj in (("RunSecrets", run._secrets), ("NoiseGenerator", run.privatizer.noise),
                               ("RoundPrivatizer", run.privatizer), ("scheduler", run.scheduler),
                               ("optimizer", run.optimizer), ("ledger", run._book), ("ledger run", run._run),
                               ("plan", run.plan), ("store", run.store), ("PrivateRun", run)):
                hay.add(f"repr({label})", repr(obj))
                hay.add(f"str({label})", str(obj))
            hay.add_object("privatizer.state_dict()", run.privatizer.state_dict())
            hay.add_object("scheduler.state_dict()", run.scheduler.state_dict())
            hay.add_object("optimizer.state_dict()", run.optimizer.state_dict())
            hay.add_object("plan.to_dict()", run.plan.to_dict())
            hay.add_object("observed epsilon", run.observed_epsilon())
        assert strategy.stopped == "horizon"
        hay.add("repr(Result)", repr(result_flower))
        hay.add_object("Result.arrays", result_flower.arrays.to_torch_state_dict())
        hay.add_object("Result.train_metrics_clientapp", {k: dict(v) for k, v in
                                                          result_flower.train_metrics_clientapp.items()})
        hay.add_object("Result.evaluate_metrics_serverapp", {k: dict(v) for k, v in
                                                             result_flower.evaluate_metrics_serverapp.items()})
        for label, s in (("strategy", strategy), ("app strategy", app_strategy)):
            hay.add_object(f"{label}.history", s.history)
            hay.add(f"{label} vars", repr(vars(s)))
            hay.add(f"{label}.stopped", s.stopped)
        for label, g in (("strategy", grid), ("app", app_grid)):  # everything the server sent to the clients
            for m in g.sent:
                hay.add(f"{label} message metadata", repr(m.metadata))
                for name, record in m.content.config_records.items():
                    hay.add_object(f"{label} message config {name}", dict(record))
                for _name, record in m.content.array_records.items():
                    for key, array in record.items():
                        hay.add(f"{label} message array {key}", array.data)

        # 4. the audit of each ledger
        from fedmf.cli import main as fedmf_cli

        for run_dir in (loop_dir, app_dir, strat_dir):
            assert fedmf_cli(["audit", "--ledger", str(run_dir / "ledger.db"), "--json"]) == 0
            assert fedmf_cli(["audit", "--ledger", str(run_dir / "ledger.db")]) == 0

        # 5. every error we can provoke
        provoke(hay, "bad configuration", lambda: RunConfig.from_mapping({"noise-multiplier": 1.0,
                                                                                "clip-norm": "wide"}), ConfigError)
        provoke(hay, "bad configuration (app)", lambda: run_server(LocalGrid({}), app_config(tmp_path / "bad",
                                                                                            **{"rounds": -1})),
                ConfigError)
        provoke(hay, "another plan", lambda: train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS, delta=1e-6),
                                                   task.local_update, checkpoint_dir=loop_dir), PlanMismatch)
        other_secrets: dict[str, bytes] = {}
        for name in SECRET_FILES:
            wrong = copy_run(loop_dir, tmp_path / f"wrong-{name}")
            other = os.urandom(32)
            other_secrets[f"replacement {name}"] = other
            replace_secret(wrong, name, other)
            provoke(hay, f"wrong {name}", lambda: PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), wrong,  # noqa: B023 (called within this iteration)
                                                                  population=task.users()), FedmfError)
        damaged = copy_run(loop_dir, tmp_path / "damaged-secret")
        replace_secret(damaged, "noise_seed", read_secrets(loop_dir)["loop/noise_seed"][:31])
        provoke(hay, "damaged secret", lambda: PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), damaged),
                CheckpointError)
        for target in (f"round-{ROUNDS - 1:06d}.pt", "run.json"):
            tampered = copy_run(loop_dir, tmp_path / f"tampered-{target}")
            data = bytearray((tampered / target).read_bytes())
            data[len(data) // 2] ^= 0x55
            (tampered / target).write_bytes(bytes(data))
            provoke(hay, f"tampered {target}", lambda: PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), tampered,  # noqa: B023 (called within this iteration)
                                                                       population=task.users()), FedmfError)
        noise_files = sorted(p.name for p in app_dir.glob("noise-*.pt"))
        if noise_files:
            tampered = copy_run(app_dir, tmp_path / "tampered-noise")
            (tampered / noise_files[-1]).write_bytes(b"\0" * 64)
            provoke(hay, "tampered noise file", lambda: run_server(LocalGrid(app_nodes()),
                                                                    app_config(tampered)), CheckpointError)
        lost = copy_run(loop_dir, tmp_path / "lost-run-json")
        (lost / "run.json").unlink()
        provoke(hay, "run.json lost", lambda: PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), lost),
                CheckpointError)
        seed = read_secrets(loop_dir)["loop/noise_seed"]
        provoke(hay, "pickle a ServerSecret", lambda: pickle.dumps(ServerSecret(seed)), TypeError)
        with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), loop_dir, population=task.users()) as run:
            provoke(hay, "pickle the scheduler", lambda: pickle.dumps(run.scheduler), TypeError)
            provoke(hay, "a round past the horizon", lambda: run.guard(), FedmfError)
        provoke(hay, "a short ledger secret", lambda: ServerSecret(seed[:8]), ValueError)
        provoke(hay, "a noise seed too long", lambda: RoundPrivatizer(task.plan(rounds=ROUNDS), {"w": (3,)},
                                                                       seed=seed * 3), ConfigError)

        out, err = capfd.readouterr()
        records = _dedupe(logs.records)
    hay.add("stdout", out)
    hay.add("stderr", err)
    hay.add("logs", logs.text())
    assert any("fedmf round" in r.getMessage() for r in records)  # the capture works
    assert "6/6 rounds" in err and "\r" not in err  # the in-process progress bar: plain lines on a captured stderr

    written = {}
    for run_dir in (loop_dir, app_dir, strat_dir):
        written[run_dir.name] = hay.add_run_directory(run_dir)
    assert {"run.json", "ledger.db", "initial.pt", "secrets/noise_seed.used"} <= set(written["loop"])
    assert any(n.startswith("round-") for n in written["loop"]) and "final-model.pt" in written["app"]

    secrets = {}
    for run_dir in (loop_dir, app_dir, strat_dir):
        secrets.update(read_secrets(run_dir))
    secrets.update(other_secrets)
    assert len(set(secrets.values())) == len(secrets) and all(len(s) == 32 for s in secrets.values())
    derived = {}
    for run_dir in (loop_dir, app_dir, strat_dir):
        seeds = derived_noise_seeds(secrets[f"{run_dir.name}/noise_seed"], task.checkpoint_salts(run_dir))
        derived.update({f"{run_dir.name} {k}": v for k, v in seeds.items()})

    # the search finds a secret where one is (the check is not vacuous)
    probe = Haystack()
    probe.add_object("probe", {"x": [base64.urlsafe_b64encode(secrets["loop/schedule_key"]).rstrip(b"=").decode()]})
    found = probe.leaks(secrets)
    assert "loop/schedule_key as urlsafe base64 unpadded in probe['x']" in found
    assert all(f.startswith("loop/schedule_key as ") and "base64" in f for f in found), found

    leaks = hay.leaks(secrets) + hay.leaks(derived)
    assert not leaks, "\n".join(leaks[:20])


# ---- permissions ---------------------------------------------------------------------------------
def _one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
@pytest.mark.parametrize("name", SECRET_FILES)
def test_a_secret_file_readable_by_others_is_refused_at_start_in_one_line(tmp_path, name, mode, capsys):
    from flwr.app import Context

    import server.app

    run_dir = tmp_path / "run"
    task.write_secrets(run_dir)
    (run_dir / "secrets" / name).chmod(mode)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    expected = f"{run_dir / 'secrets' / name}' has mode {mode:o}"
    for start in (lambda: PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), run_dir),
                  lambda: train(task.Tiny(), task.users(), task.plan(rounds=ROUNDS), task.local_update,
                                checkpoint_dir=run_dir),
                  lambda: server.app.run_server(LocalGrid(app_nodes()), app_config(run_dir))):
        with pytest.raises(CheckpointError) as caught:
            start()
        assert expected in _one_line(caught.value) and "chmod 600" in str(caught.value)
    # the ServerApp prints that one line, once, and nothing has been written
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=app_config(run_dir))
    logger = logging.getLogger("fedmf.server")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers[:] = []  # as in a fresh ServerApp process: main() installs its stderr handler
    try:
        with pytest.raises(server.app.ServerAppError):
            server.app.main(LocalGrid(app_nodes()), context)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("fedmf: error: secret file") and expected in errors[0], errors
    # ...but how the run ended (fedmf.run.outcome: the launcher reads it instead of the log)
    written = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert [p for p in written if p.name != OUTCOME_FILE] == before
    assert expected in read_outcome(run_dir).error
    assert (run_dir / "secrets" / name).read_bytes() == hashlib.sha256(b"fixed" + name.encode()).digest()


def test_a_run_directory_is_0700_its_secrets_0600_and_a_0755_one_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    old = os.umask(0)  # even with a permissive umask
    try:
        train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=run_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "secrets").stat().st_mode) == 0o700
    for name in SECRET_FILES:
        assert stat.S_IMODE((run_dir / "secrets" / name).stat().st_mode) == 0o600, name
    for path in [*run_dir.glob("*.pt"), run_dir / "run.json", run_dir / "secrets" / "noise_seed.used"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(CheckpointError) as caught:
        PrivateRun.open(task.Tiny(), task.plan(rounds=4), loose)
    assert "has mode 755" in _one_line(caught.value) and "chmod 700" in str(caught.value)
    assert list(loose.iterdir()) == []  # no secret was created in it
    loose.chmod(0o750)
    with pytest.raises(CheckpointError):
        train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=loose)
    assert list(loose.iterdir()) == []


def test_every_file_of_a_run_directory_is_0600(tmp_path):
    run_dir = tmp_path / "run"
    train(task.Tiny(), task.users(), task.plan(rounds=4), task.local_update, checkpoint_dir=run_dir)
    loose = {str(p.relative_to(run_dir)): oct(stat.S_IMODE(p.stat().st_mode)) for p in run_dir.rglob("*")
             if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert not loose


@pytest.mark.parametrize("holder", ["NoiseGenerator", "RoundPrivatizer", "RunSecrets"])
def test_objects_holding_a_secret_refuse_to_be_pickled(tmp_path, holder):
    with PrivateRun.open(task.Tiny(), task.plan(rounds=ROUNDS), tmp_path / "run", population=task.users()) as run:
        obj = {"NoiseGenerator": run.privatizer.noise, "RoundPrivatizer": run.privatizer,
               "RunSecrets": run._secrets}[holder]
        with pytest.raises(TypeError):
            data = pickle.dumps(obj)
            assert run._secrets.noise_seed in data  # what the pickle would carry
