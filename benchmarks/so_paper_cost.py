"""What a round of the ``so-paper`` preset costs in client training, measured on this machine.

    python benchmarks/so_paper_cost.py [--users 8] [--repeats 2]

``so-paper`` is the paper's geometry (2,052 rounds of 1,000 users, 4,053,428-parameter LSTM, 256
sentences per user, batch 16, one local epoch: 16 SGD steps per update). This times local updates of
that task's users as ``fedmf simulate`` runs them: one at a time (one intra-op thread each) and
``workers`` = the CPUs at a time. The server's side of a 1,000-user round is measured by
``benchmarks/round.py --users 1000`` (BENCHMARKS.md); the projection adds both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: BENCHMARKS.md, "Server time per round" (benchmarks/round.py --users 1000, banded-Toeplitz p = 64)
SERVER_S_PER_1000_USER_ROUND = 2.031


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8, help="users timed per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from fedmf.config import RunConfig
    from fedmf.run.simulate import preset_values
    from fedmf.tasks import ClientHyper, get_task
    from fedmf.tasks.base import default_workers

    config = RunConfig.from_mapping(preset_values("so-paper", {"run-dir": "unused"}))
    task = get_task(config.task, **config.task_options)
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    params = {k: v.detach().clone() for k, v in task.model().state_dict().items()}
    workers = default_workers()
    users = task.users()
    task.local_update(params, users[0], 0, hyper)  # warm-up: builds this thread's model
    one, many = [], []
    for repeat in range(args.repeats):
        cohort = users[1 + repeat * args.users: 1 + (repeat + 1) * args.users]
        sentences = [len(task.user_data(u)[1]) for u in cohort]
        started = time.perf_counter()
        for user in cohort:
            task.local_update(params, user, 0, hyper)
        one.append((time.perf_counter() - started) / len(cohort))
        started = time.perf_counter()
        task.local_updates(params, cohort, 0, hyper, workers=workers)
        many.append((time.perf_counter() - started) / len(cohort))
        print(f"# repeat {repeat}: {len(cohort)} users, sentences {sentences}: one at a time {one[-1]:.3f} s/update,"
              f" {workers} workers {many[-1]:.3f} s/update", flush=True)
    per_update = statistics.median(one)
    per_update_parallel = statistics.median(many)
    rounds, users_per_round = config.rounds, int(config.clients_per_round)
    core_s = per_update * users_per_round
    out = {
        "s_per_update_one_thread": per_update, "s_per_update_with_workers": per_update_parallel,
        "workers": workers, "core_s_per_round": core_s, "server_s_per_round": SERVER_S_PER_1000_USER_ROUND,
        "days_on_this_machine": rounds * (per_update_parallel * users_per_round + SERVER_S_PER_1000_USER_ROUND) / 86400,
        "hours_on_100_cores": rounds * (core_s / 100 + SERVER_S_PER_1000_USER_ROUND) / 3600,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
