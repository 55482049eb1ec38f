"""One private round: validate each update, zero huge ℓ∞, clip ℓ2 to ζ, sum, add the round's
correlated noise, divide by the planned expected number of users.

    privatizer = RoundPrivatizer(plan, layout, seed=noise_seed)
    mean, report = privatizer.privatize(t, {user: {name: tensor, …}, …}, selected=users)

The order of operations is the privacy argument ("Multi-Epoch Matrix Factorization
Mechanisms", Sec. 2 and Thm 2.2): every accepted update has ℓ2 norm ≤ ζ after clipping, so
the sum x_t has the planned sensitivity; the noise σ·(C⁻¹Z)_t with σ = z·ζ·sens is drawn only
once the sum is complete and is added exactly once; the result is divided by the *planned*
expected number of users — never by the number received, which would depend on the data.
An update that is invalid (wrong keys, shapes or dtype; not finite), from a user not selected
for the round, or a second one from the same user is rejected and never summed.

What ζ is, the zeroing threshold, the factor each update is summed with, the noise std, the
scaling to the released mean and the extra release that moves ζ come from the plan's clipping policy
(``fedmf.round.clipping``): ``FixedClipping`` (ζ = ``plan.clip_norm``) or ``AdaptiveClipping``
(``plan.adaptive_clipping``; Andrew et al., NeurIPS 2021, Alg. 1: ζₜ fixed before any of round t's
updates is seen, the mechanism run on the normalized sum Σ clip(Δᵢ, ζₜ)/ζₜ, a noisy count of the
unclipped updates released, ζₜ₊₁ from it). Each round draws one salt (``finish``) that keys its
correlated noise and each of its scalar releases.

With a private client-metric release (``plan.client_metrics``, ``fedmf.round.client_metrics``) round t also
releases (Σ clip(vᵢ, 0, L) + N(0, σ_m²)) / m over the contributed users' reported values, its noise
from its own keyed stream under the round's salt (``fedmf.round.count_noise.metric_noise``).

With secure aggregation the server never sees an update: ``add_sum`` takes the modular sum W that
SecAgg+ unmasked (uint64 residues modulo 2^b of the clients' words, with their ``Quantization``: the
clients clipped, zeroed and checked their own updates; ``fedmf.secagg``) in place of ``add``, and
``finish`` draws the same correlated noise N, scaled by the quantization's stated inflation — σ from
ζ_eff = ζ·inflation (``fedmf.secagg.sensitivity``) — and releases centre((W + s·N) mod 2^b)/s
(``fedmf.secagg.quantize.noisy_centred``): the noise is added to the residue *before* it is centred, so
a hostile client's word cannot make the centring wrap on an honest contribution (REVIEW-i36-privacy-path
HIGH-1); then the same scaling and division by the planned m. Adaptive clipping's count and the private
client-metric release likewise add their noise to the bit's and the metric word's residues, centre, and
only then clamp to [0, contributors] and [0, L·contributors]. A plan that records secure aggregation
(``plan.secure_aggregation``) takes only secure sums, of exactly its recorded inflation.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import checks
from ..errors import ConfigError, PlanMismatch, RoundOrderError
from ..plan import RunPlan
from ..secagg.quantize import Quantization, noisy_centred
from ..threads import one_thread
from .clipping import ClippingPolicy, clipping_policy
from .count_noise import metric_noise
from .draws import SALT_BYTES, key_of
from .noise import NoiseGenerator

__all__ = ["check_update", "RoundPrivatizer", "RoundReport", "UserReport", "flat_size", "layout_of", "param_dtype"]

Layout = Mapping[str, tuple[int, ...]]
_FLOATING = checks.floating_dtypes()
_STATE_FORMAT = 1
_ROW = 256  # row length of the blocked ℓ2 norm (see RoundPrivatizer._norm)


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The layout (name → shape) of a model's parameters or state dict."""
    return {str(name): tuple(int(x) for x in t.shape) for name, t in tensors.items()}


def flat_size(layout: Layout) -> int:
    return sum(math.prod(shape) for shape in layout.values())


