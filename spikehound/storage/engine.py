"""Engines for the two supported databases, tuned for one batched writer.

>>> make_engine("sqlite:///:memory:").dialect.name
'sqlite'
>>> normalize_url("postgres://u@h/db")
'postgresql+psycopg://u@h/db'
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError

from spikehound.config import redact_url

# libpq's: give up connecting after 10 s; and on an open connection whose server went silent (a partition, a
# host gone without a reset), fail within about 30 s instead of the kernel's 15 minutes of retransmissions.
PG_TIMEOUTS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
               "keepalives_count": 3, "tcp_user_timeout": 30_000}


def normalize_url(url: str) -> str:
    """Route every PostgreSQL URL through psycopg 3, whatever the user wrote."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def in_memory(engine: Engine) -> bool:
    """Whether the database lives in this process's memory (SQLite without a file), where no other process
    can open it.

    >>> in_memory(make_engine("sqlite://")), in_memory(make_engine("sqlite:////tmp/x.db"))
    (True, False)
    """
    return engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:")


SQLITE_HEAP_LIMIT = 128 * 2**20  # bytes of SQLite page caches (and the rest of its heap) in one process


def make_engine(url: str, *, sqlite_synchronous: str = "NORMAL") -> Engine:
    """Create the engine; SQLite gets WAL so API readers never block the writer.

    Raises :class:`DatabaseUnavailable` when a SQLite file's directory cannot be created.
    """
    given_url = url
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # A server that stops answering (a partition, not a refusal) must fail a write within half a minute, not
        # hang the writer: the collector then tells senders to retry and tries again (collector/storage_health.py).
        given = {k: v for k, v in PG_TIMEOUTS.items() if k not in parsed.query}  # the URL's own settings win
        # Last in, first out: the writer takes back the connection it just gave back, and the others stay idle
        # for the API's bursts. libpq keeps each connection's send buffer at the largest batch it ever sent;
        # handed round the pool, every batch would leave every connection holding its size.
        engine = create_engine(url, pool_size=8, max_overflow=4, pool_use_lifo=True, connect_args=given)
        _ping_when_idle(engine)
        return engine
    if parsed.database and parsed.database != ":memory:":
        try:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unavailable(exc, given_url) from None
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={sqlite_synchronous}")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA cache_size=-65536")  # 64 MiB: keeps the span id index hot
        # ... for the connection that writes. Each pooled connection has a cache of its own, and the API's
        # readers fill theirs over hours (the soak saw the collector grow by them): the process's SQLite heap
        # is capped as a whole, and past it the least recently used pages of any connection go first.
        cur.execute(f"PRAGMA soft_heap_limit={SQLITE_HEAP_LIMIT}")
        cur.execute("PRAGMA temp_store=MEMORY")
        cur.close()

    return engine


