"""Adaptive clipping that cannot run away (issue 33): ζₜ never leaves [ζ₀/R, ζ₀·R] (default R = 10),
the audit replays the clamped rule exactly and warns when ζ sits at a bound or keeps rising, resume is
bit-exact with ζ at its bound, plans written before R existed keep their fingerprints and their R (10⁶),
and the configuration, the CLI and a reduced so-tiny run follow it."""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch

from fedmf import MinSep, Workload
from fedmf.audit.replay import audit
from fedmf.config import DEFAULTS, RunConfig
from fedmf.errors import ConfigError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import (
    AT_BOUND_ROUNDS,
    DEFAULT_CLIP_NORM_RANGE,
    GROWTH_ROUNDS,
    LEGACY_CLIP_NORM_RANGE,
    AdaptiveClipping,
    trajectory_warnings,
)
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from tests import _federated_task as task

SEED = b"adaptive-range-test-seed"


def _plan(rounds: int, m: int, *, clip_norm: float, z: float = 1.0, **adaptive) -> RunPlan:
    schema = MinSep(1, rounds)
    return RunPlan.create(build("dp-sgd", rounds, schema, Workload()), schema, clip_norm=clip_norm, delta=1e-5,
                          expected_users=m, noise_multiplier=z,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=m, **adaptive))


def _spread(d: int, norm: float) -> dict[str, torch.Tensor]:
    """An update of ℓ2 norm ``norm`` spread over d coordinates (ℓ∞ = norm/√d: never zeroed here)."""
    return {"w": torch.full((d,), norm / math.sqrt(d), dtype=torch.float64)}


# ---- the rule -----------------------------------------------------------------------------------

def test_the_default_range_is_one_decade_either_way_and_the_rule_is_the_clamped_geometric_step():
    rule = AdaptiveClipping.create(0.5, expected_users=40, learning_rate=0.2)
    assert rule.clip_norm_range == DEFAULT_CLIP_NORM_RANGE == 10.0
    assert rule.clip_norm_bounds(0.1) == (0.1 / 10, 0.1 * 10)
    # inside the range: Andrew et al.'s step exactly; outside: the bound exactly
    assert rule.next_clip_norm(0.5, 8.0, 40, initial_clip_norm=0.1) == 0.5 * math.exp(-0.2 * (8.0 / 40 - 0.5))
    assert rule.next_clip_norm(0.99, 0.0, 40, initial_clip_norm=0.1) == 1.0  # 0.99·e^0.1 > 1
    assert rule.next_clip_norm(0.0101, 40.0, 40, initial_clip_norm=0.1) == 0.01
    for bad in (0.5, 0.0, -1.0, 2e6, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="clip_norm_range"):
            AdaptiveClipping.create(0.5, expected_users=40, clip_norm_range=bad)


@pytest.mark.parametrize("factor", [3.0, 1e-3])
def test_zeta_never_leaves_its_range_when_every_update_is_clipped_or_none_is(factor):
    """The runaway's worst case: each round's updates are ``factor`` × ζₜ (growing with ζ, as the noise
    grows the update norms), all clipped (3) or all unclipped (1e-3), with a fast η = 1: ζ reaches
    the bound ζ₀·10 or ζ₀/10 and stays exactly there."""
    rounds, m, d, zeta0 = 40, 20, 16, 0.1
    privatizer = RoundPrivatizer(_plan(rounds, m, clip_norm=zeta0, learning_rate=1.0), {"w": (d,)},
                                 dtype=torch.float64, seed=SEED, repeatable_noise=True)
    zetas = []
    for t in range(rounds):
        zetas.append(privatizer.clip_norm)
        privatizer.privatize(t, {f"u{i:02d}": _spread(d, factor * privatizer.clip_norm) for i in range(m)})
    low, high = zeta0 / 10, zeta0 * 10
    assert all(low <= z <= high for z in zetas + [privatizer.clip_norm])
    bound = high if factor > 1 else low
    assert zetas[-20:] == [bound] * 20  # reached the bound within 20 rounds and never left it
    warnings = trajectory_warnings(zetas, list(range(rounds)), zeta0, 10.0)
    assert len(warnings) == 1 and ("upper" if factor > 1 else "lower") in warnings[0]


