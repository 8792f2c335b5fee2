"""Faults a worker must survive: poison messages, backend and broker outages.

Real ``celery worker`` subprocesses; concurrency and starts are read from the probe.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis

from celery_semaphore import ConfigurationError, InvalidHeader, Semaphore
from celery_semaphore.backends.base import Attempt
from tests import servers
from tests.test_worker import Cluster, _parked
from tests.util import wait_until
from tests.workers import NAME_SUFFIX

pytestmark = pytest.mark.slow


class PersistentRedis:
    """A private redis-server with an fsynced AOF in ``workdir``, to kill and restart on the
    same port with its data."""

    def __init__(self, workdir):
        workdir.mkdir()
        self.workdir, self.port = str(workdir), servers.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self):
        self.proc, _ = servers.start_redis(self.port, self.workdir, "--appendonly", "yes",
                                           "--appendfsync", "always")

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)


POISON = [
    # (task, args, headers, what the error says)
    ("subscript", (None, "p1"), None, "sub:{p[c]}"),
    ("subscript", ("str", "p2"), None, "sub:{p[c]}"),
    ("numbered", ("seven", "p3"), None, "num:{n:d}"),
    ("guarded", ("p4",), {"semaphore": 5}, "semaphore"),
    ("guarded", ("p5",), {"semaphore": "{"}, "semaphore"),
    ("guarded", ("p6",), {"semaphore": "{0}"}, "semaphore"),
    ("guarded", ("p7",), {"semaphore_limit": 0}, "semaphore_limit"),
    ("guarded", ("p8",), {"semaphore_limit": "two"}, "semaphore_limit"),
]


def test_a_poison_message_fails_its_task_alone(redis_url, tmp_path):
    """Each malformed request fails with a clear error and is acknowledged; the worker goes
    on running the good tasks sent before and after it (before: the event loop raised,
    the worker exited, and the unacked message killed the next worker the same way)."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1)
    try:
        good = cluster.task("guarded")
        sent = []
        for i, (name, args, headers, _) in enumerate(POISON):
            sent.append(("good", good.delay(f"ok{i}", 0.01), None))
            # Sent as raw messages: the client side refuses such options where it can.
            bad = cluster.app.send_task(f"tests.celery_app.{name}", args=args,
                                        headers=headers or {})
            sent.append(("bad", bad, POISON[i][3]))
        sent.append(("good", good.delay("last", 0.01), None))
        for kind, result, says in sent:
            if kind == "good":
                result.get(timeout=20)
            else:
                with pytest.raises(ConfigurationError) as err:
                    result.get(timeout=20)
                assert says in str(err.value)
        worker = cluster.workers[0]
        assert worker.proc.poll() is None, worker.output()[-3000:]
        assert "Unrecoverable error" not in worker.output()
        assert not any(key.startswith(("subscript:", "numbered:"))
                       for key in cluster.probe.intervals())
    finally:
        cluster.stop()


def test_a_release_that_fails_in_a_backend_outage_is_retried(redis_url, tmp_path):
    """A task ends while its persistent backend (Redis with an fsynced AOF) is down for ~2 s:
    the release is retried, so the next guarded task starts within seconds of the backend's
    return, not after the 60 s lease TTL (before: the release was logged and dropped)."""
    backend = PersistentRedis(tmp_path / "backend")
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), backend.url,
                      workers=1)
    try:
        slow = cluster.task("slow")
        first = slow.delay("o1", 1.0)
        assert wait_until(lambda: cluster.started("slow:o1"))
        second = slow.delay("o2", 0.01)
        assert wait_until(lambda: cluster.backend.status("slow").waiting == 1)
        backend.kill()  # the body ends during the outage; its release fails
        assert first.get(timeout=10) == "o1"
        assert wait_until(lambda: "releasing" in cluster.workers[0].output(), timeout=5)
        backend.start()
        back_at = time.monotonic_ns()
        assert second.get(timeout=20) == "o2"
        started = cluster.probe.intervals()["slow:o2"][0][0]
        assert (started - back_at) / 1e9 < 5
        assert cluster.probe.max_concurrent("slow:") == 1
    finally:
        cluster.stop()
        backend.kill()


