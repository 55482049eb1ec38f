"""What a client does to its update before masking it, and the run's one ``Quantization``.

The server no longer sees an update, so the checks and the clipping it made move to the client
(ARCHITECTURE.md, "One round"): the update must be finite and of the model's layout; an update
whose ℓ∞ norm exceeds the round's zeroing threshold is replaced by zero ("Multi-Epoch MF"
StackOverflow recipe, as ``fedmf.round.privatize`` does); it is clipped to ℓ2 ≤ ζₜ and
quantized (``fedmf.secagg.quantize``). With adaptive clipping the client encodes Δ/ζₜ clipped to
1 (the mechanism runs on the normalized sum) and appends the bit 1[‖Δ‖ ≤ ζₜ] (0 when zeroed),
inside the masked vector; with the private client-metric release, the reported value clipped to
[0, L] as the last word (``fedmf.secagg.quantize.metric_word``). ``encode_local_update`` is the one
client-side encoding both the Flower ClientApp (``client/secagg_app.py``) and the in-process
secure aggregation (``server/secagg_inprocess.py``) run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..checks import positive
from .errors import SecAggError
from .quantize import Quantization, quantize

if TYPE_CHECKING:
    from ..plan import RunPlan

__all__ = ["quantization_for", "encode_update", "encode_local_update"]


def quantization_for(plan: RunPlan, dim: int, *, scale: float, bits: int, beta: float) -> Quantization:
    """The run's encoding of a ``dim``-value update: clip norm ζ (fixed clipping) or 1 and the bit
    (adaptive clipping: the normalized update)."""
    adaptive = plan.adaptive_clipping is not None
    return Quantization(clip_norm=1.0 if adaptive else plan.clip_norm, scale=scale, bits=bits, dim=dim,
                        beta=beta, with_bit=adaptive,
                        metric_clip=None if plan.client_metrics is None else plan.client_metrics.clip)


def encode_update(q: Quantization, update: np.ndarray, *, clip_norm: float, zero_threshold: float | None,
                  rng: np.random.Generator, metric: object = None) -> np.ndarray:
    """The words a client masks for its flat ``update`` in round t: checked (finite, ``q.dim``
    values), zeroed when ‖·‖∞ > ``zero_threshold``, clipped to ``clip_norm`` = ζₜ along its direction
    as the central path clips (÷ ζₜ after clipping when ``q`` carries the bit), quantized; ``metric``:
    its reported value, when ``q`` carries one."""
    zeta = positive("clip_norm", clip_norm)
    if not q.with_bit and zeta != q.clip_norm:
        raise SecAggError(f"clip norm {zeta} differs from the run's quantization's {q.clip_norm}")
    if not isinstance(update, np.ndarray) or update.shape != (q.dim,) or update.dtype.kind != "f":
        raise SecAggError(f"update must be a floating numpy vector of {q.dim} values")
    x = update.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise SecAggError("update has non-finite values")
    linf = float(np.max(np.abs(x), initial=0.0))
    zeroed = zero_threshold is not None and linf > zero_threshold
    if zeroed:
        x = np.zeros_like(x)
    with np.errstate(over="ignore"):  # squares that overflow give inf: handled below
        norm = float(np.linalg.norm(x))
    unclipped = (not zeroed) and norm <= zeta
    if not unclipped and not zeroed:
        # clipped along its direction as RoundPrivatizer.add does (REVIEW-i36-privacy-path LOW-2): finite
        # values whose squares overflow are first scaled by an exact power of two, 2^-e with ‖x‖∞ < 2^e;
        # a norm that is not finite even so is refused, as the central path rejects it
        power = 2.0 ** -math.frexp(linf)[1]
        y = x * power
        scaled = float(np.linalg.norm(y))  # in [1/2, √d]: ‖x‖ = scaled / power
        if not math.isfinite(scaled / power):
            raise SecAggError("update norm is not finite")
        x = y * (1.0 / scaled)  # clip(Δ, ζₜ)/ζₜ: the unit direction, ÷ ζₜ after clipping
        if not q.with_bit:
            x = x * zeta  # clip(Δ, ζ)
    elif q.with_bit:
        x = x / zeta  # ‖x‖ ≤ ζₜ: no overflow
    return quantize(q, x, rng, unclipped if q.with_bit else None, metric)  # quantize clips again (float excess)


def encode_local_update(q: Quantization, update: Mapping[str, Any], layout: Mapping[str, tuple[int, ...]], *,
                        clip_norm: float, zero_threshold: float | None, rng: np.random.Generator,
                        metric: object = None) -> np.ndarray:
    """A client's words for its local ``update`` (name → tensor): checked against the model
    ``layout`` as the central server checks it (``fedmf.round.privatize.check_update``), flattened
    in the layout's order as float64, then ``encode_update``. A ``SecAggError`` names what is wrong."""
    from ..round.privatize import check_update

    reason = check_update(update, layout)
    if reason is not None:
        raise SecAggError(f"this client's update cannot be summed: {reason}")
    flat = np.concatenate([update[name].detach().to(torch.float64).reshape(-1).cpu().numpy() for name in layout])
    return encode_update(q, flat, clip_norm=clip_norm, zero_threshold=zero_threshold, rng=rng,
                         metric=metric if q.metric_clip is not None else None)
