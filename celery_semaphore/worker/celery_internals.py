"""Every touch of Celery's, billiard's and kombu's internals the worker side needs, in one place.

Each function names the version whose behaviour it relies on; a transport or pool without the
structure it expects is left alone (the function reports that it did nothing).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import celery
from billiard.exceptions import WorkerLostError
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.thread import TaskPool as ThreadPool
from celery.exceptions import Terminated, TimeLimitExceeded
from celery.worker import state as worker_state
from kombu.utils.functional import maybe_list

#: The Celery version, as (major, minor), for the shims below that only older versions need.
CELERY_VERSION: Tuple[int, ...] = tuple(int(part) for part in celery.__version__.split(".")[:2])

#: Endings the pool reports before the child process has exited.
CHILD_KILLED = (TimeLimitExceeded, Terminated, WorkerLostError, SystemExit, KeyboardInterrupt)


def pool_forks(pool: Any) -> bool:
    """True for the prefork pool, whose killed tasks may run until their process exits; other
    pools run tasks in the worker process (gevent's ``worker_pid`` is a greenlet's id)."""
    return isinstance(pool, PreforkPool)


def pool_queues(pool: Any) -> bool:
    """True for pools that queue a request handed to them while every process or thread is
    busy (prefork's outbound buffer, the thread pool's executor); gevent's and eventlet's
    block the caller until a greenlet is free, and solo runs it as it is handed."""
    return isinstance(pool, (PreforkPool, ThreadPool))


def pool_size(pool: Any) -> int:
    return getattr(pool, "num_processes", None) or getattr(pool, "limit", None) or 1


def reserved_count() -> int:
    """Requests the worker has reserved: waiting ones, and those the pool runs or will run
    (celery 5.x ``worker.state.reserved_requests``)."""
    return len(worker_state.reserved_requests)


def still_held(request: Any) -> bool:
    """True while Celery's worker state counts ``request`` reserved or active (it has not
    ended, nor been forgotten on a reconnect)."""
    return request in worker_state.reserved_requests or request in worker_state.active_requests


def task_ready(request: Any) -> None:
    """Tell Celery's worker state that ``request`` has left the worker (not run here)."""
    worker_state.task_ready(request)


def runs_in_child(pid: int) -> bool:
    """True when an active request runs in pool child ``pid``."""
    return any(other.worker_pid == pid for other in list(worker_state.active_requests))


class _RunsOnceHanded:
    """The job of a request handed to a pool that keeps no reference to it (the thread pool):
    it runs whatever happens to the broker connection (nothing drops it)."""

    _accepted = True
    _write_to = None


RUNS_ONCE_HANDED: Any = _RunsOnceHanded()


def pool_job(request: Any) -> Any:
    """The pool's ApplyResult of ``request`` once handed to the pool (celery 5.x keeps a weak
    reference in ``Request._apply_result``), else None."""
    ref = getattr(request, "_apply_result", None)
    return ref() if ref is not None else None


def revoked_before_start(request: Any) -> bool:
    """True when Celery revoked (or expired) ``request`` before a pool process took it: its
    ``_already_revoked`` flag is set and it never started."""
    return request.time_start is None and getattr(request, "_already_revoked", False)


def dropped_job_child(consumer: Any, request: Any, job: Any) -> Optional[Any]:
    """After a broker reconnect flushed the prefork pool (celery 5.x ``AsynPool.flush``): was
    ``request``'s job dropped? Returns False when the job is still in the pool (or ran, or the
    pool does not fork), None when it was dropped before any child got it, else the child
    process it was being written to (``_write_to``). That child may have exited, even before
    the write (a pool reaps a dead child only when it notices, up to 5 s later): who runs the
    job with no callbacks is the child that acknowledges it (:func:`watch_job_acks`), or else
    the one that reads its pipe (:func:`pipe_reader`)."""
    pool = getattr(consumer.pool, "_pool", None)  # None once the pool has stopped
    if (job is None or request.time_start is not None or not pool_forks(consumer.pool)
            or pool is None or getattr(job, "_job", None) is None or job._job in pool._cache):
        return False
    return getattr(job, "_write_to", None)


