"""The waiting room as the sending side sees it (the worker side is
:mod:`celery_semaphore.worker.parking`): each semaphore's parking queue on the broker, how many
tasks wait there, and *parking on send*.

Parking on send: once :func:`celery_semaphore.install` ran in the sending process, a guarded
task sent with no ETA or countdown is published straight to its semaphore's parking queue
instead of its task queue, and a *doorbell* (a tiny internal task) goes to the queue the task
would have gone to, at most one every :data:`DOORBELL_EVERY` per semaphore and destination
from each sending process. A worker consuming that queue learns from the doorbell that the
semaphore has parked tasks, pulls as many as it can start soon, looks again a moment later,
and tells the other workers. So a backlog never passes through a worker that cannot start it:
one delivery per task, no parking phase, and unguarded tasks on the same queue are never stuck
behind guarded ones. The doorbell is a persistent message in the task queue, so parked tasks
are found even when no worker ran when they were sent. ``semaphore_park_on_send = False``
(setting or task option) sends guarded tasks to their task queue as before (the worker parks
what it cannot start soon).

Only semaphores with a backlog use the waiting room: a send is parked only when the backend
says the semaphore has requests waiting in its queue (:meth:`.Backend.waiting_count`, one cheap
read per send, cached for :data:`BUSY_FOR` when busy and :data:`IDLE_FOR` when idle; none for
a template's key this process has not sent for :data:`UNKNOWN_AFTER`). A semaphore with room goes
the plain way: one delivery, one acquire at the worker, nothing in the waiting room. So the
cost per task does not grow with the number of keys of a template.

Lanes keep Celery's routing: a lane is a semaphore (or a fair key of it) *and* the queue its
tasks were routed to (:func:`lane_of`); its doorbell goes to that queue, so only workers that
consume that queue ever pull its tasks.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from kombu import Exchange, Producer, Queue
from kombu.utils.uuid import uuid

from .guards import Guards, templates_of
from .settings import Settings
from .traffic import is_template

logger = logging.getLogger(__name__)

#: Longest queue name brokers take (RabbitMQ: 255 bytes); longer names are shortened + hashed.
MAX_QUEUE_NAME = 200
#: An unused parking queue on RabbitMQ (no get, no consumer, no declare) is deleted after this
#: long (``x-expires``), with what it holds: a week, as a semaphore's default ``idle_ttl``.
PARKING_QUEUE_EXPIRES = 7 * 24 * 3600.0
#: Seconds between two doorbells for one semaphore and destination queue from one sending
#: process. A worker that takes a doorbell looks again a little later, so what was parked
#: after the doorbell and missed by its first pull waits at most about this long.
DOORBELL_EVERY = 0.1
#: Seconds between two doorbells one worker sends again for a lane it holds but has no room
#: for (so that another worker consuming the same queue takes some).
RERING_EVERY = 1.0
#: Seconds between two doorbells one worker sends again for a lane whose requests wait in it
#: for a pool process while their semaphore has room (another worker may have free ones).
SHORT_RERING_EVERY = 0.25
#: Seconds a sender trusts a "busy" answer (requests wait in the backend's queue): sends of
#: that semaphore are parked meanwhile.
BUSY_FOR = 0.25
#: Seconds a sender trusts an "idle" answer (nobody waits): sends of that semaphore go the
#: plain way meanwhile, at most ``limit`` of them (then it asks again).
IDLE_FOR = 0.02
#: Seconds after which a semaphore named by a template (``"api:{customer_id}"``) that this
#: process has not sent is unknown again: its next send goes the plain way without asking the
#: backend (as after an "idle" answer). A key sent now and then (one per customer, thousands of
#: them, most with room) costs its send no backend read; a key sent often asks as before. A
#: plain send to a key with a backlog is parked by the worker that gets it: one more delivery,
#: never a task out of its limit.
UNKNOWN_AFTER = 30.0
#: Semaphores whose last send this process remembers at most (the oldest are forgotten first).
MAX_REMEMBERED = 100_000

#: On a parked message: the semaphore it waits for.
PARKED_HEADER = "semaphore_parked"
#: On a copy a worker parked (absent: parked on send): counted as parked by a worker when
#: parked, a task parked on send when a worker pulls it (:mod:`celery_semaphore.stats`).
PARKED_BY_HEADER = "semaphore_parked_by"
#: Unix time the task first waited for a slot (its send, when it was parked on send).
FIRST_WAIT_HEADER = "semaphore_first_wait"
#: On a parked message: ``[exchange, routing_key]`` it was sent to (a pulled task is given
#: them back, so that its retries and requeues go where it was sent, not to the parking queue).
ROUTE_HEADER = "semaphore_route"
#: The internal task that tells a worker a semaphore has parked tasks, and its header.
DOORBELL_TASK = "celery_semaphore.doorbell"
DOORBELL_HEADER = "semaphore_doorbell"

#: The semaphore whose parking queue this context is publishing to (keeps its headers).
parking_now: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar(
    "celery_semaphore_parking_now", default=None)


#: A part of a lane that can stand in a queue name as it is; any other is hashed (a template
#: key filled from task arguments may be huge, non-ASCII or hostile).
_PLAIN_PART = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


def lane_of(name: str, fair: Optional[str], queue: Optional[str] = None) -> str:
    """The parking lane of a task: ``"<queue>\t<semaphore>"``, with ``semaphore_fair_by``
    ``"<queue>\t<semaphore>\n<fair key>"`` (a semaphore name holds no whitespace), parked apart
    so that workers pull round-robin across keys, and only workers that consume ``queue``
    (the queue the task was routed to) pull it. ``queue`` None: a lane of an earlier release
    (no queue), still pulled by whoever gets its doorbell."""
    lane = name if fair is None else f"{name}\n{fair}"
    return lane if queue is None else f"{queue}\t{lane}"


def semaphore_of(lane: str) -> str:
    """The semaphore name of a parking lane (:func:`lane_of`)."""
    return lane.rpartition("\t")[2].partition("\n")[0]


def queue_of(lane: str) -> Optional[str]:
    """The task queue of a parking lane (:func:`lane_of`), None for a lane without one."""
    queue, tab, _ = lane.rpartition("\t")
    return queue if tab else None


def _plain(part: str) -> str:
    if _PLAIN_PART.fullmatch(part):
        return part
    return "~" + hashlib.sha1(part.encode()).hexdigest()[:16]


def parking_queue_name(key_prefix: str, lane: str) -> str:
    """``<key_prefix>park.<name>`` for a lane without a queue, ``<key_prefix>park.<queue>|
    <name>`` for one (and ``...|fair|<key>`` for a fair lane), each part that is not plain
    ASCII of up to 64 characters as ``~<hash>`` (never outside the prefix); shortened with a
    hash of the lane past 200 bytes."""
    queue = queue_of(lane)
    name, fair_lane, fair = lane.rpartition("\t")[2].partition("\n")
    if queue is None:
        full = f"{key_prefix}park.{name}"
        if fair_lane:
            full = f"{full}.fair.{_plain(fair)}"
    else:
        full = f"{key_prefix}park.{_plain(queue)}|{_plain(name)}"
        if fair_lane:
            full = f"{full}|fair|{_plain(fair)}"
    if len(full.encode()) <= MAX_QUEUE_NAME:
        return full
    digest = hashlib.sha1(lane.encode()).hexdigest()[:16]
    head = full.encode()[:MAX_QUEUE_NAME - 17].decode(errors="ignore")
    return f"{head}~{digest}"


def parking_queue(key_prefix: str, lane: str, driver_type: str) -> Queue:
    """The parking queue of ``lane`` as kombu declares it on a broker of ``driver_type``:
    durable, reached through the default exchange, expiring when unused on AMQP. Senders and
    workers declare it alike (RabbitMQ refuses a second declaration with other arguments)."""
    queue_name = parking_queue_name(key_prefix, lane)
    arguments = None
    if driver_type == "amqp":
        arguments = {"x-expires": int(PARKING_QUEUE_EXPIRES * 1000)}
    return Queue(queue_name, Exchange(""), routing_key=queue_name, durable=True,
                 auto_delete=False, queue_arguments=arguments)


def known_queues(app: Any) -> List[str]:
    """The task queues ``app`` knows (its default queue, ``task_queues``, and those its routes
    created): where its parked tasks may be bound."""
    names = {app.conf.task_default_queue}
    try:
        names.update(app.amqp.queues.keys())
    except Exception:  # no broker configuration to read: the default queue alone
        pass
    return sorted(n for n in names if n)


def parked_counts(app: Any, key_prefix: str, names: Iterable[str],
                  queues: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Tasks parked per semaphore name, over its lanes to each of ``queues`` (default: the
    queues ``app`` knows, :func:`known_queues`) and its lane of an earlier release, asked of
    ``app``'s broker (0 where no parking queue exists). Raises when the broker cannot be
    reached."""
    queues = list(known_queues(app) if queues is None else queues)
    counts: Dict[str, int] = {}
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        channel = connection.channel()
        try:
            for name in names:
                counts[name] = 0
                for lane in [name] + [lane_of(name, None, queue) for queue in queues]:
                    try:
                        counts[name] += channel.queue_declare(
                            queue=parking_queue_name(key_prefix, lane), passive=True)[1]
                    except connection.channel_errors:  # no such queue
                        if getattr(channel, "is_open", True) is False:  # AMQP closed it
                            channel = connection.channel()
        finally:
            try:
                channel.close()
            except Exception:
                pass
    return counts


