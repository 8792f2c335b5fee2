"""``postgresql://`` / ``postgres://``: semaphores in a PostgreSQL table (psycopg 3).

``postgresql://user:password@host:5432/dbname?schema=celery_semaphore&timeout=10`` is a libpq
connection URI: every query parameter but ``schema`` and ``timeout`` goes to libpq as it is
(``sslmode``, ``sslrootcert``, ``connect_timeout``, ``target_session_attrs``, ``options`` ...).
A Django project can give the DSN of its own database: the semaphores keep to their schema.

Guarantees:

* One table, ``<schema>.semaphores`` (``name`` = key prefix + semaphore name, ``state`` the
  semaphore's whole state as ``jsonb``, ``expires``), created on first write with its schema
  (``CREATE ... IF NOT EXISTS`` under an advisory lock, so processes starting together do not
  race; a schema or table that already exists is never created, so a role without ``CREATE``
  works once a DBA has run the DDL of :data:`DDL`). Reads never create anything.
* Every operation is one ``READ COMMITTED`` transaction on the engine of :mod:`.engine`: the
  semaphore's row is read ``FOR UPDATE`` (creation races end in ``INSERT ... ON CONFLICT DO
  NOTHING``: the loser starts over), the rule applied, the row written, ``COMMIT``. Time is
  the server's ``clock_timestamp()`` taken once the row lock is held, never a client clock.
* An idle semaphore's row expires ``idle_ttl`` after its last write and is deleted by the next
  operation of any client (each process deletes expired rows at most every ``sweep_interval``,
  skipping rows another transaction holds): nothing is left behind once the semaphores are
  idle and any client still runs.
* Wake-ups: ``NOTIFY`` (after the state's ``COMMIT``) on a channel per waiting process, which
  one daemon thread ``LISTEN``\\s to on a connection of its own, reconnecting when it is lost
  (within a quarter of a second of the server's return) and then waking every local waiter,
  since notifications sent meanwhile are gone.
  A wake-up is a hint: waiters also poll, so a dead listener only slows them to their poll
  interval. Notifications do not pass a PgBouncer in transaction mode: use session mode, or
  connect to PostgreSQL directly.
* Connections: one per thread (and per process: a forked child opens its own and never closes
  its parent's), opened lazily, in autocommit mode with explicit transactions. A connection
  found broken or read-only by an operation is dropped and that operation is tried once more
  on a new one (a stale connection after a server restart; a session left on the old primary
  after a failover, where a multi-host URL with ``target_session_attrs=read-write`` reaches the
  new one); a repeated operation leaves the same state, though a repeated release answers
  False. Sessions run with ``statement_timeout``, ``lock_timeout`` and
  ``idle_in_transaction_session_timeout`` of ``timeout`` seconds, so a frozen client cannot
  hold a semaphore's row lock for longer than that.

Errors: a server that cannot be reached, a lost connection (after the one retry), a timeout,
a read-only server (a standby), too many connections, a shutdown, missing privileges raise
:class:`BackendUnavailable` naming the URL (password masked). A URL libpq cannot parse, an
unknown query parameter, a bad ``schema`` or ``timeout`` raise :class:`ConfigurationError`
when the backend is made.

Not guaranteed: a commit is durable on the server that acknowledged it. Under a failover to an
asynchronous replica the last commits can be lost: a slot granted just before can be granted
again (fencing tokens are the defence; ``synchronous_commit = remote_apply`` with a synchronous
standby closes the gap). A holder cut off from the server keeps running until its local
deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from contextlib import contextmanager
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    NoReturn,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import psycopg
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from ..exceptions import BackendUnavailable, ConfigurationError
from ..urls import mask_url
from .base import LISTENER_RETRY_FIRST
from .engine import DocumentBackend, Rule, Transaction
from .model import State

logger = logging.getLogger(__name__)

DEFAULT_SCHEMA = "celery_semaphore"
TABLE = "semaphores"
#: The DDL run on first write, ``{schema}`` a quoted identifier; a DBA may run it instead.
DDL = """
CREATE TABLE IF NOT EXISTS {schema}.semaphores (
    name text PRIMARY KEY,
    state jsonb NOT NULL,
    expires timestamptz NOT NULL
) WITH (fillfactor = 50)
"""
# fillfactor: every operation rewrites its semaphore's row; free room in each page keeps those
# updates HOT (no index touched, dead versions pruned in place).

#: Every statement; ``{t}`` is the table, ``{schema}`` its schema (quoted identifiers).
STATEMENTS = {
    # The row is locked in the CTE; clock_timestamp() is read after the join, that is once the
    # lock is held, so a wait for the lock never makes the time stale.
    "load": "WITH locked AS (SELECT state, expires FROM {t} WHERE name = %s FOR UPDATE) "
            "SELECT extract(epoch FROM clock_timestamp())::float8, l.state, "
            "extract(epoch FROM l.expires)::float8 "
            "FROM (VALUES (1)) AS one LEFT JOIN locked AS l ON true",
    # a read (status, verify): the row as last committed, locked by nobody
    "peek": "WITH seen AS (SELECT state, expires FROM {t} WHERE name = %s) "
            "SELECT extract(epoch FROM clock_timestamp())::float8, l.state, "
            "extract(epoch FROM l.expires)::float8 "
            "FROM (VALUES (1)) AS one LEFT JOIN seen AS l ON true",
    "insert": "INSERT INTO {t} (name, state, expires) VALUES (%s, %s::jsonb, to_timestamp(%s)) "
              "ON CONFLICT (name) DO NOTHING",
    "update": "UPDATE {t} SET state = %s::jsonb, expires = to_timestamp(%s) WHERE name = %s",
    "delete": "DELETE FROM {t} WHERE name = %s",
    "names": "SELECT name FROM {t} WHERE left(name, %s) = %s AND expires > clock_timestamp()",
    # rows another transaction holds are being used: skipped, not waited for
    "sweep": "DELETE FROM {t} WHERE name IN (SELECT name FROM {t} "
             "WHERE expires <= clock_timestamp() FOR UPDATE SKIP LOCKED)",
    "schema": "CREATE SCHEMA IF NOT EXISTS {schema}",
    "ddl": DDL,
}
#: Options the backend takes from the URL's query; the rest go to libpq.
URL_OPTIONS = ("schema", "timeout")
#: libpq settings used unless the URL gives its own.
LIBPQ_DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "celery-semaphore",
    # a dead peer (or a partition) is noticed within about a minute, also by an idle listener
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
#: Errors that mean "the server cannot serve us now": connection failures, shutdowns, timeouts,
#: too many connections (OperationalError); a read-only transaction (a standby, or a primary
#: demoted by a failover); missing privileges (a role not yet granted what it needs).
_UNAVAILABLE = (psycopg.OperationalError, psycopg.InterfaceError,
                errors.ReadOnlySqlTransaction, errors.InsufficientPrivilege)
#: The table (or its schema) does not exist yet.
_NO_TABLE = (errors.UndefinedTable, errors.InvalidSchemaName)

Result = TypeVar("Result")


class _StaleConnection(BackendUnavailable):
    """A connection this thread had used before broke: the operation may be tried once more
    on a new connection."""


class _NoTable(Exception):
    """The semaphores table does not exist (yet)."""


def parse_url(url: str) -> Dict[str, Any]:
    """Split a ``postgresql://`` URL into ``conninfo`` (for libpq), ``schema`` and
    ``timeout``; raise ConfigurationError naming what is wrong, password masked."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError as exc:
        raise ConfigurationError(f"postgresql URL {mask_url(url)!r} is malformed: {exc}") from None
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise ConfigurationError(
            f"not a postgresql:// or postgres:// URL: {mask_url(url)!r}")
    ours = {k: v for k, v in query if k in URL_OPTIONS}
    # libpq's own parameters pass as written (libpq decodes %XX, not "+")
    rest = "&".join(item for item in parts.query.split("&")
                    if item and unquote(item.partition("=")[0]) not in URL_OPTIONS)
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ConfigurationError(f"postgresql URL {mask_url(url)!r}: {exc}") from None
    defaults = {k: v for k, v in LIBPQ_DEFAULTS.items() if k not in given}
    return {"conninfo": make_conninfo(conninfo, **defaults), "schema": ours.get("schema"),
            "timeout": ours.get("timeout")}


