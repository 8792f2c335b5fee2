"""The Redis backend's operations on the worker's event loop (kombu's ``Hub``): no thread, no
blocking call, one round trip for everything asked in one turn of the loop.

The worker's gate asks for acquires, releases, renewals and cancels on its loop thread, many
at a time. Made through redis-py they would each block the loop for a round trip, or cost a
hand-over to another thread and back (a wake-up, and the GIL: on two busy cores the dearest
part of a short task's slot). Here a :class:`HubLink` keeps two non-blocking sockets of its own
registered with the hub, as kombu's Redis transport does with the broker's:

* commands: every operation asked during one turn of the loop is packed (hiredis) and written
  in one ``send`` before the hub polls again (a pipeline: ``EVALSHA`` of the backend's own
  scripts, :meth:`.RedisBackend.calls_of`); replies are parsed (hiredis) as they arrive and
  handed to each caller, in order, on the loop thread;
* wake-ups: a subscription to this process's wake channel, whose messages (with a pushed
  grant or not) go to ``on_wake`` on the loop thread.

Guarantees: an operation's callback runs exactly once, on the loop thread: with its result, or
with :class:`~celery_semaphore.exceptions.BackendUnavailable` when the connection is lost
before its reply (it may or may not have run: callers treat that as they treat a lost reply
today), when no reply came within ``socket_timeout``, or with
:class:`~celery_semaphore.exceptions.LinkClosed` when the link closes. The scripts are
loaded on each new connection before any call (a call that still meets ``NOSCRIPT``, after a
``SCRIPT FLUSH``, is sent again as ``EVAL``). A lost wake-up connection is made again with a
pause from 0.05 s doubling to 0.25 s; once subscribed again ``on_listening`` is told (what was
published meanwhile is lost). The commands connection is made again at the next call, at most
once per pause of the same length after a failure (calls meanwhile fail at once).

Only one server (``redis://``, ``redis+socket://``), without TLS, and only with hiredis
installed: :func:`link_for` returns None otherwise, and the caller runs the operations on a
thread of its own (Sentinel, Cluster, ``rediss://``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ...exceptions import BackendUnavailable, ConfigurationError, LinkClosed
from ...urls import mask_url
from ..base import LISTENER_RETRY_FIRST, LISTENER_RETRY_MAX, AcquireAll, Operation, PushedGrant
from . import deployments

try:  # an optional extra of the redis backend: without it the worker uses a thread
    import hiredis
except ImportError:  # pragma: no cover - the test environment has it
    hiredis = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: The scripts a link calls, loaded on each new connection.
SCRIPTS = ("acquire", "acquire_all", "release", "renew", "cancel", "pause", "resume", "settle")
#: Seconds between two looks for calls that got no reply in time.
CHECK_EVERY = 0.25
#: Bytes read from a socket at once.
READ_SIZE = 65536

Done = Callable[[Any, Optional[BaseException]], None]


def _pack(*parts: Any) -> bytes:
    """One command in Redis's protocol (hiredis)."""
    packed: bytes = hiredis.pack_command(parts)
    return packed


def link_for(backend: Any, hub: Any,
             on_wake: Callable[[str, str, Optional[PushedGrant]], None],
             on_listening: Callable[[], None]) -> Optional["HubLink"]:
    """A link for ``backend`` on ``hub``, or None where there can be none (module docs)."""
    if hiredis is None or hub is None or backend.kind != deployments.SERVER:
        return None
    pool = backend.client.connection_pool
    if "SSL" in pool.connection_class.__name__:
        return None
    options = dict(pool.connection_kwargs)
    return HubLink(backend, hub, options, on_wake, on_listening)


class _Pending:
    """A command written and not answered yet."""

    __slots__ = ("done", "sent", "call")

    def __init__(self, done: Callable[[Any], None], sent: float, call: Any = None) -> None:
        self.done = done  # done(reply): a reply, or an Exception
        self.sent = sent
        self.call = call  # (script, keys, argv): sent again as EVAL after a NOSCRIPT


