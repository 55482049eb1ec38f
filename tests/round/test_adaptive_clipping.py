"""Adaptive clipping in the round (Andrew et al., NeurIPS 2021, Alg. 1): ζₜ follows the target
quantile, round t clips and noises with the same ζₜ, the released noise whitens to N(0, 1) while ζ
changes, resume is exact, the ledger records ζₜ and the audit checks the rule; fixed-ζ runs are the
bits they were before adaptive clipping existed."""

from __future__ import annotations

import hashlib
import logging
import math
import sqlite3

import numpy as np
import pytest
import torch
from scipy import stats

from fedmf import MinSep, Workload
from fedmf.audit.replay import audit
from fedmf.audit.report import ADAPTIVE_COLUMNS
from fedmf.config import RunConfig
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.count_noise import count_noise
from fedmf.round.draws import key_of
from fedmf.round.noise import NoiseGenerator
from fedmf.round.privatize import RoundPrivatizer
from fedmf.run.federated import train
from tests import _federated_task as task

SEED = b"adaptive-clipping-test-seed"
LAYOUT = {"w": (6,)}


def _plan(rounds: int, m: int, *, clip_norm: float, gamma: float = 0.5, kind: str = "dp-sgd",
          z: float = 1.0, **adaptive) -> RunPlan:
    schema = MinSep(1, rounds)
    mech = build(kind, rounds, schema, Workload(), **({"num_bands": 3} if kind == "bsr" else {}))
    return RunPlan.create(mech, schema, clip_norm=clip_norm, delta=1e-5, expected_users=m, noise_multiplier=z,
                          adaptive_clipping=AdaptiveClipping.create(gamma, expected_users=m, **adaptive))


def _updates(rng: np.random.Generator, m: int, norms: np.ndarray) -> dict[str, dict[str, torch.Tensor]]:
    """m updates in random directions with the given ℓ2 norms (float64)."""
    out = {}
    for i in range(m):
        v = rng.standard_normal(LAYOUT["w"][0])
        out[f"u{i:03d}"] = {"w": torch.from_numpy(v / np.linalg.norm(v) * norms[i])}
    return out


# ---- convergence: fedmf follows the quantile, Flower's wrapper runs away ---------------------------

