"""The ClientApp's side of a secure-aggregation round: one TRAIN message per SecAgg+ stage.

A TRAIN message with a ``"secagg"`` ConfigRecord is one stage (``server/secagg_round.py`` sends
them): its payload (``fedmf.secagg.messages.from_wire``) goes to this node's ``SecAggClient``
(``client/secagg.py``), kept between stages in the node's ``Context.state`` (private: never sent).
At the collect stage the message also carries the model: the client trains, checks its update
against the layout the server sent (names, shapes, floating, finite: ``check_update``), zeroes it
when ‖·‖∞ exceeds the round's threshold, clips it to the ζₜ the server sent, quantizes it (with the
unclipped bit when ζ adapts, and its training loss clipped to [0, L] as the last word when the run
releases the client metric privately: ``fedmf.secagg.encode.encode_local_update``, the in-process
secure aggregation's encoding too) and masks the whole vector. The reply is the stage's payload in a
``"secagg"`` ConfigRecord: the loss never travels in the clear.

Which keys sign (``client/secagg.py``): with both ``node_config["enrollment-file"]`` (the operator's
enrollment, public data, held by the node itself) and ``node_config["user-key"]``, the user's
enrolled key signs and every neighbour must sign with an enrolled key — protection against a
server that lies or forges neighbours. With no ``enrollment-file``, a fresh key per attempt and
no check of the neighbours: the server is trusted. An ``enrollment-file`` without a
``user-key`` is refused. The server's messages cannot change the mode. An enrolled node refuses a
neighbourhood below ``node_config["secagg-min-neighbours"]`` (default 3) and a threshold below
``fedmf.secagg.params.min_threshold`` of the neighbourhood it is shown (``SecAggClient``).

One update per round in enrolled mode (REVIEW-i36-secagg-2 HIGH-2; without an enrollment the server
is trusted, and a redo after an abort at unmask keeps every node): once this node has signed a survivor set U3 for
(run nonce, round), it records the pair in its ``Context.state`` (``SIGNED_RECORD``, kept across the
messages of a run) before the signature leaves, and from then on refuses any setup or signature for
another run nonce, for that round or for a lower one. So a server cannot complete two attempts of one
round with this node's update and difference their sums. Without this node's signature nobody reveals
its seed share, so an attempt that aborted before it signed may be redone with it; a node that signed
in an aborted attempt sits the redo out (a dropout of the redo: an abort at unmask, e.g. a hostile
client's bad share, then leaves the redo without its signers, and the run ends after the redos). The
record lives in the ``Context`` of one Flower run: a new run starts it afresh.

Config keys of a stage message, beside the TRAIN ones: ``clip-norm`` (ζₜ), ``zero-threshold``
(absent: no zeroing), ``secagg-scale``, ``secagg-beta``, ``secagg-bit`` (bool: adaptive clipping's
bit), ``secagg-metric-clip`` (L of the private client-metric release; absent: no metric word) and
``secagg-layout`` (JSON ``[[name, shape], …]``, the model's parameters in order).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from fedmf.enrollment import Enrollment, load_private_key
from fedmf.errors import ConfigError
from fedmf.round.client_metrics import METRIC
from fedmf.secagg.encode import encode_local_update
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.messages import CONSISTENCY_CHECK, SECAGG_RECORD, from_wire, to_wire
from fedmf.secagg.quantize import Quantization
from fedmf.tasks import Task

from .secagg import MIN_NEIGHBOURS, SecAggClient

__all__ = ["SECAGG_RECORD", "SIGNED_RECORD", "STATE_RECORD", "secure_stage"]

#: the node's Context.state record holding its SecAggClient between stages
STATE_RECORD = "fedmf-secagg"
#: the node's Context.state record of the last (run nonce, round) it signed a survivor set for
SIGNED_RECORD = "fedmf-secagg-signed"


def _check_unsigned(context: Context, run: str, round_: int) -> None:
    """Refuse a round of another run nonce than the one this node signed for, or one not above the
    last round it signed (HIGH-2: never a second update for a round whose sum may have been released)."""
    record = context.state.config_records.get(SIGNED_RECORD)
    if record is None:
        return
    if record["run"] != run:
        raise SecAggError("this node signed a survivor set under another run nonce: refused")
    if round_ <= int(record["round"]):
        raise SecAggError(f"this node signed a survivor set for round {int(record['round'])}; round {round_} "
                          f"refused (one update per round)")


def _layout(text: object) -> dict[str, tuple[int, ...]]:
    try:
        pairs = json.loads(text) if isinstance(text, str) else None
        layout = {str(name): tuple(int(x) for x in shape) for name, shape in pairs}
    except (TypeError, ValueError):
        raise ConfigError("secagg-layout must be a JSON list of [name, shape] pairs") from None
    if not layout:
        raise ConfigError("secagg-layout is empty")
    return layout


def _number(config: ConfigRecord, key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"message config {key!r} is missing or not a number")
    return float(value)


def _words(msg: Message, config: ConfigRecord, client: SecAggClient, task: Task, request: Any) -> np.ndarray:
    """Train, check, zero, clip, quantize (and the metric's word): the words this client masks."""
    arrays = msg.content.array_records.get("arrays")
    if arrays is None:
        raise ConfigError("the collect stage's message has no arrays record")
    layout = _layout(config.get("secagg-layout"))
    result = task.local_update(arrays.to_torch_state_dict(), request.user, request.round, request.hyper)
    zeta = _number(config, "clip-norm")
    bit = config.get("secagg-bit")
    if not isinstance(bit, bool):
        raise ConfigError("message config 'secagg-bit' is missing or not a bool")
    metric_clip = _number(config, "secagg-metric-clip") if "secagg-metric-clip" in config else None
    q = Quantization(clip_norm=1.0 if bit else zeta, scale=_number(config, "secagg-scale"), bits=client.bits,
                     dim=sum(math.prod(shape) for shape in layout.values()), beta=_number(config, "secagg-beta"),
                     with_bit=bit, metric_clip=metric_clip)
    threshold = _number(config, "zero-threshold") if "zero-threshold" in config else None
    return encode_local_update(q, result.update, layout, clip_norm=zeta, zero_threshold=threshold,
                               rng=np.random.default_rng(), metric=result.metrics.get(METRIC))


@functools.lru_cache(maxsize=4)
def _enrolled_keys(path: str, stamp: tuple[int, int, int]) -> frozenset[bytes]:
    del stamp  # the cache key: the file read again when it changes
    return frozenset(Enrollment.load(path).users.values())


def signing_mode(node_config: Mapping[str, Any]) -> tuple[Ed25519PrivateKey | None, frozenset[bytes] | None]:
    """(the user's enrolled key, the enrolled public keys) from this node's own configuration, or
    (None, None) where it holds no enrollment (the server is trusted then)."""
    path = node_config.get("enrollment-file")
    if path is None:
        return None, None
    key_path = node_config.get("user-key")
    if not isinstance(path, str) or not path or not isinstance(key_path, str) or not key_path:
        raise ConfigError("node config enrollment-file needs user-key (the paths of the enrollment and of the "
                          "user's private key file)")
    try:
        info = os.stat(path)
    except OSError as e:
        raise ConfigError(f"enrollment file {path!r}: {e.strerror}") from None
    return load_private_key(key_path), _enrolled_keys(path, (info.st_ino, info.st_mtime_ns, info.st_size))


def _min_neighbours(node_config: Mapping[str, Any]) -> int:
    """``node_config["secagg-min-neighbours"]`` (absent: ``MIN_NEIGHBOURS``): the smallest neighbourhood
    an enrolled node accepts; an integer ≥ 1."""
    value = node_config.get("secagg-min-neighbours", MIN_NEIGHBOURS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"node config secagg-min-neighbours must be an integer ≥ 1, got {value!r}")
    return value


def secure_stage(msg: Message, context: Context, request: Any, task: Task) -> ConfigRecord:
    """This node's answer to one SecAgg+ stage (``request``: the parsed TRAIN config)."""
    config = msg.content.config_records["config"]
    payload = from_wire(msg.content.config_records[SECAGG_RECORD], Key.MASKED_PARAMETERS)
    stage = payload.get(Key.STAGE)
    signing_key, enrolled = signing_mode(context.node_config)
    if stage == Stage.SETUP:
        client = SecAggClient(int(context.node_id), run=request.nonce, round_=request.round,
                              signing_key=signing_key, enrolled=enrolled,
                              min_neighbours=_min_neighbours(context.node_config))
    elif STATE_RECORD in context.state.config_records:
        client = SecAggClient.from_state(context.state.config_records[STATE_RECORD], signing_key=signing_key,
                                         enrolled=enrolled)
    else:
        raise SecAggError(f"secure-aggregation stage {stage!r} without a setup on this node")
    vector = _words(msg, config, client, task, request) if stage == Stage.COLLECT_MASKED_VECTORS else None
    try:
        if enrolled is not None and stage in (Stage.SETUP, CONSISTENCY_CHECK):
            _check_unsigned(context, client.run, client.round)
        reply = client.handle(payload, vector)
    except SecAggError:
        context.state.config_records.pop(STATE_RECORD, None)  # a refused round is over for this node
        raise
    if enrolled is not None and stage == CONSISTENCY_CHECK:  # recorded before the signature leaves this node
        context.state.config_records[SIGNED_RECORD] = ConfigRecord({"run": client.run, "round": client.round})
    if stage == Stage.UNMASK:
        context.state.config_records.pop(STATE_RECORD, None)
    else:
        context.state.config_records[STATE_RECORD] = ConfigRecord(client.to_state())
    return ConfigRecord(to_wire(reply))