def check_update(update: object, layout: Layout, *, values: bool = True) -> str | None:
    """Why ``update`` cannot be summed (a one-line reason), or None when it is valid:
    a mapping with exactly the layout's names, each a floating tensor of the layout's shape,
    every value finite (``values=False`` skips that last, full pass over the data)."""
    if not isinstance(update, Mapping):
        return f"update is not a mapping of tensors (got {type(update).__name__})"
    names, expected = set(update), set(layout)
    if names != expected:
        missing, extra = sorted(map(str, expected - names)), sorted(map(str, names - expected))
        parts = ([f"missing {', '.join(missing[:3])}"] if missing else []) + (
            [f"unexpected {', '.join(extra[:3])}"] if extra else [])
        return "update names differ from the model's: " + "; ".join(parts)
    for name, shape in layout.items():
        tensor = update[name]
        if not isinstance(tensor, torch.Tensor):
            return f"{name}: not a tensor (got {type(tensor).__name__})"
        if tensor.dtype not in _FLOATING:
            return f"{name}: dtype {tensor.dtype} is not floating point"
        if tuple(tensor.shape) != tuple(shape):
            return f"{name}: shape {tuple(tensor.shape)} != expected {tuple(shape)}"
        if tensor.is_sparse or tensor.layout != torch.strided:
            return f"{name}: not a dense tensor"
        if values and not bool(torch.isfinite(tensor).all()):
            return f"{name}: has non-finite values"
    return None


@dataclass(frozen=True)
class UserReport:
    """What happened to one user's update: ``status`` contributed or rejected."""

    user: Hashable
    status: str
    reason: str | None = None
    norm: float | None = None  # ℓ2 norm as received, before zeroing or clipping
    #: None: not known to the server (a secure sum: the client clipped and zeroed its own update)
    clipped: bool | None = False
    zeroed: bool | None = False


@dataclass
class RoundReport:
    round: int
    noise_std: float
    expected_users: float
    users: list[UserReport] = field(default_factory=list)
    #: adaptive clipping only (else None): ζₜ this round clipped to, and the noisy count of
    #: summed updates with norm ≤ ζₜ (released: ζₜ₊₁ follows from it)
    clip_norm: float | None = None
    noisy_unclipped: float | None = None
    #: the private client-metric release only (else None): (Σ clip(vᵢ, 0, L) + N(0, σ_m²)) / m over the
    #: contributed users (fedmf.round.client_metrics)
    noisy_client_metric: float | None = None

    @property
    def contributed(self) -> list[UserReport]:
        return [u for u in self.users if u.status == "contributed"]

    @property
    def rejected(self) -> list[UserReport]:
        return [u for u in self.users if u.status == "rejected"]

    def counts(self) -> dict[str, int | None]:
        """Users by status; clipped and zeroed None when the server cannot know them (a secure sum)."""
        good = self.contributed
        known = all(u.clipped is not None and u.zeroed is not None for u in good)
        return {"contributed": len(good), "rejected": len(self.users) - len(good),
                "clipped": sum(bool(u.clipped) for u in good) if known else None,
                "zeroed": sum(bool(u.zeroed) for u in good) if known else None}


def _linf(flat: torch.Tensor) -> float:
    low, high = torch.aminmax(flat)
    return max(-float(low), float(high))


def _user_order(user: Hashable) -> str:
    return str(user)


