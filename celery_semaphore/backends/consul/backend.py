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

import json
import logging
import math
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Union

import consul
import consul.base

from ...exceptions import BackendUnavailable
from ...urls import mask_url
from ..base import BASIC_TRAFFIC, Attempt, Meta
from ..engine import DocumentBackend, Transaction
from ..model import State, as_json
from .http import UNAVAILABLE, ConsulConfig
from .sessions import Sessions

logger = logging.getLogger(__name__)

LOCK_KEY = ".lock"
#: Consul refuses session TTLs outside this range (seconds).
MIN_SESSION_TTL, MAX_SESSION_TTL = 10, 86400
#: CAS attempts before an operation gives up (each retry waits a little longer, with jitter).
MAX_ATTEMPTS = 200
#: Consul refuses KV values above 512 KiB (its default ``kv_max_value_size``).
MAX_VALUE_SIZE = 512 * 1024


def session_ttl(ttl: float) -> int:
    """The session TTL (whole seconds) for a lease of ``ttl`` seconds, as Consul accepts it."""
    return min(MAX_SESSION_TTL, max(MIN_SESSION_TTL, math.ceil(ttl)))


def kv_root(key_prefix: str) -> str:
    """The KV folder of all semaphores: ``"semaphore:"`` -> ``"semaphore/"``."""
    root = key_prefix.rstrip(":/")
    return f"{root}/" if root else ""


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


class ConsulTransaction(Transaction):
    """A private copy of one read of a semaphore's prefix (``version``: the ModifyIndex of
    ``.lock``, 0 when absent: the check-and-set then only creates), with what ``.lock`` keeps
    beside the state."""

    def __init__(self, name: str, snapshot: _Snapshot, now: float) -> None:
        state = State.from_dict(snapshot.raw["State"]) if snapshot.state is not None else None
        super().__init__(name, state, now, snapshot.lock_index)
        self.snapshot = snapshot
        self.epochs = dict(snapshot.epochs)
        self.sessions = dict(snapshot.sessions)  # holder -> its session
        self.live = set(snapshot.live)  # sessions that held a key under the prefix when read
        #: Sessions this operation gives back to this process (a release): they become
        #: spares instead of being destroyed.
        self.spare: Set[str] = set()

    def new_state(self, limit: int) -> State:
        return State(limit=limit, epochs=dict(self.epochs))


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


def _encode(txn: ConsulTransaction) -> Dict[str, Any]:
    state = txn.state
    txn.sessions = {h: s for h, s in txn.sessions.items() if state and h in state.holders}
    return {
        "Limit": state.limit if state is not None else 0,
        "Holders": sorted(txn.sessions.values()),
        "Sessions": txn.sessions,
        "State": state.to_dict() if state is not None else None,
        "Epochs": {str(k): v for k, v in (state.epochs if state else txn.epochs).items()},
    }


class _Admission:
    """The acquire rule on Consul. A newly admitted holder needs a session with its contender
    key before ``.lock`` names it: the session this call gives it is kept across lost races
    (``session``); ``holds_with`` is the holder's session after the last try."""

    def __init__(self, backend: "ConsulBackend", holder: str, limit: int, ttl: float,
                 meta: Meta, wait: bool, session: Optional[str]) -> None:
        self.backend = backend
        self.holder, self.limit, self.ttl, self.meta, self.wait = holder, limit, ttl, meta, wait
        self.session = session
        self.holds_with: Optional[str] = None

    def __call__(self, txn: Transaction) -> Attempt:
        assert isinstance(txn, ConsulTransaction)
        backend, sessions, holder = self.backend, self.backend.sessions, self.holder
        held = txn.state is not None and holder in txn.state.holders
        attempt = backend._admit(txn, holder, self.limit, self.ttl, self.meta, self.wait)
        if attempt.grant is not None and not held:
            if self.session is not None and self.session not in txn.live:
                sessions.destroy(self.session)  # Consul invalidated it meanwhile
                self.session = None
            if self.session is None:
                ttl = session_ttl(self.ttl)
                self.session = (sessions.take_spare(txn.name, ttl, txn.live)
                                or sessions.new_contender(txn.name, ttl))
            txn.sessions[holder] = self.session
        self.holds_with = txn.sessions.get(holder) if attempt.grant is not None else None
        return attempt