def test_a_waiter_is_woken_promptly_once_its_backend_is_back(redis_url, tmp_path):
    """A task waits in the worker for a slot the test holds; the backend (Redis with an fsynced
    AOF) is down 3.5 s and comes back; the waiter asks again; then the slot is released: the
    worker's wake-up channel is subscribed again by then, so the task starts at once, not at
    the waiter's next poll (before: the channel came back up to 5 s later, and the release's
    wake-up went to nobody)."""
    backend = PersistentRedis(tmp_path / "backend")
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), backend.url,
                      workers=1, CS_SETTINGS=json.dumps({"semaphore_poll_interval": 3.0}))
    worker = cluster.workers[0]
    try:
        held = Semaphore("slow", 1, backend.url, key_prefix=cluster.env["CS_KEY_PREFIX"],
                         ttl=120).acquire()
        result = cluster.task("slow").delay("w", 0.01)
        assert wait_until(lambda: cluster.backend.status("slow").waiting == 1)
        poll = cluster.backend.pause_after(Attempt(None), 3.0)  # the waiter's pause
        backend.kill()
        assert wait_until(lambda: "wake-up channel" in worker.output(), timeout=10)
        time.sleep(3.5)  # the outage
        backend.start()
        server = redis.Redis(port=backend.port)

        def asked_again():  # (its scripts are gone with the restart: loaded again, or EVAL)
            stats = server.info("commandstats")
            return any(stats.get(f"cmdstat_{command}", {}).get("calls", 0) > 0
                       for command in ("eval", "evalsha"))

        assert wait_until(asked_again, timeout=10, interval=0.005)
        released_at = time.monotonic_ns()
        held.release()
        assert result.get(timeout=20) == "w"
        started_after = (cluster.probe.intervals()["slow:w"][0][0] - released_at) / 1e9
        print(f"started {started_after:.3f}s after the release (poll every {poll:.2f}s)")
        assert started_after < 0.5 < poll, started_after
        assert "wake-up channel restored" in worker.output()
    finally:
        cluster.stop()
        backend.kill()


def one_running_five_waiting(cluster, key, first="slow"):
    """One slow task (of task ``first``) holds the slot, five wait in the worker's gate (or,
    past its bound of waiting requests, are on their way to the waiting room); every
    message has been delivered (kombu's Redis transport loses one it has popped but not yet
    recorded as unacked when the server dies: the transport's own window, not the gate's).
    The slow one runs until the test creates the file returned (``go``): on a loaded machine
    a fixed hold could end before the fault it is meant to span."""
    slow = cluster.task("slow")
    go = os.path.join(os.path.dirname(cluster.env["CS_PROBE"]), f"go-{key}")
    results = [cluster.task(first).delay(f"{key}0", go)]
    worker = cluster.workers[0]
    assert wait_until(lambda: cluster.started(f"slow:{key}0"), timeout=30), \
        worker.output()[-4000:]
    results += [slow.delay(f"{key}{i}", 0.05) for i in range(1, 6)]
    # (a CI run once saw fewer than 6 within 10 s, its worker log lost: 30 s, and the log;
    # another saw one task received twice, 17 ms apart, as a request past the bound was
    # parked and pulled back at once: count the tasks, not the lines)
    ids = {r.id for r in results}

    def received():
        return ids & set(re.findall(r"\[([0-9a-f-]{36})\] received", worker.output()))

    assert wait_until(lambda: received() == ids, timeout=30), (
        len(received()), worker.output()[-6000:])
    assert cluster.probe.completed(f"slow:{key}0") == {f"slow:{key}0": 0}  # (waits for go)
    return worker, results, go


#: The two Redis broker outage tests run after make test's parallel part (marked ``apart``),
#: one after the other, though each kills only its own broker: side by side they failed in
#: about half of 13 runs on this 2-core machine (a worker that never saw its broker go, its
#: event loop idle in epoll, the gate's own connection finding the broker gone), where 16 runs
#: one after the other (half beside two busy CPU loops) all saw it. Why is not known yet.
OUTAGES_APART = "the Redis broker outage tests"


def sees_the_broker_gone(worker) -> bool:
    """The worker said its broker connection is lost, or that it cannot connect."""
    output = worker.output()
    return "Cannot connect to redis" in output or "re-establish" in output


