"""The Flower ClientApp: thin handlers, each parse → one task call → reply.

Messages (all config keys are ConfigRecord entries under "config"):

* QUERY ``{"config": {"request": "identity", "run": str, "round": int, "challenge": bytes}}`` →
  ``{"identity": ConfigRecord({"user-id": str, "signature": bytes})}``: the signature (with the
  private key at ``node_config["user-key"]``, only when that is set) is the user's proof of identity
  over (run, round, this node's id, challenge, user id) — ``fedmf.enrollment.proof_message``. A
  QUERY without a challenge is answered with the user id alone.
* TRAIN ``{"arrays": ArrayRecord(global state dict), "config": {"round": int, "run-nonce": str,
  "user-id": str, "task": str, "task-options": JSON object string, "client-lr": float,
  "local-epochs": int, "batch-size": int}}`` → ``{"arrays": ArrayRecord(delta = new − old),
  "metrics": MetricRecord({"num-examples": int, "train-loss": float}), "config": {"round",
  "run-nonce", "user-id"}}``.
* EVALUATE: the same config (hyperparameters not needed) → ``{"metrics": MetricRecord(
  {"num-examples", "eval-loss", "eval-accuracy"}), "config": {"round", "run-nonce", "user-id"}}``.

* TRAIN with a ``"secagg"`` ConfigRecord: one stage of a secure-aggregation round
  (``client/secagg_app.py``) → ``{"secagg": ConfigRecord(the stage's reply), "config": {"round",
  "run-nonce", "user-id"}}``. The node's own ``node_config`` decides how far it trusts the server:
  with ``"enrollment-file"`` (the operator's enrollment, public) and ``"user-key"`` it signs with
  the user's enrolled key and checks its neighbours' signatures against the enrollment (protection
  against a lying server), else it trusts the server; with ``"require-secure-aggregation" = true``
  (the default on a node with ``"enrollment-file"``; ``false`` must then be set explicitly) it refuses
  a plain TRAIN (no ``"secagg"`` record), so that a deviating server cannot simply ask for the clear
  update.

A bad message, a task error, or a "user-id" other than this node's identity is answered with an
error reply (``Error(ERROR_CODE, "fedmf: <one line>")``); any other exception is a bug and is left
to Flower (which replies with its own error).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedmf.enrollment import CHALLENGE_BYTES, check_user_id, load_private_key, sign_proof
from fedmf.errors import ConfigError, FedmfError
from fedmf.tasks import ClientHyper, Task, get_task

from .secagg_app import SECAGG_RECORD, secure_stage

__all__ = ["app", "user_id", "load_task", "TrainRequest", "parse_request", "ERROR_CODE", "IDENTITY_RECORD"]

#: the Error code of fedmf's own error replies
ERROR_CODE = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
#: the QUERY reply's ConfigRecord key (server/identity.py reads it)
IDENTITY_RECORD = "identity"

app = ClientApp()


def _requires_secure_aggregation(node_config: Mapping[str, Any]) -> bool:
    """``node_config["require-secure-aggregation"]``: true or false (absent: true on a node with an
    ``enrollment-file``, which holds the enrollment to protect against a lying server: REVIEW-i36-secagg-2
    LOW-1; false otherwise). Anything else, e.g. the string 'true', is refused, failing closed: a node
    that meant to refuse clear updates must not send them because of a quoting slip."""
    value = node_config.get("require-secure-aggregation", "enrollment-file" in node_config)
    if not isinstance(value, bool):
        raise ConfigError(f"node config require-secure-aggregation must be true or false (unquoted), got {value!r}")
    return value


def user_id(node_config: Mapping[str, Any], run_config: Mapping[str, Any] | None = None) -> str:
    """This node's user: ``node_config["user-id"]`` (deployment; an int is taken as its decimal
    string), else the simulation's ``partition-id`` (``simulation_user``); ConfigError otherwise."""
    if "user-id" in node_config:
        user = node_config["user-id"]
        if isinstance(user, int) and not isinstance(user, bool):
            user = str(user)
        return check_user_id(user, "node config user-id")
    if "partition-id" in node_config:
        part = node_config["partition-id"]
        if isinstance(part, bool) or not isinstance(part, int) or part < 0:
            raise ConfigError(f"node config partition-id must be an integer >= 0, got {part!r}")
        return simulation_user(part, run_config)
    raise ConfigError("node config has neither user-id nor partition-id: this node has no user identity")


def simulation_user(partition: int, run_config: Mapping[str, Any] | None = None) -> str:
    """Simulated node ``partition``'s user: ``str(partition)`` for a task whose users are "0".."N-1"
    (or without a run config), else the task's ``partition``-th user in ``task.users()`` order —
    the order ``fedmf simulate --backend flower`` numbers them in (shakespeare's roles, say)."""
    if not run_config or "task" not in run_config:
        return str(partition)
    users = load_task(str(run_config["task"]), run_config.get("task-options", "{}")).users()
    if partition >= len(users):
        raise ConfigError(f"partition-id {partition} is beyond the task's {len(users)} users")
    numbered = {str(i) for i in range(len(users))}
    return str(partition) if set(users) == numbered else str(users[partition])


@functools.lru_cache(maxsize=8)
def _cached_task(name: str, options_json: str) -> Task:
    return get_task(name, **json.loads(options_json))