def test_a_legacy_plan_keeps_its_fingerprint_and_range():
    """A plan written before R existed has no ``clip_norm_range`` key: it reads back with R = 10⁶ (the
    rule it ran under) and its to_dict, hence its fingerprint, is the same as before."""
    rule = AdaptiveClipping.create(0.5, expected_users=10, count_noise_std=2.0)
    legacy = {"target_quantile": 0.5, "learning_rate": 0.2, "count_noise_std": 2.0}
    old = AdaptiveClipping.from_dict(legacy)
    assert old.clip_norm_range == LEGACY_CLIP_NORM_RANGE and old.to_dict() == legacy
    assert rule.to_dict() == {**legacy, "clip_norm_range": 10.0}
    assert AdaptiveClipping.from_dict(rule.to_dict()) == rule
    plan = _plan(8, 10, clip_norm=1.0, count_noise_std=2.0)
    legacy_plan = RunPlan.create(plan.mechanism, plan.schema, clip_norm=1.0, delta=1e-5, expected_users=10,
                                 noise_multiplier=1.0, adaptive_clipping=old)
    assert plan.fingerprint != legacy_plan.fingerprint
    assert RunPlan.from_dict(legacy_plan.to_dict(), plan.mechanism).fingerprint == legacy_plan.fingerprint
    assert RunPlan.from_dict(plan.to_dict(), plan.mechanism) == plan


def test_the_range_does_not_change_the_accounting():
    """R is post-processing: ε and ρ are those of the same plan with the legacy range."""
    wide = _plan(24, 10, clip_norm=1.0, z=2.0, count_noise_std=3.0, clip_norm_range=LEGACY_CLIP_NORM_RANGE)
    narrow = _plan(24, 10, clip_norm=1.0, z=2.0, count_noise_std=3.0, clip_norm_range=1.5)
    assert narrow.epsilon() == wide.epsilon() and narrow.rho() == wide.rho()
    assert narrow.noise_multiplier == wide.noise_multiplier


# ---- trajectory warnings --------------------------------------------------------------------------

def test_trajectory_warnings_flag_a_bound_streak_and_a_long_rise_but_not_a_settled_run():
    rounds = list(range(60))
    rng = np.random.default_rng(0)
    settled = list(0.1 * np.exp(np.minimum(0.1 * np.arange(60), math.log(3)) + 0.02 * rng.standard_normal(60)))
    assert trajectory_warnings(settled, rounds, 0.1, 10.0) == []
    rising = [0.1 * math.exp(0.1 * t) for t in range(60)]  # the README run before issue 33: ×e^0.1 a round
    (line,) = trajectory_warnings(rising, rounds, 0.1, 1e6)
    assert "rose in each of 59 consecutive rounds (0–59" in line
    clamped = [min(z, 1.0) for z in rising]  # the same with R = 10: 23 rises, then the bound from round 24
    (line,) = trajectory_warnings(clamped, rounds, 0.1, 10.0)
    assert line.startswith("ζ sat at its upper bound 1 (ζ₀ · 10) for 36 rounds (24–59)")
    short = clamped[:24 + AT_BOUND_ROUNDS - 1]
    assert trajectory_warnings(short, rounds[:len(short)], 0.1, 10.0) == []
    climb = [0.1 * 1.01 ** t for t in range(GROWTH_ROUNDS)]
    assert trajectory_warnings(climb, list(range(GROWTH_ROUNDS)), 0.1, 10.0) == []
    assert len(trajectory_warnings(climb + [climb[-1] * 1.01], list(range(GROWTH_ROUNDS + 1)), 0.1, 10.0)) == 1


# ---- a run: the audit replays the clamp, resume is bit-exact at the bound -------------------------

def _big_update(params, user, t):
    """Every user sends 15.8 × ζ₀ (ℓ∞ = 5 ζ₀ < 100 ζ₀/R): clipped at any ζ in the range, never zeroed."""
    return {name: torch.full_like(p, 5.0) for name, p in params.items()}


def _bounded_plan():
    return task.plan(adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, learning_rate=0.5,
                                                                clip_norm_range=2.0))


