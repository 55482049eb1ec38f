"""What secure aggregation costs per round: fedmf's SecAgg+ against its central mode, and Flower's
legacy SecAggPlusWorkflow + DifferentialPrivacyClientSideFixedClipping, in one run.

    PYTHONPATH=$PWD nice python benchmarks/secagg_cost.py --users 10 100 1000 --models so-small paper --repeats 3
    PYTHONPATH=$PWD python benchmarks/secagg_cost.py --quick          # a smoke test in seconds

SecAgg+ k and t: derived from each cohort (``graph_for``: k = 28, t = 15 from 30 users; the complete
graph below), or fixed with ``--degree K --threshold T`` (e.g. the former defaults 8 and 5).

Models: the layouts of ``so-small`` (``model_size = "small"``, vocab 10,000: 677,348 float32
parameters) and ``so-paper`` (the paper's LSTM, 4,053,428), from ``fedmf.tasks.models``. Updates:
a pool of random float32 updates (ℓ2 norms spread over 0.3..3 ζ, about half clipped) cycled
through by the users; local training is not timed (the same in every mode).

Per cell (model, users n, dropout fraction), medians over ``--repeats``:

* central: the server's ``RoundPrivatizer`` path (begin, ``add`` per user: validate, zero, clip,
  sum; ``finish``: the round's correlated noise, ÷ m); bytes per client: its update as a Flower
  ``ArrayRecord`` and the model it receives (the same size), measured as the serialized
  ``RecordDict`` proto (``flwr.common.serde.recorddict_to_proto``).
* secure: ``SecAggServer`` and one ``SecAggClient`` per user (ephemeral Ed25519 signing keys),
  every stage that ``SecAggServer.requests()`` yields until the protocol is done (looped over
  generically: setup, share keys, collect, consistency check, unmask). Server
  time per stage = ``requests()`` + ``receive()``; after the last stage "decode+privatize":
  ``RoundPrivatizer.privatize_sum`` (noise from ζ·inflation, added to the residues before they are
  centred), and ``decode_sum`` for the equality check. Client time per stage = ``SecAggClient.handle``, and at the collect stage also the encoding (float64 flat
  update, ``encode_update``: zero, clip, conditional randomized rounding). Bytes per client per
  stage: the stage's payload as the ``"secagg"`` ConfigRecord of a RecordDict, serialized as
  above (``fedmf.secagg.messages.to_wire``), request and reply, on a sample of clients; the real
  messages also carry the TRAIN config (a few hundred bytes) and, at collect, the model (as the
  central mode's TRAIN message does). ``--dropout f``: that fraction of users is silent from the
  collect stage on (dropped after share keys): the server then reconstructs their mask keys and
  removes their pairwise masks from the survivors' sum. Check: the unmasked, decoded sum equals
  the plain sum of the survivors' quantized words (``decode_sum(mod_sum(words))``), bit for bit.
* simulated (cells whose masked vectors would not fit ``--real-limit-gb``: the server holds every
  survivor's vector at once): (a) the whole protocol for real with all n users on a short vector
  (``--short`` words): every key agreement, Shamir share and reconstruction at the real n and k,
  checked as above; (b) one real round at the full dimension with k + 1 users (the complete graph:
  each has k neighbours, as in a Harary graph of degree k) for the clients' collect stage and the
  server's per-vector cost (``--full-repeats`` of it); (c) the server's full-dimension work scaled by counts: each survivor's
  vector validated and summed (per-vector time from (b)), each mask removed at unmask (one self
  mask per survivor, one pairwise mask per (dropped, surviving neighbour) pair; per-mask time
  measured at the full dimension), and decode+privatize run for real at the full dimension.
* aborts: an attempt in which some user keeps fewer than t share holders aborts (at the collect
  stage); it is redone with a fresh graph and fresh dropouts, as the strategy does, and counted;
  ``abort_probability`` estimates the chance by Monte Carlo over the server's rule; a cell where
  every draw aborts (t = n: no dropout tolerated) is reported, not run.
* memory: the server holds every survivor's masked vector at once (survivors × words × 8 bytes,
  "server holds"; beside the replies themselves).
* signing keys (``--signing-users``): the protocol on short vectors with ephemeral and with enrolled
  Ed25519 keys (each client then checks its neighbours' keys against the enrollment).
* Flower legacy (``--flower-users``, where users × parameters ≤ ``--flower-limit``):
  ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(k + 1 shares, threshold t))`` (fedmf's k and t
  for the cohort, ``flower_graph``) with ``DifferentialPrivacyClientSideFixedClipping(FedAvg)`` on
  the server, ``ClientApp(mods=[secaggplus_mod, fixedclipping_mod])`` NumPyClients on an in-process
  grid (``server.local_grid``); each message and reply goes through Flower's protobuf serialization
  (``message_to_proto``), whose sizes are the bytes; client time is the time inside the ClientApp,
  server time the round's wall time less client and serialization time.

Machine: say in BENCHMARKS.md how loaded it was; every side is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, RecordDict  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.common.serde import recorddict_to_proto  # noqa: E402

from client.secagg import SecAggClient  # noqa: E402
from fedmf import MinSep, Workload  # noqa: E402
from fedmf.mechanisms import build  # noqa: E402
from fedmf.plan import RunPlan  # noqa: E402
from fedmf.round.privatize import RoundPrivatizer, flat_size  # noqa: E402
from fedmf.secagg.encode import encode_update  # noqa: E402
from fedmf.secagg.errors import SecAggAbort  # noqa: E402
from fedmf.secagg.masks import SELF_MASK, expand_mask, mod_sub, mod_sum  # noqa: E402
from fedmf.secagg.messages import CONSISTENCY_CHECK, SECAGG_RECORD, to_wire  # noqa: E402
from fedmf.secagg.params import DEFAULT_BITS, DEFAULT_SCALE, SecAggParams, exposure  # noqa: E402
from fedmf.secagg.quantize import Quantization, decode_sum  # noqa: E402
from fedmf.secagg.signing import public_bytes  # noqa: E402
from server.secagg import ABORTED, DONE, SecAggServer, harary_graph  # noqa: E402

CLIP_NORM = 1.0
#: server/config.py's defaults of secagg-bits and secagg-scale; degree and threshold: 0 (derived from
#: each round's cohort by ``fedmf.secagg.params.graph_for``) unless --degree/--threshold are given
BITS, SCALE = DEFAULT_BITS, DEFAULT_SCALE
#: the run nonce and round every signed statement names
RUN, ROUND = "bench", 1
VOCAB = 10_000
QUICK_LAYOUT = {"embedding.weight": (104, 16), "output.weight": (104, 16), "output.bias": (104,)}
Layout = dict[str, tuple[int, ...]]


# ---- inputs -------------------------------------------------------------------------------------
def model_layout(model: str) -> Layout:
    """The parameter layout of the ``so-small`` or ``paper`` model (``quick``: a tiny one)."""
    if model == "quick":
        return dict(QUICK_LAYOUT)
    from fedmf.tasks.models import empty_word_model

    size = {"so-small": "small", "paper": "paper"}[model]
    return {name: tuple(p.shape) for name, p in empty_word_model(size, VOCAB).named_parameters()}


def make_pool(dim: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` float32 flat updates, ℓ2 norms spread geometrically over 0.3..3 ζ."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(count):
        v = rng.standard_normal(dim, dtype=np.float32)
        v *= np.float32(CLIP_NORM * 0.3 * 10.0 ** (i / max(count - 1, 1)) / np.linalg.norm(v))
        pool.append(v)
    return pool


def make_plan(users: int) -> RunPlan:
    """A small banded plan (the noise step is the same code in both modes)."""
    schema = MinSep(4, 8)
    mechanism = build("bsr", 32, schema, Workload(), num_bands=4)
    return RunPlan.create(mechanism, schema, clip_norm=CLIP_NORM, delta=1e-6, expected_users=users,
                          noise_multiplier=1.0)


def secagg_params(degree: int = 0, threshold: int = 0) -> SecAggParams:
    """The run's SecAgg+ parameters; degree and threshold 0: derived from each round's cohort."""
    return SecAggParams(degree=degree, threshold=threshold, bits=BITS, scale=SCALE)


def quantization(dim: int) -> Quantization:
    return Quantization(clip_norm=CLIP_NORM, scale=SCALE, bits=BITS, dim=dim)


def wire_bytes(records: dict[str, Any]) -> int:
    """Bytes of a RecordDict of these records in Flower's protobuf serialization."""
    return recorddict_to_proto(RecordDict(records)).ByteSize()