def results_of(results, worker, timeout: float = 60) -> list:
    """The tasks' results, in order; a task that never ends fails the test with what the
    worker said about it and about the outage (every line naming it or the gate, the first
    3 of a repeated one), not only a timeout."""
    from celery.exceptions import TimeoutError as ResultTimeout

    try:
        return [r.get(timeout=timeout) for r in results]
    except ResultTimeout:
        pending = [r.id for r in results if not r.ready()]
        lines, seen = [], {}
        for line in worker.output().splitlines():
            said = line.split("] ", 1)[-1]
            seen[said] = seen.get(said, 0) + 1
            if seen[said] <= 3 and ("celery-semaphore" in line or "broker" in line
                                    or any(task_id in line for task_id in pending)):
                lines.append(line)
        raise AssertionError(f"tasks {pending} never ended; the worker said:\n"
                             + "\n".join(lines)[-12000:]) from None


def what_the_worker_does(worker) -> str:
    """For a failing assertion: the end of the worker's log and the stacks of its threads
    (py-spy, where the bench extra installed it)."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    stacks = ""
    if os.path.exists(spy):
        dump = subprocess.run([spy, "dump", "--locals", "--pid", str(worker.proc.pid)],
                              capture_output=True, text=True, timeout=60)
        stacks = dump.stdout + dump.stderr
    lines, seen = [], {}
    for line in worker.output().splitlines():  # a retried failure's line: its first 3 only
        said = line.split("] ", 1)[-1]
        seen[said] = seen.get(said, 0) + 1
        if seen[said] <= 3:
            lines.append(line)
    return "\n".join(lines)[-8000:] + "\n-- stacks --\n" + stacks


def waiting_back(output):
    """How many waiting tasks the worker said are back in their queue after the broker
    connection was lost (those it held from the task queue and those it had pulled from the
    waiting room are restored apart, each kind on its own line)."""
    return sum(int(n) for n in re.findall(
        r"(\d+) tasks that were waiting when the broker connection was lost", output))


def said_when_lost(output):
    """The worker's lines about the lost broker connection (for a failing assertion)."""
    return "\n".join(line for line in output.splitlines()
                     if "celery-semaphore" in line or "broker" in line)


def parked_back(output):
    """How many tasks the worker was parking (past its bound of waiting requests) when the
    broker went away: each is put back in its queue with a backoff instead (and runs once)."""
    return len(set(re.findall(r"requeueing (\S+) with a backoff of [\d.]+s: the waiting room "
                              r"could not take it", output)))


def left_for_pool(output):
    """How many tasks the worker said had left for the pool when the broker connection was
    lost (they stay unacknowledged until they end)."""
    return sum(int(n) for n in re.findall(
        r"(\d+) tasks that left for the pool stay unacknowledged", output))


def told_back(output):
    """The waiting tasks the worker said go back to their queue at the loss: those waiting in
    its gate, and those it was parking (put back with a backoff). A fifth one on its way to
    the waiting room as the connection drops (published there, its acknowledgement made again
    once the broker answers) is in neither: it runs from the waiting room."""
    return waiting_back(output) + parked_back(output)


def all_ran_once_quietly(cluster, worker, results, key):
    """Every task ran once, one at a time; the worker lives and said it once, at INFO."""
    assert results_of(results, worker) == [f"{key}{i}" for i in range(6)]
    assert worker.proc.poll() is None, worker.output()[-3000:]
    output = worker.output()
    assert "Couldn't reject" not in output and "CRITICAL" not in output, output[-3000:]
    # said once at most; the waiting requests it pulled from the waiting room may have been
    # let go just before, by the parking connection that found the broker gone first
    # (counted by waiting_back all the same), all of them when every waiting one was pulled
    assert len(re.findall(r"closed with \d+ tasks waiting for a slot", output)) <= 1, (
        said_when_lost(output))
    # the parking connection's failures: one warning for the outage, not one per retry
    assert output.count("broker unavailable") <= 1, said_when_lost(output)
    assert cluster.probe.max_concurrent(f"slow:{key}") == 1
    assert all(n == 1 for k, n in cluster.probe.completed(f"slow:{key}").items()
               if k != f"slow:{key}0")
    return output


@pytest.mark.apart  # OUTAGES_APART
def test_a_redis_broker_outage_loses_no_worker_and_no_task(redis_url, tmp_path):
    """The broker (Redis with an fsynced AOF) is killed while the worker holds waiting
    requests unacknowledged, and restarted: the worker survives (kombu 5.7's restore of
    unacked messages raised AttributeError and the worker exited), says so once instead of
    a CRITICAL traceback per waiting request, and every task runs, one at a time."""
    broker = PersistentRedis(tmp_path / "broker")
    cluster = Cluster(str(tmp_path), redis_url, broker.url, redis_url, workers=1)
    try:
        worker, results, go = one_running_five_waiting(cluster, "r")
        broker.kill()
        assert wait_until(lambda: sees_the_broker_gone(worker), timeout=30), (
            what_the_worker_does(worker))
        time.sleep(2)  # an outage, not a blip: the worker retries its connection meanwhile
        broker.start()
        open(go, "w").close()
        output = all_ran_once_quietly(cluster, worker, results, "r")
        assert 4 <= told_back(output) <= 5, said_when_lost(output)
    finally:
        cluster.stop()
        broker.kill()