def check_schema(schema: Any) -> str:
    if not isinstance(schema, str) or not _IDENTIFIER.match(schema):
        raise ConfigurationError(
            f"postgresql schema must be a plain identifier (letters, digits and _, at most 63, "
            f"not starting with a digit), not {schema!r}")
    return schema


def check_seconds(value: Any, what: str) -> float:
    """``value`` (a number, or a URL's string) as seconds above 0 and below a day."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 < seconds < 86400:
        raise ConfigurationError(
            f"postgresql {what} must be a number of seconds above 0 and below a day, "
            f"not {value!r}")
    return seconds


def channel_of(client: str) -> str:
    """The notification channel of a process (its ``client_id``): a plain identifier, well
    within PostgreSQL's 63 bytes whatever the host name."""
    return "celery_semaphore_" + hashlib.sha1(client.encode()).hexdigest()[:24]


class PgTransaction(Transaction):
    """``version`` is the connection inside the transaction; ``exists``: the semaphore's row
    exists (and is locked), even when expired (``state`` None)."""

    def __init__(self, name: str, state: Optional[State], now: float,
                 conn: psycopg.Connection, exists: bool, fresh: bool) -> None:
        super().__init__(name, state, now, conn)
        self.exists = exists
        self.fresh = fresh  # the connection was made for this transaction


