"""Secure aggregation in the Flower app, in process (server.local_grid + the real ClientApp): rounds
commit through the SecAgg+ stages, the released models equal the central mode's (same seed,
repeatable noise) up to the bounded quantization error, a dropout at a stage is survived, and a
round whose survivors fall below the threshold is aborted and redone, nothing released."""

from __future__ import annotations

import logging

import pytest
from flwr.app import MessageType
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from client.app import app as client_app
from fedmf.errors import ConfigError
from fedmf.run.private_run import REPEATABLE_NOISE_ENV
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.messages import CONSISTENCY_CHECK, SECAGG_RECORD
from server.app import run_server
from server.config import ServerConfig
from server.local_grid import LocalGrid, client_node
from tests import _federated_task as task

USERS, PER_ROUND = 12, 4
SECURE = {"secure-aggregation": "secaggplus", "secagg-degree": 4, "secagg-threshold": 3,
          "secagg-stage-timeout": 5.0}


def _config(tmp_path, name, **over):
    values = {"task": "tiny", "task-options": f'{{"num_users": {USERS}}}', "mechanism": "bsr", "rounds": 3,
              "min-sep": 2, "clients-per-round": PER_ROUND, "noise-multiplier": 0.7, "server-momentum": 0.5,
              "client-lr": 0.2, "batch-size": 8, "run-dir": str(tmp_path / name), "reply-timeout": 5.0}
    values.update(over)
    return values


def _stage(message) -> str | None:
    record = message.content.config_records.get(SECAGG_RECORD) if message.has_content() else None
    return None if record is None else record.get(Key.STAGE)


def _nodes(silent=None):
    """The real ClientApp on each node; ``silent(node, stage)`` True: that node sends nothing."""
    nodes = {}
    for i in range(USERS):
        node_id = 9000 + 7 * i
        answer = client_node(client_app, {"partition-id": i, "num-partitions": USERS}, node_id)

        def node(message, node_id=node_id, answer=answer):
            if silent is not None and silent(node_id, _stage(message)):
                return None
            return answer(message)

        nodes[node_id] = node
    return nodes


