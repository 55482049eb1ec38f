"""A tiny deterministic federated task shared by the loop tests and the SIGKILL subprocesses.

Run as a script: ``python tests/_federated_task.py CHECKPOINT_DIR OUT.pt [EVENT ROUND]`` trains
(resuming from CHECKPOINT_DIR), SIGKILLs itself at (EVENT, ROUND) if given, and saves the final
model's state dict to OUT.pt; with FEDMF_UNSAFE_REPEATABLE_NOISE=1 without noise salts.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan

ROUNDS, MIN_SEP, PARTICIPATIONS, USERS = 40, 4, 10, 60
NAN_USER, SHAPE_USER, HUGE_USER, DROPOUT_USER = "u07", "u13", "u21", "u30"


class Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2, dtype=dtype)


def share_secrets(source, target) -> None:
    """Give ``target`` (a new run directory, mode 0700) the secrets of ``source``: the same
    seed, schedule and keys — how a test compares two runs bit for bit (with
    ``repeatable_noise``: salted runs draw new noise even from the same seed). The copy is
    unbound: without the seed's binding to the source's run (which makes a run refuse a copied
    seed) nor the record that a run used it — what only a test may do."""
    from pathlib import Path

    Path(target).mkdir(mode=0o700, parents=True)
    (Path(target) / "secrets").mkdir(mode=0o700)
    for name in ("noise_seed", "schedule_key", "ledger_secret"):
        data = (Path(source) / "secrets" / name).read_bytes()[:32]
        fd = os.open(Path(target) / "secrets" / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)


def write_secrets(target, label: bytes = b"fixed") -> None:
    """Fixed, known secrets (0600) in a new run directory: a deterministic schedule and noise."""
    import hashlib
    from pathlib import Path

    Path(target).mkdir(mode=0o700, parents=True)
    directory = Path(target) / "secrets"
    directory.mkdir(mode=0o700)
    for name in ("noise_seed", "schedule_key", "ledger_secret"):
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, hashlib.sha256(label + name.encode()).digest())
        os.close(fd)


def checkpoint_salts(directory) -> list[bytes]:
    """The noise salts of every committed round, from the run's last committed checkpoint."""
    from fedmf.run.checkpoint import CheckpointStore

    store = CheckpointStore(directory)
    last = max(store.rounds())
    return [bytes.fromhex(s) for s in store.load(last, None)["privatizer"]["noise"]["salts"]]


def users(count: int = USERS) -> list[str]:
    return [f"u{i:02d}" for i in range(count)]


def plan(rounds: int = ROUNDS, sampling: str | None = None, expected_users: float = 10, delta: float = 1e-5,
         **kw) -> RunPlan:
    schema = MinSep(MIN_SEP, PARTICIPATIONS)
    mech = build("bsr", rounds, schema, Workload(momentum=0.5, cooldown=0.25), num_bands=MIN_SEP)
    return RunPlan.create(mech, schema, clip_norm=1.0, delta=delta, expected_users=expected_users,
                          noise_multiplier=0.8, sampling=sampling, **kw)


def _data(user: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(user[1:]))
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    w = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, -1.0, 2.0]], dtype=torch.float64)
    return x, x @ w.T


def local_update(params, user, t):
    """One full-batch gradient step on the user's least-squares data; planted faults by user."""
    if user == DROPOUT_USER:
        return None
    x, y = _data(user)
    weight, bias = params["linear.weight"].double(), params["linear.bias"].double()
    residual = x @ weight.T + bias - y
    dtype = params["linear.weight"].dtype
    update = {"linear.weight": (-0.1 * residual.T @ x / len(x)).to(dtype),
              "linear.bias": (-0.1 * residual.mean(0)).to(dtype)}
    if user == NAN_USER:
        update["linear.bias"] = torch.full_like(update["linear.bias"], float("nan"))
    elif user == SHAPE_USER:
        update["linear.bias"] = torch.zeros(3, dtype=dtype)
    elif user == HUGE_USER:
        update["linear.weight"] = update["linear.weight"] + 1e6
    return update


def main(argv: list[str]) -> int:
    from fedmf.run.federated import train
    from fedmf.run.private_run import repeatable_noise_from_env

    directory, out = argv[0], argv[1]
    kill = (argv[2], int(argv[3])) if len(argv) > 2 else None

    def on_event(event: str, t: int) -> None:
        if (event, t) == kill:
            os.kill(os.getpid(), signal.SIGKILL)

    model = Tiny()
    train(model, users(), plan(rounds=12), local_update, checkpoint_dir=directory, on_event=on_event,
          repeatable_noise=repeatable_noise_from_env())
    torch.save(model.state_dict(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
