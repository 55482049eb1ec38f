"""experiments/clipping.py's harness logic: the ζ grid, the sweep's choice, the arms, the report tables.
No training here."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("experiments_clipping",
                                               Path(__file__).resolve().parents[2] / "experiments" / "clipping.py")
clipping = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(clipping)

NORMS = {"so-small": {"median": 0.3}, "shakespeare": {"median": 0.25}}


def _record(zeta, seed, loss, *, accuracy=0.05, dataset="so-small", eps=2.0, adaptive=False, per_round=None):
    job = dict(dataset=dataset, epsilon=eps, adaptive=adaptive, clip_norm=zeta, seed=seed)
    return {"job": job, "key": clipping.key(job), "noise_multiplier": 1.5,
            "history": [{"round": 10, "accuracy": 0.01, "loss": 9.0},
                        {"round": 30, "accuracy": accuracy, "loss": loss}],
            "per_round": per_round or [{"round": t, "clip_norm": zeta} for t in (1, 2)]}


def test_sweep_grid_is_median_multiples_and_the_untuned_values():
    assert clipping.sweep_zetas(0.3) == [0.1, 0.15, 0.3, 0.6, 3.0]
    assert clipping.untuned_zetas(0.2974) == (0.1, 2.974)
    assert clipping.round_zeta(0.29739358347138534) == 0.2974


def test_sweep_picks_the_lowest_final_loss_of_seed0_at_its_dataset_and_epsilon():
    records = [_record(0.1, 0, 7.9, accuracy=0.0745), _record(0.15, 0, 7.2, accuracy=0.014),
               _record(0.3, 0, 7.5), _record(0.3, 1, 6.0),  # another seed: not a sweep record
               _record(0.6, 0, 7.0, eps=8.0), _record(0.1, 0, 5.0, dataset="shakespeare"),
               _record(0.1, 0, 5.0, adaptive=True)]  # the adaptive arm is no candidate
    # the lowest loss wins even where its accuracy is below the "always EOS" run's
    assert clipping.best_zeta(records, "so-small", 2.0) == 0.15
    assert clipping.best_zeta(records, "so-small", 8.0) == 0.6
    assert clipping.best_zeta(records, "shakespeare", 8.0) is None
    tie = [_record(0.3, 0, 7.2), _record(0.15, 0, 7.2)]
    assert clipping.best_zeta(tie, "so-small", 2.0) == 0.15
    diverged = [_record(0.3, 0, float("nan")), _record(3.0, 0, 9.1)]
    assert clipping.best_zeta(diverged, "so-small", 2.0) == 3.0
    assert clipping.final_loss(diverged[0]) == float("inf")


def test_final_phase_runs_tuned_and_untuned_arms_on_every_seed_once():
    records = [_record(z, 0, loss, dataset=d, eps=e) for d in clipping.DATASETS for e in clipping.EPSILONS
               for z, loss in ((0.15, 7.0), (0.1, 8.0))]
    jobs = clipping.jobs("final", NORMS, records)
    keys = [clipping.key(j) for j in jobs]
    assert len(keys) == len(set(keys)) == 4 * 3 * 3  # (dataset, ε) × {0.15, 0.1, 10× median} × seeds
    assert {j["clip_norm"] for j in jobs if j["dataset"] == "so-small"} == {0.15, 0.1, 3.0}
    assert {j["clip_norm"] for j in jobs if j["dataset"] == "shakespeare"} == {0.15, 0.1, 2.5}
    assert [j["seed"] for j in jobs] == sorted(j["seed"] for j in jobs)
    # a tuned ζ equal to an untuned one is one arm's runs, not two
    records = [_record(0.1, 0, 7.0, dataset=d, eps=e) for d in clipping.DATASETS for e in clipping.EPSILONS]
    assert len(clipping.jobs("final", NORMS, records)) == 4 * 2 * 3


def test_final_phase_of_one_dataset_needs_only_that_datasets_sweep():
    records = [_record(0.15, 0, 7.0, eps=e) for e in clipping.EPSILONS]  # so-small's sweep only
    jobs = clipping.jobs("final", NORMS, records, only="so-small")
    assert {j["dataset"] for j in jobs} == {"so-small"} and len(jobs) == 2 * 3 * 3
    with pytest.raises(clipping.ExperimentError, match="shakespeare"):
        clipping.jobs("final", NORMS, records)


def test_adaptive_phase_starts_every_seed_at_the_untuned_zeta0():
    jobs = clipping.jobs("adaptive", NORMS, [])
    assert len(jobs) == 4 * 3 and all(j["adaptive"] and j["clip_norm"] == 0.1 for j in jobs)
    assert clipping.key(jobs[0]) == "so-small_eps2_adaptive_seed0"


def test_missing_inputs_are_one_line_errors():
    with pytest.raises(clipping.ExperimentError, match="run --phase sweep first"):
        clipping.jobs("final", NORMS, [])
    with pytest.raises(clipping.ExperimentError, match="clipping.py norms"):
        clipping.jobs("sweep", {}, [])
    with pytest.raises(clipping.ExperimentError, match="did not charge the count"):
        clipping.check_count_accounted(1.2, 1.2, 2.0)
    clipping.check_count_accounted(1.3, 1.2, 2.0)


def test_arms_and_table_from_records():
    records = [_record(0.15, 0, 7.0, accuracy=0.16), _record(0.15, 1, 7.2, accuracy=0.14),
               _record(0.15, 2, 7.4, accuracy=0.15), _record(0.3, 0, 7.5), _record(0.1, 0, 8.0, accuracy=0.12),
               _record(0.1, 1, 8.2, accuracy=0.10), _record(3.0, 0, 8.5)]
    arms = clipping.arms(records, NORMS, "so-small", 2.0)
    assert [r["job"]["seed"] for r in arms["tuned fixed ζ"]] == [0, 1, 2]
    assert len(arms["fixed ζ = 0.1"]) == 2 and len(arms["fixed ζ = 3 (10× median)"]) == 1
    rows = [line for line in clipping.table(records, NORMS).splitlines() if line.startswith("| so-small | 2 |")]
    assert rows[0] == "| so-small | 2 | tuned fixed ζ | 0.15 | 1.5 | 7.2000 ± 0.2000 | 0.1500 ± 0.0100 | 3 |"
    assert rows[1] == "| so-small | 2 | fixed ζ = 0.1 | 0.1 | 1.5 | 8.1000 ± 0.1414 | 0.1100 ± 0.0141 | 2 |"
    assert rows[2] == "| so-small | 2 | fixed ζ = 3 (10× median) | 3 | 1.5 | 8.5000 ± — | 0.0500 ± — | 1 |"
    assert rows[3] == "| so-small | 2 | adaptive (γ 0.5, ζ₀ 0.1) | — | — | not yet run | not yet run | 0 |"


def test_report_reads_records_and_plots_the_adaptive_trajectory(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "runs").mkdir()
    (tmp_path / "norms.json").write_text(json.dumps({"so-small": {"median": 0.3}}))
    trajectory = [{"round": t, "clip_norm": 0.1 * 1.1 ** t} for t in range(1, 5)]
    for r in (_record(0.15, 0, 7.0, accuracy=0.16), _record(0.1, 0, 8.0, accuracy=0.12), _record(3.0, 0, 8.5),
              _record(0.1, 0, 6.9, accuracy=0.18, adaptive=True, per_round=trajectory)):
        (tmp_path / "runs" / f"{r['key']}.json").write_text(json.dumps(r))
    text = clipping.report(tmp_path)
    assert "| so-small | 2 | adaptive (γ 0.5, ζ₀ 0.1) | 0.1 | 1.5 | 6.9000 ± — | 0.1800 ± — | 1 |" in text
    assert ("| so-small | 2 | 7.000 / 0.1600 (ζ 0.15) | — | — | 8.000 / 0.1200 (ζ 0.1) | 8.500 / 0.0500 (ζ 3) |"
            in text)
    assert (tmp_path / "clipping-so-small.png").stat().st_size > 0
    assert (tmp_path / "table.md").read_text() == text


def test_count_share_spends_that_share_of_the_budget_at_equal_epsilon():
    """σ_b from count_noise_for_share: the adaptive plan, calibrated to the fixed plan's ε, has
    z_mf = z/√(1 − share) and the count takes exactly ``share`` of μ² (count_release.privacy_split)."""
    from fedmf import MinSep, Workload
    from fedmf.accounting import count_release
    from fedmf.mechanisms import build
    from fedmf.plan import RunPlan

    schema = MinSep(min_sep=15, max_participations=2)
    fixed = RunPlan.create(build("bsr", 30, schema, Workload(momentum=0.9), num_bands=15), schema,
                           clip_norm=0.1, delta=1e-5, expected_users=20, target_epsilon=2.0)
    share = clipping.ADAPTIVE["count_share"]
    adaptive = clipping.adaptive_plan(fixed, {"clip_norm": 0.1, "epsilon": 2.0}, 20)
    assert adaptive.noise_multiplier == pytest.approx(fixed.noise_multiplier / (1 - share) ** 0.5, rel=1e-6)
    split = count_release.privacy_split(adaptive.noise_multiplier, adaptive.count_noise_std, 2)
    assert split["count"] == pytest.approx(share, rel=1e-6)
    assert adaptive.epsilon() == pytest.approx(2.0, rel=1e-6)
