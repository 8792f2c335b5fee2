"""What the gate reads of Celery's and kombu's internals (:mod:`celery_semaphore.worker.
celery_internals`), on objects shaped as Celery 5.x makes them: which pool jobs a broker
reconnect leaves running, the route a rerouted message keeps, and how a parked message is
taken from a Redis broker (against a redis-server of its own)."""

import contextlib
import uuid
from types import SimpleNamespace

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.worker import state as worker_state

from celery_semaphore.worker import celery_internals
from celery_semaphore.worker.celery_internals import (
    RUNS_ONCE_HANDED,
    _routed,
    dropped_job_child,
    handed_to_pool,
)


def prefork_consumer(cache):
    pool = PreforkPool.__new__(PreforkPool)
    pool._pool = SimpleNamespace(_cache=cache)
    return SimpleNamespace(pool=pool)


class Request:
    """Shaped as Celery's: weakly referenceable (Celery keeps weak sets of requests)."""

    def __init__(self, tag):
        self.message = SimpleNamespace(delivery_tag=tag)
        self.time_start = None
        self.acknowledged = False
        self._apply_result = None


class Job:
    """Shaped as billiard's ApplyResult (weakly referenceable), written to a child."""

    _accepted = False
    _write_to = object()


def request(tag):
    return Request(tag)


def test_a_job_the_flush_dropped_is_told_apart_by_whether_a_child_got_it():
    child = SimpleNamespace(pid=42)
    kept = SimpleNamespace(_job=1, _write_to=None)
    unwritten = SimpleNamespace(_job=2, _write_to=None)
    written = SimpleNamespace(_job=3, _write_to=child)
    consumer = prefork_consumer({1: kept})
    assert dropped_job_child(consumer, request("a"), kept) is False  # still in the pool
    assert dropped_job_child(consumer, request("b"), unwritten) is None  # never runs
    assert dropped_job_child(consumer, request("c"), written) is child  # runs unseen
    # a job with no pool identity (the thread pool's stand-in, or none at all) is never
    # taken for a dropped one: the worker's chaos run crashed the gate's stop on it
    assert dropped_job_child(consumer, request("d"), RUNS_ONCE_HANDED) is False
    assert dropped_job_child(consumer, request("e"), None) is False



def test_the_pipe_of_a_dead_pool_child_is_read_by_the_child_given_its_queues():
    """billiard gives an exited child's queues, with a job still unread in its pipe, to its
    replacement (the chaos run's duplicate: the gate took the job's dead ``_write_to`` for the
    child that runs it); a pipe the pool destroyed is read by no one."""
    queues = (object(), object(), None)
    dead = SimpleNamespace(pid=1, inq=queues[0])
    heir = SimpleNamespace(pid=2, inq=queues[0])
    other = SimpleNamespace(pid=3, inq=object())
    consumer = prefork_consumer({})
    inner = consumer.pool._pool
    inner._pool, inner._queues = [dead, other], {queues: dead}
    assert celery_internals.pipe_reader(consumer.pool, dead) is dead  # not reaped yet
    inner._pool, inner._queues = [other], {queues: None}
    assert celery_internals.pipe_reader(consumer.pool, dead) is celery_internals.PIPE_WAITS
    inner._pool, inner._queues = [heir, other], {queues: heir}
    assert celery_internals.pipe_reader(consumer.pool, dead) is heir
    inner._pool, inner._queues = [other], {}
    assert celery_internals.pipe_reader(consumer.pool, dead) is None


def test_acks_and_results_of_jobs_the_pool_dropped_are_seen_and_passed_on():
    from billiard.pool import ACK, READY

    passed, seen, ended = [], [], []
    handlers = {ACK: lambda *args: passed.append(args),
                READY: lambda *args: passed.append(("ready", *args))}
    consumer = prefork_consumer({7: object()})
    consumer.pool._pool._result_handler = SimpleNamespace(state_handlers=handlers)
    acked = lambda job, pid: seen.append((job, pid))  # noqa: E731
    assert celery_internals.watch_job_acks(consumer.pool, acked, ended.append)
    assert celery_internals.watch_job_acks(consumer.pool, acked, ended.append)  # once
    handlers[ACK](7, 0, 1.0, 41, None)  # in the cache: billiard's own business
    handlers[ACK](8, 0, 1.0, 42, None)  # dropped by a flush
    handlers[READY](7, 0, (True, "r7"), None)
    handlers[READY](8, 0, (True, "r8"), None)  # its task ran to its end
    assert seen == [(8, 42)] and ended == [8]
    assert passed == [(7, 0, 1.0, 41, None), (8, 0, 1.0, 42, None),
                      ("ready", 7, 0, (True, "r7"), None), ("ready", 8, 0, (True, "r8"), None)]
    assert not celery_internals.watch_job_acks(SimpleNamespace(), acked)  # not prefork