def test_the_audit_replays_the_clamped_rule_warns_at_the_bound_and_resume_is_bit_exact(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    task.write_secrets(whole)
    task.write_secrets(parts)
    model = task.Tiny()
    train(model, task.users(), _bounded_plan(), _big_update, checkpoint_dir=whole, rounds=16, repeatable_noise=True)
    report = audit(whole / "ledger.db", verify=True)
    zetas = [r["clip_norm"] for r in report.rounds]
    assert zetas[0] == 1.0 and max(zetas) == 2.0 and zetas[-10:] == [2.0] * 10
    assert report.realized["clip_norm_rule"] == []  # the replay clamps as the run did
    (warning,) = report.realized["clip_norm_warnings"]
    assert "upper bound 2 (ζ₀ · 2)" in warning
    assert any(line.startswith("WARNING") and "upper bound" in line for line in report.lines())
    # the same ledger replayed with the legacy range would not follow: the clamp is what the audit checks
    legacy = {k: v for k, v in _bounded_plan().adaptive_clipping.to_dict().items() if k != "clip_norm_range"}
    from fedmf.audit.replay import clip_norm_violations

    replay = [{**r, "round_index": r["round"]} for r in report.rounds]
    assert clip_norm_violations(_bounded_plan().adaptive_clipping.to_dict(), 1.0, 10, replay) == []
    assert clip_norm_violations(legacy, 1.0, 10, replay) != []

    def fail(event, t):
        if (event, t) == ("stepped", 9):
            raise RuntimeError("crash in round 9")

    with pytest.raises(RuntimeError, match="crash in round 9"):
        train(task.Tiny(), task.users(), _bounded_plan(), _big_update, checkpoint_dir=parts, rounds=16,
              repeatable_noise=True, on_event=fail)
    resumed = task.Tiny()
    train(resumed, task.users(), _bounded_plan(), _big_update, checkpoint_dir=parts, rounds=16,
          repeatable_noise=True)

    def rows(directory):
        with sqlite3.connect(directory / "ledger.db") as conn:
            return conn.execute("SELECT round_index, selected, contributed, noise_std, clip_norm, noisy_unclipped "
                                "FROM rounds ORDER BY round_index").fetchall()

    assert rows(whole) == rows(parts)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_a_settled_run_has_no_warning(tmp_path):
    """The tiny task's own updates (norms well inside [ζ₀/10, ζ₀·10]): ζ moves, no bound, no warning."""
    run = tmp_path / "run"
    plan = task.plan(adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, learning_rate=0.5))
    train(task.Tiny(), task.users(), plan, task.local_update, checkpoint_dir=run, rounds=12)
    report = audit(run / "ledger.db")
    assert report.realized["clip_norm_rule"] == [] and report.realized["clip_norm_warnings"] == []
    assert not any(line.startswith("WARNING") for line in report.lines())


# ---- configuration and CLI -------------------------------------------------------------------------