def payload_bytes(payload: dict[str, Any]) -> int:
    return wire_bytes({SECAGG_RECORD: ConfigRecord(to_wire(payload))})


def tensors(flat: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in layout.items():
        size = math.prod(shape)
        out[name] = torch.from_numpy(flat[offset:offset + size]).view(shape)
        offset += size
    return out


# ---- central ------------------------------------------------------------------------------------
def central_round(layout: Layout, pool: list[np.ndarray], users: int) -> dict[str, float]:
    """The server's privatizer path for ``users`` updates: seconds and bytes per client."""
    privatizer = RoundPrivatizer(make_plan(users), layout, dtype=torch.float32, seed=b"b" * 32)
    updates = [tensors(pool[i % len(pool)], layout) for i in range(users)]
    started = time.perf_counter()
    privatizer.begin(0, range(users))
    for i, update in enumerate(updates):
        privatizer.add(i, update)
    privatizer.finish()
    server_s = time.perf_counter() - started
    up = wire_bytes({"arrays": ArrayRecord(updates[0])})
    return {"server_s": server_s, "up_bytes": up, "down_bytes": up}


# ---- secure -------------------------------------------------------------------------------------
def secure_round(layout_dim: int, pool: list[np.ndarray], users: int, dropout: float, *, seed: int = 0,
                 sample: int = 3, privatize_layout: Layout | None = None, attempts: int = 20,
                 params: SecAggParams | None = None, enrolled: bool = False) -> dict[str, Any]:
    """One real SecAgg+ round of ``users`` clients over ``layout_dim``-value updates; ``dropout`` of
    them silent from the collect stage on; ``params``: k and t (derived from the cohort by default);
    ``enrolled``: each client signs with an enrolled Ed25519 key and checks its neighbours' against
    the enrollment (else a fresh key per attempt). Returns per-stage server seconds, per-stage client
    seconds (median over clients), per-stage bytes per client (median over ``sample`` clients),
    the check of the sum and the counts the simulation scales by. An attempt that aborts (a
    neighbourhood left with fewer than t holders) is redone, as the strategy does, with a fresh
    graph and fresh dropouts; ``aborts`` and ``aborted_server_s`` count them."""
    aborts, wasted = 0, 0.0
    for attempt in range(attempts):
        try:
            result = _secure_attempt(layout_dim, pool, users, dropout, seed + 7919 * attempt, sample, privatize_layout,
                                     params or secagg_params(), enrolled)
        except _Aborted as e:
            aborts, wasted = aborts + 1, wasted + e.server_s
            continue
        return {**result, "aborts": aborts, "aborted_server_s": wasted}
    raise SecAggAbort(f"{attempts} attempts of a {users}-user round with {dropout:g} dropouts all aborted")


class _Aborted(Exception):
    def __init__(self, server_s: float) -> None:
        super().__init__()
        self.server_s = server_s


def _secure_attempt(layout_dim: int, pool: list[np.ndarray], users: int, dropout: float, seed: int, sample: int,
                    privatize_layout: Layout | None, params: SecAggParams, enrolled: bool) -> dict[str, Any]:
    q = quantization(layout_dim)
    nodes = list(range(1, users + 1))
    server = SecAggServer(params, q.length, nodes, rng=random.Random(seed), run=RUN, round_=ROUND)
    if enrolled:
        keys = {u: Ed25519PrivateKey.generate() for u in nodes}
        enrollment = frozenset(public_bytes(k) for k in keys.values())
        clients = {u: SecAggClient(u, run=RUN, round_=ROUND, signing_key=keys[u], enrolled=enrollment) for u in nodes}
    else:
        clients = {u: SecAggClient(u, run=RUN, round_=ROUND) for u in nodes}
    dropped = set(random.Random(seed + 1).sample(nodes, round(dropout * users)))
    rng = np.random.default_rng(seed)
    words: dict[int, np.ndarray] = {}
    server_s: dict[str, float] = {}
    client_s: dict[str, list[float]] = {}
    quantize_s: list[float] = []
    req_bytes: dict[str, list[int]] = {}
    rep_bytes: dict[str, list[int]] = {}
    silent: set[int] = set()
    while server.stage not in (DONE, ABORTED):
        stage = server.stage
        if stage == Stage.COLLECT_MASKED_VECTORS:
            silent |= dropped
        started = time.perf_counter()
        requests = server.requests()
        server_s[stage] = time.perf_counter() - started
        replies: dict[int, Any] = {}
        times = client_s.setdefault(stage, [])
        for u, request in requests.items():
            if u in silent:
                continue
            vector = None
            started = time.perf_counter()
            if stage == Stage.COLLECT_MASKED_VECTORS:
                update = pool[u % len(pool)].astype(np.float64)
                vector = encode_update(q, update, clip_norm=CLIP_NORM, zero_threshold=None, rng=rng)
                quantize_s.append(time.perf_counter() - started)
                words[u] = vector
            replies[u] = clients[u].handle(request, vector)
            times.append(time.perf_counter() - started)
            if len(req_bytes.get(stage, ())) < sample:
                req_bytes.setdefault(stage, []).append(payload_bytes(request))
                rep_bytes.setdefault(stage, []).append(payload_bytes(replies[u]))
        started = time.perf_counter()
        try:
            server.receive(replies)
        except SecAggAbort:
            raise _Aborted(sum(server_s.values()) + time.perf_counter() - started) from None
        server_s[stage] += time.perf_counter() - started
    assert server.stage == DONE and server.result is not None
    contributors = server.contributors
    assert contributors == frozenset(nodes) - dropped, "the survivors are not the users that sent vectors"
    started = time.perf_counter()
    decoded = decode_sum(q, server.result)
    privatizer = None
    if privatize_layout is not None:
        privatizer = RoundPrivatizer(make_plan(users), privatize_layout, dtype=torch.float32, seed=b"b" * 32)
        privatizer.privatize_sum(0, server.result, contributors, quantization=q)  # noised, then decoded
    server_s["decode+privatize"] = time.perf_counter() - started
    plain = decode_sum(q, mod_sum((words[u] for u in sorted(contributors)), q.length, q.bits)).vector
    pairs = sum(len(server.neighbours[d] & contributors) for d in dropped)
    return {"server_s": server_s, "client_s": {s: statistics.median(v) for s, v in client_s.items() if v},
            "quantize_s": statistics.median(quantize_s), "req_bytes": {s: statistics.median(v) for s, v in req_bytes.items()},
            "rep_bytes": {s: statistics.median(v) for s, v in rep_bytes.items()},
            "sum_equal": bool(np.array_equal(decoded.vector, plain)), "sum": decoded.vector,
            "contributors": sorted(contributors), "survivors": len(contributors),
            "dropped": len(dropped), "dropped_pairs": pairs, "stages": list(server_s),
            "degree": server.params.degree, "threshold": server.params.threshold,
            "held_bytes": len(contributors) * q.length * np.dtype(np.uint64).itemsize}


def abort_probability(users: int, dropout: float, trials: int, seed: int = 0,
                      params: SecAggParams | None = None) -> float:
    """Monte Carlo: the chance that a round of ``users`` with ``dropout`` of them (uniformly drawn)
    silent from the collect stage on aborts, by ``SecAggServer``'s rule at collect: some owner of
    a secret needed at unmask (every user that shared keys) keeps fewer than t holders among itself
    and its neighbours that sent their vectors (k and t of ``params`` for this cohort)."""
    p = (params or secagg_params()).for_cohort(users)
    rng = random.Random(seed)
    nodes = list(range(users))
    aborted = 0
    for _ in range(trials):
        graph = harary_graph(nodes, p.degree, rng)
        alive = set(nodes) - set(rng.sample(nodes, round(dropout * users)))
        if len(alive) < p.threshold or any(len((graph[u] | {u}) & alive) < p.threshold for u in nodes):
            aborted += 1
    return aborted / trials


def mask_cost(length: int, repeats: int = 3) -> float:
    """Seconds to expand one mask of ``length`` words and take it off a sum (unmask's unit of work)."""
    total = np.zeros(length, dtype=np.uint64)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        total = mod_sub(total, expand_mask(os.urandom(32), length, BITS, SELF_MASK), BITS)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def short_round(users: int, dropout: float, short: int, seed: int, params: SecAggParams | None = None,
                enrolled: bool = False) -> dict[str, Any]:
    """Step (a) of a simulated cell: the whole protocol for real on ``short``-word vectors (it does
    not depend on the model, so one serves every model of a run)."""
    return secure_round(short, make_pool(short, 8, seed), users, dropout, seed=seed, params=params, enrolled=enrolled)


def simulated_round(layout: Layout, full: dict[str, Any], per_mask_s: float, a: dict[str, Any],
                    seed: int) -> dict[str, Any]:
    """A round estimated from (a) ``a``, a real round of the same users on short vectors, (b)
    ``full``, a real (k + 1)-user round at the full dimension (the same k), and (c) the per-vector
    and per-mask costs at the full dimension."""
    dim, users = flat_size(layout), a["survivors"] + a["dropped"]
    if full["degree"] != a["degree"]:
        raise ValueError(f"the full-dimension round has k = {full['degree']}, the short round k = {a['degree']}")
    per_vector_s = full["server_s"][Stage.COLLECT_MASKED_VECTORS] / full["survivors"]
    server_s = dict(a["server_s"])
    server_s[Stage.COLLECT_MASKED_VECTORS] += a["survivors"] * per_vector_s
    server_s[Stage.UNMASK] += (a["survivors"] + a["dropped_pairs"]) * per_mask_s
    # decode + privatize at the full dimension, for real (any modular sum costs the same)
    q = quantization(dim)
    started = time.perf_counter()
    residues = np.random.default_rng(seed).integers(0, 2**BITS, q.length, dtype=np.uint64)
    RoundPrivatizer(make_plan(users), layout, dtype=torch.float32, seed=b"b" * 32).privatize_sum(
        0, residues, range(a["survivors"]), quantization=q)
    server_s["decode+privatize"] = time.perf_counter() - started
    client_s = dict(a["client_s"])
    client_s[Stage.COLLECT_MASKED_VECTORS] = full["client_s"][Stage.COLLECT_MASKED_VECTORS]
    rep_bytes = dict(a["rep_bytes"])
    rep_bytes[Stage.COLLECT_MASKED_VECTORS] = full["rep_bytes"][Stage.COLLECT_MASKED_VECTORS]
    return {**a, "server_s": server_s, "client_s": client_s, "quantize_s": full["quantize_s"],
            "rep_bytes": rep_bytes, "per_vector_s": per_vector_s, "per_mask_s": per_mask_s,
            "held_bytes": a["survivors"] * q.length * np.dtype(np.uint64).itemsize}


# ---- Flower legacy ------------------------------------------------------------------------------
def flower_round(layout: Layout, pool: list[np.ndarray], users: int, params: SecAggParams | None = None) -> dict[str, Any]:
    """One round of Flower's legacy SecAgg+ with client-side fixed clipping, in process, with
    fedmf's k + 1 shares and threshold t for this cohort (Flower needs t < shares ≤ users: at most
    ``users`` shares, t at most shares − 1)."""
    import logging

    from flwr.app import Context
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import fixedclipping_mod, secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.server import ServerConfig
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from server.local_grid import LocalGrid, client_node

    logging.getLogger("flwr").setLevel(logging.WARNING)
    shapes = list(layout.values())
    current = [np.zeros(s, np.float32) for s in shapes]
    splits = np.cumsum([math.prod(s) for s in shapes])[:-1]

    class Client(NumPyClient):
        def __init__(self, i: int) -> None:
            self.i = i

        def fit(self, parameters, config):
            parts = np.split(pool[self.i % len(pool)], splits)
            return [p + d.reshape(p.shape) for p, d in zip(parameters, parts)], 10, {}

    app = ClientApp(client_fn=lambda context: Client(int(context.node_config["partition-id"])).to_client(),
                    mods=[secaggplus_mod, fixedclipping_mod])
    stats = {"client_s": {}, "serde_s": 0.0, "down": {}, "up": {}}

    def wire(i: int):
        inner = client_node(app, {"partition-id": i}, 1000 + i)

        def node(message):
            started = time.perf_counter()
            data = message_to_proto(message).SerializeToString()
            copy = message_from_proto(ProtoMessage.FromString(data))
            stage = str(copy.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE, "other"))
            stats["serde_s"] += time.perf_counter() - started
            started = time.perf_counter()
            reply = inner(copy)
            stats["client_s"].setdefault(stage, []).append(time.perf_counter() - started)
            started = time.perf_counter()
            out = message_to_proto(reply).SerializeToString()
            stats["down"].setdefault(stage, []).append(len(data))
            stats["up"].setdefault(stage, []).append(len(out))
            back = message_from_proto(ProtoMessage.FromString(out))
            stats["serde_s"] += time.perf_counter() - started
            return back
        return node

    grid = LocalGrid({1000 + i: wire(i) for i in range(users)})
    grid.set_run(types.SimpleNamespace(run_id=1))
    inner = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=users, min_available_clients=users,
                   initial_parameters=ndarrays_to_parameters(current))
    strategy = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=1.0, clipping_norm=CLIP_NORM,
                                                          num_sampled_clients=users)


    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    shares, threshold = flower_graph(users, params)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold))
    started = time.perf_counter()
    workflow(grid, context)
    total = time.perf_counter() - started
    client_total = sum(sum(v) for v in stats["client_s"].values())
    return {"total_s": total, "client_s_per_client": client_total / users,
            "server_s": total - client_total - stats["serde_s"], "serde_s": stats["serde_s"],
            "client_s": {s: statistics.median(v) for s, v in stats["client_s"].items()},
            "down": {s: statistics.median(v) for s, v in stats["down"].items()},
            "up": {s: statistics.median(v) for s, v in stats["up"].items()},
            "ok": Stage.COLLECT_MASKED_VECTORS in stats["client_s"]}