def _result_handlers(pool: Any) -> Optional[Tuple[Dict[int, Any], Any]]:
    """A prefork pool's result handler's ``state_handlers`` and the pool's job cache (billiard
    4.x), or None for another pool."""
    inner = getattr(pool, "_pool", None) if pool_forks(pool) else None
    handlers = getattr(getattr(inner, "_result_handler", None), "state_handlers", None)
    cache = getattr(inner, "_cache", None)
    if not isinstance(handlers, dict) or cache is None:
        return None
    return handlers, cache


def watch_job_acks(pool: Any, acked: Callable[[int, int], None],
                   ended: Optional[Callable[[int], None]] = None) -> bool:
    """Call ``acked(job_id, pid)`` for each job a prefork pool child acknowledges (it read the
    job and runs it), and ``ended(job_id)`` for each job a child reports done (its result:
    the task ran to its end, whatever its outcome), that is no longer in the pool's cache:
    billiard's result handler drops those messages, and a broker reconnect's flush takes
    every job no child had acknowledged out of the cache, a job written to a child's pipe
    included (billiard 4.x ``ResultHandler.state_handlers[ACK]`` and ``[READY]``, called by
    its ``on_state_change`` for every message a child sends, also those of a dead child
    drained as it is reaped). True once wrapped (once per result handler)."""
    from billiard.pool import ACK, READY

    found = _result_handlers(pool)
    if found is None or ACK not in found[0] or READY not in found[0]:
        return False
    handlers, cache = found
    on_ack, on_ready = handlers[ACK], handlers[READY]
    if getattr(on_ack, "watched_by_gate", False):
        return True

    def watched_ack(job: int, i: int, time_accepted: float, pid: int, *args: Any) -> Any:
        if job not in cache:
            acked(job, pid)
        return on_ack(job, i, time_accepted, pid, *args)

    def watched_ready(job: int, *args: Any) -> Any:
        if ended is not None and job not in cache:
            ended(job)
        return on_ready(job, *args)

    watched_ack.watched_by_gate = True  # type: ignore[attr-defined]
    handlers[ACK], handlers[READY] = watched_ack, watched_ready
    return True


#: :func:`pipe_reader`: the pipe's child exited and its replacement has not started yet.
PIPE_WAITS: Any = object()


def pipe_reader(pool: Any, child: Any) -> Any:
    """The prefork pool process that reads, now, the pipe a job was written to when it went
    to pool process ``child`` (a job's ``_write_to``): ``child`` until the pool reaps it; then
    the child the pool gave its queues to, which reads what is left unread in that pipe first
    (celery 5.x ``AsynPool``: ``_process_cleanup_queues`` frees an exited child's queues and
    ``get_process_queues`` gives them to its replacement); :data:`PIPE_WAITS` while they wait
    for that replacement; None once the pool has destroyed them (``on_partial_read``, when a
    job in its cache was written to the exited child), and what they held with them."""
    inner = getattr(pool, "_pool", None)
    inq = getattr(child, "inq", None)
    if inner is None or inq is None:
        return child
    for process in list(getattr(inner, "_pool", ())):
        if getattr(process, "inq", None) is inq:
            return process
    if any(queues[0] is inq for queues in list(getattr(inner, "_queues", None) or ())):
        return PIPE_WAITS
    return None


def write_queued_jobs(pool: Any, hub: Any) -> bool:
    """Prefork: write the jobs waiting in the pool's outbound buffer to its idle children now,
    as the event loop would at its next turn (celery 5.x ``AsynPool``: ``schedule_writes``,
    the hub's ``consolidate_callback``, over the children's inqueues; it skips one being
    written to, one gone, and with the fair strategy, Celery's default, a busy child). Called
    from a pool callback, it writes a job to the child that just finished before whatever the
    callback does next (the pool marks the child free before it runs the callbacks). True if
    it asked."""
    inner = getattr(pool, "_pool", None)
    write = getattr(hub, "consolidate_callback", None)
    inqueues = getattr(inner, "_all_inqueues", None)
    if write is None or not inqueues or not getattr(inner, "outbound_buffer", None):
        return False
    write(list(inqueues))
    return True


