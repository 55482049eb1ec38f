"""Database URLs, engines (read-write and read-only), migrations and the schema-version check.

SQLite is the embedded default: a plain path (``ledger.db``) means ``sqlite:///ledger.db``.
PostgreSQL comes by URL (``postgresql://user@host/db``, run through psycopg 3). Every
failure to reach or recognise a ledger is a ``LedgerError`` with a one-line message that
never shows a password.
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote

from sqlalchemy import create_engine, event, inspect, pool, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

from ..errors import FedmfError
from ..files import check_private, check_private_path
from .models import VERSION_TABLE

__all__ = [
    "LedgerError",
    "resolve_url",
    "display_url",
    "writer_engine",
    "reader_engine",
    "read_snapshot",
    "upgrade",
    "check_version",
    "head_revision",
    "database_errors",
    "private_sqlite_file",
    "migrate",
]

T = TypeVar("T")
MIGRATIONS = Path(__file__).with_name("migrations")
CONNECT_TIMEOUT_S = 10


class LedgerError(FedmfError):
    """A ledger that cannot be reached, trusted or used as asked (one-line message)."""


def _one_line(text_: object) -> str:
    lines = [line.strip() for line in str(text_).splitlines() if line.strip()]
    return lines[0] if lines else type(text_).__name__


def resolve_url(url: str | os.PathLike) -> URL:
    """A SQLAlchemy URL for ``url``: a path means SQLite; postgres(ql):// means psycopg 3."""
    if isinstance(url, os.PathLike) or (isinstance(url, str) and "://" not in url):
        path = os.fspath(url)
        if not path:
            raise LedgerError("empty ledger URL")
        return URL.create("sqlite", database=os.path.abspath(path))
    if not isinstance(url, str):
        raise LedgerError(f"a ledger URL must be a string, not {type(url).__name__}")
    try:
        parsed = make_url(_userinfo_to_last_at(url))
    except (ArgumentError, ValueError):
        raise LedgerError(f"not a database URL: {_safe_text(url)!r}") from None
    backend = parsed.get_backend_name()
    if backend in ("postgres", "postgresql"):
        if parsed.drivername in ("postgres", "postgresql"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif parsed.drivername != "postgresql+psycopg":
            raise LedgerError(f"unsupported PostgreSQL driver {parsed.drivername!r} (use postgresql://…)")
        return parsed
    if backend == "sqlite":
        if parsed.drivername != "sqlite":
            raise LedgerError(f"unsupported SQLite driver {parsed.drivername!r} (use sqlite:///PATH)")
        return parsed
    raise LedgerError(
        f"unsupported ledger database {backend!r}: use a path, sqlite:///PATH or postgresql://USER@HOST/DB"
    )


#: parts of a query-string key that make its value password-like, in any case (libpq takes
#: password= and sslpassword= in the query string; drivers and proxies add their own)
_SECRET_KEY_PARTS = ("pass", "pwd", "pw", "secret", "token", "credential", "auth", "apikey", "api_key")
_AUTHORITY = re.compile(r"^([^:/?#]+://)([^/?#]*)(.*)$", re.DOTALL)
_QUERY_ITEM = re.compile(r"([?&;])([^=&;#]*)(=?)([^&;#]*)")


def _is_secret_key(key: str) -> bool:
    """Whether a URL query key names a password-like value (password, PASSWORD, sslPassword,
    passwd, pw, secret, token, apikey, …)."""
    lowered = key.lower()
    return any(part in lowered for part in _SECRET_KEY_PARTS)


def _userinfo_to_last_at(url: str) -> str:
    """``url`` with every '@' of its authority but the last percent-encoded: a host never holds
    an '@' (RFC 3986, 3.2), so ``u:S3c@ret@h`` is user u, password ``S3c@ret``, host h (a URL
    parser that stops at the first '@' would take ``ret@h`` for the host and show ``ret``)."""
    match = _AUTHORITY.match(url)
    if match is None or match.group(2).count("@") < 2:
        return url
    userinfo, host = match.group(2).rsplit("@", 1)
    return f"{match.group(1)}{userinfo.replace('@', '%40')}@{host}{match.group(3)}"


def _safe_text(url: str) -> str:
    """``url`` with any password replaced (for messages about unparsable URLs): the userinfo's
    (everything up to the authority's last '@') and every password-like query value (keys
    percent-decoded before matching)."""
    match = _AUTHORITY.match(url)
    if match is None:
        return url
    scheme, authority, rest = match.groups()
    if "@" in authority:
        creds, host = authority.rsplit("@", 1)
        if ":" in creds:
            creds = creds.split(":", 1)[0] + ":***"
        authority = f"{creds}@{host}"

    def mask(item: re.Match) -> str:
        sep, key, eq, value = item.groups()
        return f"{sep}{key}{eq}***" if eq and _is_secret_key(unquote(key)) else item.group(0)

    return f"{scheme}{authority}{_QUERY_ITEM.sub(mask, rest)}"


def display_url(url: URL) -> str:
    """``url`` for logs and messages: the password masked (``***``), also every password-like
    value in the query string (any case)."""
    query = {k: ("***" if _is_secret_key(k) else v) for k, v in url.query.items()}
    return _userinfo_in_host(url).set(query=query).render_as_string(hide_password=True)


def _userinfo_in_host(url: URL) -> URL:
    """A URL parsed at the first '@' of ``u:S3c@ret@h`` (host ``ret@h``): what precedes the
    host's last '@' is the rest of the password."""
    if not url.host or "@" not in url.host:
        return url
    rest, host = url.host.rsplit("@", 1)
    return url.set(host=host, password=f"{url.password or ''}@{rest}")


def public_url(url: str | os.PathLike) -> str:
    """``url`` without any password (userinfo or query string): what a printed ``fedmf audit
    --ledger`` command or a results file may hold. It still connects where the password comes
    from ``.pgpass`` / ``PGPASSWORD``. A path is returned as it is."""
    text = os.fspath(url)
    if "://" not in text:
        return text
    try:
        parsed = _userinfo_in_host(make_url(_userinfo_to_last_at(text)))
    except (ArgumentError, ValueError):
        return _safe_text(text)
    query = {k: v for k, v in parsed.query.items() if not _is_secret_key(k)}
    # URL.set(password=None) means "unchanged"; URL is a named tuple, so _replace clears it
    return parsed._replace(password=None).set(query=query).render_as_string(hide_password=False)


def _is_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


WRITE = {"fedmf_write": True}  # execution options of a writing transaction: ``engine.execution_options(**WRITE)``


def _sqlite_transactions(engine: Engine, *, foreign_keys: bool) -> None:
    """pysqlite's own transaction handling skips BEGIN before DDL and SELECT; take it over
    so that migrations and reads are real transactions (SQLAlchemy's documented recipe).

    A transaction on a connection with the ``WRITE`` options takes the write lock up front
    (BEGIN IMMEDIATE) and so waits its turn (the busy timeout) behind another process's writer
    instead of failing on a lock upgrade; reads stay deferred. The writer puts a file ledger in
    WAL mode (readers, the audit among them, never block a writer nor wait for one) with
    synchronous=FULL, so a committed round survives a power cut."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):  # pragma: no cover - exercised through every test
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if foreign_keys:  # the writer
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA cache_size = -65536")  # 64 MiB: keys land all over the eligibility index
            cursor.execute("PRAGMA journal_mode = WAL")  # persistent; in-memory databases keep "memory"
            cursor.execute("PRAGMA synchronous = FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):  # pragma: no cover
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("fedmf_write") else "BEGIN")


def writer_engine(url: URL) -> Engine:
    """An engine that may create and migrate the ledger."""
    if url.get_backend_name() == "sqlite":
        if _is_memory(url):
            engine = create_engine(url, poolclass=pool.StaticPool, connect_args={"check_same_thread": False})
        else:
            directory = Path(url.database).parent
            if not directory.is_dir():
                raise LedgerError(f"cannot create ledger {display_url(url)}: directory {str(directory)!r} does not exist")
            engine = create_engine(url, connect_args={"timeout": 30})
        _sqlite_transactions(engine, foreign_keys=True)
        return engine
    return create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}, pool_pre_ping=True)


def reader_engine(url: URL) -> Engine:
    """An engine that cannot write: PostgreSQL sessions in READ ONLY, REPEATABLE READ
    transactions; SQLite opened with mode=ro (a missing file is an error, never created) and,
    when no -wal file lies beside it (no server has it open, none left committed pages
    behind), as immutable: SQLite then creates no -wal or -shm file either. With a -wal (a live
    server, or one that stopped without closing it) the reader uses the server's WAL index, as
    any reader does. ``read_snapshot`` adds the checks that make both safe."""
    if url.get_backend_name() == "sqlite":
        if _is_memory(url):
            raise LedgerError("an in-memory SQLite database holds no ledger to audit")
        path = Path(url.database)
        if not path.is_file():
            raise LedgerError(f"no ledger at {str(path)!r}: file not found")
        path = path.resolve()
        uri = f"file:{quote(str(path))}?mode=ro"
        if not Path(f"{path}-wal").exists():
            uri += "&immutable=1"

        def creator() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False)

        engine = create_engine("sqlite://", creator=creator, poolclass=pool.NullPool)
        _sqlite_transactions(engine, foreign_keys=False)
        return engine
    engine = create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}, poolclass=pool.NullPool)
    return engine.execution_options(postgresql_readonly=True, isolation_level="REPEATABLE READ")


def _scrubbed(message: str, url: URL) -> str:
    """A driver's message with the URL's password and password-like query values masked, should
    the driver quote them."""
    secrets_ = [url.password] if url.password else []
    for key, value in url.query.items():
        if _is_secret_key(key):
            secrets_ += [value] if isinstance(value, str) else list(value)
    for secret in sorted((str(s) for s in secrets_ if s), key=len, reverse=True):
        message = message.replace(secret, "***")
    return message


_READ_TRIES = 3


def _file_signature(path: Path) -> tuple:
    """What changes when anyone writes a SQLite ledger (its file, or a new -wal beside it)."""
    try:
        st = path.stat()
    except OSError:  # gone meanwhile: read again (and report it)
        return (None, None, None, False)
    return st.st_ino, st.st_size, st.st_mtime_ns, Path(f"{path}-wal").exists()


def read_snapshot(url: URL, read: Callable[[Connection], T], doing: str = "cannot read ledger") -> T:
    """``read(connection)`` in one read-only transaction (one snapshot), writing nothing.

    SQLite: read as immutable, the result is kept only if the file did not change meanwhile (a
    server that started writing is read again, through its WAL); a -wal without its -shm (a
    server stopped without closing the ledger) is read from a private copy of both files, so
    that no -shm is created beside the ledger."""
    sqlite = url.get_backend_name() == "sqlite" and not _is_memory(url)
    for _ in range(_READ_TRIES):
        path = Path(url.database).resolve() if sqlite else None
        if path is not None and path.is_file() and Path(f"{path}-wal").exists() and not Path(f"{path}-shm").exists():
            return _read_copy(path, url, read, doing)
        before = _file_signature(path) if path is not None and path.is_file() else None
        result = _read_once(url, url, read, doing)
        if before is None or before[3] or _file_signature(path) == before:
            return result
    raise LedgerError(f"{display_url(url)} kept changing while it was read; try again")


def _read_once(reader_url: URL, url: URL, read: Callable[[Connection], T], doing: str) -> T:
    """``read`` in one transaction on a ``reader_engine(reader_url)``; errors name ``url``."""
    with database_errors(url, doing):
        engine = reader_engine(reader_url)
    try:
        with database_errors(url, doing), engine.connect() as connection:
            transaction = connection.begin()
            try:
                return read(connection)
            finally:
                transaction.rollback()
    finally:
        engine.dispose()


def _read_copy(path: Path, url: URL, read: Callable[[Connection], T], doing: str) -> T:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fedmf-audit-") as directory:
        copy = Path(directory) / "ledger.db"
        try:
            shutil.copyfile(path, copy)
            shutil.copyfile(f"{path}-wal", f"{copy}-wal")
        except OSError as e:
            raise LedgerError(f"{doing} {display_url(url)}: {e.strerror or e}") from None
        return _read_once(URL.create("sqlite", database=str(copy)), url, read, doing)


@contextmanager
def database_errors(url: URL, doing: str) -> Iterator[None]:
    """Turn driver errors into one-line LedgerErrors that name the ledger (passwords hidden)."""
    try:
        yield
    except LedgerError:
        raise
    except DBAPIError as e:
        orig = getattr(e, "orig", None) or e
        raise LedgerError(f"{doing} {display_url(url)}: {_scrubbed(_one_line(orig), url)}") from None
    except SQLAlchemyError as e:  # NoSuchModuleError and ArgumentError among them
        raise LedgerError(f"{doing} {display_url(url)}: {_scrubbed(_one_line(e), url)}") from None


# ---- migrations and versions ----------------------------------------------------------------

def _alembic_config(connection: Connection | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def _script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config())


def head_revision() -> str:
    return _script().get_current_head()


def known_revisions() -> list[str]:
    return [s.revision for s in _script().walk_revisions()]


def current_revision(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def check_version(connection: Connection, url: URL, *, allow_empty: bool, allow_older: bool) -> str | None:
    """The ledger's schema revision after checking it is one this fedmf can use.

    Returns None for an empty database when ``allow_empty``. Raises LedgerError for a
    database without the ledger's tables, a revision from a newer fedmf, an unknown
    revision, or (unless ``allow_older``) an older one.
    """
    tables = set(inspect(connection).get_table_names())
    head = head_revision()
    if VERSION_TABLE not in tables:
        if tables & {"runs", "rounds", "participations"} or (tables and not allow_empty):
            raise LedgerError(f"{display_url(url)} is not a fedmf ledger (no {VERSION_TABLE} table)")
        if not allow_empty:
            raise LedgerError(f"{display_url(url)} holds no fedmf ledger (empty database)")
        return None
    revision = current_revision(connection)
    if revision is None:
        if allow_empty:
            return None
        raise LedgerError(f"{display_url(url)} holds no fedmf ledger (no schema version recorded)")
    known = known_revisions()
    if revision not in known:
        if revision.isdigit() and head.isdigit() and int(revision) > int(head):
            raise LedgerError(
                f"ledger {display_url(url)} has schema version {revision}, newer than this fedmf "
                f"understands ({head}); upgrade fedmf to read it"
            )
        raise LedgerError(f"ledger {display_url(url)} has an unknown schema version {revision!r}")
    if revision != head and not allow_older:
        raise LedgerError(
            f"ledger {display_url(url)} has schema version {revision}, older than this fedmf's {head}; "
            "migrate it as its owner (the fedmf ledger migrate command)"
        )
    return revision


def upgrade(engine: Engine, url: URL) -> tuple[str | None, str]:
    """Create or migrate the ledger to the head revision in one transaction; returns the revision
    it had (None: an empty database) and the head."""
    from alembic import command

    with database_errors(url, "cannot open ledger"), engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            # SQLite's procedure for schema changes: foreign keys off outside the transaction (a table
            # rebuilt by a migration must not cascade-delete its children), checked before COMMIT
            connection.connection.dbapi_connection.execute("PRAGMA foreign_keys = OFF")
        try:
            with connection.execution_options(**WRITE).begin():
                if not sqlite:
                    # two servers starting at once must not both migrate
                    connection.execute(text("SELECT pg_advisory_xact_lock(7213540911)"))
                revision = check_version(connection, url, allow_empty=True, allow_older=True)
                head = head_revision()
                if revision != head:
                    command.upgrade(_alembic_config(connection), "head")
                    if sqlite and connection.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
                        raise LedgerError(f"cannot migrate ledger {display_url(url)}: it breaks a foreign key")
                return revision, head
        finally:
            if sqlite:
                connection.connection.dbapi_connection.execute("PRAGMA foreign_keys = ON")


def private_sqlite_file(url: URL) -> None:
    """A local SQLite ledger is created 0600 (its participation log is confidential; SQLite gives
    its -wal and -shm files the database file's mode); one owned by another user or writable by
    group or others is refused (``fedmf.files.check_private``), as is one reached through a
    directory or link another user could change (``fedmf.files.check_private_path``)."""
    path = url.database if url.get_backend_name() == "sqlite" else None
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    check_private_path(path, "SQLite ledger", LedgerError)  # the directories and links on the way to it
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError:
        return  # an unwritable place: opening the ledger reports it in one line
    check_private(path, "SQLite ledger", LedgerError, others_may_read=True)


def migrate(url: str | os.PathLike | URL) -> tuple[str | None, str]:
    """Create or migrate the ledger at ``url`` to this fedmf's schema, as ``Ledger.open`` does first,
    and close it; returns the schema revision it had (None: a new or empty database) and the one
    it has now. A ledger from a newer fedmf is refused (``LedgerError``)."""
    resolved = url if isinstance(url, URL) else resolve_url(url)
    private_sqlite_file(resolved)
    with database_errors(resolved, "cannot open ledger"):
        engine = writer_engine(resolved)
    try:
        return upgrade(engine, resolved)
    finally:
        engine.dispose()