def test_handed_counts_accepted_written_and_thread_pool_jobs_but_not_unwritten_ones():
    requests = [request(tag) for tag in "abcde"]
    jobs = {
        id(requests[0]): (requests[0], SimpleNamespace(_accepted=True, _write_to=None)),
        id(requests[1]): (requests[1], SimpleNamespace(_accepted=False, _write_to=object())),
        id(requests[2]): (requests[2], SimpleNamespace(_accepted=False, _write_to=None)),
        id(requests[3]): (requests[3], RUNS_ONCE_HANDED),  # queued for a busy thread
    }
    saved = set(worker_state.reserved_requests)
    worker_state.reserved_requests.clear()
    worker_state.reserved_requests.update(requests)
    try:
        assert handed_to_pool(jobs) == {"a", "b", "d"}
        assert handed_to_pool() == set()  # the requests' own (weak) references are gone
    finally:
        worker_state.reserved_requests.clear()
        worker_state.reserved_requests.update(saved)


def test_a_request_applied_after_it_was_handed_is_judged_by_its_live_job():
    """With every prefork process busy, Celery's worker semaphore applies a request only once
    a process frees: when the gate handed it over it had no job yet. At a lost connection the
    gate takes a strong reference to the job it has by then (before the pool's flush drops
    it), and a job already written to a child counts as handed (the chaos run's duplicate)."""
    import weakref

    from celery_semaphore.worker.gate import Gate

    deferred = request("a")
    gate = Gate.__new__(Gate)
    gate.core = SimpleNamespace(in_pool={id(deferred): SimpleNamespace(request=deferred)})
    gate.jobs = {id(deferred): None}  # no job yet when it was handed
    job = Job()  # written to a child, not accepted
    deferred._apply_result = weakref.ref(job)
    saved = set(worker_state.reserved_requests)
    worker_state.reserved_requests.clear()
    worker_state.reserved_requests.add(deferred)
    try:
        gate._refresh_jobs()
        assert gate.jobs[id(deferred)] is job
        held = {id(deferred): (deferred, gate.jobs[id(deferred)])}
        assert handed_to_pool(held) == {"a"}
        del job  # the flush dropped the pool's reference: the gate's own keeps it
        assert handed_to_pool(held) == {"a"}
    finally:
        worker_state.reserved_requests.clear()
        worker_state.reserved_requests.update(saved)


def test_a_rerouted_payload_says_where_it_goes_and_the_original_is_unchanged():
    payload = {"body": "x", "headers": {"id": "t"},
               "properties": {"delivery_tag": "d", "delivery_info": {
                   "exchange": "", "routing_key": "semaphore:park.q|lane", "priority": 0}}}
    routed = _routed(payload, "tasks", "q")
    assert routed["properties"]["delivery_info"] == {"exchange": "tasks", "routing_key": "q",
                                                     "priority": 0}
    assert routed["properties"]["delivery_tag"] == "d" and routed["body"] == "x"
    assert payload["properties"]["delivery_info"]["routing_key"] == "semaphore:park.q|lane"
    assert _routed("not a payload", "tasks", "q") == "not a payload"


def test_still_held_follows_celerys_worker_state():
    held = request("a")
    worker_state.reserved_requests.add(held)
    try:
        assert celery_internals.still_held(held)
    finally:
        worker_state.reserved_requests.discard(held)
    assert not celery_internals.still_held(held)


