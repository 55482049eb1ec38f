"""Empirical privacy audit in one run: canary users, and a statistical lower bound on ε.

    result = run_canary_audit(model, users, plan, local_update, canaries=200)
    print(result.summary())  # empirical ε ≥ X (95% confidence) vs accounted ε = Y

or ``fedmf audit-empirical --canaries 200 --epsilon 2`` (the tiny task). ``M`` canary users join
the population of a real ``fedmf.run.federated.train`` run (the round the Flower strategy drives, bit
for bit). Canary c has a fixed random direction u_c in parameter space (the M directions are
orthonormal when M ≤ d, nearly so otherwise) and is "in" with probability 1/2, independently of everything else:
an in-canary sends ζ'·u_c whenever the scheduler selects it (ζ' a hair below the clip norm ζ, so
clipping leaves it unchanged), an out-canary sends a zero update — the two neighbouring datasets
of zero-out adjacency (one user's contributions replaced by zeros), the neighbouring notion under
which the DP-MF guarantee and fedmf's accountant hold ("Multi-Epoch Matrix Factorization
Mechanisms", Choquette-Choo et al. 2023, Sec. 2, after Kairouz et al. 2021 "Practical and Private
(Deep) Learning without Sampling or Shuffling"): an in-canary's stream differs from an
out-canary's by at most ζ per participation, within the planned sensitivity. From the released models alone
the audit recovers each round's privatized mean update x̂_t (inverting the server optimizer),
scores every canary, guesses the top-k as in and the bottom-k as out, and turns the number of
correct guesses into a lower bound on ε with the one-run theorem of Steinke, Nasr and Jagielski
2023, "Privacy Auditing with One (1) Training Run" (arXiv:2305.08846; SNJ below).

The run's directory (``checkpoint_dir``) and its ledger reveal which canaries were in (the ledger
records each contribution's norm): keep it private, and audit with a ledger of its own — never the
production ledger (the CLI always uses a private SQLite ledger in the audit's directory).

Interpretation. ``epsilon_lower_bound`` is a statement about the whole deployed pipeline
(clipping, noise, scheduler, optimizer): with probability ≥ ``confidence`` over the run's
randomness the run is NOT (ε, δ)-DP for any ε below it. A correct implementation gives a bound
at or below the accounted ε — usually far below, since one-run audits of Gaussian noise with a
few hundred canaries are loose — so a bound near the accounted ε is not a proof of tightness,
and a bound ABOVE the accounted ε is evidence of a privacy bug (or of a 1 − confidence event).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks
from ..errors import ConfigError

__all__ = ["p_value", "epsilon_lower_bound", "best_guess_bound", "canary_scores", "run_canary_audit",
           "AuditResult", "GuessTest", "CANARY_PREFIX", "DEFAULT_GUESS_FRACTIONS"]

#: canary user ids are CANARY_PREFIX + index
CANARY_PREFIX = "fedmf-canary-"
#: guess k = fraction·E/2 in and k out of the E scored canaries, for each fraction (Bonferroni over them)
DEFAULT_GUESS_FRACTIONS = (0.1, 0.25, 0.5, 1.0)
#: canary norm = ζ·(1 − 2⁻¹⁰): below ζ by far more than the privatizer's norm bound's rounding
#: slack (≤ 300 ulps of float32, privatize.py), so an in-canary of a float32/float64 model is never
#: clipped (a half-precision cast may clip it slightly: a weaker canary, never an invalid audit)
_CANARY_SCALE = 1.0 - 2.0**-10
_MAX_DIRECTION_VALUES = 1 << 27  # M·d float64 values held for the directions (1 GiB)
_GRID_POINTS = 200
_BISECTIONS = 60


# ---- the one-run bound (SNJ 2023) ---------------------------------------------------------
def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("canaries", m), ("guesses", r), ("correct", v)):
        checks.integer(name, value)
    if not 0 <= v <= r <= m:
        raise ConfigError(f"need 0 <= correct <= guesses <= canaries, got {v}, {r}, {m}")


def _check_delta(delta: float) -> None:
    if not 0.0 <= checks.number("delta", delta) < 1.0:
        raise ConfigError(f"delta must lie in [0, 1), got {delta!r}")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """An upper bound on P[W ≥ v] for the number W of correct guesses among r guesses on m canaries
    (each in with probability 1/2) when the run is (ε, δ)-DP.

    SNJ 2023, main theorem for (ε, δ)-DP (and its appendix code ``p_value_DP_audit``):
    P[W ≥ v] ≤ f(v) + 2mδ · max_{1≤i≤m} (f(v−i) − f(v))/i, f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v];
    with δ = 0 it is the plain binomial tail (their pure-DP theorem). Since P[W ≥ v] is
    non-increasing in v, the minimum of that bound over all v' ≤ v is a bound too; that minimum is
    returned, so the p-value is non-increasing in v (which makes "reject when p < β" a level-β test
    for every ε, whatever the shape of the δ term)."""
    _check_counts(m, r, v)
    _check_delta(delta)
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0 and math.isfinite(epsilon)):
        raise ConfigError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    from scipy.special import expit
    from scipy.stats import binom

    q = float(expit(epsilon))  # accuracy of ε-DP randomized response, e^ε/(1+e^ε)
    counts = np.arange(v + 1)
    pmf = binom.pmf(counts, r, q)
    tails = binom.sf(counts - 1, r, q)  # tails[w] = f(w) = P[Binomial(r, q) >= w]

    def bound(w: int) -> float:
        alpha = 0.0
        if delta > 0 and w > 0:
            # (f(w-i) - f(w)) / i = P[w-i <= Binomial(r, q) <= w-1] / i for i = 1..w (SNJ's loop); for i > w
            # the numerator stays f(0) - f(w) while i grows, so the max over 1..m is the max over 1..w
            windows = np.cumsum(pmf[w - 1::-1])
            alpha = float(np.max(windows / np.arange(1, w + 1)))
        return min(1.0, float(tails[w]) + 2.0 * m * delta * alpha)

    best = bound(v)
    for w in range(v - 1, -1, -1):
        if tails[w + 1] >= best:  # every w' <= w has f(w') >= f(w+1) >= best, so bound(w') >= best: done
            break
        best = min(best, bound(w))
    return best


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, beta: float = 0.05) -> float:
    """The largest ε (to bisection precision) at which ``v`` correct guesses out of ``r`` (on ``m``
    canaries) still give ``p_value < beta``; 0.0 when no ε ≥ 0 does.

    Validity (SNJ 2023's test, made robust to a p-value that is not monotone in ε): a run that is
    (ε*, δ)-DP is (ε, δ)-DP for every ε ≥ ε*, so B(v) = inf_{ε ≥ ε*} p_value(ε, v) bounds P[W ≥ v] and
    is non-increasing in v; hence P[B(W) < β] ≤ β. A returned ε > 0 always has p_value(ε, W) < β, so
    a returned ε > ε* implies B(W) < β: P[bound > ε*] ≤ β for the true ε*. Unlike SNJ's bisection, which assumes
    monotonicity in ε, the search scans a grid on [0, ε_stop] for the LARGEST ε with p < β (ε_stop:
    where f(v) alone reaches β; f grows with ε, so no larger ε can qualify) and refines by bisection
    keeping p < β at the lower end."""
    _check_counts(m, r, v)
    _check_delta(delta)
    if not (isinstance(beta, float) and 0.0 < beta < 1.0):
        raise ConfigError(f"beta (1 - confidence) must lie in (0, 1), got {beta!r}")
    if v == 0:
        return 0.0
    from scipy.special import logit
    from scipy.stats import binom

    # ε_stop: f(v) = P[Binomial(r, q) >= v] is increasing in q; bisect q for f(v) = β
    lo, hi = 0.5, 1.0
    if float(binom.sf(v - 1, r, lo)) >= beta:
        hi = lo
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if float(binom.sf(v - 1, r, mid)) >= beta:
            hi = mid
        else:
            lo = mid
    if hi >= 1.0:  # v = r with β below 1: q^r < β for every q < 1 only in the limit; unreachable in practice
        hi = np.nextafter(1.0, 0.0)
    eps_stop = float(logit(hi))
    if eps_stop <= 0:
        return 0.0
    grid = np.linspace(0.0, eps_stop, _GRID_POINTS + 1)
    passing = [e for e in grid if p_value(m, r, v, float(e), delta) < beta]
    if not passing:
        return 0.0
    lo_eps = float(max(passing))
    hi_eps = min(eps_stop, lo_eps + eps_stop / _GRID_POINTS)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo_eps + hi_eps)
        if p_value(m, r, v, mid, delta) < beta:
            lo_eps = mid
        else:
            hi_eps = mid
    return lo_eps


@dataclass(frozen=True)
class GuessTest:
    """One guess rule: the top ``guesses_in`` scores guessed in, the bottom ``guesses_out`` out."""

    guesses_in: int
    guesses_out: int
    correct: int
    epsilon_lower_bound: float

    @property
    def guesses(self) -> int:
        return self.guesses_in + self.guesses_out


def best_guess_bound(scores: np.ndarray, members: np.ndarray, scored: np.ndarray, *, delta: float,
                     confidence: float = 0.95,
                     fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> tuple[GuessTest, list[GuessTest]]:
    """Guess k = fraction·E/2 canaries in (highest scores) and k out (lowest) among the E ``scored``
    ones, for each fraction; each rule is tested at level (1 − confidence)/len(rules) (Bonferroni:
    the best of the rules is then valid at 1 − confidence); returns (best, all). ``members`` (the
    truth) is used only to count correct guesses, after the guesses are fixed. The δ term of SNJ's
    theorem uses m = all canaries (``len(scores)``), abstentions included."""
    scores = np.asarray(scores, dtype=np.float64)
    members, scored = np.asarray(members, dtype=bool), np.asarray(scored, dtype=bool)
    if not (scores.ndim == 1 and scores.shape == members.shape == scored.shape):
        raise ConfigError("scores, members and scored must be 1-d arrays of one length")
    if not (isinstance(confidence, float) and 0.0 < confidence < 1.0):
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}")
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ConfigError(f"guess fractions must lie in (0, 1], got {list(fractions)!r}")
    m = int(scores.size)
    eligible = np.flatnonzero(scored)
    order = eligible[np.argsort(scores[eligible], kind="stable")]  # ascending score
    counts = sorted({max(1, int(f * len(order) / 2)) for f in fractions}) if len(order) >= 2 else []
    beta = (1.0 - confidence) / max(1, len(counts))
    tests = []
    for k in counts:
        guessed_in, guessed_out = order[len(order) - k:], order[:k]
        correct = int(np.count_nonzero(members[guessed_in]) + np.count_nonzero(~members[guessed_out]))
        tests.append(GuessTest(k, k, correct, epsilon_lower_bound(m, 2 * k, correct, delta, beta)))
    best = max(tests, key=lambda g: g.epsilon_lower_bound, default=GuessTest(0, 0, 0, 0.0))
    return best, tests


# ---- scores from the released models ------------------------------------------------------------
def canary_scores(projections: np.ndarray, participated: np.ndarray, canary_norms: np.ndarray, *,
                  workload, server_lr: float, expected_users: float, noise_std: float,
                  noise_inverse: np.ndarray) -> np.ndarray:
    """Gaussian log-likelihood-ratio score of every canary from the released models.

    ``projections[t, c]`` = ⟨θ_{t+1} − θ_t, u_c⟩ (consecutive released models, unit direction u_c).
    The server optimizer applies θ_{t+1} = θ_t + η·lr_t·m_t, m_t = β·m_{t−1} + x̂_t
    (server_optimizer.py; "Multi-Epoch MF" Sec. 5.2), so x̂_t = m_t − β·m_{t−1} with
    m_t = (θ_{t+1} − θ_t)/(η·lr_t); projections commute with it. y_c = expected_users·⟨x̂, u_c⟩ is the
    canary's coordinate of the noisy sums, whose noise is σ·(L Z)_t along any unit vector
    (L = C⁻¹ = ``noise_inverse``, Z iid N(0, 1): privatize.py), covariance σ²·G, G = L Lᵀ.
    An in-canary adds ζ_c·a_c (a_c: the rounds it may have contributed in), so the
    likelihood ratio of N(ζ_c a_c, σ²G) against N(0, σ²G) gives
    score_c = (ζ_c/σ²)·(a_cᵀ G⁻¹ y_c − ζ_c·a_cᵀ G⁻¹ a_c / 2) (Neyman–Pearson). The other users'
    updates are ignored (a nuisance); SNJ's bound holds for any score computed from the output."""
    from scipy.linalg import cho_factor, cho_solve

    projections = np.asarray(projections, dtype=np.float64)
    rounds_done, m = projections.shape
    rates = np.asarray(workload.learning_rates(int(noise_inverse.shape[0])), dtype=np.float64)[:rounds_done]
    momentum = projections / (server_lr * rates[:, None])
    noisy = momentum.copy()
    noisy[1:] -= workload.momentum * momentum[:-1]  # x̂_t = m_t − β m_{t−1}
    y = expected_users * noisy
    inverse = np.asarray(noise_inverse, dtype=np.float64)[:rounds_done]
    gram = inverse @ inverse.T  # G = L Lᵀ over the rounds done
    a = np.asarray(participated, dtype=np.float64)
    try:
        factor = cho_factor(gram, lower=True)
        weights = cho_solve(factor, a)  # G⁻¹ a_c, one column per canary
    except np.linalg.LinAlgError:
        weights = np.linalg.lstsq(gram, a, rcond=None)[0]
    norms = np.asarray(canary_norms, dtype=np.float64)
    signal = np.einsum("tc,tc->c", weights, y)
    energy = np.einsum("tc,tc->c", weights, a)
    return norms / noise_std**2 * (signal - 0.5 * norms * energy)


# ---- the audited run ---------------------------------------------------------------------------
@dataclass
class AuditResult:
    """What the audit found (never its seed, nor the run's secrets)."""

    epsilon_lower_bound: float
    confidence: float
    epsilon_accounted: float
    delta: float
    canaries: int
    canaries_in: int
    canaries_out: int
    canaries_scored: int
    guesses: int
    guesses_in: int
    guesses_out: int
    correct: int
    tests: list[dict[str, Any]]
    score: str
    rounds_done: int
    dimension: int
    noise_multiplier: float
    plan_fingerprint: str
    run_id: int
    run_dir: str | None = None
    notes: list[str] = field(default_factory=list)

    def violated(self) -> bool:
        """True when the lower bound exceeds the accounted ε (evidence of a privacy bug)."""
        return self.epsilon_lower_bound > self.epsilon_accounted

    def summary(self) -> str:
        return (f"empirical ε ≥ {self.epsilon_lower_bound:.3f} ({100 * self.confidence:g}% confidence) "
                f"vs accounted ε = {self.epsilon_accounted:.3f}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violated": self.violated(), "summary": self.summary()}


def _flat(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).to(torch.float64) for _, p in model.named_parameters()]).numpy()