class ConsulBackend(DocumentBackend):
    """Semaphores in Consul KV with sessions, per the Consul semaphore guide (module docs)."""

    max_attempts = MAX_ATTEMPTS
    #: Consul has no clock: quotas, units, adaptive limits and pauses (and settling) would
    #: run on every client's own clock, so they are refused (:meth:`.base.Backend.
    #: check_traffic`); costs, rates and orderings work as elsewhere.
    traffic_options = BASIC_TRAFFIC

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
        self.sessions = Sessions(self, spare_keep)

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

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, any failure to reach Consul raised as BackendUnavailable."""
        try:
            return fn(*args, **kwargs)
        except UNAVAILABLE as exc:
            raise BackendUnavailable(
                f"consul semaphore backend {mask_url(self.url)} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def prefix(self, name: str) -> str:
        return f"{self.root}{name}/"

    def _snapshot(self, name: str, index: int = 0, wait: Optional[str] = None) -> _Snapshot:
        prefix = self.prefix(name)
        new_index, pairs = self.call(
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

    # -- the engine's storage: check-and-set on .lock ----------------------------------------

    @contextmanager
    def _load(self, name: str) -> Iterator[Transaction]:
        yield ConsulTransaction(name, self._snapshot(name), time.time())

    def _prune(self, txn: Transaction) -> None:
        """Also drop holders whose session no longer holds a contender key."""
        assert isinstance(txn, ConsulTransaction)
        super()._prune(txn)
        if txn.state is not None:
            for holder in list(txn.state.holders):
                if txn.sessions.get(holder) not in txn.live:
                    del txn.state.holders[holder]

    def _commit(self, txn: Transaction) -> bool:
        assert isinstance(txn, ConsulTransaction)
        snap = txn.snapshot
        _coalesce(snap.state, txn.state, txn.now, self.waiter_ttl, self.idle_ttl)
        doc = _encode(txn)
        if doc == {k: v for k, v in snap.raw.items() if k != "Touched"} or (
            txn.state is None and snap.lock_index == 0  # nothing to keep, nothing kept
        ):
            return True
        value = json.dumps({**doc, "Touched": txn.now})
        if len(value.encode()) > MAX_VALUE_SIZE:
            raise BackendUnavailable(
                f"consul semaphore {txn.name!r}: .lock would exceed Consul's 512 KiB value "
                f"limit ({len(txn.state.waiters) if txn.state else 0} waiters): lower "
                f"semaphore_worker_max_waiting or the number of waiting callers"
            )
        return bool(self.call(self.client.kv.put, self.prefix(txn.name) + LOCK_KEY, value,
                              cas=snap.lock_index))

    def _lost_race(self, attempt: int) -> None:
        """Retry at once, then back off with jitter to spread contenders."""
        if attempt:
            time.sleep(random.uniform(0, min(0.1, 0.001 * 2 ** attempt)))

    def _after_commit(self, txn: Transaction) -> None:
        """Destroy the sessions of holders that left ``.lock``; keep released ones as spares."""
        assert isinstance(txn, ConsulTransaction)
        in_use = set(txn.sessions.values())
        for session in set(txn.snapshot.sessions.values()) - in_use - txn.spare:
            self.sessions.destroy(session)  # its holder left: Consul deletes its contender key
        for session in txn.spare - in_use:
            self.sessions.give_spare(txn.name, session)

    def _stored_names(self) -> List[str]:
        _, pairs = self.call(self.client.kv.get, self.root, recurse=True,
                              consistency="consistent")
        now, names = time.time(), []
        for pair in pairs or []:
            rest = pair["Key"][len(self.root):]
            name, _, key = rest.partition("/")
            if key == LOCK_KEY and self._decode(0, self.prefix(name), [pair], now).state:
                names.append(name)
        return names

    # -- operations that differ from the engine's -------------------------------------------

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        meta = as_json(meta)
        self.check_meta(meta)
        ttl_s = session_ttl(ttl)
        session = self.sessions.take_ready(name, holder)
        if session is not None and not self.sessions.usable_or_destroyed(session, ttl_s):
            self.sessions.destroy(session)
            session = None
        admission = _Admission(self, holder, limit, ttl, meta, wait, session)
        try:
            attempt = self._transact(name, admission)
        except BaseException:
            if admission.session is not None:
                self.sessions.destroy(admission.session)
            raise
        session = admission.session
        if attempt.grant is None and attempt.position is not None:
            assert attempt.limit is not None  # the model's acquire always gives it
            # Queued. Within one round of holders from admission (or with a spare at hand),
            # get the session now, so that the admission is one read and one check-and-set.
            if session is None and (attempt.position < attempt.limit
                                    or self.sessions.has_spare(name)):
                session = (self.sessions.take_spare(name, ttl_s, None)
                           or self.sessions.new_contender(name, ttl_s))
            if session is not None:
                self.sessions.keep_ready(name, holder, session)
            self._ensure_watcher(name)
        elif session is not None and admission.holds_with != session:
            # Admitted on a try that lost its check-and-set, then not; or it already held.
            self.sessions.give_spare(name, session)
        return attempt

    def release(self, name: str, holder: str, outcome: Optional[str] = None,
                latency: Optional[float] = None) -> bool:
        """(``outcome`` and ``latency``: no adaptive limit here, ignored.)"""

        def release(txn: Transaction) -> bool:
            assert isinstance(txn, ConsulTransaction)
            if txn.state is None or not txn.state.release(holder, txn.now):
                return False
            txn.spare.add(txn.sessions[holder])  # for our next waiter on this name
            return True

        return self._transact(name, release)

    def cancel(self, name: str, holder: str) -> None:
        ready = self.sessions.take_ready(name, holder)
        if ready is not None:
            self.sessions.give_spare(name, ready)
        super().cancel(name, holder)

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        def renew(txn: Transaction) -> Optional[float]:
            assert isinstance(txn, ConsulTransaction)
            if txn.state is None:
                return None
            if holder not in txn.state.holders:
                txn.state.count("lost")  # a renewal that finds its lease gone
                return None
            if not self.sessions.renew(txn.sessions[holder]):
                txn.state.release(holder)  # Consul invalidated the session: the lease is lost
                txn.state.count("lost")
                return None
            return txn.state.renew(holder, ttl, txn.now)

        return self._transact(name, renew)

    def ping(self) -> None:
        self.call(self.client.kv.get, self.root + LOCK_KEY)

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
            txn = ConsulTransaction(name, snap, time.time())
            self._prune(txn)
            state = txn.state
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
            admissible = {h for _, h in state.admissible(txn.now)}  # costs, rate, twins
            for rank in ours:
                if queue[rank] in admissible:
                    self._notify(name, queue[rank])

    def _forked(self) -> None:
        """The parent's watcher threads and HTTP connections do not exist in the child."""
        super()._forked()
        self._client = None  # the parent's connections: dropped, not closed (shared sockets)
        self._watch_threads = {}
        self.sessions = Sessions(self, self.spare_keep)  # the parent's stay the parent's

    def close(self) -> None:
        """Stop the watchers (each after its current blocking query) and close connections."""
        self._closed.set()
        self.sessions.close()
        with self._watch_lock:
            client, self._client = self._client, None
        if client is not None:
            client.http.close()