def flower_graph(users: int, params: SecAggParams | None = None) -> tuple[int, int]:
    """Flower's shares and threshold matching fedmf's k and t for a cohort of ``users``."""
    p = (params or secagg_params()).for_cohort(users)
    shares = min(p.degree + 1, users)
    return shares, min(p.threshold, shares - 1)


# ---- the run ------------------------------------------------------------------------------------
def run(models: list[str], users: list[int], dropouts: list[float], repeats: int, flower_users: list[int],
        real_limit_gb: float, short: int, pool_size: int, flower_limit: float = 1e8, abort_trials: int = 2000,
        params: SecAggParams | None = None, full_repeats: int | None = None, signing_users: tuple[int, ...] = (),
        log=print) -> dict[str, Any]:
    params = params or secagg_params()
    full_repeats = full_repeats or repeats
    results: dict[str, Any] = {"cells": [], "flower": [], "full": {}, "signing": []}
    shorts: dict[tuple[int, float, int], dict[str, Any]] = {}

    def short_for(n: int, dropout: float, r: int) -> dict[str, Any]:
        if (n, dropout, r) not in shorts:
            shorts[(n, dropout, r)] = short_round(n, dropout, short, seed=r, params=params)
        return shorts[(n, dropout, r)]

    for model in models:
        layout = model_layout(model)
        dim = flat_size(layout)
        pool = make_pool(dim, pool_size, seed=7)
        log(f"# {model}: {dim:,} parameters")
        fulls: dict[int, tuple[dict[str, Any], float]] = {}

        def full_for(k: int, fulls: dict = fulls, model: str = model, layout: Layout = layout, dim: int = dim,
                     pool: list[np.ndarray] = pool) -> tuple[dict[str, Any], float]:
            """Step (b) for degree k: a real (k + 1)-user round at the full dimension, and (c)'s per-mask cost."""
            if k not in fulls:
                runs = [secure_round(dim, pool, k + 1, 0.0, seed=100 + r, privatize_layout=layout, params=params)
                        for r in range(full_repeats)]
                assert all(f["sum_equal"] and f["degree"] == k for f in runs)
                full = {**{key: v for key, v in runs[0].items() if key != "sum"},
                        "server_s": _median_dicts([f["server_s"] for f in runs]),
                        "client_s": _median_dicts([f["client_s"] for f in runs]),
                        "quantize_s": statistics.median(f["quantize_s"] for f in runs)}
                fulls[k] = (full, mask_cost(quantization(dim).length))
                results["full"][f"{model} k={k}"] = {"k+1 round": full, "per_mask_s": fulls[k][1]}
                log(f"#   ({k}+1)-user round at full dimension: client collect "
                    f"{full['client_s'][Stage.COLLECT_MASKED_VECTORS]:.3f} s, per mask {fulls[k][1]:.4f} s")
            return fulls[k]

        for n in users:
            central = [central_round(layout, pool, n) for _ in range(repeats)]
            cohort = params.for_cohort(n)
            k, t = cohort.degree, cohort.threshold
            for dropout in dropouts:
                real = n * quantization(dim).length * 8 * 2 <= real_limit_gb * 2**30
                started = time.perf_counter()
                cell = {"model": model, "dim": dim, "users": n, "dropout": dropout, "degree": k, "threshold": t,
                        "exposure": exposure(min(k, n - 1), t), "central": _median_dicts(central),
                        "dropped": round(dropout * n),
                        "abort_probability": abort_probability(n, dropout, abort_trials, params=params) if dropout else 0.0}
                if cell["abort_probability"] == 1.0:  # every draw aborts (t = n: no dropout tolerated)
                    cell["how"] = "aborts always"
                    results["cells"].append(cell)
                    log(f"#   n={n} dropout={dropout:g}: k={k} t={t}: every attempt aborts, not run")
                    continue
                rows = []
                for r in range(repeats):
                    if real:
                        rows.append(secure_round(dim, pool, n, dropout, seed=r, privatize_layout=layout, params=params))
                    else:
                        full, per_mask_s = full_for(k)
                        rows.append(simulated_round(layout, full, per_mask_s, short_for(n, dropout, r), seed=r))
                    assert rows[-1]["sum_equal"], "the secure sum differs from the plain sum of quantized words"
                cell.update({"how": "real" if real else "simulated",
                             "server_s": _median_dicts([r["server_s"] for r in rows]),
                             "client_s": _median_dicts([r["client_s"] for r in rows]),
                             "quantize_s": statistics.median(r["quantize_s"] for r in rows),
                             "req_bytes": rows[0]["req_bytes"], "rep_bytes": rows[0]["rep_bytes"],
                             "dropped_pairs": rows[0]["dropped_pairs"], "held_bytes": rows[0]["held_bytes"],
                             "aborts": sum(r["aborts"] for r in rows),
                             "server_totals": [sum(r["server_s"].values()) for r in rows]})
                cell["server_total_s"] = statistics.median(cell["server_totals"])
                if real and n > k + 1:  # the simulation's estimate of the same cell, to check it
                    full, per_mask_s = full_for(k)
                    estimates = [sum(simulated_round(layout, full, per_mask_s, short_for(n, dropout, r),
                                                     seed=r)["server_s"].values()) for r in range(repeats)]
                    cell["simulated_estimate_s"] = statistics.median(estimates)
                results["cells"].append(cell)
                log(f"#   n={n} dropout={dropout:g} k={k} t={t} ({cell['how']}): central {cell['central']['server_s']:.3f} s, "
                    f"secure {cell['server_total_s']:.3f} s (per repeat "
                    f"{', '.join(f'{x:.2f}' for x in cell['server_totals'])}; {cell['aborts']} aborted attempts redone, "
                    f"P(abort) {cell['abort_probability']:.3f}); cell took {time.perf_counter() - started:.0f} s")
        for n in flower_users:
            started = time.perf_counter()
            if n * dim > flower_limit:
                results["flower"].append({"model": model, "users": n, "error": f"not run: n × d = {n * dim:,} is "
                                          f"above --flower-limit {flower_limit:,.0f} (time)"})
                continue
            shares, threshold = flower_graph(n, params)
            try:
                rows = [flower_round(layout, pool, n, params) for _ in range(repeats)]
                cell = {"model": model, "users": n, "shares": shares, "threshold": threshold,
                        "total_s": statistics.median(r["total_s"] for r in rows),
                        "server_s": statistics.median(r["server_s"] for r in rows),
                        "client_s_per_client": statistics.median(r["client_s_per_client"] for r in rows),
                        "client_s": _median_dicts([r["client_s"] for r in rows]),
                        "down": rows[0]["down"], "up": rows[0]["up"], "ok": all(r["ok"] for r in rows)}
            except Exception as e:  # report why Flower's legacy path could not run here
                cell = {"model": model, "users": n, "error": f"{type(e).__name__}: {e}"[:300]}
            results["flower"].append(cell)
            log(f"#   Flower legacy n={n} ({shares} shares, t={threshold}): {cell.get('total_s', cell.get('error'))} "
                f"(took {time.perf_counter() - started:.0f} s)")
    for n in signing_users:  # enrolled against ephemeral signing keys: the protocol on short vectors
        started = time.perf_counter()
        for enrolled in (False, True):
            rows = [short_round(n, 0.0, short, seed=50 + r, params=params, enrolled=enrolled) for r in range(repeats)]
            results["signing"].append({"users": n, "enrolled": enrolled, "degree": rows[0]["degree"],
                                       "server_s": _median_dicts([r["server_s"] for r in rows]),
                                       "client_s": _median_dicts([r["client_s"] for r in rows])})
        log(f"#   signing keys, enrolled and ephemeral, n={n} (took {time.perf_counter() - started:.0f} s)")
    return results


