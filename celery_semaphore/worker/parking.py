"""The waiting room: a worker keeps only the requests it can start soon; the rest of a backlog
is parked in the broker, per semaphore, in order, and pulled back the moment this worker has
room for it.

Where: one durable queue per semaphore name on the task broker (``<key_prefix>park.<name>``;
a list on Redis, a durable classic queue on RabbitMQ, a folder on the filesystem transport),
published to through kombu with persistent messages, so parked tasks are exactly as durable as
queued ones and the broker's own tooling shows them.

How: a guarded request that arrives while this worker already holds
``semaphore_worker_max_waiting`` waiting requests, or has waited past
``semaphore_worker_max_hold``, is copied to the parking queue, and the original is acked once
the copy is published (at-least-once: a kill in between leaves both, never neither). Whenever a
request of that semaphore leaves this worker's waiting line (it got its slot, failed, was
revoked), the worker pulls parked ones (``basic_get``, unacked) and feeds them through Celery's
own task strategy (received event, revoke and expiry checks, the gate), acking each on the
parking channel when Celery acks the request. A pulled request is never parked again for being
one too many. Tasks parked on send (:mod:`celery_semaphore.waiting_room`) come the same way,
announced by a doorbell message in their task queue: the worker that takes it pulls, looks
again :data:`RECHECK_AFTER` later (for tasks sent after the doorbell that its first pull
missed) and tells the others. Workers learn that a semaphore has parked requests from a
doorbell, from a broadcast (``semaphore_parked``, at most once a second per name from a
worker that parked requests or took a doorbell) and from the parking queues of the backend's
semaphores, probed at worker start.

Threads: the parking connection belongs to the I/O thread; the loop thread decides.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

from celery.worker.control import control_command
from kombu import Producer, Queue
from vine import promise

from ..exceptions import SemaphoreTimeout
from ..waiting_room import (
    ANNOUNCE_EVERY,
    DOORBELL_EVERY,
    DOORBELL_HEADER,
    FIRST_WAIT_HEADER,
    PARKED_BY_HEADER,
    PARKED_HEADER,
    ROUTE_HEADER,
    lane_of,
    parked_counts,
    parking_queue,
    semaphore_of,
)
from . import celery_internals
from .headers import lane_or_none
from .requeue import publish_copy
from .waiter import Waiter

if TYPE_CHECKING:
    from .gate import Gate

logger = logging.getLogger(__name__)

#: After a doorbell, pull once more this much later: a sender rings at most once every
#: :data:`DOORBELL_EVERY`, so what it parked after ringing is there by then.
RECHECK_AFTER = 2.5 * DOORBELL_EVERY
#: Requests of one semaphore a worker holds waiting, per pool process.
SHARE_PER_PROCESS = 2
#: Parked tasks a worker remembers, to announce their revocation or max-wait failure while
#: they are parked (the oldest are forgotten first; they are still judged when pulled).
MAX_TRACKED = 100_000
#: Messages one pull takes at most.
PULL_BATCH = 16


@dataclass
class ParkedTask:
    """What a worker keeps of a task it parked: enough to announce it revoked or timed out
    while it is parked (a few hundred bytes; the message itself is in the broker)."""

    task_id: str
    task_name: str
    semaphore: str
    stamps: Optional[Dict[str, Any]]
    deadline: Optional[float]  # Unix time semaphore_max_wait runs out


class ParkingLot:
    """Parks and pulls one worker's guarded requests. See the module docstring."""

    def __init__(self, gate: "Gate") -> None:
        self.gate = gate
        # loop thread
        self.known: Set[str] = set()  # lanes whose parking queue may hold requests
        self.lanes: Dict[str, Deque[str]] = {}  # semaphore -> its known lanes, in turn
        self.pulling: Dict[str, int] = {}  # lane -> gets on their way
        self.parking: Dict[str, int] = {}  # name -> copies being published
        self._announced: Dict[str, float] = {}
        self.tracked: "OrderedDict[str, ParkedTask]" = OrderedDict()  # task id -> parked task
        self._deadlines: List[Tuple[float, str]] = []  # heap of (deadline, task id)
        self._revocations: Tuple[int, int] = (0, 0)
        self.parked_total: Counter = Counter()  # name -> requests this worker parked
        self.pulled_total: Counter = Counter()  # name -> requests this worker pulled back
        # I/O thread
        self._connection: Any = None
        self._declared: Set[str] = set()
        # name -> pulled messages not acked or rejected yet (loop and I/O threads)
        self._unsettled: Counter = Counter()
        self._unsettled_lock = threading.Lock()

    # -- decisions (loop thread) -------------------------------------------------------------

    def room(self, name: str) -> int:
        """How many more requests of ``name`` this worker should hold waiting, counting those
        it is pulling: what it can start soon (:data:`SHARE_PER_PROCESS` per pool process),
        within ``semaphore_worker_max_waiting`` in all. The rest wait in the parking queue,
        where any worker with room takes them, and a hot semaphore does not crowd out the
        others."""
        admission = self.gate.admission
        share = (SHARE_PER_PROCESS * admission.pool_size() - admission.count(name)
                 - sum(self.pulling.get(lane, 0) for lane in self.lanes.get(name, ())))
        total = (self.gate.settings.worker_max_waiting - len(admission)
                 - sum(self.pulling.values()))
        return min(share, total)

    def park(self, waiter: Waiter, why: str) -> None:
        """Take ``waiter`` out of this worker and park it (its message is acked once the
        parked copy is published)."""
        name = lane_of(waiter.guard.name, waiter.guard.fair)
        self.gate.admission.drop(waiter)
        self.gate.admission.leave_backend(waiter)
        self.parking[name] = self.parking.get(name, 0) + 1
        logger.debug("celery-semaphore: parking %s (%s)", waiter.request.id, why)
        # stored before the copy exists: never after it ran
        self.gate.reporting.waiting(waiter, None, waiter.guard.limit, parked=True)
        self.gate.io.call(self._park, waiter, name)

    def give_back(self, waiter: Waiter) -> None:
        """The consumer stops with ``waiter``, pulled from the waiting room, still waiting:
        its message goes back to the parking queue (a reject on the parking channel; after a
        lost connection :meth:`reset` has put it back already, and the reject on the closed
        channel does nothing), the other workers are told, and this worker pulls the lane
        again once the consumer runs (loop thread)."""
        waiter.request.acknowledged = True  # settled here, not on the consumer's channel
        lane = lane_of(waiter.guard.name, waiter.guard.fair)
        self.gate.io.call(self._reject, waiter.request.message)
        # the others may have forgotten this lane (this worker may be leaving for good)
        self.gate.io.call(self._announce, lane)
        self._know(lane)

    def refill(self, name: str) -> None:
        """Pull parked requests of semaphore ``name`` (or of a lane's semaphore) while this
        worker has room for them: from its lanes in turn (with ``semaphore_fair_by``, one per
        fair key), an equal part of the room each, the next refill starting at the next lane,
        so that the backend's fair queue sees every key that has parked requests."""
        semaphore = semaphore_of(name)
        lanes = self.lanes.get(semaphore)
        if not lanes or not self.gate.open:
            return
        want = min(self.room(semaphore), PULL_BATCH)
        part = max(1, want // len(lanes))
        for _ in range(len(lanes)):
            if want <= 0:
                break
            lane = lanes[0]
            lanes.rotate(-1)
            take = min(part, want)
            want -= take
            self.pulling[lane] = self.pulling.get(lane, 0) + take
            self.gate.io.call(self._pull, lane, take)

    def refill_all(self) -> None:
        for semaphore in list(self.lanes):
            self.refill(semaphore)

    def _know(self, lane: str) -> None:
        if lane not in self.known:
            self.known.add(lane)
            self.lanes.setdefault(semaphore_of(lane), deque()).append(lane)

    def _forget(self, lane: str) -> None:
        if lane in self.known:
            self.known.discard(lane)
            lanes = self.lanes[semaphore_of(lane)]
            lanes.remove(lane)
            if not lanes:
                del self.lanes[semaphore_of(lane)]

    def learn(self, name: str) -> None:
        """Another worker parked requests of lane ``name``."""
        self._know(name)
        self.refill(name)

    def doorbell(self, name: str) -> None:
        """A sender parked tasks of ``name`` (its doorbell reached this worker): pull them,
        look again :data:`RECHECK_AFTER` later, and tell the other workers, every time (a
        sender rings at most every :data:`DOORBELL_EVERY`; this worker may have no room for
        them, and another that has may have found the queue empty since it last heard)."""
        self.learn(name)
        self.gate.io.call(self.gate.loop.post, self.learn, name, delay=RECHECK_AFTER)
        self._announced[name] = time.monotonic()
        self.gate.io.call(self._announce, name)

    def parked(self, waiter: Waiter, name: str, published: bool) -> None:
        self.parking[name] -= 1
        if not self.parking[name]:
            del self.parking[name]
        request = waiter.request
        if not published:  # what the waiting room cannot take goes the requeue way
            self.gate.requeue.requeue(waiter)
            return
        request.acknowledge()
        celery_internals.task_ready(request)
        self.parked_total[semaphore_of(name)] += 1
        self.gate.tally.add(semaphore_of(name), "parked_worker")
        self._track(waiter)
        self.gate.admission.pump()
        self._know(name)
        self._announce_soon(name)

    def _announce_soon(self, name: str) -> None:
        """Broadcast that ``name`` has parked requests, at most once a second."""
        now = time.monotonic()
        if now - self._announced.get(name, 0.0) >= ANNOUNCE_EVERY:
            self._announced[name] = now
            self.gate.io.call(self._announce, name)

    # -- parked tasks revoked or past semaphore_max_wait (loop thread) ------------------------

    def _track(self, waiter: Waiter) -> None:
        request, settings = waiter.request, waiter.guard.settings
        deadline = None if settings.max_wait is None else waiter.first_wait + settings.max_wait
        task = ParkedTask(request.id, request.name, waiter.guard.name, request.stamps or None,
                          deadline)
        self.tracked[request.id] = task
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request.id))
        while len(self.tracked) > MAX_TRACKED:
            self.tracked.popitem(last=False)

    def check_tracked(self) -> None:
        """Announce parked tasks revoked since the last check (REVOKED stored, task-revoked
        sent) and fail those whose ``semaphore_max_wait`` ran out, as for waiting ones. Their
        messages stay parked until pulled, when Celery (or the gate) discards them again."""
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, task_id = heapq.heappop(self._deadlines)
            task = self.tracked.pop(task_id, None)
            if task is not None:
                self.gate.fail_parked(task.task_id, task.task_name, SemaphoreTimeout(
                    f"no slot of semaphore {task.semaphore!r} in its semaphore_max_wait "
                    f"(parked)"))
        revocations = celery_internals.revocations()
        if revocations == self._revocations:
            return
        self._revocations = revocations
        for task in list(self.tracked.values()):
            if celery_internals.is_revoked(task.task_id, task.stamps):
                del self.tracked[task.task_id]
                self.gate.reporting.revoked_parked(task.task_id, task.task_name)

    def _pulled(self, name: str, asked: int, messages: List[Any], empty: bool) -> None:
        self.pulling[name] -= asked
        if not self.pulling[name]:
            del self.pulling[name]
        if empty:
            self._forget(name)
        if not self.gate.open:  # the consumer stopped meanwhile: they wait for another pull
            if messages:
                self._know(name)
            for message in messages:
                self.gate.io.call(message.reject_log_error, logger, (), True)
            return
        if messages:
            self.pulled_total[semaphore_of(name)] += len(messages)
            sent = sum(1 for m in messages if PARKED_BY_HEADER not in (m.headers or {}))
            if sent:  # parked on send: counted when first pulled
                self.gate.tally.add(semaphore_of(name), "parked_send", sent)
        for message in messages:
            self._deliver(message, name)
        if (messages and not empty) or (empty and semaphore_of(name) in self.lanes):
            self.refill(name)  # more of this lane, or the room it left to the others

    def _deliver(self, message: Any, name: str) -> None:
        """Hand a message pulled from lane ``name`` to Celery's strategy for its task, as the
        consumer does for a delivery, with acks and rejects going to the parking channel on
        the I/O thread. (Counted under the lane it came from, never under its
        ``semaphore_parked`` header, which the gate checks: :mod:`.headers`.)"""
        self.tracked.pop(message.headers.get("id"), None)
        route = message.headers.get(ROUTE_HEADER)
        if isinstance(route, (list, tuple)) and len(route) == 2:  # retries go where it was sent
            message.delivery_info.update(exchange=route[0], routing_key=route[1])
        consumer = self.gate.consumer
        strategy = consumer.strategies.get(message.headers.get("task"))
        if strategy is None:  # not a task this worker knows: leave it for one that does
            self.gate.io.call(message.reject_log_error, logger, (), True)
            return
        with self._unsettled_lock:
            self._unsettled[name] += 1
        try:
            strategy(message, None,
                     promise(self.gate.io.call, (self._settle, message, name, True)),
                     promise(self.gate.io.call, (self._settle, message, name, False)),
                     consumer.on_task_message)
        except Exception:  # as the consumer does for a delivery: the rest of the pull goes on
            logger.exception("celery-semaphore: cannot take pulled %s; it goes back",
                             message.delivery_tag)
            self.gate.io.call(self._reject, message, name)

    # -- broker calls (I/O thread) -----------------------------------------------------------

    def _queue(self, name: str) -> Queue:
        return parking_queue(self.gate.settings.key_prefix, name,
                             self._connection.transport.driver_type)

    def _channel(self) -> Any:
        if self._connection is None:
            self._connection = self.gate.app.connection_for_write()
            self._declared.clear()
        self._connection.ensure_connection(max_retries=1, interval_start=0)
        return self._connection.default_channel

    def _declared_queue(self, name: str) -> Queue:
        channel = self._channel()
        queue = self._queue(name)(channel)
        if queue.name not in self._declared:
            queue.declare()
            self._declared.add(queue.name)
        return queue

    def _lost(self, exc: BaseException, what: str) -> None:
        """A call on the parking connection failed (I/O thread): every message pulled on it
        and not settled goes back to its parking queue (:meth:`reset`), and this worker lets
        go of those still waiting (:meth:`_let_go_of_pulled`) rather than run them beside
        their next pull."""
        logger.warning("celery-semaphore: %s: broker unavailable: %s", what, exc)
        self.reset()
        self.gate.loop.post(self._let_go_of_pulled)

    def _let_go_of_pulled(self) -> None:  # loop thread
        admission = self.gate.admission
        for waiter in [w for w in admission.waiters.values() if w.pulled]:
            if admission.drop(waiter):
                admission.leave_backend(waiter)
                waiter.request.acknowledged = True  # its message is back in the broker
                celery_internals.task_ready(waiter.request)

    def _park(self, waiter: Waiter, name: str) -> None:
        try:
            queue = self._declared_queue(name)
            delivery = waiter.request.delivery_info or {}
            route = [delivery.get("exchange") or "", delivery.get("routing_key")]
            publish_copy(Producer(queue.channel, auto_declare=False), waiter.request, "",
                         queue.name, {PARKED_HEADER: name,
                                      FIRST_WAIT_HEADER: waiter.first_wait,
                                      PARKED_BY_HEADER: "worker",
                                      ROUTE_HEADER: route,
                                      "eta": None},  # it was due already
                         delivery_mode=2)
        except Exception as exc:
            self._lost(exc, f"parking {waiter.request.id}, requeueing it")
            self.gate.loop.post(self.parked, waiter, name, False)
            return
        self.gate.loop.post(self.parked, waiter, name, True)

    def _pull(self, name: str, want: int) -> None:
        messages: List[Any] = []
        empty = False
        try:
            queue = self._declared_queue(name)
            while len(messages) < want:
                message = queue.get(no_ack=False)
                if message is None:
                    empty = True
                    break
                messages.append(message)
        except Exception as exc:
            self._lost(exc, f"pulling parked requests of {name!r}")
            messages, empty = [], False  # back in the broker with the connection
        self.gate.loop.post(self._pulled, name, want, messages, empty)

    def _settle(self, message: Any, name: str, ack: bool, log: Any, errors: Any,
                requeue: bool = False) -> None:
        """Ack or reject a pulled message as Celery asked (I/O thread)."""
        if ack:
            message.ack_log_error(log, errors)
        else:
            message.reject_log_error(log, errors, requeue)
        self._settled(name)
        if not ack and requeue:  # back in its parking queue, which workers may have forgotten
            self.gate.loop.post(self.learn, name)
            self._announce(name)

    def _settled(self, name: str) -> None:
        with self._unsettled_lock:
            self._unsettled[name] -= 1
            if self._unsettled[name] <= 0:
                del self._unsettled[name]

    def _reject(self, message: Any, name: Optional[str] = None) -> None:
        try:
            message.reject(requeue=True)
        except Exception as exc:  # a closed channel's messages go back all the same
            logger.debug("celery-semaphore: giving back pulled %s failed: %s",
                         message.delivery_tag, exc)
        self._settled(name if name is not None else message.headers.get(PARKED_HEADER))

    def reset(self) -> None:
        """The consumer lost its broker connection (I/O thread): every message pulled from
        the waiting room and not settled yet goes back to its parking queue, and those
        semaphores are pulled again. On a Redis broker the messages are taken out of the
        parking channel's unacked set and restored once the broker answers (as the gate does
        for its own channel); AMQP requeues a closed channel's unacked messages itself."""
        connection, self._connection = self._connection, None
        with self._unsettled_lock:
            names = set(self._unsettled)
            self._unsettled.clear()
        if connection is None:
            return
        tags = celery_internals.detach_all_unacked(connection)
        try:
            connection.close()
        except Exception:
            pass
        if tags:
            self.gate.restore_detached(tags, names)
        else:
            for name in names:
                self.gate.loop.post(self.learn, name)

    def _announce(self, name: str) -> None:
        try:
            self.gate.app.control.broadcast("semaphore_parked", arguments={"name": name},
                                            connection=self._connection)
        except Exception as exc:
            logger.debug("celery-semaphore: announcing parked %r failed: %s", name, exc)

    def discover(self, names: List[str]) -> None:  # I/O thread, at worker start
        """Learn which of ``names`` have parked requests (a worker that starts after the
        others parked a backlog, or after the whole cluster restarted)."""
        try:
            counts = parked_counts(self.gate.app, self.gate.settings.key_prefix, names)
        except Exception as exc:
            logger.warning("celery-semaphore: cannot look for parked tasks: broker: %s", exc)
            return
        for name, count in counts.items():
            if count:
                self.gate.loop.post(self.learn, name)

    def close(self) -> None:  # I/O thread, at shutdown, after the last ack
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception:
                pass