def test_the_range_is_a_config_key_and_a_simulate_flag(tmp_path, capsys):
    from fedmf.cli import main

    assert DEFAULTS["adaptive-clipping-range"] == 10.0
    plan = RunConfig.from_mapping({"adaptive-clipping": 0.5, "adaptive-clipping-range": 4.0,
                                   "run-dir": str(tmp_path)}).build_plan()
    assert plan.adaptive_clipping.clip_norm_range == 4.0
    default = RunConfig.from_mapping({"adaptive-clipping": 0.5, "run-dir": str(tmp_path)}).build_plan()
    assert default.adaptive_clipping.clip_norm_range == 10.0
    for bad in (0.5, 0.0, -2.0, "wide", 1e7):
        with pytest.raises(ConfigError, match="adaptive-clipping-range"):
            RunConfig.from_mapping({"adaptive-clipping": 0.5, "adaptive-clipping-range": bad,
                                    "run-dir": str(tmp_path)})
    for argv in (["--adaptive-clipping-range", "4"],
                 ["--adaptive-clipping", "0.5", "--adaptive-clipping-range", "0.5"]):
        assert main(["simulate", "--preset", "tiny", "--out", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--adaptive-clipping" in err[0]
    assert not (tmp_path / "x").exists()


# ---- the feedback loop itself, fast: update norms that grow with the noise ------------------------

def test_norms_that_grow_with_the_noise_do_not_take_zeta_past_its_bound():
    """A model of the measured loop (EXPERIMENTS.md): each round's update norms are 1.8 plus 10 × the
    previous round's released noise norm, so a larger ζ (larger noise z·ζ·sens) makes larger norms
    that stay ahead of ζ. With R = 10⁶ (before issue 33) ζ climbs 0.1 → ~4.9 in 40 rounds, as the
    README run did (→ 5.1); with the default R = 10 it stops at exactly 1 and the warning names the bound."""
    rounds, m, d, zeta0 = 40, 40, 64, 0.1

    def run(clip_norm_range):
        plan = _plan(rounds, m, clip_norm=zeta0, z=0.75, count_noise_std=2.0, clip_norm_range=clip_norm_range)
        privatizer = RoundPrivatizer(plan, {"w": (d,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
        zetas, noise_norm = [], 0.0
        for t in range(rounds):
            zetas.append(privatizer.clip_norm)
            norm = 1.8 + 10.0 * noise_norm  # ≈ 1.8 + 1.5·ζ > ζ: every update is clipped
            mean, _ = privatizer.privatize(t, {f"u{i:02d}": _spread(d, norm) for i in range(m)})
            noise_norm = float((mean["w"] - zetas[-1] / math.sqrt(d)).norm())  # the clipped mean is ζ·direction
        return zetas

    legacy = run(LEGACY_CLIP_NORM_RANGE)  # ×e^{ηγ} = e^0.1 a round: 0.1·e^3.9 = 4.9
    assert legacy[-1] > 4.0 and all(b > a for a, b in zip(legacy, legacy[1:]))
    assert "rose in each of 39" in trajectory_warnings(legacy, list(range(rounds)), zeta0, LEGACY_CLIP_NORM_RANGE)[0]
    bounded = run(DEFAULT_CLIP_NORM_RANGE)
    assert max(bounded) == 1.0 and bounded[-1] == 1.0 and bounded[:24] == legacy[:24]
    (line,) = trajectory_warnings(bounded, list(range(rounds)), zeta0, DEFAULT_CLIP_NORM_RANGE)
    assert "upper bound 1 (ζ₀ · 10)" in line


# ---- a reduced so-tiny run of the README example ---------------------------------------------------

@pytest.mark.heavy
def test_the_readme_adaptive_example_does_not_run_away(tmp_path):
    """The README's so-tiny adaptive example (γ 0.5, ζ₀ = the preset's 1 as a ceiling: G 1, η 0.2, σ_b 12) over
    its 40 rounds: before issue 33 (ζ₀ 0.1, η 0.2, σ_b 2, no range) ζ went 0.1 → 5.1 and the held-out loss 7.60 →
    26.3 (EXPERIMENTS.md); now ζ stays within [0.1, 1], at the ceiling 1 in most rounds (every update is
    clipped; a count above γ·m, σ_b/m = 0.3, pulls it under 1 for a round), the audit follows the rule and warns
    that ζ sat at its ceiling, and the loss ends below the initial model's. About 1–10 min on 2 (shared) cores."""
    from fedmf.run.simulate import preset_values
    from fedmf.tasks import ClientHyper, get_task

    torch.set_num_threads(1)
    run = tmp_path / "run"
    values = preset_values("so-tiny", {"adaptive-clipping": 0.5, "adaptive-clipping-max-growth": 1.0,
                                       "adaptive-clipping-count-noise": 12.0, "run-dir": str(run)})
    config = RunConfig.from_mapping(values)
    assert config.clip_norm == 1.0
    so_tiny = get_task(config.task, **config.task_options)
    model = so_tiny.model()
    with torch.no_grad():
        initial = float(so_tiny.evaluate(model)["loss"])
    hyper = ClientHyper(config.client_lr, config.local_epochs, config.batch_size)
    train(model, so_tiny.users(), config.build_plan(), so_tiny.as_local_update(hyper), server_lr=config.server_lr,
          checkpoint_dir=run)
    report = audit(run / "ledger.db")
    zetas = [r["clip_norm"] for r in report.rounds]
    assert len(zetas) == config.rounds and all(0.1 <= z <= 1.0 for z in zetas)
    assert report.realized["clip_norm_rule"] == [] and zetas[0] == 1.0
    assert sum(z == 1.0 for z in zetas) >= 30  # 38–40 of 40 in the three recorded runs (EXPERIMENTS.md)
    assert any("ceiling" in line for line in report.realized["clip_norm_warnings"])
    with torch.no_grad():
        final = so_tiny.evaluate(model)
    assert math.isfinite(final["loss"]) and final["loss"] < initial


def test_the_simulate_summary_warns_when_zeta_sits_at_its_bound(tmp_path, capsys):
    """R = 1 pins ζ at ζ₀ (both bounds): after 10 rounds there, the summary says so (and the audit)."""
    from fedmf.cli import main

    out = tmp_path / "sim"
    argv = ["simulate", "--preset", "tiny", "--rounds", "10", "--epsilon", "6", "--clip-norm", "0.05",
            "--adaptive-clipping", "0.5", "--adaptive-clipping-count-noise", "2", "--adaptive-clipping-range", "1",
            "--out", str(out), "--quiet", "--no-plot"]
    assert main(argv) == 0
    summary = capsys.readouterr().out.splitlines()
    warnings = [line for line in summary if line.startswith("warning")]
    assert len(warnings) == 2 and "upper bound 0.05" in warnings[0] and "lower bound 0.05" in warnings[1]
    report = audit(out / "ledger.db")
    assert report.realized["clip_norm_rule"] == [] and len(report.realized["clip_norm_warnings"]) == 2
    assert {r["clip_norm"] for r in report.rounds} == {0.05}
