"""The gate: the shell around the worker core (:mod:`.core`), on the consumer's loop thread.

One request's way, read top to bottom in this file:

1. Celery hands the request over (:meth:`Gate.on_task_request`: the consumer's one entry to
   the pool, after ETA and rate limits). Its semaphores are resolved (:mod:`..guards`), the
   headers the gate writes itself are checked, its pool callbacks are wrapped, and the core
   hears that it arrived (:class:`.Arrived`).
2. The core answers with commands, carried out in order (:meth:`Gate.run`): an acquire
   attempt goes to the backend (:class:`.SendAttempt`, through :class:`.BackendLink`: on the
   loop itself for Redis, in one pipeline per turn of the loop); its answer, a wake-up or a
   grant the backend pushed comes back to the core as an event.
3. Granted (:class:`.Start`): the lease record goes into the request's headers (the task
   reads it with ``current_lease()``) and the request goes to the pool, unchanged otherwise.
4. The task ends (a pool callback: :meth:`Gate.ended`), the core says :class:`.Release`, and
   the release goes to the backend, which may grant the slot to the next waiter in the same
   step (pushed grants).

Meanwhile the core renews the leases its requests hold (:class:`.Renew`, every third of a
TTL), lets requests of a full semaphore wait in the worker or in the waiting room
(:mod:`.parking`), and settles every other way a request ends: failed, skipped, parked,
requeued, revoked, given back at a reconnect or a shutdown, dropped or orphaned by the pool's
flush on a reconnect (:class:`.PoolFlushed`).

Threads: every state lives on the loop thread (:mod:`.threads`); the I/O thread makes the
calls that must not block the loop (the waiting room's broker calls, result-backend writes,
the backend calls of a backend with no event-loop link) and posts their results back.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter, deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from celery import signals
from celery.exceptions import TimeLimitExceeded

from ..backends import close_all
from ..backends.base import (
    FAIR_KEY,
    Abandon,
    Acquire,
    AcquireAll,
    Attempt,
    Backend,
    MultiAttempt,
    Pause,
    PushedGrant,
    Release,
    Renew,
    new_holder_id,
)
from ..backoff import Backoff, outcome_of
from ..exceptions import ConfigurationError, LinkClosed, SemaphoreError
from ..guards import Guards
from ..settings import Settings
from ..stats import FIRST_WAIT_META
from ..task_lease import LEASE_KEY, lease_record_of_grants
from ..urls import mask_url
from ..waiting_room import DOORBELL_TASK, FIRST_WAIT_HEADER, PARKED_HEADER
from . import celery_internals, core
from .claim import Claim, State
from .context import GateContext, GateState
from .core import (
    Answer,
    Answered,
    Arrived,
    ChildFacts,
    Command,
    Event,
    How,
    Pushed,
    Tick,
    WorkerCore,
)
from .headers import check_gate_headers
from .limits import LimitWatch
from .link import BackendLink
from .outcomes import Outcomes
from .parking import ParkingLot
from .reporting import Reporting, snapshot
from .requeue import Requeue
from .settlements import Settle, Settlements
from .tally import Tally

logger = logging.getLogger(__name__)

#: The attribute of a request that holds its claim.
CLAIM = "semaphore_claim"
#: The attribute of a message this worker hands to Celery again after a Backoff: its request
#: queues ahead of later arrivals (an attribute, never a header: any producer can forge one).
FRONT = "_celery_semaphore_front"


class Gate:
    """Holds guarded requests until the semaphore admits them, and releases their slots. See
    the module docstring."""

    def __init__(self, consumer: Any, settings: Settings, backend: Backend) -> None:
        self.consumer = consumer
        self.guards = Guards(settings)
        # without a hub, requests go to the pool outside the lock: with prefork's putlocks the
        # pool can block in apply_async until its result thread, which needs the lock to run
        # the completion callbacks, frees a process
        ctx = self.ctx = GateContext(consumer, settings, backend, self.flush_handoffs)
        self.core = WorkerCore(_Surroundings(self), lease_ttl=settings.lease_ttl)
        self.link = BackendLink(ctx, self._wake, self._listening)
        self.masked_url = mask_url(backend.url)
        self.tally = Tally(ctx)
        self.settlements = Settlements(ctx)
        self.outcomes = Outcomes(ctx)
        self.reporting = Reporting(ctx, self.outcomes)
        self.requeue = Requeue(ctx, self.tally)
        self.parking = ParkingLot(ctx, self.settlements, self.tally, self.requeue,
                                  self.reporting)
        self.parking.serve(_Line(self))
        # logs a limit in force we do not declare
        self.limits = LimitWatch(backend, ctx.io.call, ctx.loop.post)
        consumer.semaphore_parking = self.parking  # its doorbell strategy finds it there
        self.original: Callable[[Any], Any] = consumer.on_task_request
        consumer.on_task_request = self.on_task_request
        self._on_connection_lost = consumer.on_connection_error_after_connected
        consumer.on_connection_error_after_connected = self.on_connection_lost
        #: Requests to hand to the pool once the commands of an event are carried out: with
        #: prefork's putlocks the pool can block in apply_async, and a pool that runs a
        #: request as it is handed one (solo) calls its callbacks from inside.
        self.handoffs: Deque[Any] = deque()
        #: The scheduled acquire attempt of each waiting claim (a timer of the loop's or the
        #: I/O thread's), and the claims watched for wake-ups through the backend's listener
        #: (a backend without an event-loop link).
        self.attempts: Dict[int, Any] = {}
        self.watched: Dict[int, str] = {}
        #: The pool job of each request handed to the pool (a strong reference: the request's
        #: own is weak, the thread pool keeps none, and a reconnect's flush drops the pool's).
        self.jobs: Dict[int, Any] = {}
        #: Orphans' jobs (claim id -> billiard's job id, the pool process it was written to),
        #: and billiard job id -> pid of the child that acknowledged it, for jobs no longer in
        #: the pool's cache (:func:`.celery_internals.watch_job_acks`; None: not watched),
        #: and the ids of such jobs a child reported done (their task ran to its end).
        self.orphans: Dict[int, Tuple[Any, Any]] = {}
        self.acked: Optional[Dict[int, int]] = None
        self.finished: Dict[int, bool] = {}
        self._connected_at_stop = False
        self._flushing = False
        #: the backend closes a semaphore for a Backoff's time (else: a countdown)
        self._pauses = "pause" in backend.traffic_options
        #: semaphore -> the calls given back by a Backoff that wait for its pauses to reach
        #: the backend (being made, or retried while the backend does not answer)
        self._pausing: Dict[str, List[core.Redeliver]] = {}
        #: semaphore -> how many of its pauses are being made (the calls above wait for all)
        self._pauses_made: Counter[str] = Counter()
        #: semaphore -> the acquire attempts (by claim) held back while its pause is being
        #: made: a call sent meanwhile must not be admitted before the pause lands either
        self._held_attempts: Dict[str, Dict[int, Tuple[Claim, str, int, bool]]] = {}
        self._warned_pause = False
        self._rejects: List[Callable[[], Any]] = []
        self._tick_timer: Any = None
        self._children: Dict[int, Any] = {}  # pid -> what watches its exit
        self._carry_out: Dict[type, Callable[[Any], None]] = {
            core.Start: self._start, core.Exit: self._exit,
            core.SendAttempt: self._send_attempt, core.StopAttempts: self._stop_attempts,
            core.Cancel: self._cancel, core.Release: self._release,
            core.Pause: self._pause, core.Redeliver: self._redeliver,
            core.GiveBackGrant: self._give_back_grant, core.Renew: self._renew,
            core.LeaseLost: self._lease_lost, core.WatchChild: self._watch_child,
            core.Dropped: self._dropped, core.Settle: self._settle,
            core.RaisePrefetch: lambda _: consumer.qos.increment_eventually(),
            core.LowerPrefetch: lambda _: consumer.qos.decrement_eventually(),
            core.ReportWaiting: lambda c: self.reporting.waiting(c.claim, c.position, c.limit,
                                                                 until=c.until),
            core.Refill: lambda c: self.parking.refill(c.name),
        }

    @property
    def backend(self) -> Backend:
        return self.ctx.backend

    @property
    def running(self) -> bool:
        """Leases are kept and released (the worker has not shut down)."""
        return self.ctx.running

    def snapshot(self) -> Dict[str, Any]:
        """What ``celery semaphore workers`` shows of this worker (the loop thread: Celery runs
        remote-control commands there)."""
        with self.ctx.loop.entered():
            return snapshot(list(self.core.waiters.values()), list(self.core.held.values()),
                            self.parking.parked_total, self.parking.pulled_total)

    # -- 1. Celery hands a request over ------------------------------------------------------

    def on_task_request(self, request: Any) -> None:
        self.settlements.watch(getattr(request.message, "channel", None))
        with self.ctx.loop.entered():
            self._admit(request)

    def _admit(self, request: Any) -> None:
        try:
            guard = self.guards.resolve(request)
            check_gate_headers(request, guard is not None, self.consumer)
        except SemaphoreError as exc:
            return self.outcomes.fail(request, exc)
        except Exception as exc:  # a poison message fails its own task, never the worker
            return self.outcomes.fail(request, ConfigurationError(
                f"task {request.name}: cannot resolve its semaphore: "
                f"{type(exc).__name__}: {exc}"))
        self._track(request)
        if guard is None:
            self.handle(Arrived(request, None))
            return
        pulled = PARKED_HEADER in (request.message.headers or {})
        # (only this worker marks a message to queue in front, never a header: it can be
        # forged by any producer)
        front = getattr(request.message, FRONT, False) is True
        self.handle(Arrived(request, guard, new_holder_id(request.id), pulled, front))

    def _track(self, request: Any) -> None:
        """Wrap the request's pool callbacks: each ending goes to the core (on the loop
        thread: prefork calls them there; the thread pool from its threads, posted)."""
        on_success, on_failure, on_timeout = (request.on_success, request.on_failure,
                                               request.on_timeout)

        def success(*args: Any, **kwargs: Any) -> Any:
            try:
                return on_success(*args, **kwargs)
            finally:
                self.ended(request)

        def failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
            if isinstance(exc, Backoff) and getattr(request, CLAIM, None) is not None \
                    and getattr(request, CLAIM).guarded:
                # not a failure (it is a Celery Ignore: the child stored nothing): the call
                # goes back to wait, without Celery settling its message
                self.backed_off(request, exc)
                return None
            try:
                return on_failure(exc_info, *args, **kwargs)
            finally:
                self.ended(request, exc, failed=True)

        def time_limit(soft: bool, timeout: float) -> Any:  # billiard passes timeout=...
            try:
                return on_timeout(soft, timeout)
            finally:
                if not soft:  # the gevent pool never calls on_failure for a hard limit
                    self.ended(request, TimeLimitExceeded(timeout))

        request.on_success, request.on_failure, request.on_timeout = success, failure, time_limit

    # -- 2. events in, commands out ----------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Give ``event`` to the core and carry out what it says (loop thread); then hand
        what it granted to the pool."""
        self.run(self.core.handle(event))
        if self.ctx.loop.owned:  # (else once the lock is released: GateContext)
            self.flush_handoffs()

    def run(self, commands: List[Command]) -> None:
        for command in commands:
            try:
                self._carry_out[type(command)](command)
            except Exception:  # one failed command must not keep the others from running
                logger.exception("celery-semaphore: carrying out %r failed", command)

    def _send_attempt(self, command: core.SendAttempt) -> None:
        claim = command.claim
        self._stop_attempts(command)
        if not self.link.pushes and id(claim) not in self.watched:
            self._watch(claim)
        if command.delay > 0:
            self.attempts[id(claim)] = self._later(command.delay, self._acquire, claim,
                                                   command.holder, command.sent, command.ahead)
        else:
            self._acquire(claim, command.holder, command.sent, command.ahead)

    def _acquire(self, claim: Claim, holder: str, sent: int, ahead: bool) -> None:
        """Make acquire attempt ``sent`` of ``claim`` as ``holder``."""
        self.attempts.pop(id(claim), None)
        if claim.state not in (State.QUEUED, State.AHEAD):
            return
        guard = claim.guard
        for name in guard.names if self._pausing else ():
            if name in self._pausing:  # its pause has not reached the backend yet
                self._held_attempts.setdefault(name, {})[id(claim)] = (claim, holder, sent,
                                                                       ahead)
                return
        wait = claim.waits and not ahead
        requested_at = time.monotonic()
        meta = {**self.meta(claim), FIRST_WAIT_META: claim.first_wait}
        ttl = guard.settings.lease_ttl
        op = (AcquireAll(guard.pairs, holder, ttl, meta, wait) if guard.multi else
              Acquire(guard.name, holder, guard.limit, ttl, meta, wait, self.link.pushes))

        def answered(attempt: Any, error: Optional[BaseException]) -> None:
            pause = 0.0
            if attempt is not None and attempt.grant is None:
                pause = self.backend.pause_after(attempt, guard.settings.poll_interval)
            self.handle(Answered(claim, Answer(holder, attempt, error, requested_at, sent,
                                               pause)))
            if attempt is not None:
                self.limits.saw(guard, attempt)

        self.link.submit(op, answered)

    def _stop_attempts(self, command: Any) -> None:
        timer = self.attempts.pop(id(command.claim), None)
        if timer is not None:
            timer.cancel()
        if not isinstance(command, core.SendAttempt) and command.claim.state is not State.QUEUED:
            self._unwatch(command.claim)

    def _watch(self, claim: Claim) -> None:
        """A backend without an event-loop link wakes ``claim`` through its listener."""
        holder = claim.holder
        self.watched[id(claim)] = holder
        for name in claim.names:  # a multi-semaphore request waits in any one's queue
            self.backend.watch(name, holder, functools.partial(
                self.ctx.loop.post, self._wake, name, holder, None))

    def _unwatch(self, claim: Claim) -> None:
        holder = self.watched.pop(id(claim), None)
        if holder is not None:
            for name in claim.names:
                self.backend.unwatch(name, holder)

    def _wake(self, name: str, holder: str, pushed: Optional[PushedGrant]) -> None:
        """A wake-up (with a grant, or not) for a waiter of this worker (loop thread)."""
        claim = self.core.waiters.get(holder)
        if claim is None:
            return  # it left (its cancel releases a pushed grant)
        self.handle(Pushed(claim, pushed) if pushed is not None else core.Woken(claim, holder))

    def _listening(self) -> None:
        """The wake-up channel is back after it was lost: what it carried meanwhile is lost,
        so every waiter tries once more now."""
        for claim in list(self.core.waiters.values()):
            if claim.state is State.QUEUED:
                self.handle(core.Woken(claim, claim.holder))

    def _cancel(self, command: core.Cancel) -> None:
        self._perform_until(Abandon(command.names, command.holder), command.until,
                            f"leaving the queue of {command.names[0]!r}")

    def _release(self, command: core.Release) -> None:
        for name in command.names:
            self._perform_until(Release(name, command.holder, command.outcome, command.latency),
                                command.until, f"releasing {name!r} ({command.holder})")

    def _perform_until(self, op: Any, until: float, what: str,
                       retry: float = 0.0) -> None:
        """Make ``op``; while the backend does not answer, again (0.1 s doubling to 2 s)
        until ``until`` (monotonic): the backend's expiry frees what it holds then. A call the
        loop's link dropped as it closed (the consumer stops: :class:`.LinkClosed`) is made
        again at once, through the gate's thread, and nothing is logged: the backend did not
        fail (a worker that stops right after a task ended still releases its slot)."""

        def done(result: Any, error: Optional[BaseException]) -> None:
            if error is None:
                return
            if isinstance(error, LinkClosed) and self.ctx.running:
                self._perform_until(op, until, what, retry)
                return
            delay = min(max(retry * 2, core.RETRY_FIRST), core.RETRY_MAX)
            if self.ctx.running and time.monotonic() + delay < until:
                if not retry:
                    logger.warning("celery-semaphore: %s failed, retrying until the backend "
                                   "answers: %s", what, error)
                self._later(delay, self._perform_until, op, until, what, delay)
            else:
                logger.warning("celery-semaphore: %s failed (the backend's expiry frees it): "
                               "%s", what, error)

        self.link.submit(op, done)

    def _give_back_grant(self, command: core.GiveBackGrant) -> None:
        """Release a grant the pool had no process for, then tell the core (a release the
        backend did not answer goes on being tried, and the claim waits as another holder)."""
        claim, holder = command.claim, command.holder
        answers: List[bool] = []

        def done(name: str, result: Any, error: Optional[BaseException]) -> None:
            answers.append(error is None)
            if error is not None:
                self._perform_until(Release(name, holder), command.until,
                                    f"giving back a grant of {holder}")
            if len(answers) == len(command.names):
                self.handle(core.GrantReturned(claim, all(answers),
                                               new_holder_id(claim.request.id)))

        for name in command.names:
            self.link.submit(Release(name, holder), functools.partial(done, name))

    def _renew(self, command: core.Renew) -> None:
        claim, sent = command.claim, time.monotonic()
        replies: List[Tuple[Any, Optional[BaseException]]] = []

        def done(expires: Any, error: Optional[BaseException]) -> None:
            replies.append((expires, error))
            if len(replies) < len(command.names):
                return
            error = next((e for _, e in replies if e is not None), None)
            held = error is None and all(r is not None for r, _ in replies)
            if error is not None and time.monotonic() < claim.deadline:
                logger.warning("celery-semaphore: renewing the lease of %s failed, retrying: %s",
                               claim.request.id, error)
            self.handle(core.Renewed(claim, sent, held, error))

        for name in command.names:
            self.link.submit(Renew(name, command.holder, command.ttl), done)

    def _lease_lost(self, command: core.LeaseLost) -> None:
        claim = command.claim
        policy = claim.guard.settings.on_lost_lease
        grant = next(iter((claim.grants or {}).values()), None)
        logger.error("celery-semaphore: task %s lost its slot of %r (token %s); policy: %s",
                     claim.request.id, claim.names[0] if claim.names else "?",
                     grant.token if grant is not None else "?", policy)
        if policy == "terminate":
            claim.request.terminate(self.consumer.pool, signal="SIGTERM")

    def meta(self, claim: Claim) -> Dict[str, Any]:
        """What the backend stores with a holder or a waiter (``celery semaphore status``)."""
        request, guard = claim.request, claim.guard
        meta = {"task_id": request.id, "task": request.name,
                "worker": self.consumer.hostname, "pid": os.getpid()}
        if guard.fair is not None:
            meta[FAIR_KEY] = guard.fair
        meta.update(guard.traffic_meta(front=claim.front))
        return meta

    def _later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop thread in ``delay`` seconds; the timer (cancel())."""
        hub = self.ctx.loop.hub
        if self.ctx.loop.owned and hub is not None and self.ctx.open:
            return hub.call_later(delay, fn, *args)
        return self.ctx.io.call(self.ctx.loop.post, fn, *args, delay=delay)

    # -- 3. granted: to the pool -------------------------------------------------------------

    def _start(self, command: core.Start) -> None:
        claim = command.claim
        request = claim.request
        setattr(request, CLAIM, claim)
        if claim.grants is not None:
            if request.revoked():  # by id, by stamped header or expired: announced and acked
                self.handle(core.Ended(claim))
                return
            request.request_dict[LEASE_KEY] = lease_record_of_grants(
                claim.grants, claim.limits or {}, claim.holder, self.masked_url,
                self.backend.key_prefix,
                waited=claim.attempts > 0,  # WAITING was stored: the task stores STARTED
                granted=claim.granted_since)
            self._unwatch(claim)
        self.handoffs.append(request)

    def flush_handoffs(self) -> None:
        """Hand granted and unguarded requests to the pool (after the core's commands: the
        pool may call back at once)."""
        if self._flushing or not self.handoffs:
            return  # (a pool that runs a request as it is handed one calls back from inside)
        if self.acked is None and celery_internals.watch_job_acks(
                self.consumer.pool, self._job_acked, self._job_ended):
            self.acked = {}
        self._flushing = True
        try:
            self._hand_over()
        finally:
            self._flushing = False

    def _hand_over(self) -> None:
        while self.handoffs:
            request = self.handoffs.popleft()
            self.original(request)
            claim = getattr(request, CLAIM, None)
            if claim is not None and claim.state is State.POOL:
                job = celery_internals.pool_job(request)
                if job is None and not celery_internals.pool_forks(self.consumer.pool):
                    # the thread pool keeps no reference to its job: it runs, whatever
                    # happens to the broker connection (no flush drops it)
                    job = celery_internals.RUNS_ONCE_HANDED
                self.jobs[id(request)] = job

    # -- 4. ended: the release ---------------------------------------------------------------

    def ended(self, request: Any, exc: Optional[BaseException] = None,
              failed: bool = False) -> None:
        """``request`` ended (a pool callback, any thread)."""
        if self.ctx.loop.owned and not self.ctx.loop.on_loop():
            self.ctx.loop.post(self.ended, request, exc, failed)
            return
        if self.ctx.loop.hub is not None:
            # The freed child takes its next job (queued in the pool) now, not at the loop's
            # next turn, after the release below is sent and its answer read: the handoff
            # of a task whose slot the worker holds ahead costs no backend round trip.
            try:
                celery_internals.write_queued_jobs(self.consumer.pool, self.ctx.loop.hub)
            except Exception:  # the loop writes it at its next turn, as without this
                logger.warning("celery-semaphore: writing a queued job to a free pool "
                               "process failed", exc_info=True)
        with self.ctx.loop.entered():
            claim = getattr(request, CLAIM, None)
            self.jobs.pop(id(request), None)
            if claim is None:
                return
            pid = request.worker_pid
            exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
            killed = (pid if isinstance(exc, celery_internals.CHILD_KILLED) and pid
                      and celery_internals.pool_forks(self.consumer.pool) else None)
            outcome = None
            if claim.guarded:
                outcome = outcome_of(exc if failed else None, claim.guard.adaptive)
            self.handle(core.Ended(claim, killed, outcome))

    def backed_off(self, request: Any, exc: Backoff) -> None:
        """``request``'s task raised ``exc`` (a pool callback, any thread)."""
        if self.ctx.loop.owned and not self.ctx.loop.on_loop():
            self.ctx.loop.post(self.backed_off, request, exc)
            return
        with self.ctx.loop.entered():
            self.jobs.pop(id(request), None)
            claim = getattr(request, CLAIM, None)
            if claim is not None:
                self.handle(core.BackedOff(claim, exc.remaining(), exc.reason,
                                           paused=bool(getattr(exc, "paused", False)),
                                           unstarted=bool(getattr(exc, "unstarted", False))))

    def _pause(self, command: core.Pause) -> None:
        """Close a semaphore cluster-wide (a Backoff's time): made before the release that
        follows it (the same pipeline), so that no grant is pushed meanwhile. A backend that
        cannot pause: the call waits out its time in the broker (:meth:`_redeliver`)."""
        if not self._pauses:
            if not self._warned_pause:
                self._warned_pause = True
                logger.warning("celery-semaphore: the %s backend cannot pause a semaphore "
                               "cluster-wide: a call given back by a Backoff is requeued "
                               "with its time as a countdown, and other calls go on",
                               type(self.backend).__name__)
            return

        name, ends = command.name, time.monotonic() + command.seconds
        self._pausing.setdefault(name, [])
        self._pauses_made[name] += 1

        def attempt(retry: float) -> None:
            """Pause for what is left of the time; while the backend does not answer, again
            (0.1 s doubling to 2 s) until the time is up. The calls given back meanwhile wait
            here (:meth:`_redeliver`): none of them may be admitted before the pause."""
            left = ends - time.monotonic()
            if left <= 0 or not self.ctx.running:
                return finish()

            def done(until: Any, error: Optional[BaseException]) -> None:
                if error is None:
                    logger.info("celery-semaphore: semaphore %r paused for %.1fs%s", name,
                                left, f" ({command.reason})" if command.reason else "")
                    return finish()
                delay = min(max(retry * 2, core.RETRY_FIRST), core.RETRY_MAX)
                if self.ctx.running and time.monotonic() + delay < ends:
                    if not retry:
                        logger.warning("celery-semaphore: pausing %r failed, retrying until "
                                       "the backend answers (the calls it gave back wait): "
                                       "%s", name, error)
                    self._later(delay, attempt, delay)
                    return
                logger.warning("celery-semaphore: pausing %r for %.1fs failed: %s", name,
                               left, error)
                finish()

            self.link.submit(Pause(name, left, command.reason), done)

        def finish() -> None:
            """This pause is made, or given up: once every pause of the semaphore is, the
            calls held for them go on, each once (two Backoffs of one semaphore in a backend
            outage make two pauses: before, each one's end handed every held call to Celery
            again, and each ran twice)."""
            self._pauses_made[name] -= 1
            if self._pauses_made[name] > 0:
                return
            del self._pauses_made[name]
            for redeliver in self._pausing.pop(name, []):
                self._redeliver(redeliver)
            for attempt_args in self._held_attempts.pop(name, {}).values():
                self._acquire(*attempt_args)

        attempt(0.0)

    def _redeliver(self, command: core.Redeliver) -> None:
        """Hand the message of a call a Backoff gave back to its task's strategy again: a new
        request of it reaches the gate and queues ahead of later arrivals, its first wait
        kept (``semaphore_max_wait`` bounds the whole). Its message is settled by the new
        request as it would have been by the old one (acknowledged already, unless the task
        acknowledges late)."""
        claim = command.claim
        old = claim.request
        if not self._pauses and command.seconds:
            self.requeue.requeue(claim, command.seconds)
            return
        waiting = self._pausing.get(claim.guard.name)
        if waiting is not None:  # its pause has not reached the backend yet
            waiting.append(command)
            return
        message = old.message
        celery_internals.task_ready(old)
        strategy = self.consumer.strategies.get(old.name)
        if strategy is None:  # (the task went away with a reload?) it cannot run here
            logger.error("celery-semaphore: %s[%s] backed off and cannot be given back: its "
                         "task is not registered here", old.name, old.id)
            return
        headers = message.headers
        if isinstance(headers, dict):
            headers[FIRST_WAIT_HEADER] = claim.first_wait
        setattr(message, FRONT, True)
        settled = old.acknowledged

        def ack(*args: Any, **kwargs: Any) -> None:
            if not settled:
                old._on_ack(*args, **kwargs)

        def reject(*args: Any, **kwargs: Any) -> None:
            if not settled:
                old._on_reject(*args, **kwargs)

        logger.info("celery-semaphore: %s[%s] backed off: it waits again, ahead of later "
                    "arrivals", old.name, old.id)
        try:
            strategy(message, None, ack, reject, self.consumer.on_task_message)
        except Exception:
            logger.exception("celery-semaphore: giving back %s[%s] failed", old.name, old.id)

    def _watch_child(self, command: core.WatchChild) -> None:
        """Tell the core when pool child ``pid`` has exited: a pidfd the hub watches (Linux),
        else a look every 5 ms on the I/O thread."""
        pid = command.pid
        if pid in self._children:
            return
        hub = self.ctx.loop.hub
        if hub is not None and self.ctx.loop.owned and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.handle(core.ChildExited(pid))
                return
            except OSError:
                fd = -1
            if fd >= 0:
                self._children[pid] = fd
                hub.add_reader(fd, self._child_exited, pid)
                return
        self._children[pid] = None
        self.ctx.io.call(self._poll_child, pid)

    def _poll_child(self, pid: int) -> None:  # I/O thread
        if self.ctx.running and celery_internals.process_alive(pid):
            self.ctx.io.call(self._poll_child, pid, delay=0.005)
            return
        self.ctx.loop.post(self._child_exited, pid)

    def _child_exited(self, pid: int) -> None:
        fd = self._children.pop(pid, None)
        if fd is not None:
            self.ctx.loop.hub.remove(fd)
            os.close(fd)
        self.handle(core.ChildExited(pid))

    # -- other ways out ----------------------------------------------------------------------

    def _exit(self, command: core.Exit) -> None:
        claim, how = command.claim, command.how
        request = claim.request
        self._unwatch(claim)
        if how is How.FAIL:
            assert command.error is not None
            self.outcomes.fail(request, command.error)
        elif how is How.FULL:
            self.outcomes.full(request, claim.guard, command.limit, command.blocking)
        elif how is How.PARK:
            self.parking.park(claim, command.why)
        elif how is How.REQUEUE:
            self.requeue.requeue(claim)
        elif how is How.GIVE_BACK:
            self._give_back(claim)
        elif how is How.LET_GO:
            request.acknowledged = True  # its message is back in the broker
            celery_internals.task_ready(request)
        # How.REVOKED: Celery announced, stored and acked it

    def _give_back(self, claim: Claim) -> None:
        """The consumer stops with ``claim`` still waiting: its message goes back to the
        broker (:meth:`stop`)."""
        request = claim.request
        if claim.pulled:
            self.parking.give_back(claim)
        elif self._connected_at_stop and not claim.detached:
            # rejected once stop() has carried out the core's commands
            self._rejects.append(functools.partial(request.reject, requeue=True))
        else:
            request.acknowledged = True  # nothing to settle on this channel
        celery_internals.task_ready(request)

    def _dropped(self, command: core.Dropped) -> None:
        request = command.claim.request
        self.parking.dropped_by_pool(request)
        if command.claim.grants is not None:
            logger.warning("celery-semaphore: %s was dropped by the pool on a broker reconnect "
                           "before any child got it; releasing its slot", request.id)

    def _settle(self, command: core.Settle) -> None:
        claim = command.claim
        job_id, _ = self.orphans.pop(id(claim), (None, None))
        if self.acked is not None:
            self.acked.pop(job_id, None)
        self.finished.pop(job_id, None)
        logger.info("celery-semaphore: settled %s (its job went to pool child %s, which %s): %s",
                    claim.request.id, claim.child,
                    "exited or never started it" if command.requeue else
                    "ran it to its end" if command.ran else "moved on",
                    "put back in its queue" if command.requeue else "acknowledged")
        self.settlements.settle_kept(claim.request.message,
                                     Settle.REQUEUE if command.requeue else Settle.ACK)

    # -- lifecycle (consumer bootstep) -------------------------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        hub = getattr(self.consumer, "hub", None)
        ctx.loop.start(hub)
        if ctx.state is GateState.NEW:
            signals.task_revoked.connect(self._on_task_revoked, weak=False)
        ctx.state = GateState.OPEN
        self.link.start(hub)
        if self._tick_timer is not None:  # the I/O thread's, while paused
            self._tick_timer.cancel()
        self._schedule_tick()
        ctx.loop.post(self.parking.refill_all)  # what a reconnect gave back

    def stop(self) -> None:
        """The consumer stops (shutdown or reconnect): give waiting requests back.

        With the broker connection still open they are rejected for redelivery. Once it is
        closed or lost, the broker has them back already (AMQP requeues a closed channel's
        unacked messages, kombu's virtual transports restore them when the channel closes,
        and :meth:`on_connection_lost` restores those of a Redis broker), and a reject on the
        dead channel would only log a CRITICAL traceback per request. Requests pulled from
        the waiting room are settled on the parking channel instead (:meth:`.ParkingLot.
        give_back`), and their semaphores are pulled again once the consumer runs. Jobs the
        pool's flush dropped go to the core (:class:`.PoolFlushed`)."""
        self._rejects = []
        with self.ctx.loop.entered():
            if self.ctx.state is GateState.OPEN:
                self.ctx.state = GateState.PAUSED  # pulls still on their way go back
            connected = self._connected_at_stop = celery_internals.consumer_connected(
                self.consumer)
            waiting = list(self.core.waiters.values())
            if not connected and waiting:
                logger.info("celery-semaphore: the broker connection is closed with %d tasks "
                            "waiting for a slot; the broker delivers them again", len(waiting))
            self.handle(core.Stop())
            pulled = sum(1 for claim in waiting if claim.pulled)
            if not connected and pulled:  # given back on the parking connection, which the
                # lost connection reset (ParkingLot.reset): they land once the broker answers
                logger.info("celery-semaphore: %d tasks that were waiting when the broker "
                            "connection was lost go back to their queue", pulled)
            bells = self.parking.let_go_of_bells()
            if connected:
                self._rejects += [functools.partial(m.reject, requeue=True) for m in bells]
            self.handle(core.PoolFlushed(self._flushed()))
            self.link.stop()
            if self._tick_timer is not None:
                self._tick_timer.cancel()
                self._tick_timer = None
        rejects, self._rejects = self._rejects, []
        for reject in rejects:  # the consumer's channel: this (the loop) thread's
            try:
                reject()
            except Exception as exc:  # the broker redelivers it all the same
                logger.debug("celery-semaphore: giving back a message on stop failed: %s",
                             exc)
        self.ctx.loop.stop()

    def _flushed(self) -> Tuple[Tuple[Claim, Optional[int]], ...]:
        """The claims in the pool whose job the pool's flush on a broker reconnect dropped,
        each with the child it was being written to (None: no child got it). A prefork pool
        drops the jobs no child has acknowledged, and their callbacks never run."""
        out = []
        for claim in list(self.core.in_pool.values()):
            if claim.state is not State.POOL:
                continue
            request = claim.request
            job = self.jobs.get(id(request))
            child = celery_internals.dropped_job_child(self.consumer, request, job)
            if child is False:
                continue
            self.jobs.pop(id(request), None)
            pid = None
            if child is not None:
                self.orphans[id(claim)] = (getattr(job, "_job", None), child)
                facts = self._orphan_child(claim)
                pid = facts.pid if facts is not None and facts.pid else child.pid
                logger.warning("celery-semaphore: %s runs in pool child %s without callbacks "
                               "after a broker reconnect; %sits message is settled when that "
                               "child moves on", request.id, pid,
                               "its slot is released and " if claim.grants else "")
            out.append((claim, pid))
        return tuple(out)

    def _job_acked(self, job_id: int, pid: int) -> None:
        """Pool child ``pid`` acknowledged job ``job_id``, which the pool's cache has no more
        (the loop thread: billiard's result handler)."""
        if self.acked is not None:
            self.acked[job_id] = pid
            if len(self.acked) > 10_000:  # the oldest, of an orphan long settled or gone
                del self.acked[next(iter(self.acked))]

    def _job_ended(self, job_id: int) -> None:
        """A pool child reported job ``job_id`` done, which the pool's cache has no more (the
        loop thread: billiard's result handler)."""
        self.finished[job_id] = True
        if len(self.finished) > 10_000:  # the oldest, of an orphan long settled or gone
            del self.finished[next(iter(self.finished))]

    def _orphan_child(self, claim: Claim) -> Optional[ChildFacts]:
        """:meth:`.Surroundings.orphan_child`: the child that acknowledged the job, else the
        one that reads the pipe it was written to (a job is written to a child the pool has
        not yet seen exit, and the flush that drops it reaps that child: its replacement runs
        the job). Without acks to go by (another pool), the child it was written to."""
        job_id, written_to = self.orphans.get(id(claim), (None, None))
        if written_to is None:
            return self._child(claim.child or 0)
        pid = (self.acked or {}).get(job_id) if job_id is not None else None
        if job_id is not None and job_id in self.finished:  # whatever became of the child
            return self._child(pid or written_to.pid)._replace(took_job=True, ran_job=True)
        if pid is not None:
            return self._child(pid)._replace(took_job=True)
        if self.acked is None or job_id is None:
            return self._child(written_to.pid)
        reader = celery_internals.pipe_reader(self.consumer.pool, written_to)
        if reader is None:  # the pool destroyed the pipe, the job unread with it
            return ChildFacts(written_to.pid, False, False, False, took_job=False)
        if reader is celery_internals.PIPE_WAITS:
            return None
        facts = self._child(reader.pid)._replace(took_job=False)  # (not yet, at least)
        # a dead child not reaped yet: celery's maintain_pool runs every 5 s at least
        return facts if facts.alive else None

    def _child(self, pid: int) -> ChildFacts:
        alive = celery_internals.process_alive(pid)
        return ChildFacts(pid, alive, alive and celery_internals.runs_in_child(pid),
                          alive and celery_internals.child_is_up(self.consumer.pool, pid))

    def on_connection_lost(self, exc: BaseException) -> Any:
        """Wraps the consumer's ``on_connection_error_after_connected``.

        Closing the lost connection makes kombu's Redis transport restore every unacked
        message through a transport it has already detached (kombu 5.7 raises AttributeError
        there, and the worker exits). Waiting requests are such messages: take them out of
        the channel's unacked set first (they stay in the broker's unacked hash) and put them
        back in their queue, with the transport's own restore, once the broker answers.
        Messages pulled from the waiting room and not settled yet (waiting, or dropped by the
        pool's flush with no callback) go back to their parking queues the same way
        (:meth:`.ParkingLot.reset`)."""
        with self.ctx.loop.entered():
            waiting = list(self.core.waiters.values())
            detached = [c for c in waiting
                        if not c.pulled and celery_internals.detach_unacked(c.request.message)]
            for claim in detached:
                claim.detached = True
            bells = [m for m in self.parking.held_bells() if celery_internals.detach_unacked(m)]
            # (the pulled ones are given back by the parking lot: ParkingLot.reset)
            # and whatever else is unacked on the task channel: requests Celery holds and
            # forgets on the reconnect go back; tasks that left for the pool (acknowledged
            # late, or whose ack the broker did not take) are settled as they end
            # (Settlements): closing the lost connection would restore them all through a
            # detached transport, and run them twice
            self._refresh_jobs()
            jobs = {key: (self.core.in_pool[key].request, job)
                    for key, job in self.jobs.items() if key in self.core.in_pool}
            handed = celery_internals.handed_to_pool(jobs) | {
                r.message.delivery_tag for r in self.handoffs} | self.ctx.in_transit
            channel = celery_internals.task_channel(self.consumer)
            # doorbells fetched by the consumer that the gate has not taken yet
            arriving = celery_internals.unacked_of_task(channel, DOORBELL_TASK)
            others = self.settlements.detach(channel, handed)
            # received as the connection went, with no record in the broker (the append
            # failed): put back from the channel's own copy
            copies = celery_internals.unrecorded_copies(channel, others)
        tags = ([c.request.message.delivery_tag for c in detached]
                + [m.delivery_tag for m in bells] + others)
        if tags:
            self.ctx.io.call(self.restore_detached, tags, core.RETRY_FIRST, len(detached),
                             len(bells) + len(arriving.intersection(others)), copies)
        self.ctx.io.call(self.parking.reset)
        return self._on_connection_lost(exc)

    def _refresh_jobs(self) -> None:
        """Take a strong reference to the pool job of every request handed to the pool whose
        job did not exist yet when it was handed: with every process busy, prefork's consumer
        holds a request in Celery's worker semaphore and applies it once a process frees.
        Called when the broker connection is lost, before the pool's flush drops the jobs no
        child accepted."""
        for key, claim in self.core.in_pool.items():
            if self.jobs.get(key) is None:
                live = celery_internals.pool_job(claim.request)
                if live is not None:
                    self.jobs[key] = live

    def restore_detached(self, tags: List[str], retry: float = core.RETRY_FIRST,
                         waiting: int = 0, doorbells: int = 0,
                         copies: Optional[celery_internals.Copies] = None) -> None:  # I/O
        """Put messages detached by :meth:`on_connection_lost` back in their queue, retrying
        until the broker answers (or the worker stops: then the transport's visibility
        timeout restores them). ``waiting``: how many of them were requests waiting for a
        slot, ``doorbells``: how many were doorbells this worker held or had just received;
        the others are requests Celery held and had not handed to the pool (those it had
        stay: :class:`.Settlements`). ``copies``: those received as the connection went whose
        record in the broker failed, put back from these copies where the broker has no
        record (:func:`.celery_internals.restore_unacked`)."""
        try:
            celery_internals.restore_unacked(self.ctx.app, tags, copies)
        except Exception as exc:
            if self.ctx.running:
                self.ctx.io.call(self.restore_detached, tags, min(retry * 2, core.RETRY_MAX),
                                 waiting, doorbells, copies, delay=retry)
            else:
                logger.warning("celery-semaphore: %d tasks stay unacknowledged in the broker "
                               "until its visibility_timeout restores them: %s", len(tags), exc)
            return
        if waiting:
            logger.info("celery-semaphore: %d tasks that were waiting when the broker "
                        "connection was lost are back in their queue", waiting)
        if doorbells:
            logger.info("celery-semaphore: %d doorbells held or arriving when the broker "
                        "connection was lost are back in their queue", doorbells)
        if len(tags) > waiting + doorbells:
            logger.info("celery-semaphore: %d tasks not handed to the pool yet, not "
                        "acknowledged when the broker connection was lost, are back in their "
                        "queue (delivered again)", len(tags) - waiting - doorbells)

    def shutdown(self) -> None:
        """The worker exits: release every lease still held, then stop the I/O thread."""
        self.stop()
        signals.task_revoked.disconnect(self._on_task_revoked)
        with self.ctx.loop.entered():
            commands = self.core.shutdown()
            self.ctx.state = GateState.CLOSED
            self.run(commands)
            self.tally.flush()
        io = self.ctx.io
        io.call(self.parking.close)  # after the acks and rejects already on their way
        io.call(self.settlements.final_flush)
        io.stop()
        close_all()  # this process's backends: wake-up listeners, connections, socket files

    # -- the tick: bounds, renewals, revocations ---------------------------------------------

    def _schedule_tick(self) -> None:
        every = self.core.tick_every(self.ctx.settings.poll_interval)
        self._tick_timer = self._later(every, self._tick)

    def _tick(self) -> None:
        self._tick_timer = None
        if not self.ctx.running:
            return
        with self.ctx.loop.entered():
            for claim in list(self.core.waiters.values()):
                if claim.request.revoked():  # Celery's own test: announces and acks it
                    self.handle(core.Revoked(claim))
            self.handle(Tick())
            self.parking.check_tracked()
            self.parking.refill_all()
        if self.ctx.open:
            self._schedule_tick()
        else:  # paused (a reconnect): leases are still renewed, on the I/O thread's timer
            self._tick_timer = self.ctx.io.call(self.ctx.loop.post, self._tick,
                                                delay=self.core.tick_every(
                                                    self.ctx.settings.poll_interval))

    def _on_task_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """Celery revoked (or expired) a request: Celery 5.3 to 5.7 send the task's
        ``Context``, not the worker's ``Request``, so the request is found by its task id."""
        task_id = getattr(request, "id", None)
        if task_id is not None:
            self.ctx.loop.post(self._revoked, task_id)

    def _revoked(self, task_id: str) -> None:
        """The requests of ``task_id`` handed to the pool that Celery revoked before a pool
        process took them: no pool callback comes for them, and their slots go now."""
        for claim in [c for c in self.core.in_pool.values() if c.request.id == task_id]:
            if claim.state is State.POOL and celery_internals.revoked_before_start(
                    claim.request):
                self.handle(core.Ended(claim))


