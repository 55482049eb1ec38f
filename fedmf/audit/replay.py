"""The read-only privacy audit of a recorded run (``fedmf audit``): its replay from the ledger.

It opens the ledger read-only (SQLite ``mode=ro``; PostgreSQL READ ONLY transactions),
reads one consistent snapshot of a run, and recomputes from the participations alone:
the worst user's ε and the plan's ε after every committed round, the realized minimum
separation and maximum participations, the participation histogram and the users who
broke the plan (there are none when the server enforced it). With ``verify`` it also
recomputes the hash chain (``fedmf.ledger.chain``) and names the first round that does not
match. Nothing is ever written to the ledger, nor beside a SQLite ledger
(``db.read_snapshot``); the report (``fedmf.audit.report``) writes its CSV and PNG files only
after the audit succeeded.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .. import checks
from ..accounting.run_privacy import run_privacy
from ..ledger.chain import ChainCheck, HeadCheck, check_chain, check_head
from ..ledger.db import LedgerError, check_version, display_url, read_snapshot, resolve_url
from ..ledger.models import Run
from ..ledger.queries import RunInfo, norm_summary, participation_rows, read_run
from ..mechanisms.base import Mechanism
from ..participation import schema_from_dict
from .report import ADAPTIVE_COLUMNS, DIAGNOSTIC_COLUMNS, RECORDED_WORST_COLUMN, AuditReport

__all__ = ["audit", "ChainBroken", "clip_norm_violations", "clip_norm_warnings"]

_REL_TOL = 1e-9


class ChainBroken(LedgerError):
    """``audit(verify=True)`` of a run whose chain does not match and whose rows could not even
    be audited (e.g. a rewritten mechanism): the verification failure, not bad input."""

    def __init__(self, chain: ChainCheck, message: str, head_check: HeadCheck | None = None) -> None:
        super().__init__(message)
        self.chain, self.head_check = chain, head_check


def _mechanism_from_document(text: str, checksum: str, run_id: int) -> Mechanism:
    """Rebuild the run's mechanism from the stored file (``io.loads``: the one validating
    reader), which must carry the checksum recorded on the run."""
    from ..mechanisms.io import MechanismFileError, loads

    try:
        mechanism, _, stored = loads(text, source=f"run {run_id} mechanism")
    except MechanismFileError as e:
        raise LedgerError(f"{e} (the ledger was modified or damaged)") from None
    if stored != checksum:
        raise LedgerError(f"run {run_id}: the stored mechanism file failed its checksum: the ledger was modified "
                          "or damaged")
    return mechanism


def audit(url: str | os.PathLike, run_id: int | None = None, *, verify: bool = False,
          head: tuple[int | None, str] | None = None) -> AuditReport:
    """Audit run ``run_id`` (default: the latest) of the ledger at ``url``, read-only; with
    ``verify``, also recompute its hash chain (``report.chain``); with ``head`` (round or None, hash:
    a head recorded outside the ledger, ``chain.parse_head``), verify and check it
    (``report.head_check``, ``chain.check_head``; with ``ChainBroken`` too, as its ``head_check``)."""
    verify = verify or head is not None
    if run_id is not None:
        run_id = checks.positive_int("run_id", run_id)
    resolved = resolve_url(url)

    def read(conn: Connection):
        version = check_version(conn, resolved, allow_empty=False, allow_older=False)
        rows = read_run(conn, resolved, run_id)
        chain = None
        if verify:  # every participation, streamed in primary-key order (one round in memory at a time)
            chain = check_chain(rows.run_values(), rows.records, participation_rows(conn, rows.run.id),
                                rows.committed_rounds)
        return version, rows, chain

    version, rows, chain = read_snapshot(resolved, read)
    head_check = None if head is None else check_head(chain, rows.records, head[0], head[1])
    try:
        report = _report(display_url(resolved), version, rows.run, rows.records, rows.states, rows.norms,
                         *rows.contributions, rows.client_state)
    except LedgerError as e:
        if chain is not None and not chain.ok:
            raise ChainBroken(chain, str(e), head_check) from None
        raise
    report.chain, report.head_check = chain, head_check
    return report


def _rounds_view(records: list, states: list, norms: dict[int, list] | None) -> list[dict[str, Any]]:
    """Every opened round, by index: its committed record, else its (open or aborted) state;
    with diagnostics, the norm summary of a committed round."""
    view = {int(r["round_index"]): {**r, **norm_summary(None if norms is None else norms.get(r["round_index"], []))}
            for r in records}
    blank = {"selected": 0, "contributed": 0, "dropped": 0, "rejected": 0, "noise_std": None,
             "checkpoint_sha256": None, "epsilon_worst_user": None, "epsilon_planned": None, "chain_sha256": None}
    for t, status, attempts in states:
        if int(t) not in view and status != "committed":
            view[int(t)] = {**blank, "round_index": int(t), "status": status, "attempts": attempts}
    return [view[t] for t in sorted(view)]


def _plan_releases(plan: dict):
    """The run's extra Gaussian releases from its recorded plan (``RunPlan.to_dict``), or None."""
    from ..accounting.releases import COUNT, ExtraReleases, GaussianRelease

    adaptive = plan.get("adaptive_clipping") or {}
    metrics = plan.get("client_metrics") or {}
    count = None if adaptive.get("count_noise_std") is None else GaussianRelease(COUNT, 1.0,
                                                                                  float(adaptive["count_noise_std"]))
    metric = None if not metrics else GaussianRelease("client-metrics", float(metrics["clip"]),
                                                      float(metrics["noise_std"]))
    return ExtraReleases.of(count, metric)


