"""The clipping policies (fedmf.round.clipping): the privatizer's releases under FixedClipping and
AdaptiveClipping are the bits they were before the policies existed, and equal an independent
straightforward implementation of the round (zero, clip, sum, noise, ÷ m; count, ζ update)."""

from __future__ import annotations

import math

import pytest
import torch

from fedmf.errors import CheckpointError
from fedmf.round.clipping import AdaptiveClipping, FixedClipping, clipping_policy
from fedmf.round.count_noise import count_noise, metric_noise
from fedmf.round.draws import key_of
from fedmf.round.noise import NoiseGenerator
from fedmf.round.privatize import RoundPrivatizer

from . import _clipping_releases as rel

#: ``_clipping_releases.digest`` at commit 4c6cbb1 (privatize.py with its `if self.adaptive` branches,
#: before fedmf.round.clipping), run there from a `git archive` of that commit with this helper:
#: (adaptive, dtype, salted, metrics) → SHA-256
BASE = {
    (False, torch.float32, False, False): "6ea0932e6cfea26c36d247a65677b4ec0d5c1fee3852d94f8a0da5d35915bd90",
    (False, torch.float32, False, True): "30bc70157642cb603d9388a5a6235c41cc735b270c85ea7333a715a732246fe2",
    (False, torch.float32, True, False): "365005fec6db4e39572cccece7e09213acdf94e351abfb8288d010a8c3d34201",
    (False, torch.float32, True, True): "1791675453d37b04b510d6f263820ff54ea0a35908e65a136c80392be15efcd3",
    (False, torch.float64, False, False): "34ee82e0dc46a231aee1a7b34c3a8324c9f24db763da5ab538593bc1cf1b20c9",
    (False, torch.float64, False, True): "ea4606b4e9c70fd16d1cfc94a00b7ad4a44adad57c61563a792f105b3cb05d9a",
    (False, torch.float64, True, False): "8d0bb095cb8b501fef1b3d6e7dbe80b880eb1fb0a885cc28f49ca83bf46ac1db",
    (False, torch.float64, True, True): "226c40f0ec016c389164d491d768f7e52f6d080b570fd5e695a21c20defd3929",
    (True, torch.float32, False, False): "827ed6bd952b2513a5c02998c8eb82ba62a1ed20e09b0b1a07b4a028a5ede723",
    (True, torch.float32, False, True): "5eaf1ebde53bbca77480be96ad3ffb92b70fc9b956b7cc52ed9add3c52f889b0",
    (True, torch.float32, True, False): "4d56e54431355283bd2f361318fb09608f7707652d65ab2749db4847e98b86a6",
    (True, torch.float32, True, True): "9bf024ec3cda2a55c5524d3345b901491707fb4e53ca4073aa60fbb068eb3f10",
    (True, torch.float64, False, False): "189509829b0da3dfbecc6e288cec9e279c9f28a6b2be1984d4ef282b54f3775b",
    (True, torch.float64, False, True): "9dcafc9a3072bc258c3949bda0d7db0e94758b184d963d7bb5f00afbb53f4652",
    (True, torch.float64, True, False): "ae3bb45ec340716a4cb650a1dd210d69062ff285b7c5c8c1d38a2cf37f5ed0ff",
    (True, torch.float64, True, True): "f2be87713875c5ca926369adb7a8ab743725ca34f24c13087507e7e37c96737d",
}


@pytest.mark.parametrize("case", sorted(BASE, key=str), ids=lambda c: "-".join(
    [("adaptive" if c[0] else "fixed"), str(c[1])[6:], ("salted" if c[2] else "repeatable"),
     ("metrics" if c[3] else "plain")]))
def test_releases_are_the_bits_of_the_commit_before_the_policies(case):
    """Released means, report fields (ζₜ, σ, noisy count, noisy metric, each user's fate), the
    checkpoint's clip entry and a resumed privatizer's rounds: bit for bit as at 4c6cbb1."""
    adaptive, dtype, salted, metrics = case
    assert rel.digest(adaptive, dtype=dtype, salted=salted, metrics=metrics) == BASE[case]