def _median_dicts(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# ---- report -------------------------------------------------------------------------------------
SHORT = {Stage.SETUP: "setup", Stage.SHARE_KEYS: "share keys", Stage.COLLECT_MASKED_VECTORS: "collect",
         CONSISTENCY_CHECK: "consistency", Stage.UNMASK: "unmask"}


def _name(stage: str) -> str:
    return SHORT.get(stage, stage)


def tables(results: dict[str, Any]) -> str:
    out = ["| model | n | k, t | dropped | how | central server s | secure server s | secure ÷ central | "
           "secure client s (excl. training) | central bytes up / down per client | secure bytes up / down per client "
           "(model down incl.) | bytes secure ÷ central | simulation's estimate of a real cell, s | "
           "aborted attempts redone (all repeats) | P(abort) | server holds (survivors' words) |", "|" + "---|" * 16]
    for c in results["cells"]:
        cen = c["central"]
        head = f"| {c['model']} | {c['users']} | {c['degree']}, {c['threshold']} | {c['dropped']} | {c['how']} | "
        if c["how"] == "aborts always":
            out.append(head + f"{cen['server_s']:.3f} | | | | | | | | | | {c['abort_probability']:.3f} | |")
            continue
        up, down = sum(c["rep_bytes"].values()), sum(c["req_bytes"].values()) + cen["down_bytes"]
        estimate = f"{c['simulated_estimate_s']:.3f}" if "simulated_estimate_s" in c else ""
        out.append(head + f"{cen['server_s']:.3f} | "
                   f"{c['server_total_s']:.3f} | {c['server_total_s'] / cen['server_s']:.1f}x | "
                   f"{sum(c['client_s'].values()):.3f} | {_mb(cen['up_bytes'])} / {_mb(cen['down_bytes'])} | "
                   f"{_mb(up)} / {_mb(down)} | {(up + down) / (cen['up_bytes'] + cen['down_bytes']):.2f}x | {estimate} | "
                   f"{c['aborts']} | {c['abort_probability']:.3f} | {c['held_bytes'] / 2**30:.2f} GiB |")
    ran = [c for c in results["cells"] if "server_s" in c]
    if ran:
        stages = [s for s in ran[0]["server_s"] if s != "decode+privatize"]
        out += ["", "Per stage (server s | client median | bytes request / reply per client, payload only):", "",
                "| model | n | dropped | " + " | ".join(_name(s) for s in stages) + " | decode+privatize |",
                "|" + "---|" * (len(stages) + 4)]
        for c in ran:
            cells = []
            for stage in stages:
                extra = f" (q {c['quantize_s']:.3f})" if stage == Stage.COLLECT_MASKED_VECTORS else ""
                cells.append(f"{c['server_s'][stage]:.3f} \\| {_ms(c['client_s'][stage])}{extra} \\| "
                             f"{_kb(c['req_bytes'][stage])} / {_kb(c['rep_bytes'][stage])}")
            cells.append(f"{c['server_s']['decode+privatize']:.3f}")
            out.append(f"| {c['model']} | {c['users']} | {c['dropped']} | " + " | ".join(cells) + " |")
    if results["signing"]:
        stages = list(results["signing"][0]["server_s"])
        out += ["", "Signing keys (short vectors; server s | client median per stage):", "",
                "| n | k | keys | " + " | ".join(_name(s) for s in stages) + " |", "|" + "---|" * (len(stages) + 3)]
        for g in results["signing"]:
            out.append(f"| {g['users']} | {g['degree']} | {'enrolled' if g['enrolled'] else 'ephemeral'} | " + " | ".join(
                f"{g['server_s'][s]:.3f} \\| {_ms(g['client_s'].get(s, 0.0))}" for s in stages) + " |")
    if results["flower"]:
        out += ["", "| model | n | shares, t | Flower round s | server s | client s per client | bytes down / up per client |",
                "|" + "---|" * 7]
        for f in results["flower"]:
            if "error" in f:
                out.append(f"| {f['model']} | {f['users']} | | could not run: {f['error']} | | | |")
                continue
            out.append(f"| {f['model']} | {f['users']} | {f['shares']}, {f['threshold']} | {f['total_s']:.3f} | "
                       f"{f['server_s']:.3f} | {f['client_s_per_client']:.3f} | "
                       f"{_kb(sum(f['down'].values()))} / {_kb(sum(f['up'].values()))} |")
    return "\n".join(out)


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def _kb(x: float) -> str:
    return f"{x / 1e3:.1f} kB" if x < 1e6 else f"{x / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--models", nargs="+", default=["so-small", "paper"], choices=["so-small", "paper", "quick"])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1],
                        help="fractions of users silent from the collect stage on (default 0 and 0.1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flower-users", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--flower-limit", type=float, default=1e8,
                        help="run Flower's round only where users × parameters is at most this (time)")
    parser.add_argument("--real-limit-gb", type=float, default=3.0,
                        help="a cell is run for real when the masked vectors it holds (x2) fit in this")
    parser.add_argument("--short", type=int, default=256, help="words per vector of a simulated cell's round (a)")
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--abort-trials", type=int, default=2000,
                        help="Monte Carlo trials of the chance that a round with dropouts aborts")
    parser.add_argument("--degree", type=int, default=0, help="SecAgg+ k (0, with --threshold 0: derived per cohort)")
    parser.add_argument("--threshold", type=int, default=0, help="SecAgg+ t (0, with --degree 0: derived per cohort)")
    parser.add_argument("--full-repeats", type=int, default=None,
                        help="repeats of a simulated cell's full-dimension (k + 1)-user round (default --repeats)")
    parser.add_argument("--signing-users", type=int, nargs="*", default=[100],
                        help="cohorts at which enrolled and ephemeral signing keys are compared (short vectors)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 6, 12 and 16 users (16 simulated): seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_HOME", tempfile.mkdtemp(prefix="fedmf-bench-flwr-"))
    torch.set_num_threads(args.threads)
    if args.quick:
        args.models, args.users, args.repeats, args.flower_users = ["quick"], [6, 12, 16], 1, [6]
        args.signing_users = [12]
        args.real_limit_gb = 14 * 3432 * 16 / 2**30  # 6 and 12 users real, 16 simulated
    import flwr

    load = os.getloadavg()
    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, flwr {flwr.__version__}, python {platform.python_version()}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; SecAgg+ k={args.degree or 'derived'} t={args.threshold or 'derived'} "
          f"bits={BITS} scale={SCALE:g}",
          flush=True)
    started = time.perf_counter()
    results = run(args.models, args.users, args.dropouts, args.repeats, args.flower_users, args.real_limit_gb,
                  args.short, args.pool, args.flower_limit, args.abort_trials, params=secagg_params(args.degree, args.threshold),
                  full_repeats=args.full_repeats, signing_users=tuple(args.signing_users),
                  log=lambda s: print(s, flush=True))
    load = os.getloadavg()
    print(f"# took {time.perf_counter() - started:.0f} s; load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(tables(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
