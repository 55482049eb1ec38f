"""Flower's own FedAvg (``flwr.serverapp.strategy.FedAvg``, no DP) on a fedmf task: the anchor that
``benchmarks/simulate.py`` runs beside ``fedmf simulate --backend flower``.

The client is a plain Flower FedAvg client on fedmf's task code: ``client.app.load_task`` and
``client.app.user_id`` (the same helpers fedmf's ClientApp uses) and the task's ``local_update``; it
replies with its trained model (old + delta), as FedAvg expects. fedmf's own ClientApp cannot serve
FedAvg unchanged: it replies with the delta and needs a per-node ``user-id`` in the config, while
FedAvg sends one config to every node. The server logs one ``fedavg-anchor round`` line per round
with wall-clock (``time.time()``) stamps at the start of ``configure_train`` and the end of
``aggregate_train``; the benchmark reads them from the run's output.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from client.app import load_task, user_id
from fedmf.tasks import ClientHyper

log = logging.getLogger("fedavg_anchor")
server = ServerApp()
client = ClientApp()


class TimedFedAvg(FedAvg):
    """FedAvg that logs the wall-clock window of each round (configure_train start → aggregate_train end)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._started_s = 0.0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._started_s = time.time()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        out = super().aggregate_train(server_round, replies)
        ok = sum(1 for r in replies if not r.has_error())
        log.info("fedavg-anchor round %d start_s %.6f end_s %.6f received %d", server_round - 1, self._started_s,
                 time.time(), ok)
        return out


@server.main()
def main(grid: Grid, context: Context) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    rc = context.run_config
    task = load_task(str(rc["task"]), str(rc["task-options"]))
    users, population = int(rc["clients-per-round"]), int(rc["population"])
    strategy = TimedFedAvg(fraction_train=users / population, fraction_evaluate=0.0, min_train_nodes=users,
                           min_evaluate_nodes=0, min_available_nodes=population)
    train_config = ConfigRecord({k: rc[k] for k in ("task", "task-options", "client-lr", "local-epochs", "batch-size")})
    log.info("fedavg-anchor start_s %.6f", time.time())
    strategy.start(grid=grid, initial_arrays=ArrayRecord(task.model().state_dict()), num_rounds=int(rc["rounds"]),
                   train_config=train_config)


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Local training on this node's user; reply with the trained model and its example count."""
    config = msg.content["config"]
    task = load_task(str(config["task"]), str(config["task-options"]))
    hyper = ClientHyper(float(config["client-lr"]), int(config["local-epochs"]), int(config["batch-size"]))
    params = msg.content["arrays"].to_torch_state_dict()
    result = task.local_update(params, user_id(context.node_config), int(config["server-round"]) - 1, hyper)
    model = {name: value + result.update[name] for name, value in params.items()}
    metrics = MetricRecord({"num-examples": int(result.num_examples)})
    return Message(RecordDict({"arrays": ArrayRecord(model), "metrics": metrics}), reply_to=msg)
