"""Parking on send (``celery_semaphore.waiting_room.ParkOnSend``): where a send lands, read
back from a real Redis broker (no worker runs here; `tests/test_worker.py` runs them)."""

import base64
import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

import celery_semaphore
from celery_semaphore import waiting_room
from celery_semaphore.backends import get_backend
from celery_semaphore.waiting_room import (
    DOORBELL_EVERY,
    DOORBELL_HEADER,
    DOORBELL_TASK,
    FIRST_WAIT_HEADER,
    PARKED_HEADER,
    ROUTE_HEADER,
    lane_of,
    parking_queue_name,
)
from tests import servers


@pytest.fixture
def broker(redis_url):
    url = servers.redis_broker(redis_url)
    client = redis.Redis.from_url(url)
    tag = servers.unique_tag()
    yield url, client, tag
    for key in client.scan_iter(f"{tag}*"):
        client.delete(key)
    client.close()


def make_busy(tag, *names, limit=2):
    """Fill semaphores ``names`` and queue one waiter on each: they have a backlog, so sends
    of them are parked (a semaphore with room goes the plain way)."""
    backend = get_backend(f"memory://{tag}", key_prefix=f"{tag}:")
    for name in names:
        for i in range(limit + 1):
            backend.acquire(name, f"busy-{i}", limit=limit, ttl=60, meta={}, wait=True)
    return backend


def lane(tag, name, queue=None):
    return parking_queue_name(f"{tag}:", lane_of(name, None, queue or f"{tag}.q"))


def make_app(broker_url, tag, busy=True, **conf):
    app = Celery(f"park-on-send-{tag}", set_as_current=False)
    app.conf.update(broker_url=broker_url, semaphore_backend=f"memory://{tag}",
                    task_default_queue=f"{tag}.q", semaphore_key_prefix=f"{tag}:", **conf)
    celery_semaphore.install(app)
    if busy:
        make_busy(tag, "images", "api:7", "api:5", "n:1", limit=2)

    @app.task(name="t.guarded", semaphore="images", limit=2, shared=False)
    def guarded(key):
        return key

    @app.task(name="t.per_customer", semaphore="api:{customer}", limit=1, shared=False)
    def per_customer(customer, key):
        return key

    @app.task(name="t.subscript", semaphore="sub:{p[c]}", limit=1, shared=False)
    def subscript(p):
        return p

    @app.task(name="t.unguarded", shared=False)
    def unguarded(key):
        return key

    @app.task(name="t.not_on_send", semaphore="images", limit=2, shared=False,
              semaphore_park_on_send=False)
    def not_on_send(key):
        return key

    @app.task(name="t.bounded", semaphore="images", limit=2, shared=False,
              semaphore_max_wait=30)
    def bounded(key):
        return key

    return app


def messages(client, queue):
    """The messages in a kombu Redis queue, oldest first: (task name, headers, properties)."""
    found = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        payload = json.loads(raw)
        found.append((payload["headers"]["task"], payload["headers"], payload["properties"]))
    return found


def test_a_guarded_send_is_parked_and_rings_the_doorbell_in_its_queue(broker):
    url, client, tag = broker
    app = make_app(url, tag)
    before = time.time()
    result = app.tasks["t.guarded"].delay("a")
    ((name, headers, _),) = messages(client, lane(tag, "images"))
    assert name == "t.guarded" and headers["id"] == result.id
    assert headers[PARKED_HEADER] == lane_of("images", None, f"{tag}.q")
    assert before <= headers[FIRST_WAIT_HEADER] <= time.time()
    assert headers[ROUTE_HEADER] == ["", f"{tag}.q"]  # where a pulled copy's retries go
    ((name, headers, properties),) = messages(client, f"{tag}.q")
    assert name == DOORBELL_TASK
    assert headers[DOORBELL_HEADER] == lane_of("images", None, f"{tag}.q")
    assert properties["delivery_mode"] == 2  # persistent: found by a worker started later


