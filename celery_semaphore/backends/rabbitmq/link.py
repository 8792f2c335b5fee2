"""One kombu connection and the one thread that uses it, for the RabbitMQ backends.

**Connection.** py-amqp connections are not thread-safe, so every backend instance owns one
kombu connection and one I/O thread that alone touches it: it runs the callers' operations one
at a time, dispatches deliveries, sends heartbeats and fires local lease deadlines. A lost
connection loses every slot it held (the broker takes them back); the next operation reconnects.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple, TypeVar

import amqp
from amqp import exceptions as amqp_errors
from kombu import Connection

from ...exceptions import BackendUnavailable
from ...scheduler import Timers

logger = logging.getLogger(__name__)
#: What a function run by :meth:`AMQPLink.call` returns.
Result = TypeVar("Result")

#: Errors after which the connection is unusable. BackendUnavailable is an OSError too (a
#: ConnectionError) but is raised by this module for a wait that timed out, with the
#: connection fine: it is always caught before these.
CONNECTION_ERRORS = (OSError, amqp_errors.ConnectionError, amqp_errors.RecoverableConnectionError)


class AMQPLink:
    """One kombu connection and the one thread that uses it.

    :meth:`call` runs a function on that thread and returns its result; functions already on
    it run directly. ``on_connection_lost`` runs on the thread after the connection dropped.
    """

    def __init__(
        self,
        url: str,
        *,
        heartbeat: float,
        connect_timeout: float,
        on_connection_lost: Callable[[], None],
        name: str = "celery-semaphore-amqp",
    ) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.connect_timeout = connect_timeout
        self.on_connection_lost = on_connection_lost
        self.kombu: Optional[Connection] = None
        self.conn: Optional[amqp.Connection] = None
        self._commands: "queue.SimpleQueue[Tuple[Callable[..., Any], Tuple[Any, ...], Future[Any]]]"
        self._commands = queue.SimpleQueue()
        self._urgent: "queue.SimpleQueue[Tuple[Callable[..., Any], Tuple[Any, ...], Future[Any]]]"
        self._urgent = queue.SimpleQueue()
        self._timers = Timers()  # touched by the I/O thread only
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- used from any thread ------------------------------------------------------------

    def call(self, fn: Callable[..., Result], *args: Any, timeout: float = 60.0,
             urgent: bool = False) -> Result:
        """``urgent``: run before the calls that are not, that wait already (the attempt of
        a woken waiter: a slot is waiting for it)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        if self._stopped:
            raise BackendUnavailable("the AMQP backend was closed")
        future: "Future[Result]" = Future()
        (self._urgent if urgent else self._commands).put((fn, args, future))
        self._poke()
        return future.result(timeout)

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread at ``time.monotonic() >= when`` (from the I/O thread)."""
        self._timers.add(when, fn)

    def stop(self) -> None:
        if self._stopped:
            return
        try:
            self.call(self._disconnect, timeout=5)
        except Exception:
            pass
        self._stopped = True
        self._poke()
        self._thread.join(5)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed by stop(), or full: the loop is awake either way
            pass

    # -- the I/O thread ------------------------------------------------------------------

    def connection(self) -> amqp.Connection:
        """The live connection, connecting first if needed (I/O thread only)."""
        if self.conn is None:
            kombu_conn = Connection(
                self.url, heartbeat=self.heartbeat, connect_timeout=self.connect_timeout
            )
            try:
                kombu_conn.connect()
            except Exception as exc:
                raise BackendUnavailable(
                    f"cannot reach the AMQP broker at {kombu_conn.as_uri()}: {exc}"
                ) from exc
            self.kombu = kombu_conn
            self.conn = kombu_conn.connection
        return self.conn

    def _disconnect(self) -> None:
        kombu_conn, self.kombu, self.conn = self.kombu, None, None
        if kombu_conn is not None:
            try:
                kombu_conn.close()
            except Exception:
                pass

    def lost(self, exc: BaseException) -> None:
        """The connection failed: drop it and tell the owner (I/O thread only)."""
        if self.conn is None:
            return
        logger.warning("AMQP semaphore connection lost: %r", exc, exc_info=exc)
        kombu_conn, self.kombu, self.conn = self.kombu, None, None
        try:
            kombu_conn.collect()  # type: ignore[union-attr]
        except Exception:
            pass
        self.on_connection_lost()

    def _loop(self) -> None:
        last_beat = time.monotonic()
        while not self._stopped:
            conn = self.conn
            timeout = self.heartbeat / 4 if conn is not None else 1.0
            due = self._timers.next_due()
            if due is not None:
                timeout = max(0.0, min(timeout, due - time.monotonic()))
            watched = [self._wake_r]
            sock = conn.transport.sock if conn is not None and conn.transport else None
            if sock is not None:
                watched.append(sock)
                if getattr(sock, "pending", None) and sock.pending():
                    timeout = 0  # TLS bytes already decrypted: select would not show them
            try:
                readable, _, _ = select.select(watched, [], [], timeout)
            except (OSError, ValueError) as exc:  # the socket was closed under us
                self.lost(exc)
                continue
            if self._wake_r in readable:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
            self._run_timers()  # first: a lapsed lease gives up its slot before new requests
            self._run_commands()
            # Ask again: the commands' RPCs may have read what select saw, and a read
            # that finds nothing would block the thread for the read timeout.
            if sock is not None and sock in readable and self.conn is conn:
                self._drain(sock)
            if self.conn is not None and time.monotonic() - last_beat > self.heartbeat / 4:
                last_beat = time.monotonic()
                try:
                    self.conn.heartbeat_tick(rate=4)
                except CONNECTION_ERRORS as exc:
                    self.lost(exc)
        self._disconnect()
        for commands in (self._urgent, self._commands):
            while True:  # calls that raced with stop(): fail them now, not by their timeout
                try:
                    _, _, future = commands.get_nowait()
                except queue.Empty:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(BackendUnavailable("the AMQP backend was closed"))

    def _drain(self, sock: socket.socket) -> None:
        """Handle the frames that arrived, without starving the commands or the heartbeats.

        One frame per read: ``drain_events`` would read on until a whole method arrived, and
        the broker's heartbeat frames (every ``heartbeat / 2``) can keep it reading forever
        while we send nothing, until the broker drops us for missed heartbeats. The read
        timeout is generous because callbacks may run RPCs (py-amqp reopening a closed
        channel) on it."""
        for _ in range(100):
            if self.conn is None or not _readable(sock):
                return
            try:
                self.conn.blocking_read(timeout=5.0)
            except TimeoutError:
                return
            except amqp_errors.ChannelError as exc:  # a channel closed by the broker
                logger.debug("AMQP channel closed by the broker: %r", exc)
            except CONNECTION_ERRORS as exc:
                self.lost(exc)
                return

    def _run_commands(self) -> None:
        while True:
            try:  # the urgent first, looked at again after each call
                fn, args, future = self._urgent.get_nowait()
            except queue.Empty:
                try:
                    fn, args, future = self._commands.get_nowait()
                except queue.Empty:
                    return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BackendUnavailable as exc:  # a wait that timed out: the connection is fine
                future.set_exception(exc)
            except CONNECTION_ERRORS as exc:
                self.lost(exc)
                future.set_exception(BackendUnavailable(f"AMQP broker connection failed: {exc}"))
            except BaseException as exc:
                future.set_exception(exc)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while True:
            timer = self._timers.pop_due(now)
            if timer is None:
                return
            try:
                timer.run()
            except BackendUnavailable:
                logger.exception("AMQP semaphore timer failed")
            except CONNECTION_ERRORS as exc:
                self.lost(exc)
            except Exception:
                logger.exception("AMQP semaphore timer failed")

    def wait_for(self, done: Callable[[], bool], timeout: float, what: str = "") -> None:
        """Process incoming frames until ``done()`` (I/O thread only), heartbeats included."""
        started = time.monotonic()
        warned = False
        while not done():
            waited = time.monotonic() - started
            if waited >= timeout:
                raise BackendUnavailable(f"waited {timeout}s for {what or 'the AMQP broker'}")
            if waited > 5 and not warned:
                warned = True
                logger.warning("still waiting for %s after %.0fs", what or "the broker", waited)
            conn = self.connection()
            try:
                conn.blocking_read(timeout=min(timeout - waited, 1.0))  # see _drain
            except TimeoutError:
                pass
            conn.heartbeat_tick(rate=4)


def _readable(sock: socket.socket) -> bool:
    pending = getattr(sock, "pending", None)  # TLS: decrypted bytes the socket no longer shows
    if pending is not None and pending():
        return True
    return bool(select.select([sock], [], [], 0)[0])


