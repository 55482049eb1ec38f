"""Adaptive clipping with a ceiling (issue 33, item 3): ``max_growth`` G bounds ζ above by ζ₀·G (default R),
so with G = 1 the user's ``--clip-norm`` is a ceiling ζ only goes below: a run's noise z·ζₜ·sens is never
above the fixed-ζ₀ run's at the same z, whatever the count or the clients send (at a target ε the count's
share raises z). The bound is post-processing (ε and z as
without it), it is part of the plan (fingerprint, to_dict round trip, old plans unchanged), the audit replays
it, a checkpoint's ζ above it is refused, and the config key and the CLI flag are checked at the edge."""

from __future__ import annotations

import math

import pytest
import torch

from fedmf import MinSep, Workload
from fedmf.audit.replay import audit, clip_norm_violations
from fedmf.config import DEFAULTS, RunConfig
from fedmf.errors import CheckpointError, ConfigError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping, trajectory_warnings
from fedmf.round.clipping import clipping_policy
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from tests import _federated_task as task

SEED = b"adaptive-ceiling-test-seed"


def _plan(rounds: int, m: int, *, clip_norm: float, z: float = 1.0, adaptive: bool = True, **rule) -> RunPlan:
    schema = MinSep(1, rounds)
    clipping = AdaptiveClipping.create(0.5, expected_users=m, **rule) if adaptive else None
    return RunPlan.create(build("dp-sgd", rounds, schema, Workload()), schema, clip_norm=clip_norm, delta=1e-5,
                          expected_users=m, noise_multiplier=z, adaptive_clipping=clipping)


def _spread(d: int, norm: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((d,), norm / math.sqrt(d), dtype=torch.float64)}