def keep_running_jobs_on_flush(pool: Any) -> bool:
    """Celery 5.3 to 5.5 only: make the prefork pool's flush on a broker reconnect keep the
    jobs a pool child has accepted, as Celery 5.6 does. True if the pool was wrapped (once).

    ``AsynPool.flush`` of those versions empties the pool's whole job cache when no write to
    a child is in progress (celery/celery#8541): a task running across a reconnect then
    finishes in its child, but its callbacks never run in the worker, so its slot would be
    held (its lease renewed) until the worker stops, and Celery counts it active for ever.
    Jobs no child has accepted are still dropped (the broker redelivers their messages).
    The consumer calls ``TaskPool.flush``, bound to the pool once it started; that attribute
    is wrapped (call this after the pool started, e.g. when the consumer starts).
    """
    if CELERY_VERSION >= (5, 6) or not pool_forks(pool):
        return False
    flush = getattr(pool, "flush", None)
    if flush is None or getattr(flush, "keeps_running_jobs", False):
        return False

    def flush_keeping_running_jobs() -> Any:
        cache = getattr(getattr(pool, "_pool", None), "_cache", None)
        running = {} if cache is None else {
            key: job for key, job in list(cache.items()) if getattr(job, "_accepted", False)}
        try:
            return flush()
        finally:
            if cache is not None:
                for key, job in running.items():
                    cache.setdefault(key, job)

    flush_keeping_running_jobs.keeps_running_jobs = True  # type: ignore[attr-defined]
    pool.flush = flush_keeping_running_jobs
    return True


def consumer_connected(consumer: Any) -> bool:
    """True while the consumer's broker connection is open. Celery 5.7 drops a lost
    connection (``consumer.connection`` becomes None) before the consumer's steps stop;
    Celery 5.3 to 5.6 keep the lost one there, collected by kombu (its ``connected`` is
    False), until the Connection step stops."""
    connection = consumer.connection
    if connection is None:
        return False
    return CELERY_VERSION >= (5, 7) or bool(connection.connected)


def revocations() -> Tuple[int, int]:
    """A cheap fingerprint of the worker's revocations: it changes when a revoke (by id or by
    stamped header) arrives (celery 5.x ``worker.state.revoked``, ``revoked_stamps``)."""
    stamps = sum(len(maybe_list(v) or ()) for v in worker_state.revoked_stamps.values())
    return len(worker_state.revoked), stamps


def is_revoked(task_id: str, stamps: Optional[Dict[str, Any]]) -> bool:
    """Celery's own test (celery 5.x ``Request.revoked``), without the request: revoked by id,
    or by one of the task's stamped headers."""
    if task_id in worker_state.revoked:
        return True
    for header, value in (stamps or {}).items():
        revoked = worker_state.revoked_stamps.get(header)
        if revoked is None or value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(v in maybe_list(revoked) or v == revoked for v in values):
            return True
    return False


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


def detach_unacked(message: Any) -> bool:
    """Forget ``message`` in its channel's unacked set without touching the broker, if the
    channel is kombu's Redis transport (which keeps every unacked message in the broker's
    ``unacked`` hash until it is acked or restored). True if it was detached.

    kombu 5.x: ``redis.QoS._delivered`` maps delivery tags to messages; closing the channel
    restores each of them, which is what must not happen on a lost connection.
    """
    qos = getattr(getattr(message, "channel", None), "qos", None)
    delivered = getattr(qos, "_delivered", None)
    if delivered is None or not hasattr(qos, "restore_by_tag") or not hasattr(qos,
                                                                              "unacked_key"):
        return False
    return delivered.pop(message.delivery_tag, None) is not None


def redis_qos(channel: Any) -> Any:
    """``channel``'s QoS if it is kombu's Redis transport (kombu 5.x ``redis.QoS``: delivered
    messages in ``_delivered``, the broker's ``unacked`` hash behind it), else None."""
    qos = getattr(channel, "qos", None)
    if (getattr(qos, "_delivered", None) is None or not hasattr(qos, "restore_by_tag")
            or not hasattr(qos, "unacked_key")):
        return None
    return qos