def _flat(update) -> torch.Tensor:
    return torch.cat([update[name].reshape(-1).double() for name in rel.LAYOUT])


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_releases_equal_a_straightforward_implementation(adaptive):
    """The round written out once, in float64, from the plan's description alone: zero an update
    with ℓ∞ > threshold (100·ζₜ), clip the rest to ζₜ, sum, add the generator's noise (its own
    instance), ÷ m; adaptive: the sum is normalized by ζₜ and the mean scaled back by ζₜ, the count
    of unclipped summed updates gets count_noise, ζₜ₊₁ = clamp(ζₜ·exp(−η(b̃/m − γ)), ζ₀/R, ζ₀·R)."""
    plan = rel.plan(adaptive, metrics=True)
    key, m, zeta0 = key_of(rel.SEED), plan.expected_users, plan.clip_norm
    privatizer = RoundPrivatizer(plan, rel.LAYOUT, dtype=torch.float64, seed=rel.SEED, repeatable_noise=True)
    std = plan.std_per_clip if adaptive else plan.noise_std
    noise = NoiseGenerator(plan.mechanism, rel.LAYOUT, std, dtype=torch.float64, seed=key)
    zeta = zeta0
    for t in range(rel.ROUNDS):
        assert privatizer.clip_norm == zeta  # ζₜ is fixed before round t
        batch = rel.updates(t, zeta, torch.float64)
        values = {user: 0.9 * i for i, user in enumerate(sorted(batch))}
        mean, report = privatizer.privatize(t, batch, selected=[u for u in batch if u != "stranger"], values=values)
        total, unclipped, metric = torch.zeros(307, dtype=torch.float64), 0, 0.0
        threshold = plan.zero_threshold * zeta / zeta0
        for user in sorted(batch):
            x = _flat(batch[user])
            if user == "stranger" or not bool(torch.isfinite(x).all()):
                continue
            metric += min(max(values[user], 0.0), plan.client_metrics.clip)
            if float(x.abs().max()) > threshold:
                continue  # zeroed, counted as clipped
            norm = float(torch.linalg.vector_norm(x))
            unclipped += norm < zeta * (1 - 1e-12)
            total += x * min(1.0, zeta / norm) / (zeta if adaptive else 1.0)
        drawn = noise.next()
        expected = (total + torch.cat([drawn[n].reshape(-1) for n in rel.LAYOUT])) * (zeta if adaptive else 1.0) / m
        assert torch.allclose(_flat(mean), expected, rtol=1e-12, atol=1e-14)
        assert report.noise_std == pytest.approx(plan.noise_multiplier * zeta * plan.sensitivity.value, rel=1e-15)
        assert report.noisy_client_metric == pytest.approx(
            (metric + metric_noise(key, t, b"", plan.client_metrics.noise_std)) / m, rel=1e-12)
        if not adaptive:
            assert report.clip_norm is None and report.noisy_unclipped is None and privatizer.clip_norm == zeta0
            continue
        rule = plan.adaptive_clipping
        assert report.clip_norm == zeta
        noisy = unclipped + count_noise(key, t, b"", rule.count_noise_std)
        assert report.noisy_unclipped == noisy
        step = -rule.learning_rate * (noisy / m - rule.target_quantile)
        zeta = min(max(zeta * math.exp(step), zeta0 / rule.clip_norm_range), zeta0 * rule.clip_norm_range)
        assert privatizer.clip_norm == pytest.approx(zeta, rel=1e-15)
        zeta = privatizer.clip_norm


def test_the_plan_picks_its_policy_and_each_keeps_the_checkpoint_format():
    fixed, adaptive = clipping_policy(rel.plan(False, False)), clipping_policy(rel.plan(True, False))
    assert type(fixed) is FixedClipping and type(adaptive) is AdaptiveClipping
    assert fixed.state_dict() == {} and fixed.generator_std == fixed.plan.noise_std
    assert adaptive.state_dict() == {"adaptive_clipping": {"clip_norm": 0.8}}
    assert adaptive.generator_std == adaptive.plan.std_per_clip
    assert fixed.read_state({"adaptive_clipping": {"clip_norm": 3.0}}) == 0.8  # a fixed plan ignores it
    adaptive.load_state_dict({"adaptive_clipping": {"clip_norm": 1.25}})
    assert adaptive.clip_norm == 1.25 and adaptive.zero_threshold == pytest.approx(125.0, rel=1e-15)
    for bad in ({}, {"adaptive_clipping": None}, {"adaptive_clipping": {"clip_norm": 1}},
                {"adaptive_clipping": {"clip_norm": -1.0}}, {"adaptive_clipping": {"clip_norm": math.inf}}):
        with pytest.raises(CheckpointError, match="adaptive clip norm"):
            adaptive.read_state(bad)
    assert adaptive.clip_norm == 1.25


def test_a_refused_state_changes_nothing():
    plan = rel.plan(True, False)
    privatizer = RoundPrivatizer(plan, rel.LAYOUT, dtype=torch.float64, seed=rel.SEED, repeatable_noise=True)
    privatizer.privatize(0, rel.updates(0, 0.8, torch.float64), selected=None)
    state = privatizer.state_dict()
    other = RoundPrivatizer(plan, rel.LAYOUT, dtype=torch.float64, seed=rel.SEED, repeatable_noise=True)
    with pytest.raises(CheckpointError):
        other.load_state_dict({k: v for k, v in state.items() if k != "adaptive_clipping"})
    assert other.next_round == 0 and other.clip_norm == 0.8
    other.load_state_dict(state)
    assert other.next_round == 1 and other.clip_norm == privatizer.clip_norm != 0.8
