"""Secure aggregation in process (``server/secagg_inprocess.py``, ``fedmf simulate --secure-aggregation``),
the plan's record of it (fingerprint, inflation, σ from ζ_eff) and the client metric inside the mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedmf.errors import ConfigError, PlanMismatch
from fedmf.plan import RunPlan
from fedmf.round.adaptive_clipping import AdaptiveClipping
from fedmf.round.client_metrics import ClientMetricRelease
from fedmf.round.privatize import RoundPrivatizer, flat_size
from fedmf.run.federated import train
from fedmf.secagg.encode import encode_update, quantization_for
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.masks import mod_sum
from fedmf.secagg.params import SecAggParams
from fedmf.secagg.quantize import check_no_wrap, decode_sum, max_safe_cohort, metric_cap, metric_word
from server.secagg_inprocess import secaggplus
from tests import _federated_task as task
from tests.secagg._drive import tensors

PARAMS = SecAggParams(degree=4, threshold=3, bits=40, scale=2.0 ** 16)
LAYOUT = {"w": (3, 4), "b": (4,)}
DIM = flat_size(LAYOUT)
USERS = [f"u{i:02d}" for i in range(12)]
SEED = b"s" * 32


# ---- the client metric's word ----------------------------------------------------------------


def test_a_metric_word_decodes_into_zero_to_L_for_any_value():
    for clip, scale in ((10.0, 65536.0), (0.3, 3.0), (1e-3, 7.0), (0.1, 10.0)):
        cap = metric_cap(clip, scale)
        assert cap / scale <= clip and (cap + 1) / scale > clip  # the largest word within L
        for v in (-5.0, 0.0, clip / 3, clip, 2 * clip, 1e300, float("nan"), float("inf"), None, "x"):
            w = metric_word(v, clip, scale)
            assert 0 <= w <= cap and 0.0 <= w / scale <= clip
            exact = min(max(float(v), 0.0), clip) if isinstance(v, float) and math.isfinite(v) else 0.0
            assert 0.0 <= exact - w / scale < 1.0 / scale + 1e-12  # rounded down, by less than 1/s


def test_the_no_wrap_bound_counts_the_metric_word():
    # ζ·s = 8, L·s = 80: the metric word, not the update, bounds the cohort
    assert max_safe_cohort(0.5, 16.0, 12) == 2047 // 8
    assert max_safe_cohort(0.5, 16.0, 12, metric_clip=5.0) == 2047 // 80
    with pytest.raises(Exception, match="could wrap"):
        check_no_wrap(30, 0.5, 16.0, 12, metric_clip=5.0)
    plan = task.plan(rounds=4, client_metrics=ClientMetricRelease.create(5.0, 1.0, expected_users=10))
    q = quantization_for(plan, DIM, scale=16.0, bits=12, beta=math.exp(-0.5))
    assert q.length == DIM + 1 and q.word_bound == 80


def _tensors(flat: np.ndarray) -> dict[str, torch.Tensor]:
    return tensors(flat, LAYOUT)


def test_the_metric_inside_the_mask_is_released_as_the_central_path_up_to_the_rounding():
    release = ClientMetricRelease.create(10.0, 2.0, expected_users=10)
    plan = task.plan(rounds=4, client_metrics=release)
    scale = 2.0 ** 10
    q = quantization_for(plan, DIM, scale=scale, bits=40, beta=math.exp(-0.5))
    central = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    secure = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    rng = np.random.default_rng(0)
    for t in range(3):
        flats = {u: rng.normal(size=DIM) * 0.1 for u in USERS}
        values = {u: float(v) for u, v in zip(USERS, rng.uniform(-2, 14, len(USERS)))}  # some clipped
        values[USERS[0]] = float("nan")
        tensors = {u: _tensors(f) for u, f in flats.items()}
        _, rep_c = central.privatize(t, tensors, selected=USERS, values=values)
        words = [encode_update(q, np.concatenate([tensors[u][n].double().reshape(-1).numpy() for n in LAYOUT]),
                               clip_norm=plan.clip_norm, zero_threshold=None, rng=rng, metric=values[u])
                 for u in USERS]
        total = mod_sum(words, q.length, q.bits)
        decoded = decode_sum(q, total)
        exact = math.fsum(release.clipped(v) for v in values.values())
        assert 0.0 <= exact - decoded.metric < len(USERS) / scale  # each value rounded down by < 1/s
        _, rep_s = secure.privatize_sum(t, total, USERS, quantization=q, selected=USERS)
        # the same noise draw (same key, round, unsalted): the releases differ only by the rounding
        diff = rep_c.noisy_client_metric - rep_s.noisy_client_metric
        assert 0.0 <= diff < len(USERS) / scale / plan.expected_users, (t, diff)


def test_a_hostile_metric_sum_is_clamped_after_its_noise_and_a_missing_one_refused():
    release = ClientMetricRelease.create(1.0, 1e-9, expected_users=10)
    plan = task.plan(rounds=4, client_metrics=release)
    q = quantization_for(plan, DIM, scale=2.0 ** 10, bits=40, beta=math.exp(-0.5))
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    bare = quantization_for(task.plan(rounds=4), DIM, scale=2.0 ** 10, bits=40, beta=math.exp(-0.5))
    with pytest.raises(ConfigError, match="client-metric sum"):
        p.privatize_sum(0, np.zeros(bare.length, dtype=np.uint64), USERS[:3], quantization=bare, selected=USERS)
    words = np.zeros(q.length, dtype=np.uint64)
    words[-1] = np.uint64(10 ** 8 * 2 ** 10)  # a hostile metric word: 1e8
    _, report = p.privatize_sum(0, words, USERS[:3], quantization=q, selected=USERS)
    assert report.noisy_client_metric == pytest.approx(3.0 / plan.expected_users, abs=1e-8)  # ≤ L per contributor
    words[-1] = np.uint64((1 << 40) - 5 * 2 ** 10)  # −5
    _, report = p.privatize_sum(1, words, USERS[:3], quantization=q, selected=USERS)
    assert report.noisy_client_metric == pytest.approx(0.0, abs=1e-8)


# ---- the plan records secure aggregation ----------------------------------------------------


def test_the_plan_records_secure_aggregation_in_its_fingerprint_and_sigma():
    plan = task.plan(rounds=4)
    secure = plan.with_secure_aggregation(PARAMS, DIM)
    q = quantization_for(plan, DIM, scale=PARAMS.scale, bits=PARAMS.bits, beta=PARAMS.beta)
    assert secure.secure_aggregation.inflation == q.inflation > 1.0
    assert secure.to_dict()["secure_aggregation"] == {
        "protocol": "secaggplus", "degree": 4, "threshold": 3, "bits": 40, "scale": 2.0 ** 16,
        "beta": PARAMS.beta, "dim": DIM, "inflation": q.inflation}
    assert secure.fingerprint != plan.fingerprint
    assert secure.epsilon() == plan.epsilon() and secure.noise_multiplier == plan.noise_multiplier
    assert secure.effective_noise_std == plan.noise_std * q.inflation
    assert secure.effective_clip_norm == plan.clip_norm * q.inflation
    assert plan.effective_noise_std == plan.noise_std
    # every parameter but the stage timeout changes the fingerprint
    for other in (SecAggParams(6, 4, 40, 2.0 ** 16), SecAggParams(4, 4, 40, 2.0 ** 16),
                  SecAggParams(4, 3, 41, 2.0 ** 16), SecAggParams(4, 3, 40, 2.0 ** 15)):
        assert plan.with_secure_aggregation(other, DIM).fingerprint != secure.fingerprint
    assert plan.with_secure_aggregation(SecAggParams(4, 3, 40, 2.0 ** 16, stage_timeout_s=9.0), DIM) == secure
    assert plan.with_secure_aggregation(PARAMS, DIM + 1).fingerprint != secure.fingerprint
    back = RunPlan.from_dict(secure.to_dict(), plan.mechanism)
    assert back.fingerprint == secure.fingerprint and back.secure_aggregation == secure.secure_aggregation
    forged = secure.to_dict()
    forged["secure_aggregation"] = {**forged["secure_aggregation"], "inflation": 1.0}
    with pytest.raises(PlanMismatch, match="inflation"):
        RunPlan.from_dict(forged, plan.mechanism)


def test_a_secure_plan_takes_only_secure_sums_of_its_inflation():
    plan = task.plan(rounds=4).with_secure_aggregation(PARAMS, DIM)
    p = RoundPrivatizer(plan, LAYOUT, seed=SEED, repeatable_noise=True)
    with pytest.raises(ConfigError, match="secure aggregation"):
        p.privatize(0, {u: _tensors(np.zeros(DIM)) for u in USERS}, selected=USERS)
    other = quantization_for(plan, DIM, scale=PARAMS.scale / 2, bits=PARAMS.bits, beta=PARAMS.beta)
    with pytest.raises(ConfigError, match="inflation"):
        p.privatize_sum(0, np.zeros(other.length, dtype=np.uint64), USERS, quantization=other, selected=USERS)
    q = quantization_for(plan, DIM, scale=PARAMS.scale, bits=PARAMS.bits, beta=PARAMS.beta)
    assert q.inflation == plan.secure_aggregation.inflation
    _, report = p.privatize_sum(0, np.zeros(q.length, dtype=np.uint64), USERS, quantization=q, selected=USERS)
    assert report.noise_std == plan.effective_noise_std


# ---- train() with the in-process SecAgg+ ----------------------------------------------------


def _train(tmp_path, name, secure: bool, users, params=PARAMS, **kw):
    plan = task.plan(rounds=4, **kw)
    model = task.Tiny()
    cohort = None
    if secure:
        dim = sum(p.numel() for p in model.parameters())
        cohort = secaggplus(params, plan, dim, len(users))
        plan = plan.with_secure_aggregation(params, dim)
    local = task.local_update
    if plan.client_metrics is not None:
        from fedmf.tasks.base import LocalResult

        def local(params, user, t):
            update = task.local_update(params, user, t)
            return None if update is None else LocalResult(update, 8, {"train-loss": int(user[1:]) / 7.0})
    result = train(model, users, plan, local, checkpoint_dir=tmp_path / name, repeatable_noise=True,
                   witness="off", rounds=1, secure_sum=cohort)
    return result, model, cohort


def test_in_process_secagg_records_contributed_dropped_and_rejected_users(tmp_path):
    faulty = [task.NAN_USER, task.SHAPE_USER, task.HUGE_USER, task.DROPOUT_USER]
    users = faulty + ["u01", "u02", "u03", "u04", "u05", "u06"]
    release = ClientMetricRelease.create(1.0, 0.5, expected_users=10)
    central, model_c, _ = _train(tmp_path, "central", False, users, client_metrics=release)
    task.share_secrets(tmp_path / "central", tmp_path / "secure")
    wide = SecAggParams(degree=8, threshold=5, bits=40, scale=2.0 ** 16)  # 3 of 10 drop: t = 5 still reached
    secure, model_s, cohort = _train(tmp_path, "secure", True, users, params=wide, client_metrics=release)
    first = secure.history[0]
    assert (first.selected, first.contributed, first.rejected, first.dropped) == (10, 7, 2, 1)
    assert [(r.contributed, r.rejected, r.dropped) for r in central.history][0] == (7, 2, 1)
    assert cohort.server is not None and len(cohort.server.contributors) == 7
    from fedmf.audit.replay import audit

    [row] = audit(tmp_path / "secure" / "ledger.db").rounds  # the ledger's record of the round
    assert (row["contributed"], row["rejected"], row["dropped"]) == (7, 2, 1)
    # the released client metric equals the central one up to the rounding (< 1/s per contributor)
    for c, s in zip(central.history, secure.history):
        gap = c.metrics["noisy-train-loss"] - s.metrics["noisy-train-loss"]
        assert 0.0 <= gap < 7 / PARAMS.scale / 10, gap
    got, want = model_s.state_dict(), model_c.state_dict()
    assert 0 < max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-3


def test_survivors_below_the_threshold_abort_the_round_nothing_released(tmp_path):
    from fedmf.secagg.errors import SecAggAbort

    users = [task.DROPOUT_USER, task.NAN_USER, task.SHAPE_USER, "u01", "u02"]  # 2 survivors < t = 3
    with pytest.raises(SecAggAbort, match="threshold"):
        _train(tmp_path, "abort", True, users, expected_users=5)
    from fedmf.audit.replay import audit

    report = audit(tmp_path / "abort" / "ledger.db")
    assert report.realized["rounds_committed"] == 0



@pytest.mark.parametrize("adaptive", [False, True])
def test_the_run_refuses_a_population_whose_sum_plus_a_12_sigma_noise_margin_could_wrap(adaptive):
    """The noise is added to the residues before they are centred (HIGH-1): the no-wrap check keeps a
    12σ margin for it, σ per coordinate = σ_generator·inflation·max_t ‖(C⁻¹)ₜ‖₂ (cross-checked here on
    the dense C⁻¹), and for the count's and the metric's noise."""
    from server.secagg_round import run_quantization

    rule = AdaptiveClipping.create(0.5, expected_users=10) if adaptive else None
    release = ClientMetricRelease.create(1.0, 0.5, expected_users=10)
    plan = task.plan(rounds=4, adaptive_clipping=rule, client_metrics=release)
    params = SecAggParams(degree=4, threshold=3, bits=24, scale=2.0 ** 12)
    q = quantization_for(plan, DIM, scale=params.scale, bits=params.bits, beta=params.beta)
    row = float(np.linalg.norm(plan.mechanism.inverse_matrix(), axis=1).max())
    sigma = (plan.std_per_clip if adaptive else plan.noise_std) * q.inflation * row
    largest = max_safe_cohort(q.clip_norm, q.scale, q.bits, q.metric_clip, noise_std=sigma,
                              count_noise_std=plan.count_noise_std or 0.0, metric_noise_std=release.noise_std)
    noiseless = max_safe_cohort(q.clip_norm, q.scale, q.bits, q.metric_clip)
    assert 10 <= largest < noiseless
    assert run_quantization(params, plan, DIM, largest) == q
    with pytest.raises(SecAggError, match=f"12σ noise margin: at most {largest} fit"):
        run_quantization(params, plan, DIM, largest + 1)
    assert check_no_wrap(largest + 1, q.clip_norm, q.scale, q.bits, q.metric_clip) == largest + 1  # no margin: fits