@pytest.mark.apart  # OUTAGES_APART
def test_a_redis_broker_outage_does_not_run_a_running_task_again(redis_url, tmp_path):
    """As above, with the running task acknowledged late, and the broker down until its body
    has ended (its ack cannot reach the broker): the worker says 5 tasks waited, that those 5
    are back, and that the running one stays unacknowledged until it ends; once the broker is
    back its ack lands, and it never runs again (#27 defect 3a: it was put back with the
    waiting ones, "delivered again", and ran twice)."""
    broker = PersistentRedis(tmp_path / "broker")
    cluster = Cluster(str(tmp_path), redis_url, broker.url, redis_url, workers=1)
    try:
        worker, results, go = one_running_five_waiting(cluster, "a", first="slow_late")
        broker.kill()
        assert wait_until(lambda: sees_the_broker_gone(worker), timeout=30), (
            what_the_worker_does(worker))
        # the body ends while the broker is away: its acknowledgement cannot be made now
        open(go, "w").close()
        assert wait_until(lambda: cluster.probe.completed("slow:a0"), timeout=20)
        broker.start()
        assert results_of(results, worker) == [f"a{i}" for i in range(6)]
        client = redis.Redis.from_url(broker.url)
        def left() -> dict:
            lists = {k: client.llen(k) for k in client.scan_iter("*") if client.type(k) == b"list"}
            return {"unacked": client.hlen("unacked"), **{k: n for k, n in lists.items() if n}}

        try:  # every message settled in the broker: nothing left to deliver again
            assert wait_until(lambda: left() == {"unacked": 0}, timeout=20), (
                left(), said_when_lost(worker.output()))
        finally:
            client.close()
        assert cluster.probe.completed("slow:a") == {f"slow:a{i}": 1 for i in range(6)}, (
            worker.output()[-8000:])
        assert cluster.probe.max_concurrent("slow:a") == 1
        output = worker.output()
        assert len(re.findall(r"closed with \d+ tasks waiting for a slot", output)) <= 1, (
            said_when_lost(output))
        assert 4 <= told_back(output) <= 5, said_when_lost(output)
        # a0, acknowledged late, stays unacknowledged until it ends
        assert left_for_pool(output) >= 1, said_when_lost(output)
        assert "delivered again" not in output.replace("(not delivered again)", "")
        assert worker.proc.poll() is None
    finally:
        cluster.stop()
        broker.kill()


def parking_worker(tmp_path, redis_url, broker, **env):
    """One worker on ``broker`` that keeps one request waiting and parks the rest (in the
    worker, not on send), and a lease on its semaphore "slow" (limit 1) held outside it: what
    the worker gets of task ``slow`` waits, and parks, until the test releases the lease.
    ``env``: the worker's extra environment (a fault to inject)."""
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=1,
                      CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 1,
                                              "semaphore_park_on_send": False}), **env)
    holder = Semaphore("slow", 1, redis_url, key_prefix=cluster.env["CS_KEY_PREFIX"], ttl=60)
    try:
        return cluster, holder.acquire(timeout=10)
    except BaseException:
        cluster.stop()
        raise


#: The line Python prints between the tracebacks of one chain of exceptions.
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def other_tracebacks(output) -> list:
    """Each traceback in the log, and each CRITICAL line, with the 3 lines before it and up to
    30 after (for a failing assertion: what logged it and why), but for the traceback Celery
    before 5.4 prints with "Connection to broker lost" (its own, at WARNING), the chained ones
    after it included (a fresh-clone CI run on Celery 5.3 logged one such chain). A traceback
    chained to another is part of that one's report."""
    lines = output.splitlines()
    reported, celerys = [], False
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            chained = any(lines[j].startswith(_CHAINED) for j in range(max(i - 2, 0), i))
            if not chained:
                celerys = bool(i) and "Connection to broker lost" in lines[i - 1]
            if not celerys and not chained:
                reported.append("\n".join(lines[max(i - 3, 0):i + 30]))
        elif "CRITICAL" in line:
            reported.append("\n".join(lines[max(i - 3, 0):i + 30]))
    return reported