class RoundPrivatizer:
    """Clip, sum and noise the updates of each round of ``plan``, in order, on ``device``.

    The noise generator is seeded with ``seed`` (a secret: keep it in a 0600 file; the
    state dict never contains it) and salted: each round's fresh noise is keyed by a new
    random salt, so a round privatized again after ``load_state_dict`` (a redo, a restored
    backup) gets new noise, while the rounds in the state are reproduced exactly.
    ``repeatable_noise=True`` (tests only: unsafe) leaves the salts out, so that the same seed
    and state always give the same noise. Sums are kept in one flat buffer of the model's
    ``dtype`` on its ``device``."""

    def __reduce__(self):  # it holds a secret: never pickled (save state_dict() instead)
        checks.refuse_pickle(self)

    def __init__(self, plan: RunPlan, layout: Layout, *, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32, seed: bytes | int | None = None,
                 repeatable_noise: bool = False) -> None:
        if not isinstance(plan, RunPlan):
            raise ConfigError(f"plan must be a RunPlan, got {type(plan).__name__}")
        if not isinstance(repeatable_noise, bool):
            raise ConfigError(f"repeatable_noise must be True or False, got {repeatable_noise!r}")
        if dtype not in _FLOATING:
            raise ConfigError(f"dtype must be floating point, got {dtype}")
        self.plan = plan
        self.layout = checks.layout(layout)
        self.size = flat_size(self.layout)
        # half-precision models are summed and noised in float32, then cast back
        work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        #: ζ of each round and what follows from it (fedmf.round.clipping)
        self.clipping: ClippingPolicy = clipping_policy(plan)
        self._salted = not repeatable_noise
        # the run's noise key: the correlated noise's, and the scalar releases' streams (fedmf.round.count_noise)
        self._key = secrets.token_bytes(32) if seed is None else key_of(seed)
        self.noise = NoiseGenerator(plan.mechanism, self.layout, self.clipping.generator_std, dtype=work,
                                    device=device, seed=self._key, salted=not repeatable_noise)
        self.device, self.dtype, self._work = self.noise.device, dtype, work
        self._sum = torch.zeros(self.size, dtype=work, device=self.device)
        self._scratch = torch.empty(self.size, dtype=work, device=self.device)
        self._noise_buffer = torch.empty(self.size, dtype=work, device=self.device)
        # clipping to exactly ζ in floating point can round up by an ulp; scale a hair below
        self._clip_margin = 1.0 - 4.0 * torch.finfo(work).eps
        self._open: RoundReport | None = None
        self._seen: set[str] = set()
        self._selected: set[str] | None = None
        #: the open round's secure sum: (its quantization, its uint64 residues W, its contributor count)
        #: (None: central)
        self._secure: tuple[Quantization, np.ndarray, int] | None = None

    @property
    def clip_norm(self) -> float:
        """ζ of the next round (adaptive clipping: ζ₀ = plan.clip_norm, then the update rule's)."""
        return self.clipping.clip_norm

    @property
    def next_round(self) -> int:
        """The only round this privatizer serves next."""
        return self.noise.round

    # ---- one round, step by step -----------------------------------------------------
    def begin(self, t: int, selected: Iterable[Hashable] | None = None) -> None:
        """Open round t (must be ``next_round``); ``selected``: the users whose updates may count."""
        if isinstance(t, bool) or not isinstance(t, int):
            raise RoundOrderError(f"round index must be an int, got {t!r}")
        if self._open is not None:
            raise RoundOrderError(f"round {self._open.round} is still open")
        if t != self.next_round:
            raise RoundOrderError(f"this privatizer serves round {self.next_round} next, not {t} "
                                  "(rounds are never skipped or repeated)")
        if t >= self.plan.rounds:
            from ..errors import HorizonReached

            raise HorizonReached(f"round {t} is past the mechanism's horizon of {self.plan.rounds} rounds")
        self._sum.zero_()
        self._secure = None
        self._open = RoundReport(t, self.clipping.noise_std, self.plan.expected_users,
                                 clip_norm=self.clipping.reported_clip_norm)
        self._seen = set()
        self._selected = None if selected is None else {_user_order(u) for u in selected}

    def add(self, user: Hashable, update: object) -> UserReport:
        """Validate, zero, clip and sum one user's update (or reject it with its reason)."""
        report = self._require_open()
        if self._secure is not None:
            raise RoundOrderError(f"round {report.round} holds a secure sum: no update is added to it")
        if self.plan.secure_aggregation is not None:
            raise ConfigError("this plan uses secure aggregation: the server takes only secure sums, no update")
        key = _user_order(user)
        if key in self._seen:
            return self._reject(user, f"a second update from this user in round {report.round}", record=False)
        self._seen.add(key)
        if self._selected is not None and key not in self._selected:
            return self._reject(user, f"not selected for round {report.round}")
        reason = check_update(update, self.layout, values=False)
        if reason is not None:
            return self._reject(user, reason)
        with one_thread(self.device):
            flat = self._flatten(update)
            norm, bound = self._norm(flat)  # a NaN or inf anywhere makes both non-finite
            if not math.isfinite(bound):
                reason = check_update(update, self.layout)
                if reason is not None:
                    return self._reject(user, reason)
                if not bool(torch.isfinite(flat).all()):
                    return self._reject(user, f"update values overflow the model's dtype {self.dtype}")
                # finite values whose squares overflow: scale by an exact power of two first
                scale = 2.0 ** -math.frexp(float(torch.linalg.vector_norm(flat, ord=math.inf)))[1]
                norm, bound = (value / scale for value in self._norm(flat * scale))
                if not math.isfinite(bound):
                    return self._reject(user, "update norm is not finite")
            zeta, threshold = self.clipping.clip_norm, self.clipping.zero_threshold
            # ℓ∞ ≤ ℓ2: the ℓ∞ pass is needed only when the ℓ2 norm exceeds the threshold
            if threshold is not None and norm > threshold and _linf(flat) > threshold:
                # "Multi-Epoch MF" StackOverflow recipe: an update with ℓ∞ > 100·ζ is replaced by zero
                result = UserReport(user, "contributed", None, norm, False, True)
            else:
                clipped = bound > zeta  # ℓ2 clipping to ζ (Multi-Epoch MF Sec. 2), scaled by the policy
                self._sum.add_(flat, alpha=self.clipping.factor(bound, clipped, self._clip_margin))
                result = UserReport(user, "contributed", None, norm, clipped, False)
        report.users.append(result)
        return result

    def add_sum(self, residues: Any, contributors: Iterable[Hashable], *, quantization: Quantization) -> None:
        """The open round's sum as secure aggregation unmasked it, in place of ``add``: ``residues``,
        the modular sum W (uint64 words below 2^b) of ``contributors``' words, encoded by
        ``quantization``: the flat update in the layout's order, Σ clip(Δ, ζ)·s (fixed clipping) or
        Σ clip(Δ, ζₜ)/ζₜ·s (adaptive), each update's decoded ℓ2 norm at most ζ·inflation (Kairouz, Liu,
        Steinke, ICML 2021, Thm. 1); then the unclipped bits' sum (adaptive clipping only); then the
        client-metric words' sum (the private client-metric release only). Nothing is decoded here:
        ``finish`` adds the noise (σ·inflation) to the residues, then centres them (HIGH-1)."""
        report = self._require_open()
        if self._secure is not None or self._seen:
            raise RoundOrderError(f"round {report.round} already has updates or a secure sum")
        if not isinstance(quantization, Quantization):
            raise ConfigError(f"a secure sum needs its Quantization, got {type(quantization).__name__}")
        q = quantization
        factor = checks.interval("quantization inflation", q.inflation, 1.0, float("inf"))
        planned = self.plan.secure_aggregation
        if planned is not None and factor != planned.inflation:
            raise ConfigError(f"a secure sum's inflation {factor!r} differs from the plan's {planned.inflation!r}")
        words = np.asarray(residues)
        if (q.dim != self.size or words.dtype != np.uint64 or words.shape != (q.length,)
                or np.any(words >> np.uint64(q.bits))):
            raise ConfigError(f"a secure sum must be {self.size} update words (and its bit, metric) as uint64 "
                              "residues below 2^bits")
        users = sorted({_user_order(u): u for u in contributors}.items())
        if self._selected is not None and any(key not in self._selected for key, _ in users):
            raise ConfigError(f"a secure sum of round {report.round} names users not selected for it")
        adaptive = self.clipping.reported_clip_norm is not None
        if adaptive != q.with_bit:
            raise ConfigError("a secure sum carries the unclipped count exactly when ζ adapts")
        if q.clip_norm != (1.0 if adaptive else self.plan.clip_norm):
            raise ConfigError("a secure sum's quantization clips to ζ (fixed) or 1 (adaptive: the normalized update)")
        release = self.plan.client_metrics
        if (release is not None) != (q.metric_clip is not None):
            raise ConfigError("a secure sum carries the client-metric sum exactly when the plan releases it")
        if release is not None and q.metric_clip != release.clip:
            raise ConfigError("a secure sum's client-metric clip differs from the plan's")
        self._seen = {key for key, _ in users}
        report.users.extend(UserReport(user, "contributed", clipped=None, zeroed=None) for _, user in users)
        self._secure = (q, words.copy(), len(users))

    def finish(self, values: Mapping[Hashable, Any] | None = None) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Draw round t's noise (only now: the sum is complete), add it once, divide by the
        planned expected number of users; returns the mean update in the layout and the report.
        ``values``: user → the client-reported metric, read only by the private client-metric release
        (``plan.client_metrics``; only the contributed users' values count)."""
        report = self._require_open()
        # the round's one salt (b"": unsalted), drawn before any of its noise: it keys the correlated
        # noise's fresh rows and each scalar release's stream, so a redone round draws all of them afresh
        salt = secrets.token_bytes(SALT_BYTES) if self._salted else b""
        self._release_client_metric(report, values, salt)
        # σ·(C⁻¹Z)_t (Multi-Epoch MF Sec. 2), σ = the policy's generator std
        noise = self.noise.next(out=self._noise_buffer, salt=salt or None)
        flat_noise = noise if isinstance(noise, torch.Tensor) else self._noise_buffer
        noisy_count = None
        if self._secure is None:
            noisy = torch.add(self._sum, flat_noise)
        else:
            q, words, contributors = self._secure
            # σ_eff = z·(ζ·inflation)·sens: the same draws, × inflation in float64 (INFO-4: not rounded to
            # the work dtype), added to the residues before centring (HIGH-1), ÷ s: the sum's units
            scaled = flat_noise.to(torch.float64).cpu().numpy() * q.inflation
            released = noisy_centred(q.bits, q.scale, words[: q.dim], scaled)
            noisy = torch.from_numpy(released).to(device=self.device, dtype=self._work)
            report.noise_std = report.noise_std * q.inflation
            if q.with_bit:  # the bit word, 1 per unclipped update: its noise (count units) before centring
                def noisy_count(noise: float) -> float:
                    count = float(noisy_centred(q.bits, 1.0, words[q.dim : q.dim + 1], np.array([noise]))[0])
                    return min(max(count, 0.0), float(contributors))  # post-processing: clamped after the noise
        mean = self.clipping.scale_back(noisy)
        report.noisy_unclipped = self.clipping.release(self._key, report.round, salt, report.contributed,
                                                       noised=noisy_count)
        self._open = None
        self._selected = None
        self._secure = None
        return self._unflatten(mean.to(self.dtype)), report

    def _release_client_metric(self, report: RoundReport, values: Mapping[Hashable, Any] | None,
                               salt: bytes) -> None:
        """The private client-metric release (``fedmf.round.client_metrics``): each contributed user's value
        clipped to [0, L] (missing or not finite: 0), summed, N(0, σ_m²) from the round's keyed stream
        (the round's salt: a redone round draws afresh), ÷ the planned m."""
        release = self.plan.client_metrics
        if release is None:
            return
        noise = metric_noise(self._key, report.round, salt, release.noise_std)
        if self._secure is not None:  # the metric word's residue: noise first, centred, then clamped (HIGH-1)
            q, words, contributors = self._secure
            total = float(noisy_centred(q.bits, q.scale, words[q.length - 1 :], np.array([noise]))[0])
            total = min(max(total, 0.0), release.clip * contributors)  # post-processing of the noisy sum
            report.noisy_client_metric = total / self.plan.expected_users
            return
        given = {_user_order(u): v for u, v in (values or {}).items()}
        contributed = [given.get(_user_order(u.user)) for u in report.contributed]
        report.noisy_client_metric = release.noisy_mean(contributed, noise, self.plan.expected_users)

    def abort(self) -> None:
        """Drop an open round without drawing its noise (nothing was released)."""
        self._open = None
        self._selected = None
        self._secure = None

    def privatize(self, t: int, updates: Mapping[Hashable, object], selected: Collection[Hashable] | None = None,
                  values: Mapping[Hashable, Any] | None = None) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Round t in one call. Updates are summed in the order of ``str(user)``, so the result
        does not depend on the order in which they arrived. ``values``: the client-reported metric
        (``finish``)."""
        self.begin(t, selected)
        try:
            for user in sorted(updates, key=_user_order):
                self.add(user, updates[user])
        except BaseException:
            self.abort()
            raise
        return self.finish(values)

    def privatize_sum(self, t: int, residues: Any, contributors: Collection[Hashable], *,
                      quantization: Quantization, selected: Collection[Hashable] | None = None,
                      ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Round t in one call from a secure sum's residues (``add_sum``): the same noise and scaling as
        ``privatize``, σ from ζ·inflation, added before the centring, ÷ the planned m."""
        self.begin(t, selected)
        try:
            self.add_sum(residues, contributors, quantization=quantization)
        except BaseException:
            self.abort()
            raise
        return self.finish()

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state to continue exactly (no seed: the generator state carries a seed check).
        Its noise tensors are the live ones, not copies: serialize it before the next round."""
        if self._open is not None:
            raise RoundOrderError("cannot checkpoint in the middle of a round")
        state = {"format": _STATE_FORMAT, "plan_fingerprint": self.plan.fingerprint,
                 "layout": {k: list(v) for k, v in self.layout.items()}, "device_type": self.device.type,
                 "noise": self.noise.state_dict(include_seed=False, copy=False)}
        state.update(self.clipping.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        checks.state_format(state, "privatizer state", _STATE_FORMAT, error=PlanMismatch)
        self.plan.check_fingerprint(state.get("plan_fingerprint"), "privatizer state")
        if {k: tuple(v) for k, v in state["layout"].items()} != self.layout:
            raise PlanMismatch("privatizer state was written for another model layout")
        if state.get("device_type") != self.device.type:
            # the Gaussian sampler differs by device: the regenerated past draws would not match
            raise PlanMismatch(f"privatizer state was written on {state.get('device_type')!r}; resume it on that "
                               f"device type, not {self.device.type!r}")
        self.clipping.read_state(state)  # checked before anything changes
        self.noise.load_state_dict(state["noise"])
        self.clipping.load_state_dict(state)
        self._open = None

    # ---- helpers ---------------------------------------------------------------------
    def _require_open(self) -> RoundReport:
        if self._open is None:
            raise RoundOrderError("no round is open: call begin(t) first")
        return self._open

    def _reject(self, user: Hashable, reason: str, *, record: bool = True) -> UserReport:
        result = UserReport(user, "rejected", reason)
        if record:
            self._open.users.append(result)
        return result

    def _norm(self, flat: torch.Tensor) -> tuple[float, float]:
        """(‖flat‖₂, an upper bound of it) in one cheap pass: ℓ2 norms of rows of 256 values in the
        working dtype, whose squares are summed in float64. Each row's sum of squares is computed
        with relative error ≤ γ₂₅₆ ≈ 256u (Higham, "Accuracy and Stability of Numerical
        Algorithms", Sec. 4.2), so dividing it by 1 − 300u bounds the exact value (the float64 tail
        likewise); squares that underflow lose at most the smallest normal each, added as n·tiny."""
        rows = (flat.numel() // _ROW) * _ROW
        blocked = tail = 0.0
        if rows:
            norms = torch.linalg.vector_norm(flat[:rows].view(-1, _ROW), dim=1)
            blocked = float(norms.double().square().sum())
        if rows < flat.numel():
            tail = float(torch.linalg.vector_norm(flat[rows:], dtype=torch.float64))
            tail = tail * tail  # inf when it overflows (float ** 2 would raise OverflowError)
        info = torch.finfo(flat.dtype)
        u, u64 = info.eps, 2.0 ** -52
        # relative rounding of the sums of squares, plus their absolute error below the normal range
        bound = (blocked / (1.0 - (_ROW + 44) * u) + tail / (1.0 - (flat.numel() - rows + 2) * u64)
                 + flat.numel() * info.tiny)
        return math.sqrt(blocked + tail), math.sqrt(bound)

    def _flatten(self, update: Mapping[str, torch.Tensor]) -> torch.Tensor:
        flat, offset = self._scratch, 0
        for name, shape in self.layout.items():
            size = math.prod(shape)
            flat[offset : offset + size].copy_(update[name].reshape(-1))
            offset += size
        return flat

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in self.layout.items():
            size = math.prod(shape)
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out


def param_dtype(params: Mapping[str, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    """The one floating dtype and device of a model's trainable parameters (refused otherwise)."""
    dtypes = {p.dtype for p in params.values()}
    devices = {p.device for p in params.values()}
    if not params or len(dtypes) != 1 or len(devices) != 1:
        raise ConfigError("all trainable parameters must share one floating dtype and one device")
    dtype = dtypes.pop()
    if not dtype.is_floating_point:
        raise ConfigError(f"trainable parameters must be floating point, got {dtype}")
    return dtype, devices.pop()