def _flower_clip_norms(norms_by_round: list[np.ndarray], clip_norm: float, gamma: float) -> list[float]:
    """Flower 1.42's real DifferentialPrivacyServerSideAdaptiveClipping.aggregate_train on the same norms."""
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg

    m = len(norms_by_round[0])
    strategy = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.5, num_sampled_clients=m, initial_clipping_norm=clip_norm,
        target_clipped_quantile=gamma, clip_norm_lr=0.2, clipped_count_stddev=m / 20)
    rng = np.random.default_rng(7)
    np.random.seed(7)  # its count noise uses numpy's global generator
    zetas = []
    logging.getLogger("flwr").setLevel(logging.WARNING)
    for t, norms in enumerate(norms_by_round):
        strategy.current_arrays = ArrayRecord([np.zeros(LAYOUT["w"][0])])
        replies = []
        for i, norm in enumerate(norms):
            v = rng.standard_normal(LAYOUT["w"][0])
            meta = Metadata(run_id=1, message_id=f"{t}-{i}", src_node_id=i + 1, dst_node_id=0,
                            reply_to_message_id=f"q{t}-{i}", group_id=str(t + 1), created_at=0.0, ttl=60.0,
                            message_type="train")
            content = RecordDict({"arrays": ArrayRecord([v / np.linalg.norm(v) * norm]),
                                  "metrics": MetricRecord({"num-examples": 1})})
            replies.append(Message(content, metadata=meta))
        arrays, _ = strategy.aggregate_train(t + 1, replies)
        assert arrays is not None
        zetas.append(strategy.clipping_norm)
    return zetas


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_clip_norm_converges_to_the_target_quantile_from_both_sides_and_flowers_diverges(gamma):
    """Norms log-normal with median 1 and log-std s = 0.5: the γ-quantile is q = exp(s·Φ⁻¹(γ)).
    Tolerance: near q, log ζ is an AR(1) with coefficient 1 − η·f, f = φ(Φ⁻¹(γ))/s ≥ 0.56 the slope of
    the unclipped fraction in log ζ, and step noise η·sqrt(γ(1−γ)/m + (σ_b/m)²) ≤ 0.018 (m = 50,
    σ_b = m/20), so its stationary std is below 0.04 and the mean of the last 80 of 240 rounds has std
    ≈ 0.015: assert 0.06. Each start reaches q first (|log ζ₀/q| ≤ 5.1, moving by η·γ ≥ 0.1 per round
    from below, by η·(1 − γ) ≥ 0.04 from above: ≤ 110 rounds)."""
    m, rounds, s = 50, 240, 0.5
    q = math.exp(s * stats.norm.ppf(gamma))
    rng = np.random.default_rng(11)
    norms_by_round = [np.exp(s * rng.standard_normal(m)) for _ in range(rounds)]
    for start in (0.01, 100.0):
        # ζ₀ is 100× off the quantile: a range of 10³ (the default 10 would stop it at ζ₀·10, tested below)
        privatizer = RoundPrivatizer(_plan(rounds, m, clip_norm=start, gamma=gamma, clip_norm_range=1e3), LAYOUT,
                                     dtype=torch.float64, seed=SEED, repeatable_noise=True)
        zetas, directions = [], np.random.default_rng(3)
        for t in range(rounds):
            zetas.append(privatizer.clip_norm)
            _, report = privatizer.privatize(t, _updates(directions, m, norms_by_round[t]))
            assert report.clip_norm == zetas[-1]
        tail = np.log(zetas[-80:])
        assert abs(tail.mean() - math.log(q)) < 0.06, (start, math.exp(tail.mean()), q)
        assert tail.std() < 0.08
        assert abs(math.log(zetas[0] / q)) > 3  # it did start far away
    if gamma != 0.5:
        return
    # Flower's wrapper, on the first 20 norms of the same rounds: it counts the clipped updates but moves
    # ζ with the sign for the unclipped ones, by −0.2·(1 − γ) per round from below, +0.2·γ from above
    shrinking = _flower_clip_norms([n[:20] for n in norms_by_round[:60]], 0.1, gamma)
    growing = _flower_clip_norms([n[:20] for n in norms_by_round[:60]], 100.0, gamma)
    assert shrinking[-1] < 1e-3 and all(b < a for a, b in zip(shrinking, shrinking[1:]))
    assert growing[-1] > 1e3 and all(b > a for a, b in zip(growing, growing[1:]))


# ---- the released noise, the order of ζ, the count ----------------------------------------------

