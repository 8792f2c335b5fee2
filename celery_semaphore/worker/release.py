"""Release, exactly once, on every way a guarded task ends (all in the worker's main process):

* success, failure, retry, time limits, a killed child (WorkerLostError), revoke with
  terminate: the request's ``on_success``/``on_failure`` pool callbacks, which are wrapped;
* a hard time limit: also ``on_timeout`` (the gevent pool calls nothing else; prefork calls
  ``on_failure`` too, and the first of the two releases);
* revoked or expired before running: the ``task_revoked`` signal;
* warm or cold shutdown: :meth:`Releases.release_all`;
* a broker reconnect: the consumer drops the jobs no pool child has acknowledged, with their
  callbacks: released at once if no child got the job, else once that child moves on or exits
  (:class:`Orphan`, whose message is settled then too);
* a whole worker dying: the lease's TTL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from celery import signals
from celery.exceptions import TimeLimitExceeded

from ..guards import Guard
from ..keeper import default_keeper
from ..semaphore import Lease, LeaseGroup
from . import celery_internals
from .context import GateContext
from .settlements import Settle, Settlements

logger = logging.getLogger(__name__)

#: One semaphore's lease, or the leases of a request under several.
AnyLease = Union[Lease, LeaseGroup]

#: Seconds to wait for a timed-out or terminated pool child to exit before releasing anyway.
CHILD_EXIT_WAIT = 30.0


@dataclass(eq=False)
class Held:
    """A guarded request that holds its slot: handed to the pool, running, or ending."""

    request: Any
    lease: AnyLease
    guard: Guard


@dataclass(eq=False)
class Orphan:
    """A request (guarded or not) whose job a broker reconnect's pool flush dropped after its
    write to pool child ``pid`` had begun: the child runs it, and no callback will say so."""

    request: Any
    pid: int
    held: Optional[Held]  # its slot, if guarded
    child_up: Optional[float] = None  # monotonic time the child was first seen up


class Releases:
    """The slots this worker's requests hold, and their release. Loop thread, except the
    methods marked I/O."""

    def __init__(self, ctx: GateContext, settlements: Settlements,
                 dropped_by_pool: Callable[[Any], None],
                 capacity_changed: Callable[[], None]) -> None:
        self.ctx = ctx
        self.settlements = settlements
        #: told of a request pulled from the waiting room that the pool dropped unrun
        self.dropped_by_pool = dropped_by_pool
        #: told when a slot or a pool process frees
        self.capacity_changed = capacity_changed
        self.held: Dict[str, Held] = {}  # lease holder -> Held
        #: Requests handed to the pool whose ending has not been seen, with their pool job (a
        #: strong reference: the request's own is weak, and the flush drops the pool's):
        #: id(request) -> (request, job).
        self.in_pool: Dict[int, Tuple[Any, Any]] = {}
        self.orphans: List[Orphan] = []

    def connect(self) -> None:
        signals.task_revoked.connect(self._on_task_revoked, weak=False)

    def disconnect(self) -> None:
        signals.task_revoked.disconnect(self._on_task_revoked)

    def hold(self, request: Any, lease: AnyLease, guard: Guard) -> Held:
        """``request`` got its slot and goes to the pool: renew its lease until it ends."""
        entry = self.held[lease.holder] = Held(request, lease, guard)
        request.semaphore_held = entry
        lease.on_lost(lambda lost: self.ctx.loop.post(self._lease_lost, entry))
        default_keeper.add(lease)
        self.track(request)
        return entry

    def handed_to_pool(self, request: Any) -> None:
        if not getattr(request, "semaphore_ended", False):  # (a pool that runs it at once)
            # the thread pool keeps no reference to its job: it runs, whatever happens to the
            # broker connection (no flush drops it)
            job = celery_internals.pool_job(request)
            if job is None and not celery_internals.pool_forks(self.ctx.consumer.pool):
                job = celery_internals.RUNS_ONCE_HANDED
            self.in_pool[id(request)] = (request, job)

    def track(self, request: Any) -> None:
        """Wrap the request's pool callbacks: release its lease, and look for free processes."""
        on_success, on_failure = request.on_success, request.on_failure

        # Pool callbacks run on the pool's thread (prefork: the loop thread; threads, gevent:
        # others): each posts its ending to the loop thread, which owns the gate's state.
        post = self.ctx.loop.post

        def success(*args: Any, **kwargs: Any) -> Any:
            try:
                return on_success(*args, **kwargs)
            finally:
                post(self.finished, request)

        def failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return on_failure(exc_info, *args, **kwargs)
            finally:
                post(self.finished, request, getattr(exc_info, "exception", None))

        def time_limit(soft: bool, timeout: float) -> Any:  # billiard passes timeout=...
            try:
                return on_timeout(soft, timeout)
            finally:
                if not soft:  # the gevent pool never calls on_failure for a hard limit
                    post(self.finished, request, TimeLimitExceeded(timeout))

        on_timeout = request.on_timeout
        request.on_success, request.on_failure, request.on_timeout = success, failure, time_limit

    def refresh_jobs(self) -> None:
        """Take a strong reference to the pool job of every request handed to the pool whose
        job did not exist yet when it was handed: with every process busy, prefork's consumer
        holds a request in Celery's worker semaphore and applies it once a process frees
        (``WorkController._process_task_sem``). Called when the broker connection is lost,
        before the pool's flush drops the jobs no child accepted."""
        for key, (request, job) in list(self.in_pool.items()):
            if job is None:
                live = celery_internals.pool_job(request)
                if live is not None:
                    self.in_pool[key] = (request, live)

    def finished(self, request: Any, exc: Optional[BaseException] = None) -> None:
        """``request`` ended (a pool callback, posted to the loop thread): release its slot,
        and let waiters have the process it freed."""
        request.semaphore_ended = True
        self.in_pool.pop(id(request), None)
        entry: Optional[Held] = getattr(request, "semaphore_held", None)
        if entry is not None and self.held.pop(entry.lease.holder, None) is not None:
            pid = request.worker_pid
            exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
            if (isinstance(exc, celery_internals.CHILD_KILLED) and pid
                    and celery_internals.pool_forks(self.ctx.consumer.pool)):
                # Celery reports these before the pool child has died; the body may still
                # run (a finally block, a handler): keep the slot until it exits.
                self.ctx.io.call(self._release_after_exit, entry.lease, pid,
                                 time.monotonic() + CHILD_EXIT_WAIT)
            else:
                self._release_soon(entry.lease)
        self.capacity_changed()

    def _release_after_exit(self, lease: AnyLease, pid: int, deadline: float) -> None:  # I/O
        # At worker shutdown the pool has been stopped first: release now, not never.
        if (self.ctx.running and celery_internals.process_alive(pid)
                and time.monotonic() < deadline):
            self.ctx.io.call(self._release_after_exit, lease, pid, deadline, delay=0.005)
            return
        default_keeper.discard(lease)
        self.release(lease)

    def release(self, lease: AnyLease, retry: float = 0.0) -> None:  # I/O thread
        """Release ``lease``; while the backend cannot be reached, try again with backoff
        until it answers or the lease would have expired anyway (its TTL then frees it)."""
        try:
            if not lease.release() and not lease.lost:
                logger.debug("celery-semaphore: lease %r had expired before release", lease)
        except Exception as exc:
            self.ctx.retry_io(lambda next_retry: self.release(lease, next_retry), retry,
                              lease.remaining, f"releasing {lease!r}", exc)

    def release_all(self) -> None:
        """The worker exits: release every lease still held."""
        with self.ctx.lock:
            held = list(self.held.values())
            self.held.clear()
        for entry in held:
            self._release_soon(entry.lease)

    def _release_soon(self, lease: AnyLease) -> None:
        """Stop renewing ``lease`` and release it on the I/O thread."""
        default_keeper.discard(lease)
        self.ctx.io.call(self.release, lease)

    def _lease_lost(self, entry: Held) -> None:
        if self.held.get(entry.lease.holder) is not entry:
            return
        policy = entry.guard.settings.on_lost_lease
        logger.error("celery-semaphore: task %s lost its slot of %r (token %s); policy: %s",
                     entry.request.id, entry.lease.name, entry.lease.token, policy)
        if policy == "terminate":
            entry.request.terminate(self.ctx.consumer.pool, signal="SIGTERM")

    # -- revoked before a pool process took it ----------------------------------------------

    def _on_task_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        task_id = getattr(request, "id", None)
        if task_id is not None:
            self.ctx.loop.post(self._revoked, task_id)

    def _revoked(self, task_id: str) -> None:
        for entry in list(self.held.values()):
            request = entry.request
            if request.id == task_id and celery_internals.revoked_before_start(request):
                # No pool callback comes. (Another delivery of the same task id may hold a
                # slot too, and run.)
                self.finished(request)

    # -- jobs a broker reconnect dropped from the pool --------------------------------------

    def after_flush(self) -> None:
        """On a broker reconnect the consumer flushes the prefork pool: jobs no child has
        acknowledged leave the pool's cache and their callbacks never run. A job no child got
        never runs: its slot is released now, and its message was put back already
        (:meth:`.Gate.on_connection_lost`; a pulled one goes back to its queue now). A job
        whose write to a child had begun runs there unseen: an :class:`Orphan` until that child
        has moved on (:meth:`check_orphans`)."""
        for request, job in list(self.in_pool.values()):
            child = celery_internals.dropped_job_child(self.ctx.consumer, request, job)
            if child is False:
                continue
            del self.in_pool[id(request)]
            entry: Optional[Held] = getattr(request, "semaphore_held", None)
            if entry is not None and self.held.get(entry.lease.holder) is not entry:
                entry = None
            if child is None:
                self.dropped_by_pool(request)
                if entry is not None:
                    logger.warning("celery-semaphore: %s was dropped by the pool on a broker "
                                   "reconnect before any child got it; releasing its slot",
                                   request.id)
                    self._forget(entry)
                continue
            logger.warning("celery-semaphore: %s runs in pool child %s without callbacks after "
                           "a broker reconnect; %sits message is settled when that child moves "
                           "on", request.id, child.pid, "its slot is released and " if entry
                           else "")
            self.orphans.append(Orphan(request, child.pid, entry))

    def check_orphans(self) -> None:
        """Settle an orphan once its child has moved on or exited. A child that is up runs the
        job it was written first, and one that takes no other job and does not exit (with
        ``max_tasks_per_child``) shows nothing: a write to a child can also be lost with the
        pipe of one that exited before reading it, and the slot would be held until the worker
        stops. So a child up for a whole lease TTL counts as moved on too: if it runs the job
        after all, that run has lost its lease (``current_lease().verify()`` says so, and
        fencing tokens reject its writes), as a partitioned holder's would.

        Its message, kept unacknowledged on a Redis broker (a job a child got is among those
        :func:`.celery_internals.handed_to_pool` counts), is acknowledged once the child moved
        on (it ran the job) and put back if the child exited (it may have died before running
        it: at-least-once). On AMQP the broker put it back when the channel closed, as for
        plain Celery."""
        now = time.monotonic()
        for key, (request, _) in list(self.in_pool.items()):  # ended unseen (never applied)
            if not celery_internals.still_held(request):
                del self.in_pool[key]
        for orphan in list(self.orphans):
            pid = orphan.pid
            alive = celery_internals.process_alive(pid)
            if alive and not celery_internals.runs_in_child(pid):
                if not celery_internals.child_is_up(self.ctx.consumer.pool, pid):
                    continue
                ttl = (orphan.held.lease.ttl if orphan.held is not None
                       else self.ctx.settings.lease_ttl)
                if orphan.child_up is None:
                    orphan.child_up = now
                    continue
                if now - orphan.child_up <= ttl:
                    continue
                logger.warning("celery-semaphore: pool child %s has not moved on in a lease TTL "
                               "after a broker reconnect; settling %s", pid, orphan.request.id)
            self.orphans.remove(orphan)
            if orphan.held is not None:
                self._forget(orphan.held)
            settle = Settle.ACK if alive else Settle.REQUEUE
            logger.info("celery-semaphore: settled %s (its job went to pool child %s, which %s):"
                        " %s", orphan.request.id, pid, "moved on" if alive else "exited",
                        "acknowledged" if alive else "put back in its queue")
            self.settlements.settle_kept(orphan.request.message, settle)

    def _forget(self, entry: Held) -> None:
        """Release a held slot no pool callback will release."""
        if self.held.pop(entry.lease.holder, None) is entry:
            self._release_soon(entry.lease)