PING_IDLE_SECONDS = 1.0  # a pooled PostgreSQL connection unused this long is pinged before it is lent again


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping``, for connections that sat unused for ``PING_IDLE_SECONDS`` only.

    A ping is a round trip: at every checkout it was 5 % of the writer's time under load, for a connection
    used a few milliseconds before. One that was idle (a server restarted meanwhile) is still tested, and
    replaced when it fails; a write on a connection that broke since its last use fails like any other
    (``collector/storage_health.py`` retries it).
    """

    @event.listens_for(engine, "checkin")
    def _idle_since(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("idle_since", -PING_IDLE_SECONDS) < PING_IDLE_SECONDS:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # the driver's error: the pool connects anew (up to three times)
            raise DisconnectionError(str(exc)) from exc
        if not alive:
            raise DisconnectionError("the connection did not answer a ping")


# --- a database that cannot be used at start -----------------------------------------------------------------

DATABASE_DOWN_STATUS = 3  # exit status: PostgreSQL down, unreachable or refusing the login (systemd restarts)
DATABASE_PATH_STATUS = 2  # exit status: a SQLite path that cannot be used (a configuration error: not restarted)


class DatabaseUnavailable(Exception):
    """The database cannot be used at start. ``str()`` is one line: what is wrong and what to do.

    ``status`` is the exit status it means: 3 when the server may come up later (systemd starts the daemon
    again), 2 when ``storage.url`` itself names what cannot work (a SQLite path).
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def unavailable(exc: BaseException, url: str) -> DatabaseUnavailable:
    """``exc``, raised opening or migrating the database at ``url``, said in one line with what to do.

    >>> from sqlalchemy.exc import OperationalError
    >>> str(unavailable(OperationalError("connect", {}, Exception("connection failed: connection to server at "
    ...     '"127.0.0.1", port 5433 failed: Connection refused\\n\\tIs the server running')),
    ...     "postgresql://app:s3cret@db:5433/x"))  # doctest: +ELLIPSIS
    'storage.url postgresql://app:***@db:5433/x: cannot connect to PostgreSQL at db:5433: connection refused...'
    >>> unavailable(PermissionError(13, "Permission denied"), "sqlite:////srv/x/s.db").status
    2
    """
    shown = redact_url(url)
    parsed = make_url(normalize_url(url))
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    said = _one_line(cause, url)
    if parsed.get_backend_name() == "sqlite":
        where = Path(parsed.database or "")
        blocking = next((p for p in where.parents if _exists(p)), None)
        if blocking is not None and not blocking.is_dir():
            what = f"{blocking} is not a directory"
        elif isinstance(exc, PermissionError):
            what = (f"cannot reach or create the directory {where.parent} ({exc.strerror}): the collector's user "
                    "needs to enter every directory above it and to write in it")
        elif isinstance(exc, OSError) and exc.strerror:
            what = f"cannot create the directory {where.parent} ({exc.strerror}): create it, writable by the " \
                   "collector's user"
        else:
            what = f"cannot open or write the SQLite file {where} ({said}): make it and its directory writable " \
                   "by the collector's user"
        return DatabaseUnavailable(f"storage.url {shown}: {what}; or set storage.url (SPIKEHOUND_STORAGE_URL, "
                                   "--db) to another path", DATABASE_PATH_STATUS)
    at = f"{parsed.host or 'localhost'}:{parsed.port or 5432}"
    lowered = said.lower()
    if "connection refused" in lowered:
        why = ("connection refused: start PostgreSQL there, or correct the host and port in storage.url "
               "(SPIKEHOUND_STORAGE_URL, --db)")
    elif "resolve host" in lowered or "name or service not known" in lowered or "nodename nor servname" in lowered:
        why = (f"the host name {parsed.host} does not resolve: correct it in storage.url (SPIKEHOUND_STORAGE_URL, "
               "--db), or check the host's DNS")
    elif "timeout" in lowered or "timed out" in lowered or "unreachable" in lowered or "no route" in lowered:
        why = (f"no answer ({said}): the host is down or unreachable, or a firewall drops the packets; check the "
               "address in storage.url and the network path to it")
    elif "authentication" in lowered or "password" in lowered or "role" in lowered:
        why = f"the login was refused ({said}): check the user and password in storage.url"
    elif "does not exist" in lowered:
        why = f"{said}: create it (createdb), or correct the database name in storage.url"
    else:
        why = f"{said}: check storage.url and that PostgreSQL runs there"
    return DatabaseUnavailable(f"storage.url {shown}: cannot connect to PostgreSQL at {at}: {why}",
                               DATABASE_DOWN_STATUS)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False when that cannot be told (a directory above it the user may not enter)."""
    try:
        return path.exists()
    except OSError:
        return False


def _one_line(exc: BaseException, url: str) -> str:
    """The first line of what the driver said, without a password it may have quoted."""
    text = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
    text = re.sub(r"^connection failed: ", "", text)
    password = urlsplit(url).password or ""
    for secret in filter(None, {password, unquote(password)}):
        text = text.replace(secret, "***")
    return text[:300]

