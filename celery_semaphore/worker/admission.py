"""Admission, the shell around the worker core (:mod:`.core`): it feeds the core events and
carries out its commands against the backend, the pool, the consumer and the waiting room.

The core decides (who waits in the line, who enters the backend's queue, what a grant or a
"wait" means, when a request leaves and how); this shell only does: acquire attempts, watches
and cancels on the I/O thread, whose answers come back to the loop thread as events; leases
built from grants; prefetch changes; requests handed to the pool or settled.

A request under several semaphores (:attr:`.Guard.multi`) asks for all of them in each attempt
(:meth:`.Backend.acquire_all`: granted together or not at all, waiting in the queue of the one
that refuses it), watches every one of them for wake-ups and holds a :class:`.LeaseGroup`. It
is counted in the line and the pool-process share of its first semaphore. A request under one
semaphore makes exactly the calls it always made.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Iterable, Protocol, Tuple, Union

from ..backends.base import FAIR_KEY, Attempt, MultiAttempt, new_holder_id
from ..guards import Guard
from ..semaphore import Lease, LeaseGroup
from ..stats import FIRST_WAIT_META
from ..task_lease import LEASE_KEY, lease_record_of
from . import celery_internals
from .context import GateContext
from .core import (
    AdmissionCore,
    Answer,
    Answered,
    Arrived,
    Cancel,
    CapacityChanged,
    Command,
    Event,
    Exit,
    GiveBackGrant,
    GrantReturned,
    How,
    Leave,
    LowerPrefetch,
    RaisePrefetch,
    Refill,
    ReleaseLate,
    ReportWaiting,
    Revoked,
    SendAttempt,
    StopAttempts,
    Tick,
    Unwatch,
    Watch,
    Woken,
)
from .limits import LimitWatch
from .outcomes import Outcomes
from .release import Releases
from .reporting import Reporting
from .requeue import Requeue
from .waiter import Waiter

logger = logging.getLogger(__name__)

__all__ = ["Admission", "Answer"]


class WaitingRoom(Protocol):
    """What admission asks of the waiting room (:class:`.ParkingLot`)."""

    def publishing(self) -> int:
        """Requests being parked: Celery still counts them reserved."""

    def room(self, name: str, waiting_of_name: int, waiting: int) -> int:
        """How many more requests of ``name`` this worker should hold waiting."""

    def park(self, waiter: Waiter, why: str) -> None:
        """Park ``waiter``, which left the core."""

    def refill(self, name: str) -> None:
        """The line of ``name`` has room: pull its parked requests."""


class GateSurroundings:
    """What the core reads of this worker: its pool and its waiting room."""

    def __init__(self, ctx: GateContext, waiting_room: WaitingRoom) -> None:
        self.ctx = ctx
        self.waiting_room = waiting_room

    def free_processes(self, waiting: int) -> int:
        busy = (celery_internals.reserved_count() - waiting
                - self.waiting_room.publishing())
        return celery_internals.pool_size(self.ctx.consumer.pool) - busy

    def room(self, name: str, waiting_of_name: int, waiting: int) -> int:
        return self.waiting_room.room(name, waiting_of_name, waiting)

    def lookahead(self) -> int:
        if not celery_internals.pool_queues(self.ctx.consumer.pool):
            return 0
        return self.ctx.settings.worker_lookahead


class Admission:
    """The waiting requests of one worker and their way to a slot: the core and its shell.
    Loop thread only, except the methods marked I/O."""

    def __init__(self, ctx: GateContext, waiting_room: WaitingRoom, releases: Releases,
                 requeue: Requeue, reporting: Reporting, outcomes: Outcomes,
                 hand_off: Callable[[Any], None], give_back: Callable[[Waiter], None]) -> None:
        """``hand_off``: hands a granted request to the pool (outside the lock);
        ``give_back``: gives a waiter's message back to the broker as the consumer stops."""
        self.ctx = ctx
        self.backend = ctx.backend
        self.waiting_room = waiting_room
        self.releases = releases
        self.requeue = requeue
        self.reporting = reporting
        self.outcomes = outcomes
        self.hand_off = hand_off
        self.give_back = give_back
        self.core = AdmissionCore(GateSurroundings(ctx, waiting_room))
        self.limits = LimitWatch(self.backend)  # logs a limit in force we do not declare
        self._carry_out: Dict[type, Callable[[Any], None]] = {
            Exit: self._exit, Watch: self._watch, Unwatch: self._unwatch,
            SendAttempt: self._send, StopAttempts: self._stop_attempts, Cancel: self._cancel,
            ReleaseLate: self._release_late, GiveBackGrant: self._give_back_grant,
            RaisePrefetch: lambda _: self.ctx.consumer.qos.increment_eventually(),
            LowerPrefetch: lambda _: self.ctx.consumer.qos.decrement_eventually(),
            ReportWaiting: self._report_waiting, Refill: self._refill,
        }

    # -- reading (loop thread) ---------------------------------------------------------------

    @property
    def waiters(self) -> Dict[str, Waiter]:
        return self.core.waiters

    def __len__(self) -> int:
        return len(self.core)

    def count(self, name: str) -> int:
        return self.core.count(name)

    def blocked(self, name: str) -> int:
        return self.core.blocked(name)

    def pool_size(self) -> int:
        return celery_internals.pool_size(self.ctx.consumer.pool)

    # -- events in ---------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        """Give ``event`` to the core and carry out what it says, in order (loop thread)."""
        self.run(self.core.handle(event))

    def run(self, commands: Iterable[Command]) -> None:
        for command in commands:
            try:
                self._carry_out[type(command)](command)
            except Exception:  # one failed command must not keep the others from running
                logger.exception("celery-semaphore: carrying out %r failed", command)

    def arrive(self, request: Any, guard: Guard, pulled: bool) -> None:
        self.handle(Arrived(request, guard, new_holder_id(request.id), pulled))

    def pump(self) -> None:
        self.handle(CapacityChanged())

    def tick(self) -> None:
        """Every poll interval: revoked waiters leave (Celery's own test, which announces and
        acks them), then the core checks its bounds."""
        for waiter in list(self.core.waiters.values()):
            if waiter.request.revoked():
                self.handle(Revoked(waiter))
        self.handle(Tick())

    def leave(self, waiter: Waiter, how: How, why: str = "") -> None:
        self.handle(Leave(waiter, how, why))

    # -- commands out ------------------------------------------------------------------------

    def _exit(self, command: Exit) -> None:
        waiter, how = command.waiter, command.how
        request = waiter.request
        if how is How.START:
            assert command.answer is not None
            self._start(waiter, command.answer)
        elif how is How.FAIL:
            assert command.error is not None
            self.outcomes.fail(request, command.error)
        elif how is How.FULL:
            self.outcomes.full(request, waiter.guard, command.limit, command.blocking)
        elif how is How.PARK:
            self.waiting_room.park(waiter, command.why)
        elif how is How.REQUEUE:
            self.requeue.requeue(waiter)
        elif how is How.GIVE_BACK:
            self.give_back(waiter)
        elif how is How.LET_GO:
            request.acknowledged = True  # its message is back in the broker
            celery_internals.task_ready(request)
        # How.REVOKED: Celery announced, stored and acked it

    def _start(self, waiter: Waiter, answer: Answer) -> None:
        lease = self._lease(waiter, answer)
        request = waiter.request
        if request.revoked():  # by id, by stamped header or expired: announced and acked
            self.ctx.io.call(self.releases.release, lease)
            return
        request.request_dict[LEASE_KEY] = lease_record_of(
            lease, self.backend.url, self.backend.key_prefix,
            waited=waiter.attempts > 0,  # WAITING was stored: the task stores STARTED
        ).to_header()
        self.releases.hold(request, lease, waiter.guard)
        self.hand_off(request)

    def _watch(self, command: Watch) -> None:
        self.ctx.io.call(self._watch_io, command.waiter, command.waiter.holder)

    def _watch_io(self, waiter: Waiter, holder: str) -> None:  # I/O thread
        def woken() -> None:
            self.ctx.loop.post(self.handle, Woken(waiter, holder))

        for name in waiter.guard.names:  # a multi-semaphore request waits in any one's queue
            self.backend.watch(name, holder, woken)

    def _unwatch(self, command: Unwatch) -> None:
        for name in command.waiter.guard.names:
            self.backend.unwatch(name, command.holder)

    def _send(self, command: SendAttempt) -> None:
        waiter = command.waiter
        if waiter.next_attempt is not None:
            waiter.next_attempt.cancel()
        waiter.next_attempt = self.ctx.io.call(self._acquire, waiter, command.holder,
                                               command.sent, command.ahead,
                                               delay=command.delay)

    def _stop_attempts(self, command: StopAttempts) -> None:
        waiter = command.waiter
        if waiter.next_attempt is not None:
            waiter.next_attempt.cancel()
            waiter.next_attempt = None

    def _acquire(self, waiter: Waiter, holder: str, sent: int,
                 ahead: bool = False) -> None:  # I/O thread
        guard = waiter.guard
        wait = waiter.waits and not ahead
        requested_at = time.monotonic()
        meta = {**self.meta(waiter.request, guard), FIRST_WAIT_META: waiter.first_wait}
        try:
            attempt: Union[Attempt, MultiAttempt]
            if guard.multi:
                attempt = self.backend.acquire_all(
                    guard.pairs, holder, ttl=guard.settings.lease_ttl, meta=meta,
                    wait=wait)
            else:
                attempt = self.backend.acquire(
                    guard.name, holder, limit=guard.limit, ttl=guard.settings.lease_ttl,
                    meta=meta, wait=wait)
        except Exception as exc:
            answer = Answer(holder, None, exc, requested_at, sent)
        else:
            pause = (self.backend.pause_after(attempt, guard.settings.poll_interval)
                     if attempt.grant is None else 0.0)
            answer = Answer(holder, attempt, None, requested_at, sent, pause)
        self.ctx.loop.post(self.handle, Answered(waiter, answer))
        if answer.attempt is not None:
            self.limits.saw(guard, answer.attempt)

    def _cancel(self, command: Cancel) -> None:
        self.ctx.io.call(self._cancel_io, command.names, command.holder, command.expires)

    def _cancel_io(self, names: Tuple[str, ...], holder: str, expires: float,
                   retry: float = 0.0) -> None:  # I/O thread
        """Leave the backend's queues of ``names`` and release a grant an attempt may have got
        (its reply lost, or never to be read), retrying until the lease would have expired
        anyway (``expires``, monotonic)."""
        try:
            self.backend.abandon_all(names, holder)
        except Exception as exc:
            self.ctx.retry_io(
                lambda next_retry: self._cancel_io(names, holder, expires, next_retry),
                retry, expires - time.monotonic(), f"leaving the queue of {names[0]!r}", exc)

    def _release_late(self, command: ReleaseLate) -> None:
        if command.answer.holder in self.releases.held:
            return  # that holder runs with this very grant
        self.ctx.io.call(self.releases.release, self._lease(command.waiter,
                                                                  command.answer))

    def _give_back_grant(self, command: GiveBackGrant) -> None:
        self.ctx.io.call(self._give_back_grant_io, command.waiter,
                         self._lease(command.waiter, command.answer))

    def _give_back_grant_io(self, waiter: Waiter,
                            lease: Union[Lease, LeaseGroup]) -> None:  # I/O thread
        """Release a grant the pool had no process for, then tell the core."""
        self.releases.release(lease)
        self.ctx.loop.post(self.handle, GrantReturned(waiter, lease.released,
                                                      new_holder_id(waiter.request.id)))

    def _report_waiting(self, command: ReportWaiting) -> None:
        self.reporting.waiting(command.waiter, command.position, command.limit)

    def _refill(self, command: Refill) -> None:
        self.waiting_room.refill(command.name)

    # -- leases ------------------------------------------------------------------------------

    def _lease(self, waiter: Waiter, answer: Answer) -> Union[Lease, LeaseGroup]:
        attempt = answer.attempt
        assert attempt is not None and attempt.grant is not None
        meta = self.meta(waiter.request, waiter.guard)
        if isinstance(attempt, MultiAttempt):
            return LeaseGroup({
                name: Lease(self.backend, name, answer.holder, grant, answer.requested_at,
                            limit=attempt.limits.get(name), meta=meta)
                for name, grant in (attempt.grants or {}).items()})
        return Lease(self.backend, waiter.guard.name, answer.holder, attempt.grant,
                     answer.requested_at, limit=attempt.limit, meta=meta)

    def meta(self, request: Any, guard: Guard) -> Dict[str, Any]:
        meta = {"task_id": request.id, "task": request.name,
                "worker": self.ctx.consumer.hostname, "pid": os.getpid()}
        if guard.fair is not None:
            meta[FAIR_KEY] = guard.fair
        meta.update(guard.traffic_meta())
        return meta
