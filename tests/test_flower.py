"""What a real Flower shows, read through its HTTP API (``/api/tasks``, ``/api/task/info``).

A waiting task shows WAITING, then STARTED and SUCCESS; every task that waits for a slot shows
WAITING wherever it waits (in the worker's line behind its peers, in the backend's queue, or
parked in the waiting room by the worker); no internal message of ours (the doorbell,
``celery_semaphore.doorbell``) ever shows as a task, even with ``task_send_sent_event`` on.

Each Flower listens on an event exchange of its own (``event_exchange``), so tasks of other
test clusters on the shared broker never show in it.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from tests import servers
from tests.servers import free_port
from tests.test_worker import Cluster, _parked
from tests.util import wait_until
from tests.workers import ROOT

pytestmark = pytest.mark.slow


class Flower:
    """A ``celery flower`` subprocess watching a test cluster, read through its HTTP API."""

    def __init__(self, cluster, log_path):
        self.cluster = cluster
        self.log_path = log_path
        port = free_port()
        env = dict(cluster.env, FLOWER_UNAUTHENTICATED_API="true")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "flower",
             f"--port={port}", "--address=127.0.0.1"],
            cwd=ROOT, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
        )
        self.base = f"http://127.0.0.1:{port}"
        self.history = {}  # task id -> the states seen, in order, without repeats
        self.probes = set()  # ids of the tasks wait_for_events sent

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path):
        try:
            response = requests.get(f"{self.base}{path}", timeout=2)
        except requests.RequestException:
            return None
        return response.json() if response.ok else None

    def wait_ready(self):
        assert wait_until(lambda: self.get("/api/workers") is not None, timeout=30), self.log()

    def wait_for_events(self):
        """Flower hears the workers' events: an unguarded task shows in it (Flower subscribes
        to the event exchange a little after it answers; an event sent before is lost)."""
        unguarded = self.cluster.task("unguarded")
        for attempt in range(30):
            probe = unguarded.delay(f"flower-probe{attempt}")
            self.probes.add(probe.id)
            if wait_until(lambda: self.state_of(probe.id) == "SUCCESS", timeout=1, interval=0.05):
                return
        raise AssertionError(f"Flower shows no task events: {self.log()[-3000:]}")

    def caught_up(self, timeout=15):
        """Send an unguarded task through the cluster's task queue and wait until Flower shows
        it succeeded: by then Flower has every event the worker sent for the messages
        delivered before it from that queue (doorbells included; the queue is FIFO, one
        worker sends its events in order)."""
        marker = self.cluster.task("unguarded").delay("flower-marker")
        self.probes.add(marker.id)
        return wait_until(lambda: self.state_of(marker.id) == "SUCCESS", timeout=timeout,
                          interval=0.05)

    def info(self, task_id):
        return self.get(f"/api/task/info/{task_id}")

    def state_of(self, task_id):
        info = self.info(task_id)
        state = info and info.get("state")
        seen = self.history.setdefault(task_id, [])
        if state and (not seen or seen[-1] != state):
            seen.append(state)
        return state

    def tasks(self):
        return self.get("/api/tasks") or {}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def watched(redis_url, tmp_path):
    """``watched(workers=1, concurrency=4, settings=None, names="flower")``: a cluster (SQLite
    semaphore backend) and a Flower watching it, events flowing."""
    started = []

    def start(workers=1, concurrency=4, settings=None, names="flower"):
        settings = dict(settings or {}, event_exchange=f"{servers.unique_tag()}.ev")
        cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url),
                          f"sqlite:///{tmp_path}/sem.db", workers=workers,
                          concurrency=concurrency, names=names,
                          CS_SETTINGS=json.dumps(settings))
        started.append(cluster)
        flower = Flower(cluster, tmp_path / "flower.log")
        started.append(flower)
        flower.wait_ready()
        flower.wait_for_events()
        return cluster, flower

    try:
        yield start
    finally:
        for thing in reversed(started):
            thing.stop()


def test_waiting_state_in_flower(watched):
    cluster, flower = watched()
    slow = cluster.task("slow")
    first = slow.delay("fl0", 2.0)
    assert wait_until(lambda: cluster.started("slow:fl0"), timeout=10)
    waiter = slow.delay("fl1", 1.0)
    seen = flower.history.setdefault(waiter.id, [])
    assert wait_until(lambda: flower.state_of(waiter.id) == "WAITING", timeout=10,
                      interval=0.05), seen
    info = flower.info(waiter.id)
    # the result backend too (stored by the gate's I/O thread after the event is sent)
    assert wait_until(lambda: waiter.state == "WAITING", timeout=5), waiter.state
    assert waiter.info.get("semaphore") == "slow"
    first.get(timeout=10)
    assert wait_until(lambda: flower.state_of(waiter.id) == "SUCCESS", timeout=15,
                      interval=0.02), seen
    assert seen.index("WAITING") < seen.index("SUCCESS")
    # STARTED replaced WAITING while the body ran (it ran for a second).
    assert "STARTED" in seen and seen.index("WAITING") < seen.index("STARTED"), seen
    assert info["name"] == "tests.celery_app.slow"
    assert os.path.exists(cluster.env["CS_PROBE"])


def _all_waiting(flower, results, holder, timeout=20):
    """Every one of ``results`` shows WAITING in Flower at one moment while ``holder`` has not
    finished (False once it has); also what each showed at the last look."""
    shown = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = not holder.ready()
        shown.update({r.id: flower.state_of(r.id) for r in results})
        if not running:
            return False, shown
        if all(state == "WAITING" for state in shown.values()):
            return True, shown
        time.sleep(0.1)
    return False, shown


@pytest.mark.parametrize("park_on_send", [True, False], ids=["park-on-send", "plain-send"])
def test_every_task_waiting_behind_a_holder_shows_waiting(watched, park_on_send):
    """Issue #29's scenario: one prefork worker of 2 processes, a template semaphore
    (``api:{customer_id}``, limit 1), one slow task of a customer holding the slot and 3 more of
    the same customer. The first of the 3 waits in the backend's queue, the others in the
    worker's line behind it (or, parked on send, pulled back into that line): all 3 show
    WAITING in Flower while the slow one runs, then all succeed."""
    cluster, flower = watched(concurrency=2, settings={"semaphore_park_on_send": park_on_send})
    per_customer = cluster.task("per_customer")
    holder = per_customer.delay(7, "hold", 6.0)
    assert wait_until(lambda: cluster.started("customer-7:hold"), timeout=10)
    waiters = [per_customer.delay(7, f"w{i}", 0.05) for i in range(3)]
    every_one, shown = _all_waiting(flower, waiters, holder)
    assert every_one, (
        f"expected WAITING for all 3 while the holder runs; Flower shows {shown}, states "
        f"seen {[flower.history.get(r.id) for r in waiters]}, result backend "
        f"{[(r.id, r.state) for r in waiters]}")
    for i, result in enumerate(waiters):
        assert wait_until(lambda: flower.state_of(result.id) == "SUCCESS", timeout=30,
                          interval=0.05), flower.history.get(result.id)
        assert result.get(timeout=5) == f"w{i}"
    assert holder.get(timeout=10) == "hold"
    assert cluster.probe.max_concurrent("customer-7:") == 1


@pytest.mark.parametrize("park_on_send", [True, False], ids=["park-on-send", "parked-by-worker"])
def test_no_internal_message_shows_as_a_task(watched, park_on_send):
    """With ``task_send_sent_event`` on (senders and workers), a backlog in the waiting room
    (parked on send, or parked by the worker past ``semaphore_worker_max_waiting`` 1), rung
    doorbells, pulls: Flower's task list holds exactly the tasks the test sent, none named
    ``celery_semaphore.*``; the ones the worker parked show WAITING there; all succeed."""
    cluster, flower = watched(concurrency=2, settings={"task_send_sent_event": True,
                                                       "semaphore_worker_max_waiting": 1,
                                                       "semaphore_park_on_send": park_on_send})
    assert cluster.app.conf.task_send_sent_event
    sent = set()

    def send(task, *args):
        result = cluster.task(task).apply_async(args)
        sent.add(result.id)
        return result

    def foreign():
        """Tasks in Flower's list that the test did not send (a probe of wait_for_events
        whose task-received went before Flower listened may show with no name: not ours)."""
        return {task_id: (info.get("name"), info.get("state"))
                for task_id, info in flower.tasks().items()
                if task_id not in sent and task_id not in flower.probes}

    holder = send("slow", "np0", 4.0)
    assert wait_until(lambda: cluster.started("slow:np0"), timeout=10)
    backlog = [send("slow", f"np{i}", 0.05) for i in range(1, 7)]
    # One waits in the worker, the rest in the waiting room.
    assert wait_until(lambda: _parked(cluster, "slow") >= 4, timeout=15), _parked(cluster, "slow")
    if not park_on_send:  # parked by the worker: WAITING, parked, in Flower too
        assert wait_until(lambda: sum(r.state == "WAITING" and bool(r.info.get("parked"))
                                      for r in backlog) >= 4, timeout=15), \
            [(r.id, r.state, r.info) for r in backlog]
        for result in backlog:
            assert wait_until(lambda: flower.state_of(result.id) == "WAITING", timeout=10,
                              interval=0.05), (result.id, flower.history.get(result.id))
    assert foreign() == {}
    for result in [holder] + backlog:
        assert result.get(timeout=60)
    for result in [holder] + backlog:
        assert wait_until(lambda: flower.state_of(result.id) == "SUCCESS", timeout=15,
                          interval=0.05), (result.id, flower.history.get(result.id))
    # The lane is empty, and every doorbell rung for it went to the task queue before it was
    # parked in: a task sent now is delivered after them, and once Flower shows it, whatever
    # the doorbells made the worker send has reached Flower too.
    assert wait_until(lambda: _parked(cluster, "slow") == 0, timeout=10)
    assert flower.caught_up(), flower.log()[-3000:]
    listed = flower.tasks()
    assert not [info.get("name") for info in listed.values()
                if str(info.get("name")).startswith("celery_semaphore.")]
    assert foreign() == {}
    assert sent <= set(listed)
    types = flower.get("/api/task/types") or {}
    assert not [t for t in types.get("task-types", []) if str(t).startswith("celery_semaphore")]


def test_flower_shows_what_a_waiting_task_waits_for(watched):
    cluster, flower = watched(concurrency=2)
    per_customer = cluster.task("per_customer")
    per_customer.delay(8, "hold", 3.0)
    assert wait_until(lambda: cluster.started("customer-8:hold"), timeout=10)
    waiter = per_customer.delay(8, "w", 0.05)
    assert wait_until(lambda: flower.state_of(waiter.id) == "WAITING", timeout=10,
                      interval=0.05), flower.history.get(waiter.id)
    assert wait_until(lambda: waiter.state == "WAITING", timeout=5)
    assert waiter.info["semaphore"] == "api:8"  # the result backend says it
    info = flower.info(waiter.id)
    assert info.get("semaphore") == "api:8", info
    listed = flower.tasks()[waiter.id]
    assert listed.get("semaphore") == "api:8", listed
