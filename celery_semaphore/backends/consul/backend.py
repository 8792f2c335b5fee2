"""``consul://host:8500`` / ``consuls://host:8501`` (TLS): semaphores in Consul's KV store.

The algorithm is Consul's semaphore guide (and ``api/semaphore.go``), extended to the full
contract of :mod:`.base`. A semaphore ``name`` lives under the KV prefix
``<key_prefix>/<name>/`` (``key_prefix`` ``"semaphore:"`` gives ``semaphore/<name>/``):

* ``<prefix>.lock`` holds ``{"Limit", "Holders", "Sessions", "State", "Epochs", "Touched"}``:
  the guide's ``Limit`` and ``Holders`` (holder session ids), the holder id -> session map and
  the rules' whole state (:class:`.model.State`: FIFO waiters with tickets and expiry, holders
  with slot, epoch and metadata, per-slot epochs, declared limits). It is only ever changed by
  check-and-set on its ``ModifyIndex``: every operation reads the prefix (one consistent
  recursive read), applies the rules, and writes back with ``?cas=``, retrying with jitter when
  another client won the race. Reads that change nothing (``status``, ``verify``, a no-op
  ``cancel``) write nothing.
* Each holder has a Consul session (``TTL`` = the lease ttl rounded up and clamped to Consul's
  10 s .. 24 h, behavior ``delete``, lock-delay 0) and a contender key ``<prefix><session>``
  acquired with it *before* the holder is added to ``.lock``. Every operation prunes holders
  whose session no longer holds a contender key, so a session Consul invalidates (TTL,
  failed node check, ``consul session destroy``) drops its holder on the next operation.
  ``renew`` renews the session and fails (None) when Consul no longer knows it. Whenever a
  holder leaves ``.lock`` (expiry, pruning, reset, another process's release) its session is
  destroyed after the CAS, which deletes its contender key; an acquire that raises destroys
  the sessions it made. A process's own release keeps the session (and its key) as a *spare*
  for that process's next holder or waiter on the name; a spare nobody takes is destroyed
  ``spare_keep`` to 1.5 x ``spare_keep`` seconds later (1 s by default), and at
  :meth:`close`. A worker that runs guarded tasks back to back thus makes no session per task,
  which spares Consul three Raft writes (session create, key acquire, session destroy) per
  admission. No two holders ever share a session.
* Waiters have no session in ``.lock``: their queue entry expires after ``waiter_ttl`` unless
  they retry, as in the other backends. A waiter within one round of holders from admission
  (or with a spare at hand) gets its session while it waits, so that its admission is one
  read and one check-and-set; each retry of the waiter (every ``waiter_ttl / 3`` at most)
  renews that session once it is past half its TTL.
* Wake-ups: while a process has queued waiters on a name, one daemon thread per name runs
  blocking queries (``?index=&wait=``, consistent) on the prefix and calls a waiter's callback
  when the rules would admit it; a process also wakes its own waiters directly after its own
  operations. Every change under the prefix answers every blocking query, so a watcher whose
  first waiter is ``g >= limit`` places from admission pauses ``~wake_pause * g / limit``
  seconds (with jitter, at most 1 s) before asking again: processes within one round of
  holders from the head hear of a free slot at once, the rest of the herd stays quiet.
* HTTP: py-consul's API objects over a lean ``http.client`` transport, one keep-alive
  connection per thread.

Time. Consul exposes no clock, so lease and waiter expiries in ``.lock`` use the clock of the
client doing each operation (keep hosts NTP-synchronized: skew shortens or stretches leases by
as much). Consul's own guarantee is the session: a holder that stops renewing loses its session
once the session TTL (``max(10 s, ttl)``) has passed (Consul documents the TTL as a lower
bound and typically invalidates within twice it), whatever the clocks say, and is then
pruned. Fencing epochs are kept in ``.lock`` (also across ``reset`` and idle expiry, which keep
an epochs-only ``.lock``), so they strictly increase per slot without relying on clocks; they
also have :func:`.model.next_epoch`'s time floor. Deleting the prefix by hand forgets them.

Guarantees under partition: writes go through the Consul servers' Raft log and reads are
``consistent``, so at most ``limit`` holders are admitted *while each lease is valid*. A holder
cut off from Consul cannot renew: its lease is reported lost at its local deadline and Consul
frees the slot after the session TTL (or its ``.lock`` expiry, whichever another client notices
first). Like every backend here, nothing stops a partitioned holder from running on: use the
fencing token. Idle semaphores are hidden after ``idle_ttl`` but their ``.lock`` key stays.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import random
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union
from urllib.parse import parse_qsl, urlsplit

import consul
import consul.base
import requests
from consul.std import parse_duration

from ...exceptions import BackendUnavailable, ConfigurationError
from ...urls import mask_url
from ..base import Attempt, Meta, SemaphoreStatus
from ..model import Box, ModelBackend, State, as_json, wakeups

logger = logging.getLogger(__name__)

LOCK_KEY = ".lock"
#: Consul refuses session TTLs outside this range (seconds).
MIN_SESSION_TTL, MAX_SESSION_TTL = 10, 86400
#: CAS attempts before an operation gives up (each retry waits a little longer, with jitter).
MAX_ATTEMPTS = 200
#: Spare sessions (see ConsulBackend._give_spare) kept per semaphore name and process.
MAX_SPARES = 8
#: Keep-alive connections to Consul kept open while unused, per backend instance and process.
MAX_IDLE_CONNECTIONS = 4
#: Consul refuses KV values above 512 KiB (its default ``kv_max_value_size``).
MAX_VALUE_SIZE = 512 * 1024
_UNAVAILABLE = (consul.ConsulException, requests.RequestException, OSError,
                http.client.HTTPException)


def session_ttl(ttl: float) -> int:
    """The session TTL (whole seconds) for a lease of ``ttl`` seconds, as Consul accepts it."""
    return min(MAX_SESSION_TTL, max(MIN_SESSION_TTL, math.ceil(ttl)))


def kv_root(key_prefix: str) -> str:
    """The KV folder of all semaphores: ``"semaphore:"`` -> ``"semaphore/"``."""
    root = key_prefix.rstrip(":/")
    return f"{root}/" if root else ""


class _HTTPClient(consul.base.HTTPClient):
    """py-consul's transport over keep-alive ``http.client`` connections, shared by threads:
    each request takes an idle connection (or opens one) and puts it back, at most
    ``MAX_IDLE_CONNECTIONS`` stay open idle. A third of the CPU time of py-consul's
    ``requests`` transport per request, which matters because every operation is a few
    requests."""

    def __init__(self, host: str, port: int, scheme: str, verify: Union[bool, str],
                 timeout: float) -> None:
        super().__init__(host, port, scheme, verify)
        self.timeout = timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    def _connection(self) -> http.client.HTTPConnection:
        with self._idle_lock:
            if self._idle:
                return self._idle.pop()
        if self.scheme == "https":
            context = ssl.create_default_context(
                cafile=self.verify if isinstance(self.verify, str) else None)
            if self.verify is False:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            return http.client.HTTPSConnection(self.host, self.port, context=context)
        return http.client.HTTPConnection(self.host, self.port)

    def _put_back(self, conn: http.client.HTTPConnection) -> None:
        with self._idle_lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _request(self, method: str, callback: Any, path: str, params: Any = None,
                 data: Union[str, bytes] = "", headers: Optional[Dict[str, str]] = None) -> Any:
        query = dict(params or ())
        timeout = self.timeout
        if "index" in query:  # a blocking query answers after its wait, plus up to wait/16
            wait = parse_duration(query["wait"]) if "wait" in query else 300.0
            timeout += wait * 17 / 16
        body = data.encode() if isinstance(data, str) else data
        for attempt in (1, 2):  # a kept-alive connection the server closed: reconnect once
            conn = self._connection()
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, self.uri(path, params), body=body or None,
                             headers=headers or {})
                response = conn.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt == 2 or method != "GET":
                    raise
                continue
            self._put_back(conn)
            break
        return callback(consul.base.Response(response.status, response.headers,
                                             payload.decode("utf-8")))

    def get(self, callback: Any, path: str, params: Any = None,
            headers: Optional[Dict[str, str]] = None, raw: bool = False) -> Any:
        return self._request("GET", callback, path, params, headers=headers)

    def put(self, callback: Any, path: str, params: Any = None, data: Union[str, bytes] = "",
            headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("PUT", callback, path, params, data, headers)

    def delete(self, callback: Any, path: str, params: Any = None,
               data: Union[str, bytes] = "", headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("DELETE", callback, path, params, data, headers)

    def post(self, callback: Any, path: str, params: Any = None, data: str = "",
             headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("POST", callback, path, params, data, headers)

    def close(self) -> None:
        """Close the idle connections; those in use close as their requests end."""
        with self._idle_lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.close()


class _Consul(consul.Consul):
    """py-consul's client with the lean transport above."""

    def __init__(self, *args: Any, timeout: float, **kwargs: Any) -> None:
        self._timeout = timeout
        super().__init__(*args, **kwargs)

    def http_connect(self, host: str, port: int, scheme: str, verify: Union[bool, str] = True,
                     cert: Any = None) -> _HTTPClient:
        return _HTTPClient(host, port, scheme, verify, self._timeout)