class _Connection:
    """One non-blocking connection to the server on the hub: commands written once per turn
    of the loop, replies read as they come and handed out in order."""

    def __init__(self, link: "HubLink", role: str) -> None:
        self.link = link
        self.role = role
        self.sock: Optional[socket.socket] = None
        self.fd = -1
        #: a duplicate of ``fd`` to wait on for writing: kombu's hub keeps one registration
        #: per descriptor, and epoll ignores a second one for the reader's
        self.wfd = -1
        self.ready = False  # connected (the set-up commands are on their way ahead of others)
        self.reader: Any = None
        self.out = bytearray()
        #: asked this turn, not written yet (no _Pending: a command whose replies are pushes)
        self.queued: List[Tuple[bytes, Optional[_Pending]]] = []
        self.pending: Deque[_Pending] = deque()
        self.connect_started = 0.0
        self.down_until = 0.0  # after a failure: no new connection before
        self.backoff = LISTENER_RETRY_FIRST
        self.on_push: Optional[Callable[[Any], None]] = None  # subscription: every message

    # -- connecting --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self) -> bool:
        """Start connecting (if not yet); False while a recent failure keeps it down."""
        if self.sock is not None:
            return True
        now = time.monotonic()
        if now < self.down_until:
            return False
        options = self.link.options
        try:
            if options.get("path"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                address: Any = options["path"]
            else:
                host, port = options.get("host", "localhost"), int(options.get("port", 6379))
                info = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
                sock = socket.socket(info[0], socket.SOCK_STREAM)
                address = info[4]
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setblocking(False)
            code = sock.connect_ex(address)
        except OSError as exc:
            self.failed(exc)
            return False
        if code not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            self.failed(OSError(code, errno.errorcode.get(code, str(code))))
            return False
        self.sock, self.fd = sock, sock.fileno()
        self.reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self.connect_started = now
        self.ready = False
        self.out.clear()
        self.link.hub.add_reader(self.fd, self.readable)
        if code == 0:
            self._connected()
        else:
            self._wait_writable(self._connect_done)
        return True

    def _wait_writable(self, callback: Callable[[], None]) -> None:
        if self.wfd < 0:
            self.wfd = os.dup(self.fd)
        self.link.hub.add_writer(self.wfd, callback)

    def _stop_waiting_writable(self) -> None:
        if self.wfd >= 0:
            self.link.hub.remove_writer(self.wfd)

    def _connect_done(self) -> None:
        if self.sock is None:
            return
        code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        self._stop_waiting_writable()
        if code:
            self.failed(OSError(code, errno.errorcode.get(code, str(code))))
            return
        self._connected()

    def _connected(self) -> None:
        """Connected: the set-up commands go first (AUTH, SELECT, the scripts), then what
        waited for the connection."""
        self.ready = True
        waiting, self.queued = self.queued, []
        for command, replies in self.link.setup(self.role):
            self.queued.append((command, _Pending(self._setup_reply, 0.0) if replies else None))
        self.queued += waiting
        self.flush()

    def _setup_reply(self, reply: Any) -> None:
        if isinstance(reply, Exception):
            self.failed(reply)

    def failed(self, exc: BaseException) -> None:
        """The connection is unusable: drop it, and fail every call written or queued on it."""
        if not isinstance(exc, (BackendUnavailable, ConfigurationError)):
            exc = BackendUnavailable(f"semaphore backend {mask_url(self.link.backend.url)} "
                                     f"unavailable: {exc}")
        was = self.sock is not None
        self.close()
        self.down_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, LISTENER_RETRY_MAX)
        calls = list(self.pending) + [p for _, p in self.queued if p is not None]
        self.pending.clear()
        self.queued = []
        for pending in calls:
            pending.done(exc)
        if was:
            self.link.lost(self, exc)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self.ready = False
        if sock is None:
            return
        for fd in (self.fd, self.wfd):
            if fd >= 0:
                try:
                    self.link.hub.remove(fd)
                except Exception:
                    pass
        if self.wfd >= 0:
            try:
                os.close(self.wfd)
            except OSError:
                pass
        self.fd = self.wfd = -1
        try:
            sock.close()
        except OSError:
            pass

    # -- writing -----------------------------------------------------------------------------

    def queue(self, packed: bytes, pending: _Pending) -> None:
        self.queued.append((packed, pending))

    def flush(self) -> None:
        """Write what was asked this turn (the hub's tick, before it polls)."""
        if not self.ready or (not self.queued and not self.out):
            return
        now = time.monotonic()
        for packed, pending in self.queued:
            self.out += packed
            if pending is not None:
                pending.sent = now
                self.pending.append(pending)
        self.queued = []
        self._send()

    def _send(self) -> None:
        try:
            sent = self.sock.send(self.out) if self.sock is not None else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.failed(exc)
            return
        del self.out[:sent]
        if self.out:
            self._wait_writable(self._writable)

    def _writable(self) -> None:
        if self.sock is None:
            return
        self._stop_waiting_writable()
        if self.out:
            self._send()

    # -- reading -----------------------------------------------------------------------------

    def readable(self) -> None:
        if self.sock is None:
            return
        if not self.ready:  # (a connect that failed shows as readable too)
            self._connect_done()
            if self.sock is None:
                return
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.failed(exc)
            return
        if not data:
            self.failed(ConnectionError("connection closed by the server"))
            return
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.failed(exc)
                return
            if reply is False:
                break
            if self.on_push is not None and not self.pending:
                self.on_push(reply)
                continue
            if not self.pending:  # a reply nobody asked for: the stream is out of step
                self.failed(ConnectionError(f"unexpected reply {reply!r:.80}"))
                return
            pending = self.pending.popleft()
            self.backoff = LISTENER_RETRY_FIRST
            if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT") \
                    and pending.call is not None:
                self.link.send_eval(self, pending)
                continue
            pending.done(reply)
            if self.sock is None:  # a callback failed the connection
                return

    def overdue(self, now: float, timeout: float, connect_timeout: float) -> bool:
        if self.sock is not None and not self.ready:
            return now - self.connect_started > connect_timeout
        return bool(self.pending) and now - self.pending[0].sent > timeout