@pytest.fixture
def logs(monkeypatch, caplog):
    monkeypatch.setenv(REPEATABLE_NOISE_ENV, "1")  # tests only: the two modes draw the same noise
    monkeypatch.setattr(logging.getLogger("fedmf.server"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="fedmf.server"):
        yield caplog


def test_secure_rounds_commit_and_equal_the_central_mode_up_to_the_quantization_error(tmp_path, logs):
    central = run_server(LocalGrid(_nodes()), _config(tmp_path, "central", rounds=1, **{"min-sep": 1}))
    task.share_secrets(tmp_path / "central", tmp_path / "secure")
    secure = run_server(LocalGrid(_nodes()), _config(tmp_path, "secure", rounds=1, **{**SECURE, "min-sep": 1}))
    assert "secure aggregation (SecAgg+)" in logs.text
    [record] = secure.history
    assert (record.selected, record.contributed, record.dropped) == (PER_ROUND, PER_ROUND, 0)
    # round 0 starts from the same model with the same users: the releases differ only by the
    # quantization — each coordinate of each update rounded by < 1/s, and σ·(inflation − 1) —,
    # and the first step of the server optimizer moves the model by server-lr × the release
    config = ServerConfig.from_mapping(_config(tmp_path, "x", **SECURE))
    plan, q = secure.run.plan, secure.secure.quantization
    sigma = plan.noise_std
    bound = config.server_lr * (PER_ROUND / q.scale + (q.inflation - 1.0) * 8 * sigma) / plan.expected_users
    assert q.inflation > 1.0
    got, want = secure.run.model.state_dict(), central.run.model.state_dict()
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert 0 < diff <= bound + 1e-6, (diff, bound)


def test_several_secure_rounds_track_the_central_mode(tmp_path, logs):
    central = run_server(LocalGrid(_nodes()), _config(tmp_path, "central"))
    task.share_secrets(tmp_path / "central", tmp_path / "secure")
    secure = run_server(LocalGrid(_nodes()), _config(tmp_path, "secure", **SECURE))
    assert [r.round for r in secure.history] == [0, 1, 2] and secure.stopped == "horizon"
    got, want = secure.run.model.state_dict(), central.run.model.state_dict()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-3


def test_a_dropout_at_the_collect_stage_is_survived(tmp_path, logs):
    dropped: list[int] = []

    def silent(node, stage):  # the first node asked to send its masked vector never does (round 0)
        if stage == Stage.COLLECT_MASKED_VECTORS and (not dropped or dropped == [node]) and len(dropped) < 2:
            dropped[:] = [node]
            return True
        return False

    strategy = run_server(LocalGrid(_nodes(silent)), _config(tmp_path, "drop", rounds=1, **{**SECURE, "min-sep": 1}))
    [record] = strategy.history
    assert (record.selected, record.contributed, record.dropped) == (PER_ROUND, PER_ROUND - 1, 1)
    assert strategy.secure.server.dropped and len(strategy.secure.server.contributors) == PER_ROUND - 1


def test_below_the_threshold_the_round_is_aborted_and_redone(tmp_path, logs):
    attempts: list[set[int]] = [set()]

    def silent(node, stage):  # in the first attempt, two of four drop at collect: 2 < t = 3
        if stage == Stage.SETUP and node in attempts[-1]:
            attempts.append(set())
        if stage == Stage.COLLECT_MASKED_VECTORS and len(attempts) == 1:
            attempts[0].add(node)
            return len(attempts[0]) <= 2
        return False

    strategy = run_server(LocalGrid(_nodes(silent)), _config(tmp_path, "abort", rounds=2, **SECURE))
    assert "aborted and nothing of it was released; redone with fresh noise" in logs.text
    assert [r.round for r in strategy.history] == [0, 1]
    assert strategy.history[0].contributed == PER_ROUND


def test_adaptive_clipping_under_secure_aggregation_releases_the_central_count(tmp_path, logs):
    adaptive = {"adaptive-clipping": 0.5, "clip-norm": 0.05}
    central = run_server(LocalGrid(_nodes()), _config(tmp_path, "central", **adaptive))
    task.share_secrets(tmp_path / "central", tmp_path / "secure")
    secure = run_server(LocalGrid(_nodes()), _config(tmp_path, "secure", **{**SECURE, **adaptive}))
    assert secure.secure.quantization.with_bit
    # round 0: the same model and users, so the same unclipped count (from the masked bits) and the
    # same count noise (repeatable), added to the bits' residue before centring; the secure count is
    # then clamped to [0, contributors] (post-processing, REVIEW-i36-privacy-path HIGH-1): the same
    # released fraction and the same ζ₁ unless the noise took the central count out of that range
    first_c, first_s = central.history[0].metrics, secure.history[0].metrics
    m, contributors = secure.run.plan.expected_users, secure.history[0].contributed
    count = first_c["noisy-unclipped-fraction"] * m
    if 0.0 <= count <= contributors:
        assert first_s["noisy-unclipped-fraction"] == first_c["noisy-unclipped-fraction"]
        assert secure.history[1].metrics["clip-norm"] == central.history[1].metrics["clip-norm"]
    else:
        clamped = min(max(count, 0.0), contributors) / m
        assert first_s["noisy-unclipped-fraction"] == pytest.approx(clamped, rel=1e-12, abs=1e-15)


class SpyGrid(LocalGrid):
    """Keeps every reply the server receives."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.replies = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.replies.extend(replies)
        return replies


def test_the_server_receives_no_update_only_masked_words(tmp_path, logs):
    grid = SpyGrid(_nodes())
    strategy = run_server(grid, _config(tmp_path, "spy", rounds=2, **SECURE))
    answered = [reply for reply in grid.replies if reply.has_content() and SECAGG_RECORD in reply.content.config_records]
    assert all(not reply.content.array_records and not reply.content.metric_records for reply in answered)
    stages = [reply.content.config_records[SECAGG_RECORD][Key.STAGE] for reply in answered]
    assert stages.count(Stage.COLLECT_MASKED_VECTORS) == 2 * PER_ROUND
    assert [r.contributed for r in strategy.history] == [PER_ROUND, PER_ROUND]


def test_a_node_that_errs_at_share_keys_is_dropped_and_recorded_as_rejected(tmp_path, logs):
    nodes = _nodes()
    victim: list[int] = []

    def wrap(node_id, answer):
        def node(message):
            if _stage(message) == Stage.SHARE_KEYS and (not victim or victim == [node_id]):
                victim[:] = [node_id]
                from flwr.app import Error, Message

                return Message(Error(code=1, reason="boom"), reply_to=message)
            return answer(message)
        return node

    grid = LocalGrid({node_id: wrap(node_id, answer) for node_id, answer in nodes.items()})
    strategy = run_server(grid, _config(tmp_path, "err", rounds=1, **{**SECURE, "min-sep": 1}))
    [record] = strategy.history
    assert (record.contributed, record.rejected) == (PER_ROUND - 1, 1)


def test_secure_aggregation_refuses_a_cohort_that_could_wrap(tmp_path, logs):
    with pytest.raises(SecAggError, match="could wrap"):
        run_server(LocalGrid(_nodes()), _config(tmp_path, "wrap", **{**SECURE, "secagg-bits": 16}))
    assert not (tmp_path / "wrap").exists()  # refused before the run opened


@pytest.mark.heavy  # a real `flwr run` simulation (Ray actors, Context.state between stages): ~1-2 min
def test_flwr_run_simulation_with_secure_aggregation(tmp_path):
    from pathlib import Path

    from tests.flower_harness import run_simulation

    root = Path(__file__).resolve().parents[2]
    values = _config(tmp_path, "sim", **{**SECURE, "reply-timeout": 120.0, "secagg-stage-timeout": 60.0,
                                         "task-options": '{"num_users": 8}'})
    result = run_simulation(root, num_supernodes=8, run_config=values, timeout=400, tmp_path=tmp_path / "flwr")
    assert result.rc == 0, result.output[-3000:]
    assert "secure aggregation (SecAgg+)" in result.output
    assert (tmp_path / "sim" / "final-model.pt").exists()
    assert "fedmf round 2 (3/3 done)" in result.output


def test_a_cohort_always_below_the_threshold_ends_the_run_with_nothing_released(tmp_path, logs):
    from fedmf.secagg.errors import SecAggAbort

    answering: set[int] = set()

    def silent(node, stage):  # only two nodes ever answer the setup: 2 < t = 3 in every attempt
        if stage == Stage.SETUP and len(answering) < 2:
            answering.add(node)
        return stage == Stage.SETUP and node not in answering

    with pytest.raises(SecAggAbort, match="below the threshold"):
        run_server(LocalGrid(_nodes(silent)), _config(tmp_path, "small", **SECURE))
    assert logs.text.count("redone with fresh noise") == 3
    assert not (tmp_path / "small" / "final-model.pt").exists()
    log = tmp_path / "small" / "rounds.jsonl"
    assert not log.exists() or not log.read_text()


def test_a_planned_cohort_below_the_threshold_is_refused_before_the_run_opens(tmp_path, logs):
    with pytest.raises(ConfigError, match="threshold"):
        run_server(LocalGrid(_nodes()), _config(tmp_path, "small", **{**SECURE, "clients-per-round": 2}))
    assert not (tmp_path / "small").exists()


def test_the_client_metric_travels_masked_and_is_released_as_the_central_one(tmp_path, logs):
    metrics = {"client-metrics": "private", "client-metrics-clip": 5.0, "client-metrics-noise": 0.5}
    central = run_server(LocalGrid(_nodes()), _config(tmp_path, "central", rounds=2, **metrics))
    task.share_secrets(tmp_path / "central", tmp_path / "secure")
    grid = SpyGrid(_nodes())
    secure = run_server(grid, _config(tmp_path, "secure", rounds=2, **{**SECURE, **metrics}))
    assert secure.secure.quantization.metric_clip == 5.0
    # no reply carries the loss in the clear: only the secagg record (masked words) and the echo
    answered = [r for r in grid.replies if r.has_content() and SECAGG_RECORD in r.content.config_records]
    assert answered and all(not r.content.metric_records for r in answered)
    assert all(set(r.content.config_records) == {"config", SECAGG_RECORD} for r in answered)
    # round 0: the same users, model and noise draw; each value rounded down by < 1/s on the client
    q, m = secure.secure.quantization, secure.run.plan.expected_users
    gap = central.history[0].metrics["noisy-train-loss"] - secure.history[0].metrics["noisy-train-loss"]
    assert 0.0 <= gap < PER_ROUND / q.scale / m, gap
    assert secure.run.plan.to_dict()["secure_aggregation"]["degree"] == SECURE["secagg-degree"]


def test_the_flower_backend_reads_a_secure_run_back_with_its_plan(tmp_path, logs):
    from fedmf.config import RunConfig
    from fedmf.errors import PlanMismatch
    from fedmf.tasks import get_task
    from launcher.flower_backend import flower_result

    values = _config(tmp_path, "secure", rounds=2, **SECURE)
    run_server(LocalGrid(_nodes()), values)
    tiny = get_task("tiny", num_users=USERS)
    result = flower_result(ServerConfig.from_mapping(values), model=tiny.model(), evaluate=tiny.evaluate, plot=False)
    assert result.rounds_done == 2
    engine = RunConfig.from_mapping({k: v for k, v in values.items() if not k.startswith(("secure", "secagg",
                                                                                           "reply"))})
    with pytest.raises(PlanMismatch, match="another plan"):  # the central plan is not the one that ran
        flower_result(engine, model=tiny.model(), evaluate=tiny.evaluate, plot=False)


def _enrolled_nodes(tmp_path):
    """The real ClientApp on each node, each holding the enrollment of all users and its own key."""
    from fedmf.enrollment import Enrollment, generate_key_pair

    keys = {i: tmp_path / f"user-{i}.pem" for i in range(USERS)}
    Enrollment({str(i): generate_key_pair(path) for i, path in keys.items()}).save(tmp_path / "enrollment.json")
    return {9000 + 7 * i: client_node(client_app, {"partition-id": i, "num-partitions": USERS, "user-key": str(keys[i]),
                                                   "enrollment-file": str(tmp_path / "enrollment.json")}, 9000 + 7 * i)
            for i in range(USERS)}


def test_enrolled_nodes_sign_their_keys_and_the_survivor_set(tmp_path, logs):
    """Every node holds the enrollment: each checks its neighbours' signed keys against it and signs
    U3 with its user key; the rounds commit as in the unverified mode."""
    grid = SpyGrid(_enrolled_nodes(tmp_path))
    derived = {**SECURE, "secagg-degree": 0, "secagg-threshold": 0, "min-sep": 1}  # k = 4, t = 3: below the rule
    strategy = run_server(grid, _config(tmp_path, "enrolled", rounds=1, **derived))
    [record] = strategy.history
    assert (record.selected, record.contributed, record.rejected, record.dropped) == (PER_ROUND, PER_ROUND, 0, 0)
    answered = [r for r in grid.replies if r.has_content() and SECAGG_RECORD in r.content.config_records]
    stages = [r.content.config_records[SECAGG_RECORD][Key.STAGE] for r in answered]
    assert stages.count(CONSISTENCY_CHECK) == PER_ROUND and stages.count(Stage.UNMASK) == PER_ROUND


def test_an_enrollment_without_a_user_key_is_refused(tmp_path):
    from client.secagg_app import signing_mode

    assert signing_mode({"partition-id": 1, "user-key": "ignored without an enrollment"}) == (None, None)
    with pytest.raises(ConfigError, match="enrollment-file needs user-key") as caught:
        signing_mode({"enrollment-file": str(tmp_path / "enrollment.json")})
    assert "\n" not in str(caught.value)


def test_a_node_that_requires_secure_aggregation_refuses_a_plain_train(tmp_path, logs):
    """A deviating server could skip SecAgg+ and ask for the clear update: a node configured with
    require-secure-aggregation answers a plain TRAIN with an error reply, and none of its updates
    reaches the server."""
    nodes = {i: client_node(client_app, {"partition-id": i, "num-partitions": USERS,
                                         "require-secure-aggregation": True}, 9000 + 7 * i) for i in range(USERS)}
    grid = SpyGrid({9000 + 7 * i: node for i, node in nodes.items()})
    strategy = run_server(grid, _config(tmp_path, "central", rounds=1, **{"min-sep": 1}))
    assert [r.contributed for r in strategy.history] == [0]
    trains = [r for r in grid.replies if r.metadata.message_type == MessageType.TRAIN]
    assert len(trains) >= PER_ROUND and all(r.has_error() and "only under secure aggregation" in r.error.reason
                                            for r in trains)
    secure = run_server(SpyGrid({9000 + 7 * i: node for i, node in nodes.items()}),
                        _config(tmp_path, "secure", rounds=1, **{**SECURE, "min-sep": 1}))
    assert [r.contributed for r in secure.history] == [PER_ROUND]


@pytest.mark.parametrize("value, required", [(True, True), (False, False), (None, False)])
def test_require_secure_aggregation_is_a_boolean(value, required):
    from client.app import _requires_secure_aggregation

    assert _requires_secure_aggregation({} if value is None else {"require-secure-aggregation": value}) is required


@pytest.mark.parametrize("value", ["true", "yes", 1])
def test_a_quoted_require_secure_aggregation_fails_closed(value):
    """--node-config "require-secure-aggregation='true'" parses to a string: refused (the node then
    answers every plain TRAIN with an error), never read as false."""
    from client.app import _requires_secure_aggregation

    with pytest.raises(ConfigError, match="must be true or false") as caught:
        _requires_secure_aggregation({"require-secure-aggregation": value})
    assert "\n" not in str(caught.value)


def test_an_enrolled_node_signs_for_one_attempt_of_a_round_and_never_an_earlier_round():
    """REVIEW-i36-secagg-2 HIGH-2: the record of the last signed (run nonce, round) in Context.state."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from client.secagg_app import SIGNED_RECORD, _check_unsigned
    from fedmf.secagg.errors import SecAggError

    context = Context(run_id=1, node_id=9000, node_config={}, state=RecordDict(), run_config={})
    _check_unsigned(context, "nonce", 3)  # nothing signed yet: any round, e.g. a redo before signing
    context.state.config_records[SIGNED_RECORD] = ConfigRecord({"run": "nonce", "round": 3})
    for run, round_, words in (("nonce", 3, "round 3 refused"), ("nonce", 2, "round 2 refused"),
                               ("other", 4, "another run nonce")):
        with pytest.raises(SecAggError, match=words):
            _check_unsigned(context, run, round_)
    _check_unsigned(context, "nonce", 4)
