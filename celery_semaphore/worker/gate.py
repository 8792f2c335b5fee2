"""The worker gate: guarded requests wait for a slot in the worker's main process.

Where it sits: Celery hands every request that is due (after ETA and rate limits) to
``consumer.on_task_request``; the gate wraps that callable. An unguarded request passes straight
through. A guarded one is held in the main process (never in a pool process) until the backend
grants a slot, then handed to the pool with its lease.

Threads: all gate state lives on the consumer's loop thread (``asynloop``; with ``synloop``
the same code runs under one lock). Backend calls run on one I/O thread so that a slow or
unreachable backend never stalls the event loop; their results come back to the loop through a
pipe the hub watches, which wakes it at once.

Local capacity: a request enters the backend's waiter queue only while a pool process is free
for it (per semaphore name), so a granted slot never waits for a local pool process; a grant
that finds the pool full after all is released and the request goes back to the local line.

Release, exactly once, on every way a task ends (all in the main process):

* success, failure, retry, time limits, a killed child (WorkerLostError), revoke with
  terminate: the request's ``on_success``/``on_failure`` pool callbacks, which the gate wraps;
* a hard time limit: also ``on_timeout`` (the gevent pool calls nothing else; prefork calls
  ``on_failure`` too, and the first of the two releases);
* revoked or expired before running: the ``task_revoked`` signal;
* warm or cold shutdown: the consumer step's ``shutdown`` releases what is left;
* a broker reconnect: the consumer drops the jobs no pool child has acknowledged, with their
  callbacks: released at once if no child got the job, else once that child moves on or exits;
* a whole worker dying: the lease's TTL.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from billiard.exceptions import WorkerLostError
from celery import signals
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import Terminated, TimeLimitExceeded
from celery.worker import state as worker_state

from . import internals
from .backends import close_all
from .backends.base import Backend, Grant, new_holder_id
from .exceptions import ConfigurationError, SemaphoreError, SemaphoreTimeout
from .guards import Guard, Guards
from .keeper import default_keeper
from .scheduler import Scheduler
from .semaphore import Lease
from .settings import Settings
from .states import WAITING, WAITING_EVENT
from .task_lease import LEASE_KEY, LeaseRecord

logger = logging.getLogger(__name__)

#: Message headers the gate writes when it requeues a request.
REQUEUES_HEADER = "semaphore_requeues"
FIRST_WAIT_HEADER = "semaphore_first_wait"
#: What the gate adds to a request; kept out of messages the task publishes (``self.retry``).
GATE_HEADERS = (REQUEUES_HEADER, FIRST_WAIT_HEADER, LEASE_KEY)
#: Endings the pool reports before the child process has exited.
CHILD_KILLED = (TimeLimitExceeded, Terminated, WorkerLostError, SystemExit, KeyboardInterrupt)
#: Seconds to wait for a timed-out or terminated pool child to exit before releasing anyway.
CHILD_EXIT_WAIT = 30.0
#: First and longest pause between retries of a release or cancel the backend did not answer.
RETRY_FIRST = 0.1
RETRY_MAX = 2.0


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has stopped running and counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class LoopCaller:
    """Runs callables on the consumer's loop thread, waking the hub through a pipe.

    Without a hub (``synloop``) the callable runs at once in the calling thread, under the
    gate's lock; Celery itself calls ``on_task_request`` from its timer thread there.
    """

    def __init__(self, hub: Any, lock: threading.RLock, after: Callable[[], None]) -> None:
        self.hub = hub
        self.lock = lock
        self.after = after  # runs after each call, outside the lock
        self._calls: Deque[Tuple[Callable[..., Any], tuple]] = deque()
        self._rfd = self._wfd = -1
        # Held while the pipe is written or closed: a write racing stop() could otherwise hit
        # the fd number after it was closed and reused (the reconnected broker's socket).
        self._pipe_lock = threading.Lock()

    def start(self) -> None:
        with self._pipe_lock:
            if self.hub is None or self._rfd >= 0:
                return
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
        self.hub.add_reader(self._rfd, self._drain)

    def stop(self) -> None:
        with self._pipe_lock:
            rfd, wfd, self._rfd, self._wfd = self._rfd, self._wfd, -1, -1
        if rfd >= 0:
            try:
                self.hub.remove_reader(rfd)
            except Exception:
                pass
            os.close(rfd)
            os.close(wfd)
        self._drain_calls()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._pipe_lock:
            if self._wfd >= 0:
                self._calls.append((fn, args))
                try:
                    os.write(self._wfd, b"\0")
                except (BlockingIOError, OSError):  # a full pipe already wakes the hub
                    pass
                return
        self._run(fn, args)  # no loop to wake (synloop, or stopped): run it here

    def _drain(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._drain_calls()

    def _drain_calls(self) -> None:
        while self._calls:
            fn, args = self._calls.popleft()
            self._run(fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            with self.lock:
                fn(*args)
        except Exception:
            logger.exception("celery-semaphore: %r failed on the loop thread", fn)
        self.after()


@dataclass(eq=False)
class Pending:
    """A guarded request held in the main process until it gets a slot."""

    request: Any
    guard: Guard
    holder: str = field(default_factory=new_holder_id)
    entered: float = field(default_factory=time.monotonic)
    attempts: int = 0
    position: Optional[int] = None
    queued: bool = False  # in the backend's waiter queue
    granted: bool = False  # a grant is on its way to the loop: ignore further attempts
    done: bool = False
    generation: int = 0
    backend_down: bool = False
    maybe_granted: bool = False  # an acquire raised: the backend may have granted unseen
    entered_wall: float = field(default_factory=time.time)
    last_attempt: float = 0.0  # monotonic time of the last acquire sent to the backend

    @property
    def requeues(self) -> int:
        return int(self.request.request_dict.get(REQUEUES_HEADER) or 0)

    @property
    def first_wait(self) -> float:
        """Unix time this task first waited for a slot, across requeues."""
        return float(self.request.request_dict.get(FIRST_WAIT_HEADER) or self.entered_wall)


@dataclass(eq=False)
class Held:
    request: Any
    lease: Lease
    guard: Guard
    job: Any = None  # the pool's ApplyResult, once handed to the pool
    orphan_of: Optional[int] = None  # the pool child running it with no callbacks left
    orphan_child_up: Optional[float] = None  # monotonic time that child was first seen up


class Gate:
    """Holds guarded requests until the semaphore admits them. See the module docstring."""

    def __init__(self, consumer: Any, settings: Settings, backend: Backend) -> None:
        self.consumer = consumer
        self.app = consumer.app
        self.settings = settings
        self.guards = Guards(settings)
        self.backend = backend
        self.lock = threading.RLock()
        # Requests to hand to the pool once the lock is released: with prefork's putlocks the
        # pool can block in apply_async until its result thread, which needs the lock to run
        # our completion callbacks, frees a process.
        self.handoffs: Deque[Any] = deque()
        self.loop = LoopCaller(consumer.hub, self.lock, self._flush_handoffs)
        self.io = Scheduler("celery-semaphore-gate")
        self.pending: Dict[str, Pending] = {}  # holder -> Pending
        self.line: Deque[Pending] = deque()  # waiting for a free local pool process
        self.queued: Dict[str, int] = {}  # semaphore name -> requests in the backend's queue
        self.held: Dict[str, Held] = {}  # lease holder -> Held
        self.original: Callable[[Any], Any] = consumer.on_task_request
        consumer.on_task_request = self.on_task_request
        self._on_connection_lost = consumer.on_connection_error_after_connected
        consumer.on_connection_error_after_connected = self.on_connection_lost
        self._running = False

    # -- lifecycle (consumer bootstep) -------------------------------------------------------

    def start(self) -> None:
        self.loop.hub = self.consumer.hub
        self.loop.start()
        if not self._running:
            self._running = True
            self.io.call(self._tick, delay=self.settings.poll_interval)
            signals.task_revoked.connect(self._on_task_revoked, weak=False)

    def stop(self) -> None:
        """The consumer stops (shutdown or reconnect): give waiting requests back.

        With the broker connection still open they are rejected for redelivery. Once it is
        closed or lost, the broker has them back already (AMQP requeues a closed channel's
        unacked messages, kombu's virtual transports restore them when the channel closes,
        and :meth:`on_connection_lost` restores those of a Redis broker), and a reject on the
        dead channel would only log a CRITICAL traceback per request."""
        with self.lock:
            connected = self.consumer.connection is not None
            if not connected and self.pending:
                logger.info("celery-semaphore: the broker connection is closed with %d tasks "
                            "waiting for a slot; the broker delivers them again",
                            len(self.pending))
            for pending in list(self.pending.values()):
                self._drop(pending)
                self.io.call(self._cancel_in_backend, pending)
                if connected:
                    try:
                        pending.request.reject(requeue=True)
                    except Exception as exc:  # the broker redelivers it all the same
                        logger.debug("celery-semaphore: reject on stop failed: %s", exc)
                else:
                    pending.request.acknowledged = True  # nothing to settle on this channel
                worker_state.task_ready(pending.request)
            for entry in list(self.held.values()):
                self._after_flush(entry)
        self.loop.stop()

    def on_connection_lost(self, exc: BaseException) -> Any:
        """Wraps the consumer's ``on_connection_error_after_connected``.

        Closing the lost connection makes kombu's Redis transport restore every unacked
        message through a transport it has already detached (kombu 5.7 raises AttributeError
        there, and the worker exits). Waiting requests are such messages: take them out of
        the channel's unacked set first (they stay in the broker's unacked hash) and put them
        back in their queue, with the transport's own restore, once the broker answers."""
        with self.lock:
            tags = [pending.request.message.delivery_tag for pending in self.pending.values()
                    if internals.detach_unacked(pending.request.message)]
        if tags:
            self.io.call(self._restore_detached, tags)
        return self._on_connection_lost(exc)

    def _restore_detached(self, tags: List[str], retry: float = RETRY_FIRST) -> None:  # I/O
        """Put messages detached by :meth:`on_connection_lost` back in their queue, retrying
        until the broker answers (or the worker stops: then the transport's visibility
        timeout restores them)."""
        try:
            internals.restore_unacked(self.app, tags)
        except Exception as exc:
            if self._running:
                self.io.call(self._restore_detached, tags, min(retry * 2, RETRY_MAX),
                             delay=retry)
            else:
                logger.warning("celery-semaphore: %d waiting tasks stay unacked in the broker "
                               "until its visibility_timeout restores them: %s", len(tags), exc)
            return
        logger.info("celery-semaphore: %d tasks that were waiting when the broker connection "
                    "was lost are back in their queue", len(tags))

    def _after_flush(self, entry: Held) -> None:
        """On a broker reconnect the consumer flushes the prefork pool: jobs no child has
        acknowledged leave the pool's cache and their callbacks never run (the broker
        redelivers their messages). A job no child got never runs: release now. A job whose
        write to a child had begun runs there unseen: release once that child has moved on to
        another task or exited, or has been up for a whole lease TTL without doing either
        (``_check_orphans``)."""
        request, job = entry.request, entry.job
        pool = getattr(self.consumer.pool, "_pool", None)  # None once the pool has stopped
        if (job is None or request.time_start is not None or not self._pool_forks()
                or pool is None or job._job in pool._cache):
            return
        child = getattr(job, "_write_to", None)
        if child is None:
            logger.warning("celery-semaphore: %s was dropped by the pool on a broker reconnect "
                           "before any child got it; releasing its slot", request.id)
            self._forget(entry)
        else:
            logger.warning("celery-semaphore: %s runs in pool child %s without callbacks after a "
                           "broker reconnect; its slot is released when that child moves on",
                           request.id, child.pid)
            entry.orphan_of = child.pid

    def _check_orphans(self) -> None:
        """Release an orphan's slot once its child has moved on or exited. A child that is
        up runs the job it was written first, and one that takes no other job and does not
        exit (with ``max_tasks_per_child``) shows nothing: a write to a child can also be
        lost with the pipe of one that exited before reading it, and the slot would be held
        until the worker stops. So a child up for a whole lease TTL frees the slot too: if it
        runs the job after all, that run has lost its lease (``current_lease().verify()``
        says so, and fencing tokens reject its writes), as a partitioned holder's would."""
        now = time.monotonic()
        for entry in list(self.held.values()):
            pid = entry.orphan_of
            if pid is None:
                continue
            if not process_alive(pid) or any(
                    other.worker_pid == pid for other in list(worker_state.active_requests)):
                self._forget(entry)
            elif internals.child_is_up(self.consumer.pool, pid):
                if entry.orphan_child_up is None:
                    entry.orphan_child_up = now
                elif now - entry.orphan_child_up > entry.lease.ttl:
                    logger.warning("celery-semaphore: pool child %s has not moved on in a lease "
                                   "TTL after a broker reconnect; releasing the slot of %s",
                                   pid, entry.request.id)
                    self._forget(entry)

    def _forget(self, entry: Held) -> None:
        """Release a held slot no pool callback will release."""
        if self.held.pop(entry.lease.holder, None) is entry:
            default_keeper.discard(entry.lease)
            self.io.call(self._release, entry.lease)

    def shutdown(self) -> None:
        """The worker exits: release every lease still held, then stop the I/O thread."""
        self.stop()
        signals.task_revoked.disconnect(self._on_task_revoked)
        with self.lock:
            held = list(self.held.values())
            self.held.clear()
        for entry in held:
            default_keeper.discard(entry.lease)
            self.io.call(self._release, entry.lease)
        self._running = False
        self.io.stop()
        close_all()  # this process's backends: wake-up listeners, connections, socket files

    # -- entry -------------------------------------------------------------------------------

    def on_task_request(self, request: Any) -> None:
        with self.lock:
            self._admit(request)
        self._flush_handoffs()

    def _admit(self, request: Any) -> None:
        try:
            guard = self.guards.resolve(request)
        except SemaphoreError as exc:
            return self._fail(request, exc)
        except Exception as exc:  # a poison message fails its own task, never the worker
            return self._fail(request, ConfigurationError(
                f"task {request.name}: cannot resolve its semaphore: "
                f"{type(exc).__name__}: {exc}"))
        if guard is None:
            self._track(request)
            self.handoffs.append(request)
            return
        pending = Pending(request, guard)
        if len(self.pending) >= guard.settings.worker_max_waiting:
            logger.debug("celery-semaphore: %s: worker holds %d waiting tasks, requeueing",
                         request.id, len(self.pending))
            self.pending[pending.holder] = pending
            self.consumer.qos.increment_eventually()
            return self._requeue(pending)
        self.pending[pending.holder] = pending
        self.consumer.qos.increment_eventually()
        self.line.append(pending)
        self._pump()

    def _flush_handoffs(self) -> None:
        """Hand granted and unguarded requests to the pool, outside the lock."""
        while self.handoffs:
            try:
                request = self.handoffs.popleft()
            except IndexError:
                return
            self.original(request)
            entry = getattr(request, "semaphore_held", None)
            ref = getattr(request, "_apply_result", None)
            if entry is not None and ref is not None:
                entry.job = ref()  # the request keeps only a weak reference

    # -- waiting -----------------------------------------------------------------------------

    def _free_processes(self) -> int:
        pool = self.consumer.pool
        size = getattr(pool, "num_processes", None) or getattr(pool, "limit", None) or 1
        busy = len(worker_state.reserved_requests) - len(self.pending)
        return size - busy

    def _pump(self) -> None:
        """Move requests from the local line into the backend's queue while processes are free."""
        free = self._free_processes()
        if free <= 0 or not self.line:
            return
        moved = []
        for pending in self.line:
            if self.queued.get(pending.guard.name, 0) < free:
                self._set_queued(pending, True)
                moved.append(pending)
        for pending in moved:
            self.line.remove(pending)
            self.io.call(self._enqueue, pending)

    def _set_queued(self, pending: Pending, queued: bool) -> None:
        if pending.queued != queued:
            pending.queued = queued
            self.queued[pending.guard.name] = (
                self.queued.get(pending.guard.name, 0) + (1 if queued else -1))

    def _enqueue(self, pending: Pending) -> None:  # I/O thread
        self.backend.watch(
            pending.guard.name, pending.holder, lambda: self.io.call(self._kick, pending)
        )
        self._kick(pending)

    def _kick(self, pending: Pending) -> None:  # I/O thread
        pending.generation += 1
        self._attempt(pending, pending.generation)

    def _attempt(self, pending: Pending, generation: int) -> None:  # I/O thread
        if pending.done or pending.granted or generation != pending.generation:
            return
        guard = pending.guard
        requested_at = pending.last_attempt = time.monotonic()
        try:
            attempt = self.backend.acquire(
                guard.name, pending.holder, limit=guard.limit, ttl=guard.settings.lease_ttl,
                meta=self._meta(pending.request), wait=True,
            )
        except Exception as exc:
            if not pending.backend_down:
                logger.warning("celery-semaphore: %s waits: backend unavailable: %s",
                               pending.request.id, exc)
            pending.backend_down = pending.maybe_granted = True
            self._schedule(pending, min(guard.settings.poll_interval, 1.0))
            return
        pending.backend_down = False
        if attempt.grant is not None:
            pending.granted = True
            self.backend.unwatch(guard.name, pending.holder)
            self.loop.post(self._granted, pending, attempt.grant, requested_at, attempt.limit)
            return
        pending.attempts += 1
        if attempt.position != pending.position:
            pending.position = attempt.position
            self.loop.post(self._report_waiting, pending, attempt.position, attempt.limit)
        self._schedule(pending, self.backend.pause_after(attempt, guard.settings.poll_interval))

    def _schedule(self, pending: Pending, delay: float) -> None:  # I/O thread
        pending.generation += 1
        self.io.call(self._attempt, pending, pending.generation, delay=delay)

    def _meta(self, request: Any) -> Dict[str, Any]:
        return {"task_id": request.id, "task": request.name, "worker": self.consumer.hostname,
                "pid": os.getpid()}

    def _report_waiting(self, pending: Pending, position: Optional[int], limit: Any) -> None:
        if pending.done:
            return
        fields = {"semaphore": pending.guard.name, "limit": limit, "position": position,
                  "attempt": pending.requeues + 1}
        pending.request.send_event(WAITING_EVENT, **fields)
        if not pending.request.ignore_result:
            self.io.call(self._store_waiting, pending, fields)

    def _store_waiting(self, pending: Pending, fields: Dict[str, Any]) -> None:  # I/O thread
        if pending.granted or pending.done:  # it may have run and stored its outcome already
            return
        request = pending.request
        backend = request.task.backend
        if getattr(backend, "persistent", True) and type(backend).__name__ != "DisabledBackend":
            try:
                backend.store_result(request.id, fields, WAITING, request=request._context)
            except Exception as exc:
                logger.debug("celery-semaphore: storing WAITING for %s failed: %s",
                             request.id, exc)

    # -- admission ---------------------------------------------------------------------------

    def _granted(self, pending: Pending, grant: Grant, requested_at: float, limit: Any) -> None:
        request, guard = pending.request, pending.guard
        lease = Lease(self.backend, guard.name, pending.holder, grant, requested_at,
                      limit=limit, meta=self._meta(request))
        if pending.done:
            self.io.call(self._release, lease)
            return
        if request.revoked():  # by id, by stamped header or expired: announced and acked
            self._drop(pending)
            self.io.call(self._release, lease)
            return
        if self._free_processes() <= 0:
            # The pool filled up meanwhile: never sit on a slot waiting for a process.
            self.io.call(self._release_unused_grant, pending, lease)
            return
        self._drop(pending)
        entry = self.held[pending.holder] = Held(request, lease, guard)
        request.semaphore_held = entry
        request.request_dict[LEASE_KEY] = LeaseRecord(
            guard.name, limit, pending.holder, grant.slot, grant.epoch, grant.ttl,
            self.backend.url, self.backend.key_prefix,
            waited=pending.attempts > 0,  # WAITING was stored: the task stores STARTED
        ).to_header()
        lease.on_lost(lambda lost: self.loop.post(self._lease_lost, entry))
        default_keeper.add(lease)
        self._track(request)
        self.handoffs.append(request)

    def _release_unused_grant(self, pending: Pending, lease: Lease) -> None:  # I/O thread
        """Release a grant the pool had no process for, then put the request back in line.

        ``pending.granted`` stays set until the release is done: an attempt made before it (a
        wake-up already on its way) would be answered with this very grant, about to be freed.
        """
        pending.generation += 1  # attempts scheduled before the grant are void
        self._release(lease)
        self.loop.post(self._line_again, pending, lease)

    def _line_again(self, pending: Pending, lease: Lease) -> None:
        if pending.done:
            return
        if not lease.released:  # the release is being retried: wait under another holder id
            del self.pending[pending.holder]
            pending.holder = new_holder_id()
            self.pending[pending.holder] = pending
        self._set_queued(pending, False)
        pending.granted = False
        pending.position = None
        self.line.appendleft(pending)
        self._pump()

    def _drop(self, pending: Pending) -> None:
        """Forget a pending request (it runs, is requeued, failed or revoked)."""
        if pending.done:
            return
        pending.done = True
        self._set_queued(pending, False)
        self.pending.pop(pending.holder, None)
        try:
            self.line.remove(pending)
        except ValueError:
            pass
        self.backend.unwatch(pending.guard.name, pending.holder)
        self.consumer.qos.decrement_eventually()

    # -- completion --------------------------------------------------------------------------

    def _track(self, request: Any) -> None:
        """Wrap the request's pool callbacks: release its lease, and look for free processes."""
        on_success, on_failure = request.on_success, request.on_failure

        def success(*args: Any, **kwargs: Any) -> Any:
            try:
                return on_success(*args, **kwargs)
            finally:
                self._finished(request)

        def failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return on_failure(exc_info, *args, **kwargs)
            finally:
                self._finished(request, getattr(exc_info, "exception", None))

        def time_limit(soft: bool, timeout: float) -> Any:  # billiard passes timeout=...
            try:
                return on_timeout(soft, timeout)
            finally:
                if not soft:  # the gevent pool never calls on_failure for a hard limit
                    self._finished(request, TimeLimitExceeded(timeout))

        on_timeout = request.on_timeout
        request.on_success, request.on_failure, request.on_timeout = success, failure, time_limit

    def _finished(self, request: Any, exc: Optional[BaseException] = None) -> None:
        with self.lock:
            entry: Optional[Held] = getattr(request, "semaphore_held", None)
            if entry is not None and self.held.pop(entry.lease.holder, None) is not None:
                pid = request.worker_pid
                exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
                if isinstance(exc, CHILD_KILLED) and pid and self._pool_forks():
                    # Celery reports these before the pool child has died; the body may
                    # still run (a finally block, a handler): keep the slot until it exits.
                    self.io.call(self._release_after_exit, entry.lease, pid,
                                 time.monotonic() + CHILD_EXIT_WAIT)
                else:
                    default_keeper.discard(entry.lease)
                    self.io.call(self._release, entry.lease)
            self._pump()

    def _pool_forks(self) -> bool:
        """True for the prefork pool, whose killed tasks may run until their process exits;
        other pools run tasks in this process (gevent's ``worker_pid`` is a greenlet's id)."""
        return isinstance(self.consumer.pool, PreforkPool)

    def _release_after_exit(self, lease: Lease, pid: int, deadline: float) -> None:  # I/O
        # At worker shutdown the pool has been stopped first: release now, not never.
        if self._running and process_alive(pid) and time.monotonic() < deadline:
            self.io.call(self._release_after_exit, lease, pid, deadline, delay=0.005)
            return
        default_keeper.discard(lease)
        self._release(lease)

    def _on_task_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        task_id = getattr(request, "id", None)
        if task_id is None:
            return
        self.loop.post(self._revoked, task_id)

    def _revoked(self, task_id: str) -> None:
        for entry in list(self.held.values()):
            request = entry.request
            if (request.id == task_id and request.time_start is None
                    and getattr(request, "_already_revoked", False)):
                # Revoked or expired before a pool process took it: no pool callback comes.
                # (Another delivery of the same task id may hold a slot too, and run.)
                self._finished(request)

    def _release(self, lease: Lease, retry: float = RETRY_FIRST) -> None:  # I/O thread
        """Release ``lease``; while the backend cannot be reached, try again with backoff
        until it answers or the lease would have expired anyway (its TTL then frees it)."""
        try:
            if not lease.release() and not lease.lost:
                logger.debug("celery-semaphore: lease %r had expired before release", lease)
        except Exception as exc:
            self._retry(self._release, lease, retry, lease.remaining, f"releasing {lease!r}",
                        exc)

    def _retry(self, fn: Callable[..., None], subject: Any, retry: float, left: float,
               what: str, exc: BaseException) -> None:  # I/O thread
        """Call ``fn(subject, next_retry)`` again in ``retry`` seconds while that is within
        ``left`` seconds and the worker runs; else log that the backend's expiry frees it."""
        if self._running and retry < left:
            if retry == RETRY_FIRST:
                logger.warning("celery-semaphore: %s failed, retrying until the backend "
                               "answers: %s", what, exc)
            self.io.call(fn, subject, min(retry * 2, RETRY_MAX), delay=retry)
        else:
            logger.warning("celery-semaphore: %s failed (the backend's expiry frees it): %s",
                           what, exc)

    def _lease_lost(self, entry: Held) -> None:
        if self.held.get(entry.lease.holder) is not entry:
            return
        policy = entry.guard.settings.on_lost_lease
        logger.error("celery-semaphore: task %s lost its slot of %r (token %s); policy: %s",
                     entry.request.id, entry.lease.name, entry.lease.token, policy)
        if policy == "terminate":
            entry.request.terminate(self.consumer.pool, signal="SIGTERM")

    # -- bounds, requeue, failure ------------------------------------------------------------

    def _tick(self) -> None:  # I/O thread, every poll interval
        if not self._running:
            return
        self.loop.post(self._check_bounds)
        self.io.call(self._tick, delay=self.settings.poll_interval)

    def _check_bounds(self) -> None:
        now, wall = time.monotonic(), time.time()
        for pending in list(self.pending.values()):
            settings = pending.guard.settings
            if pending.request.revoked():  # Celery's own test; announces and acks
                self._drop(pending)
                self.io.call(self._cancel_in_backend, pending)
            elif settings.max_wait is not None and wall - pending.first_wait > settings.max_wait:
                self._drop(pending)
                self.io.call(self._cancel_in_backend, pending)
                self._fail(pending.request, SemaphoreTimeout(
                    f"no slot of semaphore {pending.guard.name!r} in {settings.max_wait}s "
                    f"(semaphore_max_wait)"))
            elif now - pending.entered > settings.worker_max_hold:
                self._requeue(pending)
        self._check_orphans()
        self._pump()

    def _requeue(self, pending: Pending) -> None:
        """Publish a copy of the message with a backoff ETA, then ack the original."""
        self._drop(pending)
        countdown = self._backoff(pending)
        logger.debug("celery-semaphore: requeueing %s in %.2fs", pending.request.id, countdown)
        self.io.call(self._republish, pending, countdown)

    def _backoff(self, pending: Pending) -> float:
        settings = pending.guard.settings
        delay = min(settings.retry_backoff * 2 ** pending.requeues, settings.retry_backoff_max)
        if settings.retry_jitter:
            delay = random.uniform(delay / 2, delay)
        return delay

    def _republish(self, pending: Pending, countdown: float) -> None:  # I/O thread
        self._cancel_in_backend(pending)
        request = pending.request
        message = request.message
        headers = dict(message.headers)
        headers[REQUEUES_HEADER] = pending.requeues + 1
        headers[FIRST_WAIT_HEADER] = pending.first_wait
        headers["eta"] = (datetime.now(timezone.utc) + timedelta(seconds=countdown)).isoformat()
        properties = dict(message.properties or {})
        delivery = request.delivery_info or {}
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(
                    message.body,
                    exchange=delivery.get("exchange") or "",
                    routing_key=delivery.get("routing_key"),
                    headers=headers,
                    content_type=message.content_type,
                    content_encoding=message.content_encoding,
                    correlation_id=properties.get("correlation_id"),
                    reply_to=properties.get("reply_to"),
                    priority=delivery.get("priority"),
                    delivery_mode=properties.get("delivery_mode", 2),
                    retry=True,
                    retry_policy={"max_retries": 3},
                )
        except Exception as exc:
            logger.warning("celery-semaphore: requeue of %s failed, rejecting for redelivery: %s",
                           request.id, exc)
            self.loop.post(self._settle_requeued, request, False)
            return
        self.loop.post(self._settle_requeued, request, True)

    def _settle_requeued(self, request: Any, republished: bool) -> None:
        if republished:
            request.acknowledge()
        else:
            request.reject(requeue=True)
        worker_state.task_ready(request)

    def _cancel_in_backend(self, pending: Pending, retry: float = RETRY_FIRST) -> None:  # I/O
        """Leave the backend's queue (and release a grant whose reply may have been lost),
        retrying like :meth:`_release` until the entry would have expired anyway."""
        if not pending.last_attempt:  # it never reached the backend's queue
            return
        try:
            if pending.maybe_granted:  # a grant whose reply was lost would hold a slot
                self.backend.abandon(pending.guard.name, pending.holder)
            else:
                self.backend.cancel(pending.guard.name, pending.holder)
        except Exception as exc:
            expires = (pending.guard.settings.lease_ttl if pending.maybe_granted
                       else self.backend.waiter_ttl)
            left = pending.last_attempt + expires - time.monotonic()
            self._retry(self._cancel_in_backend, pending, retry, left,
                        f"leaving the queue of {pending.guard.name!r}", exc)

    def _fail(self, request: Any, exc: BaseException) -> None:
        """Fail a request that may never run guarded (bad template, max wait passed)."""
        logger.error("celery-semaphore: task %s[%s] failed: %s", request.name, request.id, exc)
        try:
            request.task.backend.mark_as_failure(
                request.id, exc, request=request._context, store_result=request.store_errors
            )
        except Exception as store_exc:
            logger.warning("celery-semaphore: storing the failure of %s failed: %s",
                           request.id, store_exc)
        request.send_event("task-failed", exception=repr(exc), traceback="")
        request.acknowledge()
        worker_state.task_ready(request)

    # -- introspection (remote control) -----------------------------------------------------

    def snapshot(self) -> Dict[str, List[Dict[str, Any]]]:
        with self.lock:
            return {
                "waiting": [
                    {"id": p.request.id, "task": p.request.name, "semaphore": p.guard.name,
                     "position": p.position, "queued": p.queued,
                     "waited": round(time.monotonic() - p.entered, 3),
                     "requeues": p.requeues}
                    for p in self.pending.values()
                ],
                "held": [
                    {"id": h.request.id, "task": h.request.name, "semaphore": h.lease.name,
                     "holder": h.lease.holder, "token": str(h.lease.token)}
                    for h in self.held.values()
                ],
            }