class PostgresBackend(DocumentBackend):
    """Semaphores in one PostgreSQL table, shared by every client of the database.

    ``schema`` (default ``celery_semaphore``; also ``?schema=`` in the URL) is where the table
    lives; ``timeout`` (seconds, default 10; also ``?timeout=``) bounds every statement, lock
    wait and transaction; ``sweep_interval`` (seconds, default ``min(60, idle_ttl)``) is how
    often a process deletes expired rows.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: Optional[str] = None,
        timeout: Optional[float] = None,
        sweep_interval: Optional[float] = None,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        parsed = parse_url(url)
        self.conninfo: str = parsed["conninfo"]
        self.schema = check_schema(next(v for v in (schema, parsed["schema"], DEFAULT_SCHEMA)
                                        if v is not None))
        self.timeout = check_seconds(next(v for v in (timeout, parsed["timeout"], 10.0)
                                          if v is not None), "timeout")
        self.sweep_interval = (min(60.0, self.idle_ttl) if sweep_interval is None
                               else check_seconds(sweep_interval, "sweep_interval"))
        self._sql = {key: sql.SQL(text).format(t=sql.Identifier(self.schema, TABLE),
                                               schema=sql.Identifier(self.schema))
                     for key, text in STATEMENTS.items()}
        self._local = threading.local()
        self._connections: "weakref.WeakSet[psycopg.Connection]" = weakref.WeakSet()
        self._connections_lock = threading.Lock()
        self._next_sweep = 0.0
        self._closed = threading.Event()
        self._listen_lock = threading.Lock()
        self._listener: Optional[threading.Thread] = None
        self._listen_conn: Optional[psycopg.Connection] = None

    # -- connections -------------------------------------------------------------------------

    def _connect(self, purpose: str) -> psycopg.Connection:
        """A new autocommit connection with this backend's session settings."""
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise BackendUnavailable(
                f"postgresql semaphore backend {mask_url(self.url)} unavailable ({purpose}): "
                f"{exc}") from exc
        try:
            millis = str(int(self.timeout * 1000))
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), "
                "set_config('lock_timeout', %s, false), "
                "set_config('idle_in_transaction_session_timeout', %s, false)",
                (millis, millis, millis))
        except psycopg.Error as exc:
            conn.close()
            raise BackendUnavailable(
                f"postgresql semaphore backend {mask_url(self.url)} unavailable ({purpose}): "
                f"{exc}") from exc
        with self._connections_lock:
            self._connections.add(conn)
        self._server_answered()
        return conn

    def _connection(self) -> Tuple[psycopg.Connection, bool]:
        """This thread's connection, and whether it was just made."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid() and not conn.closed:
            return conn, False
        conn = self._connect("operations")
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn, True

    def _drop(self, conn: psycopg.Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        try:
            conn.close()
        except Exception:
            pass

    def _raise(self, conn: psycopg.Connection, fresh: bool, exc: psycopg.Error) -> NoReturn:
        """Raise what ``exc``, met on ``conn`` (``fresh``: just made), means, after rolling
        back or dropping the connection: _NoTable, _StaleConnection (a connection used before
        broke or went read-only: worth one more try on a new one), BackendUnavailable, or
        ``exc`` itself (a bug)."""
        if isinstance(exc, _NO_TABLE):
            self._rollback(conn)
            raise _NoTable() from exc
        # A read-only server is a standby, or the old primary after a failover: a new
        # connection may reach the new primary (a multi-host URL with
        # target_session_attrs=read-write), so this one is dropped like a broken one.
        broken = conn.broken or conn.closed or isinstance(exc, errors.ReadOnlySqlTransaction)
        if broken:
            self._drop(conn)
        else:
            self._rollback(conn)
        url = mask_url(self.url)
        if isinstance(exc, errors.InsufficientPrivilege):
            raise BackendUnavailable(
                f"postgresql semaphore backend {url}: {exc} (the role needs SELECT, INSERT, "
                f"UPDATE, DELETE on {self.schema}.{TABLE}, and CREATE on the database or schema "
                f"until the table exists)") from exc
        if isinstance(exc, _UNAVAILABLE):
            kind = _StaleConnection if broken and not fresh else BackendUnavailable
            raise kind(f"postgresql semaphore backend {url} unavailable: "
                       f"{type(exc).__name__}: {exc}") from exc
        raise exc

    def _rollback(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.info.transaction_status == TransactionStatus.IDLE:
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error:
            self._drop(conn)

    def _run(self, fn: Callable[[psycopg.Connection], Result]) -> Result:
        """``fn(connection)`` outside the engine, errors mapped as for operations."""
        for attempt in range(2):
            conn, fresh = self._connection()
            try:
                return fn(conn)
            except psycopg.Error as exc:
                try:
                    self._raise(conn, fresh, exc)
                except _StaleConnection:
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    # -- storage -------------------------------------------------------------------------------

    def _transact(self, name: str, rule: Rule[Result], *, write: bool = True) -> Result:
        """The engine's transaction, tried once more after a stale connection; creates the
        table when a write finds none, and answers a read on a missing table as on an absent
        semaphore."""
        return self._retrying(lambda: super(PostgresBackend, self)._transact(name, rule,
                                                                            write=write),
                              lambda: rule(Transaction(name, None, time.time())), write)

    def _transact_many(self, names: Sequence[str],
                       rule: Callable[[Dict[str, Transaction]], Result]) -> Result:
        """:meth:`_transact` over several rows: one transaction locks them ``FOR UPDATE`` one
        by one in sorted name order (so two such transactions never deadlock)."""
        return self._retrying(lambda: super(PostgresBackend, self)._transact_many(names, rule),
                              None, True)

    def _retrying(self, run: Callable[[], Result], absent: Optional[Callable[[], Result]],
                  write: bool) -> Result:
        """``run()``, again after a stale connection or once the missing table is created;
        ``absent()`` (a read's answer when the table is missing: reads pass one) instead
        of creating it when ``write`` is False."""
        stale = created = False
        while True:
            try:
                return run()
            except _StaleConnection:
                if stale:
                    raise
                stale = True
            except _NoTable:
                if not write:
                    assert absent is not None
                    return absent()
                if created:
                    raise BackendUnavailable(
                        f"postgresql semaphore backend {mask_url(self.url)}: the table "
                        f"{self.schema}.{TABLE} disappeared right after it was created") from None
                self._create_table()
                created = True

    def _create_table(self) -> None:
        """Create the schema and table unless they exist; an advisory lock serializes the
        processes that try at once (``IF NOT EXISTS`` alone can fail on a catalog race)."""
        def create(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                             (f"celery_semaphore.ddl:{self.schema}",))
                exists = conn.execute(
                    "SELECT to_regclass(%s) IS NOT NULL, "
                    "EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)",
                    (sql.Identifier(self.schema, TABLE).as_string(conn), self.schema)).fetchone()
                if exists is not None and exists[0]:
                    return
                if exists is None or not exists[1]:
                    conn.execute(self._sql["schema"])
                conn.execute(self._sql["ddl"])
            logger.info("celery-semaphore: created table %s.%s", self.schema, TABLE)

        self._run(create)

    @contextmanager
    def _load(self, name: str) -> Iterator[Transaction]:
        """Inside ``BEGIN``, the semaphore's row locked ``FOR UPDATE`` until :meth:`_commit`
        commits or the transaction rolls back."""
        with self._load_many([name]) as (txn,):
            yield txn

    @contextmanager
    def _read(self, name: str) -> Iterator[Transaction]:
        """Inside ``BEGIN``, the row as last committed, locked by nobody: a read neither waits
        for a writer's lock nor holds one up."""
        with self._load_many([name], lock=False) as (txn,):
            yield txn

    multi_document = True

    @contextmanager
    def _load_many(self, names: Sequence[str], lock: bool = True
                   ) -> Iterator[List[Transaction]]:
        """Inside one ``BEGIN``, each row locked ``FOR UPDATE`` in the (sorted) order given
        (``lock`` False: read as last committed)."""
        conn, fresh = self._connection()
        txns: List[Transaction] = []
        query = self._sql["load" if lock else "peek"]
        try:
            conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            for name in names:
                row = conn.execute(query, (self.key_prefix + name,)).fetchone()
                assert row is not None
                now, raw, expires = row
                live = raw is not None and expires > now
                txns.append(PgTransaction(name, State.from_dict(raw) if live else None, now,
                                          conn, exists=raw is not None, fresh=fresh))
        except psycopg.Error as exc:
            self._raise(conn, fresh, exc)
        try:
            yield txns
        finally:
            self._rollback(conn)  # not committed: a read, a lost race or a rule that raised

    def _commit_many(self, txns: Sequence[Transaction]) -> bool:
        for txn in txns:
            if not self._write(txn):
                return False
        first = txns[0]
        assert isinstance(first, PgTransaction)  # as _write checked
        try:
            first.version.execute("COMMIT")
        except psycopg.Error as exc:
            self._raise(first.version, first.fresh, exc)
        return True

    def _write(self, txn: Transaction) -> bool:
        """Write ``txn``'s row (no commit); False when another client created it meanwhile."""
        assert isinstance(txn, PgTransaction)
        conn, key = txn.version, self.key_prefix + txn.name
        try:
            if txn.state is None:
                if txn.exists:
                    conn.execute(self._sql["delete"], (key,))
            else:
                state = txn.state.dumps()
                expires = txn.now + txn.state.keep_for(txn.now, self.idle_ttl)
                if txn.exists:
                    conn.execute(self._sql["update"], (state, expires, key))
                elif conn.execute(self._sql["insert"], (key, state, expires)).rowcount == 0:
                    return False
        except psycopg.Error as exc:
            self._raise(conn, txn.fresh, exc)
        return True

    def _commit(self, txn: Transaction) -> bool:
        return self._commit_many([txn])

    def _after_commit(self, txn: Transaction) -> None:
        self._sweep_if_due()

    def _sweep_if_due(self) -> None:
        """:meth:`_sweep`, at most once per ``sweep_interval`` in this process."""
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self.sweep_interval
            self._sweep()

    def _sweep(self) -> int:
        """Delete every expired row (of any key prefix: none is visible to anyone); rows other
        transactions hold are skipped. Returns how many were deleted; never raises."""
        try:
            return self._run(lambda conn: conn.execute(self._sql["sweep"]).rowcount)
        except (BackendUnavailable, _NoTable):
            return 0
        except psycopg.Error as exc:
            logger.warning("celery-semaphore: deleting expired semaphores failed: %s", exc)
            return 0

    def _stored_names(self) -> List[str]:
        self._sweep_if_due()
        prefix = self.key_prefix
        try:
            rows = self._run(lambda conn: conn.execute(
                self._sql["names"], (len(prefix), prefix)).fetchall())
        except _NoTable:
            return []
        return [row[0][len(prefix):] for row in rows]

    def ping(self) -> None:
        self._run(lambda conn: conn.execute("SELECT 1").fetchone())

    # -- wake-ups ------------------------------------------------------------------------------

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        try:
            self._run(lambda conn: conn.execute(
                "SELECT pg_notify(%s, %s)", (channel_of(client), json.dumps([name, holder]))))
        except (BackendUnavailable, psycopg.Error) as exc:  # a hint: the waiter polls anyway
            logger.debug("celery-semaphore: wake-up not sent: %s", exc)

    @property
    def listening(self) -> bool:
        """True while this process's listener connection is up and listening."""
        conn = self._listen_conn
        return conn is not None and not conn.closed

    @property
    def listener_pid(self) -> Optional[int]:
        """The server process id of the listener connection (for operators), or None."""
        conn = self._listen_conn
        return conn.info.backend_pid if conn is not None and not conn.closed else None

    def _start_listening(self) -> None:
        """Start this process's listener thread unless it runs. The first ``LISTEN`` happens
        here, in the caller's thread, so a waiter that starts watching listens before its
        first acquire: no wake-up sent after that is missed."""
        with self._listen_lock:
            if self._closed.is_set() or (self._listener and self._listener.is_alive()):
                return
            try:
                self._listen_conn = self._connect_listener()
            except Exception as exc:  # waiters poll meanwhile; the thread keeps trying
                logger.warning("celery-semaphore: cannot listen for wake-ups yet, waiters "
                               "poll: %s", exc)
                self._listen_conn = None
                self._listener_went()
            self._listener = threading.Thread(
                target=self._listen, name="celery-semaphore-postgres-wake", daemon=True)
            self._listener.start()

    def _connect_listener(self) -> psycopg.Connection:
        conn = self._connect("wake-up listener")
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_of(self.client_id))))
        except psycopg.Error as exc:
            conn.close()
            raise BackendUnavailable(f"LISTEN failed: {exc}") from exc
        return conn

    def _listen(self) -> None:
        """Deliver wake-ups until close(). Connection lost: reconnect, forever, within
        :data:`.LISTENER_RETRY_MAX` of the server's return (at once when an operation of this
        process reaches it first); once back, wake every local waiter (what was notified
        meanwhile is lost)."""
        backoff, lost = LISTENER_RETRY_FIRST, self._listen_conn is None
        while not self._closed.is_set():
            try:
                if self._listen_conn is None:
                    self._listen_conn = self._connect_listener()
                    logger.info("celery-semaphore: wake-up listener connected")
                    self._listener_back()
                    backoff, lost = LISTENER_RETRY_FIRST, False
                for notify in self._listen_conn.notifies(timeout=1.0):
                    if self._closed.is_set():  # close() notified us to stop waiting
                        break
                    self._deliver(notify.payload)
            except Exception as exc:
                if self._closed.is_set():
                    break
                if not lost:
                    logger.warning(
                        "celery-semaphore: wake-up listener of %s lost (%s); reconnecting, "
                        "waiters poll meanwhile", mask_url(self.url), exc)
                lost = True
                self._listener_went()
                conn, self._listen_conn = self._listen_conn, None
                if conn is not None:
                    conn.close()
                backoff = self._listener_pause(backoff)
        conn, self._listen_conn = self._listen_conn, None
        if conn is not None:
            conn.close()

    def _deliver(self, payload: str) -> None:
        try:
            name, holder = json.loads(payload)
        except ValueError:
            return
        try:
            self._notify(name, holder)
        except Exception:  # a broken callback must not stop everyone's wake-ups
            logger.exception("celery-semaphore: wake-up callback failed")

    # -- life cycle ------------------------------------------------------------------------------

    def _forked(self) -> None:
        """The parent's connections and listener are not this process's: drop them without
        closing (closing would end the parent's sessions; psycopg never finishes a
        connection in a process that did not open it)."""
        super()._forked()
        self._local = threading.local()
        self._connections = weakref.WeakSet()
        self._connections_lock = threading.Lock()
        self._listen_lock = threading.Lock()
        self._listener = None
        self._listen_conn = None
        self._next_sweep = 0.0

    def close(self) -> None:
        """Stop the listener and close every connection this process opened."""
        self._closed.set()
        self._listener_kick.set()  # end a pause between reconnection tries
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            if listener.is_alive() and self.listening:  # end its wait for notifications now
                self._send_wakeup(self.client_id, "", "")
            listener.join(3)
        with self._connections_lock:
            conns = list(self._connections)
            self._connections = weakref.WeakSet()
        for conn in conns:
            try:
                conn.close()
            except Exception:
                pass
        self._local = threading.local()