def test_released_noise_whitens_to_iid_standard_normal_while_zeta_changes():
    """released_t − Σ clip(Δ, ζₜ)/m = ζₜ·z·sens·(C⁻¹Z)ₜ/m: divided by ζₜ·z·sens/m and multiplied by C
    (a banded, non-diagonal C) it is Z, i.i.d. N(0, 1): 24 rounds × 2000 coordinates = 48000 values."""
    rounds, m, dim = 24, 20, 2000
    layout = {"w": (dim,)}
    plan = _plan(rounds, m, clip_norm=5.0, gamma=0.3, kind="bsr", learning_rate=0.5)
    privatizer = RoundPrivatizer(plan, layout, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    rng = np.random.default_rng(5)
    whitened_rows, zetas = [], []
    for t in range(rounds):
        zeta = privatizer.clip_norm
        norms = np.exp(rng.standard_normal(m))
        updates = {f"u{i:02d}": {"w": torch.from_numpy(rng.standard_normal(dim))} for i in range(m)}
        for i, u in enumerate(updates.values()):
            u["w"] *= norms[i] / float(u["w"].norm())
        mean, _ = privatizer.privatize(t, updates)
        true_sum = sum(u["w"] * min(1.0, zeta / float(u["w"].norm())) for u in updates.values())
        noise = (mean["w"] - true_sum / m).numpy()
        whitened_rows.append(noise / (zeta * plan.std_per_clip / m))
        zetas.append(zeta)
    assert max(zetas) / min(zetas) > 3  # ζ did change a lot: a fixed-ζ whitening would be off
    w = np.array(whitened_rows)  # (C⁻¹Z) by round
    c = np.linalg.inv(plan.mechanism.inverse_matrix())
    z = c @ w
    values = z.ravel()
    assert abs(values.mean()) < 4 / math.sqrt(values.size)
    assert abs(values.var() - 1) < 4 * math.sqrt(2 / values.size)
    assert stats.kstest(values, "norm").pvalue > 1e-3
    lag = np.corrcoef(z[:-1].ravel(), z[1:].ravel())[0, 1]  # C applied: no correlation left across rounds
    assert abs(lag) < 4 / math.sqrt(values.size)
    fixed = (np.array(whitened_rows) * np.array(zetas)[:, None] / zetas[0])
    assert abs((c @ fixed).var() - 1) > 0.5


def test_round_t_clips_and_noises_with_zeta_t_not_zeta_t_plus_1():
    """An independent replay (the same noise and count streams, rebuilt from the seed) gives each
    round's release to the bit scale; clipping or noising with the next round's ζ would not."""
    rounds, m = 6, 10
    plan = _plan(rounds, m, clip_norm=1.0, gamma=0.5, kind="bsr", learning_rate=1.0)
    privatizer = RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    replay = NoiseGenerator(plan.mechanism, LAYOUT, plan.std_per_clip, dtype=torch.float64, seed=SEED)
    rng = np.random.default_rng(9)
    zeta, rule, differs = 1.0, plan.adaptive_clipping, 0
    for t in range(rounds):
        norms = np.full(m, 10.0) if t == 0 else np.exp(rng.standard_normal(m))  # round 0: all clipped
        updates = _updates(rng, m, norms)
        mean, report = privatizer.privatize(t, updates)
        noise = replay.next()["w"]
        unclipped = int(sum(n <= zeta for n in norms))
        noisy = unclipped + count_noise(key_of(SEED), t, b"", rule.count_noise_std)
        following = rule.next_clip_norm(zeta, noisy, m, initial_clip_norm=plan.clip_norm)

        def release(clip_at: float, noise_at: float) -> torch.Tensor:
            clipped = sum(u["w"] * min(1.0, clip_at / float(u["w"].norm())) for u in updates.values())  # noqa: B023 (called within this iteration)
            return (clipped + noise_at * noise) / m  # noqa: B023 (called within this iteration)

        assert report.clip_norm == zeta and report.noisy_unclipped == pytest.approx(noisy, abs=1e-12)
        assert torch.allclose(mean["w"], release(zeta, zeta), rtol=1e-12, atol=1e-13)
        for wrong in (release(following, zeta), release(zeta, following), release(following, following)):
            differs += not torch.allclose(mean["w"], wrong, rtol=1e-6, atol=1e-9)
        assert privatizer.clip_norm == pytest.approx(following, rel=1e-15)
        zeta = following
    assert differs == 3 * rounds


def test_count_noise_is_its_own_stream_keyed_by_round_and_salt():
    key = key_of(SEED)
    draws = [count_noise(key, t, b"", 1.0) for t in range(2000)]
    assert draws == [count_noise(key, t, b"", 1.0) for t in range(2000)]  # reproducible
    assert count_noise(key, 3, b"s" * 16, 1.0) != count_noise(key, 3, b"t" * 16, 1.0)
    assert count_noise(key, 3, b"", 2.5) == 2.5 * draws[3]
    assert stats.kstest(draws, "norm").pvalue > 1e-3
    # not the correlated noise's first draws (another personalization): the dp-sgd generator's rows
    mech = build("dp-sgd", 8, MinSep(1, 8), Workload())
    gen = NoiseGenerator(mech, 1, 1.0, dtype=torch.float64, seed=SEED)
    assert all(float(gen.next()[0]) != draws[t] for t in range(8))


def test_dropped_and_rejected_updates_are_not_counted_and_m_is_the_planned_users():
    rounds, m = 3, 10
    plan = _plan(rounds, m, clip_norm=1.0, count_noise_std=1e-9)  # a negligible count noise: exact counts
    privatizer = RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=SEED, repeatable_noise=True)
    rng = np.random.default_rng(1)
    updates = _updates(rng, 4, np.array([0.5, 0.5, 0.5, 3.0]))  # 4 of 10 arrived, 3 unclipped
    updates["u000"]["w"][0] = float("nan")  # rejected: not summed, not counted
    _, report = privatizer.privatize(0, updates)
    assert report.counts()["rejected"] == 1 and report.noisy_unclipped == pytest.approx(2.0, abs=1e-6)
    # b̃/m = 2/10 (never 2/3): ζ grows by exp(0.2·(0.5 − 0.2))
    assert privatizer.clip_norm == pytest.approx(math.exp(0.2 * 0.3), rel=1e-6)