def visibility_timeout(channel: Any) -> Optional[float]:
    """Seconds after which kombu's Redis transport delivers a message unacked on ``channel``
    again (kombu 5.x ``redis.Channel.visibility_timeout``, from the transport options), or
    None for another transport (AMQP delivers again only once the channel is closed)."""
    if redis_qos(channel) is None:
        return None
    timeout = getattr(channel, "visibility_timeout", None)
    return float(timeout) if isinstance(timeout, (int, float)) else None


def parking_channel(connection: Any) -> Any:
    """The channel of ``connection`` the parking lot pulls on: kombu 5.x keeps the default
    channel in ``Connection._default_channel`` (None when it was never opened)."""
    return getattr(connection, "_default_channel", None)


def task_channel(consumer: Any) -> Any:
    """The channel ``consumer`` receives its task messages on."""
    return getattr(getattr(consumer, "task_consumer", None), "channel", None)


def unacked_of_task(channel: Any, task_name: str) -> Set[str]:
    """Delivery tags of the messages of task ``task_name`` unacked on ``channel`` (kombu's
    Redis transport; an empty set for another transport)."""
    qos = redis_qos(channel)
    if qos is None:
        return set()
    return {tag for tag, message in list(qos._delivered.items())
            if (getattr(message, "headers", None) or {}).get("task") == task_name}


def forget_unacked(qos: Any) -> List[str]:
    """Forget every unacked message of a Redis transport's ``qos`` without touching the
    broker (they stay in its unacked hash); their delivery tags."""
    delivered = qos._delivered
    tags = list(delivered)
    delivered.clear()
    return tags


def handed_to_pool(jobs: Optional[Dict[int, Tuple[Any, Any]]] = None) -> Set[str]:
    """Delivery tags of the requests whose task runs, ran, or will run without a new delivery
    (celery.worker.state; read on the consumer's thread, or copied again if another thread
    changed a set meanwhile): Celery's active requests, those it acknowledged, and those whose
    pool job a child has accepted (celery 5.x ``ApplyResult._accepted``; a job of a pool that
    does not fork, which has no such flag, runs once handed) or is being or was written to
    (``_write_to``: the pool's flush on a broker reconnect drops the job but finishes the
    write, and the child runs it; :class:`.release.Orphan` settles its message). A prefork
    job no child got is not among them: the flush drops it, counting on the broker to
    deliver its message again (``AsynPool.flush``). ``jobs``: ``id(request) -> (request,
    job)`` for the requests whose pool job the caller holds (a request's own reference is
    weak, and the thread pool keeps none: a job queued for a busy thread would look gone)."""
    from celery.worker import state

    for _ in range(10):
        try:
            active = tuple(state.active_requests)
            requests = active + tuple(state.reserved_requests)
            break
        except RuntimeError:  # "changed size during iteration"
            continue
    else:
        return set()
    handed = set()
    for request in requests:
        held = jobs.get(id(request)) if jobs is not None else None
        job = pool_job(request)
        if job is None and held is not None and held[0] is request:
            job = held[1]
        if (request in active or getattr(request, "acknowledged", False)
                or (job is not None and (getattr(job, "_accepted", True)
                                         or getattr(job, "_write_to", None) is not None))):
            tag = getattr(getattr(request, "message", None), "delivery_tag", None)
            if tag is not None:
                handed.add(tag)
    return handed