class HubLink:
    """A :class:`.RedisBackend`'s operations on a kombu ``Hub`` (module docs). Every method
    runs on the hub's thread."""

    def __init__(self, backend: Any, hub: Any, options: Dict[str, Any],
                 on_wake: Callable[[str, str, Optional[PushedGrant]], None],
                 on_listening: Callable[[], None]) -> None:
        self.backend = backend
        self.hub = hub
        self.options = options
        self.on_wake = on_wake
        self.on_listening = on_listening
        self.sources = backend.scripts()
        self.timeout = float(options.get("socket_timeout") or 5.0)
        self.connect_timeout = float(options.get("socket_connect_timeout") or self.timeout)
        self.commands = _Connection(self, "commands")
        self.wakeups = _Connection(self, "wakeups")
        self.wakeups.on_push = self._message
        self.channel = backend._channel_prefix + backend.client_id
        self._listening = False
        self._lost_wakeups = False
        self._timer: Any = None
        self._retry: Any = None
        self._started = False

    def __repr__(self) -> str:
        return f"<HubLink {mask_url(self.backend.url)}>"

    @property
    def running(self) -> bool:
        """Started, and neither closed nor reset with its hub since: calls go out."""
        return self._started

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Connect (again) on the hub, both connections at once: the commands connection
        loads the scripts as it connects, so the first acquire does not wait for them (nor
        does a benchmark count them against its tasks). After the hub was reset (a broker
        reconnect) the old sockets are gone from it: they are dropped and made anew."""
        self.close(reason="the link restarts")
        self._started = True
        self.hub.on_tick.add(self.flush)
        on_close = getattr(self.hub, "on_close", None)
        if on_close is not None:
            on_close.add(self._hub_closed)
        self._timer = self.hub.call_repeatedly(CHECK_EVERY, self._check)
        self._subscribe()
        self.commands.connect()  # (a failure: the next call tries again, after its pause)

    def close(self, reason: str = "the link closed") -> None:
        on_close = getattr(self.hub, "on_close", None)
        if on_close is not None:
            on_close.discard(self._hub_closed)
        self._shut(reason)

    def _shut(self, reason: str) -> None:
        self._started = False
        self.hub.on_tick.discard(self.flush)
        for timer in (self._timer, self._retry):
            if timer is not None:
                timer.cancel()
        self._timer = self._retry = None
        for connection in (self.commands, self.wakeups):
            if connection.connected:
                connection.failed(LinkClosed(
                    f"semaphore backend {mask_url(self.backend.url)}: {reason}"))
            connection.down_until = 0.0
            connection.backoff = LISTENER_RETRY_FIRST
        self._listening = False

    def _hub_closed(self, hub: Any) -> None:
        """The hub forgot every socket (kombu resets it on a lost broker connection). This
        callback stays in the hub's ``on_close`` until the link closes or starts again: kombu
        before 5.4 calls it while iterating that set, and a set changed meanwhile raised
        there, which cut the hub's close short (the callbacks after this one and the work it
        still had to do were skipped)."""
        self._shut("the event loop was reset")

    # -- operations --------------------------------------------------------------------------

    def submit(self, op: Operation, done: Done) -> None:
        """Queue ``op``; ``done(result, None)`` or ``done(None, exc)`` later, on the loop."""
        if isinstance(op, AcquireAll) and not self.backend.atomic_acquire_all:
            done(None, ConfigurationError("acquire_all is not one script here"))
            return
        calls, parse = self.backend.calls_of(op)
        connection = self.commands
        if not self._started or not connection.connect():
            done(None, BackendUnavailable(
                f"semaphore backend {mask_url(self.backend.url)} unavailable (reconnecting)"))
            return
        replies: List[Any] = []
        count = len(calls)

        def one(reply: Any) -> None:
            replies.append(reply)
            if len(replies) < count:
                return
            error = next((r for r in replies if isinstance(r, Exception)), None)
            if error is not None:  # a reply error, or the connection's failure (as it is)
                done(None, error if isinstance(error, (BackendUnavailable, ConfigurationError))
                     else self._error(error))
                return
            try:
                result = parse(replies)
            except Exception as exc:
                done(None, exc)
                return
            done(result, None)

        for call in calls:
            script, keys, argv = call
            packed = _pack("EVALSHA", self.sources[script][1], len(keys),
                                           *keys, *argv)
            connection.queue(packed, _Pending(one, 0.0, call))

    def send_eval(self, connection: _Connection, pending: _Pending) -> None:
        """A call met NOSCRIPT (the server's scripts were flushed): send it as EVAL."""
        script, keys, argv = pending.call
        pending.call = None
        connection.queue(_pack("EVAL", self.sources[script][0], len(keys),
                                               *keys, *argv), pending)

    def flush(self) -> None:
        """Once per turn of the hub, before it polls: write every call asked since."""
        self.commands.flush()
        self.wakeups.flush()

    def setup(self, role: str) -> List[Tuple[bytes, bool]]:
        """The first commands of a new connection, each with whether it has a reply of its
        own (SUBSCRIBE's come as messages)."""
        options, out = self.options, []
        password = options.get("password")
        if password:
            username = options.get("username")
            out.append((_pack("AUTH", username, password) if username
                        else _pack("AUTH", password), True))
        if role == "commands":
            if options.get("db"):
                out.append((_pack("SELECT", int(options["db"])), True))
            out += [(_pack("SCRIPT", "LOAD", self.sources[name][0]), True)
                    for name in SCRIPTS]
        else:
            out.append((_pack("SUBSCRIBE", self.channel), False))
        return out

    def _error(self, reply: Exception) -> Exception:
        """What a reply error means, as :meth:`.RedisBackend._unavailable` says it for
        redis-py's exceptions."""
        text = str(reply)
        url = mask_url(self.backend.url)
        if text.startswith("COST "):
            cost, limit = text.split()[1:3]
            return ConfigurationError(f"cost {cost} is above the semaphore's limit ({limit}): "
                                      "it could never be admitted")
        word = text.split(" ", 1)[0]
        if word in ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "CROSSSLOT"):
            return ConfigurationError(f"semaphore backend {url} is a Redis Cluster node "
                                      f"({text}); use a redis+cluster:// URL")
        if word in ("READONLY", "MASTERDOWN", "OOM", "BUSY", "NOPERM", "LOADING", "NOAUTH",
                    "WRONGPASS"):
            return BackendUnavailable(f"semaphore backend {url} unavailable: {text}")
        return BackendUnavailable(f"semaphore backend {url}: {text}")

    # -- wake-ups ----------------------------------------------------------------------------

    def _subscribe(self) -> None:
        self._retry = None
        if not self._started:
            return
        if not self.wakeups.connect():
            self._retry = self.hub.call_later(max(self.wakeups.down_until - time.monotonic(),
                                                  0.0), self._subscribe)

    def _message(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            if isinstance(reply, Exception):
                self.wakeups.failed(reply)
            return
        kind = reply[0]
        if kind == "subscribe":
            self.wakeups.backoff = LISTENER_RETRY_FIRST
            was_lost, self._lost_wakeups = self._lost_wakeups, False
            self._listening = True
            if was_lost:
                logger.info("celery-semaphore: wake-up channel restored")
                self.on_listening()
            return
        if kind != "message":
            return
        try:
            name, holder, pushed = self.backend.pushed_grant(reply[2])
            self.on_wake(name, holder, pushed)
        except Exception:  # one bad message, or a callback's bug, must not stop the others
            logger.exception("celery-semaphore: wake-up %r failed", reply[2])

    def lost(self, connection: _Connection, exc: BaseException) -> None:
        """``connection`` failed (its calls have been told)."""
        if connection is self.wakeups:
            if self._listening and self._started:
                logger.warning("celery-semaphore: wake-up channel of %s lost (%s); "
                               "resubscribing, waiters poll meanwhile",
                               mask_url(self.backend.url), exc)
            self._listening = False
            self._lost_wakeups = True
            if self._started and self._retry is None:
                self._retry = self.hub.call_later(connection.backoff, self._subscribe)
        elif self._started and not self.wakeups.connected and self._retry is None:
            self._subscribe()  # the server answers again, perhaps: try the channel now

    def _check(self) -> None:
        """Calls that got no reply in time fail, with their connection."""
        now = time.monotonic()
        for connection in (self.commands, self.wakeups):
            if connection.overdue(now, self.timeout, self.connect_timeout):
                connection.failed(TimeoutError(f"no reply in {self.timeout:g}s"))
