"""fedmf.round.server_optimizer: the model trajectory is exactly theta_0 + eta * A x̂ (A from
Workload.matrix in numpy), resume is bit-identical, other kinds match torch.optim and warn."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch

from fedmf.errors import CheckpointError, ConfigError, FedmfError, HorizonReached, PlanMismatch
from fedmf.round.server_optimizer import ServerOptimizer, server_optimizer
from fedmf.workloads import Workload

SHAPES = {"w": (3, 4), "b": (4,), "s": ()}
ROUNDS = 16
ETA = 0.7


def draws(rounds: int = ROUNDS, seed: int = 0, dtype=torch.float64):
    """theta_0 and x̂_0..x̂_{n-1}: one name -> tensor mapping per round, from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    theta0 = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
    updates = [{k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()} for _ in range(rounds)]
    return theta0, updates


def clone(params):
    return {k: v.clone() for k, v in params.items()}


def flat(params) -> np.ndarray:
    return np.concatenate([params[k].reshape(-1).numpy() for k in SHAPES])


WORKLOADS = [Workload.prefix(), Workload(0.9), Workload(0.95, 0.25, 0.05)]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_trajectory_is_theta0_plus_eta_A_xhat_every_round(workload):
    theta0, updates = draws()
    A = workload.matrix(ROUNDS)
    X = np.stack([flat(u) for u in updates])  # (n, d)
    expected = flat(theta0) + ETA * (A @ X)  # row t: theta_{t+1} = theta_0 + eta (A x̂)_t
    params = clone(theta0)
    opt = server_optimizer(params, workload, ROUNDS, ETA)
    for t, update in enumerate(updates):
        assert opt.round == t
        opt.step(update)
        np.testing.assert_allclose(flat(params), expected[t], rtol=1e-12)
    assert opt.round == ROUNDS
    if workload.cooldown:  # the cooldown really reached the final factor
        assert A[-1, -1] == pytest.approx(0.05)


def test_float32_params_keep_dtype_and_follow_A():
    workload = Workload(0.9, 0.25)
    theta0, updates = draws(dtype=torch.float32)
    params = clone(theta0)
    opt = server_optimizer(params, workload, ROUNDS, ETA)
    for u in updates:
        opt.step({k: v.double() for k, v in u.items()})  # a float64 update is applied in the model's dtype
    assert all(p.dtype == torch.float32 for p in params.values())
    assert all(b.dtype == torch.float32 for b in opt.state_dict()["buffers"].values())
    X = np.stack([flat(u) for u in updates]).astype(np.float64)
    expected = flat(theta0).astype(np.float64) + ETA * (workload.matrix(ROUNDS) @ X)[-1]
    np.testing.assert_allclose(flat(params), expected, rtol=1e-5, atol=1e-5)


def test_model_parameters_are_updated_in_place():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = server_optimizer(dict(model.named_parameters()), Workload(0.5), 2, 2.0)
    opt.step({k: torch.ones_like(v) for k, v in before.items()})
    opt.step({k: torch.ones_like(v) for k, v in before.items()})
    # m = 1 then 1.5; theta = theta_0 + 2 * (1 + 1.5)
    for k, v in model.named_parameters():
        torch.testing.assert_close(v.detach(), before[k] + 5.0, rtol=0, atol=1e-15)
        assert v.requires_grad and v.grad is None


def run(workload, kind="workload", stop=None, seed=1, **options):
    theta0, updates = draws(seed=seed)
    params = clone(theta0)
    opt = server_optimizer(params, workload, ROUNDS, ETA, kind=kind, **options)
    for u in updates[:stop]:
        opt.step(u)
    return params, opt, updates


@pytest.mark.parametrize("kind,options", [("workload", {}), ("adam", {"betas": (0.8, 0.99)}),
                                          ("sgd", {"momentum": 0.9, "schedule": True})])