def _inflation(secure: Any, clip_norm: float, adaptive: bool, run_id: int) -> float:
    """The quantization inflation of a secure-aggregation plan (``RunPlan.to_dict``), recomputed from
    its recorded parameters, ζ (1 for adaptive clipping's normalized updates) and dimension
    (``fedmf.secagg.quantize.Quantization.inflation``); refused when the recorded value differs."""
    from ..secagg.errors import SecAggError
    from ..secagg.params import SecureAggregation
    from ..secagg.quantize import Quantization

    try:
        params, dim = SecureAggregation.params_from_dict(secure)
        inflation = Quantization(clip_norm=1.0 if adaptive else clip_norm, scale=params.scale, bits=params.bits,
                                 dim=dim, beta=params.beta, with_bit=adaptive).inflation
        recorded = secure["inflation"]
    except (SecAggError, KeyError, TypeError, ValueError) as e:
        raise LedgerError(f"run {run_id}: malformed secure-aggregation plan ({e})") from None
    if recorded != inflation:
        raise LedgerError(f"run {run_id}: the recorded quantization inflation {recorded!r} is not the {inflation!r} "
                          "its secure-aggregation parameters give")
    return inflation


def clip_norm_violations(adaptive: Any, clip_norm: float, expected_users: Any, committed: list) -> list[int]:
    """The committed rounds whose recorded ζₜ does not follow adaptive clipping's rule: ζ₀ = the plan's
    clip norm, ζₜ₊₁ = next_clip_norm(ζₜ, b̃ₜ, m) (within ζ₀'s range) from the recorded noisy counts (Andrew et al., Alg. 1);
    a round without its ζₜ or b̃ₜ, or a plan whose rule cannot be read, violates it."""
    from ..errors import FedmfError
    from ..round.adaptive_clipping import AdaptiveClipping

    try:
        rule = AdaptiveClipping.from_dict(adaptive)
        m = checks.positive("expected_users", expected_users)
    except FedmfError:
        return [int(r["round_index"]) for r in committed] or [0]
    bad, expected = [], float(clip_norm)
    for r in committed:
        t, zeta, noisy = int(r["round_index"]), r.get("clip_norm"), r.get("noisy_unclipped")
        if zeta is None or noisy is None or abs(zeta - expected) > _REL_TOL * expected:
            bad.append(t)
        if zeta is None or noisy is None:
            break  # the rest of the sequence cannot be followed
        expected = rule.next_clip_norm(zeta, noisy, m, initial_clip_norm=float(clip_norm))
    return bad


def clip_norm_warnings(adaptive: Any, clip_norm: float, committed: list) -> list[str]:
    """``adaptive_clipping.trajectory_warnings`` of the recorded ζ sequence (ζ at a bound for many rounds,
    or rising round after round); none where the rule cannot be read (``clip_norm_violations`` says so)."""
    from ..errors import FedmfError
    from ..round.adaptive_clipping import AdaptiveClipping, trajectory_warnings

    try:
        rule = AdaptiveClipping.from_dict(adaptive)
    except FedmfError:
        return []
    rows = [r for r in committed if r.get("clip_norm") is not None]
    return trajectory_warnings([r["clip_norm"] for r in rows], [int(r["round_index"]) for r in rows],
                               float(clip_norm), rule.clip_norm_range, rule.max_growth)


