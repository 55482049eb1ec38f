"""One round's secure sum over the Grid: SecAgg+ (``server/secagg.py``) with the Message API.

    total = SecureRound(params, quantization, layout).run(grid, expected, config, arrays, collect_timeout)

The stages (``STAGES``) are Flower's four with ``CONSISTENCY_CHECK`` before unmask; the round's
run nonce and round number go into every statement the clients sign. Each stage is one TRAIN
message per node still in the protocol — ``{"config": the round's TRAIN
config and the encoding's parameters, "secagg": the stage's payload}``, the collect stage's also
``{"arrays": the committed model}`` — sent with ``grid.send_and_receive`` under the stage timeout
(the collect stage, where clients train, at least the round's reply timeout). A reply is read only
from a node that was asked, that echoes the round, the run nonce and its user, and that is not an
error; everything else about it is checked by the state machine. A node that is silent, errs or is
refused at a stage has dropped out: SecAgg+ removes its masks from the survivors' sum from the
shares of t neighbours — except at the consistency check, where a survivor that does not sign
the survivor set aborts the attempt (its seed share is revealed only with its signature). Below
the threshold ``SecAggAbort`` propagates: the strategy aborts the
round (nothing of it was noised or released) and redoes it with fresh noise, leaving out the
clients whose shares proved them at fault (``SecAggServer.culprits``). A cohort below the
threshold from the start (a small amplified draw) runs no protocol: its users count as dropped and
the round releases the zero sum plus its noise, like an empty draw.

The unmasked modular sum W is handed, *not decoded*, in a ``SecureSum`` to ``PrivateRun.aggregate``:
the residues of the contributors' quantized, clipped updates (and of the unclipped bits and the
metric words), the quantization (scale, modulus, its inflation, which scales σ: ζ_eff = ζ·inflation),
who contributed, who was refused and why. The privatizer adds the noise to W before centring it
(``fedmf.secagg.quantize.noisy_centred``; REVIEW-i36-privacy-path HIGH-1).
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.serverapp import Grid

from fedmf.errors import ConfigError
from fedmf.secagg.encode import quantization_for
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.messages import CONSISTENCY_CHECK, SECAGG_RECORD, from_wire, to_wire
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import Quantization, check_no_wrap
from fedmf.secagg.secure_sum import SecureSum

from .secagg import SecAggServer

if TYPE_CHECKING:
    from fedmf.plan import RunPlan

__all__ = ["SecureRound", "STAGES", "run_quantization"]

log = logging.getLogger("fedmf.server")
STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, CONSISTENCY_CHECK, Stage.UNMASK)
_MAX_REASON = 200


def run_quantization(params: SecAggParams, plan: RunPlan, dim: int, population: int | None = None) -> Quantization:
    """The run's encoding of a ``dim``-value update (``fedmf.secagg.encode.quantization_for``);
    refused (one line, before the run opens) when the planned cohort is below the threshold or a
    cohort of the whole ``population`` plus the release's noise could wrap the modular sum: the noise
    is added to the residues before they are centred, so each word keeps a 12σ margin
    (``fedmf.secagg.quantize.NOISE_MARGIN_SIGMAS``) for its noise's per-coordinate std, σ·max_t ‖(C⁻¹)ₜ‖₂
    for the correlated noise (round t's coordinate is σ·Σⱼ (C⁻¹)ₜⱼ·zⱼ), σ_b for the count, σ_m for the metric."""
    if plan.expected_users < params.threshold:
        raise ConfigError(f"clients-per-round {plan.expected_users:g} is below the secure-aggregation threshold "
                          f"{params.threshold}: every round would abort")
    q = quantization_for(plan, dim, scale=params.scale, bits=params.bits, beta=params.beta)
    if population is not None:
        # σ per coordinate of the vector's noise, in the quantization's units (ζ-clipped or normalized)
        coef = plan.mechanism.inverse_toeplitz  # Toeplitz C⁻¹: its last row has the largest norm
        row = (float(np.linalg.norm(coef[: plan.rounds])) if coef is not None
               else max(float(np.linalg.norm(r)) for r in plan.mechanism.inverse_rows()))
        generator = plan.std_per_clip if q.with_bit else plan.noise_std
        check_no_wrap(population, q.clip_norm, q.scale, q.bits, q.metric_clip,
                      noise_std=generator * q.inflation * row, count_noise_std=plan.count_noise_std or 0.0,
                      metric_noise_std=0.0 if plan.client_metrics is None else plan.client_metrics.noise_std)
    return q


class SecureRound:
    """Runs SecAgg+ rounds of ``quantization``-encoded updates of a model ``layout`` (name → shape)."""

    def __init__(self, params: SecAggParams, quantization: Quantization, layout: Mapping[str, tuple[int, ...]],
                 *, rng: random.Random | None = None) -> None:
        if quantization.bits != params.bits or quantization.scale != params.scale:
            raise SecAggError("the quantization's bits and scale must be the SecAgg+ parameters'")
        if quantization.dim != sum(math.prod(s) for s in layout.values()):
            raise SecAggError("the quantization's dimension must be the layout's")
        self.params, self.quantization = params, quantization
        self.layout_json = json.dumps([[name, list(shape)] for name, shape in layout.items()])
        self.rng = rng
        #: the last round's protocol, for tests and diagnostics
        self.server: SecAggServer | None = None

    def encoding(self, clip_norm: float, zero_threshold: float | None) -> dict[str, Any]:
        """The config entries a client needs to encode its update for a round clipped at ``clip_norm``."""
        entries = {"clip-norm": float(clip_norm), "secagg-scale": float(self.params.scale),
                   "secagg-beta": float(self.params.beta), "secagg-bit": self.quantization.with_bit,
                   "secagg-layout": self.layout_json}
        if zero_threshold is not None:
            entries["zero-threshold"] = float(zero_threshold)
        if self.quantization.metric_clip is not None:  # the client metric travels masked, as the last word
            entries["secagg-metric-clip"] = float(self.quantization.metric_clip)
        return entries

    def run(self, grid: Grid, expected: Mapping[Hashable, int], config: Mapping[str, Any], arrays: ArrayRecord,
            collect_timeout: float, excluded: Mapping[Hashable, str] | None = None) -> SecureSum:
        """The decoded secure sum of the users ``expected`` (user → node) for the round of
        ``config`` (the TRAIN config, with ``round`` and ``run-nonce``, and ``encoding``'s entries).
        ``excluded``: expected users left out of the protocol (user → reason, e.g. named by an
        aborted attempt), returned as rejected. Fewer than max(2, t) users left: the zero sum, all
        of them dropped, nobody asked. Raises ``SecAggAbort`` when the survivors fall below the
        threshold or a committed secret does not reconstruct (``self.server.culprits``)."""
        q = self.quantization
        self.server = None
        excluded = {user: reason for user, reason in (excluded or {}).items() if user in expected}
        user_of = {int(node): user for user, node in expected.items() if user not in excluded}
        if len(user_of) < max(2, self.params.threshold):
            # an empty draw, or one below the threshold (amplified sampling, or users left out): no
            # SecAgg+ can protect so few, so none of them is asked; all count as dropped and the
            # round releases the zero sum plus its noise, as the central mode does for users it
            # cannot hear from (deterministic: a redo would draw the same cohort)
            return SecureSum.empty(q, excluded)
        self.server = server = SecAggServer(self.params, q.length, sorted(user_of), rng=self.rng,
                                            run=str(config["run-nonce"]), round_=int(config["round"]))
        refused: dict[Hashable, str] = {}
        for stage in STAGES:
            requests = server.requests()
            messages = [self._message(stage, node, user_of[node], payload, config, arrays)
                        for node, payload in requests.items()]
            timeout = self.params.stage_timeout_s
            if stage == Stage.COLLECT_MASKED_VECTORS:
                timeout = max(timeout, collect_timeout)
            replies = grid.send_and_receive(messages, timeout=timeout)
            server.receive(self._read(replies, requests, user_of, config, refused))
        for node, reason in server.rejected.items():
            refused.setdefault(user_of[node], reason[:_MAX_REASON])
        assert server.result is not None
        contributors = frozenset(user_of[node] for node in server.contributors)
        rejected = {user: reason for user, reason in {**refused, **excluded}.items() if user not in contributors}
        return SecureSum(server.result, q, contributors, rejected)  # residues: decoded only when noised

    def _message(self, stage: str, node: int, user: Hashable, payload: Mapping[str, Any],
                 config: Mapping[str, Any], arrays: ArrayRecord) -> Message:
        content = RecordDict({"config": ConfigRecord({**config, "user-id": user}),
                              SECAGG_RECORD: ConfigRecord(to_wire(payload))})
        if stage == Stage.COLLECT_MASKED_VECTORS:
            content["arrays"] = arrays
        return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)

    @staticmethod
    def _read(replies: Iterable[Message], requests: Mapping[int, Any], user_of: Mapping[int, Hashable],
              config: Mapping[str, Any], refused: dict[Hashable, str]) -> dict[int, object]:
        """The stage's payloads by node: only from nodes asked, echoing the round, nonce and user."""
        read: dict[int, object] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in requests or node in read:
                continue
            user = user_of[node]
            if reply.has_error():
                refused[user] = f"error reply: {str(reply.error.reason)[:_MAX_REASON]}"
                continue
            records = reply.content.config_records
            echo, record = records.get("config"), records.get(SECAGG_RECORD)
            if echo is None or record is None or echo.get("round") != config["round"] \
                    or echo.get("run-nonce") != config["run-nonce"] or echo.get("user-id") != user:
                refused[user] = "a secure-aggregation reply without the round's config echo or payload"
                continue
            read[node] = from_wire(record, Key.MASKED_PARAMETERS)
        return read