def broker_left(url) -> dict:
    """What a Redis broker still holds: its unacked hash's size and every non-empty list."""
    client = redis.Redis.from_url(url)
    try:
        lists = {k: client.llen(k) for k in client.scan_iter("*") if client.type(k) == b"list"}
        return {"unacked": client.hlen("unacked"), **{k: n for k, n in lists.items() if n}}
    finally:
        client.close()


def unacked_entries(url) -> list:
    """What each of a Redis broker's unacked messages is (for a failing assertion): its
    delivery tag, exchange and routing key, task, id and the gate's headers."""
    client = redis.Redis.from_url(url)
    try:
        entries = []
        for tag, raw in client.hgetall("unacked").items():
            try:
                payload, exchange, routing_key = json.loads(raw)
                headers = payload.get("headers") or {}
                entries.append({"tag": tag.decode(), "exchange": exchange, "key": routing_key,
                                "task": headers.get("task"), "id": headers.get("id"),
                                **{k: v for k, v in headers.items() if "semaphore" in k}})
            except (ValueError, TypeError, AttributeError):
                entries.append({"tag": tag.decode(), "raw": raw[:300]})
        return entries
    finally:
        client.close()


@pytest.mark.apart  # OUTAGES_APART
@pytest.mark.parametrize("point", ["park-before-publish", "park-after-publish", "mid-pull",
                                   "consumer-record", "take-record"])
def test_a_redis_broker_killed_inside_the_waiting_room_loses_no_task(point, redis_url,
                                                                     tmp_path):
    """The broker (Redis, fsynced AOF) is killed by the worker itself at one point of the
    waiting room (tests/celery_app.py ``kill_the_broker_at``): as a parked copy is about to
    be published, just after it was published (its original not acknowledged yet), while
    messages taken from a lane are on their way to the gate, or as the consumer records a
    doorbell it received (the worker rings a lane it holds without room about once a second)
    and the broker applies that record but dies before its reply reaches the worker: kombu
    then knew nothing of the message, and the broker kept it unacked for its
    visibility_timeout (a fresh-clone CI run on Celery 5.3 met this as one doorbell left
    unacked in the mid-pull case), or as the broker runs a take from a lane whose reply never
    reaches the worker (the message recorded unacked for a worker that does not know it).
    Every message had reached the worker before (kombu's other window, a message popped but
    not yet recorded as unacked, is not the gate's).
    Once the broker is back, every task runs exactly once, one at a time, and the broker
    holds nothing: no unacked message, no parked copy, no task left."""
    broker = PersistentRedis(tmp_path / "broker")
    armed = str(tmp_path / "armed")
    cluster, lease = parking_worker(tmp_path, redis_url, broker.url, CS_BROKER_KILL_AT=point,
                                    CS_BROKER_KILL_ARMED=armed,
                                    CS_BROKER_PID=str(broker.proc.pid))
    try:
        slow, worker = cluster.task("slow"), cluster.workers[0]
        results = [slow.delay(f"k{i}", 0.02) for i in range(6)]
        assert wait_until(lambda: worker.output().count(" received") == 6, timeout=10)
        assert wait_until(lambda: _parked(cluster, "slow") == 5, timeout=20), (
            said_when_lost(worker.output()))
        with open(armed, "w") as arming:  # a park meets the kill only for k6's copy: its
            arming.write('"k6"' if point.startswith("park") else "")  # send is answered
        if point.startswith("park"):  # the next one parked meets the kill
            results.append(slow.delay("k6", 0.02))
        elif point in ("mid-pull", "take-record"):  # the slot frees: the one waiting
            lease.release()  # starts, and the worker pulls the next
        # (consumer-record: the next doorbell the worker rings and receives meets the kill)
        assert wait_until(lambda: broker.proc.poll() is not None, timeout=20), (
            what_the_worker_does(worker))
        assert wait_until(lambda: sees_the_broker_gone(worker)
                          or "broker unavailable" in worker.output(), timeout=30), (
            what_the_worker_does(worker))
        broker.start()
        lease.release()
        sent = [f"k{i}" for i in range(len(results))]
        assert results_of(results, worker) == sent
        assert cluster.probe.completed("slow:k") == {f"slow:{k}": 1 for k in sent}, (
            said_when_lost(worker.output()))
        assert cluster.probe.max_concurrent("slow:k") == 1
        assert wait_until(lambda: broker_left(broker.url) == {"unacked": 0}, timeout=20), (
            f"left: {broker_left(broker.url)}\nunacked: {unacked_entries(broker.url)}\n"
            f"the worker's log (its end):\n{worker.output()[-30000:]}")
        output = worker.output()
        unexpected = other_tracebacks(output)
        assert not unexpected, "\n--\n".join(unexpected)[-12000:]
        assert worker.proc.poll() is None
    finally:
        lease.release()
        cluster.stop()
        broker.kill()