def _report(ledger: str, version: str, run: Run, records: list, states: list, norms: dict[int, list] | None,
            unique: np.ndarray, users: np.ndarray, r_sorted: np.ndarray, state: list) -> AuditReport:
    info = RunInfo.from_row(run)
    rounds = _rounds_view(records, states, norms)
    mechanism = _mechanism_from_document(run.mechanism_document, run.mechanism_checksum, info.id)
    schema = schema_from_dict(run.participation_schema)
    n = info.rounds
    if mechanism.rounds != n:
        raise LedgerError(f"run {info.id}: the stored mechanism has {mechanism.rounds} rounds, the run {n}")
    b, k = schema.min_sep, schema.participations(n)
    committed = [r["round_index"] for r in rounds if r["status"] == "committed"]
    last = max(committed) if committed else None
    if r_sorted.size and (r_sorted.min() < 0 or r_sorted.max() >= n):
        raise LedgerError(f"run {info.id}: a participation lies outside the run's {n} rounds")
    if rounds and not 0 <= rounds[0]["round_index"] <= rounds[-1]["round_index"] < n:
        raise LedgerError(f"run {info.id}: a round lies outside the run's {n} rounds")
    n_users = len(unique)
    z, delta = info.noise_multiplier, info.delta
    adaptive = (info.plan or {}).get("adaptive_clipping") or {}
    releases = _plan_releases(info.plan or {})
    priv = run_privacy(mechanism, schema, z, delta, users, r_sorted, n_users,
                       labels=[key.tobytes().hex() for key in unique],
                       count_noise_std=None if releases is None else releases.unit_std)
    s_plan = priv.sensitivity_plan
    upto = (last + 1) if last is not None else 0

    # realized separation and participations, per user and after each round
    big = np.iinfo(np.int64).max
    bounds = np.searchsorted(users, np.arange(n_users + 1))
    counts = np.diff(bounds)
    same = users[1:] == users[:-1]
    gaps = np.where(same, r_sorted[1:] - r_sorted[:-1], big)
    user_min_gap = np.full(n_users, big)
    np.minimum.at(user_min_gap, users[1:], gaps)
    min_gap_by_round = np.full(n, big)
    np.minimum.at(min_gap_by_round, r_sorted[1:][same], gaps[same])
    min_gap_by_round = np.minimum.accumulate(min_gap_by_round)
    ordinal = np.arange(len(users)) - bounds[users] + 1
    max_part_by_round = np.zeros(n, dtype=np.int64)
    np.maximum.at(max_part_by_round, r_sorted, ordinal)
    max_part_by_round = np.maximum.accumulate(max_part_by_round)

    # users who broke the plan: fedmf.accounting.posthoc accounted every user
    flagged = []
    for u, account in enumerate(priv.posthoc.users):
        if account.violation is None:
            continue
        flagged.append({
            "user": account.user[:16],
            "participations": int(counts[u]),
            "min_separation": None if user_min_gap[u] == big else int(user_min_gap[u]),
            "rounds": list(account.rounds),
            "sensitivity": account.sensitivity,
            "sensitivity_exact": account.sensitivity_exact,
            "epsilon": account.epsilon,
            "reasons": [account.violation],
        })
    flagged.sort(key=lambda f: (-f["epsilon"], f["user"]))
    # the eligibility table must agree with the participations it was derived from
    last_round = r_sorted[bounds[1:] - 1] if n_users else np.zeros(0, np.int64)
    state_keys = np.frombuffer(b"".join(bytes(k) for k, _, _ in state), dtype=np.uint8).reshape(-1, 32)
    consistent = (len(state) == n_users and bool(np.array_equal(state_keys, unique))
                  and [(c, lr) for _, c, lr in state] == list(zip(counts.tolist(), last_round.tolist())))
    eps_end = priv.posthoc.epsilon  # the worst user's

    # secure aggregation: σ from ζ_eff = ζ·inflation (fedmf.secagg.sensitivity), as the rounds drew it
    secure = (info.plan or {}).get("secure_aggregation")
    inflation = 1.0 if secure is None else _inflation(secure, info.clip_norm,
                                                      (info.plan or {}).get("adaptive_clipping") is not None, info.id)
    # absolute, like rounds.noise_std: sigma = z · clip_norm_eff · sens
    planned_std = z * info.clip_norm * inflation * s_plan
    adaptive = (info.plan or {}).get("adaptive_clipping")
    rows = []
    below = []
    for r in rounds:
        t = r["round_index"]
        done = r["status"] == "committed"
        # adaptive clipping: round t's planned std is z·ζₜ·sens at its recorded ζₜ
        zeta_t = r.get("clip_norm") if adaptive is not None else None
        std_t = planned_std if zeta_t is None else z * zeta_t * inflation * s_plan
        if done and r["noise_std"] is not None and r["noise_std"] < std_t * (1 - _REL_TOL):
            below.append(t)
        rows.append({
            "round": t, "status": r["status"], "attempts": r["attempts"], "selected": r["selected"],
            "contributed": r["contributed"], "dropped": r["dropped"], "rejected": r["rejected"],
            "noise_std": r["noise_std"],
            "sensitivity_worst_user": float(priv.worst_by_round[t]) if done else None,
            "epsilon_worst_user": float(priv.epsilon_worst_by_round[t]) if done else None,
            "sensitivity_planned": float(priv.plan_by_round[t]) if done else None,
            "epsilon_planned": float(priv.epsilon_plan_by_round[t]) if done else None,
            RECORDED_WORST_COLUMN: r["epsilon_worst_user"],
            "recorded_epsilon_planned": r["epsilon_planned"],
            "min_separation": None if min_gap_by_round[t] == big else int(min_gap_by_round[t]),
            "max_participations": int(max_part_by_round[t]),
            "checkpoint_sha256": r["checkpoint_sha256"], "chain_sha256": r["chain_sha256"],
            **({c: r.get(c) for c in ADAPTIVE_COLUMNS} if adaptive is not None else {}),
            **({c: r.get(c) for c in DIAGNOSTIC_COLUMNS} if info.diagnostics else {}),
        })

    if all(row[RECORDED_WORST_COLUMN] is None for row in rows):  # never recorded: no always-empty column
        for row in rows:
            del row[RECORDED_WORST_COLUMN]
    realized_gap = int(user_min_gap.min()) if n_users and user_min_gap.min() != big else None
    hist = {int(c): int(v) for c, v in enumerate(np.bincount(counts)) if c > 0 and v > 0} if n_users else {}
    planned = {
        "schema": schema.name, "min_sep": b, "max_participations": k,
        "sensitivity": s_plan, "sensitivity_method": priv.sensitivity_plan_method,
        "sensitivity_exact": priv.sensitivity_plan_exact, "curve_method": priv.plan_curve_method,
        "curve_exact": priv.plan_curve_exact, "epsilon": priv.epsilon_plan, "target_epsilon": info.target_epsilon, "noise_std": planned_std,
        "rho": priv.rho_plan,
    }
    if adaptive:
        planned["count_noise_std"] = adaptive.get("count_noise_std")
    if secure is not None:
        planned["secure_aggregation"] = {**secure, "clip_norm_effective": info.clip_norm * inflation}
    if releases is not None and not releases.count_only:
        # each release's share of the extra releases' part of μ² (= of ρ), and that part's share of the whole
        planned["extra_releases"] = releases.to_list()
        extra_share = (k / releases.unit_std**2) / (1.0 / z**2 + k / releases.unit_std**2)
        planned["privacy_split"] = {"mf": 1.0 - extra_share,
                                    **{name: extra_share * f for name, f in releases.shares().items()}}
    realized = {
        "rounds_committed": len(committed), "last_committed_round": last,
        "rounds_aborted": sum(1 for r in rounds if r["status"] == "aborted"),
        "rounds_open": sum(1 for r in rounds if r["status"] == "open"),
        "aborts": sum(max(r["attempts"] - 1, 0) + (r["status"] == "aborted") for r in rounds),
        "users": n_users, "contributions": int(len(users)),
        "min_separation": realized_gap, "max_participations": int(counts.max()) if n_users else 0,
        "worst_user_sensitivity": float(priv.user_sensitivity.max()) if n_users else 0.0,
        "sensitivity_exact": priv.observed_exact,
        "epsilon_worst_user": float(priv.epsilon_worst_by_round[upto - 1]) if upto else None,
        "epsilon_planned_so_far": float(priv.epsilon_plan_by_round[upto - 1]) if upto else None,
        "epsilon_worst_user_at_end": eps_end,
        "rho_worst_user_at_end": float(priv.rho_user.max()) if n_users else 0.0,
        "flagged_users": len(flagged),
        "rounds_below_planned_noise": below,
        "client_state_consistent": consistent,
    }
    if adaptive is not None:
        expected_users = (info.plan or {}).get("expected_users")
        committed_rows = [r for r in rounds if r["status"] == "committed"]
        realized["clip_norm_rule"] = clip_norm_violations(adaptive, info.clip_norm, expected_users, committed_rows)
        realized["clip_norm_warnings"] = clip_norm_warnings(adaptive, info.clip_norm, committed_rows)
    run_dict = info.to_dict()
    return AuditReport(ledger, version, run_dict, planned, realized, hist, flagged, rows)