@dataclass(frozen=True)
class ConsulConfig:
    """Where and how to reach Consul, parsed from the URL and keyword options."""

    host: str
    port: int
    scheme: str
    token: Optional[str]
    dc: Optional[str]
    verify: Union[bool, str]
    timeout: float

    @classmethod
    def parse(cls, url: str, *, token: Optional[str] = None, dc: Optional[str] = None,
              verify: Union[bool, str, None] = None, timeout: Optional[float] = None,
              ) -> "ConsulConfig":
        """``consul[s]://host[:port][?token=&dc=&verify=&timeout=]``; keywords win over the
        query. ``verify`` (TLS only): ``true`` (default), ``false`` or a CA bundle path."""
        parts = urlsplit(url)
        if parts.scheme not in ("consul", "consuls"):
            raise ConfigurationError(f"not a consul:// or consuls:// URL: {parts.scheme}://")
        query = dict(parse_qsl(parts.query))
        unknown = set(query) - {"token", "dc", "verify", "timeout"}
        if unknown:
            raise ConfigurationError(f"unknown consul URL parameters: {', '.join(sorted(unknown))}")
        tls = parts.scheme == "consuls"
        if verify is None:
            raw = query.get("verify", "true")
            verify = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower(), raw)
        try:
            port = parts.port or (8501 if tls else 8500)
            timeout = float(timeout if timeout is not None else query.get("timeout", 10.0))
        except ValueError as exc:
            raise ConfigurationError(f"bad consul URL {mask_url(url)!r}: {exc}") from exc
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=port,
            scheme="https" if tls else "http",
            token=token if token is not None else query.get("token") or None,
            dc=dc if dc is not None else query.get("dc") or None,
            verify=verify,
            timeout=timeout,
        )

    def client(self) -> consul.Consul:
        client = _Consul(host=self.host, port=self.port, scheme=self.scheme, token=self.token,
                         dc=self.dc, verify=self.verify, timeout=self.timeout)
        if self.token is not None:
            client.token = self.token  # py-consul lets CONSUL_HTTP_TOKEN override an explicit one
        return client


