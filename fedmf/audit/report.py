"""The audit's report of a recorded run: its round columns, its JSON form, its CSV, its plot and
its human-readable summary (``fedmf audit``). ``fedmf.audit.replay`` fills it from the ledger; nothing
here reads the ledger or recomputes privacy.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from typing import Any

from ..files import atomic_write
from ..ledger.chain import ChainCheck, HeadCheck

__all__ = ["AuditReport", "ROUND_COLUMNS", "RECORDED_WORST_COLUMN", "DIAGNOSTIC_COLUMNS", "ADAPTIVE_COLUMNS"]

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
        secure = p.get("secure_aggregation")
        if secure is not None:  # σ from ζ_eff = ζ·inflation: ε as planned, the noise larger
            graph = ("degree and threshold derived from each round's cohort" if secure["degree"] == 0
                     else f"degree {secure['degree']}, threshold {secure['threshold']}")
            out.insert(3, f"secure aggregation  SecAgg+: {graph}, "
                          f"modulo 2^{secure['bits']}, scale {secure['scale']:g}; quantization inflation "
                          f"{secure['inflation']:.9g}: ζ_eff = {secure['clip_norm_effective']:.6g}, noise std "
                          f"{p['noise_std']:.6g}")
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
