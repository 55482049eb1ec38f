"""A password in a ledger URL never reaches what fedmf prints, logs or writes."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from fedmf.federated import train
from fedmf.ledger.db import display_url, public_url, resolve_url

from . import _federated_task as task

SECRET = "s3cret-Pw"


@pytest.mark.parametrize("url, expected", [
    (f"postgresql://alice:{SECRET}@db.example.org:5432/fedmf", "postgresql://alice@db.example.org:5432/fedmf"),
    (f"postgresql://alice@db/fedmf?password={SECRET}&sslmode=require", "postgresql://alice@db/fedmf?sslmode=require"),
    (f"postgresql://alice:{SECRET}@db/fedmf?sslpassword={SECRET}", "postgresql://alice@db/fedmf"),
    ("sqlite:////var/lib/fedmf/ledger.db", "sqlite:////var/lib/fedmf/ledger.db"),
    ("run/ledger.db", "run/ledger.db"),
])
def test_public_url_drops_every_password_and_keeps_the_rest(url, expected):
    assert public_url(url) == expected
    assert SECRET not in public_url(url)
    if "://" in url:  # what remains is still the same database
        a, b = make_url(url), make_url(public_url(url))
        assert (a.drivername, a.username, a.host, a.port, a.database) == (b.drivername, b.username, b.host, b.port,
                                                                          b.database)


def test_display_url_masks_a_query_string_password_too():
    shown = display_url(resolve_url(f"postgresql://alice@db/fedmf?password={SECRET}"))
    assert SECRET not in shown and ("password=***" in shown or "password=%2A%2A%2A" in shown)


def test_train_reports_its_postgres_ledger_without_the_password(tmp_path, pg_url):
    url = make_url(pg_url).set(password=SECRET).render_as_string(hide_password=False)  # trust auth ignores it
    assert SECRET in url
    result = train(task.Tiny(), task.users(), task.plan(rounds=6), task.local_update, ledger=url,
                   checkpoint_dir=tmp_path)
    assert result.rounds_done == 6
    assert SECRET not in result.ledger and SECRET not in result.audit_command()
    assert make_url(result.ledger).database == make_url(pg_url).database
