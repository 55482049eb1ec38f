"""Independent review of the clipping policies (b68becf, docs/reviews/REVIEW-i35-clipping.md): the order of
operations, ζ's update from released values only, the scalar releases' keyed streams and salts, resume and
refused states, no secret in the state, and the releases bit for bit against 4c6cbb1 (the tree before the
policies, taken from git when its objects are present)."""

from __future__ import annotations

import copy
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedmf.round.clipping as clipping_module
import fedmf.round.count_noise as count_module
import fedmf.round.noise as noise_module
import fedmf.round.privatize as privatize_module
from fedmf import MinSep, Workload
from fedmf.errors import CheckpointError
from fedmf.mechanisms import build
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.count_noise import count_noise
from fedmf.round.draws import key_of
from fedmf.round.privatize import RoundPrivatizer

ROOT = Path(__file__).resolve().parents[2]
SEED, M, N, D = b"review-i35-seed-0123456789abcdef", 4, 6, 64
LAYOUT = {"w": (D,)}
BASE_COMMIT = "4c6cbb1"


def _plan(adaptive: bool, *, kind: str = "bsr", metrics: bool = False, zeta0: float = 0.7) -> RunPlan:
    schema = MinSep(2, N)
    mechanism = build(kind, N, schema, Workload(), num_bands=2 if kind == "bsr" else None)
    return RunPlan.create(mechanism, schema, clip_norm=zeta0, delta=1e-5, expected_users=M, noise_multiplier=1.3,
                          adaptive_clipping=AdaptiveClipping.create(0.5, expected_users=M) if adaptive else None,
                          client_metrics=ClientMetricRelease.create(1.0, expected_users=M) if metrics else None)


def _updates(t: int, zeta: float) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(31 * t + 1)
    out = {}
    for i, scale in enumerate((0.4, 0.9, 2.5, 1.0)):
        v = torch.randn(D, generator=g, dtype=torch.float64)
        out[f"u{i}"] = {"w": v / v.norm() * zeta * scale}
    out["u3"]["w"][t % D] = 500.0 * zeta  # zeroed: ℓ∞ > 100·ζ
    if t % 2:
        out["u1"]["w"][0] = math.nan  # rejected
    return out


def _privatizer(plan: RunPlan, *, salted: bool = False) -> RoundPrivatizer:
    return RoundPrivatizer(plan, LAYOUT, dtype=torch.float64, seed=SEED, repeatable_noise=not salted)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_resume_from_a_serialized_state_is_the_uninterrupted_run(adaptive):
    """ζ and the noise stream's position after a resume are those of the uninterrupted run (the state
    serialized at once; tests/round/test_clipping_policy.py reads a live state after three more rounds)."""
    plan = _plan(adaptive, metrics=True)
    first, released = _privatizer(plan), []
    for t in range(N):
        mean, report = first.privatize(t, _updates(t, first.clip_norm), values={"u0": 0.5})
        released.append((mean["w"].clone(), report.clip_norm, report.noisy_unclipped, report.noisy_client_metric))
        if t == 2:
            buffer = io.BytesIO()
            torch.save(first.state_dict(), buffer)
            blob, zeta = buffer.getvalue(), first.clip_norm
    second = _privatizer(plan)
    second.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
    assert second.next_round == 3 and second.clip_norm == zeta
    for t in range(3, N):
        mean, report = second.privatize(t, _updates(t, second.clip_norm), values={"u0": 0.5})
        assert torch.equal(mean["w"], released[t][0])
        assert (report.clip_norm, report.noisy_unclipped, report.noisy_client_metric) == released[t][1:]


def test_the_next_clip_norm_follows_from_released_values_only():
    """ζₜ is fixed before round t (the report's ζ, the std z·ζₜ·sens); b̃ₜ = Σ 1[unclipped] + the count's own
    keyed stream; ζₜ₊₁ = next_clip_norm(ζₜ, b̃ₜ, m, ζ₀) exactly."""
    plan = _plan(True)
    rule, privatizer = plan.adaptive_clipping, _privatizer(plan)
    for t in range(N):
        zeta = privatizer.clip_norm
        _, report = privatizer.privatize(t, _updates(t, zeta))
        unclipped = sum(1 for u in report.contributed if not (u.clipped or u.zeroed))
        assert report.clip_norm == zeta and report.noise_std == plan.noise_std_at(zeta)
        assert report.noisy_unclipped == unclipped + count_noise(key_of(SEED), t, b"", rule.count_noise_std)
        assert privatizer.clip_norm == rule.next_clip_norm(zeta, report.noisy_unclipped, M,
                                                           initial_clip_norm=plan.clip_norm)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_mean_is_divided_by_the_planned_users_whatever_was_received(adaptive):
    plan = _plan(adaptive, kind="dp-sgd")
    with_updates, without = _privatizer(plan), _privatizer(plan)
    updates = _updates(0, plan.clip_norm)
    del updates["u3"], updates["u1"]
    a, _ = with_updates.privatize(0, updates)
    b, _ = without.privatize(0, {})
    signal = sum(u["w"] * min(1.0, plan.clip_norm / float(u["w"].norm())) for u in updates.values())
    assert torch.allclose((a["w"] - b["w"]) * M, signal, rtol=0, atol=1e-12)