#: kombu's Redis ``basic_get`` in one server step: the first message of the queue's lists (by
#: priority) is popped and recorded in the unacked index and hash as ``QoS.append`` records it
#: (``[payload, exchange, routing_key]``, the route from the payload's ``delivery_info``).
#: KEYS: the lists, then the unacked index and hash; ARGV[1]: the time (s) for the index.
#: Returns ``{entry, 1}``, or ``{entry, 0}`` for an entry it cannot read (popped, not
#: recorded: kombu's own get would drop it the same way), or nil when every list is empty.
_TAKE_SCRIPT = """
local lists = #KEYS - 2
for i = 1, lists do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local ok, payload = pcall(cjson.decode, item)
    local properties = ok and type(payload) == 'table' and payload['properties']
    local info = type(properties) == 'table' and properties['delivery_info']
    local tag = type(properties) == 'table' and properties['delivery_tag']
    if type(info) ~= 'table' or type(tag) ~= 'string' then return {item, 0} end
    redis.call('ZADD', KEYS[lists + 1], ARGV[1], tag)
    redis.call('HSET', KEYS[lists + 2], tag, '[' .. item .. ',' .. cjson.encode(info['exchange'])
      .. ',' .. cjson.encode(info['routing_key']) .. ']')
    return {item, 1}
  end
end
return false
"""


class UndecodableEntry(ValueError):
    """:func:`take_unacked` took an entry that cannot be decoded (out of its queue, as kombu's
    own get takes it): the cause is chained."""


def take_unacked(queue: Any, stamp: Optional[float] = None) -> Any:
    """``queue.get(no_ack=False)``: the next message of the bound ``queue``, or None when it is
    empty. On kombu's Redis transport the message leaves the queue and enters the broker's
    unacked hash in one server step (a script): kombu's own get pops it first and records it
    with a second command, and a broker that dies between the two loses the message. The
    record's time is ``stamp`` (Unix seconds; now by default): a take whose reply was lost
    finds its record by that time (:func:`taken_at`). Raises what kombu's get raises (a lost
    connection), and :class:`UndecodableEntry` for an entry that cannot be decoded (dropped,
    as kombu drops it)."""
    channel = queue.channel
    qos = redis_qos(channel)
    if qos is None or not hasattr(channel, "_q_for_pri"):
        try:
            return queue.get(no_ack=False)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise UndecodableEntry(f"{type(exc).__name__}: {exc}") from exc
    import time

    from kombu.utils.encoding import bytes_to_str
    from kombu.utils.json import loads

    prefix = getattr(channel, "global_keyprefix", "") or ""
    keys = [prefix + channel._q_for_pri(queue.name, pri) for pri in channel.priority_steps]
    keys += [prefix + qos.unacked_index_key, prefix + qos.unacked_key]
    with channel.conn_or_acquire() as client:
        # EVAL with the keys prefixed here: kombu's prefixing client leaves EVAL alone
        taken = client.eval(_TAKE_SCRIPT, len(keys), *keys,
                            repr(time.time() if stamp is None else stamp))
        refresh = getattr(channel, "_maybe_update_queues_expire", None)  # kombu >= 5.4
        if refresh is not None:
            refresh(client, queue.name)
    if not taken:
        return None
    from kombu.transport.virtual import QoS as VirtualQoS

    item, recorded = taken
    try:
        payload = loads(bytes_to_str(item))  # raises for what kombu could not decode either
        message = channel.message_to_python(channel.Message(payload, channel=channel))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise UndecodableEntry(f"{type(exc).__name__}: {exc}") from exc
    if recorded:  # in memory only: the script recorded it in the broker
        VirtualQoS.append(qos, message, message.delivery_tag)
    else:  # an entry the server's JSON could not read: recorded as kombu records it
        qos.append(message, message.delivery_tag)
    if message.errors:
        try:
            message._reraise_error()
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise UndecodableEntry(f"{type(exc).__name__}: {exc}") from exc
    return message


_TAKEN_AT_SCRIPT = """
local found = {}
for _, tag in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], ARGV[1])) do
  local raw = redis.call('HGET', KEYS[2], tag)
  local ok, entry = pcall(cjson.decode, raw or '')
  if ok and type(entry) == 'table' and entry[3] == ARGV[2] then found[#found + 1] = tag end
end
return found
"""