def load_task(name: str, options: str | Mapping[str, Any]) -> Task:
    """The task ``name`` with ``options`` (a JSON object string or a mapping), built once per process."""
    if isinstance(options, str):
        try:
            options = json.loads(options or "{}")
        except json.JSONDecodeError:
            raise ConfigError(f"task-options must be a JSON object, got {options!r}") from None
    if not isinstance(options, Mapping):
        raise ConfigError(f"task-options must be a JSON object, got {options!r}")
    return _cached_task(name, json.dumps(dict(options), sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class TrainRequest:
    """A TRAIN or EVALUATE message's config, parsed and checked."""

    round: int
    nonce: str
    user: str
    task: str
    options: str
    hyper: ClientHyper | None


def _get(config: ConfigRecord, key: str, kind: type | tuple[type, ...]) -> Any:
    value = config.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"message config {key!r} is missing or not {getattr(kind, '__name__', kind)}: {value!r}")
    return value


def parse_request(msg: Message, hyper: bool = True) -> TrainRequest:
    """The message's "config" record as a TrainRequest (``hyper=False``: no hyperparameters needed)."""
    if not msg.has_content() or "config" not in msg.content.config_records:
        raise ConfigError("message has no config record")
    config = msg.content.config_records["config"]
    round_ = _get(config, "round", int)
    if round_ < 0:
        raise ConfigError(f"message config 'round' must be >= 0, got {round_}")
    return TrainRequest(
        round=round_, nonce=_get(config, "run-nonce", str), user=_get(config, "user-id", str),
        task=_get(config, "task", str), options=_get(config, "task-options", str),
        hyper=ClientHyper(_get(config, "client-lr", (int, float)), _get(config, "local-epochs", int),
                          _get(config, "batch-size", int)) if hyper else None)


def _arrays(msg: Message) -> ArrayRecord:
    arrays = msg.content.array_records.get("arrays")
    if arrays is None:
        raise ConfigError("message has no arrays record")
    return arrays


def _checked(msg: Message, context: Context, hyper: bool) -> tuple[TrainRequest, Task]:
    request = parse_request(msg, hyper)
    me = user_id(context.node_config, context.run_config)
    if request.user != me:
        raise ConfigError(f"message is for user {request.user!r}, this node is {me!r}")
    return request, load_task(request.task, request.options)


def _echo(request: TrainRequest) -> ConfigRecord:
    return ConfigRecord({"round": request.round, "run-nonce": request.nonce, "user-id": request.user})


def _error(msg: Message, e: FedmfError) -> Message:
    return Message(Error(ERROR_CODE, f"fedmf: {e}"), reply_to=msg)


def _identity(msg: Message, context: Context) -> ConfigRecord:
    """This node's user id, signed over the server's challenge when the node has a ``user-key``."""
    user = user_id(context.node_config, context.run_config)
    record = ConfigRecord({"user-id": user})
    config = msg.content.config_records.get("config") if msg.has_content() else None
    key_path = context.node_config.get("user-key")
    if config is None or "challenge" not in config or key_path is None:
        return record
    run, round_, challenge = config.get("run"), config.get("round"), config.get("challenge")
    if not isinstance(run, str) or isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0 \
            or not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_BYTES:
        raise ConfigError("identity query: run, round or challenge missing or malformed")
    if not isinstance(key_path, str) or not key_path:
        raise ConfigError("node config user-key must be the path of the user's private key file")
    record["signature"] = sign_proof(load_private_key(key_path), run, round_, int(context.node_id), challenge, user)
    return record


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's user identity (and its proof: ``_identity``)."""
    try:
        record = _identity(msg, context)
    except FedmfError as e:
        return _error(msg, e)
    return Message(RecordDict({IDENTITY_RECORD: record}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training: reply with the model delta, example count and training loss."""
    try:
        request, task = _checked(msg, context, hyper=True)
        if SECAGG_RECORD in msg.content.config_records:  # one stage of a secure-aggregation round
            record = secure_stage(msg, context, request, task)
            return Message(RecordDict({SECAGG_RECORD: record, "config": _echo(request)}), reply_to=msg)
        if _requires_secure_aggregation(context.node_config):
            raise ConfigError("this node sends its update only under secure aggregation "
                              "(node config require-secure-aggregation): refused")
        params = _arrays(msg).to_torch_state_dict()
        result = task.local_update(params, request.user, request.round, request.hyper)
    except FedmfError as e:
        return _error(msg, e)
    metrics = MetricRecord({"num-examples": int(result.num_examples),
                            "train-loss": float(result.metrics.get("train-loss", float("nan")))})
    return Message(RecordDict({"arrays": ArrayRecord(result.update), "metrics": metrics,
                               "config": _echo(request)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation of the received model on this user's data."""
    try:
        if _requires_secure_aggregation(context.node_config):  # its loss on a chosen model, in the clear
            raise ConfigError("this node answers no federated evaluation under secure aggregation (node config "
                              "require-secure-aggregation, or an enrollment-file): refused")
        request, task = _checked(msg, context, hyper=False)
        model = task.load(_arrays(msg).to_torch_state_dict())
        n, scores = task.evaluate_user(model, request.user)
    except FedmfError as e:
        return _error(msg, e)
    metrics = MetricRecord({"num-examples": int(n), "eval-loss": float(scores["loss"]),
                            "eval-accuracy": float(scores["accuracy"])})
    return Message(RecordDict({"metrics": metrics, "config": _echo(request)}), reply_to=msg)