def test_one_salt_per_round_keys_every_stream_and_is_never_reused(monkeypatch):
    """Salted: the correlated noise, the count and the client-metric release of round t share round t's
    one fresh salt (their streams are separated by personalization); no salt serves two rounds."""
    calls = []
    real_count, real_metric, real_next = count_module.count_noise, count_module.metric_noise, noise_module.NoiseGenerator.next

    def rec_count(key, t, salt, std):
        calls.append(("count", t, salt))
        return real_count(key, t, salt, std)

    def rec_metric(key, t, salt, std):
        calls.append(("metric", t, salt))
        return real_metric(key, t, salt, std)

    def rec_next(self, *args, **kwargs):
        calls.append(("noise", self.round, kwargs.get("salt")))
        return real_next(self, *args, **kwargs)

    monkeypatch.setattr(clipping_module, "count_noise", rec_count)
    monkeypatch.setattr(privatize_module, "metric_noise", rec_metric)
    monkeypatch.setattr(noise_module.NoiseGenerator, "next", rec_next)
    privatizer = _privatizer(_plan(True, metrics=True), salted=True)
    for t in range(N):
        privatizer.privatize(t, _updates(t, privatizer.clip_norm), values={"u0": 0.5})
    by_round: dict[int, set[bytes]] = {}
    for _stream, t, salt in calls:
        by_round.setdefault(t, set()).add(salt)
    assert sorted(stream for stream, t, _ in calls if t == 0) == ["count", "metric", "noise"]
    assert all(len(salts) == 1 for salts in by_round.values())
    salts = [next(iter(s)) for s in by_round.values()]
    assert all(isinstance(s, bytes) and len(s) == 16 for s in salts) and len(set(salts)) == N
    assert len({count_module.PERSON, count_module.METRIC_PERSON, b"fedmf-noise-s1", b"fedmf-noise-v2"}) == 4


def test_no_secret_in_the_state_or_the_policy():
    privatizer = _privatizer(_plan(True), salted=True)
    privatizer.privatize(0, _updates(0, privatizer.clip_norm))
    buffer = io.BytesIO()
    torch.save(privatizer.state_dict(), buffer)
    blob, key = buffer.getvalue(), key_of(SEED)
    assert SEED not in blob and key not in blob and key.hex().encode() not in blob
    assert not any(isinstance(v, (bytes, bytearray)) for v in vars(privatizer.clipping).values())


@pytest.mark.parametrize("name, entry", [("missing", None), ("negative", {"clip_norm": -1.0}),
                                         ("nan", {"clip_norm": math.nan}), ("int", {"clip_norm": 1})])
def test_a_bad_clip_entry_is_refused_without_side_effects(name, entry):
    plan = _plan(True)
    source = _privatizer(plan)
    source.privatize(0, _updates(0, source.clip_norm))
    state = copy.deepcopy(source.state_dict())
    bad = {k: v for k, v in state.items() if k != "adaptive_clipping"}
    if entry is not None:
        bad["adaptive_clipping"] = entry
    target, twin = _privatizer(plan), _privatizer(plan)
    with pytest.raises(CheckpointError):
        target.load_state_dict(bad)
    assert target.next_round == 0 and target.clip_norm == plan.clip_norm
    assert torch.equal(target.privatize(0, _updates(0, 0.7))[0]["w"], twin.privatize(0, _updates(0, 0.7))[0]["w"])


@pytest.mark.parametrize("where", ["above", "below"])
def test_a_clip_norm_outside_the_rules_range_is_refused(where):
    """REVIEW-i35-clipping LOW-1: a checkpoint's ζ must be one the rule can reach, in ζ₀·[1/R, R]."""
    plan = _plan(True)
    source = _privatizer(plan)
    source.privatize(0, _updates(0, source.clip_norm))
    state = copy.deepcopy(source.state_dict())
    low, high = plan.adaptive_clipping.clip_norm_bounds(plan.clip_norm)
    state["adaptive_clipping"] = {"clip_norm": math.nextafter(high, math.inf) if where == "above"
                                  else math.nextafter(low, 0.0)}
    target = _privatizer(plan)
    with pytest.raises(CheckpointError, match="outside the rule's range"):
        target.load_state_dict(state)
    assert target.clip_norm == plan.clip_norm


@pytest.mark.parametrize("end", [0, 1])
def test_a_clip_norm_at_the_rules_bounds_is_restored(end):
    """The clamp returns the bounds exactly, so a run that reached one resumes at it."""
    plan = _plan(True)
    bound = plan.adaptive_clipping.clip_norm_bounds(plan.clip_norm)[end]
    source = _privatizer(plan)
    source.privatize(0, _updates(0, source.clip_norm))
    state = copy.deepcopy(source.state_dict())
    state["adaptive_clipping"] = {"clip_norm": bound}
    target = _privatizer(plan)
    target.load_state_dict(state)
    assert target.clip_norm == bound


def _base_tree(tmp: Path) -> Path | None:
    """4c6cbb1's tree from git (None: not in this checkout's objects)."""
    out = tmp / "base"
    out.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASE_COMMIT], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out


def test_releases_bit_identical_to_the_tree_before_the_policies(tmp_path):
    """docs/reviews/i35-clipping/releases.py (quick: bsr; fixed/adaptive, float32/float64/bfloat16, salted or
    not, client metrics, dropouts, zeroed/NaN/inf/not selected/wrong shape/duplicate updates, a serialized
    resume, every keyed draw's salt) in 4c6cbb1's tree and in this one: torch.equal on every tensor."""
    base = _base_tree(tmp_path)
    if base is None:
        pytest.skip(f"commit {BASE_COMMIT} is not in this checkout")
    script = ROOT / "docs" / "reviews" / "i35-clipping" / "releases.py"
    dumps = {}
    for name, tree in (("old", base), ("new", ROOT)):
        dumps[name] = tmp_path / f"{name}.pt"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(script), str(dumps[name]), "quick"], env=env, cwd=tmp_path, check=True,
                       capture_output=True, timeout=600)
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "reviews" / "i35-clipping" / "compare.py"),
                             str(dumps["old"]), str(dumps["new"])], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("MISMATCHES 0"), result.stdout
