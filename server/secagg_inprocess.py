"""SecAgg+ in process: ``fedmf simulate --secure-aggregation`` with ``--backend inprocess``.

The engine finds this module through the ``fedmf.secure_aggregation`` entry point ``secaggplus``
(pyproject.toml), as it finds ``--backend flower``: it imports no adapter. ``secaggplus(params,
plan, dim, population)`` checks the run (the planned cohort at least the threshold, no wrap for the
whole population: ``server.secagg_round.run_quantization``) and returns the cohort's secure sum,
``SecureCohort``, which ``fedmf.run.federated`` calls each round with the users' local results.

Each round plays the protocol between the real state machines, ``SecAggServer`` (``server/secagg.py``)
and one ``SecAggClient`` (``client/secagg.py``) per reachable user, looping over the server's
requests until it holds the sum, so a new stage needs no change here. At the collect stage each
client's words are what the Flower ClientApp sends (``fedmf.secagg.encode.encode_local_update``:
checked, ℓ∞-zeroed, clipped to ζₜ, quantized, adaptive clipping's bit and the private client
metric's word inside the masked vector). A user whose local update is missing drops out at the
collect stage; one whose update is refused drops out there too and is recorded as rejected. The
unmasked modular sum is handed, not decoded, in a ``SecureSum`` to ``PrivateRun.aggregate``, which
noises it before centring it. A cohort below max(2, t)
runs no protocol (the zero sum, every user dropped), as ``server/secagg_round.py``; survivors
below the threshold raise ``SecAggAbort`` (the round is aborted, nothing released).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from client.secagg import SecAggClient
from fedmf.secagg.encode import encode_local_update
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import Quantization
from fedmf.secagg.secure_sum import SecureSum

from .secagg import SecAggServer
from .secagg_round import run_quantization

if TYPE_CHECKING:
    from fedmf.plan import RunPlan
    from fedmf.run.private_run import PrivateRun
    from fedmf.schedule import Selection

__all__ = ["secaggplus", "SecureCohort"]


class SecureCohort:
    """One run's in-process SecAgg+ rounds of ``quantization``-encoded updates."""

    def __init__(self, params: SecAggParams, quantization: Quantization) -> None:
        if quantization.bits != params.bits or quantization.scale != params.scale:
            raise SecAggError("the quantization's bits and scale must be the SecAgg+ parameters'")
        self.params, self.quantization = params, quantization
        #: the last round's protocol (None: no protocol ran), for tests and diagnostics
        self.server: SecAggServer | None = None
        self._rng = np.random.default_rng()  # the clients' randomized rounding (never the noise's)

    def __call__(self, run: PrivateRun, selection: Selection, updates: Mapping[Hashable, Any],
                 values: Mapping[Hashable, Any]) -> SecureSum:
        """The decoded secure sum of ``selection``'s reachable users, each with its local update in
        ``updates`` (absent: it drops out at the collect stage) and its reported value in ``values``."""
        q, privatizer = self.quantization, run.privatizer
        users = sorted(selection.reachable, key=str)
        self.server = None
        if len(users) < max(2, self.params.threshold):  # no SecAgg+ protects so few: all dropped
            return SecureSum.empty(q)
        user_of = {node: user for node, user in enumerate(users, start=1)}
        words: dict[int, np.ndarray] = {}
        refused: dict[Hashable, str] = {}
        for node, user in user_of.items():
            update = updates.get(user)
            if update is None:
                continue
            try:
                words[node] = encode_local_update(q, update, privatizer.layout, clip_norm=privatizer.clip_norm,
                                                  zero_threshold=privatizer.clipping.zero_threshold, rng=self._rng,
                                                  metric=values.get(user))
            except SecAggError as e:  # the ClientApp would answer the collect stage with an error
                refused[user] = str(e)
        # every signature binds the run and the round (one process plays both ends: no enrollment)
        bound = {"run": str(run.run_id), "round_": int(selection.round)}
        self.server = server = SecAggServer(self.params, q.length, sorted(user_of), **bound)
        clients = {node: SecAggClient(node, **bound) for node in user_of}
        silent: set[int] = set()
        while server.result is None:  # every stage the server asks for, until it holds the sum
            replies: dict[int, object] = {}
            for node, request in server.requests().items():
                collect = request.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
                if collect and node not in words:
                    silent.add(node)  # no update: silent from the collect stage on
                if node in silent:
                    continue
                replies[node] = clients[node].handle(request, words[node] if collect else None)
            server.receive(replies)  # raises SecAggAbort below the threshold
        for node, reason in server.rejected.items():
            refused.setdefault(user_of[node], reason)
        contributors = frozenset(user_of[node] for node in server.contributors)
        rejected = {user: reason for user, reason in refused.items() if user not in contributors}
        return SecureSum(server.result, q, contributors, rejected)  # residues: decoded only when noised


def secaggplus(params: SecAggParams, plan: RunPlan, dim: int, population: int) -> SecureCohort:
    """The run's in-process SecAgg+ (the ``fedmf.secure_aggregation`` entry point ``secaggplus``);
    a one-line refusal, before the run opens, of a planned cohort below the threshold or a
    population whose sum could wrap."""
    if not isinstance(params, SecAggParams):
        raise SecAggError(f"params must be SecAggParams, got {type(params).__name__}")
    return SecureCohort(params, run_quantization(params, plan, dim, population))