def test_a_send_whose_doorbell_the_broker_refuses_raises_and_parks_nothing(broker,
                                                                           monkeypatch):
    """The doorbell goes first: when the broker does not take it, ``apply_async`` raises and
    nothing is parked (parked first, the task waited for a later send's doorbell: #27's
    chaos run); the next send rings again."""
    from kombu.exceptions import OperationalError

    from celery_semaphore import waiting_room

    url, client, tag = broker
    app = make_app(url, tag)
    real_ring = waiting_room.ring

    def refused(*args, **kwargs):
        raise OperationalError("the broker went away")

    monkeypatch.setattr(waiting_room, "ring", refused)
    with pytest.raises(OperationalError):
        app.tasks["t.guarded"].delay("a")
    assert client.llen(lane(tag, "images")) == 0 and client.llen(f"{tag}.q") == 0
    monkeypatch.setattr(waiting_room, "ring", real_ring)
    result = app.tasks["t.guarded"].delay("b")  # not throttled by the refused doorbell
    ((_, headers, _),) = messages(client, lane(tag, "images"))
    assert headers["id"] == result.id
    ((name, _, _),) = messages(client, f"{tag}.q")
    assert name == DOORBELL_TASK


def test_template_names_park_per_concrete_name_and_routes_follow_the_send(broker):
    url, client, tag = broker
    app = make_app(url, tag)
    send = app.tasks["t.per_customer"]
    send.apply_async((7, "first"), queue=f"{tag}.other")  # a key unknown here: the plain way
    send.apply_async((7, "a"), queue=f"{tag}.other")
    ((_, headers, _),) = messages(client, lane(tag, "api:7", f"{tag}.other"))
    assert headers[ROUTE_HEADER] == ["", f"{tag}.other"]
    assert [(name, headers.get(DOORBELL_HEADER)) for name, headers, _ in messages(
        client, f"{tag}.other")] == [  # the doorbell goes there too
            ("t.per_customer", None), (DOORBELL_TASK, lane_of("api:7", None, f"{tag}.other"))]
    assert client.llen(f"{tag}.q") == 0


def _counting_reads(monkeypatch):
    """The names whose backlog the senders read (``Backend.waiting_count``), in order."""
    from celery_semaphore.backends.memory import MemoryBackend

    reads = []
    read = MemoryBackend.waiting_count

    def counted(self, name):
        reads.append(name)
        return read(self, name)

    monkeypatch.setattr(MemoryBackend, "waiting_count", counted)
    return reads


def test_a_template_key_this_process_has_not_sent_costs_its_send_no_backend_read(
        broker, monkeypatch):
    """Thousands of keys, each sent now and then, most with room: a key not sent from this
    process for UNKNOWN_AFTER goes the plain way without a read (as if idle: a burst of it is
    still parked past its limit); a key sent again asks, and is parked if it has a backlog. A
    fixed name asks from its first send."""
    url, client, tag = broker
    reads = _counting_reads(monkeypatch)
    # "first" and "burst" must fall within one idle answer's trust however loaded the machine
    monkeypatch.setattr(waiting_room, "IDLE_FOR", 1.0)
    app = make_app(url, tag)
    per_customer = app.tasks["t.per_customer"]
    for customer in (11, 12, 13):  # no backlog, never sent: no read
        per_customer.delay(customer, "x")
    assert reads == []
    assert [h.get(PARKED_HEADER) for _, h, _ in messages(client, f"{tag}.q")] == [None] * 3
    per_customer.delay(7, "first")  # a backlog, but unknown here: the plain way, unread
    per_customer.delay(7, "burst")  # past its limit (1) while trusted idle: parked, unread
    assert reads == []
    assert len(messages(client, lane(tag, "api:7"))) == 1
    time.sleep(2 * waiting_room.IDLE_FOR)  # sleep-ok: the idle answer's trust lapses
    per_customer.delay(7, "again")  # sent before: asked, and parked
    assert reads == ["api:7"]
    assert len(messages(client, lane(tag, "api:7"))) == 2
    app.tasks["t.guarded"].delay("fixed")  # a fixed name: asked at once
    assert reads == ["api:7", "images"]
    assert len(messages(client, lane(tag, "images"))) == 1