def doorbell_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's task strategy for the doorbell task (``Task.Strategy``): the worker's main
    process acks the message and learns that its semaphore has parked tasks; no request is
    built, nothing runs in the pool, no task event is sent."""

    def on_doorbell(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                    **options: Any) -> None:
        ack(logger, consumer.connection_errors)  # as Request.acknowledge calls it
        gate: Optional["Gate"] = getattr(consumer, "semaphore_gate", None)
        raw = (message.headers or {}).get(DOORBELL_HEADER)
        name = lane_or_none(raw)
        if name is None:
            logger.warning("celery-semaphore: ignoring a doorbell whose %s header is not a "
                           "parking lane: %.80r", DOORBELL_HEADER, raw)
        elif gate is not None:
            gate.loop.post(gate.parking.doorbell, name)

    return on_doorbell


@control_command(args=[("name", str)], signature="<semaphore name>")
def semaphore_parked(state: Any, name: str, **kwargs: Any) -> Any:
    """A worker parked requests of semaphore ``name``: pull them when there is room."""
    if lane_or_none(name) is None:  # sent by hand, or by something else than a worker
        logger.warning("celery-semaphore: ignoring a semaphore_parked broadcast whose name is "
                       "not a semaphore name: %.80r", name)
        return {"error": f"name must be a semaphore name, not {name!r:.80}"}
    gate: Optional["Gate"] = getattr(state.consumer, "semaphore_gate", None)
    if gate is not None:
        gate.loop.post(gate.parking.learn, name)
    return {"ok": "learned"}