class _Surroundings:
    """What the core reads of this worker: its pool and its waiting room."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def pool_size(self) -> int:
        return celery_internals.pool_size(self.gate.consumer.pool)

    def lookahead(self) -> int:
        if not celery_internals.pool_queues(self.gate.consumer.pool):
            return 0
        return self.gate.ctx.settings.worker_lookahead

    def pulling(self, name: str) -> Tuple[int, int]:
        return self.gate.parking.pulling_counts(name)

    def max_waiting(self) -> int:
        return self.gate.ctx.settings.worker_max_waiting

    def child(self, pid: int) -> ChildFacts:
        return self.gate._child(pid)

    def orphan_child(self, claim: Claim) -> Optional[ChildFacts]:
        return self.gate._orphan_child(claim)

    def held_by_celery(self, request: Any) -> bool:
        return celery_internals.still_held(request)


class _Line:
    """What the waiting room reads of and asks of the core (:class:`.parking.Line`)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def room(self, name: str) -> int:
        return self.gate.core.room(name)

    def short_of_processes(self, name: str) -> bool:
        return self.gate.core.short_of_processes(name)

    def pump(self) -> None:
        self.gate.handle(core.CapacityChanged())

    def waiting(self) -> List[Claim]:
        return list(self.gate.core.waiters.values())

    def let_go(self, claims: List[Claim]) -> None:
        self.gate.handle(core.LetGo(tuple(claims)))


# (the attempts' answers feed the limit watch on the loop: LimitWatch.saw)
_ = (Attempt, MultiAttempt)