def test_a_heartbeat_due_while_the_broker_is_away_does_not_hold_the_event_loop(tmp_path):
    """Celery's worker heartbeat publishes with retry=True and no policy: kombu retries it
    without end, on the event loop, once the broker it was connected to has gone (a worker
    blocked there for a whole outage, its gate with it: unbounded, this send is still
    retrying 40 s later). Once the gate's step has bounded it, a heartbeat sent after the
    broker died returns at once, and the dispatcher keeps the event for later."""
    import threading

    from celery import Celery
    from celery.worker import heartbeat

    from tests import servers

    assert celery_internals.bound_heartbeat_retries()
    assert celery_internals.bound_heartbeat_retries()  # idempotent
    port = servers.free_port()
    proc, client = servers.start_redis(port, str(tmp_path))
    client.close()
    app = Celery("heartbeat", broker=f"redis://127.0.0.1:{port}/0")
    connection = app.connection_for_write()
    try:
        dispatcher = app.events.Dispatcher(connection, hostname="hb@test", enabled=True)
        heart = heartbeat.Heart(SimpleNamespace(), dispatcher, interval=2.0)
        heart._send("worker-heartbeat")  # connected: it goes out
        assert dispatcher._outbound_buffer == type(dispatcher._outbound_buffer)()
        proc.kill()
        proc.wait(10)
        sent = threading.Thread(target=heart._send, args=("worker-heartbeat",), daemon=True)
        sent.start()
        sent.join(20)
        assert not sent.is_alive(), "the heartbeat still retries its publish"
        (kept,) = dispatcher._outbound_buffer  # (the event, ...): its shape varies by version
        assert "worker-heartbeat" in repr(kept[0])
    finally:
        proc.kill()
        connection.release()
        app.close()


def test_a_queued_job_is_written_to_the_child_that_freed_before_its_callback_goes_on():
    """A real prefork pool of one process on a kombu hub: while the first job's callback
    runs, the child is idle and the second job waits in the pool's outbound buffer; the loop
    would write it only at its next turn, after the callback (and whatever it sends and
    reads: the gate's release and its answer). ``write_queued_jobs`` writes it there and
    then."""
    import time

    from celery import Celery
    from celery.concurrency.prefork import TaskPool
    from kombu.asynchronous import Hub

    hub = Hub()
    pool = TaskPool(1, initargs=(Celery("internals", set_as_current=False), "internals@test"),
                    threads=False, putlocks=False)  # as a worker with an event loop makes it
    pool.start()
    try:
        pool.register_with_event_loop(hub)
        seen = {}
        second = []

        def first_done(*args):
            seen["queued"] = second[0]._scheduled_for is None
            seen["asked"] = celery_internals.write_queued_jobs(pool, hub)
            seen["written"] = second[0]._scheduled_for is not None
            seen["again"] = celery_internals.write_queued_jobs(pool, hub)  # nothing queued

        pool.apply_async(time.sleep, (0.05,), callback=first_done)
        second.append(pool.apply_async(time.sleep, (0,), callback=lambda *a: seen.setdefault(
            "second done", True)))
        loop = hub.create_loop()
        deadline = time.monotonic() + 30
        while "second done" not in seen and time.monotonic() < deadline:
            next(loop)
        assert seen == {"queued": True, "asked": True, "written": True, "again": False,
                        "second done": True}
    finally:
        pool.terminate()
        hub.close()


def test_writing_queued_jobs_asks_nothing_of_a_pool_that_has_no_outbound_buffer():
    hub = SimpleNamespace(consolidate_callback=lambda fds: calls.append(fds))
    calls = []
    thread_pool = SimpleNamespace(_pool=SimpleNamespace())  # the thread pool's executor
    assert not celery_internals.write_queued_jobs(thread_pool, hub)
    assert not celery_internals.write_queued_jobs(SimpleNamespace(), SimpleNamespace())
    empty = SimpleNamespace(_pool=SimpleNamespace(_all_inqueues={5}, outbound_buffer=[]))
    assert not celery_internals.write_queued_jobs(empty, hub)
    queued = SimpleNamespace(_pool=SimpleNamespace(_all_inqueues={5, 7}, outbound_buffer=[1]))
    assert celery_internals.write_queued_jobs(queued, hub)
    assert [sorted(fds) for fds in calls] == [[5, 7]]


# -- taking a parked message from a Redis broker ---------------------------------------------


def _calls(client):
    from tests.servers import command_calls

    return command_calls(client)


def _publish(connection, queue, bodies, priority=None):
    from kombu import Producer

    producer = Producer(connection.default_channel)
    for body in bodies:
        producer.publish(body, exchange="", routing_key=queue.name, priority=priority,
                         headers={"empty": [], "also": {}}, serializer="json")


