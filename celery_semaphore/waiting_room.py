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
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import threading
import time
from typing import Any, Dict, Iterable, Optional, Tuple

from kombu import Exchange, Queue

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
#: Seconds between two broadcasts from one worker that a semaphore has parked tasks.
ANNOUNCE_EVERY = 1.0

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


#: A fair key that can stand in a queue name as it is; any other is hashed.
_PLAIN_FAIR_KEY = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


def lane_of(name: str, fair: Optional[str]) -> str:
    """The parking lane of a task: its semaphore's name, or with ``semaphore_fair_by``,
    ``"<name>\n<fair key>"`` (a semaphore name holds no whitespace), parked apart so that
    workers can pull round-robin across keys."""
    return name if fair is None else f"{name}\n{fair}"


def semaphore_of(lane: str) -> str:
    """The semaphore name of a parking lane (:func:`lane_of`)."""
    return lane.partition("\n")[0]


def parking_queue_name(key_prefix: str, name: str) -> str:
    """``<key_prefix>park.<name>`` (a fair lane: ``...park.<name>.fair.<key>``, a key that is
    not plain ASCII of up to 64 characters as ``~<hash>``), shortened with a hash of ``name``
    past 200 bytes."""
    name, fair_lane, fair = name.partition("\n")
    full = f"{key_prefix}park.{name}"
    if fair_lane:
        if not _PLAIN_FAIR_KEY.fullmatch(fair):
            fair = "~" + hashlib.sha1(fair.encode()).hexdigest()[:16]
        full, name = f"{full}.fair.{fair}", f"{name}\n{fair}"
    if len(full.encode()) <= MAX_QUEUE_NAME:
        return full
    digest = hashlib.sha1(name.encode()).hexdigest()[:16]
    head = full.encode()[:MAX_QUEUE_NAME - 17].decode(errors="ignore")
    return f"{head}~{digest}"


def parking_queue(key_prefix: str, name: str, driver_type: str) -> Queue:
    """The parking queue of semaphore ``name`` as kombu declares it on a broker of
    ``driver_type``: durable, reached through the default exchange, expiring when unused on
    AMQP. Senders and workers declare it alike (RabbitMQ refuses a second declaration with
    other arguments)."""
    queue_name = parking_queue_name(key_prefix, name)
    arguments = None
    if driver_type == "amqp":
        arguments = {"x-expires": int(PARKING_QUEUE_EXPIRES * 1000)}
    return Queue(queue_name, Exchange(""), routing_key=queue_name, durable=True,
                 auto_delete=False, queue_arguments=arguments)


def parked_counts(app: Any, key_prefix: str, names: Iterable[str]) -> Dict[str, int]:
    """Tasks parked per semaphore name, asked of ``app``'s broker (0 where no parking queue
    exists). Raises when the broker cannot be reached."""
    counts: Dict[str, int] = {}
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        channel = connection.channel()
        try:
            for name in names:
                try:
                    counts[name] = channel.queue_declare(
                        queue=parking_queue_name(key_prefix, name), passive=True)[1]
                except connection.channel_errors:  # no such queue
                    counts[name] = 0
                    if getattr(channel, "is_open", True) is False:  # AMQP closes the channel
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
    process is free for the task).
    Anything else is sent as Celery sends it; the worker's gate handles it then (including a
    template it cannot fill, which fails that task alone).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.send_original = app.send_task
        self._guards: Any = None
        self._driver_type: Optional[str] = None
        self._rung: Dict[Tuple[str, str], float] = {}
        self._lock = threading.Lock()

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
        token = parking_now.set(lane)
        try:
            result = self.send_original(name, args, kwargs, queue=queue, exchange="",
                                        routing_key=queue.name, exchange_type="direct",
                                        headers=headers, **options)
        finally:
            parking_now.reset(token)
        self._ring(lane, destination, options)
        return result

    def driver_type(self) -> str:
        if self._driver_type is None:
            self._driver_type = self.app.connection_for_write().transport.driver_type
        return self._driver_type

    def _plan(self, name: str, args: Any, kwargs: Any,
              options: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
        """(parking lane, destination route) when this send is parked, else None."""
        task = options.get("task_type") or self.app.tasks.get(name)
        headers = options.get("headers") or {}
        if task is None or not (headers.get("semaphore") or getattr(task, "semaphore", None)):
            return None
        if self._guards is None:
            from .guards import Guards
            from .settings import Settings

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
        route_options = {key: options[key] for key in _ROUTING if key in options}
        if "queue" not in route_options and getattr(task, "queue", None):
            route_options["queue"] = task.queue
        router = options.get("router") or self.app.amqp.router
        destination = router.route(route_options, options.get("route_name") or name,
                                   args, kwargs, task)
        queue = destination.get("queue")
        if queue is not None and queue.exchange is not None and queue.exchange.type == "fanout":
            return None  # a broadcast: every worker runs it; the gate sees each copy
        return lane_of(guard.name, guard.fair), destination

    def _exchange_and_routing_key(self, destination: Dict[str, Any]) -> Tuple[str, str]:
        """Where Celery would publish a send routed to ``destination`` (as celery 5.x
        ``AMQP.send_task_message`` decides it)."""
        queue = destination.get("queue")
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

    def _ring(self, semaphore: str, destination: Dict[str, Any],
              options: Dict[str, Any]) -> None:
        """Send the doorbell for ``semaphore`` to ``destination``, at most once every
        :data:`DOORBELL_EVERY`."""
        queue = destination.get("queue")
        key = (semaphore, getattr(queue, "name", None) or str(destination.get("routing_key")))
        now = time.monotonic()
        with self._lock:
            if now - self._rung.get(key, -DOORBELL_EVERY) < DOORBELL_EVERY:
                return
            self._rung[key] = now
            if len(self._rung) > 10_000:  # template names: forget the old ones
                self._rung = {k: t for k, t in self._rung.items()
                              if now - t < DOORBELL_EVERY}
        routing = {k: v for k, v in destination.items() if k in _ROUTING}
        try:
            self.send_original(DOORBELL_TASK, (semaphore,), None, ignore_result=True,
                               headers={DOORBELL_HEADER: semaphore},
                               producer=options.get("producer"),
                               connection=options.get("connection"), **routing)
        except Exception as exc:  # the task is parked: the next send of it rings again
            with self._lock:
                self._rung.pop(key, None)
            logger.warning("celery-semaphore: the doorbell for semaphore %r was not sent "
                           "(its parked tasks wait for the next one, or for a worker that "
                           "knows the semaphore): %s", semaphore, exc)


def park_on_send(app: Any) -> None:
    """Park ``app``'s guarded sends (idempotent). See :class:`ParkOnSend`."""
    if isinstance(getattr(app.send_task, "__self__", None), ParkOnSend):
        return
    ParkOnSend(app).install()
