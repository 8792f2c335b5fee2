"""``sqlite:///relative.db`` / ``sqlite:////absolute.db``: semaphores in a file on one host.

Every process on the machine that opens the same file shares the semaphores. Each operation is
one ``BEGIN IMMEDIATE`` transaction (SQLite's write lock) over the semaphore's state, so
operations are atomic across processes. Time is the host's clock, which every process shares.

Wake-ups travel as datagrams over Unix sockets, one per waiting process, in a directory under
the system's temp dir named after the database file; waiters poll as well, so a lost datagram
only delays a waiter by its poll interval. The file must be on a local disk: SQLite's locking
is not reliable over network file systems, and the sockets reach only this host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sqlite3
import stat
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence
from urllib.parse import unquote, urlsplit

from ..exceptions import BackendUnavailable, ConfigurationError
from ..urls import mask_url
from .base import SemaphoreStatus
from .engine import DocumentBackend, Transaction
from .model import State

logger = logging.getLogger(__name__)

# SQLite keeps per-process lock bookkeeping that a forked child inherits: a child forked while
# another thread is inside a transaction believes it holds that lock forever, and its own
# connections then fail with "database is locked" (SQLite: "do not carry an open database
# across fork()"). Prefork pools fork all the time, so no transaction may be in flight at a fork.
_no_fork = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_no_fork.acquire, after_in_parent=_no_fork.release,
                        after_in_child=_no_fork.release)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS semaphores (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    expires REAL NOT NULL
)
"""


