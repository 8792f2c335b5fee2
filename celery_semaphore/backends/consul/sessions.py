"""The Consul sessions one process makes for its holders, and keeps for reuse.

Each holder needs a session and a contender key acquired with it. Making one costs Consul three
Raft writes (session create, key acquire, later session destroy), so a process keeps:

* **ready** sessions, made while a waiter queues close to admission, so that its admission is
  one read and one check-and-set;
* **spares**, the sessions its own releases gave back, for its next waiter on the same name;
  a spare nobody takes is destroyed ``spare_keep`` to 1.5 x ``spare_keep`` seconds later, and
  at :meth:`Sessions.close`.

No two holders ever share a session; a session is only reused once its holder left ``.lock``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Set, Tuple

import consul

from ...exceptions import BackendUnavailable
from ...scheduler import Scheduler, Timer


class SessionHost(Protocol):
    """What the sessions use of their backend (:class:`.ConsulBackend`)."""

    client_id: str

    @property
    def client(self) -> consul.Consul: ...

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a failure to reach Consul raised as BackendUnavailable."""

    def prefix(self, name: str) -> str:
        """The KV prefix of semaphore ``name``."""

logger = logging.getLogger(__name__)

#: Spare sessions kept per semaphore name and process.
MAX_SPARES = 8

#: Destroys unused spares, for every Consul backend of the process.
sweeper = Scheduler("celery-semaphore-consul-sweep")


class Sessions:
    """The sessions of one backend instance in one process (thread-safe)."""

    def __init__(self, backend: SessionHost, spare_keep: float) -> None:
        self.backend = backend
        self.spare_keep = spare_keep
        self._lock = threading.Lock()
        #: Every session this process made and may still use: session -> (TTL, renewed at).
        self.owned: Dict[str, Tuple[int, float]] = {}
        #: Sessions made in advance for our queued waiters: (name, holder) -> session.
        self._ready: Dict[Tuple[str, str], str] = {}
        #: Sessions our releases gave back, for our next waiters: name -> [(session, since)].
        self._spares: Dict[str, List[Tuple[str, float]]] = {}
        self._sweep: Optional[Timer] = None
        self._closed = False

    # -- making and ending sessions -------------------------------------------------------

    def new_contender(self, name: str, ttl: int) -> str:
        """A session (TTL ``ttl`` seconds) and its contender key ``<prefix><session>``."""
        backend = self.backend
        session: str = backend.call(
            backend.client.session.create, name=f"celery-semaphore {name}", behavior="delete",
            ttl=ttl, lock_delay=0,
        )
        now = time.monotonic()
        with self._lock:
            # Forget sessions nobody renewed for twice their TTL: Consul has invalidated them
            # (a lease of ours that another process pruned and destroyed leaves one behind).
            self.owned = {s: v for s, v in self.owned.items() if now - v[1] <= 2 * v[0]}
            self.owned[session] = (ttl, now)
        body = json.dumps({"client": backend.client_id})
        try:
            made = backend.call(backend.client.kv.put, backend.prefix(name) + session, body,
                                acquire=session)
        except BaseException:
            self.destroy(session)
            raise
        if not made:
            self.destroy(session)
            raise BackendUnavailable(
                f"consul refused the contender key of semaphore {name!r} (session invalidated?)"
            )
        return session

    def destroy(self, session: str) -> None:
        """Destroy a session: Consul deletes its contender key (behavior delete)."""
        with self._lock:
            self.owned.pop(session, None)
        try:
            self.backend.call(self.backend.client.session.destroy, session)
        except BackendUnavailable as exc:  # its TTL will end it
            logger.warning("could not destroy consul session %s: %s", session, exc)

    def renew(self, session: str) -> bool:
        """Renew one of our sessions; False when Consul no longer knows it."""
        try:
            self.backend.call(self.backend.client.session.renew, session)
        except BackendUnavailable as exc:
            if not isinstance(exc.__cause__, consul.NotFound):
                raise
            with self._lock:
                self.owned.pop(session, None)
            return False
        with self._lock:
            if session in self.owned:
                self.owned[session] = (self.owned[session][0], time.monotonic())
        return True

    def usable_or_destroyed(self, session: str, ttl: int) -> bool:
        """Ours, with TTL ``ttl``, and renewed less than half its TTL ago (renewing it if
        not): good enough to become a holder's session, which its lease keeps renewing.
        Destroyed if Consul cannot be asked (it would be nobody's, yet live for up to twice
        its TTL)."""
        try:
            with self._lock:
                owned = self.owned.get(session)
            if owned is None or owned[0] != ttl:
                return False
            return time.monotonic() - owned[1] < ttl / 2 or self.renew(session)
        except BaseException:
            self.destroy(session)
            raise

    # -- sessions kept for our waiters ------------------------------------------------------

    def take_ready(self, name: str, holder: str) -> Optional[str]:
        with self._lock:
            return self._ready.pop((name, holder), None)

    def keep_ready(self, name: str, holder: str, session: str) -> None:
        with self._lock:
            self._ready[(name, holder)] = session

    def has_spare(self, name: str) -> bool:
        with self._lock:
            return bool(self._spares.get(name))

    def take_spare(self, name: str, ttl: int, live: Optional[Set[str]]) -> Optional[str]:
        """A session that a release of ours on ``name`` gave back, if still good (and in
        ``live``, the sessions holding keys in the caller's read, when given)."""
        while True:
            with self._lock:
                spares = self._spares.get(name, [])
                picked = [s for s, _ in spares if self.owned.get(s, (0,))[0] == ttl]
                if not picked:
                    return None
                session = picked[-1]
                spares[:] = [(s, at) for s, at in spares if s != session]
            if (live is None or session in live) and self.usable_or_destroyed(session, ttl):
                return session
            self.destroy(session)

    def give_spare(self, name: str, session: str) -> None:
        """Keep a session no holder uses any more for this process's next waiter on ``name``."""
        with self._lock:
            if session not in self.owned or self._closed:
                extra = [session]
            else:
                spares = self._spares.setdefault(name, [])
                spares.append((session, time.monotonic()))
                extra = [s for s, _ in spares[:-MAX_SPARES]]
                del spares[:-MAX_SPARES]
                if self._sweep is None:
                    self._sweep = sweeper.call(self._sweep_spares, delay=self.spare_keep)
        for old in extra:
            self.destroy(old)

    def _sweep_spares(self) -> None:
        cutoff = time.monotonic() - self.spare_keep
        with self._lock:
            self._sweep = None
            stale = [s for spares in self._spares.values() for s, at in spares if at <= cutoff]
            for name in list(self._spares):
                self._spares[name] = [(s, at) for s, at in self._spares[name] if at > cutoff]
                if not self._spares[name]:
                    del self._spares[name]
            if self._spares and not self._closed:
                self._sweep = sweeper.call(self._sweep_spares, delay=self.spare_keep / 2)
        for session in stale:
            self.destroy(session)

    def close(self) -> None:
        """Destroy every session kept for reuse; later spares are destroyed at once."""
        with self._lock:
            self._closed = True
            unused = list(self._ready.values())
            unused += [session for spares in self._spares.values() for session, _ in spares]
            self._ready, self._spares = {}, {}
            if self._sweep is not None:
                self._sweep.cancel()
                self._sweep = None
        for session in unused:
            self.destroy(session)
