"""A password in a ledger URL never reaches what fedmf prints, logs or writes."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from fedmf.ledger.db import display_url, public_url, resolve_url
from fedmf.run.federated import train
from tests import _federated_task as task

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


PASSWORD_KEYS = ["password", "PASSWORD", "Password", "sslpassword", "SSLPASSWORD", "sslPassword", "passwd", "PASS",
                 "pwd", "secret", "Client_Secret", "TOKEN", "access_token"]


@pytest.mark.parametrize("key", PASSWORD_KEYS)
def test_every_password_like_query_value_is_masked_in_any_case(key):
    url = f"postgresql://alice:{SECRET}@db/fedmf?{key}={SECRET}2&sslmode=require"
    shown = display_url(resolve_url(url))
    assert SECRET not in shown and "alice" in shown and "sslmode=require" in shown
    assert f"{key}=***" in shown or f"{key}=%2A%2A%2A" in shown
    assert public_url(url) == "postgresql://alice@db/fedmf?sslmode=require"
    # an URL that does not parse is masked by text
    broken = f"postgresql://alice:{SECRET}@db:port/fedmf?{key}={SECRET}2&x=1"
    from fedmf.ledger.db import LedgerError

    with pytest.raises(LedgerError) as caught:
        resolve_url(broken)
    assert SECRET not in str(caught.value) and f"{key}=***" in str(caught.value)
    assert public_url(broken) == f"postgresql://alice:***@db:port/fedmf?{key}=***&x=1"


@pytest.mark.parametrize("key", ["PASSWORD", "Password", "SslPassword", "passwd", "TOKEN"])
def test_the_cli_error_line_never_shows_a_password_like_query_value(key, capsys):
    """The driver refuses these keys (libpq's are lower case) and says so: the one error line names
    the ledger with the value masked and never quotes it."""
    from fedmf.cli import main

    url = f"postgresql://postgres@127.0.0.1:1/test?{key}={SECRET}"
    assert main(["audit", "--ledger", url]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmf: error: cannot read ledger postgresql+psycopg://"), err
    assert SECRET not in err and SECRET not in out and key in lines[0]


def test_a_driver_message_quoting_the_password_is_scrubbed():
    """Should a driver quote the password in its message, the error line masks it."""
    from sqlalchemy.exc import OperationalError

    from fedmf.ledger.db import LedgerError, database_errors

    url = resolve_url(f"postgresql://alice:{SECRET}@db/fedmf?PassWord={SECRET}x")
    with pytest.raises(LedgerError) as caught:
        with database_errors(url, "cannot open ledger"):
            raise OperationalError("connect", {}, Exception(f'bad value "{SECRET}x" and "{SECRET}"'))
    assert SECRET not in str(caught.value) and 'bad value "***" and "***"' in str(caught.value)


def test_a_password_with_an_unescaped_at_sign_is_masked_up_to_the_last_at():
    """``u:S3c@ret@h``: a first-'@' parser takes host ``ret@h`` and password ``S3c``; a host never
    holds an '@', so the password runs to the last '@' — resolved so, and masked whole."""
    from sqlalchemy.exc import OperationalError

    from fedmf.ledger.db import LedgerError, _safe_text, database_errors

    url = "postgresql://alice:S3c@ret@db:5433/fedmf?sslmode=require"
    resolved = resolve_url(url)
    assert (resolved.username, resolved.password, resolved.host, resolved.port) == ("alice", "S3c@ret", "db", 5433)
    assert display_url(resolved) == "postgresql+psycopg://alice:***@db:5433/fedmf?sslmode=require"
    assert display_url(make_url(url)) == "postgresql://alice:***@db:5433/fedmf?sslmode=require"  # parsed elsewhere
    assert public_url(url) == "postgresql://alice@db:5433/fedmf?sslmode=require"
    assert _safe_text(url) == "postgresql://alice:***@db:5433/fedmf?sslmode=require"
    with pytest.raises(LedgerError) as caught:  # a driver quoting the password or the host it was given
        with database_errors(resolved, "cannot open ledger"):
            raise OperationalError("connect", {}, Exception('password "S3c@ret" refused'))
    assert "S3c" not in str(caught.value) and "@ret" not in str(caught.value) and '"***"' in str(caught.value)


@pytest.mark.parametrize("key", ["p%61ssword", "PASS%57ORD", "pw", "PW", "apikey", "x_ApiKey", "api_key"])
def test_percent_encoded_pw_and_apikey_query_keys_are_masked(key):
    from fedmf.ledger.db import _safe_text

    url = f"postgresql://alice@db/fedmf?{key}={SECRET}&sslmode=require"
    for shown in (display_url(resolve_url(url)), public_url(url), _safe_text(url),
                  public_url(url.replace("@db/", "@db:port/"))):  # the last one does not parse
        assert SECRET not in shown and "sslmode=require" in shown, shown
