"""REVIEW-i36-last-fixes MEDIUM-1: a node that requires secure aggregation (or holds an enrollment,
which implies it) refuses a plain TRAIN, but answers any EVALUATE with its user's loss, accuracy and
example count in the clear: a deviating server chooses the model and learns a data-dependent value
outside the DP guarantee (the server itself never sends EVALUATE: README, federated evaluation off)."""
from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, MessageType, RecordDict

from client.app import app
from fedmf.tasks import get_task
from tests.flower.test_client import _config, _context, _message


@pytest.mark.parametrize("node_config", [{"require-secure-aggregation": True}, {"enrollment-file": "/nonexistent"}])
def test_a_node_requiring_secure_aggregation_refuses_evaluate(node_config):
    task = get_task("tiny", num_users=8, seed=2)
    content = RecordDict({"arrays": ArrayRecord(task.model().state_dict()),
                          "config": _config(**{"client-lr": None, "local-epochs": None, "batch-size": None})})
    reply = app(_message(content, MessageType.EVALUATE), _context(**{"partition-id": 5, **node_config}))
    assert reply.has_error()