# ---- runs: resume, ledger, audit -------------------------------------------------------------------

def _adaptive_task_plan():
    return task.plan(adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10, learning_rate=0.5))


def _ledger_rounds(directory):
    with sqlite3.connect(directory / "ledger.db") as conn:
        return conn.execute("SELECT round_index, status, selected, contributed, dropped, rejected, "
                            "noise_std, epsilon_planned, checkpoint_sha256, clip_norm, noisy_unclipped FROM rounds "
                            "ORDER BY round_index").fetchall()


def _model_bytes(model) -> bytes:
    return b"".join(t.numpy().tobytes() for t in model.state_dict().values())


def test_resume_after_a_failed_round_repeats_the_zeta_sequence_ledger_and_model(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    task.write_secrets(whole)
    task.write_secrets(parts)
    model = task.Tiny()
    train(model, task.users(), _adaptive_task_plan(), task.local_update, checkpoint_dir=whole, rounds=12,
          repeatable_noise=True)

    def fail(event, t):
        if (event, t) == ("stepped", 7):
            raise RuntimeError("crash in round 7")

    with pytest.raises(RuntimeError, match="crash in round 7"):
        train(task.Tiny(), task.users(), _adaptive_task_plan(), task.local_update, checkpoint_dir=parts, rounds=12,
              repeatable_noise=True, on_event=fail)
    assert len(_ledger_rounds(parts)) == 7
    with sqlite3.connect(parts / "ledger.db") as conn:
        assert conn.execute("SELECT attempts FROM round_state WHERE round_index = 7").fetchone() == (1,)
    resumed = task.Tiny()
    train(resumed, task.users(), _adaptive_task_plan(), task.local_update, checkpoint_dir=parts, rounds=12,
          repeatable_noise=True)
    # a resumed run's checkpoint files hash differently (so does a fixed-ζ run's: not compared here)
    rows = [r[:8] + r[9:] for r in _ledger_rounds(whole)]
    assert rows == [r[:8] + r[9:] for r in _ledger_rounds(parts)]
    zetas = [r[-2] for r in rows]
    assert zetas[0] == 1.0 and len(set(zetas)) == 12 and all(r[-1] is not None for r in rows)
    assert _model_bytes(resumed) == _model_bytes(model)


def test_ledger_records_zeta_the_chain_verifies_and_the_audit_catches_a_rewritten_zeta(tmp_path, capsys):
    from fedmf.cli import main

    run = tmp_path / "run"
    plan = _adaptive_task_plan()
    result = train(task.Tiny(), task.users(), plan, task.local_update, checkpoint_dir=run, rounds=8)
    report = audit(run / "ledger.db", verify=True)
    assert report.chain.ok and report.realized["clip_norm_rule"] == []
    assert set(ADAPTIVE_COLUMNS) <= set(report.columns)
    zetas = [r["clip_norm"] for r in report.rounds]
    assert zetas[0] == plan.clip_norm and zetas == [h.metrics["clip-norm"] for h in result.history]
    sens = plan.sensitivity.value
    assert [r["noise_std"] for r in report.rounds] == pytest.approx([plan.noise_multiplier * z * sens for z in zetas])
    assert report.realized["rounds_below_planned_noise"] == []
    for h, r in zip(result.history, report.rounds):
        assert h.metrics["noisy-unclipped-fraction"] == r["noisy_unclipped"] / plan.expected_users
    assert any("adaptive clipping" in line and "follows the rule" in line for line in report.lines())
    assert main(["audit", "--ledger", str(run / "ledger.db"), "--csv", str(tmp_path / "a.csv")]) == 0
    header = (tmp_path / "a.csv").read_text().splitlines()[0].split(",")
    assert "clip_norm" in header and "noisy_unclipped" in header
    capsys.readouterr()
    with sqlite3.connect(run / "ledger.db") as conn:
        conn.execute("UPDATE rounds SET clip_norm = clip_norm * 1.01 WHERE round_index = 5")
    tampered = audit(run / "ledger.db", verify=True)
    assert not tampered.chain.ok and tampered.chain.first_bad_round == 5
    assert tampered.realized["clip_norm_rule"] == [5, 6]  # ζ₅ breaks the rule, and ζ₆ no longer follows it
    assert any("VIOLATES the rule at rounds [5, 6]" in line for line in tampered.lines())
    assert main(["audit", "--ledger", str(run / "ledger.db"), "--verify"]) == 1
    with sqlite3.connect(run / "ledger.db") as conn:
        conn.execute("UPDATE rounds SET clip_norm = clip_norm / 1.01 WHERE round_index = 5")
        conn.execute("UPDATE rounds SET noisy_unclipped = noisy_unclipped + 1 WHERE round_index = 2")
    assert audit(run / "ledger.db").realized["clip_norm_rule"] == [3]


def test_a_fixed_clip_norm_run_is_bit_identical_to_the_base_commit(tmp_path):
    """The same run at commit cefcda7 (before adaptive clipping reached the round; computed there
    with this task, these fixed secrets and repeatable noise) gave these hashes: the model after 12
    rounds and the last checkpoint, which holds the model, optimizer, noise and scheduler state."""
    task.write_secrets(tmp_path / "run")
    model = task.Tiny()
    train(model, task.users(), task.plan(), task.local_update, checkpoint_dir=tmp_path / "run", rounds=12,
          repeatable_noise=True)
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.numpy().tobytes())
    assert digest.hexdigest() == "809ab46f8b61b50f3ee5bcef788df44ffbc93d81822170fda77ce9c2adfc9334"
    rows = _ledger_rounds(tmp_path / "run")
    assert rows[-1][8] == "f037e12928c92293b62e6d0b8bb203085dd0f20cd7fcdbcc6197a00584174a57"
    assert all(r[-2] is None and r[-1] is None for r in rows)
    report = audit(tmp_path / "run" / "ledger.db", verify=True)
    assert report.chain.ok and "clip_norm_rule" not in report.realized
    assert not set(ADAPTIVE_COLUMNS) & set(report.columns)