def test_a_template_key_is_forgotten_after_a_while_and_past_the_most_remembered(
        broker, monkeypatch):
    url, client, tag = broker
    reads = _counting_reads(monkeypatch)
    app = make_app(url, tag)
    per_customer = app.tasks["t.per_customer"]
    monkeypatch.setattr(waiting_room, "MAX_REMEMBERED", 1)
    per_customer.delay(7, "a")
    per_customer.delay(5, "b")  # forgets api:7
    time.sleep(2 * waiting_room.IDLE_FOR)  # sleep-ok: the idle answer's trust lapses
    per_customer.delay(7, "c")  # unknown again: plain, unread
    assert reads == []
    monkeypatch.setattr(waiting_room, "MAX_REMEMBERED", 100)
    # Sleeps make only the "longer than" sides sure; "c" to "d" must stay shorter than
    # UNKNOWN_AFTER however loaded the machine (0.05 s was not, in a CI run), hence 2 s.
    monkeypatch.setattr(waiting_room, "UNKNOWN_AFTER", 2.0)
    time.sleep(2 * waiting_room.IDLE_FOR)  # sleep-ok: the idle answer's trust lapses
    per_customer.delay(7, "d")  # sent shortly before: asked, parked
    assert reads == ["api:7"]
    # sleep-ok: the busy answer's trust and the remembered send both lapse
    time.sleep(max(waiting_room.BUSY_FOR, waiting_room.UNKNOWN_AFTER) + 0.05)
    per_customer.delay(7, "e")  # not sent for UNKNOWN_AFTER: plain, unread
    assert reads == ["api:7"]
    assert [h["argsrepr"] for name, h, _ in messages(client, f"{tag}.q")
            if name != DOORBELL_TASK] == ["(7, 'a')", "(5, 'b')", "(7, 'c')", "(7, 'e')"]
    assert len(messages(client, lane(tag, "api:7"))) == 1


@pytest.mark.parametrize("send", [
    lambda app: app.tasks["t.unguarded"].delay("u"),
    lambda app: app.tasks["t.guarded"].apply_async(("c",), countdown=5),
    lambda app: app.tasks["t.guarded"].apply_async(
        ("e",), eta=datetime.now(timezone.utc) + timedelta(seconds=5)),
    lambda app: app.tasks["t.not_on_send"].delay("o"),  # the task option
    lambda app: app.tasks["t.bounded"].delay("b"),  # semaphore_max_wait: a worker tracks it
    lambda app: app.tasks["t.subscript"].delay(None),  # the worker fails it, naming why
    lambda app: app.send_task("t.elsewhere", ("x",)),  # a task this process does not know
], ids=["unguarded", "countdown", "eta", "task-option-off", "max-wait", "unfillable",
        "unknown-task"])
def test_what_is_not_parked_on_send_goes_to_its_task_queue(broker, send):
    url, client, tag = broker
    app = make_app(url, tag)
    send(app)
    queued = messages(client, f"{tag}.q")
    assert len(queued) == 1 and queued[0][0] != DOORBELL_TASK
    assert PARKED_HEADER not in queued[0][1]
    assert not list(client.scan_iter(f"{tag}:park.*"))


def test_the_setting_turns_it_off(broker):
    url, client, tag = broker
    app = make_app(url, tag, semaphore_park_on_send=False)
    app.tasks["t.guarded"].delay("a")
    assert [m[0] for m in messages(client, f"{tag}.q")] == ["t.guarded"]
    assert not list(client.scan_iter(f"{tag}:park.*"))


def test_the_setting_is_checked_when_the_worker_starts():
    from celery_semaphore import ConfigurationError
    from celery_semaphore.settings import Settings

    app = Celery("bad", set_as_current=False)
    app.conf.semaphore_park_on_send = "yes"
    with pytest.raises(ConfigurationError, match="semaphore_park_on_send must be True or False"):
        Settings.from_app(app)


