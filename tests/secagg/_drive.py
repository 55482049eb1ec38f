"""Drives one SecAgg+ round in process: the server's state machine and one client per node,
with replies dropped or rewritten per stage (a plain helper, not a test module)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from client.secagg import SecAggClient
from fedmf.secagg.messages import CONSISTENCY_CHECK
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.signing import public_bytes
from server.secagg import SecAggServer

STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, CONSISTENCY_CHECK, Stage.UNMASK)

Tamper = Callable[[str, int, dict], object]


def run_round(params: SecAggParams, words: Mapping[int, np.ndarray], *, drop: Mapping[str, set[int]] | None = None,
              tamper: Tamper | None = None, graph_seed: int = 0,
              user_keys: Mapping[int, Ed25519PrivateKey] | None = None, graph_rule: bool = True) -> SecAggServer:
    """Play the five stages; ``drop[stage]`` stay silent from that stage on; ``tamper`` may
    replace a reply; ``user_keys``: each node's enrolled key (every client then holds the
    enrollment of all of them), else ephemeral keys; ``graph_rule``: the enrolled clients' check of k and t
    (``SecAggClient``). Raises what the server raises
    (``SecAggAbort`` below the threshold)."""
    drop = drop or {}
    length = len(next(iter(words.values())))
    server = SecAggServer(params, length, list(words), rng=random.Random(graph_seed), run="run", round_=3)
    clients = {u: make_client(u, user_keys, graph_rule=graph_rule) for u in words}
    silent: set[int] = set()
    for stage in STAGES:
        silent |= set(drop.get(stage, ()))
        replies: dict[object, object] = {}
        for u, request in server.requests().items():
            if u in silent:
                continue
            reply = clients[u].handle(request, words[u] if stage == Stage.COLLECT_MASKED_VECTORS else None)
            replies[u] = tamper(stage, u, reply) if tamper else reply
        server.receive(replies)
    return server


def make_client(u: int, user_keys: Mapping[int, Ed25519PrivateKey] | None = None, **context) -> SecAggClient:
    """Node ``u``'s client for the drive's run and round (enrolled when ``user_keys`` are given)."""
    context = {"run": "run", "round_": 3, **context}
    if user_keys is None:
        context.pop("graph_rule", None)
        return SecAggClient(u, **context)
    enrolled = frozenset(public_bytes(k) for k in user_keys.values())
    return SecAggClient(u, signing_key=user_keys[u], enrolled=enrolled, **context)


def random_words(nodes: list[int], length: int, bits: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {u: rng.integers(0, 2**bits, length, dtype=np.uint64) for u in nodes}


def tensors(flat: np.ndarray, layout: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32
            ) -> dict[str, torch.Tensor]:
    """A flat update cut into the ``layout``'s named tensors, in order."""
    out, offset = {}, 0
    for name, shape in layout.items():
        size = math.prod(shape)
        out[name] = torch.tensor(flat[offset:offset + size].reshape(shape), dtype=dtype)
        offset += size
    return out