def test_the_ceiling_bounds_the_rule_and_defaults_to_the_range():
    rule = AdaptiveClipping.create(0.5, expected_users=40, learning_rate=0.2, clip_norm_range=10.0)
    assert rule.max_growth is None and rule.growth == 10.0 and rule.clip_norm_bounds(0.5) == (0.05, 5.0)
    ceiling = AdaptiveClipping.create(0.5, expected_users=40, learning_rate=0.2, clip_norm_range=10.0, max_growth=1.0)
    assert ceiling.clip_norm_bounds(0.5) == (0.05, 0.5)
    # every update clipped (count 0): the step e^{ηγ} is cut at ζ₀·G exactly; below the ceiling the step is Andrew
    # et al.'s exactly; the floor ζ₀/R is as before
    assert ceiling.next_clip_norm(0.5, 0.0, 40, initial_clip_norm=0.5) == 0.5
    assert ceiling.next_clip_norm(0.3, 0.0, 40, initial_clip_norm=0.5) == 0.3 * math.exp(0.2 * 0.5)
    assert ceiling.next_clip_norm(0.49, 0.0, 40, initial_clip_norm=0.5) == 0.5
    assert ceiling.next_clip_norm(0.0501, 40.0, 40, initial_clip_norm=0.5) == 0.05
    assert rule.next_clip_norm(0.5, 0.0, 40, initial_clip_norm=0.5) == 0.5 * math.exp(0.1)
    assert AdaptiveClipping.create(0.5, expected_users=40, max_growth=10.0) == AdaptiveClipping.create(
        0.5, expected_users=40)  # G = R explicitly is the default rule (one fingerprint)
    grown = AdaptiveClipping.create(0.5, expected_users=40, clip_norm_range=2.0, max_growth=8.0)
    assert grown.clip_norm_bounds(1.0) == (0.5, 8.0)
    for bad in (0.99, 0.0, -1.0, 2e6, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_growth"):
            AdaptiveClipping.create(0.5, expected_users=40, max_growth=bad)


def test_the_ceiling_is_in_the_plan_and_old_plans_keep_their_fingerprints():
    old = _plan(8, 10, clip_norm=1.0, count_noise_std=2.0)
    new = _plan(8, 10, clip_norm=1.0, count_noise_std=2.0, max_growth=1.0)
    assert "max_growth" not in old.adaptive_clipping.to_dict()
    assert new.adaptive_clipping.to_dict()["max_growth"] == 1.0
    assert new.fingerprint != old.fingerprint
    assert RunPlan.from_dict(new.to_dict(), new.mechanism) == new
    assert RunPlan.from_dict(old.to_dict(), old.mechanism).fingerprint == old.fingerprint
    # post-processing: the same ε and z as without the ceiling
    assert new.epsilon() == old.epsilon() and new.noise_multiplier == old.noise_multiplier


def test_with_a_ceiling_the_noise_is_never_above_the_fixed_runs_and_zeta_still_goes_down():
    """The measured feedback loop (norms grow with the released noise, every update clipped), R = 10:
    without a ceiling ζ climbs to ζ₀·R = 10·ζ₀ and the noise std with it; with G = 1 every round's noise
    std is at most the fixed-ζ₀ plan's (the same z), and when the updates are small ζ falls toward them."""
    rounds, m, d, zeta0 = 40, 40, 64, 1.0

    def run(norm_of, **rule):
        plan = _plan(rounds, m, clip_norm=zeta0, z=0.75, count_noise_std=2.0, **rule)
        privatizer = RoundPrivatizer(plan, {"w": (d,)}, dtype=torch.float64, seed=SEED, repeatable_noise=True)
        zetas, stds, noise_norm = [], [], 0.0
        for t in range(rounds):
            zeta = privatizer.clip_norm
            zetas.append(zeta)
            mean, report = privatizer.privatize(t, {f"u{i:02d}": _spread(d, norm_of(zeta, noise_norm))
                                                    for i in range(m)})
            stds.append(report.noise_std)
            noise_norm = float((mean["w"] - min(zeta, norm_of(zeta, noise_norm)) / math.sqrt(d)).norm())
        return zetas, stds, plan

    def loop(zeta, noise_norm):
        return 1.8 + 10.0 * noise_norm

    fixed = _plan(rounds, m, clip_norm=zeta0, z=0.75, adaptive=False)
    fixed_std = fixed.noise_std
    free, free_stds, plan = run(loop)
    assert max(free) == 10.0 and max(free_stds) > 9 * fixed_std
    capped, capped_stds, plan = run(loop, max_growth=1.0)
    assert plan.noise_multiplier == fixed.noise_multiplier
    assert max(capped) == zeta0 and all(s <= fixed_std * (1 + 1e-12) for s in capped_stds)
    (line,) = trajectory_warnings(capped, list(range(rounds)), zeta0, 10.0, 1.0)
    assert "upper bound 1 (ζ₀ · 1)" in line and "ceiling" in line
    small, _, _ = run(lambda zeta, noise_norm: 0.2, max_growth=1.0)
    assert small[0] == zeta0 and small[-1] < 0.35 and all(b <= a for a, b in zip(small[:10], small[1:11]))


def _big_update(params, user, t):
    return {name: torch.full_like(p, 5.0) for name, p in params.items()}


def test_the_audit_replays_the_ceiling_and_a_checkpoint_above_it_is_refused(tmp_path):
    run = tmp_path / "run"
    task.write_secrets(run)
    rule = AdaptiveClipping.create(0.5, expected_users=10, learning_rate=0.5, clip_norm_range=4.0, max_growth=1.0)
    plan = task.plan(adaptive_clipping=rule)
    train(task.Tiny(), task.users(), plan, _big_update, checkpoint_dir=run, rounds=12)
    report = audit(run / "ledger.db")
    assert [r["clip_norm"] for r in report.rounds] == [1.0] * 12  # every update clipped: ζ held at the ceiling
    assert report.realized["clip_norm_rule"] == []
    assert "ceiling" in report.realized["clip_norm_warnings"][0]
    rows = [{**r, "round_index": r["round"]} for r in report.rounds]
    # the same ledger read under the rule without the ceiling does not follow (ζ would have grown)
    no_ceiling = {k: v for k, v in rule.to_dict().items() if k != "max_growth"}
    assert clip_norm_violations(rule.to_dict(), 1.0, 10, rows) == []
    assert clip_norm_violations(no_ceiling, 1.0, 10, rows) != []
    policy = clipping_policy(plan)
    assert policy.read_state({"adaptive_clipping": {"clip_norm": 0.25}}) == 0.25
    with pytest.raises(CheckpointError, match=r"outside the rule's range \[0.25, 1\]"):
        policy.read_state({"adaptive_clipping": {"clip_norm": 1.5}})


def test_the_ceiling_is_a_config_key_and_a_simulate_flag(tmp_path, capsys):
    from fedmf.cli import main

    assert DEFAULTS["adaptive-clipping-max-growth"] == 0.0
    base = {"adaptive-clipping": 0.5, "run-dir": str(tmp_path)}
    plan = RunConfig.from_mapping({**base, "adaptive-clipping-max-growth": 1.0}).build_plan()
    assert plan.adaptive_clipping.max_growth == 1.0 and plan.adaptive_clipping.clip_norm_bounds(1.0) == (0.1, 1.0)
    assert RunConfig.from_mapping(base).build_plan().adaptive_clipping.max_growth is None
    assert RunConfig.from_mapping({**base, "adaptive-clipping-max-growth": "2"}).adaptive_clipping_max_growth == 2.0
    for bad in (0.5, -2.0, "tall", 1e7, float("nan")):
        with pytest.raises(ConfigError, match="adaptive-clipping-max-growth"):
            RunConfig.from_mapping({**base, "adaptive-clipping-max-growth": bad})
    for argv in (["--adaptive-clipping-max-growth", "1"],
                 ["--adaptive-clipping", "0.5", "--adaptive-clipping-max-growth", "0.5"]):
        assert main(["simulate", "--preset", "tiny", "--out", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--adaptive-clipping" in err[0]
    assert not (tmp_path / "x").exists()