class _Box(Box):
    """A semaphore's state inside one CAS attempt, with what ``.lock`` keeps beside it."""

    def __init__(self, state: Optional[State], now: float, epochs: Dict[int, int],
                 sessions: Dict[str, str], live: Set[str]) -> None:
        super().__init__(state, now)
        self.epochs = epochs
        self.sessions = sessions  # holder -> its session
        self.live = live  # sessions that held a key under the prefix when it was read
        #: Sessions this operation gives back to this process (a release, a cancel): they
        #: become spares instead of being destroyed.
        self.spare: Set[str] = set()

    def new_state(self, limit: int) -> State:
        return State(limit=limit, epochs=dict(self.epochs))


@dataclass
class _Snapshot:
    """One consistent read of a semaphore's prefix."""

    index: int
    lock_index: int  # ModifyIndex of .lock, 0 when absent (cas=0: create only)
    raw: Dict[str, Any]
    state: Optional[State]
    epochs: Dict[int, int]
    sessions: Dict[str, str]
    live: Set[str] = field(default_factory=set)

    def box(self, now: float, idle_ttl: float) -> Tuple[_Box, Set[Tuple[str, str]]]:
        """A private copy, pruned: expired entries and holders whose session is gone."""
        state = State.from_dict(self.raw["State"]) if self.state is not None else None
        box = _Box(state, now, dict(self.epochs), dict(self.sessions), set(self.live))
        before: Set[Tuple[str, str]] = set()
        if state is not None:
            before = state.admissible()
            state.prune(now, idle_ttl)
            for holder in list(state.holders):
                if box.sessions.get(holder) not in self.live:
                    del state.holders[holder]
        return box, before