@pytest.mark.parametrize("kind, times", [("AttributeError", 1), ("TypeError", 40)])
def test_a_bug_in_the_waiting_rooms_pull_is_an_error_with_its_traceback_not_an_outage(
        redis_url, tmp_path, kind, times):
    """A pull of parked requests that fails with the broker answering (a bug: an injected
    ``AttributeError``, tests/celery_app.py ``fail_a_pull``) is logged as an error with its
    traceback and not as "broker unavailable" (before, the pull took every failure for an
    outage: one warning that named the wrong cause, then debug lines). The waiting room
    recovers as after a lost connection: every task runs once, one at a time. A
    ``TypeError`` that keeps coming is such a bug too, not an undecodable entry (before, the
    pull logged it as a dropped entry and took again, on and on, without taking anything)."""
    armed = str(tmp_path / "armed")
    cluster, lease = parking_worker(tmp_path, redis_url, servers.redis_broker(redis_url),
                                    CS_PULL_FAULT_ARMED=armed, CS_PULL_FAULT_KIND=kind,
                                    CS_PULL_FAULT_TIMES=str(times))
    try:
        slow, worker = cluster.task("slow"), cluster.workers[0]
        results = [slow.delay(f"k{i}", 0.02) for i in range(5)]
        assert wait_until(lambda: _parked(cluster, "slow") == 4, timeout=20), worker.output()
        open(armed, "w").close()
        lease.release()  # the one waiting starts, and the worker pulls the next: it fails
        assert results_of(results, worker) == [f"k{i}" for i in range(5)]
        assert cluster.probe.completed("slow:k") == {f"slow:k{i}": 1 for i in range(5)}
        assert cluster.probe.max_concurrent("slow:k") == 1
        output = worker.output()
        said = [line for line in output.splitlines() if "not because the broker" in line]
        assert len(said) == 1 and "ERROR" in said[0] and "pulling parked requests" in said[0], (
            output[-6000:])
        assert f"{kind}: injected: a bug in the pull" in output, output[-6000:]
        assert "broker unavailable" not in output, output[-6000:]
        assert "undecodable" not in output, output[-6000:]
    finally:
        lease.release()
        cluster.stop()


def test_a_release_still_on_its_way_when_the_worker_stops_is_made_before_it_exits(
        redis_url, tmp_path):
    """A task ends and its release is asked, but not sent yet when the worker is told to
    stop (tests/celery_app.py ``hold_backend_calls`` keeps the event loop's calls from being
    written): closing the loop's link fails the call, and the gate makes it again through its
    thread before the worker exits, quietly (the link was closed on purpose: the backend did
    not fail). The slot is free once the worker has exited, not a lease TTL later."""
    armed, go = str(tmp_path / "armed"), str(tmp_path / "go")
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, CS_HOLD_CALLS_ARMED=armed)
    try:
        worker = cluster.workers[0]
        result = cluster.task("slow").delay("k0", go)
        assert wait_until(lambda: cluster.started("slow:k0"))
        assert cluster.held("slow") == 1
        open(armed, "w").close()
        open(go, "w").close()
        assert result.get(timeout=20) == "k0"
        assert wait_until(lambda: "test: backend calls held" in worker.output(), timeout=10)
        assert cluster.held("slow") == 1  # the release waits in the link
        worker.stop()
        assert worker.proc.returncode == 0, worker.output()[-4000:]
        assert cluster.held("slow") == 0, worker.output()[-4000:]
        output = worker.output()
        assert "releasing 'slow'" not in output, output[-4000:]
    finally:
        cluster.stop()