def test_a_burst_rings_once_per_doorbell_interval(broker):
    url, client, tag = broker
    app = make_app(url, tag)
    began = time.monotonic()
    for i in range(200):
        app.tasks["t.guarded"].delay(f"b{i}")
    elapsed = time.monotonic() - began
    assert client.llen(lane(tag, "images")) == 200
    doorbells = [m for m in messages(client, f"{tag}.q") if m[0] == DOORBELL_TASK]
    assert 1 <= len(doorbells) <= 1 + elapsed / DOORBELL_EVERY


def test_eager_calls_are_not_sent_at_all(broker):
    url, client, tag = broker
    app = make_app(url, tag, busy=False, task_always_eager=True)
    assert app.tasks["t.guarded"].delay("e").get() == "e"
    assert not list(client.scan_iter(f"{tag}*"))


def test_a_retry_of_a_parked_task_keeps_none_of_its_marks(broker):
    """The worker hands a pulled task its original route back, so ``self.retry(countdown=)``
    goes to its task queue with an ETA, carrying no mark of the waiting room."""
    url, client, tag = broker
    app = make_app(url, tag)
    app.tasks["t.guarded"].apply_async(
        ("r",), countdown=1, headers={PARKED_HEADER: "images", FIRST_WAIT_HEADER: 1.0,
                                      ROUTE_HEADER: ["", f"{tag}.q"]})
    ((name, headers, _),) = messages(client, f"{tag}.q")
    assert name == "t.guarded" and headers["eta"]
    assert not {PARKED_HEADER, FIRST_WAIT_HEADER, ROUTE_HEADER} & set(headers)



def _chain(app):
    from celery import chain

    return chain(app.tasks["t.guarded"].s("c1").set(headers={"trace": "h"}),
                 app.tasks["t.guarded"].si("c2")).apply_async()


def _group(app):
    from celery import group

    return group(app.tasks["t.guarded"].s("g1").set(headers={"trace": "h"}),
                 app.tasks["t.guarded"].s("g2").set(headers={"trace": "h"})).apply_async()


TRACE = {"trace": "h"}


@pytest.mark.parametrize("send, expected", [
    (lambda app: app.tasks["t.guarded"].apply_async(("a",), headers=TRACE), TRACE),
    (lambda app: app.tasks["t.guarded"].apply_async(("l",), headers={"semaphore_limit": 3}),
     {"semaphore_limit": 3}),
    (lambda app: app.tasks["t.guarded"].apply_async(
        ("q",), headers=TRACE, queue="other", priority=3, expires=60, ignore_result=True,
        task_id="fixed-id", shadow="shadowed", retry=True), TRACE),
    (lambda app: app.tasks["t.guarded"].apply_async(("n",), headers={"semaphore": "n:1"}),
     {"semaphore": "n:1"}),
    (lambda app: app.tasks["t.guarded"].s("s").set(headers=TRACE).apply_async(), TRACE),
    (lambda app: app.tasks["t.guarded"].s("s").apply_async(headers=TRACE), TRACE),
    (lambda app: app.tasks["t.guarded"].si("si").set(headers=TRACE).delay(), TRACE),
    (lambda app: app.send_task("t.guarded", ("t",), headers=TRACE), TRACE),
    (lambda app: app.send_task("t.guarded", ("t",), headers={"semaphore_limit": 1}),
     {"semaphore_limit": 1}),
    (lambda app: app.tasks["t.per_customer"].apply_async((5, "k"), headers=TRACE), TRACE),
    (_chain, TRACE),
    (_group, TRACE),
], ids=["apply_async", "apply_async-limit-header", "apply_async-options",
        "apply_async-name-header", "signature-set", "signature-apply_async", "si-delay",
        "send_task", "send_task-limit-header", "template", "chain", "group"])