def _coalesce(old: Optional[State], new: Optional[State], now: float, waiter_ttl: float,
              idle_ttl: float) -> None:
    """Keep ``old``'s timestamps in ``new`` where they are still fresh, so that a waiter's
    retry or a repeated declared limit writes ``.lock`` only every half ``waiter_ttl`` (resp.
    ``idle_ttl``) instead of on every call: each write wakes every watcher of the prefix."""
    if old is None or new is None:
        return
    for holder, waiter in new.waiters.items():
        before = old.waiters.get(holder)
        if before is not None and before.ticket == waiter.ticket and (
            before.expires > now + waiter_ttl / 2
        ):
            waiter.expires = before.expires
    for limit, seen in old.declared.items():
        if limit in new.declared and seen > now - idle_ttl / 2:
            new.declared[limit] = seen


def _encode(box: _Box) -> Dict[str, Any]:
    state = box.state
    box.sessions = {h: s for h, s in box.sessions.items() if state and h in state.holders}
    return {
        "Limit": state.limit if state is not None else 0,
        "Holders": sorted(box.sessions.values()),
        "Sessions": box.sessions,
        "State": json.loads(state.dumps()) if state is not None else None,
        "Epochs": {str(k): v for k, v in (state.epochs if state else box.epochs).items()},
    }