@pytest.mark.serial
def test_a_rabbitmq_reconnect_is_logged_once_and_loses_nothing(redis_url, amqp_url, tmp_path):
    """The broker closes the worker's connections while requests wait in its gate: RabbitMQ
    requeues them itself. The gate says so once, instead of a CRITICAL "Couldn't reject"
    traceback per request from rejecting on the dead channel, and every task runs once."""
    cluster = Cluster(str(tmp_path), redis_url, amqp_url, redis_url, workers=1)
    try:
        worker, results, go = one_running_five_waiting(cluster, "q")
        subprocess.run([servers.rabbitmqctl(), "close_all_connections", "--vhost", "/",
                        "celery-semaphore test"], check=True, capture_output=True, timeout=60)
        assert wait_until(lambda: "re-establish" in worker.output(), timeout=10)
        open(go, "w").close()
        all_ran_once_quietly(cluster, worker, results, "q")
    finally:
        cluster.stop()


def raw_send(app, name, args=(), headers=None):
    """Publish a task message as a process without celery-semaphore would: straight through
    kombu (no parking on send, no header checks, no ``before_task_publish`` receivers), the
    headers exactly as given."""
    task_id = str(uuid.uuid4())
    full = name if "." in name else f"tests.celery_app.{name}"
    message_headers, properties, body, _ = app.amqp.create_task_message(task_id, full, args, {})
    message_headers.update(headers or {})
    with app.producer_or_acquire() as producer:
        producer.publish(body, exchange="", routing_key=app.conf.task_default_queue,
                         headers=message_headers, serializer="json", **properties)
    return app.AsyncResult(task_id)


BAD_GATE_HEADERS = [
    # (headers, the header the error names)
    ({"semaphore_first_wait": "abc"}, "semaphore_first_wait"),
    ({"semaphore_first_wait": float("inf")}, "semaphore_first_wait"),
    ({"semaphore_first_wait": -5}, "semaphore_first_wait"),
    ({"semaphore_requeues": "x"}, "semaphore_requeues"),
    ({"semaphore_requeues": -1}, "semaphore_requeues"),
    ({"semaphore_requeues": 2.5}, "semaphore_requeues"),
]
#: Marks of a pulled message on a message that was not pulled: meaningless, removed.
IGNORED_GATE_HEADERS = [
    {"semaphore_parked": 123},
    {"semaphore_parked": "images", "semaphore_route": "x", "semaphore_parked_by": ["?"]},
    {"semaphore_requeues": 10**6, "semaphore_first_wait": time.time() + 10**6},
]


def test_malformed_internal_headers_fail_their_task_alone(redis_url, tmp_path):
    """Headers the gate writes itself, sent malformed by a process without the library: each
    bad one fails its own task, naming the header, and the worker runs the next good task
    (before: a bad ``semaphore_first_wait`` left the task unacked and never failed, a bad
    ``semaphore_requeues`` raised on the gate's threads, a ``semaphore_parked`` broadcast
    with ``name=123`` raised on the loop thread); pulled-message marks on a message that was
    not pulled are removed; a forged ``semaphore_lease`` is never shown to the task."""
    names = f"hdr{uuid.uuid4().hex[:6]}"  # the broadcast goes to this worker alone
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, names=names)
    worker = cluster.workers[0]
    try:
        bad = [(raw_send(cluster.app, "guarded", (f"h{i}",), headers), says)
               for i, (headers, says) in enumerate(BAD_GATE_HEADERS)]
        ignored = [raw_send(cluster.app, "guarded", (f"i{i}",), headers)
                   for i, headers in enumerate(IGNORED_GATE_HEADERS)]
        forged = {"name": "lease", "limit": 3, "holder": "x:1", "slot": 0, "epoch": 1,
                  "ttl": 60, "backend": "redis://:stolen@127.0.0.1:1/0", "key_prefix": "x"}
        free = raw_send(cluster.app, "unguarded_request", (), {"semaphore_lease": forged})
        for result, says in bad:
            with pytest.raises(InvalidHeader) as err:
                result.get(timeout=15)
            assert says in str(err.value) and result.state == "FAILURE"
        assert [r.get(timeout=15) for r in ignored] == [f"i{i}" for i in range(3)]
        seen = free.get(timeout=15)
        assert seen["lease"] is None and "stolen" not in seen["request"] + seen["headers"]
        replies = cluster.app.control.broadcast(
            "semaphore_parked", arguments={"name": 123}, reply=True, timeout=3,
            destination=[f"{names}0{NAME_SUFFIX}@{socket.gethostname()}"])
        assert len(replies) == 1 and "error" in list(replies[0].values())[0], replies
        raw_send(cluster.app, "celery_semaphore.doorbell", ("x",), {"semaphore_doorbell": ["x"]})
        assert wait_until(lambda: "ignoring a doorbell" in worker.output())
        assert cluster.task("guarded").delay("after", 0.01).get(timeout=15) == "after"
        assert worker.proc.poll() is None, worker.output()[-3000:]
        output = worker.output()
        assert "Traceback" not in output and "failed on the loop thread" not in output, \
            output[-3000:]
        assert not any(key.startswith("guarded:h") for key in cluster.probe.intervals())
        assert wait_until(lambda: cluster.held("images") == 0)
    finally:
        cluster.stop()