def taken_at(channel: Any, stamp: float, queue_name: str) -> List[str]:
    """Delivery tags of the messages of ``queue_name`` that :func:`take_unacked` recorded in
    the Redis broker's unacked hash with time ``stamp`` on ``channel``, still there: a take
    whose reply never reached the worker (the broker died, or the connection, after the
    script ran), which nothing else would put back before the transport's
    ``visibility_timeout``. Raises when the broker cannot be reached."""
    qos = redis_qos(channel)
    if qos is None:
        return []
    prefix = getattr(channel, "global_keyprefix", "") or ""
    with channel.conn_or_acquire() as client:  # (EVAL: the keys prefixed here)
        tags = client.eval(_TAKEN_AT_SCRIPT, 2, prefix + qos.unacked_index_key,
                           prefix + qos.unacked_key, repr(stamp), queue_name)
    return [tag.decode() if isinstance(tag, bytes) else str(tag) for tag in tags or ()]


#: Attribute of a Redis ``QoS``: delivery tag -> ``(payload, exchange, routing_key)`` of each
#: message whose record in the broker failed (:func:`record_deliveries_first`).
UNRECORDED = "_celery_semaphore_unrecorded"

#: What :func:`restore_unacked` puts back from the worker's own copy when the broker has no
#: record: delivery tag -> ``(payload, exchange, routing_key)``.
Copies = Dict[str, Tuple[Any, str, str]]


def unrecorded_copies(channel: Any, tags: List[str]) -> Copies:
    """The copies of those of ``tags`` whose record in the broker failed as ``channel``
    received them (:func:`record_deliveries_first`), taken from the channel: the caller
    puts them back (:func:`restore_unacked`). {} for another transport."""
    qos = redis_qos(channel)
    kept = getattr(qos, UNRECORDED, None) if qos is not None else None
    if not kept:
        return {}
    return {tag: kept.pop(tag) for tag in tags if tag in kept}


def record_deliveries_first() -> bool:
    """kombu 5.x's Redis ``QoS.append`` records a message the consumer received in the
    broker's unacked hash (one ``MULTI``/``EXEC``) and only then in the channel's
    ``_delivered``. A broker that applies (and fsyncs) the transaction and dies before its
    reply reaches the worker leaves the message in the unacked hash with no trace in the
    worker: the append raises, the message's callback never runs, nothing restores it until
    the transport's ``visibility_timeout`` (an hour by default) delivers it again. From this
    call on, every Redis ``QoS`` of the process records the message in ``_delivered`` first:
    a failed append leaves it there, and the lost connection's restore
    (:meth:`.Gate.on_connection_lost`, or kombu's own as the channel closes) puts it back by
    delivery tag. A failed append also keeps the message's payload on the ``QoS``
    (:func:`unrecorded_copies`): if the transaction never landed, the gate's restore puts the
    message back from that copy (:func:`restore_unacked`). What no worker can put back is a
    message the broker popped for a connection that was gone before the reply arrived
    (kombu's own window: recorded nowhere, seen by nobody). Idempotent; False where kombu's
    Redis ``QoS`` is not shaped as expected."""
    try:
        from kombu.transport import redis as kombu_redis
        from kombu.transport.virtual import QoS as VirtualQoS
    except ImportError:  # pragma: no cover - kombu's redis transport needs redis-py
        return False
    append = getattr(kombu_redis.QoS, "append", None)
    if append is None or not hasattr(VirtualQoS, "append"):
        return False
    if getattr(append, "_celery_semaphore_records_first", False):
        return True

    @functools.wraps(append)
    def append_recorded_first(self: Any, message: Any, delivery_tag: Any) -> Any:
        VirtualQoS.append(self, message, delivery_tag)  # (append records it again: a dict)
        try:
            return append(self, message, delivery_tag)
        except BaseException:
            # the broker may hold no record of it: keep what a restore needs to put it back
            delivery = message.delivery_info
            self.__dict__.setdefault(UNRECORDED, {})[delivery_tag] = (
                message._raw, delivery["exchange"], delivery["routing_key"])
            raise

    append_recorded_first._celery_semaphore_records_first = True  # type: ignore[attr-defined]
    kombu_redis.QoS.append = append_recorded_first  # type: ignore[method-assign]
    return True