@pytest.mark.parametrize("prefix", ["", "pre:"])
def test_a_take_whose_reply_was_lost_is_found_by_its_record_time(private_redis, prefix):
    """``taken_at`` finds what ``take_unacked`` recorded with a given time, for the queue it
    was taken from, while it is unacked: neither another take's record nor another queue's
    with the same time, nor a record acked since."""
    from kombu import Connection, Queue

    url, client = private_redis
    options = {"global_keyprefix": prefix} if prefix else {}
    with Connection(url, transport_options=options) as connection:
        channel = connection.default_channel
        queue, other = (Queue(n, routing_key=n)(channel) for n in ("lane", "other"))
        for q in (queue, other):
            q.declare()
            _publish(connection, q, ["a", "b"])
        stamp = 1_795_000_000.123456
        lost = celery_internals.take_unacked(queue, stamp)
        celery_internals.take_unacked(queue, stamp + 1e-6)
        elsewhere = celery_internals.take_unacked(other, stamp)
        assert celery_internals.taken_at(channel, stamp, "lane") == [lost.delivery_tag]
        assert celery_internals.taken_at(channel, stamp, "other") == [elsewhere.delivery_tag]
        assert celery_internals.taken_at(channel, stamp - 1e-6, "lane") == []
        lost.ack()
        assert celery_internals.taken_at(channel, stamp, "lane") == []


@pytest.mark.parametrize("prefix", ["", "pre:"])
def test_a_message_taken_from_a_redis_queue_is_recorded_as_unacked_in_the_same_step(
        private_redis, prefix):
    """``take_unacked`` gives the messages kombu's own get gives, in the same order
    (priorities first), each recorded in the broker's unacked hash and index exactly as
    kombu records it, by one script: no moment when a message has left its queue and is not
    recorded (a broker dying there lost it). Acks, requeues and the visibility timeout's
    restore work on what it took; an empty queue gives None; an entry nobody can decode is
    dropped with an error, as kombu drops it."""
    from kombu import Connection, Queue
    from kombu.utils.json import loads

    url, client = private_redis
    options = {"global_keyprefix": prefix} if prefix else {}
    with Connection(url, transport_options=options) as connection:
        channel = connection.default_channel
        queue, twin = (Queue(n, routing_key=n)(channel) for n in ("lane", "twin"))
        for q in (queue, twin):
            q.declare()
            _publish(connection, q, ["low-1", "low-2"])
            _publish(connection, q, ["high"], priority=9)
        kombus = [twin.get(no_ack=True).decode() for _ in range(3)]  # kombu's own order
        assert sorted(kombus) == ["high", "low-1", "low-2"] and kombus[1:] != ["low-2", "low-1"]
        before = _calls(client)
        first = celery_internals.take_unacked(queue)
        after = _calls(client)
        # one script, no MULTI/EXEC pipeline after it (kombu's own get: RPOP, then one)
        assert after.get("eval", 0) - before.get("eval", 0) == 1
        assert after.get("exec", 0) == before.get("exec", 0)
        taken = [first, celery_internals.take_unacked(queue),
                 celery_internals.take_unacked(queue)]
        assert [m.decode() for m in taken] == kombus
        assert celery_internals.take_unacked(queue) is None
        qos = channel.qos
        assert set(qos._delivered) == {m.delivery_tag for m in taken}
        entries = client.hgetall(f"{prefix}unacked")
        assert {k.decode() for k in entries} == {m.delivery_tag for m in taken}
        assert client.zcard(f"{prefix}unacked_index") == 3
        for message in taken:
            payload, exchange, routing_key = loads(entries[message.delivery_tag.encode()])
            assert payload == message._raw and (exchange, routing_key) == ("", "lane")
        assert taken[0].headers == {"empty": [], "also": {}}

        taken[0].ack()  # gone from the hash
        taken[1].reject(requeue=True)  # back at the head of its queue
        assert {k.decode() for k in client.hgetall(f"{prefix}unacked")} == {
            taken[2].delivery_tag}
        again = celery_internals.take_unacked(queue)
        assert again.decode() == kombus[1]
        assert (again.headers["empty"], again.headers["also"]) == ([], {})  # (redelivered)
        # a worker killed now: the visibility timeout's restore puts both back
        qos._delivered.clear()  # (the restore takes what is older than the timeout)
        client.zadd(f"{prefix}unacked_index", {again.delivery_tag: 0, taken[2].delivery_tag: 0})
        qos.restore_visible(num=10)
        assert sorted(m.decode() for m in (celery_internals.take_unacked(queue),
                                           celery_internals.take_unacked(queue))) == sorted(
            kombus[1:])

        client.lpush(f"{prefix}lane", b"{not json")
        with pytest.raises(ValueError):
            celery_internals.take_unacked(queue)
        assert celery_internals.take_unacked(queue) is None