def on_a_backend_to_kill(tmp_path, redis_url):
    """A backend the test may kill and start again (Redis with an fsynced AOF) and one worker
    on it, the broker being the shared Redis: ``(backend, cluster)``."""
    backend = PersistentRedis(tmp_path / "backend")
    try:
        return backend, Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url),
                                backend.url, workers=1)
    except BaseException:
        backend.kill()
        raise


def test_two_backoffs_of_one_semaphore_in_a_backend_outage_give_each_call_back_once(
        redis_url, tmp_path):
    """Two calls of one semaphore raise Backoff during a backend outage: two pauses of it are
    retried until the backend answers, and the calls given back wait for them. Each call then
    runs once more, not twice: before, the end of each pause handed every call held for the
    semaphore to Celery again (found by the nemesis soak, seed 4242028: one task run
    twice)."""
    backend, cluster = on_a_backend_to_kill(tmp_path, redis_url)
    worker, partner, go = cluster.workers[0], cluster.task("partner"), str(tmp_path / "go")
    try:
        calls = {key: partner.delay(key, 2.0, go) for key in ("a", "c")}
        assert wait_until(lambda: cluster.started("api:a") and cluster.started("api:c"),
                          timeout=20)
        backend.kill()
        open(go, "w").close()  # both bodies end and raise Backoff(2) during the outage
        assert wait_until(lambda: worker.output().count("pausing 'partner' failed, retrying")
                          == 2, timeout=10), worker.output()[-4000:]
        backend.start()
        assert {key: r.get(timeout=30) for key, r in calls.items()} == {"a": ["a", 0],
                                                                        "c": ["c", 0]}
        assert wait_until(lambda: cluster.held("partner") == 0, timeout=20)
        runs = cluster.probe.intervals()
        assert len(runs["api:a"]) == 2 and len(runs["api:c"]) == 2, runs  # backed off, ran
        output = worker.output()
        for result in calls.values():
            assert output.count(f"{result.id}] backed off: it waits again") == 1, (
                output[-4000:])
    finally:
        cluster.stop()
        backend.kill()


def test_a_backoff_raised_in_a_backend_outage_still_closes_the_semaphore_for_its_time(
        redis_url, tmp_path):
    """A call raises Backoff(retry_after=4) while its backend (Redis with an fsynced AOF) is
    down: the pause (from the pool process, then from the gate) fails, and is made again once
    the backend answers, for what is left of the time; the call given back waits for it, and
    neither it nor a call sent meanwhile starts before the 4 s are up (before: the failed
    pause was logged and dropped, and both ran as soon as the backend was back)."""
    backend, cluster = on_a_backend_to_kill(tmp_path, redis_url)
    worker, partner, go = cluster.workers[0], cluster.task("partner"), str(tmp_path / "go")
    try:
        first = partner.delay("a", 4.0, go)
        assert wait_until(lambda: cluster.started("api:a"), timeout=20)
        backend.kill()
        open(go, "w").close()  # the body ends and raises Backoff(4) during the outage
        assert wait_until(lambda: "pausing 'partner' failed, retrying" in worker.output(),
                          timeout=10)
        later = partner.delay("b", 0.0, 0.01)
        backend.start()
        assert first.get(timeout=30) == ["a", 0] and later.get(timeout=30) == ["b", 0]
        runs = cluster.probe.intervals()
        (_, backed_off_at), (again, _) = runs["api:a"]
        b_started = runs["api:b"][0][0]  # (it backs off once too, by 0 s)
        assert min(again, b_started) >= backed_off_at + 3.8e9
        assert "semaphore 'partner' paused for" in worker.output()
    finally:
        cluster.stop()
        backend.kill()