def reroute_unacked(channel: Any, reroutes: List[Tuple[Any, str, str]]) -> None:
    """Make every later restore of each pulled ``(message, exchange, routing_key)`` of
    ``channel`` (kombu's Redis transport: the visibility timeout's, a reject with requeue, the
    gate's after a lost connection) put the message where ``exchange`` routes
    ``routing_key``, instead of back where it was pulled from: kombu 5.x restores from the
    ``[payload, exchange, routing_key]`` it keeps in the broker's unacked hash
    (``QoS.append``), which this rewrites in one pipeline. The payload's own
    ``properties.delivery_info`` is rewritten too: a worker that consumes the restored message
    from its task queue records the route it finds there, and a later restore of that delivery
    must not send it back to the parking queue, where no doorbell announces it. Does nothing
    on another transport."""
    qos = redis_qos(channel)
    if qos is None or not reroutes:
        return
    from kombu.utils.json import dumps

    with channel.conn_or_acquire() as client:
        pipe = client.pipeline()
        for message, exchange, routing_key in reroutes:
            pipe.hset(qos.unacked_key, message.delivery_tag,
                      dumps([_routed(message._raw, exchange, routing_key), exchange,
                             routing_key]))
        pipe.execute()


def _routed(payload: Any, exchange: str, routing_key: str) -> Any:
    """A copy of a kombu virtual-transport ``payload`` whose ``delivery_info`` says it was
    published to ``exchange`` with ``routing_key`` (``payload`` itself is unchanged)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("properties"), dict):
        return payload
    properties = dict(payload["properties"])
    delivery_info = properties.get("delivery_info")
    properties["delivery_info"] = {**(delivery_info if isinstance(delivery_info, dict) else {}),
                                   "exchange": exchange, "routing_key": routing_key}
    return {**payload, "properties": properties}


def settle_unacked(app: Any, settlements: List[Tuple[str, bool]],
                   landed: Callable[[str], None]) -> None:
    """Settle messages of a Redis broker's unacked hash by delivery tag through a connection
    of its own: ``(tag, True)`` puts the message back at the head of its queue (kombu 5.x
    ``QoS.restore_by_tag``), ``(tag, False)`` removes it (``QoS._remove_from_indices``: an
    ack). Calls ``landed(tag)`` after each. A tag already gone is skipped. Raises when the
    broker cannot be reached."""
    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        qos = connection.default_channel.qos
        for tag, requeue in settlements:
            if requeue:
                qos.restore_by_tag(tag, leftmost=True)
            else:
                qos._remove_from_indices(tag).execute()
            landed(tag)


def restore_unacked(app: Any, tags: List[str], copies: Optional[Copies] = None) -> None:
    """Move the messages with delivery ``tags`` from a Redis broker's unacked hash back to the
    head of their queues, through a connection of its own (kombu 5.x ``QoS.restore_by_tag``,
    one transaction per message: a tag already restored or acked is skipped). A tag of
    ``copies`` (:func:`unrecorded_copies`) that the hash does not hold is put back from its
    copy, in the same kind of transaction; one the hash holds, from the hash (never both).
    Raises when the broker cannot be reached."""
    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        qos = connection.default_channel.qos
        for tag in tags:
            if copies and tag in copies:
                _restore_recorded_or_copy(qos, tag, copies[tag])
            else:
                qos.restore_by_tag(tag, leftmost=True)


def _restore_recorded_or_copy(qos: Any, tag: str, copy: Tuple[Any, str, str]) -> None:
    """kombu 5.x ``QoS.restore_by_tag``, with ``copy`` put back where the broker's unacked
    hash has no record of ``tag``."""
    from kombu.utils.json import loads

    def restore(pipe: Any) -> None:
        recorded = pipe.hget(qos.unacked_key, tag)
        pipe.multi()
        qos._remove_from_indices(tag, pipe)
        payload, exchange, routing_key = (
            loads(recorded.decode() if isinstance(recorded, bytes) else recorded)
            if recorded else copy)
        qos.channel._do_restore_message(payload, exchange, routing_key, pipe, True)

    with qos.channel.conn_or_acquire() as client:
        client.transaction(restore, qos.unacked_key)


def child_is_up(pool: Any, pid: int) -> bool:
    """True when the prefork pool's child ``pid`` has started (sent its UP message), so it
    takes jobs. celery 5.x ``AsynPool._waiting_to_start`` holds the children that have not."""
    inner = getattr(pool, "_pool", None)
    if inner is None:
        return False
    waiting = {getattr(proc, "pid", None) for proc in getattr(inner, "_waiting_to_start", ())}
    return pid not in waiting and any(proc.pid == pid for proc in getattr(inner, "_pool", ()))



def consumed_queues(consumer: Any) -> List[Any]:
    """The kombu queues ``consumer`` consumes tasks from (celery 5.x ``app.amqp.queues``
    filtered by ``-Q``: ``consumer.task_consumer.queues`` once the consumer runs)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    queues = getattr(task_consumer, "queues", None)
    if queues:
        return list(queues)
    return list(consumer.app.amqp.queues.consume_from.values())