def test_optional_chain_fields_enter_the_hash_only_when_set():
    from fedmf.ledger.chain import round_sha256

    record = {"round_index": 0, "status": "committed", "attempts": 1, "selected": 2, "contributed": 2, "dropped": 0,
              "rejected": 0, "noise_std": 1.5, "epsilon_worst_user": None, "epsilon_planned": 0.3,
              "checkpoint_sha256": None}
    base = round_sha256("00" * 32, record, [])
    assert round_sha256("00" * 32, {**record, "clip_norm": None, "noisy_unclipped": None}, []) == base
    with_zeta = round_sha256("00" * 32, {**record, "clip_norm": 0.5, "noisy_unclipped": 3.25}, [])
    assert with_zeta != base
    assert with_zeta != round_sha256("00" * 32, {**record, "clip_norm": 0.5, "noisy_unclipped": 3.5}, [])


# ---- state, configuration, CLI ---------------------------------------------------------------------

def test_privatizer_state_carries_zeta_and_a_fixed_plans_state_does_not(tmp_path):
    plan = _plan(4, 5, clip_norm=2.0)
    privatizer = RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=SEED)
    privatizer.privatize(0, _updates(np.random.default_rng(0), 5, np.full(5, 9.0)))
    state = privatizer.state_dict()
    assert state["adaptive_clipping"] == {"clip_norm": privatizer.clip_norm} and privatizer.clip_norm > 2.0  # all clipped: ζ grows
    other = RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=SEED)
    other.load_state_dict(state)
    assert other.clip_norm == privatizer.clip_norm and other.next_round == 1
    from fedmf.errors import CheckpointError

    with pytest.raises(CheckpointError, match="adaptive clip norm"):
        other.load_state_dict({**state, "adaptive_clipping": {"clip_norm": -1.0}})
    fixed = RoundPrivatizer(task.plan(), LAYOUT, seed=SEED)
    assert "adaptive_clipping" not in fixed.state_dict()