#: Routing options of a send that the parking queue replaces.
_ROUTING = ("queue", "exchange", "routing_key", "exchange_type")


class ParkOnSend:
    """Wraps ``app.send_task`` to park guarded tasks on send (see the module docstring).

    A send is parked when the task is known to this process (``app.tasks``), declares a
    semaphore (task option or ``semaphore`` header), has neither ETA nor countdown, its
    semaphore name can be filled from the call's arguments, ``semaphore_park_on_send`` is on
    for it and ``semaphore_max_wait`` is not set (a worker that holds or parked a task fails
    it when its wait runs out; nobody watches a task parked on send until it is pulled) and
    ``semaphore_on_full`` is ``"wait"`` (a skip or fail is decided by the worker, once a pool
    process is free for the task), its ``semaphore_priority`` is not above the default (it
    goes to a worker and into the backend's queue, ordered by priority, ahead of the parked
    backlog), it is routed to a queue, and its semaphore is busy: the
    backend has requests waiting in its queue (:meth:`busy`).
    Anything else is sent as Celery sends it; the worker's gate handles it then (including a
    template it cannot fill, which fails that task alone).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.send_original = app.send_task
        self._guards: Any = None
        self._backend: Any = None
        self._driver_type: Optional[str] = None
        self._rung: Dict[Tuple[str, str], float] = {}
        #: semaphore -> (busy, trusted until (monotonic), plain sends left while idle)
        self._busy: Dict[str, Tuple[bool, float, int]] = {}
        #: semaphore -> its last send (monotonic), the oldest first
        self._sent: Dict[str, float] = {}
        self._lock = threading.Lock()
        #: AMQP: (connection, producer with publisher confirms, returned messages)
        self._confirm: Optional[Tuple[Any, Any, List[Any]]] = None
        self._confirm_lock = threading.Lock()

    def install(self) -> None:
        self.app.send_task = self.send_task

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, countdown: Any = None,
                  eta: Any = None, **options: Any) -> Any:
        parked = None
        if countdown is None and eta is None:
            parked = self._plan(name, args, kwargs, options)
        if parked is None:
            return self.send_original(name, args, kwargs, countdown=countdown, eta=eta,
                                      **options)
        lane, destination = parked
        queue = parking_queue(self._guards.settings.key_prefix, lane, self.driver_type())
        # the caller's own headers travel with the parked message, beside the parking marks
        headers = {**(options.pop("headers", None) or {}), PARKED_HEADER: lane,
                   FIRST_WAIT_HEADER: time.time(),
                   ROUTE_HEADER: list(self._exchange_and_routing_key(destination))}
        for key in _ROUTING:
            options.pop(key, None)
        # the doorbell first: a send whose doorbell the broker does not take raises here, with
        # nothing parked (parked first, the task would wait for the next send's doorbell); a
        # worker that takes the doorbell before the task lands looks again RECHECK_AFTER later
        self._ring(lane, destination, options)
        token = parking_now.set(lane)
        try:
            if self.driver_type() == "amqp":
                result = self._publish_confirmed(name, args, kwargs, queue, headers, options)
            else:
                result = self.send_original(name, args, kwargs, queue=queue, exchange="",
                                            routing_key=queue.name, exchange_type="direct",
                                            headers=headers, **options)
        finally:
            parking_now.reset(token)
        return result

    def _publish_confirmed(self, name: str, args: Any, kwargs: Any, queue: Queue,
                           headers: Dict[str, Any], options: Dict[str, Any]) -> Any:
        """Publish a parked send on AMQP through this sender's own connection with publisher
        confirms, ``mandatory``: a parking queue unused for :data:`PARKING_QUEUE_EXPIRES` is
        deleted by the broker (``x-expires``) while this process may still believe it
        declared, so the broker may return the message (no such queue any more); then the
        queue is declared again and the message published again, never dropped. One parked
        send at a time per process."""
        for key in ("producer", "connection", "mandatory"):
            options.pop(key, None)
        with self._confirm_lock:
            for _ in range(3):
                producer, returned = self._confirm_producer()
                returned.clear()
                try:
                    result = self.send_original(
                        name, args, kwargs, queue=queue, exchange="", routing_key=queue.name,
                        exchange_type="direct", headers=headers, producer=producer,
                        mandatory=True, **options)
                except Exception:  # a new connection for the next send
                    assert self._confirm is not None  # _confirm_producer made it
                    connection, self._confirm = self._confirm[0], None
                    try:
                        connection.close()
                    except Exception:
                        pass
                    raise
                if not returned:
                    return result
                queue(producer.channel).declare()
            raise RuntimeError(f"the broker returned the parked task {name} three times "
                               f"(parking queue {queue.name})")

    def _confirm_producer(self) -> Tuple[Any, List[Any]]:
        if self._confirm is None:
            connection = self.app.connection_for_write(
                transport_options={"confirm_publish": True})
            returned: List[Any] = []
            producer = Producer(connection.default_channel, auto_declare=False,
                                on_return=lambda exc, *rest: returned.append(exc))
            self._confirm = (connection, producer, returned)
        _, producer, returned = self._confirm
        return producer, returned

    def busy(self, name: str, limit: int, templated: bool = False) -> bool:
        """Whether semaphore ``name`` has a backlog: requests wait in the backend's queue
        (:meth:`.Backend.waiting_count`). A "busy" answer is trusted for :data:`BUSY_FOR`; an
        "idle" one for :data:`IDLE_FOR` and at most ``limit`` sends (a burst of one
        semaphore is parked once it exceeds what could start at once, before its waiters show
        in the backend). A backend that does not answer counts as busy: the waiting room
        keeps the tasks until a worker can admit them. A ``templated`` name (filled in from
        the call) not sent from this process for :data:`UNKNOWN_AFTER` is not asked about:
        idle, as if the backend had said so."""
        now = time.monotonic()
        with self._lock:
            last_sent = self._remember_send(name, now) if templated else now
            known = self._busy.get(name)
            if known is not None and now < known[1]:
                busy, until, left = known
                if busy:
                    return True
                if left > 0:
                    self._busy[name] = (False, until, left - 1)
                    return False
                return True  # more plain sends than could start: park the rest of it
            if last_sent is None or now - last_sent > UNKNOWN_AFTER:
                self._busy[name] = (False, now + IDLE_FOR, max(0, limit - 1))
                return False
        try:
            busy = self.backend().waiting_count(name) > 0
        except Exception as exc:
            logger.debug("celery-semaphore: cannot tell whether %r has a backlog (parking "
                         "the send): %s", name, exc)
            busy = True
        with self._lock:
            if len(self._busy) > 10_000:  # template names: forget the stale answers
                self._busy = {k: v for k, v in self._busy.items() if v[1] > now}
            self._busy[name] = (busy, now + (BUSY_FOR if busy else IDLE_FOR),
                                max(0, limit - 1))
        return busy

    def _remember_send(self, name: str, now: float) -> Optional[float]:
        """Record a send of ``name`` now; the one before it, if remembered (under the lock)."""
        sent = self._sent
        last = sent.pop(name, None)
        sent[name] = now
        while sent:  # the oldest first: forget those too old to matter, and the overflow
            oldest, when = next(iter(sent.items()))
            if now - when <= UNKNOWN_AFTER and len(sent) <= MAX_REMEMBERED:
                break
            del sent[oldest]
        return last

    def backend(self) -> Any:
        if self._backend is None:
            from .backends import get_backend

            settings = self._guards.settings
            self._backend = get_backend(settings.backend_url(self.app),
                                        key_prefix=settings.key_prefix)
        return self._backend

    def driver_type(self) -> str:
        if self._driver_type is None:
            self._driver_type = self.app.connection_for_write().transport.driver_type
        return self._driver_type

    def _plan(self, name: str, args: Any, kwargs: Any,
              options: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
        """(parking lane, destination route) when this send is parked, else None."""
        task = options.get("task_type") or self.app.tasks.get(name)
        headers = options.get("headers") or {}
        option = headers.get("semaphore") or getattr(task, "semaphore", None)
        if task is None or not option:
            return None
        if self._guards is None:
            self._guards = Guards(Settings.from_app(self.app))
        try:
            guard = self._guards.resolve_call(task, args, kwargs, headers)
        except Exception:  # the worker fails that task alone, with the error
            return None
        if guard is None or not guard.settings.park_on_send:
            return None
        if guard.settings.max_wait is not None:  # a worker tracks it and fails it on time
            return None
        if guard.settings.on_full != "wait":  # judged full or not by the worker that gets it
            return None
        if guard.priority > 0:  # parked, it would wait behind the backlog it should pass
            return None
        route_options = {key: options[key] for key in _ROUTING if key in options}
        if "queue" not in route_options and getattr(task, "queue", None):
            route_options["queue"] = task.queue
        router = options.get("router") or self.app.amqp.router
        destination = router.route(route_options, options.get("route_name") or name,
                                   args, kwargs, task)
        queue = destination.get("queue")
        if queue is None or not getattr(queue, "name", None):
            return None  # routed by exchange alone: no queue whose consumers may pull it
        if queue.exchange is not None and queue.exchange.type == "fanout":
            return None  # a broadcast: every worker runs it; the gate sees each copy
        templated = any(is_template(template) for template in templates_of(option))
        if guard.fair is None and not self.busy(
                guard.name, guard.limit if isinstance(guard.limit, int) else 1, templated):
            return None  # room, or nobody waits: the plain way, one acquire at the worker
        # (with semaphore_fair_by every send is parked: its fair lanes, pulled in turn, are
        # what serves the keys in turn behind a backlog that plain sends would overtake)
        return lane_of(guard.name, guard.fair, queue.name), destination

    def _exchange_and_routing_key(self, destination: Dict[str, Any]) -> Tuple[str, str]:
        """Where Celery would publish a send routed to ``destination`` (as celery 5.x
        ``AMQP.send_task_message`` decides it)."""
        queue: Any = destination.get("queue")  # a kombu Queue: Celery's router always sets one
        exchange = destination.get("exchange")
        exchange = getattr(exchange, "name", exchange)
        routing_key = destination.get("routing_key")
        exchange_type = destination.get("exchange_type") or (
            queue.exchange.type if queue is not None and queue.exchange is not None
            else "direct")
        if (not exchange or not routing_key) and exchange_type == "direct":
            return "", queue.name
        if exchange is None:
            exchange = queue.exchange.name or self.app.amqp.default_exchange.name
        return exchange, (routing_key or queue.routing_key
                          or self.app.conf.task_default_routing_key)

    def _ring(self, lane: str, destination: Dict[str, Any], options: Dict[str, Any]) -> None:
        """Send the doorbell for ``lane`` to ``destination``, unless one went less than
        :data:`DOORBELL_EVERY` ago (a worker that took it pulls the lane again
        :data:`.lanes.RECHECK_AFTER` later). Raises what the broker raised: the caller parks
        nothing then. A throttled send counts on a doorbell that was sent, never on one still
        on its way (two sends at once may both ring)."""
        queue = destination.get("queue")
        key = (lane, getattr(queue, "name", None) or str(destination.get("routing_key")))
        now = time.monotonic()
        with self._lock:
            if now - self._rung.get(key, -DOORBELL_EVERY) < DOORBELL_EVERY:
                return
        routing = {k: v for k, v in destination.items() if k in _ROUTING}
        ring(self.app, lane, routing, producer=options.get("producer"),
             connection=options.get("connection"))
        with self._lock:
            self._rung[key] = now
            if len(self._rung) > 10_000:  # template names: forget the old ones
                self._rung = {k: t for k, t in self._rung.items()
                              if now - t < DOORBELL_EVERY}


def ring(app: Any, lane: str, routing: Dict[str, Any], producer: Any = None,
         connection: Any = None) -> None:
    """Publish the doorbell of ``lane`` (a small persistent internal task) with ``routing``
    (to the queue its parked tasks were routed to). It is published as Celery publishes a
    task but never announced: no ``task-sent`` event even with ``task_send_sent_event`` (an
    internal message never shows as a task in Flower), and no routing of the app's own
    applies (it goes exactly where ``routing`` says)."""
    message = app.amqp.create_task_message(uuid(), DOORBELL_TASK, (lane,), {},
                                           ignore_result=True)
    if producer is None and connection is not None:
        producer = app.amqp.Producer(connection, auto_declare=False)
    with app.producer_or_acquire(producer) as publisher:
        app.amqp.send_task_message(publisher, DOORBELL_TASK, message,
                                   headers={DOORBELL_HEADER: lane}, **routing)


def park_on_send(app: Any) -> None:
    """Park ``app``'s guarded sends (idempotent). See :class:`ParkOnSend`."""
    if isinstance(getattr(app.send_task, "__self__", None), ParkOnSend):
        return
    ParkOnSend(app).install()
