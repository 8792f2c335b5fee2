"""The waiting room: a worker keeps only the requests it can start soon; the rest of a backlog
is parked in the broker, per lane, in order, and pulled back the moment a worker has room for
it.

Where: one durable queue per lane on the task broker (a lane is a semaphore, or one fair key of
it, *and* the task queue its tasks were routed to: :func:`..waiting_room.lane_of`; a list on
Redis, a durable classic queue on RabbitMQ), published to through kombu with persistent
messages, so parked tasks are exactly as durable as queued ones.

Only semaphores with a backlog use it. A guarded request is admitted the plain way (one
acquire); only when the backend answers "wait" (its semaphore is full, others queue) and this
worker already holds its share of that semaphore's waiters (``core.SHARE_PER_PROCESS`` per pool
process, ``semaphore_worker_max_waiting`` in all), or it waited past
``semaphore_worker_max_hold``, is it copied to its lane's parking queue, and the original
acked once the copy is published (at-least-once: a kill in between leaves both, never
neither). Senders park on send only when the semaphore has a backlog
(:mod:`celery_semaphore.waiting_room`).

Doorbells: whoever parks a task makes sure a *doorbell* for its lane (a tiny persistent
internal message) is in the lane's task queue, so only workers that consume that queue learn
of the lane (Celery's routing holds, whatever path a task takes). A worker that takes a
doorbell *holds* it, unacked, while it pulls the lane, and acks it only once a pull begun at
least :data:`RECHECK_AFTER` after the last doorbell of that lane found the lane empty and no
message it pulled from the lane is unsettled. So while a lane holds parked tasks, its doorbell
is in the task queue or held by a live worker: a worker that dies gives it back with the
tasks it pulled (the broker restores both), and parked tasks are never stranded waiting for a
new send. A worker that holds a doorbell but has no room for the lane rings it again (at most
once every :data:`..waiting_room.RERING_EVERY`), so that another worker consuming the queue
takes a share. Pulled messages go through Celery's own task strategy (received event, revoke
and expiry checks, the gate), acked on the parking channel when Celery acks the request.

Threads: the parking connection belongs to the I/O thread; the loop thread decides.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Protocol, Set, Tuple

from celery.worker.control import control_command
from kombu import Producer, Queue
from kombu.exceptions import OperationalError
from vine import promise

from ..exceptions import SemaphoreTimeout
from ..waiting_room import (
    DOORBELL_EVERY,
    DOORBELL_HEADER,
    FIRST_WAIT_HEADER,
    PARKED_BY_HEADER,
    PARKED_HEADER,
    ROUTE_HEADER,
    lane_of,
    parking_queue,
    queue_of,
    ring,
    semaphore_of,
)
from . import celery_internals
from .claim import Claim
from .context import GateContext
from .headers import lane_or_none
from .lane_guards import SETTLE, LaneBusy, LaneGuards
from .lanes import (
    REFUSE_FOR,
    AckDuplicate,
    Bell,
    Hold,
    LaneBook,
    LaneCommand,
    LetGo,
    Pull,
    Recheck,
    Ring,
)
from .reporting import Reporting
from .requeue import Requeue, publish_copy
from .settlements import EVERY_MESSAGE, Settle, Settlements
from .tally import Tally

logger = logging.getLogger(__name__)

#: Parked tasks a worker remembers, to announce their revocation or max-wait failure while
#: they are parked (the oldest are forgotten first; they are still judged when pulled).
MAX_TRACKED = 100_000
#: Seconds before a lane another worker is deleting (AMQP) is pulled again.
BUSY_RETRY = 1.0
#: Seconds after a lane was proven empty before its parking queue is deleted (AMQP).
DELETE_AFTER = 2.0


class Line(Protocol):
    """What the waiting room asks of the requests waiting in the worker (the gate's core)."""

    def room(self, name: str) -> int:
        """How many more requests of ``name`` this worker should hold waiting."""

    def short_of_processes(self, name: str) -> bool:
        """Requests of ``name`` wait in this worker with every pool process busy."""

    def pump(self) -> None:
        """Something changed that may let the line move."""

    def waiting(self) -> Iterable[Claim]:
        """The requests waiting in this worker."""

    def let_go(self, claims: List[Claim]) -> None:
        """These waiting requests' messages are back in the broker already: they leave."""


@dataclass
class ParkedTask:
    """What a worker keeps of a task it parked: enough to announce it revoked or timed out
    while it is parked (a few hundred bytes; the message itself is in the broker)."""

    task_id: str
    task_name: str
    semaphore: str
    stamps: Optional[Dict[str, Any]]
    deadline: Optional[float]  # Unix time semaphore_max_wait runs out


class BrokerRefused(RuntimeError):
    """The broker answered, and would not take what the waiting room gave it."""


#: Takes whose reply was lost that one worker looks for at most (the others wait for the
#: broker's visibility_timeout).
MAX_LOST_TAKES = 100


class ParkingLot:
    """Parks and pulls one worker's guarded requests. See the module docstring."""

    def __init__(self, ctx: GateContext, settlements: Settlements, tally: Tally,
                 requeue: Requeue, reporting: Reporting) -> None:
        self.ctx = ctx
        self.settlements = settlements
        self.tally = tally
        self.requeue = requeue
        self.reporting = reporting
        #: the line of waiting requests this room refills (:meth:`serve`)
        self.line: Line
        # loop thread
        #: the doorbells held, by lane and semaphore, and the pulls on their way: decisions
        self.book = LaneBook(_LaneSurroundings(self))
        self.parking: Dict[str, int] = {}  # lane -> copies being published
        self._io_rung: Dict[str, float] = {}  # the same for doorbells rung before a park (I/O)
        self.tracked: "OrderedDict[str, ParkedTask]" = OrderedDict()  # task id -> parked task
        self._deadlines: List[Tuple[float, str]] = []  # heap of (deadline, task id)
        self._revocations: Tuple[int, int] = (0, 0)
        self.parked_total: Counter[str] = Counter()  # name -> requests this worker parked
        self.pulled_total: Counter[str] = Counter()  # name -> requests it pulled back
        # I/O thread
        self._connection: Any = None
        self._declared: Set[str] = set()
        #: AMQP: the lanes this worker holds messages of, as the broker sees it
        self.guards = LaneGuards(ctx.settings.key_prefix)
        self._is_amqp: Optional[bool] = None
        self._producer_of: Optional[Tuple[Any, Producer]] = None
        self._returned: List[Any] = []
        # lane -> pulled messages not acked or rejected yet: the I/O thread's count (it pulls
        # and settles them), and the loop thread's (it delivers them, and hears of each
        # settlement)
        self._unsettled: Counter[str] = Counter()
        self.unsettled: Counter[str] = Counter()
        #: when the parking connection's last call failed and none has succeeded since (I/O
        #: thread): one warning per outage, not one per retried call
        self._unavailable_since: Optional[float] = None
        #: failures not the broker's already logged with their traceback (:meth:`_lost`)
        self._faults_seen: Set[Tuple[str, str]] = set()
        #: takes whose reply was lost (I/O thread): (record time, lane, parking queue), put
        #: back by the next pull (:meth:`_put_back_lost_takes`); the last take's record time
        self._lost_takes: List[Tuple[float, str, str]] = []
        self._last_stamp = 0.0

    def serve(self, line: Line) -> None:
        """Refill ``line`` (each needs the other: the line parks here, the room reads the
        line's counts and hands it what it pulls). Called once, before the gate starts."""
        self.line = line

    def doorbell_arrived(self, lane: str, message: Any) -> None:
        """A doorbell of ``lane`` was delivered to this worker (any thread)."""
        self.ctx.loop.post(self.doorbell, lane, message)

    # -- decisions (loop thread) -------------------------------------------------------------

    def publishing(self) -> int:
        """Requests whose parked copy is being published (Celery still counts them
        reserved)."""
        return sum(self.parking.values())

    def room(self, name: str) -> int:
        """How many more requests of ``name`` this worker should hold waiting (the core's
        rule: :meth:`.WorkerCore.room`)."""
        return self.line.room(name)

    def pulling_counts(self, name: str) -> Tuple[int, int]:
        """Requests being pulled: of semaphore ``name`` (from every lane of it), and in all."""
        pulling = self.pulling
        return (sum(pulling.get(lane, 0) for lane in self.lanes.get(name, ())),
                sum(pulling.values()))

    def park(self, claim: Claim, why: str) -> None:
        """Park ``claim``, which left the core (:attr:`.How.PARK`), in its lane (its message
        is acked once the parked copy is published, and a doorbell rung for the lane)."""
        queue = celery_internals.consumed_queue(self.ctx.consumer, claim.request)
        if queue is None:  # no lane whose doorbell would reach the workers of its queue
            self.requeue.requeue(claim)
            return
        lane = lane_of(claim.guard.name, claim.guard.fair, queue.name)
        self.parking[lane] = self.parking.get(lane, 0) + 1
        self.ctx.in_transit.add(claim.request.message.delivery_tag)
        logger.debug("celery-semaphore: parking %s (%s)", claim.request.id, why)
        # stored before the copy exists: never after it ran
        self.reporting.waiting(claim, None, claim.guard.limit, parked=True)
        self.ctx.io.call(self._park, claim, lane, queue)

    def dropped_by_pool(self, request: Any) -> None:
        """The pool's flush on a broker reconnect dropped ``request``'s job (loop thread). If
        it was pulled from the waiting room on a Redis broker, :meth:`reset` kept its message
        unacknowledged for whoever settles it, and nobody will: it goes back to its queue
        (the consumer's own messages of such jobs were put back already)."""
        message = request.message
        channel = getattr(message, "channel", None)
        if (channel is not None and channel is not celery_internals.task_channel(
                self.ctx.consumer) and celery_internals.redis_qos(channel) is not None):
            self.settlements.later(message.delivery_tag, Settle.REQUEUE)

    def give_back(self, claim: Claim) -> None:
        """The consumer stops with ``claim``, pulled from the waiting room, still waiting:
        its message goes back to the parking queue (a reject on the parking channel; after a
        lost connection :meth:`reset` has put it back already, and the reject on the closed
        channel does nothing). The lane's doorbell goes back with the consumer's channel."""
        claim.request.acknowledged = True  # settled here, not on the consumer's channel
        message = claim.request.message
        self.ctx.io.call(self._reject, message, (message.headers or {}).get(PARKED_HEADER))

    @property
    def bells(self) -> Dict[str, Bell]:
        return self.book.bells

    @property
    def lanes(self) -> Dict[str, Deque[str]]:
        return self.book.lanes

    @property
    def pulling(self) -> Dict[str, int]:
        return self.book.pulling

    def refill(self, name: str) -> None:
        """Pull parked requests of semaphore ``name`` (or of a lane's semaphore) while this
        worker has room for them (:meth:`.LaneBook.refill`)."""
        self._run(self.book.refill(name))

    def refill_all(self) -> None:
        self._run(self.book.refill_all())

    def doorbell(self, lane: str, message: Any) -> None:
        """A doorbell of ``lane`` reached this worker (through a queue it consumes): hold it
        (or, holding one already, ack this one) and pull; look again :data:`RECHECK_AFTER`
        later, for what was parked after it was rung."""
        self._run(self.book.doorbell(lane, message, message.delivery_tag))

    def _recheck(self, bell: Bell) -> None:
        self._run(self.book.recheck(bell))

    def _run(self, commands: List[LaneCommand]) -> None:
        """Carry out the lane book's commands, in order (loop thread)."""
        for command in commands:
            if isinstance(command, Pull):
                self.ctx.io.call(self._pull, command.lane, command.want, command.began)
            elif isinstance(command, Recheck):
                self.ctx.io.call(self.ctx.loop.post, self._recheck, command.bell,
                                 delay=command.delay)
            elif isinstance(command, Ring):
                self.ctx.io.call(self._ring, command.lane)
            elif isinstance(command, Hold):
                self.ctx.consumer.qos.increment_eventually()  # held: the consumer fetches on
            elif isinstance(command, AckDuplicate):
                command.message.ack_log_error(logger, self.ctx.consumer.connection_errors)
            elif isinstance(command, LetGo):
                message = command.bell.message
                if command.ack:
                    message.ack_log_error(logger, self.ctx.consumer.connection_errors)
                elif celery_internals.detach_unacked(message):  # not restored when it closes
                    logger.info("celery-semaphore: the doorbell of %r was held longer than the "
                                "broker's visibility_timeout: left unacked for the broker to "
                                "deliver again (another worker may hold it by now)",
                                semaphore_of(command.bell.lane))
                self.ctx.consumer.qos.decrement_eventually()
                if self._amqp():  # proven empty: its parking queue goes, a little later (not
                    # in the way of the releases that end a drain, nor of a lane that refills)
                    self.ctx.io.call(self._delete_lane, command.bell.lane, delay=DELETE_AFTER)

    def _amqp(self) -> bool:
        """Whether the broker is RabbitMQ (AMQP), whose parking queues are real queues."""
        if self._is_amqp is None:
            with self.ctx.app.connection_for_write() as connection:  # not connected
                self._is_amqp = connection.transport.driver_type == "amqp"
        return self._is_amqp

    def held_bells(self) -> List[Any]:
        """The doorbell messages this worker holds."""
        return self.book.held()

    def let_go_of_bells(self) -> List[Any]:
        """The consumer stops: stop holding every doorbell; return their messages, for the
        gate to reject while the connection is open (else the broker has them back
        already)."""
        return self.book.let_go_of_all()

    def parked(self, claim: Claim, lane: str, published: bool) -> None:
        self.parking[lane] -= 1
        if not self.parking[lane]:
            del self.parking[lane]
        request = claim.request
        if not published:  # what the waiting room cannot take goes the requeue way
            self.requeue.requeue(claim)
            return
        self.ctx.in_transit.discard(request.message.delivery_tag)
        request.acknowledge()
        celery_internals.task_ready(request)
        self.parked_total[semaphore_of(lane)] += 1
        self.tally.add(semaphore_of(lane), "parked_worker")
        self._track(claim)
        self.line.pump()

    # -- parked tasks revoked or past semaphore_max_wait (loop thread) ------------------------

    def _track(self, claim: Claim) -> None:
        request, settings = claim.request, claim.guard.settings
        deadline = None if settings.max_wait is None else claim.first_wait + settings.max_wait
        task = ParkedTask(request.id, request.name, claim.guard.name, request.stamps or None,
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
                self.reporting.failed_parked(task.task_id, task.task_name, SemaphoreTimeout(
                    f"no slot of semaphore {task.semaphore!r} in its semaphore_max_wait "
                    f"(parked)"))
        revocations = celery_internals.revocations()
        if revocations == self._revocations:
            return
        self._revocations = revocations
        for task in list(self.tracked.values()):
            if celery_internals.is_revoked(task.task_id, task.stamps):
                del self.tracked[task.task_id]
                self.reporting.revoked_parked(task.task_id, task.task_name)

    def _pulled(self, lane: str, asked: int, messages: List[Any], empty: bool,
                began: float) -> None:
        self.book.pull_landed(lane, asked)
        if messages:  # each is settled once, whatever happens to it (_settled_here)
            self.unsettled[lane] += len(messages)
        bell = self.bells.get(lane)
        if not self.ctx.open:  # the consumer stopped meanwhile: they wait for another pull
            for message in messages:
                self.ctx.io.call(self._reject, message, lane, False)
            return
        if messages:
            self.pulled_total[semaphore_of(lane)] += len(messages)
            sent = sum(1 for m in messages if PARKED_BY_HEADER not in (m.headers or {}))
            if sent:  # parked on send: counted when first pulled
                self.tally.add(semaphore_of(lane), "parked_send", sent)
        for message in messages:
            self._deliver(message, lane)
        if not messages:  # nothing held of it now, perhaps (AMQP: stop holding the lane)
            self.ctx.io.call(self._release_if_idle, lane)
        self._run(self.book.pulled(bell, len(messages), empty, began, lane))

    def _deliver(self, message: Any, lane: str) -> None:
        """Hand a pulled message to Celery's strategy for its task, as the consumer does for a
        delivery, with acks and rejects going to the parking channel on the I/O thread."""
        headers = message.headers or {}
        self.tracked.pop(str(headers.get("id")), None)
        route = headers.get(ROUTE_HEADER)
        if isinstance(route, (list, tuple)) and len(route) == 2:  # retries go where it was sent
            message.delivery_info.update(exchange=route[0], routing_key=route[1])
        consumer = self.ctx.consumer
        strategy = consumer.strategies.get(headers.get("task"))
        if strategy is None:  # not a task this worker knows: leave the lane to the others
            logger.warning("celery-semaphore: parked task %s[%s] is not registered on this "
                           "worker; leaving its lane to the other workers for %gs",
                           headers.get("task"), headers.get("id"), REFUSE_FOR)
            self._run(self.book.refused(lane))
            self.ctx.io.call(self._reject, message, lane, False)
            return
        try:
            strategy(message, None,
                     promise(self.ctx.io.call, (self._settle, message, lane, True)),
                     promise(self.ctx.io.call, (self._settle, message, lane, False)),
                     consumer.on_task_message)
        except Exception:  # as the consumer does for a delivery: the rest of the pull goes on
            logger.exception("celery-semaphore: cannot take pulled %s; it goes back",
                             message.delivery_tag)
            self.ctx.io.call(self._reject, message, lane)

    # -- broker calls (I/O thread) -----------------------------------------------------------

    def _queue(self, lane: str) -> Queue:
        return parking_queue(self.ctx.settings.key_prefix, lane,
                             self._connection.transport.driver_type)

    def _producer(self) -> Producer:
        """A producer on the parking channel whose returned messages (AMQP, ``mandatory``)
        land in ``_returned``."""
        channel = self._channel()
        if self._producer_of is None or self._producer_of[0] is not channel:
            amqp = self._connection.transport.driver_type == "amqp"  # only it returns
            producer = Producer(channel, auto_declare=False, on_return=(
                (lambda exc, *rest: self._returned.append(exc)) if amqp else None))
            self._producer_of = (channel, producer)
        return self._producer_of[1]

    def _channel(self) -> Any:
        if self._connection is None:
            # AMQP: publisher confirms, so that a parked copy the broker returns (its queue
            # expired unused, x-expires) is published again (:meth:`_park`)
            self._connection = self.ctx.app.connection_for_write(
                transport_options={"confirm_publish": True})
            self._declared.clear()
        self._connection.ensure_connection(max_retries=1, interval_start=0)
        channel = self._connection.default_channel
        self.settlements.watch(channel)  # an ack the broker does not take is made again
        return channel

    def _declared_queue(self, lane: str) -> Queue:
        """The lane's parking queue bound to the parking channel, declared once (on Redis
        never: the default exchange publishes to the list by name and a get reads it, and a
        declaration would leave a binding behind once the list is gone)."""
        channel = self._channel()
        queue = self._queue(lane)(channel)
        if self._connection.transport.driver_type == "redis":
            return queue
        if queue.name not in self._declared:
            queue.declare()
            self._declared.add(queue.name)
        return queue

    def _lost(self, exc: BaseException, what: str) -> None:
        """A call on the parking connection failed (I/O thread): the connection is dropped
        and every message pulled on it and not settled yet is settled by whoever holds it
        (:meth:`reset`). The first failure of an outage is a warning, the next ones (a pull
        retried while the broker is away) are logged at debug until a call succeeds again
        (:meth:`_answered`). A failure that is not the broker's (:meth:`_broker_failed`: a
        bug, in the gate or below it) is recovered from the same way, but logged as an error
        with its traceback, the first time each kind of it happens, never as an outage."""
        if not self._broker_failed(exc):
            fault = (type(exc).__qualname__, str(exc))
            if fault not in self._faults_seen:
                if len(self._faults_seen) < 100:
                    self._faults_seen.add(fault)
                logger.error("celery-semaphore: %s failed, and not because the broker is "
                             "unavailable: %r (the parking connection is reset and what the "
                             "call held goes back, as after a lost connection; this is a "
                             "bug, please report it)", what, exc, exc_info=exc)
            else:
                logger.debug("celery-semaphore: %s failed again: %r", what, exc)
            self.reset()
            return
        if self._unavailable_since is None:
            self._unavailable_since = time.monotonic()
            logger.warning("celery-semaphore: %s: broker unavailable: %s (until it answers "
                           "again, the next failures are logged at debug level)", what, exc)
        else:
            logger.debug("celery-semaphore: %s: broker still unavailable: %s", what, exc)
        self.reset()

    def _broker_failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` comes from the broker or the way to it: the transport's connection
        and channel errors, kombu's ``OperationalError``, an ``OSError``, or the broker
        refusing a parked copy (:class:`BrokerRefused`)."""
        if isinstance(exc, (OSError, OperationalError, BrokerRefused)):
            return True
        connection = self._connection
        if connection is None:
            return False
        try:
            errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
        except Exception:  # a transport that cannot say: as before, every failure is one
            return True
        return isinstance(exc, errors)

    def _answered(self) -> None:
        """A call on the parking connection succeeded (I/O thread): an outage it was in ends."""
        if self._unavailable_since is not None:
            logger.info("celery-semaphore: the broker answers the worker's parking connection "
                        "again, after %.1f s", time.monotonic() - self._unavailable_since)
            self._unavailable_since = None

    def _let_go_of_pulled(self, channel: Any) -> None:  # loop thread
        """The parking connection of ``channel`` is gone: the requests pulled on it that still
        wait leave the gate, rather than run beside their next delivery. On a Redis broker
        each goes back to its queue through :class:`.Settlements` once the broker answers
        (AMQP requeued them as the connection closed). Then every held lane is pulled again,
        and proven empty anew before its doorbell goes."""
        self.unsettled.clear()  # the reset forgot them: their settlements are not counted
        let_go = [c for c in self.line.waiting()
                  if c.pulled and getattr(c.request.message, "channel", None) is channel]
        redis = celery_internals.redis_qos(channel) is not None
        self.line.let_go(let_go)
        if redis:
            for claim in let_go:
                self.settlements.later(claim.request.message.delivery_tag, Settle.REQUEUE)
        if let_go:
            logger.info("celery-semaphore: %d tasks that were waiting when the broker "
                        "connection was lost go back to their queue%s", len(let_go),
                        " once the broker answers" if redis else "")
        self._rearm()

    def _park(self, claim: Claim, lane: str, queue: Queue) -> None:
        """Publish ``claim``'s parked copy (I/O thread), its lane's doorbell first (at most one
        every :data:`DOORBELL_EVERY` per lane from this worker: a worker that took the last one
        looks again :data:`RECHECK_AFTER` later): a doorbell the broker does not take leaves
        nothing parked (the request is requeued instead), never a copy nobody rings for."""
        try:
            self._ring_first(lane)
            delivery = claim.request.delivery_info or {}
            route = [delivery.get("exchange") or "", delivery.get("routing_key")]
            for _ in range(3):
                parking = self._declared_queue(lane)
                self._returned.clear()
                publish_copy(self._producer(), claim.request, "", parking.name,
                             {PARKED_HEADER: lane, FIRST_WAIT_HEADER: claim.first_wait,
                              PARKED_BY_HEADER: "worker", ROUTE_HEADER: route,
                              "eta": None},  # it was due already
                             delivery_mode=2, mandatory=True)
                if not self._returned:
                    break
                self._declared.discard(parking.name)  # expired unused: declare it again
            else:
                raise BrokerRefused(f"the broker returned the parked copy three times "
                                    f"(parking queue {parking.name})")
        except Exception as exc:
            self._lost(exc, f"parking {claim.request.id}, requeueing it")
            self.ctx.loop.post(self.parked, claim, lane, False)
            return
        self._answered()
        self.ctx.loop.post(self._parked_then_ring, claim, lane, queue)

    def _parked_then_ring(self, claim: Claim, lane: str, queue: Queue) -> None:
        self.parked(claim, lane, True)
        # held here: a pull begun from now on must find the copy (otherwise its doorbell was
        # rung before the copy was published: _park)
        self._run(self.book.rung_here(lane))

    def _ring_first(self, lane: str) -> None:
        """Ring ``lane`` before parking a copy in it, unless this worker rang it less than
        :data:`DOORBELL_EVERY` ago (I/O thread). Raises when the broker does not take it."""
        now = time.monotonic()
        if now - self._io_rung.get(lane, -DOORBELL_EVERY) < DOORBELL_EVERY:
            return
        self._publish_doorbell(lane)
        self._io_rung[lane] = now
        if len(self._io_rung) > 10_000:  # template names: forget the old ones
            self._io_rung = {k: t for k, t in self._io_rung.items()
                             if now - t < DOORBELL_EVERY}

    def _publish_doorbell(self, lane: str) -> None:
        queue = queue_of(lane)
        consumed = {q.name: q for q in celery_internals.consumed_queues(self.ctx.consumer)}
        self._channel()
        ring(self.ctx.app, lane, {"queue": consumed.get(queue, queue)} if queue else {},
             connection=self._connection)

    def _ring(self, lane: str) -> None:
        """Publish a doorbell of ``lane`` to its task queue (I/O thread). A doorbell the broker
        does not take leaves the lane's parked tasks for the next one, and the parking
        connection is reset as after any failed call on it (:meth:`_lost`): a channel the
        failure closed is never used again (the next park met it closed, and its
        ``AttributeError`` was logged as a bug)."""
        try:
            self._publish_doorbell(lane)
        except Exception as exc:
            logger.warning("celery-semaphore: ringing the doorbell of %r failed (its parked "
                           "tasks wait for the next one): %s", semaphore_of(lane), exc)
            self._lost(exc, f"ringing the doorbell of {semaphore_of(lane)!r}")
            self.ctx.loop.post(self.book.ring_failed, lane)
            return
        self._answered()

    def _pull(self, lane: str, want: int, began: float) -> None:
        messages: List[Any] = []
        empty = False
        try:
            try:
                queue = self._pulling_queue(lane)
            except LaneBusy:  # another worker deletes it (it was empty): look again soon
                self.ctx.loop.post(self._pulled, lane, want, [], False, began)
                self.ctx.io.call(self.ctx.loop.post, self.refill, lane, delay=BUSY_RETRY)
                return
            self._put_back_lost_takes(queue.channel)
            while len(messages) < want:
                # (a record time of its own: a take whose reply is lost is found by it)
                stamp = self._last_stamp = max(time.time(), self._last_stamp + 1e-6)
                try:
                    # (on Redis taken and recorded as unacked in one step: never lost
                    # between the two, should the broker die there)
                    message = celery_internals.take_unacked(queue, stamp)
                except celery_internals.UndecodableEntry as exc:
                    # kombu took an entry it cannot decode (on Redis, out of the list):
                    # it is set aside alone; the other messages stay as they are
                    logger.error("celery-semaphore: dropped an undecodable entry of parking "
                                 "queue %s: %s", queue.name, exc)
                    continue
                except Exception:  # the script may have run: its record is looked for
                    if len(self._lost_takes) < MAX_LOST_TAKES:
                        self._lost_takes.append((stamp, lane, queue.name))
                    raise
                if message is None:
                    empty = True
                    break
                messages.append(message)
                self._unsettled[lane] += 1  # unsettled from now on, whoever settles it
            self._reroute(queue.channel, messages)
            self._answered()
        except Exception as exc:
            self._lost(exc, f"pulling parked requests of {semaphore_of(lane)!r}")
            for message in messages:  # never delivered: back to their queue (Redis; AMQP
                # requeued them as the connection closed)
                if celery_internals.redis_qos(message.channel) is not None:
                    self.settlements.later(message.delivery_tag, Settle.REQUEUE)
            messages, empty = [], False
        self.ctx.loop.post(self._pulled, lane, want, messages, empty, began)

    def _put_back_lost_takes(self, channel: Any) -> None:
        """Put back in their lanes the messages of takes whose reply never came (I/O thread,
        before the next take, on the parking channel), and ring those lanes: the script ran,
        recording the message as unacked for this worker, and the reply was lost with the
        connection, so nothing here knows the message and nothing would put it back before
        the broker's ``visibility_timeout``. Raises (and keeps them) when the broker does not
        answer."""
        while self._lost_takes:
            stamp, lane, queue_name = self._lost_takes[0]
            tags = celery_internals.taken_at(channel, stamp, queue_name)
            if tags:  # back at the head of its lane, and the lane rung: it may have been
                # proven empty meanwhile
                celery_internals.restore_unacked(self.ctx.app, tags)
                logger.info("celery-semaphore: a parked task of %r taken as the broker "
                            "connection was lost, its reply lost with it, is back in its "
                            "parking queue (delivery %s)", semaphore_of(lane), tags[0])
                self._publish_doorbell(lane)
            self._lost_takes.pop(0)

    def _pulling_queue(self, lane: str) -> Queue:
        """The lane's parking queue, bound to the channel to pull it on: on AMQP a channel of
        its own that holds the lane while any message pulled from it is unsettled
        (:class:`.LaneGuards`: so that an empty lane can be deleted safely); on Redis the
        parking channel."""
        if self._connection_driver() != "amqp":
            return self._declared_queue(lane)
        channel = self.guards.channel(self._connection, lane, self._queue(lane))
        return self._queue(lane)(channel)

    def _connection_driver(self) -> str:
        self._channel()  # connected
        return str(self._connection.transport.driver_type)

    def _release_if_idle(self, lane: str) -> None:
        """Stop holding ``lane`` (AMQP) once no message pulled from it is unsettled (I/O)."""
        if not self.guards.holds(lane):
            return
        if self._unsettled.get(lane):
            return
        self.guards.release(lane)

    def _delete_lane(self, lane: str) -> None:
        """This worker proved ``lane`` empty and let go of its doorbell (AMQP, I/O thread):
        delete its parking queue unless someone holds the lane or a message is in it
        (:class:`.LaneGuards`)."""
        if self._unsettled.get(lane) or self.guards.holds(lane):  # pulled again meanwhile
            return
        try:
            self._channel()
            locked = self.guards.lock(self._connection, lane)
        except Exception as exc:  # the lane stays; its x-expires is the backstop
            logger.debug("celery-semaphore: not deleting the lane of %r: %s",
                         semaphore_of(lane), exc)
            return
        if locked is not None:
            self.ctx.io.call(self._delete_locked, lane, locked, self._connection, delay=SETTLE)

    def _delete_locked(self, lane: str, channel: Any, connection: Any) -> None:
        if connection is not self._connection:  # reset meanwhile: the lock went with it
            return
        queue = self._queue(lane)
        try:
            if self.guards.delete(channel, queue):
                self._declared.discard(queue.name)
                logger.debug("celery-semaphore: deleted the empty parking queue %s",
                             queue.name)
        except Exception as exc:
            logger.debug("celery-semaphore: deleting %s failed: %s", queue.name, exc)

    def _reroute(self, channel: Any, messages: List[Any]) -> None:
        """On a Redis broker, a pulled message of a task this worker knows goes back to the
        task queue it was routed to, not to its lane, whoever puts it back (I/O thread): the
        visibility timeout after this worker is killed, a requeue, the restore after a lost
        connection. A doorbell does not go with it (its lane's doorbell may have been proven
        empty and acked meanwhile: in the lane it would wait for a doorbell that never comes);
        in its task queue every worker that consumes the queue sees it, and the gate admits it
        or parks it again. (On AMQP the broker puts a message back in its parking queue, and
        the doorbell held with it, in the same instant.) A task this worker does not know stays
        routed to its lane, for the workers that know it."""
        reroutes = []
        strategies = self.ctx.consumer.strategies
        for message in messages:
            headers = message.headers or {}
            route = headers.get(ROUTE_HEADER)
            if (headers.get("task") in strategies and isinstance(route, (list, tuple))
                    and len(route) == 2 and all(isinstance(part, str) for part in route)
                    and route[1]):
                reroutes.append((message, route[0], route[1]))
        celery_internals.reroute_unacked(channel, reroutes)

    def _settle(self, message: Any, lane: str, ack: bool, log: Any, errors: Any,
                requeue: bool = False) -> None:
        """Ack or reject a pulled message as Celery asked (I/O thread)."""
        if ack:
            message.ack_log_error(log, errors)
        else:
            message.reject_log_error(log, errors, requeue)
        if not ack and requeue:  # back in the lane, which may have been proven empty since
            self.ctx.loop.post(self._back_in_lane, lane)
        self._settled(lane)

    def _back_in_lane(self, lane: str) -> None:
        """A pulled message went back to ``lane`` (Celery rejected it with requeue): the
        lane must be proven empty anew before its doorbell goes."""
        self._run(self.book.back_in_lane(lane))

    def _settled(self, lane: str) -> None:  # I/O thread
        if lane in self._unsettled:
            self._unsettled[lane] -= 1
            if self._unsettled[lane] <= 0:
                del self._unsettled[lane]
                self.ctx.io.call(self._release_if_idle, lane)
        self.ctx.loop.post(self._settled_here, lane)

    def _settled_here(self, lane: str) -> None:  # loop thread
        if lane not in self.unsettled:  # (pulled before a reset that forgot it)
            return
        self.unsettled[lane] -= 1
        if self.unsettled[lane] > 0:
            return
        del self.unsettled[lane]
        self._run(self.book.last_settled(lane))

    def _reject(self, message: Any, lane: Optional[str] = None, rearm: bool = True) -> None:
        """Give back a pulled message (I/O thread); ``rearm``: its lane must be proven empty
        anew (:meth:`_back_in_lane`)."""
        try:
            message.reject(requeue=True)
        except Exception as exc:  # a closed channel's messages go back all the same
            logger.debug("celery-semaphore: giving back pulled %s failed: %s",
                         message.delivery_tag, exc)
        if lane is not None:
            if rearm:
                self.ctx.loop.post(self._back_in_lane, lane)
            self._settled(lane)

    def reset(self) -> None:
        """The parking connection or the consumer's was lost (I/O thread): drop the parking
        connection. Every message pulled on it and not settled yet is settled by whoever
        holds it, so that none is put back while its task runs and none is put back twice:
        the loop lets go of the pulled requests still waiting (:meth:`_let_go_of_pulled`:
        back to their queue), a task that left for the pool is acked or requeued as Celery
        settles its request, a pull still on its way to the loop is given back
        (:meth:`_pulled`), all through :class:`.Settlements` on a Redis broker (kombu would
        put back every unacked message of the closed channel). On AMQP the broker requeues
        the closed channel's messages itself. The lanes' doorbells come back with the
        consumer's channel, or stay held."""
        connection, self._connection = self._connection, None
        self.guards.forget_all()
        self._unsettled.clear()
        if connection is None:
            return
        channel = celery_internals.parking_channel(connection)
        self.settlements.detach(channel, keep=EVERY_MESSAGE)
        try:
            connection.close()
        except Exception:
            pass
        self.ctx.loop.post(self._let_go_of_pulled, channel)

    def _rearm(self) -> None:
        """Messages pulled from the held lanes went back (loop thread): pull every held lane
        again, proving it empty anew before its doorbell goes."""
        self._run(self.book.rearm())

    def close(self) -> None:  # I/O thread, at shutdown, after the last ack
        connection, self._connection = self._connection, None
        self.guards.forget_all()
        if connection is not None:
            try:
                connection.close()
            except Exception:
                pass


class _LaneSurroundings:
    """What the lane book reads of the worker (:class:`.LaneSurroundings`)."""

    def __init__(self, lot: ParkingLot) -> None:
        self.lot = lot

    @property
    def open(self) -> bool:
        return self.lot.ctx.open

    def room(self, semaphore: str) -> int:
        return self.lot.room(semaphore)

    def short_of_processes(self, semaphore: str) -> bool:
        return self.lot.line.short_of_processes(semaphore)

    def settling(self) -> bool:
        return len(self.lot.settlements) > 0

    def unsettled(self, lane: str) -> int:
        return self.lot.unsettled.get(lane, 0)

    @property
    def redelivered_after(self) -> Optional[float]:
        return celery_internals.visibility_timeout(
            celery_internals.task_channel(self.lot.ctx.consumer))


def doorbell_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's task strategy for the doorbell task (``Task.Strategy``): the worker's main
    process holds the message (:meth:`ParkingLot.doorbell`) and pulls its lane; no request is
    built, nothing runs in the pool, no task event is sent. A doorbell this worker cannot use
    (no gate, or a malformed lane) is acked: it carries nothing else."""

    def on_doorbell(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                    **options: Any) -> None:
        lot: Optional[ParkingLot] = getattr(consumer, "semaphore_parking", None)
        raw = (message.headers or {}).get(DOORBELL_HEADER)
        lane = lane_or_none(raw)
        if lane is None:
            logger.warning("celery-semaphore: ignoring a doorbell whose %s header is not a "
                           "parking lane: %.80r", DOORBELL_HEADER, raw)
        if lot is None or lane is None:
            ack(logger, consumer.connection_errors)  # as Request.acknowledge calls it
            return
        lot.doorbell_arrived(lane, message)

    return on_doorbell


@control_command(args=[("name", str)], signature="<semaphore name>")
def semaphore_parked(state: Any, name: str, **kwargs: Any) -> Any:
    """Sent by workers of earlier releases when they parked requests. Lanes are learned from
    doorbells in the queues a worker consumes now (so that a task runs only where it was
    routed): this command is accepted and ignored (one that names no semaphore is refused,
    naming why)."""
    if lane_or_none(name) is None:  # sent by hand, or by something else than a worker
        logger.warning("celery-semaphore: ignoring a semaphore_parked broadcast whose name is "
                       "not a semaphore name: %.80r", name)
        return {"error": f"name must be a semaphore name, not {name!r:.80}"}
    return {"ok": "ignored"}