def test_config_keys_build_the_adaptive_plan_and_round_trip(tmp_path):
    values = {"adaptive-clipping": 0.7, "adaptive-clipping-lr": 0.3, "adaptive-clipping-count-noise": 0.4,
              "clip-norm": 0.25, "run-dir": str(tmp_path)}
    config = RunConfig.from_mapping(values)
    plan = config.build_plan()
    assert plan.adaptive_clipping == AdaptiveClipping(0.7, 0.3, 0.4) and plan.clip_norm == 0.25
    assert RunPlan.from_dict(plan.to_dict(), plan.mechanism) == plan
    default = RunConfig.from_mapping({"adaptive-clipping": 0.5, "run-dir": str(tmp_path)}).build_plan()
    assert default.adaptive_clipping.count_noise_std == default.expected_users / 20
    off = RunConfig.from_mapping({"run-dir": str(tmp_path)}).build_plan()
    assert off.adaptive_clipping is None and "adaptive_clipping" not in off.to_dict()
    from fedmf.errors import ConfigError

    for bad in ({"adaptive-clipping": 1.0}, {"adaptive-clipping": -0.1}, {"adaptive-clipping": 1.5},
                {"adaptive-clipping-lr": 0.0}, {"adaptive-clipping-count-noise": -1.0},
                {"adaptive-clipping": "half"}):
        with pytest.raises(ConfigError):
            RunConfig.from_mapping({**bad, "run-dir": str(tmp_path)})