def run_canary_audit(model, users: Sequence[Hashable], plan, local_update: Callable, *, canaries: int = 200,
                     seed: int | None = None, confidence: float = 0.95, server_lr: float = 1.0,
                     rounds: int | None = None, checkpoint_dir: str | Path | None = None,
                     ledger: str | None = None, ledger_diagnostics: bool = False,
                     fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> AuditResult:
    """Run ``fedmf.run.federated.train`` on ``users`` plus ``canaries`` canary users and audit it (see
    the module docstring; ``ledger_diagnostics``: ``train``'s). ``seed``: the audit's own secret (canary directions and memberships;
    default: fresh randomness); it is never returned. ``checkpoint_dir`` must hold no earlier run
    (the audit must see every released model). The server optimizer is the plan's workload."""
    import torch

    from ..plan import RunPlan
    from ..round.privatize import flat_size, layout_of
    from ..run.cohort import NO_MINIMUM
    from ..run.federated import train

    if not isinstance(plan, RunPlan):
        raise ConfigError(f"plan must be a RunPlan, got {type(plan).__name__}")
    if plan.adaptive_clipping is not None:  # the canaries and the scores assume one fixed ζ and σ
        raise ConfigError("the canary audit needs a fixed clip norm: it does not audit adaptive-clipping plans")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 2:
        raise ConfigError(f"canaries must be an integer >= 2, got {canaries!r}")
    if not (isinstance(confidence, float) and 0.0 < confidence < 1.0):
        raise ConfigError(f"confidence must lie in (0, 1), got {confidence!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError("the audit seed must be a non-negative integer")
    end = plan.rounds if rounds is None else rounds
    if isinstance(end, bool) or not isinstance(end, int) or not 0 < end <= plan.rounds:
        raise ConfigError(f"rounds must be an integer in [1, {plan.rounds}], got {rounds!r}")
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "run.json").exists():
        raise ConfigError(f"{str(checkpoint_dir)!r} already holds a run; the audit needs a new run directory")
    params = dict(model.named_parameters())
    layout = layout_of(params)
    dim = flat_size(layout)
    if canaries * dim > _MAX_DIRECTION_VALUES:  # checked before anything of size M is built
        raise ConfigError(f"{canaries} canaries x {dim} parameters exceed the audit's memory limit "
                          f"({_MAX_DIRECTION_VALUES} values); use fewer canaries or a smaller model")
    users = list(users)
    ids = [f"{CANARY_PREFIX}{i:05d}" for i in range(canaries)]
    if {str(u) for u in users} & set(ids):
        raise ConfigError(f"a user id collides with the canary ids ({CANARY_PREFIX}NNNNN)")
    dtype = next(iter(params.values())).dtype

    # canary c: an independent fair coin (SNJ: S_c uniform on {in, out}) and a random unit direction
    rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
    members = rng.random(canaries) < 0.5
    directions = rng.standard_normal((canaries, dim))
    if canaries <= dim:
        # exactly orthonormal (QR of the Gaussian draws: uniformly random orthonormal directions), so
        # that one canary's contribution adds nothing to another's score; with M > d they cannot be
        directions = np.linalg.qr(directions.T)[0].T
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    cast = torch.from_numpy(directions * (plan.clip_norm * _CANARY_SCALE)).to(dtype)
    released = cast.to(torch.float64).numpy()  # what the canaries really send, in the model's dtype
    norms = np.linalg.norm(released, axis=1)
    units = released / norms[:, None]
    updates = []
    zero = {name: torch.zeros(shape, dtype=dtype) for name, shape in layout.items()}
    for c in range(canaries):
        update, offset = {}, 0
        for name, shape in layout.items():
            size = math.prod(shape)
            update[name] = cast[c, offset:offset + size].reshape(shape).clone()
            offset += size
        updates.append(update if members[c] else zero)  # zero-out adjacency: out = a zero update
    index = {cid: c for c, cid in enumerate(ids)}
    selected = np.zeros((end, canaries), dtype=bool)

    def audited_update(global_params: Mapping[str, Any], user: Hashable, t: int):
        c = index.get(str(user))
        if c is None:
            return local_update(global_params, user, t)
        selected[t, c] = True  # the schedule (used only where it is public: unamplified runs)
        return updates[c]

    previous = _flat(model)
    projections: list[np.ndarray] = []

    def on_round(record) -> None:  # called after round t is committed: the model is released
        nonlocal previous
        current = _flat(model)
        projections.append(units @ (current - previous))
        previous = current

    result = train(model, users + ids, plan, audited_update, server_lr=server_lr, rounds=end,
                   checkpoint_dir=checkpoint_dir, ledger=ledger, on_round=on_round,
                   ledger_diagnostics=ledger_diagnostics, min_clients_per_round=NO_MINIMUM)
    done = result.rounds_done
    notes = []
    if done < end:
        notes.append(f"the run stopped after {done} rounds ({result.stopped})")
    if not plan.sampling.amplified:
        # unamplified: the accountant's ε holds for every participation pattern allowed by the schema,
        # so the audit may condition on the schedule (drawn independently of the canaries' coins)
        participated, score = selected[:done], "likelihood-ratio (known participation)"
    else:
        # amplified: ε relies on the sampling staying secret; score every round a canary could be in
        participated, score = np.ones((done, canaries), dtype=bool), "likelihood-ratio (all rounds)"
    if done == 0:
        scores = np.zeros(canaries)
    else:
        scores = canary_scores(np.array(projections), participated, norms, workload=plan.mechanism.workload,
                               server_lr=server_lr, expected_users=plan.expected_users,
                               noise_std=plan.noise_std, noise_inverse=plan.mechanism.inverse_matrix())
    scored = participated.any(axis=0)  # a canary never selected carries no signal: abstain on it
    best, tests = best_guess_bound(scores, members, scored, delta=plan.delta, confidence=confidence,
                                   fractions=fractions)
    return AuditResult(
        epsilon_lower_bound=best.epsilon_lower_bound, confidence=confidence,
        epsilon_accounted=plan.epsilon_after(done - 1) if done else 0.0, delta=plan.delta, canaries=canaries,
        canaries_in=int(members.sum()), canaries_out=int((~members).sum()), canaries_scored=int(scored.sum()),
        guesses=best.guesses, guesses_in=best.guesses_in, guesses_out=best.guesses_out, correct=best.correct,
        tests=[{**asdict(t), "guesses": t.guesses} for t in tests], score=score, rounds_done=done, dimension=dim,
        noise_multiplier=plan.noise_multiplier, plan_fingerprint=plan.fingerprint,
        run_id=result.run_id, run_dir=None if checkpoint_dir is None else str(checkpoint_dir), notes=notes)
