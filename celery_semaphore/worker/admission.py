"""Admission: guarded requests wait in the worker's line, then in the backend's queue, until
the semaphore grants them a slot and a pool process is free to run them.

A request enters the backend's waiter queue only while a pool process is free for it (per
semaphore name), so a granted slot never waits for a local pool process; a grant that finds
the pool full after all is given back and the request goes back to the head of the line.

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
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, NamedTuple, Optional, Tuple, Union

from ..backends.base import FAIR_KEY, Attempt, MultiAttempt, new_holder_id
from ..exceptions import ConfigurationError
from ..guards import Guard
from ..semaphore import Lease, LeaseGroup
from ..stats import FIRST_WAIT_META
from ..task_lease import LEASE_KEY, lease_record_of
from . import celery_internals
from .limits import LimitWatch
from .waiter import Waiter, WaitState

if TYPE_CHECKING:
    from .gate import Gate

logger = logging.getLogger(__name__)


class Answer(NamedTuple):
    """What one acquire attempt came back with (``attempt`` None: the call raised)."""

    holder: str
    attempt: Optional[Union[Attempt, MultiAttempt]]
    error: Optional[BaseException]
    requested_at: float
    #: The waiter's attempt number it answers (:attr:`.Waiter.attempts_sent`).
    sent: int = 0


class Admission:
    """The waiting requests of one worker and their way to a slot. Loop thread only, except
    the methods marked I/O."""

    def __init__(self, gate: "Gate") -> None:
        self.gate = gate
        self.backend = gate.backend
        self.waiters: Dict[str, Waiter] = {}  # holder -> waiter
        self.line: Deque[Waiter] = deque()  # LINED, in arrival order
        self.queued: Dict[str, int] = {}  # semaphore name -> its QUEUED waiters
        self.by_name: Dict[str, int] = {}  # semaphore name -> its waiters
        #: semaphore name -> its waiters the backend told to wait (the semaphore is full)
        self.blocked_by_name: Dict[str, int] = {}
        self.limits = LimitWatch(self.backend)  # logs a limit in force we do not declare

    def __len__(self) -> int:
        return len(self.waiters)

    def count(self, name: str) -> int:
        return self.by_name.get(name, 0)

    def blocked(self, name: str) -> int:
        """Waiters of semaphore ``name`` the backend told to wait."""
        return self.blocked_by_name.get(name, 0)

    def add(self, request: Any, guard: Guard, pulled: bool = False) -> Waiter:
        """A guarded request enters. It costs what any request the consumer holds costs (a
        place in its prefetch) until the backend tells it to wait (:meth:`_told_to_wait`):
        a semaphore with room costs one acquire and nothing else."""
        waiter = Waiter(request, guard, new_holder_id(request.id), pulled=pulled)
        self.waiters[waiter.holder] = waiter
        self.by_name[guard.name] = self.by_name.get(guard.name, 0) + 1
        return waiter

    def wait(self, waiter: Waiter) -> None:
        """``waiter`` joins this worker's line: after those of its priority or higher
        (``semaphore_priority``), ahead of lower ones, so that it enters the backend's queue
        (ordered by priority there too) first."""
        priority = waiter.guard.priority
        if not self.line or self.line[-1].guard.priority >= priority:
            self.line.append(waiter)
        else:
            index = next(i for i, w in enumerate(self.line) if w.guard.priority < priority)
            self.line.insert(index, waiter)
        self.pump()

    def pool_size(self) -> int:
        return celery_internals.pool_size(self.gate.consumer.pool)

    def free_processes(self) -> int:
        busy = (celery_internals.reserved_count() - len(self.waiters)
                - sum(self.gate.parking.parking.values()))
        return self.pool_size() - busy

    def pump(self) -> None:
        """Move waiters from the line into the backend's queue while processes are free (as
        many of one semaphore as processes are free; one whose priority is above the default
        goes in at once, so that the backend's queue orders it ahead of lower ones: a grant
        that then finds no free process is given back)."""
        free = self.free_processes()
        if free <= 0 or not self.line:
            return
        for waiter in list(self.line):
            if self.queued.get(waiter.guard.name, 0) < free or waiter.guard.priority > 0:
                self.line.remove(waiter)
                self._move(waiter, WaitState.QUEUED)
                self.gate.io.call(self._watch, waiter, waiter.holder)
                self._send(waiter)

    def drop(self, waiter: Waiter) -> bool:
        """Forget ``waiter`` (it runs, is requeued, failed or revoked); False if it had left
        already. The caller settles its message."""
        if waiter.state is WaitState.DONE:
            return False
        if waiter.state is WaitState.LINED and waiter in self.line:  # not yet, if refused
            self.line.remove(waiter)
        self._move(waiter, WaitState.DONE)
        self.waiters.pop(waiter.holder, None)
        name = waiter.guard.name
        self.by_name[name] -= 1
        if not self.by_name[name]:
            del self.by_name[name]
        if waiter.attempts:
            self.blocked_by_name[name] -= 1
            if not self.blocked_by_name[name]:
                del self.blocked_by_name[name]
        self._unwatch(waiter)
        if waiter.raised_prefetch:
            self.gate.consumer.qos.decrement_eventually()
        self.gate.parking.refill(name)
        return True

    def leave_backend(self, waiter: Waiter) -> None:
        """Take a dropped waiter out of the backend's queue, and release the grant an attempt
        still on its way may get (on the I/O thread, after that attempt; its answer may
        never be read: the loop stops at shutdown)."""
        if waiter.first_sent is not None:
            self.gate.io.call(self._cancel, waiter.guard.names, waiter.holder,
                              waiter.last_sent + waiter.guard.settings.lease_ttl)

    def _move(self, waiter: Waiter, to: WaitState) -> None:
        name = waiter.guard.name
        if waiter.state is WaitState.QUEUED:
            self.queued[name] -= 1
            if not self.queued[name]:
                del self.queued[name]
        waiter.move(to)
        if to is WaitState.QUEUED:
            self.queued[name] = self.queued.get(name, 0) + 1

    # -- attempts: sent from the loop, made on the I/O thread, answered on the loop ----------

    def _send(self, waiter: Waiter, delay: float = 0.0) -> None:
        if waiter.next_attempt is not None:
            waiter.next_attempt.cancel()
        now = time.monotonic()
        if waiter.first_sent is None:
            waiter.first_sent = now
        waiter.last_sent = now + delay
        waiter.attempts_sent += 1
        waiter.next_attempt = self.gate.io.call(self._acquire, waiter, waiter.holder,
                                                waiter.attempts_sent, delay=delay)

    def _watch(self, waiter: Waiter, holder: str) -> None:  # I/O thread
        woken = lambda: self.gate.loop.post(self._woken, waiter, holder)  # noqa: E731
        for name in waiter.guard.names:  # a multi-semaphore request waits in any one's queue
            self.backend.watch(name, holder, woken)

    def _unwatch(self, waiter: Waiter) -> None:
        for name in waiter.guard.names:
            self.backend.unwatch(name, waiter.holder)

    def _woken(self, waiter: Waiter, holder: str) -> None:
        if waiter.state is WaitState.QUEUED and waiter.holder == holder:
            self._send(waiter)

    def _acquire(self, waiter: Waiter, holder: str, sent: int) -> None:  # I/O thread
        guard = waiter.guard
        requested_at = time.monotonic()
        meta = {**self.meta(waiter.request, guard), FIRST_WAIT_META: waiter.first_wait}
        try:
            attempt: Union[Attempt, MultiAttempt]
            if guard.multi:
                attempt = self.backend.acquire_all(
                    guard.pairs, holder, ttl=guard.settings.lease_ttl, meta=meta,
                    wait=waiter.waits)
            else:
                attempt = self.backend.acquire(
                    guard.name, holder, limit=guard.limit, ttl=guard.settings.lease_ttl,
                    meta=meta, wait=waiter.waits)
        except Exception as exc:
            answer = Answer(holder, None, exc, requested_at, sent)
        else:
            answer = Answer(holder, attempt, None, requested_at, sent)
        self.gate.loop.post(self._answered, waiter, answer)
        if answer.attempt is not None:
            self.limits.saw(guard, answer.attempt)

    def _answered(self, waiter: Waiter, answer: Answer) -> None:
        current = waiter.holder == answer.holder
        if waiter.state is not WaitState.QUEUED or not current:
            self._late_answer(waiter, answer, current)
            return
        if answer.sent != waiter.attempts_sent and (answer.attempt is None
                                                    or answer.attempt.grant is None):
            # A newer attempt is on its way (a wake-up sent it after this one was made):
            # its answer decides. Rescheduling from this one would cancel it, and the
            # waiter would sleep a poll interval through the slot it was woken for.
            return
        settings = waiter.guard.settings
        if isinstance(answer.error, ConfigurationError):
            # The backend refused the request itself (a cost above the stored limit, an
            # option this backend cannot apply): it fails alone; trying again cannot help.
            with waiter.outcome_lock:  # no WAITING stored over the failure
                self.drop(waiter)
                self.leave_backend(waiter)
                self.gate.fail(waiter.request, answer.error)
            return
        if answer.error is not None:
            if not waiter.backend_down:
                logger.warning("celery-semaphore: %s waits: backend unavailable: %s",
                               waiter.request.id, answer.error)
            waiter.backend_down = True
            self._send(waiter, delay=min(settings.poll_interval, 1.0))
            return
        waiter.backend_down = False
        attempt = answer.attempt
        if attempt.grant is not None:
            self._granted(waiter, answer)
            return
        blocking = getattr(attempt, "blocking", None) or waiter.guard.name
        if not waiter.waits:  # semaphore_on_full skip or fail: it never queued
            self.drop(waiter)
            self.gate.full(waiter.request, waiter.guard, attempt.limit, blocking)
            return
        waiter.attempts += 1
        if waiter.attempts == 1 and self._told_to_wait(waiter):
            return
        waits_for = getattr(attempt, "waits_for", None)
        if (attempt.position != waiter.position or blocking != waiter.blocking
                or waits_for != waiter.waits_for):
            waiter.position, waiter.blocking = attempt.position, blocking
            waiter.waits_for = waits_for
            self.gate.reporting.waiting(waiter, attempt.position, attempt.limit)
        pause = self.backend.pause_after(attempt, settings.poll_interval)
        if getattr(attempt, "rate_due", None) is not None:
            # Due counts from when the backend decided, which was after the attempt was sent:
            # count from the send, so the next try reaches it as its start falls due rather
            # than a round trip later (each late start delays every later one).
            pause = max(0.0, pause - (time.monotonic() - answer.requested_at))
        self._send(waiter, delay=pause)

    def _told_to_wait(self, waiter: Waiter) -> bool:
        """The backend told ``waiter`` to wait for the first time: its semaphore is full. It
        stops counting against the consumer's prefetch (the consumer fetches other work
        meanwhile); beyond this worker's share of that semaphore's waiters it goes to the
        waiting room instead (True: it left)."""
        name = waiter.guard.name
        self.blocked_by_name[name] = self.blocked_by_name.get(name, 0) + 1  # drop undoes it
        if not waiter.pulled and self.gate.parking.room(name) < 0 and waiter.parks:
            self.gate.parking.park(waiter, "this worker holds its share of waiters already")
            return True
        self.raise_prefetch(waiter)
        return False

    def raise_prefetch(self, waiter: Waiter) -> None:
        """``waiter`` waits for its semaphore (not for a pool process): raise the consumer's
        prefetch while it does (never for a pulled one, which is not on the consumer's
        channel), so that the consumer fetches other work meanwhile."""
        if not waiter.pulled and not waiter.raised_prefetch:
            waiter.raised_prefetch = True
            self.gate.consumer.qos.increment_eventually()

    def _late_answer(self, waiter: Waiter, answer: Answer, current: bool) -> None:
        """An answer to an attempt sent before the waiter left the backend's queue (the I/O
        thread may have made it after the grant that ended the wait). Repeating an acquire
        returns the holder's own grant: while the waiter gives that grant back (GRANTED) or
        its task holds it, the answer is that very slot and changes nothing. Otherwise a
        grant, or an error that may hide one, must not keep a slot."""
        if current and waiter.state is WaitState.GRANTED:
            return
        if answer.holder in self.gate.releases.held:
            return
        if answer.attempt is not None and answer.attempt.grant is not None:
            self.gate.io.call(self.gate.releases.release, self._lease(waiter, answer))
        elif answer.error is not None:
            self.gate.io.call(self._cancel, waiter.guard.names, answer.holder,
                              answer.requested_at + waiter.guard.settings.lease_ttl)

    # -- a grant -----------------------------------------------------------------------------

    def _lease(self, waiter: Waiter, answer: Answer) -> Union[Lease, LeaseGroup]:
        attempt = answer.attempt
        meta = self.meta(waiter.request, waiter.guard)
        if isinstance(attempt, MultiAttempt):
            return LeaseGroup({
                name: Lease(self.backend, name, answer.holder, grant, answer.requested_at,
                            limit=attempt.limits.get(name), meta=meta)
                for name, grant in attempt.grants.items()})
        return Lease(self.backend, waiter.guard.name, answer.holder, attempt.grant,
                     answer.requested_at, limit=attempt.limit, meta=meta)

    def _granted(self, waiter: Waiter, answer: Answer) -> None:
        self._move(waiter, WaitState.GRANTED)
        self._unwatch(waiter)
        lease = self._lease(waiter, answer)
        request, guard = waiter.request, waiter.guard
        if request.revoked():  # by id, by stamped header or expired: announced and acked
            self.drop(waiter)
            self.gate.io.call(self.gate.releases.release, lease)
            return
        if self.free_processes() <= 0:
            # The pool filled up meanwhile: never sit on a slot waiting for a process.
            self.gate.io.call(self._give_back_grant, waiter, lease)
            return
        self.drop(waiter)
        request.request_dict[LEASE_KEY] = lease_record_of(
            lease, self.backend.url, self.backend.key_prefix,
            waited=waiter.attempts > 0,  # WAITING was stored: the task stores STARTED
        ).to_header()
        self.gate.releases.hold(request, lease, guard)
        self.gate.handoffs.append(request)

    def _give_back_grant(self, waiter: Waiter,
                         lease: Union[Lease, LeaseGroup]) -> None:  # I/O thread
        """Release a grant the pool had no process for, then put the request back in line.
        The waiter stays GRANTED until the release is done: an answer to an attempt made
        before it would carry this very grant, about to be freed."""
        self.gate.releases.release(lease)
        self.gate.loop.post(self._line_again, waiter, lease)

    def _line_again(self, waiter: Waiter, lease: Union[Lease, LeaseGroup]) -> None:
        if waiter.state is not WaitState.GRANTED:
            return
        if not lease.released:  # the release is being retried: wait under another holder id
            del self.waiters[waiter.holder]
            waiter.holder = new_holder_id(waiter.request.id)
            self.waiters[waiter.holder] = waiter
            waiter.first_sent = None
        self._move(waiter, WaitState.LINED)
        waiter.position = waiter.blocking = None
        self.line.appendleft(waiter)
        self.pump()

    # -- leaving -----------------------------------------------------------------------------

    def _cancel(self, names: Tuple[str, ...], holder: str, expires: float,
                retry: float = 0.0) -> None:  # I/O thread
        """Leave the backend's queues of ``names`` and release a grant an attempt may have got
        (its reply lost, or never to be read), retrying until the lease would have expired
        anyway (``expires``, monotonic)."""
        try:
            self.backend.abandon_all(names, holder)
        except Exception as exc:
            self.gate.retry_io(
                lambda next_retry: self._cancel(names, holder, expires, next_retry),
                retry, expires - time.monotonic(), f"leaving the queue of {names[0]!r}", exc)

    def meta(self, request: Any, guard: Guard) -> Dict[str, Any]:
        meta = {"task_id": request.id, "task": request.name,
                "worker": self.gate.consumer.hostname, "pid": os.getpid()}
        if guard.fair is not None:
            meta[FAIR_KEY] = guard.fair
        meta.update(guard.traffic_meta())
        return meta
