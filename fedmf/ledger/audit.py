"""The read-only privacy audit of a recorded run (``fedmf audit``).

It opens the ledger read-only (SQLite ``mode=ro``; PostgreSQL READ ONLY transactions),
reads one consistent snapshot of a run, and recomputes from the participations alone:
the worst user's ε and the plan's ε after every committed round, the realized minimum
separation and maximum participations, the participation histogram and the users who
broke the plan (there are none when the server enforced it). With ``verify`` it also
recomputes the hash chain (``fedmf.ledger.chain``) and names the first round that does not
match. Nothing is ever written to the ledger, nor beside a SQLite ledger
(``db.read_snapshot``); the CSV and PNG files are written only after the audit succeeded.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy.engine import Connection

from .. import checks
from ..files import atomic_write
from ..mechanisms.base import Mechanism
from ..participation import schema_from_dict
from .chain import ChainCheck, HeadCheck, check_chain, check_head
from .db import LedgerError, check_version, display_url, read_snapshot, resolve_url
from .models import Run
from .privacy import run_privacy
from .queries import RunInfo, norm_summary, participation_rows, read_run

__all__ = ["AuditReport", "audit", "ROUND_COLUMNS", "RECORDED_WORST_COLUMN", "DIAGNOSTIC_COLUMNS", "ADAPTIVE_COLUMNS",
           "ChainBroken", "clip_norm_violations", "clip_norm_warnings"]

ROUND_COLUMNS = [
    "round", "status", "attempts", "selected", "contributed", "dropped", "rejected",
    "noise_std", "sensitivity_worst_user", "epsilon_worst_user", "sensitivity_planned", "epsilon_planned",
    "recorded_epsilon_planned", "min_separation", "max_participations",
    "checkpoint_sha256", "chain_sha256",
]
#: the worst user's ε as the writer recorded it in the ledger: fedmf's server does not record it (the
#: audit recomputes it, ``epsilon_worst_user``), so the column appears only for a ledger that has it
RECORDED_WORST_COLUMN = "recorded_epsilon_worst_user"
#: diagnostics (outside the DP guarantee): in the rows and the CSV only for runs that record them
DIAGNOSTIC_COLUMNS = ["clipped", "norm_min", "norm_median", "norm_mean", "norm_max"]
#: adaptive clipping's per-round ζₜ and released noisy count: in the rows and the CSV only for adaptive runs
ADAPTIVE_COLUMNS = ["clip_norm", "noisy_unclipped"]
_REL_TOL = 1e-9


class ChainBroken(LedgerError):
    """``audit(verify=True)`` of a run whose chain does not match and whose rows could not even
    be audited (e.g. a rewritten mechanism): the verification failure, not bad input."""

    def __init__(self, chain: ChainCheck, message: str, head_check: HeadCheck | None = None) -> None:
        super().__init__(message)
        self.chain, self.head_check = chain, head_check


@dataclass
class AuditReport:
    ledger: str
    schema_version: str
    run: dict[str, Any]
    planned: dict[str, Any]
    realized: dict[str, Any]
    histogram: dict[int, int]
    flagged: list[dict[str, Any]]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    chain: ChainCheck | None = None  # with verify
    head_check: HeadCheck | None = None  # with a recorded head

    @property
    def columns(self) -> list[str]:
        """The CSV's columns: the diagnostics only where the run recorded them, and no column that would
        be empty in every row."""
        recorded = any(row.get(RECORDED_WORST_COLUMN) is not None for row in self.rounds)
        return (ROUND_COLUMNS + ([RECORDED_WORST_COLUMN] if recorded else [])
                + (ADAPTIVE_COLUMNS if "clip_norm_rule" in self.realized else [])
                + (DIAGNOSTIC_COLUMNS if self.run.get("diagnostics") else []))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "ledger": self.ledger,
            "schema_version": self.schema_version,
            "run": self.run,
            "planned": self.planned,
            "realized": self.realized,
            "participation_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "flagged_users": self.flagged,
            "rounds": self.rounds,
        }
        if self.chain is not None:
            out["verify"] = self.chain.to_dict()
        if self.head_check is not None:
            out["head_check"] = self.head_check.to_dict()
        out["chain_head"] = self.chain_head
        return out

    @property
    def chain_head(self) -> str | None:
        """"ROUND:HASH": the stored chain head at the last committed round (-1: the genesis), what an
        auditor records outside the ledger (verified only with ``verify``)."""
        committed = [r for r in self.rounds if r.get("status") == "committed" and r.get("chain_sha256")]
        if committed:
            return f"{committed[-1]['round']}:{committed[-1]['chain_sha256']}"
        genesis = self.run.get("genesis_sha256")
        return None if genesis is None else f"-1:{genesis}"

    # ---- outputs ---------------------------------------------------------------------------
    def write_csv(self, path: str | os.PathLike) -> None:
        def write(f) -> None:
            writer = csv.DictWriter(f, fieldnames=self.columns, lineterminator="\n")
            writer.writeheader()
            for row in self.rounds:
                writer.writerow({k: "" if row.get(k) is None else _csv_value(row[k]) for k in self.columns})

        atomic_write(path, write, text=True)

    def plot(self, path: str | os.PathLike) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        committed = [r for r in self.rounds if r["status"] == "committed"]
        fig = Figure(figsize=(11, 4.2), dpi=110)
        FigureCanvasAgg(fig)
        ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
        t = [r["round"] for r in committed]
        ax.plot(t, [r["epsilon_planned"] for r in committed], color="tab:blue", lw=4, alpha=0.35,
                label="planned: worst pattern the plan allows", zorder=2)
        ax.plot(t, [r["epsilon_worst_user"] for r in committed], color="tab:red", lw=1.4,
                label="worst recorded user", zorder=3)
        rec = [(r["round"], r[RECORDED_WORST_COLUMN]) for r in committed
               if r.get(RECORDED_WORST_COLUMN) is not None]
        if rec:
            ax.plot(*zip(*rec), ls="none", marker=".", ms=3, color="black", label="recorded by the server",
                    zorder=4)
        ax.axhline(self.planned["epsilon"], color="tab:blue", lw=1, ls="--",
                   label=f"plan at the end of the run: ε = {self.planned['epsilon']:.3g}")
        target = self.run.get("target_epsilon")
        if target is not None and abs(target - self.planned["epsilon"]) > 1e-3 * target:
            ax.axhline(target, color="gray", lw=1, ls=":", label=f"target ε = {target:g}")
        ax.set_xlabel("round")
        ax.set_ylabel(f"ε spent (δ = {self.run['delta']:g})")
        ax.set_title(f"run {self.run['id']}: ε after each committed round")
        ax.set_xlim(0, max(self.run["rounds"] - 1, 1))
        ax.set_ylim(0, 1.08 * max([self.planned["epsilon"], target or 0.0]
                                  + [r["epsilon_worst_user"] for r in committed]))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        k = self.planned["max_participations"]
        top = max([k] + list(self.histogram)) + 1
        counts = list(range(1, top))
        values = [self.histogram.get(c, 0) for c in counts]
        bx.bar(counts, values, color=["tab:red" if c > k else "tab:green" for c in counts], width=0.8)
        bx.axvline(k + 0.5, color="gray", ls=":", lw=1, label=f"plan: at most k = {k}")
        bx.set_xlabel("rounds a user took part in")
        bx.set_ylabel("users")
        bx.set_title(f"participation histogram ({self.realized['users']} users)")
        bx.xaxis.get_major_locator().set_params(integer=True)
        bx.set_xlim(0.4, top - 0.4)
        bx.legend(fontsize=8, loc="upper left")
        bx.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, format="png"), text=False)

    def lines(self, max_flagged: int = 10) -> list[str]:
        """The human-readable summary."""
        p, r = self.planned, self.realized
        out = [
            f"ledger              {self.ledger} (schema {self.schema_version})",
            f"run                 {self.run['id']}{' ' + repr(self.run['name']) if self.run['name'] else ''}: "
            f"{self.run['mechanism_kind']}, {self.run['rounds']} rounds, z = {self.run['noise_multiplier']:g}, "
            f"clip {self.run['clip_norm']:g}, δ = {self.run['delta']:g}",
            f"plan                {p['schema']}: min_sep b = {p['min_sep']}, max_participations k = "
            f"{p['max_participations']}, sensitivity {p['sensitivity']:.6g}"
            f"{'' if p['sensitivity_exact'] else ' (upper bound)'}, ε = {p['epsilon']:.6g}, ρ-zCDP = {p['rho']:.6g}"
            + ("" if p.get("count_noise_std") is None else f" (with the adaptive-clipping count, σ_b = "
                                                          f"{p['count_noise_std']:g})")
            + "".join(f" (with the private client-metric release, clip L = {e['sensitivity']:g}, σ_m = "
                      f"{e['noise_std']:g})" for e in p.get("extra_releases", ()) if e["name"] == "client-metrics"),
            f"rounds              {r['rounds_committed']} committed (last {r['last_committed_round']}), "
            f"{r['rounds_aborted']} aborted, {r['rounds_open']} open",
            f"users               {r['users']} ({r['contributions']} contributions)",
            f"realized            min separation {r['min_separation']}, max participations {r['max_participations']}",
            f"ε spent             worst user {_fmt(r['epsilon_worst_user'])} "
            f"(planned so far {_fmt(r['epsilon_planned_so_far'])}, plan at the end {p['epsilon']:.6g}); "
            f"ρ worst user {r['rho_worst_user_at_end']:.6g}",
            "participations      " + ", ".join(f"{c}: {n}" for c, n in sorted(self.histogram.items())),
        ]
        if "privacy_split" in p:  # the share of μ² (of ρ) each release spends, as planned
            out.insert(3, "privacy split       " + ", ".join(f"{name} {share:.4g}" for name, share in
                                                            p["privacy_split"].items()) + " of μ² (ρ)")
        if r["rounds_below_planned_noise"]:
            out.append(f"WARNING             {len(r['rounds_below_planned_noise'])} rounds had noise below the plan's "
                       f"std {p['noise_std']:.6g}: {r['rounds_below_planned_noise'][:10]}")
        if "clip_norm_rule" in r:
            zetas = [row["clip_norm"] for row in self.rounds if row.get("clip_norm") is not None]
            span = f"ζ {zetas[0]:.6g} → {zetas[-1]:.6g}" if zetas else "no round committed"
            rule = r["clip_norm_rule"]
            verdict = ("follows the rule from the noisy counts" if not rule else
                       f"VIOLATES the rule at rounds {rule[:10]}")
            out.append(f"adaptive clipping   {span} over {len(zetas)} rounds; {verdict}")
            out += [f"WARNING             {line}" for line in r.get("clip_norm_warnings", [])]
        if not r["client_state_consistent"]:
            out.append("WARNING             the client_state table (eligibility) disagrees with the participations")
        if self.run.get("diagnostics"):
            out.append("diagnostics         update norms recorded (data-dependent, outside the DP guarantee)")
        if self.chain is not None:
            c = self.chain
            if c.ok:
                out.append(f"hash chain          verified: {c.rounds_verified} rounds, head "
                           f"{'genesis' if c.head_round is None else 'round ' + str(c.head_round)} "
                           f"{c.head_sha256 or c.genesis_sha256}")
            else:
                where = "the run row" if c.first_bad_round == -1 else f"round {c.first_bad_round}"
                out.append(f"hash chain          FAILED at {where}: {c.reason}")
        if self.head_check is not None:
            h = self.head_check
            out.append(f"recorded head       {'matches' if h.ok else 'MISMATCH'} ({h.recorded}): {h.reason}")
        if self.chain_head is not None:
            out.append(f"head to record      {self.chain_head} (keep it outside the ledger; check it later with "
                       f"fedmf audit --verify --head {self.chain_head})"
                       + ("" if self.chain is not None and self.chain.ok else " [not verified: --verify]"))
        out.append(f"flagged users       {r['flagged_users']}")
        for user in self.flagged[:max_flagged]:
            out.append(f"  {user['user']}  participations {user['participations']}, min separation "
                       f"{user['min_separation']}, ε {user['epsilon']:.6g}: {', '.join(user['reasons'])}")
        if len(self.flagged) > max_flagged:
            out.append(f"  … and {len(self.flagged) - max_flagged} more (--json or --csv lists every round)")
        return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _csv_value(v: Any) -> Any:
    return repr(v) if isinstance(v, float) else v


# ---- reading --------------------------------------------------------------------------------

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


def clip_norm_violations(adaptive: Any, clip_norm: float, expected_users: Any, committed: list) -> list[int]:
    """The committed rounds whose recorded ζₜ does not follow adaptive clipping's rule: ζ₀ = the plan's
    clip norm, ζₜ₊₁ = next_clip_norm(ζₜ, b̃ₜ, m) (within ζ₀'s range) from the recorded noisy counts (Andrew et al., Alg. 1);
    a round without its ζₜ or b̃ₜ, or a plan whose rule cannot be read, violates it."""
    from ..adaptive_clipping import AdaptiveClipping
    from ..errors import FedmfError

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
    from ..adaptive_clipping import AdaptiveClipping, trajectory_warnings
    from ..errors import FedmfError

    try:
        rule = AdaptiveClipping.from_dict(adaptive)
    except FedmfError:
        return []
    rows = [r for r in committed if r.get("clip_norm") is not None]
    return trajectory_warnings([r["clip_norm"] for r in rows], [int(r["round_index"]) for r in rows],
                               float(clip_norm), rule.clip_norm_range)


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

    planned_std = z * info.clip_norm * s_plan  # absolute, like rounds.noise_std: sigma = z · clip_norm · sens
    adaptive = (info.plan or {}).get("adaptive_clipping")
    rows = []
    below = []
    for r in rounds:
        t = r["round_index"]
        done = r["status"] == "committed"
        # adaptive clipping: round t's planned std is z·ζₜ·sens at its recorded ζₜ
        zeta_t = r.get("clip_norm") if adaptive is not None else None
        std_t = planned_std if zeta_t is None else z * zeta_t * s_plan
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