def database_path(url: str) -> str:
    """The file a ``sqlite://`` URL names, by SQLAlchemy's convention (3 slashes: relative)."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc or not path.startswith("/") or path == "/":
        raise ConfigurationError(
            f"sqlite URL {mask_url(url)!r} names no file: use sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    return os.path.abspath(path[1:])


class SQLiteBackend(DocumentBackend):
    """Semaphores in one SQLite file, shared by the processes of one host."""

    def __init__(self, url: str, *, busy_timeout: float = 30.0, **options: Any) -> None:
        super().__init__(url, **options)
        self.path = database_path(url)
        self.busy_timeout = busy_timeout
        digest = hashlib.sha1(self.path.encode()).hexdigest()[:12]
        # Per user: a directory another user made (mode 0700) would refuse our sockets.
        self._socket_dir = os.path.join(tempfile.gettempdir(),
                                        f"celery-semaphore-{os.getuid()}-{digest}")
        self._listen_failed = False
        self._local = threading.local()
        self._listener: Optional[socket.socket] = None
        self._closed = threading.Event()
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)

    # -- storage ---------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            try:
                conn = sqlite3.connect(
                    self.path, timeout=self.busy_timeout, isolation_level=None,
                    check_same_thread=False,
                )
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute(_SCHEMA)
            except sqlite3.Error as exc:
                raise BackendUnavailable(
                    f"cannot open semaphore database {self.path}: {exc}"
                ) from exc
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @contextmanager
    def _load(self, name: str) -> Iterator[Transaction]:
        """Inside ``BEGIN IMMEDIATE`` (the database's write lock): no other process writes
        until :meth:`_commit` commits or the transaction rolls back."""
        with self._load_many([name]) as (txn,):
            yield txn

    @contextmanager
    def _read(self, name: str) -> Iterator[Transaction]:
        """Inside a deferred ``BEGIN``: in WAL mode a reader sees the last committed state and
        neither waits for the write lock nor holds it up."""
        with self._load_many([name], begin="BEGIN") as (txn,):
            yield txn

    multi_document = True

    @contextmanager
    def _load_many(self, names: Sequence[str], begin: str = "BEGIN IMMEDIATE"
                   ) -> Iterator[List[Transaction]]:
        """Every document inside one ``BEGIN IMMEDIATE`` (see :meth:`_load`), or ``begin``."""
        with _no_fork:
            conn = self._connection()
            try:
                conn.execute(begin)
            except sqlite3.Error as exc:
                raise BackendUnavailable(
                    f"semaphore database {self.path} is locked: {exc}"
                ) from exc
            try:
                now = time.time()
                txns = []
                for name in names:
                    row = conn.execute(
                        "SELECT state FROM semaphores WHERE name = ? AND expires > ?",
                        (self.key_prefix + name, now),
                    ).fetchone()
                    txns.append(Transaction(name, State.loads(row[0]) if row else None, now,
                                            conn))
                yield txns
            finally:
                if conn.in_transaction:  # not committed: a read, or a rule that raised
                    conn.execute("ROLLBACK")

    def _commit_many(self, txns: Sequence[Transaction]) -> bool:
        for txn in txns:
            self._write(txn)
        txns[0].version.execute("COMMIT")
        return True

    def _commit(self, txn: Transaction) -> bool:
        self._write(txn)
        txn.version.execute("COMMIT")
        return True

    def _write(self, txn: Transaction) -> None:
        conn, key = txn.version, self.key_prefix + txn.name
        if txn.state is None:
            conn.execute("DELETE FROM semaphores WHERE name = ?", (key,))
        else:
            conn.execute(
                "INSERT OR REPLACE INTO semaphores (name, state, expires) VALUES (?, ?, ?)",
                (key, txn.state.dumps(), txn.now + txn.state.keep_for(txn.now, self.idle_ttl)),
            )

    def _stored_names(self) -> List[str]:
        if not self._exists():
            return []
        with _no_fork:
            conn = self._connection()
            conn.execute("DELETE FROM semaphores WHERE expires <= ?", (time.time(),))
            rows = conn.execute(
                "SELECT name FROM semaphores WHERE substr(name, 1, ?) = ?",
                (len(self.key_prefix), self.key_prefix),
            ).fetchall()
        return [row[0][len(self.key_prefix):] for row in rows]

    # -- wake-ups ----------------------------------------------------------------------------

    def _socket_path(self, client: str) -> str:
        return os.path.join(self._socket_dir, hashlib.sha1(client.encode()).hexdigest()[:16])

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        try:
            self._sender.sendto(json.dumps([name, holder]).encode(), self._socket_path(client))
        except OSError:  # that process is gone or its buffer is full: it polls anyway
            pass

    def _start_listening(self) -> None:
        if self._listener is not None:
            return
        try:
            listener = self._bind()
        except OSError as exc:  # wake-ups are a hint: waiters poll
            if not self._listen_failed:
                logger.warning("celery-semaphore: no wake-ups for %s, waiters poll: %s",
                               self.path, exc)
            self._listen_failed = True
            return
        self._listener = listener
        threading.Thread(
            target=self._listen, args=(listener,), name="celery-semaphore-sqlite-wake",
            daemon=True,
        ).start()

    def _bind(self) -> socket.socket:
        os.makedirs(self._socket_dir, mode=0o700, exist_ok=True)
        info = os.lstat(self._socket_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{self._socket_dir} is not a directory of this user")
        path = self._socket_path(self.client_id)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if os.path.lexists(path):
                os.unlink(path)
            listener.bind(path)
        except OSError:
            listener.close()
            raise
        listener.settimeout(1.0)
        return listener

    # -- reads never create the database file (an operator's typo would leave one behind) ----

    def _exists(self) -> bool:
        return os.path.exists(self.path)

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        return super().status(name) if self._exists() else None

    def verify(self, name: str, holder: str) -> bool:
        return self._exists() and super().verify(name, holder)

    def _listen(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                payload = listener.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                name, holder = json.loads(payload)
            except ValueError:
                continue
            self._notify(name, holder)

    def _forked(self) -> None:
        """The parent's listening socket, sender and connections are not this process's;
        the parent unlinks its socket file, so the child only drops its copies."""
        super()._forked()
        self._listener = None
        self._closed = threading.Event()
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._local = threading.local()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            try:
                os.unlink(self._socket_path(self.client_id))
                os.rmdir(self._socket_dir)  # only when no other process listens here
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