def test_resume_is_bit_identical(kind, options):
    workload = Workload(0.95, 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        whole, _, _ = run(workload, kind, **options)
        half, first, updates = run(workload, kind, stop=ROUNDS // 2, **options)
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        second = server_optimizer(half, workload, ROUNDS, ETA, kind=kind, **options)
    second.load_state_dict(state)
    assert second.round == ROUNDS // 2
    for u in updates[ROUNDS // 2 :]:
        second.step(u)
    for k in SHAPES:
        assert torch.equal(half[k], whole[k])


def test_state_dict_is_a_copy():
    params, opt, updates = run(Workload(0.9), stop=3)
    state = opt.state_dict()
    saved = state["buffers"]["w"].clone()
    opt.step(updates[3])
    assert torch.equal(state["buffers"]["w"], saved)
    assert state["round"] == 3 and opt.round == 4


def test_horizon_refused_and_state_unchanged():
    params, opt, updates = run(Workload(0.9))
    before = clone(params)
    with pytest.raises(HorizonReached, match="horizon of 16 rounds"):
        opt.step(updates[0])
    assert opt.round == ROUNDS and all(torch.equal(params[k], before[k]) for k in SHAPES)


@pytest.mark.parametrize("change", [
    {"workload": Workload(0.95, 0.25)}, {"lr": 0.5}, {"rounds": ROUNDS + 1}, {"kind": "sgd"},
])
def test_state_for_another_plan_is_refused(change):
    _, opt, _ = run(Workload(0.9), stop=2)
    state = opt.state_dict()
    args = {"workload": Workload(0.9), "lr": ETA, "rounds": ROUNDS, "kind": "workload", **change}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        other = server_optimizer(clone(draws()[0]), args["workload"], args["rounds"], args["lr"], kind=args["kind"])
    with pytest.raises(PlanMismatch):
        other.load_state_dict(state)
    assert other.round == 0


def test_state_for_other_params_or_options_is_refused():
    _, opt, _ = run(Workload(0.9), stop=2)
    params = clone(draws()[0])
    params["b"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(PlanMismatch, match="other params"):
        server_optimizer(params, Workload(0.9), ROUNDS, ETA).load_state_dict(opt.state_dict())
    with pytest.warns(UserWarning):
        _, adam, _ = run(Workload(0.9), "adam", stop=2, betas=(0.8, 0.99))
        other = server_optimizer(clone(draws()[0]), Workload(0.9), ROUNDS, ETA, kind="adam")
    with pytest.raises(PlanMismatch, match="adam options"):
        other.load_state_dict(adam.state_dict())
    with pytest.raises(CheckpointError):
        other.load_state_dict({"format": 99})


def test_update_with_other_names_or_shapes_is_refused_without_a_step():
    params, opt, updates = run(Workload(0.9), stop=1)
    before = clone(params)
    good = updates[1]
    bad = [
        {k: v for k, v in good.items() if k != "b"},
        {**good, "extra": torch.zeros(1, dtype=torch.float64)},
        {**good, "b": torch.zeros(5, dtype=torch.float64)},
        {**good, "b": torch.zeros(4, dtype=torch.int64)},
        {**good, "b": torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=torch.float64)},
        [good],
    ]
    for update in bad:
        with pytest.raises(ConfigError):
            opt.step(update)
    assert opt.round == 1 and all(torch.equal(params[k], before[k]) for k in SHAPES)


def test_another_kind_warns_once_and_workload_does_not():
    theta0, _ = draws()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server_optimizer(clone(theta0), Workload(0.9), ROUNDS, ETA)
    assert not caught
    for kind in ("sgd", "adam"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            server_optimizer(clone(theta0), Workload(0.9), ROUNDS, ETA, kind=kind)
        assert len(caught) == 1 and caught[0].category is UserWarning
        text = str(caught[0].message)
        assert "post-processing" in text and "optimized for the workload A" in text


def test_adam_matches_torch_adam_on_minus_xhat():
    theta0, updates = draws(seed=2)
    with pytest.warns(UserWarning):
        params, _, _ = run(Workload(0.9), "adam", seed=2, betas=(0.8, 0.98), eps=1e-6)
    reference = {k: v.clone().requires_grad_(True) for k, v in theta0.items()}
    adam = torch.optim.Adam(list(reference.values()), lr=ETA, betas=(0.8, 0.98), eps=1e-6)
    for u in updates:
        for k, p in reference.items():
            p.grad = -u[k]
        adam.step()
    for k in SHAPES:
        torch.testing.assert_close(params[k], reference[k].detach(), rtol=1e-12, atol=0)
        assert not torch.equal(params[k], theta0[k])


def test_sgd_with_beta_and_schedule_is_the_workload():
    # torch SGD (dampening 0): buf_0 = g_0, buf_t = beta buf + g_t, p -= lr_t buf; with g = -x̂ that is A.
    workload = Workload(0.95, 0.25)
    exact, _, _ = run(workload)
    with pytest.warns(UserWarning):
        sgd, _, _ = run(workload, "sgd", momentum=0.95, schedule=True)
        plain, _, _ = run(workload, "sgd", momentum=0.95)
    for k in SHAPES:
        torch.testing.assert_close(sgd[k], exact[k], rtol=1e-12, atol=1e-14)
    assert not torch.allclose(plain["w"], exact["w"])


def test_tied_weights_refused():
    w = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ConfigError, match="share memory"):
        server_optimizer({"a": w, "b": w}, Workload(), 2, 1.0)
    with pytest.raises(ConfigError, match="share memory"):
        server_optimizer({"a": w, "b": w[1]}, Workload(), 2, 1.0)
    server_optimizer({"a": w[0], "b": w[1]}, Workload(), 2, 1.0)  # disjoint rows are fine


@pytest.mark.parametrize("args,options,match", [
    (dict(lr=0.0), {}, "lr"), (dict(lr=-1.0), {}, "lr"), (dict(lr=float("inf")), {}, "lr"),
    (dict(lr=float("nan")), {}, "lr"), (dict(lr=True), {}, "lr"), (dict(lr="1"), {}, "lr"),
    (dict(rounds=0), {}, "rounds"), (dict(rounds=2.0), {}, "rounds"),
    (dict(workload="prefix"), {}, "Workload"), (dict(kind="rmsprop"), {}, "unknown"),
    (dict(params={"a": torch.zeros(2, dtype=torch.int64)}), {}, "floating"),
    (dict(params={}), {}, "empty"), (dict(params=[torch.zeros(2)]), {}, "mapping"),
    (dict(params={"a": [0.0]}), {}, "not a tensor"),
    (dict(), {"momentum": 0.9}, "no options"),
    (dict(kind="adam"), {"bogus": 1}, "bad options"), (dict(kind="adam"), {"betas": (1.5, 0.9)}, "bad options"),
    (dict(kind="sgd"), {"schedule": 1}, "schedule"),
])
def test_bad_arguments_raise_config_error(args, options, match):
    full = {"params": {"a": torch.zeros(2)}, "workload": Workload(0.9), "rounds": 4, "lr": 1.0, "kind": "workload",
            **args}
    with pytest.raises(ConfigError, match=match) as info:
        ServerOptimizer(full["params"], full["workload"], full["rounds"], full["lr"], kind=full["kind"], **options)
    assert isinstance(info.value, FedmfError) and "\n" not in str(info.value)