class ConsulBackend(ModelBackend):
    """Semaphores in Consul KV with sessions, per the Consul semaphore guide (module docs)."""

    def __init__(
        self,
        url: str = "consul://127.0.0.1:8500",
        *,
        token: Optional[str] = None,
        dc: Optional[str] = None,
        verify: Union[bool, str, None] = None,
        timeout: Optional[float] = None,
        watch_wait: float = 10.0,
        wake_pause: float = 0.05,
        spare_keep: float = 1.0,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        self.config = ConsulConfig.parse(url, token=token, dc=dc, verify=verify, timeout=timeout)
        self.root = kv_root(self.key_prefix)
        self.watch_wait = watch_wait
        self.wake_pause = wake_pause
        self._client: Optional[consul.Consul] = None
        self._closed = threading.Event()
        self._watch_threads: Dict[str, threading.Thread] = {}
        self.spare_keep = spare_keep
        self._new_session_pools()

    def _new_session_pools(self) -> None:
        self._sessions_lock = threading.Lock()
        #: Every session this process made and may still use: session -> (TTL, renewed at).
        self._owned: Dict[str, Tuple[int, float]] = {}
        #: Sessions made in advance for our queued waiters: (name, holder) -> session.
        self._ready: Dict[Tuple[str, str], str] = {}
        #: Sessions our releases gave back, for our next waiters: name -> [(session, since)].
        self._spares: Dict[str, List[Tuple[str, float]]] = {}
        self._sweeper: Optional[threading.Timer] = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {mask_url(self.url)}>"

    # -- Consul access -----------------------------------------------------------------------

    @property
    def client(self) -> consul.Consul:
        """This process's client; its transport pools connections across threads."""
        client = self._client
        if client is None:
            with self._watch_lock:
                if self._client is None:
                    self._client = self.config.client()
                client = self._client
        return client

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise BackendUnavailable(
                f"consul semaphore backend {mask_url(self.url)} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def prefix(self, name: str) -> str:
        return f"{self.root}{name}/"

    def _snapshot(self, name: str, index: int = 0, wait: Optional[str] = None) -> _Snapshot:
        prefix = self.prefix(name)
        new_index, pairs = self._call(
            self.client.kv.get, prefix, recurse=True, consistency="consistent",
            index=index or None, wait=wait,
        )
        return self._decode(int(new_index or 0), prefix, pairs or [], time.time())

    def _decode(self, index: int, prefix: str, pairs: List[Dict[str, Any]],
                now: float) -> _Snapshot:
        lock = next((p for p in pairs if p["Key"] == prefix + LOCK_KEY), None)
        live = {p["Session"] for p in pairs if p.get("Session") and p["Key"] != prefix + LOCK_KEY}
        if lock is None or not lock.get("Value"):
            return _Snapshot(index, lock["ModifyIndex"] if lock else 0, {}, None, {}, {}, live)
        raw = json.loads(lock["Value"])
        epochs = {int(k): v for k, v in raw.get("Epochs", {}).items()}
        state = None
        if raw.get("State") is not None and raw.get("Touched", 0) + self.idle_ttl > now:
            state = State.from_dict(raw["State"])
        sessions = dict(raw.get("Sessions", {})) if state is not None else {}
        return _Snapshot(index, lock["ModifyIndex"], raw, state, epochs, sessions, live)

    def _destroy(self, session: str) -> None:
        """Destroy a session: Consul deletes its contender key (behavior delete)."""
        with self._sessions_lock:
            self._owned.pop(session, None)
        try:
            self._call(self.client.session.destroy, session)
        except BackendUnavailable as exc:  # its TTL will end it
            logger.warning("could not destroy consul session %s: %s", session, exc)

    def _new_contender(self, name: str, ttl: int) -> str:
        """A session (TTL ``ttl`` seconds) and its contender key ``<prefix><session>``."""
        session = self._call(
            self.client.session.create, name=f"celery-semaphore {name}", behavior="delete",
            ttl=ttl, lock_delay=0,
        )
        now = time.monotonic()
        with self._sessions_lock:
            # Forget sessions nobody renewed for twice their TTL: Consul has invalidated them
            # (a lease of ours that another process pruned and destroyed leaves one behind).
            self._owned = {s: v for s, v in self._owned.items() if now - v[1] <= 2 * v[0]}
            self._owned[session] = (ttl, now)
        body = json.dumps({"client": self.client_id})
        try:
            made = self._call(self.client.kv.put, self.prefix(name) + session, body,
                              acquire=session)
        except BaseException:
            self._destroy(session)
            raise
        if not made:
            self._destroy(session)
            raise BackendUnavailable(
                f"consul refused the contender key of semaphore {name!r} (session invalidated?)"
            )
        return session

    # -- sessions this process made: kept for its waiters, reused after a release ------------

    def _renew_session(self, session: str) -> bool:
        """Renew one of our sessions; False when Consul no longer knows it."""
        try:
            self._call(self.client.session.renew, session)
        except BackendUnavailable as exc:
            if not isinstance(exc.__cause__, consul.NotFound):
                raise
            with self._sessions_lock:
                self._owned.pop(session, None)
            return False
        with self._sessions_lock:
            if session in self._owned:
                self._owned[session] = (self._owned[session][0], time.monotonic())
        return True

    def _usable(self, session: str, ttl: int) -> bool:
        """Ours, with TTL ``ttl``, and renewed less than half its TTL ago (renewing it if
        not): good enough to become a holder's session, which its lease keeps renewing."""
        with self._sessions_lock:
            owned = self._owned.get(session)
        if owned is None or owned[0] != ttl:
            return False
        return time.monotonic() - owned[1] < ttl / 2 or self._renew_session(session)

    def _take_spare(self, name: str, ttl: int, live: Optional[Set[str]]) -> Optional[str]:
        """A session that a release of ours on ``name`` gave back, if still good (and in
        ``live``, the sessions holding keys in the caller's read, when given)."""
        with self._sessions_lock:
            spares = self._spares.get(name, [])
            picked = [s for s, _ in spares if self._owned.get(s, (0,))[0] == ttl]
            if not picked:
                return None
            session = picked[-1]
            spares[:] = [(s, at) for s, at in spares if s != session]
        if (live is None or session in live) and self._usable_or_destroyed(session, ttl):
            return session
        self._destroy(session)
        return self._take_spare(name, ttl, live)

    def _usable_or_destroyed(self, session: str, ttl: int) -> bool:
        """:meth:`_usable`, destroying the session if Consul cannot be asked (it would be
        nobody's, yet live for up to twice its TTL)."""
        try:
            return self._usable(session, ttl)
        except BaseException:
            self._destroy(session)
            raise

    def _give_spare(self, name: str, session: str) -> None:
        """Keep a session no holder uses any more for this process's next waiter on ``name``;
        it is destroyed ``spare_keep`` to 1.5 x ``spare_keep`` seconds later if unused, or at
        :meth:`close`."""
        with self._sessions_lock:
            if session not in self._owned or self._closed.is_set():
                extra = [session]
            else:
                spares = self._spares.setdefault(name, [])
                spares.append((session, time.monotonic()))
                extra = [s for s, _ in spares[:-MAX_SPARES]]
                del spares[:-MAX_SPARES]
                if self._sweeper is None:
                    self._sweeper = threading.Timer(self.spare_keep, self._sweep_spares)
                    self._sweeper.daemon = True
                    self._sweeper.start()
        for old in extra:
            self._destroy(old)

    def _sweep_spares(self) -> None:  # a Timer thread of its own
        cutoff = time.monotonic() - self.spare_keep
        with self._sessions_lock:
            self._sweeper = None
            stale = [s for spares in self._spares.values() for s, at in spares if at <= cutoff]
            for name in list(self._spares):
                self._spares[name] = [(s, at) for s, at in self._spares[name] if at > cutoff]
                if not self._spares[name]:
                    del self._spares[name]
            if self._spares and not self._closed.is_set():
                self._sweeper = threading.Timer(self.spare_keep / 2, self._sweep_spares)
                self._sweeper.daemon = True
                self._sweeper.start()
        for session in stale:
            self._destroy(session)

    # -- the rules in a CAS loop on .lock ----------------------------------------------------

    def _run(self, name: str, op: Callable[[Box], Any], write: bool = True) -> Any:
        for attempt in range(MAX_ATTEMPTS):
            snap = self._snapshot(name)
            now = time.time()
            box, before = snap.box(now, self.idle_ttl)
            result = op(box)
            if not write:
                return result
            _coalesce(snap.state, box.state, now, self.waiter_ttl, self.idle_ttl)
            doc = _encode(box)
            unchanged = doc == {k: v for k, v in snap.raw.items() if k != "Touched"} or (
                box.state is None and snap.lock_index == 0  # nothing to keep, nothing kept
            )
            value = json.dumps({**doc, "Touched": now})
            if not unchanged and len(value.encode()) > MAX_VALUE_SIZE:
                raise BackendUnavailable(
                    f"consul semaphore {name!r}: .lock would exceed Consul's 512 KiB value limit "
                    f"({len(box.state.waiters) if box.state else 0} waiters): lower "
                    f"semaphore_worker_max_waiting or the number of waiting callers"
                )
            if unchanged or self._call(self.client.kv.put, self.prefix(name) + LOCK_KEY, value,
                                       cas=snap.lock_index):
                break
            # Lost the race: retry at once, then back off with jitter to spread contenders.
            if attempt:
                time.sleep(random.uniform(0, min(0.1, 0.001 * 2 ** attempt)))
        else:
            raise BackendUnavailable(
                f"consul semaphore {name!r}: {MAX_ATTEMPTS} check-and-set attempts lost"
            )
        in_use = set(box.sessions.values())
        for session in set(snap.sessions.values()) - in_use - box.spare:
            self._destroy(session)  # its holder left: Consul deletes its contender key
        for session in box.spare - in_use:
            self._give_spare(name, session)
        for client, holder in wakeups(before, box.state):
            self._send_wakeup(client, name, holder)
        return result

    def _stored_names(self) -> List[str]:
        _, pairs = self._call(self.client.kv.get, self.root, recurse=True,
                              consistency="consistent")
        now, names = time.time(), []
        for pair in pairs or []:
            rest = pair["Key"][len(self.root):]
            name, _, key = rest.partition("/")
            if key == LOCK_KEY and self._decode(0, self.prefix(name), [pair], now).state:
                names.append(name)
        return names

    # -- operations that differ from the model's ---------------------------------------------

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        meta = as_json(meta)
        ttl_s = session_ttl(ttl)
        with self._sessions_lock:
            ready = self._ready.pop((name, holder), None)
        # The session this call gives the holder; kept across check-and-set retries.
        mine: List[str] = []
        if ready is not None:
            if self._usable_or_destroyed(ready, ttl_s):
                mine.append(ready)
            else:
                self._destroy(ready)

        holds_with: List[Optional[str]] = [None]  # the holder's session after the last try

        def op(box: Box) -> Attempt:
            assert isinstance(box, _Box)
            if box.state is None:
                box.state = box.new_state(limit)
            held = holder in box.state.holders
            attempt = box.state.acquire(
                holder, declared=limit, ttl=ttl, meta=meta, wait=wait,
                client=self.client_id, now=box.now, waiter_ttl=self.waiter_ttl,
            )
            if attempt.grant is not None and not held:
                if mine and mine[0] not in box.live:  # Consul invalidated it meanwhile
                    self._destroy(mine.pop())
                if not mine:
                    mine[:] = [self._take_spare(name, ttl_s, box.live)
                               or self._new_contender(name, ttl_s)]
                box.sessions[holder] = mine[0]
            holds_with[0] = box.sessions.get(holder) if attempt.grant is not None else None
            return attempt

        try:
            attempt = self._run(name, op)
        except BaseException:
            for session in mine:
                self._destroy(session)
            raise
        if attempt.grant is None and attempt.position is not None:
            # Queued. Within one round of holders from admission (or with a spare at hand),
            # get the session now, so that the admission is one read and one check-and-set.
            if not mine and (attempt.position < attempt.limit or self._spares.get(name)):
                mine.append(self._take_spare(name, ttl_s, None)
                            or self._new_contender(name, ttl_s))
            if mine:
                with self._sessions_lock:
                    self._ready[(name, holder)] = mine[0]
            self._ensure_watcher(name)
        elif mine and holds_with[0] != mine[0]:
            # Admitted on a try that lost its check-and-set, then not; or it already held.
            self._give_spare(name, mine[0])
        return attempt

    def release(self, name: str, holder: str) -> bool:
        def op(box: Box) -> bool:
            assert isinstance(box, _Box)
            if box.state is None or not box.state.release(holder):
                return False
            box.spare.add(box.sessions[holder])  # for our next waiter on this name
            return True

        return self._run(name, op)

    def cancel(self, name: str, holder: str) -> None:
        with self._sessions_lock:
            ready = self._ready.pop((name, holder), None)
        if ready is not None:
            self._give_spare(name, ready)
        super().cancel(name, holder)

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        def op(box: Box) -> Optional[float]:
            assert isinstance(box, _Box)
            if box.state is None or holder not in box.state.holders:
                return None
            try:
                self._call(self.client.session.renew, box.sessions[holder])
            except BackendUnavailable as exc:
                if not isinstance(exc.__cause__, consul.NotFound):
                    raise
                box.state.release(holder)  # Consul invalidated the session: the lease is lost
                with self._sessions_lock:
                    self._owned.pop(box.sessions[holder], None)
                return None
            with self._sessions_lock:
                owned = self._owned.get(box.sessions[holder])
                if owned is not None:
                    self._owned[box.sessions[holder]] = (owned[0], time.monotonic())
            return box.state.renew(holder, ttl, box.now)

        return self._run(name, op)

    def verify(self, name: str, holder: str) -> bool:
        return self._run(
            name, lambda box: box.state is not None and holder in box.state.holders, write=False
        )

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        return self._run(
            name, lambda box: box.state.status(name) if box.state else None, write=False
        )

    def resize(self, name: str, limit: int) -> bool:
        def op(box: Box) -> bool:
            assert isinstance(box, _Box)
            created = box.state is None
            if box.state is None:
                box.state = box.new_state(limit)
            box.state.limit = limit
            return created

        return self._run(name, op)

    def ping(self) -> None:
        self._call(self.client.kv.get, self.root + LOCK_KEY)

    # -- wake-ups ------------------------------------------------------------------------------

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        """Our own waiters are woken at once; other processes' watchers see the change."""
        if client == self.client_id:
            self._notify(name, holder)

    def _ensure_watcher(self, name: str) -> None:
        """Start the watcher thread of ``name`` unless it runs (only queued waiters need it)."""
        with self._watch_lock:
            if name not in self._watch_threads and not self._closed.is_set():
                thread = threading.Thread(target=self._watch_loop, args=(name,), daemon=True,
                                          name=f"celery-semaphore-consul-watch-{name}")
                self._watch_threads[name] = thread
                thread.start()

    def _watch_loop(self, name: str) -> None:
        """Blocking queries on the prefix while this process has waiters on ``name``."""
        try:
            self._watch(name)
        finally:
            with self._watch_lock:
                if self._watch_threads.get(name) is threading.current_thread():
                    del self._watch_threads[name]

    def _watch(self, name: str) -> None:
        index, failures = 0, 0
        watch_lock, watchers, threads = self._watch_lock, self._watchers, self._watch_threads
        while not self._closed.is_set():
            with watch_lock:
                if not any(n == name for (n, _) in watchers):
                    threads.pop(name, None)
                    return
            try:
                snap = self._snapshot(name, index, wait=f"{self.watch_wait:g}s")
                failures = 0
            except BackendUnavailable as exc:
                failures += 1
                logger.debug("consul watch on %r failed: %s", name, exc)
                index = 0
                self._closed.wait(min(5.0, 0.1 * 2 ** failures) * random.uniform(0.5, 1.0))
                continue
            index = snap.index if snap.index >= index else 0  # gone back: start over
            box, _ = snap.box(time.time(), self.idle_ttl)
            state = box.state
            if state is None:
                continue
            queue, free = state.queue(), state.limit - len(state.holders)
            with watch_lock:
                ours = [rank for rank, h in enumerate(queue) if (name, h) in watchers]
            if not ours:
                continue
            # Admitted when rank < limit - holders. Every change under the prefix wakes every
            # watcher, so a waiter more than a full round of holders (``limit`` releases) from
            # admission pauses (with jitter) before asking again, the longer the further back;
            # changes meanwhile are seen at once after the pause. Waiters within one round
            # never pause: with short holds, their slots free up within milliseconds.
            gap = ours[0] - free
            if gap >= state.limit:
                pause = min(1.0, self.wake_pause * gap / state.limit)
                self._closed.wait(pause * random.uniform(0.5, 1.0))
            for rank in ours:
                if rank < free:
                    self._notify(name, queue[rank])

    def _forked(self) -> None:
        """The parent's watcher threads and HTTP connections do not exist in the child."""
        super()._forked()
        self._client = None  # the parent's connections: dropped, not closed (shared sockets)
        self._watch_threads = {}
        self._new_session_pools()  # the parent's sessions stay the parent's

    def close(self) -> None:
        """Stop the watchers (each after its current blocking query) and close connections."""
        self._closed.set()
        with self._sessions_lock:
            unused = list(self._ready.values())
            unused += [session for spares in self._spares.values() for session, _ in spares]
            self._ready, self._spares = {}, {}
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
        for session in unused:
            self._destroy(session)
        with self._watch_lock:
            client, self._client = self._client, None
        if client is not None:
            client.http.close()
