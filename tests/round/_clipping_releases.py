"""A few rounds of ``RoundPrivatizer`` under each clipping policy, hashed: every released tensor,
every report field and the checkpoint state's clip entry, bit for bit. Uses the privatizer's public
API only, so the same function runs on any commit's tree (tests/round/test_clipping_policy.py compares it
with digests recorded at the commit before the clipping policies existed)."""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from typing import Any

import torch

from fedmf import MinSep, Workload
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.privatize import RoundPrivatizer

SEED = b"clipping-policy-bit-identity"
LAYOUT = {"w": (300,), "b": (7,)}
ROUNDS, M = 8, 5


def plan(adaptive: bool, metrics: bool) -> RunPlan:
    schema = MinSep(2, ROUNDS)
    mech = build("bsr", ROUNDS, schema, Workload(), num_bands=3)
    return RunPlan.create(
        mech, schema, clip_norm=0.8, delta=1e-5, expected_users=M, noise_multiplier=1.1,
        adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=M) if adaptive else None,
        client_metrics=ClientMetricRelease.create(3.0, 0.75, expected_users=M) if metrics else None)


def _vector(t: int, i: int, norm: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + i)
    v = torch.randn(307, generator=g, dtype=torch.float64)
    v = v / torch.linalg.vector_norm(v) * norm
    return {"w": v[:300].to(dtype), "b": v[300:].to(dtype)}


def updates(t: int, zeta: float, dtype: torch.dtype) -> dict[str, Any]:
    """Round t's updates: unclipped, clipped, one at exactly ζ, one zeroed (huge ℓ∞), one not selected,
    one not finite."""
    out = {f"u{i}": _vector(t, i, factor * zeta, dtype) for i, factor in enumerate((0.3, 0.9, 1.7, 4.0))}
    out["u4"] = _vector(t, 4, zeta, dtype)
    zeroed = _vector(t, 5, 0.5 * zeta, dtype)
    zeroed["w"][t % 300] = 500.0 * zeta
    out["u5"] = zeroed
    out["stranger"] = _vector(t, 6, 0.1, dtype)
    bad = _vector(t, 7, 0.1, dtype)
    bad["b"][0] = math.nan
    out["u7"] = bad
    return out


def _hex(x: float | None) -> str:
    return "-" if x is None else float(x).hex()


def _fake_token_bytes():
    counter = iter(range(10**6))
    return lambda n=32: hashlib.sha256(b"salt-%d" % next(counter)).digest()[:n]


def digest(adaptive: bool, *, dtype: torch.dtype = torch.float32, salted: bool = False,
           metrics: bool = False) -> str:
    """SHA-256 of ROUNDS rounds, a checkpoint after round 4 and a resumed privatizer's rounds 5…7
    (its outputs too). ``salted``: salts from a deterministic stand-in for ``secrets.token_bytes``."""
    the_plan = plan(adaptive, metrics)
    h = hashlib.sha256()
    real = secrets.token_bytes
    if salted:
        secrets.token_bytes = _fake_token_bytes()
    try:
        first = RoundPrivatizer(the_plan, LAYOUT, dtype=dtype, seed=SEED, repeatable_noise=not salted)
        state = None
        for t in range(ROUNDS):
            _round(h, first, t, dtype)
            if t == 4:
                state = first.state_dict()
                h.update(repr(sorted(state)).encode())
                h.update(repr(state.get("adaptive_clipping")).encode())
        second = RoundPrivatizer(the_plan, LAYOUT, dtype=dtype, seed=SEED, repeatable_noise=not salted)
        second.load_state_dict(state)
        for t in range(5, ROUNDS):
            _round(h, second, t, dtype)
    finally:
        secrets.token_bytes = real
    return h.hexdigest()


def _round(h, privatizer: RoundPrivatizer, t: int, dtype: torch.dtype) -> None:
    zeta = privatizer.clip_norm
    batch = updates(t, zeta, dtype)
    values = {user: 0.7 * i - 0.5 for i, user in enumerate(sorted(batch))}
    values["u3"] = math.inf
    mean, report = privatizer.privatize(t, batch, selected=[u for u in batch if u != "stranger"], values=values)
    for name in LAYOUT:
        h.update(name.encode())
        h.update(mean[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(struct.pack("<q", report.round))
    h.update(" ".join(_hex(x) for x in (zeta, report.noise_std, report.expected_users, report.clip_norm,
                                         report.noisy_unclipped, report.noisy_client_metric)).encode())
    for u in report.users:
        h.update(repr((str(u.user), u.status, u.reason, _hex(u.norm), u.clipped, u.zeroed)).encode())
    h.update(_hex(privatizer.clip_norm).encode())
