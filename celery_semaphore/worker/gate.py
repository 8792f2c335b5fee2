"""The worker gate: guarded requests wait for a slot in the worker's main process.

Where it sits: Celery hands every request that is due (after ETA and rate limits) to
``consumer.on_task_request``; the gate wraps that callable. An unguarded request passes straight
through. A guarded one is held in the main process (never in a pool process) until the backend
grants a slot, then handed to the pool with its lease.

Its parts, which the gate assembles and none of which imports it: :mod:`.core` (every
decision about a waiting request: events in, commands out, no threads, no Celery),
:mod:`.admission` (the shell that feeds the core and carries out its commands),
:mod:`.context` (what the parts share), :mod:`.threads` (the loop thread owns every state,
one I/O thread calls out),
:mod:`.waiter` (a waiting request's state machine), :mod:`.parking` (the waiting room, whose
pulling decisions are a core of their own: :mod:`.lanes`),
:mod:`.release` (release on every ending), :mod:`.requeue` (when the waiting room cannot take
a request), :mod:`.outcomes` (every result-backend write, in order), :mod:`.reporting`
(events, WAITING, remote control), :mod:`.settlements` (what a lost connection could not
settle), :mod:`.tally` (worker-side counts) and :mod:`.celery_internals` (every touch of
Celery's internals).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

from ..backends import close_all
from ..backends.base import Backend
from ..exceptions import ConfigurationError, SemaphoreError
from ..guards import Guards
from ..settings import Settings
from ..waiting_room import PARKED_HEADER
from . import celery_internals
from .admission import Admission
from .context import GateContext, GateState
from .core import How
from .headers import check_gate_headers
from .outcomes import Outcomes
from .parking import ParkingLot
from .release import Releases
from .reporting import Reporting, snapshot
from .requeue import Requeue
from .settlements import Settlements
from .tally import Tally
from .threads import RETRY_FIRST, RETRY_MAX

logger = logging.getLogger(__name__)


class Gate:
    """Holds guarded requests until the semaphore admits them. See the module docstring.

    The gate is the assembly: it builds the parts around one :class:`.GateContext`, hands
    each the parts it calls, wraps the consumer's entry points, and runs the lifecycle
    (start, stop on a reconnect, shutdown). No part reaches back to it."""

    def __init__(self, consumer: Any, settings: Settings, backend: Backend) -> None:
        self.consumer = consumer
        self.guards = Guards(settings)
        # Requests to hand to the pool once the lock is released: with prefork's putlocks the
        # pool can block in apply_async until its result thread, which needs the lock to run
        # our completion callbacks, frees a process.
        self.handoffs: Deque[Any] = deque()
        ctx = self.ctx = GateContext(consumer, settings, backend, self.flush_handoffs)

        def capacity_changed() -> None:  # a slot or a process freed: the line may move
            self.admission.pump()

        self.tally = Tally(ctx)
        self.settlements = Settlements(ctx)
        self.outcomes = Outcomes(ctx, capacity_changed)
        self.reporting = Reporting(ctx, self.outcomes)
        self.requeue = Requeue(ctx, self.tally, capacity_changed)
        self.parking = ParkingLot(ctx, self.settlements, self.tally, self.requeue,
                                  self.reporting)
        self.releases = Releases(ctx, self.settlements, self.parking.dropped_by_pool,
                                 capacity_changed)
        self.admission = Admission(ctx, self.parking, self.releases, self.requeue,
                                   self.reporting, self.outcomes,
                                   hand_off=self.handoffs.append, give_back=self.give_back)
        self.parking.serve(self.admission)
        consumer.semaphore_parking = self.parking  # its doorbell strategy finds it there
        self.original: Callable[[Any], Any] = consumer.on_task_request
        consumer.on_task_request = self.on_task_request
        self._on_connection_lost = consumer.on_connection_error_after_connected
        consumer.on_connection_error_after_connected = self.on_connection_lost
        self._connected_at_stop = False
        #: Rejects to make once :meth:`stop` has let go of the lock (loop thread).
        self._rejects: List[Callable[[], Any]] = []

    @property
    def backend(self) -> Backend:
        return self.ctx.backend

    @property
    def running(self) -> bool:
        """Leases are kept and released (the worker has not shut down)."""
        return self.ctx.running

    def snapshot(self) -> Dict[str, Any]:
        """What ``celery semaphore workers`` shows of this worker (any thread)."""
        with self.ctx.lock:
            return snapshot(self.admission.waiters.values(), self.releases.held.values(),
                            self.parking.parked_total, self.parking.pulled_total)

    # -- lifecycle (consumer bootstep) -------------------------------------------------------

    def start(self) -> None:
        ctx = self.ctx
        ctx.loop.hub = self.consumer.hub
        ctx.loop.start()
        if ctx.state is GateState.NEW:
            ctx.io.call(self._tick, delay=ctx.settings.poll_interval)
            self.releases.connect()
        ctx.state = GateState.OPEN
        ctx.loop.post(self.parking.refill_all)  # what a reconnect gave back

    def stop(self) -> None:
        """The consumer stops (shutdown or reconnect): give waiting requests back.

        With the broker connection still open they are rejected for redelivery. Once it is
        closed or lost, the broker has them back already (AMQP requeues a closed channel's
        unacked messages, kombu's virtual transports restore them when the channel closes,
        and :meth:`on_connection_lost` restores those of a Redis broker), and a reject on the
        dead channel would only log a CRITICAL traceback per request. Requests pulled from
        the waiting room are settled on the parking channel instead (:meth:`.ParkingLot.
        give_back`), and their semaphores are pulled again once the consumer runs. The
        rejects go out after the gate's lock is released (no lock is held across I/O)."""
        self._rejects = []
        with self.ctx.lock:
            if self.ctx.state is GateState.OPEN:
                self.ctx.state = GateState.PAUSED  # pulls still on their way go back
            connected = self._connected_at_stop = celery_internals.consumer_connected(
                self.consumer)
            waiters = list(self.admission.waiters.values())
            if not connected and waiters:
                logger.info("celery-semaphore: the broker connection is closed with %d tasks "
                            "waiting for a slot; the broker delivers them again", len(waiters))
            for waiter in waiters:
                self.admission.leave(waiter, How.GIVE_BACK)
            pulled = sum(1 for waiter in waiters if waiter.pulled)
            if not connected and pulled:  # given back on the parking connection, which the
                # lost connection reset (ParkingLot.reset): they land once the broker answers
                logger.info("celery-semaphore: %d tasks that were waiting when the broker "
                            "connection was lost go back to their queue", pulled)
            bells = self.parking.let_go_of_bells()
            if connected:
                self._rejects += [functools.partial(m.reject, requeue=True) for m in bells]
            self.releases.after_flush()
        rejects, self._rejects = self._rejects, []
        for reject in rejects:  # the consumer's channel: this (the loop) thread's
            try:
                reject()
            except Exception as exc:  # the broker redelivers it all the same
                logger.debug("celery-semaphore: giving back a message on stop failed: %s",
                             exc)
        self.ctx.loop.stop()

    def give_back(self, waiter: Any) -> None:
        """The consumer stops with ``waiter`` still waiting (it left the core): its message
        goes back to the broker (:meth:`stop`)."""
        request = waiter.request
        if waiter.pulled:
            self.parking.give_back(waiter)
        elif self._connected_at_stop and not waiter.detached:
            # rejected once stop() has let go of the lock
            self._rejects.append(functools.partial(request.reject, requeue=True))
        else:
            request.acknowledged = True  # nothing to settle on this channel
        celery_internals.task_ready(request)

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
        with self.ctx.lock:
            waiters = list(self.admission.waiters.values())
            detached = [w for w in waiters
                        if not w.pulled and celery_internals.detach_unacked(w.request.message)]
            for waiter in detached:
                waiter.detached = True
            bells = [m for m in self.parking.held_bells() if celery_internals.detach_unacked(m)]
            # (the pulled ones are given back by the parking lot: ParkingLot.reset)
            # and whatever else is unacked on the task channel: requests Celery holds and
            # forgets on the reconnect go back; tasks that left for the pool (acknowledged
            # late, or whose ack the broker did not take) are settled as they end
            # (Settlements): closing the lost connection would restore them all through a
            # detached transport, and run them twice
            self.releases.refresh_jobs()
            handed = celery_internals.handed_to_pool(self.releases.in_pool) | {
                r.message.delivery_tag for r in self.handoffs} | self.ctx.in_transit
            others = self.settlements.detach(celery_internals.task_channel(self.consumer),
                                             handed)
        tags = ([w.request.message.delivery_tag for w in detached]
                + [m.delivery_tag for m in bells] + others)
        if tags:
            self.ctx.io.call(self.restore_detached, tags, None, RETRY_FIRST, len(detached),
                             len(bells))
        self.ctx.io.call(self.parking.reset)
        return self._on_connection_lost(exc)

    def restore_detached(self, tags: List[str], then: Optional[Callable[[], None]] = None,
                         retry: float = RETRY_FIRST, waiting: int = 0,
                         doorbells: int = 0) -> None:  # I/O
        """Put messages detached by :meth:`on_connection_lost` back in their queue, retrying
        until the broker answers (or the worker stops: then the transport's visibility
        timeout restores them); then post ``then`` to the loop. ``waiting``: how many of them
        were requests waiting for a slot, ``doorbells``: how many were doorbells this worker
        held; the others are requests Celery held and had not handed to the pool (those it
        had stay: :class:`.Settlements`). The log lines count each kind, so that they agree
        with :meth:`stop`'s count of waiting requests (the pulled ones are counted by the
        parking lot, which gives them back)."""
        try:
            celery_internals.restore_unacked(self.ctx.app, tags)
        except Exception as exc:
            if self.ctx.running:
                self.ctx.io.call(self.restore_detached, tags, then, min(retry * 2, RETRY_MAX),
                                 waiting, doorbells, delay=retry)
            else:
                logger.warning("celery-semaphore: %d tasks stay unacknowledged in the broker "
                               "until its visibility_timeout restores them: %s", len(tags), exc)
            return
        if waiting:
            logger.info("celery-semaphore: %d tasks that were waiting when the broker "
                        "connection was lost are back in their queue", waiting)
        if doorbells:
            logger.info("celery-semaphore: %d doorbells held when the broker connection was "
                        "lost are back in their queue", doorbells)
        if len(tags) > waiting + doorbells:
            logger.info("celery-semaphore: %d tasks not handed to the pool yet, not "
                        "acknowledged when the broker connection was lost, are back in their "
                        "queue (delivered again)", len(tags) - waiting - doorbells)
        if then is not None:
            self.ctx.loop.post(then)

    def shutdown(self) -> None:
        """The worker exits: release every lease still held, then stop the I/O thread."""
        self.stop()
        self.releases.disconnect()
        self.releases.release_all()
        self.ctx.state = GateState.CLOSED
        io = self.ctx.io
        io.call(self.parking.close)  # after the acks and rejects already on their way
        io.call(self.settlements.final_flush)
        io.call(self.tally.flush)
        io.stop()
        close_all()  # this process's backends: wake-up listeners, connections, socket files

    # -- entry -------------------------------------------------------------------------------

    def on_task_request(self, request: Any) -> None:
        self.settlements.watch(getattr(request.message, "channel", None))
        with self.ctx.lock:
            self._admit(request)
        self.flush_handoffs()

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
        if guard is None:
            self.releases.track(request)
            self.handoffs.append(request)
            return
        pulled = PARKED_HEADER in (request.message.headers or {})
        self.admission.arrive(request, guard, pulled)

    def flush_handoffs(self) -> None:
        """Hand granted and unguarded requests to the pool, outside the lock."""
        while self.handoffs:
            try:
                request = self.handoffs.popleft()
            except IndexError:
                return
            self.original(request)
            self.releases.handed_to_pool(request)

    # -- bounds and failure ------------------------------------------------------------------

    def _tick(self) -> None:  # I/O thread, every poll interval
        if not self.ctx.running:
            return
        self.ctx.loop.post(self._check_bounds)
        self.ctx.io.call(self._tick, delay=self.ctx.settings.poll_interval)

    def _check_bounds(self) -> None:
        self.admission.tick()
        self.releases.check_orphans()
        self.parking.check_tracked()
        self.parking.refill_all()
