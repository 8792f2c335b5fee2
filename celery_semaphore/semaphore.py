"""The client API: :class:`Semaphore` hands out :class:`Lease` objects.

Guarantee: while every holder's lease is valid (not expired on the backend's clock), at most
``limit`` leases of one semaphore are held. Nothing can stop a holder that lost its lease from
running on (a partition, a paused process), so each lease carries a fencing token and a local
deadline that ends before the backend can expire it: check :attr:`Lease.valid` or call
:meth:`Lease.verify` before an action the semaphore protects, and pass :attr:`Lease.token`
to the protected resource where it can reject stale tokens.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .backends import get_backend
from .backends.base import (
    FAIR_KEY,
    Backend,
    FencingToken,
    Grant,
    Meta,
    SemaphoreStatus,
    new_holder_id,
)
from .backoff import (
    OUTCOMES,
    Adaptive,
    Backoff,
    RetryAfter,
    check_reason,
    outcome_of,
    retry_after_seconds,
)
from .exceptions import ConfigurationError, SemaphoreTimeout
from .names import validate_limit, validate_name, validate_ttl

logger = logging.getLogger(__name__)

DEFAULT_TTL = 60.0
DEFAULT_POLL_INTERVAL = 1.0


def _positive_seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{what} must be a positive number of seconds, not {value!r}")
    if math.isinf(value):
        raise ConfigurationError(f"{what} must be finite, not {value!r}")
    return float(value)


class Lease:
    """A held slot. Release it exactly once: :meth:`release`, or leave the ``with`` block.

    ``token`` is the fencing token ``(slot, epoch)``; ``holder`` the id the backend knows the
    lease by (what ``celery semaphore release NAME HOLDER`` takes).
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        holder: str,
        grant: Grant,
        requested_at: float,
        *,
        limit: Optional[int] = None,
        meta: Optional[Meta] = None,
        adaptive: Optional[Adaptive] = None,
    ) -> None:
        self.backend = backend
        self.name = name
        self.holder = holder
        self.token: FencingToken = grant.token
        self.limit = limit
        self.meta = dict(meta or {})
        #: The :class:`.Adaptive` limit of the semaphore, or None: a release reports the
        #: outcome of the work (``with``: from its exception) for the limit to learn from.
        self.adaptive = adaptive
        self.ttl = grant.ttl
        self._granted_at = time.monotonic()
        # The local deadline counts from before the request was sent, so it ends no later
        # than the backend's expiry whatever the network delay was.
        self._deadline = requested_at + grant.ttl
        self._released = False
        self._releasing = False  # a release call is in flight
        self._lost = False
        self._lost_callbacks: List[Callable[["Lease"], None]] = []
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return self._released

    @property
    def releasing(self) -> bool:
        """True while a release call is in flight."""
        return self._releasing

    @property
    def lost(self) -> bool:
        """True once a renewal found the lease gone or the local deadline passed unrenewed."""
        return self._lost or (not self._released and time.monotonic() >= self._deadline)

    @property
    def valid(self) -> bool:
        """Held as far as this process can tell without a round trip."""
        return not self._released and not self.lost

    @property
    def remaining(self) -> float:
        """Seconds until the local deadline (0 when passed)."""
        return max(0.0, self._deadline - time.monotonic())

    def on_lost(self, callback: Callable[["Lease"], None]) -> None:
        """Call ``callback(lease)`` once when a renewal discovers the lease is gone."""
        self._lost_callbacks.append(callback)

    def mark_lost(self) -> None:
        """Record that the lease is gone and run the ``on_lost`` callbacks (once); not while
        it is being released (a renewal racing the release finds it gone)."""
        with self._lock:
            if self._lost or self._released or self._releasing:
                return
            self._lost = True
        for callback in self._lost_callbacks:
            callback(self)

    def release(self, outcome: Optional[str] = None, latency: Optional[float] = None) -> bool:
        """Free the slot. True only for the call that freed it; False when it had expired.

        Idempotent: later calls return False and touch nothing. A call that raises (the
        backend unreachable) leaves the lease held, to be released again; meanwhile it is no
        longer renewed, so its TTL frees the slot if nobody does.

        ``outcome`` (``"ok"``, ``"overload"``, ``"error"``) and ``latency`` (seconds) tell an
        :class:`.Adaptive` semaphore how the work went (:mod:`.backends.base`, ``release``);
        leaving a ``with`` block reports them for an adaptive lease.
        """
        if outcome is not None and outcome not in OUTCOMES:
            raise ConfigurationError(f"outcome must be one of {', '.join(OUTCOMES)} or None, "
                                     f"not {outcome!r}")
        with self._lock:
            if self._released or self._releasing:
                return False
            self._releasing = True
        from .keeper import default_keeper

        default_keeper.discard(self)
        try:
            if outcome is None and latency is None:
                freed = self.backend.release(self.name, self.holder)
            else:
                freed = self.backend.release(self.name, self.holder,
                                                           outcome=outcome, latency=latency)
        except BaseException:
            with self._lock:
                self._releasing = False
            raise
        with self._lock:
            self._released, self._releasing = True, False
        return freed

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Extend the lease to ``ttl`` seconds from now. Never re-acquires a lost lease."""
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        if self._released or self._lost:
            return False
        started = time.monotonic()
        if self.backend.renew(self.name, self.holder, ttl) is None:
            self.mark_lost()
            return False
        self._deadline = started + ttl
        self.ttl = ttl
        return True

    def verify(self) -> bool:
        """Ask the backend (one round trip) whether the lease is still held."""
        if self._released:
            return False
        held = self.backend.verify(self.name, self.holder)
        if not held:
            self.mark_lost()
        return held

    def settle(self, units: int) -> bool:
        """Say how many units of the semaphore's rates and quotas this holder actually spent
        (``units`` >= 0; at admission it spent its estimate, the ``units`` of the acquire):
        the windows still open and the rates are adjusted by the difference, refunding or
        overdrawing (:mod:`.backends.base`, ``settle``). Absolute and idempotent: settling
        again adjusts by the change. False when the lease is no longer held (nothing
        changed)."""
        from .traffic import validate_settle_units

        units = validate_settle_units(units)
        if self._released:
            return False
        return bool(self.backend.settle(self.name, self.holder, units))

    def outcome(self, exc: Optional[BaseException]) -> Optional[str]:
        """What releasing after ``exc`` (None: the work went well) reports: None unless the
        semaphore is adaptive (:func:`.backoff.outcome_of`)."""
        return None if self.adaptive is None else outcome_of(exc, self.adaptive)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        wait = exc.remaining() if isinstance(exc, Backoff) else None
        if wait and not self._released:
            try:  # closed for everyone before this slot frees
                self.backend.pause(self.name, wait, exc.reason)
            except Exception as pause_error:
                logger.warning("pausing semaphore %r for %r failed: %s", self.name, exc,
                               pause_error)
        _release_on_exit(self, exc, self.outcome(exc), time.monotonic() - self._granted_at)

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self.lost else "held")
        return f"<Lease {self.name!r} token={self.token} holder={self.holder} {state}>"


def _release_on_exit(lease: Union[Lease, "LeaseGroup"], exc: Any, outcome: Optional[str],
                     latency: float) -> None:
    """Release on leaving a ``with`` block, reporting ``outcome`` (and the time held) when
    there is one; after an exception, a failed release is logged, not raised: the body's
    exception is the one to surface."""
    args: Dict[str, Any] = {} if outcome is None else {"outcome": outcome, "latency": latency}
    if exc is None:
        lease.release(**args)
        return
    try:
        lease.release(**args)
    except Exception as release_error:
        logger.warning("releasing %r after %r failed (its TTL frees the slot): %s",
                       lease, exc, release_error)


class Semaphore:
    """A named counting semaphore shared by every process that uses the same backend.

    Guarantee: while every lease is valid, at most ``limit`` are held (see the module
    docstring for what happens past a lease's deadline). Waiters are admitted in FIFO order,
    woken by the backend's notification, with a poll every ``poll_interval`` seconds as the
    fallback for a lost notification or an expired lease.

    :param name: the semaphore's name: at most 200 UTF-8 bytes, printable, without whitespace
        or any of ``{}[]*?\\/``.
    :param limit: the limit this caller declares (1 to 100,000; 1 by default, as the
        ``semaphore_default_limit`` setting), or an :class:`.Adaptive` (the limit is learned
        between its ``min`` and ``max``; a lease left by a ``with`` block reports how the
        work went). Limits follow the code: the declaration of the
        most recently started process is in force (so a deploy that changes it takes effect
        with the new processes' first acquire), unless an operator pinned the limit with
        :meth:`resize` or ``celery semaphore resize`` (:mod:`.backends.base`, "Limits").
    :param backend: where the semaphore lives: a URL (``redis://host:6379/0``,
        ``amqp://...``, ``consul://host:8500``, ``sqlite:////path.db`` for one host) or a
        :class:`Backend`. Required: there is no broker here to follow, and a guessed default
        could give each host its own limit.
    :param ttl: lease length in seconds (at least ``MIN_LEASE_TTL``, 0.1 s; 60 by default);
        a lease not renewed in time expires and frees its slot.
    :param poll_interval: seconds between a waiter's tries when no wake-up comes.
    :param meta: JSON-able data shown to operators with each lease (``status``).
    :param auto_renew: renew every lease in the background every third of its TTL and call
        its ``on_lost`` callbacks when a renewal finds it gone.
    :param rate: at most that many starts (grants) per period, cluster-wide, on the backend's
        clock (``"100/s"``, ``"30/m"``, ``"1000/h"``; several: ``"10/s; 500/m"``);
        ``burst`` starts at once (default 1), for each rate. The rate is the semaphore's: the
        latest caller that declares one sets it (:mod:`.backends.base`, "Rate").
    :param quota: at most that many units started per calendar window (``"1000/h;
        20000/d"``; :func:`.traffic.parse_quota`), the semaphore's like the rate; windows of
        whole days, weeks (from Monday) and months start at midnight of ``quota_tz`` (an IANA
        name, its UTC offset when the call is made; default UTC).
    :param options: passed to the backend (``key_prefix``, ``waiter_ttl``, ``idle_ttl``, and
        each backend's own, e.g. Redis's ``socket_timeout``).
    :raises ConfigurationError: for any invalid argument, before anything is sent.
    """

    def __init__(
        self,
        name: str,
        limit: Union[int, Adaptive] = 1,
        backend: Union[str, Backend, None] = None,
        *,
        ttl: float = DEFAULT_TTL,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        meta: Optional[Meta] = None,
        auto_renew: bool = False,
        rate: Optional[str] = None,
        burst: int = 1,
        quota: Optional[str] = None,
        quota_tz: str = "UTC",
        **options: Any,
    ) -> None:
        from . import traffic

        self.name = validate_name(name)
        declared = traffic.validate_limit_value(limit)
        #: The :class:`.Adaptive` limit this caller declares, or None.
        self.adaptive = traffic.adaptive_of(declared)
        #: The limit it declares (an adaptive one's ``max``).
        self.limit = traffic.limit_number(declared)
        intervals = traffic.parse_rates(rate, "rate")
        #: ``(interval seconds, burst)`` of each rate this caller declares (empty: none).
        self.rates: Tuple[Tuple[float, int], ...] = traffic.rates_meta(
            intervals, traffic.validate_burst(burst, "burst")) or ()
        #: The first of them, or None.
        self.rate = self.rates[0] if self.rates else None
        #: The quotas it declares (:class:`.traffic.Quota`), or None.
        self.quota = traffic.parse_quota(quota, "quota")
        self.quota_tz = traffic.validate_quota_tz(quota_tz, "quota_tz")
        self.ttl = validate_ttl(ttl)
        self.poll_interval = _positive_seconds(poll_interval, "poll_interval")
        self.meta = dict(meta or {})
        self.auto_renew = auto_renew
        if backend is None:
            raise ConfigurationError(
                "Semaphore needs a backend: a URL such as redis://host:6379/0, or "
                "sqlite:////path/to/file.db for processes on one host")
        self.backend = get_backend(backend, **options)
        if self.ttl > self.backend.max_lease_ttl:  # the state would expire under it
            raise ConfigurationError(
                f"ttl {self.ttl:g}s must stay below the backend's idle_ttl "
                f"({self.backend.idle_ttl:g}s), which forgets a semaphore nobody touches"
            )

    def _lease(self, holder: str, grant: Grant, requested_at: float, meta: Meta,
               limit: Any) -> Lease:
        lease = Lease(self.backend, self.name, holder, grant, requested_at, limit=limit,
                      meta=meta, adaptive=self.adaptive)
        if self.auto_renew:
            from .keeper import default_keeper

            default_keeper.add(lease)
        return lease

    def acquire(self, timeout: Optional[float] = None, *, meta: Optional[Meta] = None,
                task_id: Optional[str] = None, fair_key: Optional[str] = None,
                cost: int = 1, priority: int = 0, fair_weight: int = 1,
                units: int = 1) -> Lease:
        """Block until a slot is free and return its lease.

        Raises :class:`SemaphoreTimeout` when ``timeout`` seconds pass first (the caller then
        leaves the queue). ``meta`` (JSON-able) is shown to operators in ``status``. With
        ``task_id``, no lease is granted while another lease of the same task id is held (a
        duplicate delivery waits for its twin, keeping its place in line). With ``fair_key``
        (a tenant, say) the semaphore serves its waiters round-robin across keys, FIFO within
        one (:mod:`.backends.base`, "Fair shares"), ``fair_weight`` waiters of this key per
        round. ``cost``: the units of the limit this lease holds (1 to the limit); ``priority``:
        higher is admitted first (:mod:`.backends.base`, "Costs", "Priorities"). ``units``:
        the units of the semaphore's rates and quotas this start spends, as estimated now
        (:meth:`Lease.settle` says what it actually spent).
        """
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ConfigurationError(f"timeout must be None or a number of seconds >= 0, "
                                     f"not {timeout!r}")
        if timeout is not None and math.isinf(timeout):
            timeout = None
        meta = self._meta(meta, fair_key, cost, priority, fair_weight, units)
        holder = new_holder_id(task_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        wake = threading.Event()
        self.backend.watch(self.name, holder, wake.set)
        granted = False
        try:
            while True:
                wake.clear()
                requested_at = time.monotonic()
                attempt = self.backend.acquire(
                    self.name, holder, limit=self.limit, ttl=self.ttl, meta=meta, wait=True
                )
                if attempt.grant is not None:
                    granted = True
                    return self._lease(holder, attempt.grant, requested_at, meta, attempt.limit)
                pause = self.backend.pause_after(attempt, self.poll_interval)
                if attempt.due is not None or attempt.rate_due is not None:
                    # due from the backend's decision (a rate, a quota window, a pause):
                    # count from the send
                    pause = max(0.0, pause - (time.monotonic() - requested_at))
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise SemaphoreTimeout(
                            f"no slot of semaphore {self.name!r} became free in {timeout}s"
                        )
                    pause = min(pause, remaining)
                wake.wait(pause)
        finally:
            self.backend.unwatch(self.name, holder)
            if not granted:
                self._abandon(holder)

    def _meta(self, meta: Optional[Meta], fair_key: Optional[str], cost: int = 1,
              priority: int = 0, fair_weight: int = 1, units: int = 1) -> Meta:
        from . import traffic

        if isinstance(units, str):
            raise ConfigurationError(f"units must be an integer, not {units!r}")
        meta = {**self.meta, **(meta or {}), **traffic.traffic_meta(
            traffic.validate_cost(cost, "cost", self.limit),
            traffic.validate_priority(priority, "priority"),
            weight=traffic.validate_weight(fair_weight), rates=self.rates, quota=self.quota,
            quota_tz=self.quota_tz, units=traffic.validate_units(units, "units", self.quota),
            adaptive=self.adaptive)}
        if fair_key is not None:
            if not isinstance(fair_key, str):
                raise ConfigurationError(f"fair_key must be a string, not {fair_key!r}")
            meta[FAIR_KEY] = fair_key
        return meta

    def _abandon(self, holder: str) -> None:
        """Leave the queue; also release, in case a grant was lost with its reply."""
        try:
            self.backend.abandon(self.name, holder)
        except Exception:  # the queue entry expires by itself after waiter_ttl
            pass

    def try_acquire(self, *, meta: Optional[Meta] = None, task_id: Optional[str] = None,
                    fair_key: Optional[str] = None, cost: int = 1, priority: int = 0,
                    fair_weight: int = 1, units: int = 1) -> Optional[Lease]:
        """Take a slot if one is free and nobody is queued ahead of this caller for it; never
        blocks. ``meta``, ``task_id``, ``fair_key``, ``cost``, ``priority``, ``fair_weight``
        and ``units`` as for :meth:`acquire`."""
        meta = self._meta(meta, fair_key, cost, priority, fair_weight, units)
        holder = new_holder_id(task_id)
        requested_at = time.monotonic()
        try:
            attempt = self.backend.acquire(
                self.name, holder, limit=self.limit, ttl=self.ttl, meta=meta, wait=False
            )
        except BaseException:
            self._abandon(holder)  # the backend may have granted, the reply lost
            raise
        if attempt.grant is None:
            return None
        return self._lease(holder, attempt.grant, requested_at, meta, attempt.limit)

    def resize(self, limit: int) -> bool:
        """Set the limit for everyone and pin it: no declared limit changes it until
        :meth:`unpin` (creating the semaphore); True if created."""
        return self.backend.resize(self.name, validate_limit(limit))

    def unpin(self) -> Optional[int]:
        """Release the pin :meth:`resize` set: the newest declared limit is in force again.
        Returns the limit in force (None: the backend does not know the semaphore)."""
        return self.backend.unpin(self.name)

    def pause(self, retry_after: RetryAfter, reason: str = "") -> float:
        """Close the semaphore for everyone until ``retry_after`` (seconds, a datetime, a
        timedelta or a ``Retry-After`` header value, as :class:`.Backoff` takes) from now, on
        the backend's clock: no acquire is admitted meanwhile (holders keep their slots). A
        pause in force that ends later is kept. Returns the end in force (backend epoch
        seconds). Leaving a lease's ``with`` block by a :class:`.Backoff` with a time does
        the same."""
        seconds = retry_after_seconds(retry_after, what="pause")
        if seconds is None:
            raise ConfigurationError("pause needs a time: seconds, a datetime, a timedelta or "
                                     "a Retry-After header value, not None")
        return float(self.backend.pause(self.name, seconds, check_reason(reason)))

    def resume(self) -> bool:
        """Lift a pause (:meth:`pause`); True if one was in force."""
        return bool(self.backend.resume(self.name))

    def status(self) -> SemaphoreStatus:
        """Limit, holders and waiters. A semaphore never used shows this caller's limit."""
        status = self.backend.status(self.name)
        if status is None:
            return SemaphoreStatus(self.name, self.limit, {}, (), ())
        return status

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit} backend={self.backend!r}>"


class LeaseGroup:
    """The leases of several semaphores granted together (:func:`acquire_all`), held under
    one holder id and kept, renewed and released as one: it offers what :class:`Lease` offers
    (``release``, ``renew``, ``verify``, ``valid``, ``lost``, ``on_lost``, ``with``), over all
    of them. ``name``, ``token`` and ``limit`` are the first semaphore's; :attr:`leases` maps
    every name to its own :class:`Lease` (its own fencing token).

    The group is lost as soon as one of its leases is: the guarantee it gives (at most
    ``limit`` holders of each semaphore) holds only while all of them are valid.
    """

    def __init__(self, leases: "Dict[str, Lease]") -> None:
        if not leases:
            raise ValueError("a lease group needs at least one lease")
        self.leases = dict(leases)
        first = next(iter(self.leases.values()))
        self.backend = first.backend
        self.name = first.name
        self.holder = first.holder
        self.token = first.token
        self.limit = first.limit
        self.meta = first.meta
        self._lost_callbacks: List[Callable[["LeaseGroup"], None]] = []
        self._lost_once = threading.Lock()
        self._lost_fired = False
        for lease in self.leases.values():
            lease.on_lost(lambda _lease: self.mark_lost())

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self.leases)

    @property
    def tokens(self) -> "Dict[str, FencingToken]":
        return {name: lease.token for name, lease in self.leases.items()}

    @property
    def ttl(self) -> float:
        return min(lease.ttl for lease in self.leases.values())

    @property
    def released(self) -> bool:
        return all(lease.released for lease in self.leases.values())

    @property
    def releasing(self) -> bool:
        return any(lease.releasing for lease in self.leases.values())

    @property
    def lost(self) -> bool:
        return any(lease.lost for lease in self.leases.values())

    @property
    def valid(self) -> bool:
        return all(lease.valid for lease in self.leases.values())

    @property
    def remaining(self) -> float:
        return min(lease.remaining for lease in self.leases.values())

    def on_lost(self, callback: Callable[["LeaseGroup"], None]) -> None:
        """Call ``callback(group)`` once when one of the leases is found gone."""
        self._lost_callbacks.append(callback)

    def mark_lost(self) -> None:
        """Run the ``on_lost`` callbacks, once (not while the group is being released)."""
        with self._lost_once:
            if self._lost_fired or self.releasing or self.released:
                return
            self._lost_fired = True
        for callback in self._lost_callbacks:
            callback(self)

    def release(self, outcome: Optional[str] = None, latency: Optional[float] = None) -> bool:
        """Release every lease (each once; a call that raises leaves the ones not released to
        a later call). True when this call freed all that were still held. ``outcome`` and
        ``latency`` as for :meth:`Lease.release`, reported to each adaptive semaphore."""
        return self._release(lambda lease: outcome if lease.adaptive is not None else None,
                             latency)

    def _release(self, outcome_of_lease: Callable[[Lease], Optional[str]],
                 latency: Optional[float]) -> bool:
        from .keeper import default_keeper

        default_keeper.discard(self)
        freed, error = True, None
        for lease in self.leases.values():
            if lease.released:
                continue
            outcome = outcome_of_lease(lease)
            try:
                freed = (lease.release(outcome, latency) if outcome is not None
                         else lease.release()) and freed
            except BaseException as exc:  # the others are still released
                error = error or exc
        if error is not None:
            raise error
        return freed

    def settle(self, units: int) -> bool:
        """:meth:`Lease.settle` for every semaphore of the group: True when each was
        settled."""
        return all([lease.settle(units) for lease in self.leases.values()])

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Renew every lease; False (and lost) as soon as one is gone."""
        return all([lease.renew(ttl) for lease in self.leases.values()])

    def verify(self) -> bool:
        return all([lease.verify() for lease in self.leases.values()])

    def __enter__(self) -> "LeaseGroup":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        """Release every lease, each adaptive one with the outcome of ``exc``. A
        :class:`.Backoff` pauses none of them (which one did the API mean?): call
        :meth:`Semaphore.pause`."""
        latency = time.monotonic() - min(lease._granted_at for lease in self.leases.values())
        try:
            self._release(lambda lease: lease.outcome(exc), latency)
        except Exception as release_error:
            if exc is None:
                raise
            logger.warning("releasing %r after %r failed (its TTL frees the slot): %s",
                           self, exc, release_error)

    def __repr__(self) -> str:
        tokens = " ".join(f"{name}={token}" for name, token in self.tokens.items())
        return f"<LeaseGroup {tokens} holder={self.holder}>"


def _check_set(semaphores: Sequence[Semaphore]) -> Backend:
    if not semaphores:
        raise ConfigurationError("acquire_all needs at least one semaphore")
    backend = semaphores[0].backend
    if any(s.backend is not backend for s in semaphores):
        raise ConfigurationError("semaphores acquired together must share one backend")
    if len({s.name for s in semaphores}) != len(semaphores):
        raise ConfigurationError("acquire_all lists a semaphore twice")
    first = semaphores[0]
    if any((s.quota, s.quota_tz, s.adaptive) != (first.quota, first.quota_tz, first.adaptive)
           for s in semaphores):  # one acquire's meta declares them for every semaphore
        raise ConfigurationError("semaphores acquired together must declare the same quota "
                                 "and the same Adaptive limit (or none)")
    return backend


def _group(semaphores: Sequence[Semaphore], backend: Backend, holder: str, attempt: Any,
           requested_at: float, meta: Meta) -> LeaseGroup:
    group = LeaseGroup({
        s.name: Lease(backend, s.name, holder, attempt.grants[s.name], requested_at,
                      limit=attempt.limits.get(s.name), meta=meta, adaptive=s.adaptive)
        for s in semaphores})
    if semaphores[0].auto_renew:
        from .keeper import default_keeper

        default_keeper.add(group)
    return group


def acquire_all(semaphores: Sequence[Semaphore], timeout: Optional[float] = None, *,
                meta: Optional[Meta] = None, task_id: Optional[str] = None,
                fair_key: Optional[str] = None) -> LeaseGroup:
    """Block until every one of ``semaphores`` (on one backend) grants a slot, together, and
    return their :class:`LeaseGroup`; while it waits it holds none of them
    (:meth:`.backends.base.Backend.acquire_all`). TTL, poll interval and auto-renewal are the
    first semaphore's; ``timeout``, ``meta``, ``task_id`` and ``fair_key`` as for
    :meth:`Semaphore.acquire`.
    """
    backend = _check_set(semaphores)
    first = semaphores[0]
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float)) or not timeout >= 0):
        raise ConfigurationError(f"timeout must be None or a number of seconds >= 0, "
                                 f"not {timeout!r}")
    meta = first._meta(meta, fair_key)
    holder = new_holder_id(task_id)
    requests = [(s.name, s.limit) for s in semaphores]
    deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
    wake = threading.Event()
    for s in semaphores:  # it may wait in any one's queue
        backend.watch(s.name, holder, wake.set)
    granted = False
    try:
        while True:
            wake.clear()
            requested_at = time.monotonic()
            attempt = backend.acquire_all(requests, holder, ttl=first.ttl, meta=meta, wait=True)
            if attempt.grants is not None:
                granted = True
                return _group(semaphores, backend, holder, attempt, requested_at, meta)
            pause = backend.pause_after(attempt, first.poll_interval)
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SemaphoreTimeout(
                        f"no slot of semaphore {attempt.blocking!r} (of "
                        f"{[s.name for s in semaphores]!r}) became free in {timeout}s")
                pause = min(pause, remaining)
            wake.wait(pause)
    finally:
        for s in semaphores:
            backend.unwatch(s.name, holder)
        if not granted:
            try:
                backend.abandon_all([s.name for s in semaphores], holder)
            except Exception:  # queue entries expire by themselves after waiter_ttl
                pass


def try_acquire_all(semaphores: Sequence[Semaphore], *, meta: Optional[Meta] = None,
                    task_id: Optional[str] = None,
                    fair_key: Optional[str] = None) -> Optional[LeaseGroup]:
    """Every one of ``semaphores`` together if each admits the caller now, else None (none
    held); never blocks."""
    backend = _check_set(semaphores)
    first = semaphores[0]
    meta = first._meta(meta, fair_key)
    holder = new_holder_id(task_id)
    requested_at = time.monotonic()
    try:
        attempt = backend.acquire_all([(s.name, s.limit) for s in semaphores], holder,
                                      ttl=first.ttl, meta=meta, wait=False)
    except BaseException:
        try:
            backend.abandon_all([s.name for s in semaphores], holder)
        except Exception:
            pass
        raise
    if attempt.grants is None:
        return None
    return _group(semaphores, backend, holder, attempt, requested_at, meta)