def test_an_entry_the_servers_json_cannot_read_is_recorded_as_kombu_records_it(
        private_redis, monkeypatch):
    """Where the script could not read an entry that kombu can, the message is recorded by
    kombu's own two steps rather than dropped."""
    from kombu import Connection, Queue

    url, client = private_redis
    unreadable = celery_internals._TAKE_SCRIPT.replace(
        "if type(info) ~= 'table'", "if true or type(info) ~= 'table'")
    monkeypatch.setattr(celery_internals, "_TAKE_SCRIPT", unreadable)
    with Connection(url) as connection:
        queue = Queue("lane", routing_key="lane")(connection.default_channel)
        queue.declare()
        _publish(connection, queue, ["one"])
        message = celery_internals.take_unacked(queue)
        assert message.decode() == "one"
        assert client.hexists("unacked", message.delivery_tag)
        message.ack()
        assert client.hlen("unacked") == 0


def test_taking_from_an_amqp_queue_is_kombus_own_get(amqp_url):
    from kombu import Connection, Queue

    with Connection(amqp_url) as connection:
        name = f"cs-take-{uuid.uuid4().hex[:8]}"
        queue = Queue(name, routing_key=name, auto_delete=True)(connection.default_channel)
        queue.declare()
        try:
            _publish(connection, queue, ["a"])
            message = celery_internals.take_unacked(queue)
            assert message is not None and message.decode() == "a"
            message.ack()
            assert celery_internals.take_unacked(queue) is None
        finally:
            queue.delete()


def test_a_delivery_whose_record_failed_goes_back_from_the_workers_copy(private_redis,
                                                                        monkeypatch):
    """kombu's Redis ``QoS.append`` records a received message in the broker in one
    transaction; a connection lost there (the transaction never landed) left the message in
    no queue and no unacked hash, and the lost connection's restore by tag found nothing:
    the task was lost. Now the failed append keeps a copy, and the restore puts the message
    back from it; where the record did land (its reply lost), from the record, once."""
    from celery import Celery
    from kombu import Connection, Queue

    url, client = private_redis
    assert celery_internals.record_deliveries_first()
    app = Celery(broker=url, set_as_current=False)
    with Connection(url) as connection:
        channel = connection.default_channel
        queue = Queue("lane", routing_key="lane")(channel)
        queue.declare()
        _publish(connection, queue, ["lost", "landed"])
        qos = channel.qos
        real = qos.pipe_or_acquire

        @contextlib.contextmanager
        def cut(pipe=None, client=None):
            with real(pipe, client) as p:
                p.execute = _raise_connection_error
                yield p

        monkeypatch.setattr(qos, "pipe_or_acquire", cut)
        with pytest.raises(ConnectionError):
            queue.get(no_ack=False)  # "lost": popped, its record never landed
        monkeypatch.setattr(qos, "pipe_or_acquire", real)
        landed = queue.get(no_ack=False)  # "landed": recorded...
        assert landed.decode() == "landed"
        # ...but its reply lost as well: the channel keeps a copy of it too
        getattr(qos, celery_internals.UNRECORDED)[landed.delivery_tag] = (
            landed._raw, "", "lane")
        assert client.llen("lane") == 0 and client.hlen("unacked") == 1
        tags = list(qos._delivered)
        assert len(tags) == 2
        copies = celery_internals.unrecorded_copies(channel, tags)
        assert set(copies) == set(tags)
        assert celery_internals.unrecorded_copies(channel, tags) == {}  # taken once

        celery_internals.restore_unacked(app, tags, copies)
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
        back = sorted(queue.get(no_ack=True).decode() for _ in range(2))
        assert back == ["landed", "lost"]
        assert queue.get(no_ack=True) is None  # each once


def _raise_connection_error(*args, **kwargs):
    raise ConnectionError("the connection was reset")