def consumed_queue(consumer: Any, request: Any) -> Optional[Any]:
    """The queue among those ``consumer`` consumes that ``request``'s message came from, as
    far as its delivery info tells (the exchange and routing key it was published with); None
    when none of them matches."""
    delivery = request.delivery_info or {}
    exchange, routing_key = delivery.get("exchange") or "", delivery.get("routing_key")
    queues = consumed_queues(consumer)
    for queue in queues:
        if queue.name == routing_key and exchange in ("", getattr(queue.exchange, "name", "")):
            return queue
    for queue in queues:
        if (queue.routing_key == routing_key
                and exchange == getattr(queue.exchange, "name", None)):
            return queue
    for queue in queues:  # a topic or fanout exchange: the first queue bound to it
        if exchange and exchange == getattr(queue.exchange, "name", None):
            return queue
    return None


#: The retry policy of the worker's event heartbeat (below): one new connection, at once.
HEARTBEAT_RETRY: Dict[str, Any] = {"max_retries": 1, "interval_start": 0, "interval_step": 1,
                                   "interval_max": 1}


class _BoundedRetries:
    """An event dispatcher as the worker's heartbeat sees it: a send that asks to be retried
    without a policy of its own is retried by :data:`HEARTBEAT_RETRY`."""

    def __init__(self, dispatcher: Any) -> None:
        self._dispatcher = dispatcher

    def send(self, *args: Any, retry: bool = False, retry_policy: Optional[Dict[str, Any]] = None,
             **kwargs: Any) -> Any:
        if retry and retry_policy is None:
            retry_policy = HEARTBEAT_RETRY
        return self._dispatcher.send(*args, retry=retry, retry_policy=retry_policy, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dispatcher, name)


def bound_heartbeat_retries() -> bool:
    """Celery 5.x's worker heartbeat (``celery.worker.heartbeat.Heart``, with events on)
    publishes with ``retry=True`` and no retry policy, which kombu retries without end: a
    heartbeat due after the broker went away and before the consumer saw it retries on the
    event loop until the broker answers, and the worker, the gate with it (renewals, releases,
    the waiting room), stands still for the whole outage. From this call on, every heartbeat
    made in this process retries once (:data:`HEARTBEAT_RETRY`); one that still fails is
    buffered by the dispatcher (or logged by the timer) and the loop goes on, so the consumer
    sees the lost connection. Idempotent; False where ``Heart`` is not shaped as expected."""
    try:
        from celery.worker import heartbeat
    except ImportError:  # pragma: no cover - every Celery 5 has it
        return False
    init = heartbeat.Heart.__init__
    if getattr(init, "_celery_semaphore_bounded", False):
        return True

    @functools.wraps(init)
    def bounded(self: Any, timer: Any, eventer: Any, *args: Any, **kwargs: Any) -> None:
        init(self, timer, _BoundedRetries(eventer), *args, **kwargs)

    bounded._celery_semaphore_bounded = True  # type: ignore[attr-defined]
    heartbeat.Heart.__init__ = bounded
    return True