@pytest.mark.parametrize("argv", [
    ["--adaptive-clipping", "1.5"], ["--adaptive-clipping", "0"], ["--adaptive-clipping-lr", "0.1"],
    ["--adaptive-clipping-count-noise", "2"], ["--adaptive-clipping", "0.5", "--adaptive-clipping-lr", "-1"],
    ["--adaptive-clipping", "0.5", "--adaptive-clipping-count-noise", "0"], ["--clip-norm", "0"],
    ["--adaptive-clipping", "x"],
])
def test_bad_adaptive_flags_exit_2_with_one_line(tmp_path, argv, capsys):
    from fedmf.cli import main

    try:
        code = main(["simulate", "--preset", "tiny", "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:  # argparse: a value that is not a number
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert (err.startswith("fedmf: error:") and len(err.strip().splitlines()) == 1) or "usage:" in err
    assert not (tmp_path / "o").exists()


def test_simulate_with_adaptive_clipping_writes_zeta_to_results_plot_and_ledger(tmp_path, capsys):
    import json

    from fedmf.cli import main

    out = tmp_path / "sim"
    argv = ["simulate", "--preset", "tiny", "--rounds", "5", "--epsilon", "6", "--clip-norm", "0.05",
            "--adaptive-clipping", "0.5", "--adaptive-clipping-lr", "0.4", "--adaptive-clipping-count-noise", "2",
            "--out", str(out), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    zetas = [h["metrics"]["clip-norm"] for h in result["history"]]
    assert zetas[0] == 0.05 and len(zetas) == 5 and len(set(zetas)) == 5
    assert (out / "progress.png").stat().st_size > 0
    report = audit(out / "ledger.db", verify=True)
    assert report.chain.ok and report.realized["clip_norm_rule"] == []
    assert [r["clip_norm"] for r in report.rounds] == zetas


def test_the_canary_audit_refuses_an_adaptive_plan():
    from fedmf.audit.empirical import run_canary_audit
    from fedmf.errors import ConfigError

    with pytest.raises(ConfigError, match="fixed clip norm"):
        run_canary_audit(task.Tiny(), task.users(), _adaptive_task_plan(), task.local_update, canaries=4)


def test_the_flower_strategy_runs_adaptive_clipping_bit_for_bit_and_reports_zeta(tmp_path):
    from server.local_grid import LocalGrid
    from server.strategy import DPMFStrategy
    from tests.flower.test_server_strategy import CONFIG, _nodes

    rounds = 6
    plan = task.plan(rounds=rounds, adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=10,
                                                                              learning_rate=0.5))
    reference = task.Tiny()
    loop = train(reference, task.users(), plan, task.local_update, checkpoint_dir=tmp_path / "loop",
                 repeatable_noise=True)
    task.share_secrets(tmp_path / "loop", tmp_path / "flower")
    model = task.Tiny()
    from fedmf.run.private_run import PrivateRun

    with PrivateRun.open(model, plan, tmp_path / "flower", population=task.users(), repeatable_noise=True) as run:
        result = DPMFStrategy(run, CONFIG).start(LocalGrid(_nodes()))
    assert _model_bytes(model) == _model_bytes(reference)
    metrics = [result.train_metrics_clientapp[t + 1] for t in range(rounds)]
    assert [m["clip-norm"] for m in metrics] == [h.metrics["clip-norm"] for h in loop.history]
    assert [m["noisy-unclipped-fraction"] for m in metrics] == [h.metrics["noisy-unclipped-fraction"]
                                                                for h in loop.history]
    assert metrics[0]["clip-norm"] == plan.clip_norm and len({m["clip-norm"] for m in metrics}) == rounds
    assert [r[-2] for r in _ledger_rounds(tmp_path / "flower")] == [m["clip-norm"] for m in metrics]


def test_each_normalized_contribution_has_norm_at_most_one_at_the_clip_boundary():
    """Sensitivity 1 per participation: an update at ζₜ (within rounding, either side) or far above it
    adds at most norm 1 to the normalized sum, in float32 where rounding is coarse."""
    rng = np.random.default_rng(4)
    for zeta in (1e-3, 0.37, 1.0, 3.3, 1e4):
        plan = _plan(2, 1, clip_norm=zeta)
        privatizer = RoundPrivatizer(plan, {"w": (1000,)}, dtype=torch.float32, seed=SEED)
        for scale in (1 - 1e-7, 1.0, 1 + 1e-7, 1e3):
            v = torch.from_numpy(rng.standard_normal(1000)).float()
            v *= float(zeta * scale / torch.linalg.vector_norm(v.double()))
            privatizer.begin(0)
            privatizer.add("u", {"w": v})
            assert float(torch.linalg.vector_norm(privatizer._sum.double())) <= 1.0, (zeta, scale)
            privatizer.abort()


def test_a_salted_run_resumed_after_a_crash_keeps_following_the_rule(tmp_path):
    """With per-attempt salts (every real run) the redone round draws fresh noise and a fresh count,
    and ζ resumes from the checkpoint: the audit finds the recorded sequence following the rule."""
    from fedmf.run.checkpoint import CheckpointStore

    def fail(event, t):
        if (event, t) == ("noised", 5):
            raise RuntimeError("crash in round 5")

    with pytest.raises(RuntimeError, match="crash in round 5"):
        train(task.Tiny(), task.users(), _adaptive_task_plan(), task.local_update, checkpoint_dir=tmp_path, rounds=9,
              on_event=fail)
    store = CheckpointStore(tmp_path)
    zeta_5 = store.load(4, None)["privatizer"]["adaptive_clipping"]["clip_norm"]
    train(task.Tiny(), task.users(), _adaptive_task_plan(), task.local_update, checkpoint_dir=tmp_path, rounds=9)
    report = audit(tmp_path / "ledger.db", verify=True)
    assert report.chain.ok and report.realized["clip_norm_rule"] == []
    assert [r["clip_norm"] for r in report.rounds][5] == zeta_5
    assert len({r["clip_norm"] for r in report.rounds}) == 9