def test_every_way_to_send_works_with_headers_under_default_settings(broker, send, expected):
    """Defect 1 of #27: a guarded send with ``headers=`` raised ``TypeError`` in the caller
    once parking on send was on (the default). Every documented way to send takes them, and
    the caller's headers travel with the task's message wherever it goes."""
    url, client, tag = broker
    app = make_app(url, tag)
    send(app)
    sent = [headers for key in sorted(client.scan_iter(f"{tag}*"))
            if client.type(key) == b"list"
            for name, headers, _ in messages(client, key.decode()) if name != DOORBELL_TASK]
    assert sent, "nothing was sent"
    for headers in sent:
        assert {k: headers.get(k) for k in expected} == expected


def test_a_semaphore_with_room_goes_the_plain_way(broker):
    """Only a semaphore with a backlog uses the waiting room: with nobody waiting, a send of a
    template key goes to its task queue (one delivery, one acquire at the worker), with no
    parking queue and no doorbell, whatever the number of keys."""
    url, client, tag = broker
    app = make_app(url, tag, busy=False)
    for customer in range(50):
        app.tasks["t.per_customer"].delay(customer, "k")
    queued = messages(client, f"{tag}.q")
    assert [m[0] for m in queued] == ["t.per_customer"] * 50
    assert not any(PARKED_HEADER in m[1] for m in queued)
    assert not list(client.scan_iter(f"{tag}:park*"))


def test_a_burst_on_an_idle_semaphore_parks_what_could_not_start_at_once(broker, monkeypatch):
    """Before the backend shows waiters, a sender lets at most ``limit`` sends of an idle
    semaphore go the plain way; the rest of the burst is parked."""
    url, client, tag = broker
    # the 20 sends within one idle answer's trust however loaded the machine (0.02 s is not)
    monkeypatch.setattr(waiting_room, "IDLE_FOR", 5.0)
    app = make_app(url, tag, busy=False)
    for i in range(20):
        app.tasks["t.guarded"].delay(f"b{i}")
    plain = [m for m in messages(client, f"{tag}.q") if m[0] == "t.guarded"]
    parked = client.llen(lane(tag, "images"))
    assert 2 <= len(plain) < 20 and len(plain) + parked == 20


def test_hostile_template_keys_never_name_a_queue_outside_the_prefix():
    tag = "hostile"
    for key in ("x" * 5000, "ключ", "a b*?[]{}|\n", "../../etc"):
        name = parking_queue_name(f"{tag}:", lane_of(f"api:{key}", key, f"{tag}.q"))
        assert name.startswith(f"{tag}:park.") and len(name.encode()) <= 200
        assert key not in name


def test_a_doorbell_is_never_announced_as_a_task(broker):
    """With ``task_send_sent_event`` on (common where Flower runs), the guarded task parked on
    send is announced (task-sent), its doorbell never is: no internal message of ours shows
    as a task in Flower."""
    url, client, tag = broker
    app = make_app(url, tag, task_send_sent_event=True)
    events = client.pubsub()
    events.psubscribe("*celeryev*")
    assert wait_for_subscription(events)
    result = app.tasks["t.guarded"].delay("a")
    ours, doorbells = [], []
    deadline = time.monotonic() + 3  # the doorbell was published right after the task
    while time.monotonic() < deadline:
        message = events.get_message(timeout=0.2)
        if not message or message["type"] != "pmessage":
            continue
        body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
        for event in body if isinstance(body, list) else [body]:  # a batch, or one
            if not isinstance(event, dict):
                continue
            if event.get("type") == "task-sent" and event.get("uuid") == result.id:
                ours.append(event)
            if event.get("name") == DOORBELL_TASK:
                doorbells.append(event)
    events.close()
    assert len(ours) == 1 and ours[0]["name"] == "t.guarded"
    assert doorbells == []
    assert [m[0] for m in messages(client, f"{tag}.q")] == [DOORBELL_TASK]


def wait_for_subscription(pubsub):
    message = pubsub.get_message(timeout=2)
    return message is not None and message["type"] == "psubscribe"
