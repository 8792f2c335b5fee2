"""The gate with real prefork workers (2 workers x 4 processes), real brokers, real backends.

Concurrency is read from the probe file the task bodies write, never from the library.
"""

import json
import os
import re
import signal
import threading
import time
import uuid

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_semaphore import Semaphore, SemaphoreTimeout
from celery_semaphore.backends import get_backend
from celery_semaphore.cli import worker_requests
from celery_semaphore.waiting_room import lane_of, parking_queue_name
from tests import servers
from tests.celery_app import create_app
from tests.probe import Probe
from tests.util import wait_until
from tests.workers import NAME_SUFFIX, Worker, cluster_env, run_cli

pytestmark = pytest.mark.slow

# broker-backend
COMBOS = ["redis-redis", "redis-sqlite", "amqp-redis", "amqp-sqlite", "amqp-tokens", "amqp-slots"]
RESULTS_DB = 13  # the result backend: this database of the tests' Redis server


class Cluster:
    def __init__(self, tmp_dir, redis_url, broker, backend, workers=2, concurrency=4,
                 names="w", **env_extra):
        results = servers.redis_db(redis_url, RESULTS_DB)
        self.env = cluster_env(tmp_dir, broker, backend, results, **env_extra)
        self.app = create_app(self.env)
        self.probe = Probe(self.env["CS_PROBE"])
        self.backend = get_backend(backend or broker, key_prefix=self.env["CS_KEY_PREFIX"])
        # Worker names are unique per broker: a RabbitMQ worker's pidbox queue is exclusive.
        self.workers = [Worker(self.env, f"{names}{i}", concurrency) for i in range(workers)]
        try:
            for worker in self.workers:
                worker.wait_ready()
        except BaseException:  # none left running when one does not start
            for worker in self.workers:
                worker.kill()
            raise

    def task(self, name):
        return self.app.tasks[f"tests.celery_app.{name}"]

    def stop(self):
        for worker in self.workers:
            worker.stop()
        self.app.close()

    def held(self, name):
        status = self.backend.status(name)
        return 0 if status is None else status.held

    def started(self, key):
        return key in self.probe.intervals()

    def diagnosis(self, tail=4000):
        """What each worker says it holds (the ``semaphore_requests`` inspect command) and the
        end of its log: for the message of an assertion that waited in vain."""
        try:
            requests = json.dumps(worker_requests(self.app, timeout=2.0), indent=1, default=str)
        except Exception as exc:  # the broker may be what failed
            requests = f"(no answer: {exc!r})"
        logs = "\n".join(f"--- {w.name}\n{w.output()[-tail:]}" for w in self.workers)
        return f"workers' requests: {requests}\n{logs}"


def urls(combo, redis_url, amqp_url, tmp_dir):
    broker_kind, backend_kind = combo.split("-")
    broker = servers.redis_broker(redis_url) if broker_kind == "redis" else amqp_url
    backend = {
        "redis": redis_url,
        "sqlite": f"sqlite:///{tmp_dir}/sem.db",
        "tokens": None,  # unset: an AMQP broker gives the token backend on its own URL
        "slots": servers.slots_url(amqp_url),
    }[backend_kind]
    return broker, backend


class SharedCluster:
    """One cluster per combination, shared by the tests that leave it as they found it.

    Before each test the cluster must be whole and quiet (every worker alive, no slot held, no
    request waiting); after a failed test, or when that check fails, the next test gets a fresh
    cluster (new queue, key prefix, probe and database), so no test depends on another's order
    or outcome.
    """

    def __init__(self, combo, redis_url, amqp_url, tmp_path_factory):
        self.combo, self.redis_url, self.amqp_url = combo, redis_url, amqp_url
        self.tmp_path_factory = tmp_path_factory
        self.current = None

    def ready(self) -> Cluster:
        if self.current is not None and not self._whole_and_quiet(self.current):
            self.discard()
        if self.current is None:
            tmp_dir = str(self.tmp_path_factory.mktemp(self.combo))
            broker, backend = urls(self.combo, self.redis_url, self.amqp_url, tmp_dir)
            self.current = Cluster(tmp_dir, self.redis_url, broker, backend)
        return self.current

    def discard(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None

    @staticmethod
    def _whole_and_quiet(cluster: Cluster) -> bool:
        if any(worker.proc.poll() is not None for worker in cluster.workers):
            return False

        def quiet():
            statuses = [cluster.backend.status(name) for name in cluster.backend.names()]
            return all(s is None or (s.held == 0 and s.waiting == 0) for s in statuses)

        return wait_until(quiet, timeout=10)


@pytest.fixture(scope="module", params=COMBOS)
def shared_cluster(request, redis_url, amqp_url, tmp_path_factory):
    shared = SharedCluster(request.param, redis_url, amqp_url, tmp_path_factory)
    yield shared
    shared.discard()


@pytest.fixture
def cluster(shared_cluster, request):
    failures_before = request.session.testsfailed
    yield shared_cluster.ready()
    if request.session.testsfailed != failures_before:
        shared_cluster.discard()


def test_limit_holds_and_every_task_runs_once(cluster):
    guarded, per_customer, unguarded = (cluster.task(n) for n in
                                        ("guarded", "per_customer", "unguarded"))
    results = [guarded.delay(f"a{i}", 0.05) for i in range(30)]
    results += [per_customer.delay(c, f"a{i}", 0.05) for i in range(8) for c in (1, 2, 3)]
    results += [unguarded.delay(f"a{i}") for i in range(20)]
    for result in results:
        result.get(timeout=60)
    assert cluster.probe.max_concurrent("guarded:a") == 2
    for customer in (1, 2, 3):
        assert cluster.probe.max_concurrent(f"customer-{customer}:a") == 1
    # three customers ran side by side: the template made three semaphores
    assert cluster.probe.max_concurrent("customer-") > 1
    completed = cluster.probe.completed()
    keys = [k for k in completed if k.split(":")[1].startswith("a")]
    assert len(keys) == 30 + 24 + 20
    assert all(completed[k] == 1 for k in keys)
    # a slot is released after its task's result is stored: wait for the last releases
    assert wait_until(lambda: cluster.held("images") == 0 and cluster.held("api:2") == 0)


def test_unguarded_tasks_flow_while_guarded_ones_wait(cluster):
    slow, unguarded = cluster.task("slow"), cluster.task("unguarded")
    first = slow.delay("x0", 30)
    assert wait_until(lambda: cluster.started("slow:x0"))
    waiting = [slow.delay(f"b{i}", 0.05) for i in range(1, 13)]
    assert wait_until(lambda: cluster.backend.status("slow").waiting >= 1)
    started = time.monotonic()
    free = [unguarded.delay(f"b{i}") for i in range(24)]
    for result in free:
        result.get(timeout=15)
    assert time.monotonic() - started < 10
    assert not any(cluster.started(f"slow:b{i}") for i in range(1, 13))
    assert cluster.held("slow") == 1
    # A waiting request shows WAITING in the result backend.
    assert wait_until(lambda: waiting[0].state == "WAITING", timeout=5)
    # Revoking a waiting task, by id or by stamped header: it never runs.
    waiting[0].revoke()
    assert wait_until(lambda: waiting[0].state == "REVOKED", timeout=5)
    # Sent behind a backlog, the stamped task may wait in a worker or in the waiting room
    # (parked on send, or by a worker past its share): revoked by its stamp either way, it
    # never runs, and is announced REVOKED where a worker meets it (in its line at the next
    # tick, or when it is pulled once the backlog drains).
    stamped = slow.s("s1", 0.05)
    stamped.stamp(batch="cancel-me")
    stamped = stamped.apply_async()
    cluster.app.control.revoke_by_stamped_headers({"batch": "cancel-me"})
    # Revoke with terminate frees the slot at once: the waiters run, one at a time.
    terminated_at = time.monotonic_ns()
    first.revoke(terminate=True)

    def logs():
        return "\n".join(f"--- {w.name}\n{w.output()[-6000:]}" for w in cluster.workers)

    for result in waiting[1:]:
        try:
            result.get(timeout=30)
        except Exception as exc:
            raise AssertionError(f"{result.id}: {exc!r}\n{logs()}") from exc
    assert wait_until(lambda: stamped.state == "REVOKED", timeout=30), logs()
    assert not cluster.started("slow:b1") and not cluster.started("slow:s1")
    assert cluster.probe.max_concurrent("slow:b") == 1
    b_starts = [runs[0][0] for key, runs in cluster.probe.intervals().items()
                if key.startswith("slow:b")]
    assert min(b_starts) > terminated_at
    assert wait_until(lambda: cluster.held("slow") == 0)


def test_a_granted_task_revoked_before_a_pool_process_takes_it_frees_its_slot_at_once(
        redis_url, tmp_path):
    """With its one process busy, a worker tries the next request ahead, and hands it to the
    pool with its slot: Celery holds it until the process frees. Revoked meanwhile, Celery
    discards it there (no pool callback comes; the signal it sends carries the task's
    Context, not the request), and the slot goes at once, not at the gate's next tick (30 s
    here)."""
    settings = json.dumps({"semaphore_poll_interval": 30.0})
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, concurrency=1, CS_SETTINGS=settings, CS_LEASE_TTL="300")
    try:
        call = cluster.task("ahead_call")
        release = str(tmp_path / "a.go")
        first = call.delay("a", release)
        assert wait_until(lambda: cluster.started("ahead:a"), timeout=20)
        second = call.delay("b", 0.0)
        assert wait_until(lambda: cluster.held("ahead") == 2, timeout=20)  # granted ahead
        second.revoke()
        worker = cluster.workers[0]
        assert wait_until(lambda: f"Tasks flagged as revoked: {second.id}" in worker.output(),
                          timeout=10)
        open(release, "w").close()
        assert first.get(timeout=30) == "a"
        assert wait_until(lambda: f"Discarding revoked task: tests.celery_app.ahead_call"
                          f"[{second.id}]" in worker.output(), timeout=10)
        assert wait_until(lambda: cluster.held("ahead") == 0, timeout=5), worker.output()[-4000:]
        assert not cluster.started("ahead:b")
        assert "Signal handler" not in worker.output()
    finally:
        cluster.stop()


def test_a_duplicate_delivery_never_runs_beside_its_twin(cluster):
    """Two messages of one task id (what a worker killed between parking a copy and acking
    the original leaves): both run, at-least-once, but one after the other, though the
    semaphore has a free slot."""
    guarded = cluster.task("guarded")
    task_id = str(uuid.uuid4())
    for _ in range(2):
        guarded.apply_async(("dup", 1.0), task_id=task_id)
    assert wait_until(lambda: cluster.probe.completed("guarded:dup").get("guarded:dup") == 2,
                      timeout=30)
    assert cluster.probe.max_concurrent("guarded:dup") == 1
    assert wait_until(lambda: cluster.held("images") == 0)


def test_sigkilled_pool_child_frees_its_slot_at_once(cluster):
    slow = cluster.task("slow")
    slow.delay("c0", 30)
    assert wait_until(lambda: cluster.started("slow:c0"))
    nxt = slow.delay("c1", 0.05)
    assert wait_until(lambda: cluster.backend.status("slow").waiting == 1), (  # queued, not run
        f"{cluster.backend.status('slow')}\nc1: {nxt.state}\n{cluster.diagnosis()}")
    assert not cluster.started("slow:c1")
    (pid,) = [e[3] for e in cluster.probe.events() if e[1] == "slow:c0"]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    nxt.get(timeout=20)
    assert time.monotonic() - killed_at < 10  # the lease TTL is 60 s
    assert wait_until(lambda: cluster.held("slow") == 0)


def test_time_limits_free_the_slot(cluster):
    limited = cluster.task("time_limited")
    soft = limited.delay("d0", 5.0)  # soft limit 0.5 s: raises in the body
    hard = limited.delay("d1", 5.0, obey_soft_limit=False)  # hard limit 1 s: child killed
    after = limited.delay("d2", 0.01)
    after.get(timeout=30)
    with pytest.raises(SoftTimeLimitExceeded):
        soft.get(timeout=5)
    with pytest.raises(TimeLimitExceeded):
        hard.get(timeout=5)
    runs = {key: spans[0] for key, spans in cluster.probe.intervals().items()
            if key.startswith("limited:d")}
    # The hard-killed body never wrote its end; one at a time all the same, and each slot
    # came back when the limit struck, long before the 5 s the bodies wanted.
    order = sorted(runs, key=lambda k: runs[k][0])
    for previous, current in zip(order, order[1:]):
        prev_start, prev_end = runs[previous]
        limit_ns = 0.5e9 if previous == "limited:d0" else 1.0e9
        assert runs[current][0] >= (prev_end or prev_start + limit_ns), (order, runs)
        assert runs[current][0] - prev_start < 4e9
    assert wait_until(lambda: cluster.held("limited") == 0)
    # Celery's own time-limit handler ran through the gate's wrapper (it raised a TypeError
    # on billiard's keyword call, so Celery's handler was skipped).
    logs = "".join(worker.output() for worker in cluster.workers)
    assert "Pool callback raised exception" not in logs
    assert "Hard time limit (1.0s) exceeded for tests.celery_app.time_limited" in logs


def test_gevent_pool_hard_time_limit_frees_the_slot(redis_url, tmp_path):
    """gevent (and eventlet) report a hard time limit through the request's on_timeout only,
    never on_failure: the gate must release there, once the limit has unwound the body."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=0)
    try:
        worker = Worker(cluster.env, "green", 4, pool="gevent")
        worker.wait_ready()
        cluster.workers.append(worker)
        limited = cluster.task("time_limited")
        hard = limited.delay("g1", 5.0, obey_soft_limit=False)  # hard limit 1 s
        after = limited.delay("g2", 0.01)
        after.get(timeout=15)
        with pytest.raises(TimeLimitExceeded):
            hard.get(timeout=5)
        runs = cluster.probe.intervals()
        # g2 waits for g1's hard limit (1 s). gevent counts it from the pool's apply, which
        # comes before the body's first mark in the probe (0.97 s apart in a loaded CI run):
        # a release made too early would start g2 within milliseconds, none at all only after
        # the lease's TTL, past the 15 s above
        assert runs["limited:g2"][0][0] - runs["limited:g1"][0][0] >= 0.5e9, runs
        assert wait_until(lambda: cluster.held("limited") == 0)
    finally:
        cluster.stop()


def test_failure_and_retry_release(cluster):
    fails, retrying = cluster.task("fails"), cluster.task("retrying")
    failures = [fails.delay(f"e{i}") for i in range(3)]
    for result in failures:
        with pytest.raises(ValueError):
            result.get(timeout=20)
    assert retrying.delay("e").get(timeout=30) == 2
    assert wait_until(lambda: cluster.held("fails") == 0 and cluster.held("retrying") == 0)


def test_current_lease_inside_the_task(cluster):
    info = cluster.task("lease_info").delay().get(timeout=20)
    assert info["name"] == "lease" and info["limit"] == 3
    assert info["verified"] is True
    assert info["slot"] in (0, 1, 2) and info["epoch"] > 0


# -- scenarios with a cluster of their own ------------------------------------------------


def test_the_task_never_sees_the_backend_password_and_its_lease_still_works(redis_url,
                                                                            tmp_path):
    """The semaphore backend is a password-protected private redis-server: nothing the task can
    read of its request holds the password (before: ``request.headers["semaphore_lease"]
    ["backend"]`` was the URL in clear), and its lease still reaches the backend, through the
    worker's own configuration (``verify``, ``ensure``). The worker's log holds no password
    either."""
    password = f"pw{uuid.uuid4().hex[:12]}"
    port = servers.free_port()
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    proc, client = servers.start_redis(port, tmp_path, "--requirepass", password,
                                       client_url=url)
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), url,
                      workers=1)
    try:
        seen = cluster.task("guarded_request").delay().get(timeout=20)
        assert seen["lease"] == {"name": "lease", "verified": True, "leases": ["lease"]}
        assert "semaphore_lease" in seen["headers"]  # the record is there, masked
        assert password not in json.dumps(seen), seen
        assert password not in cluster.workers[0].output()
        assert client.keys("*{lease}*")  # the lease went to the protected server
        assert wait_until(lambda: cluster.held("lease") == 0)
    finally:
        cluster.stop()
        proc.terminate()
        proc.wait(10)


def test_sigkilled_worker_frees_its_slot_within_the_lease_ttl(redis_url, tmp_path):
    ttl = 3.0
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, CS_LEASE_TTL=str(ttl))
    try:
        slow = cluster.task("slow")
        slow.delay("f0", 60)
        assert wait_until(lambda: cluster.started("slow:f0"))
        spare = Worker(cluster.env, "spare", 2)
        spare.wait_ready()
        cluster.workers.append(spare)
        killed_at = time.monotonic()
        cluster.workers[0].kill()
        nxt = slow.delay("f1", 0.01)
        nxt.get(timeout=ttl + 15)
        waited = time.monotonic() - killed_at
        assert 0.5 * ttl < waited < ttl + 5, waited
    finally:
        cluster.stop()


def test_postgres_backend_holds_the_limit_across_prefork_workers(redis_url, postgres_url,
                                                                  tmp_path):
    """The PostgreSQL backend under real workers (not a combination of the shared clusters:
    one scenario is enough to see the pool children fork a backend that listens, and each
    combination costs the suite about a minute)."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), postgres_url)
    try:
        assert all("PostgresBackend postgresql://" in w.output() for w in cluster.workers)
        guarded, per_customer = cluster.task("guarded"), cluster.task("per_customer")
        results = [guarded.delay(f"p{i}", 0.05) for i in range(30)]
        results += [per_customer.delay(c, f"p{i}", 0.05) for i in range(6) for c in (1, 2)]
        for result in results:
            result.get(timeout=60)
        assert cluster.probe.max_concurrent("guarded:p") == 2
        assert cluster.probe.max_concurrent("customer-1:p") == 1
        assert cluster.probe.max_concurrent("customer-2:p") == 1
        completed = cluster.probe.completed()
        assert len([k for k in completed if k.split(":")[1].startswith("p")]) == 30 + 12
        assert all(n == 1 for n in completed.values())
        assert wait_until(lambda: cluster.held("images") == 0)
    finally:
        cluster.stop()


@pytest.mark.parametrize("lease_ttl, problem", [
    (-5, "positive"),
    (30 * 24 * 3600, "idle_ttl"),  # the backend (idle_ttl 7 days) would forget the semaphore
])
def test_bad_settings_stop_the_worker_naming_the_setting(redis_url, tmp_path, lease_ttl,
                                                         problem):
    env = cluster_env(str(tmp_path), servers.redis_broker(redis_url), redis_url,
                      servers.redis_db(redis_url, RESULTS_DB),
                      CS_SETTINGS=json.dumps({"semaphore_lease_ttl": lease_ttl}))
    worker = Worker(env, "bad", 1)
    assert worker.proc.wait(30) != 0
    output = worker.output()
    assert "semaphore_lease_ttl" in output and problem in output


def test_requeue_past_the_per_worker_bound_loses_nothing(redis_url, tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 2}))
    try:
        guarded = cluster.task("guarded")
        results = [guarded.delay(f"g{i}", 0.1) for i in range(12)]
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"g{i}" for i in range(12))
        assert cluster.probe.max_concurrent("guarded:g") == 2
        assert all(n == 1 for n in cluster.probe.completed("guarded:g").values())
    finally:
        cluster.stop()


def test_max_wait_fails_the_task_with_a_clear_error(redis_url, tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, CS_SETTINGS=json.dumps({"semaphore_max_wait": 1.0}))
    try:
        slow = cluster.task("slow")
        slow.delay("h0", 5)
        assert wait_until(lambda: cluster.started("slow:h0"))
        late = slow.delay("h1", 0.01)
        with pytest.raises(SemaphoreTimeout) as err:
            late.get(timeout=15)
        assert "semaphore_max_wait" in str(err.value)
        assert not cluster.started("slow:h1")
    finally:
        cluster.stop()


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_worker_shutdown_releases_and_loses_nothing(how, redis_url, tmp_path):
    """Warm: the running task finishes, then its slot is freed. Cold: the task dies with the
    pool and the slot is freed at exit, not after the lease TTL. Requests that waited in the
    stopped worker run later on another worker."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1)
    try:
        slow = cluster.task("slow")
        running = slow.delay("k0", 1.5)
        assert wait_until(lambda: cluster.started("slow:k0"))
        waiting = [slow.delay(f"k{i}", 0.05) for i in range(1, 4)]
        assert wait_until(lambda: cluster.backend.status("slow").waiting >= 1, timeout=5)
        worker = cluster.workers[0]
        stopped_at = time.monotonic()
        worker.stop(signal.SIGTERM if how == "warm" else signal.SIGQUIT)
        assert worker.proc.returncode is not None
        if how == "warm":
            assert running.get(timeout=5) == "k0"
        assert cluster.held("slow") == 0  # freed by the worker itself, not by the 60 s TTL
        assert time.monotonic() - stopped_at < 20
        status = cluster.backend.status("slow")
        assert status is None or status.waiting == 0
        spare = Worker(cluster.env, "spare", 2)
        spare.wait_ready()
        cluster.workers.append(spare)
        assert [r.get(timeout=30) for r in waiting] == ["k1", "k2", "k3"]
        assert all(n == 1 for k, n in cluster.probe.completed("slow:k").items() if k != "slow:k0")
    finally:
        cluster.stop()


def test_a_job_the_pool_drops_on_a_broker_reconnect_does_not_keep_its_slot(redis_url, tmp_path,
                                                                          own_broker):
    """On a broker reconnect the consumer drops the jobs no pool child has acknowledged, and
    their pool callbacks never run (before: the lease was renewed, so the slot held, until the
    worker stopped). Here the job was written to the pool child that ran the first task and
    exits (max-tasks-per-child 1; the next child takes 2.5 s to start) when the test cuts the
    worker's broker connections: the slot is kept until that child exits, then its message
    is put back (the child may have exited before reading it). billiard gives the exited
    child's pipe to the next child, which runs the job too: ``b`` may run twice, never beside
    itself. Where the job was lost with the exited child's pipe (or the pool's buffer), the
    next child never starts it, and once it has been up a lease TTL the message is put back
    (before, it was acknowledged, and ``b`` was lost: seen when this test first ran beside
    others)."""
    ttl = 2.0
    broker = own_broker
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=0,
                      CS_LEASE_TTL=str(ttl), CS_CHILD_START_DELAY="2.5")
    try:
        worker = Worker(cluster.env, "flushed", 1, extra=["--max-tasks-per-child", "1"])
        worker.wait_ready()
        cluster.workers.append(worker)
        slow = cluster.task("slow")
        first, second = slow.delay("a", 0.1), slow.delay("b", 0.1)
        assert first.get(timeout=30) == "a"
        assert wait_until(lambda: _holders(cluster, "slow") == [second.id], timeout=10)
        assert not cluster.started("slow:b")  # granted, waiting for the next pool child
        cut = _kill_clients(redis.Redis.from_url(broker))
        assert cut and wait_until(lambda: "Trying to re-establish" in worker.output(), 5)
        # The broker redelivers the message, which runs once the unseen run has ended.
        assert wait_until(lambda: second.ready(), timeout=30), worker.output()[-6000:]
        assert second.get(timeout=1) == "b"
        assert cluster.probe.max_concurrent() == 1
        assert wait_until(lambda: cluster.held("slow") == 0, timeout=ttl + 5)
    finally:
        cluster.stop()


def test_a_job_written_to_a_pool_child_before_a_broker_reconnect_runs_once(redis_url, tmp_path,
                                                                           own_broker):
    """``b``'s job is written to the worker's one pool child, which is stopped (SIGSTOP) and so
    has not read it, when the test cuts the worker's broker connections. The pool's flush
    drops the job (no child accepted it), but the child reads and runs it, unseen, once it
    continues. Its message stays unacknowledged in the broker until that child reports the
    job done (billiard's result for a job the pool dropped), then is acknowledged: ``b`` runs
    once. Before, the
    gate put the message back at the reconnect and ``b`` ran twice (the chaos soak's one
    duplicate in 1,578 tasks)."""
    ttl = 2.0
    broker = own_broker
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=0,
                      CS_LEASE_TTL=str(ttl))
    client = redis.Redis.from_url(broker)
    child = None
    try:
        worker = Worker(cluster.env, "flushed", 1)
        worker.wait_ready()
        cluster.workers.append(worker)
        warm = cluster.task("guarded").delay("warm")
        assert warm.get(timeout=30) == "warm"
        # the pool has the child's result (else it holds b until the stopped child answers)
        assert wait_until(lambda: f"{warm.id}] succeeded" in worker.output(), timeout=10)
        assert wait_until(lambda: _pool_writes(cluster, worker) == 1, timeout=10)
        (child,) = worker.pool_pids()
        os.kill(child, signal.SIGSTOP)
        queued = cluster.task("unguarded").delay("b", 0.1)
        # b's job is written to the stopped child's pipe: the pool counts the write done
        assert wait_until(lambda: _pool_writes(cluster, worker) == 2, timeout=10), \
            worker.output()[-3000:]
        cut = _kill_clients(client)
        assert cut and wait_until(lambda: "Trying to re-establish" in worker.output(), 5)
        assert wait_until(lambda: f"{queued.id} runs in pool child {child}" in worker.output(),
                          5), worker.output()[-3000:]
        os.kill(child, signal.SIGCONT)
        child = None
        assert queued.get(timeout=30) == "b"
        assert wait_until(lambda: f"settled {queued.id}" in worker.output(), timeout=ttl + 10), \
            worker.output()[-3000:]
        settled = worker.output().split(f"settled {queued.id}")[1].split("\n")[0]
        # settled on the child's own report that the job is done (billiard's READY for a job
        # the pool dropped), not on what became of the child afterwards
        assert "which ran it to its end): acknowledged" in settled, settled
        # acknowledged in the broker: it cannot be delivered again; and every delivery of b
        # the worker received has ended
        assert wait_until(lambda: not _in_broker(client, cluster), timeout=10)
        assert wait_until(lambda: worker.output().count(f"{queued.id}] received")
                          == cluster.probe.completed("free:b").get("free:b", 0), timeout=15)
        assert cluster.probe.completed("free:b") == {"free:b": 1}
    finally:
        if child is not None:
            os.kill(child, signal.SIGCONT)
        client.close()
        cluster.stop()


def test_a_job_left_in_a_dead_pool_childs_pipe_runs_once_in_its_replacement(redis_url, tmp_path,
                                                                             own_broker):
    """``b``'s job is written to the worker's one pool child, stopped (SIGSTOP) so that it never
    reads it; the test cuts the worker's broker connections (the pool's flush drops the job:
    no child accepted it), then kills that child. billiard gives the dead child's pipe, with
    ``b``'s job unread in it, to the child that replaces it, which runs ``b``: its message is
    acknowledged once that child has moved on, and ``b`` runs once. Before, the gate followed
    the job's ``_write_to`` (the dead child), put the message back when it found that child
    gone, and ``b`` ran twice (the chaos soak's duplicate with seed 777123, where the child was
    already dead, not yet reaped, when the job was written to its pipe). The lease TTL leaves
    room for a slow machine: a child up for a TTL counts as moved on, and the gate settles
    then."""
    ttl = 6.0
    broker = own_broker
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=0,
                      CS_LEASE_TTL=str(ttl))
    client = redis.Redis.from_url(broker)
    child = None
    try:
        worker = Worker(cluster.env, "flushed", 1)
        worker.wait_ready()
        cluster.workers.append(worker)
        warm = cluster.task("guarded").delay("warm")
        assert warm.get(timeout=30) == "warm"
        assert wait_until(lambda: f"{warm.id}] succeeded" in worker.output(), timeout=10)
        assert wait_until(lambda: _pool_writes(cluster, worker) == 1, timeout=10)
        (child,) = worker.pool_pids()
        os.kill(child, signal.SIGSTOP)
        queued = cluster.task("unguarded").delay("b", 0.1)
        assert wait_until(lambda: _pool_writes(cluster, worker) == 2, timeout=10), \
            worker.output()[-3000:]
        cut = _kill_clients(client)
        assert cut and wait_until(lambda: "Trying to re-establish" in worker.output(), 5)
        assert wait_until(lambda: f"{queued.id} runs in pool child {child}" in worker.output(),
                          5), worker.output()[-3000:]
        before = worker.output()
        os.kill(child, signal.SIGKILL)  # dies stopped: b's job is still in its pipe
        child = None
        assert f"settled {queued.id}" not in before  # (not on a lease TTL: the kill decides)
        # run by the replacement, from that pipe
        assert wait_until(lambda: queued.ready(), timeout=30), worker.output()[-5000:]
        assert queued.get(timeout=1) == "b"
        assert wait_until(lambda: f"settled {queued.id}" in worker.output(), timeout=ttl + 15), \
            worker.output()[-3000:]
        # acknowledged in the broker, or delivered again and run to its end: either way gone
        # from the broker once every delivery of b the worker received has ended
        assert wait_until(lambda: not _in_broker(client, cluster), timeout=15)
        assert wait_until(lambda: worker.output().count(f"{queued.id}] received")
                          == cluster.probe.completed("free:b").get("free:b", 0), timeout=15)
        assert cluster.probe.completed("free:b") == {"free:b": 1}, worker.output()[-3000:]
        assert "acknowledged" in worker.output().split(f"settled {queued.id}")[1].split("\n")[0]
    finally:
        if child is not None:
            os.kill(child, signal.SIGCONT)
        client.close()
        cluster.stop()


def test_a_job_run_unseen_by_a_pool_child_that_dies_running_it_is_delivered_again(
        redis_url, tmp_path, own_broker):
    """As above, but the stopped child continues after the reconnect, reads ``b``'s job (its
    acknowledgement of the job tells the gate so, though the pool dropped the job) and is
    killed running it: its replacement, which gets the same pipe, has nothing of ``b`` to
    read, and ``b``'s message is put back (at-least-once): ``b`` runs to its end once, on its
    second delivery."""
    ttl = 6.0
    broker = own_broker
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=0,
                      CS_LEASE_TTL=str(ttl))
    client = redis.Redis.from_url(broker)
    child = None
    try:
        worker = Worker(cluster.env, "flushed", 1)
        worker.wait_ready()
        cluster.workers.append(worker)
        warm = cluster.task("guarded").delay("warm")
        assert warm.get(timeout=30) == "warm"
        assert wait_until(lambda: f"{warm.id}] succeeded" in worker.output(), timeout=10)
        assert wait_until(lambda: _pool_writes(cluster, worker) == 1, timeout=10)
        (child,) = worker.pool_pids()
        os.kill(child, signal.SIGSTOP)
        queued = cluster.task("unguarded").delay("b", 3.0)
        assert wait_until(lambda: _pool_writes(cluster, worker) == 2, timeout=10), \
            worker.output()[-3000:]
        cut = _kill_clients(client)
        assert cut and wait_until(lambda: "Trying to re-establish" in worker.output(), 5)
        assert wait_until(lambda: f"{queued.id} runs in pool child {child}" in worker.output(),
                          5), worker.output()[-3000:]
        os.kill(child, signal.SIGCONT)
        assert wait_until(lambda: "free:b" in cluster.probe.intervals(), timeout=10)
        before = worker.output()
        os.kill(child, signal.SIGKILL)  # in b's body
        child = None
        assert f"settled {queued.id}" not in before  # (not on a lease TTL: the kill decides)
        assert queued.get(timeout=30) == "b"
        assert wait_until(lambda: f"settled {queued.id}" in worker.output(), timeout=10)
        assert "put back" in worker.output().split(f"settled {queued.id}")[1].split("\n")[0]
        assert wait_until(lambda: not _in_broker(client, cluster), timeout=15)
        runs = cluster.probe.intervals()["free:b"]
        assert len(runs) == 2 and runs[0][1] is None and runs[1][1] is not None
    finally:
        if child is not None:
            os.kill(child, signal.SIGCONT)
        client.close()
        cluster.stop()


def _pool_writes(cluster, worker):
    """Jobs ``worker``'s prefork pool has written to its children (``inspect stats``); None
    when the broker does not answer, or on a pooled connection an earlier test's cut closed
    (kombu's connection pools are shared by every app on the same broker URL)."""
    try:
        replies = cluster.app.control.inspect(timeout=1.0).stats() or {}
    except redis.exceptions.ConnectionError:
        return None
    for name, stats in replies.items():
        if name.startswith(f"{worker.name}{NAME_SUFFIX}@"):
            return stats["pool"]["writes"]["total"]
    return None


def test_a_task_queued_in_the_thread_pool_runs_once_across_a_broker_reconnect(redis_url, tmp_path,
                                                                              own_broker):
    """A thread pool with its one thread busy: ``b`` (a semaphore with room) is granted ahead
    and queued in the pool's executor when the test cuts the worker's broker connections.
    The thread pool drops nothing on a reconnect, so ``b`` runs there: its message stays
    unacknowledged and is acknowledged when it ends. Before, the gate put it back (the
    request's reference to its thread-pool job is weak and was gone), and ``b`` ran twice
    (the chaos soak's duplicates on its thread-pool worker)."""
    broker = own_broker
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, workers=0)
    client = redis.Redis.from_url(broker)
    try:
        worker = Worker(cluster.env, "threads", 1, pool="threads")
        worker.wait_ready()
        cluster.workers.append(worker)
        running = cluster.task("slow").delay("a", 2.0)
        assert wait_until(lambda: cluster.started("slow:a"), timeout=30)
        queued = cluster.task("guarded").delay("b", 0.1)
        assert wait_until(lambda: _holders(cluster, "images") == [queued.id], timeout=10)
        assert not cluster.started("guarded:b")  # granted, queued behind the busy thread
        cut = _kill_clients(client)
        assert cut and wait_until(lambda: "Trying to re-establish" in worker.output(), 5)
        assert running.get(timeout=30) == "a" and queued.get(timeout=30) == "b"
        # both acknowledged in the broker: neither can be delivered again; and every delivery
        # of b the worker received has ended
        assert wait_until(lambda: not _in_broker(client, cluster), timeout=15), \
            _in_broker(client, cluster)
        assert wait_until(lambda: worker.output().count(f"{queued.id}] received")
                          == worker.output().count(f"{queued.id}] succeeded"), timeout=15)
        assert cluster.probe.completed("guarded:b") == {"guarded:b": 1}
        assert cluster.probe.completed("slow:a") == {"slow:a": 1}
    finally:
        client.close()
        cluster.stop()


def _in_broker(client, cluster):
    """This test's messages in the broker: in its task queue, or unacknowledged (kombu's
    Redis transport keeps those in one ``unacked`` hash for every queue of the database)."""
    queue = cluster.env["CS_QUEUE"]
    unacked = [v for v in client.hvals("unacked") if f'"{queue}"' in v.decode(errors="replace")]
    return unacked + client.lrange(queue, 0, -1)


def _holders(cluster, name):
    status = cluster.backend.status(name)
    return [h.meta.get("task_id") for h in status.holders] if status else []


def _kill_clients(client):
    """Close every connection to the client's Redis database (the worker's broker ones)."""
    db = client.connection_pool.connection_kwargs.get("db", 0)
    ours = client.client_id()
    ids = [c["id"] for c in client.client_list() if int(c["db"]) == db and c["id"] != ours]
    for client_id in ids:
        client.client_kill_filter(_id=client_id)
    return ids


# -- the waiting room -----------------------------------------------------------------------


def _parked(cluster, name, queue=None):
    """Messages in the parking queue of semaphore ``name``'s lane to the cluster's task queue
    (or ``queue``), asked of the broker itself."""
    lane = lane_of(name, None, queue or cluster.env["CS_QUEUE"])
    parking = parking_queue_name(cluster.env["CS_KEY_PREFIX"], lane)
    with cluster.app.connection_for_write() as connection:
        try:
            return connection.default_channel.queue_declare(queue=parking, passive=True)[1]
        except connection.channel_errors:  # not declared (yet), or deleted once empty
            return 0


class _NONE:
    waiting = 0


def _waiting_elsewhere(cluster, name, limit):
    """A thread that waits in ``name``'s queue (so the semaphore has a backlog and sends of it
    are parked) until it gets a slot, which it gives back at once."""
    semaphore = Semaphore(name, limit, cluster.backend.url,
                          key_prefix=cluster.env["CS_KEY_PREFIX"], ttl=60)
    thread = threading.Thread(target=lambda: semaphore.acquire(timeout=120).release(),
                              daemon=True)
    thread.start()
    assert wait_until(lambda: (cluster.backend.status(name) or _NONE).waiting >= 1)
    return thread


@pytest.mark.parametrize("broker_kind", ["redis", "amqp"])
def test_a_backlog_past_the_worker_bound_is_parked_in_the_broker_and_drained(
        broker_kind, redis_url, amqp_url, tmp_path):
    """Sent to the task queue (``semaphore_park_on_send`` off), requests past
    semaphore_worker_max_waiting wait in a parking queue on the broker, not in ETA requeues:
    each runs once, never more than the limit at once, with at most one
    extra delivery (the pull from the parking queue) and no requeue."""
    broker = servers.redis_broker(redis_url) if broker_kind == "redis" else amqp_url
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, names="park",
                      CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 3,
                                              "semaphore_park_on_send": False}))
    try:
        guarded = cluster.task("guarded")
        done = tmp_path / "long-tasks-may-end"
        # both slots, until the test says so (a fixed hold ran out under a loaded CI once)
        long = [guarded.delay(f"long{i}", str(done)) for i in range(2)]
        assert wait_until(lambda: all(cluster.started(f"guarded:long{i}") for i in range(2)))
        results = [guarded.delay(f"p{i}", 0.02) for i in range(80)]
        # 3 wait in each worker, the rest in the parking queue: WAITING, parked, and counted
        # by `celery semaphore status` from the broker
        assert wait_until(lambda: _parked(cluster, "images") == 80 - 2 * 3, timeout=20)
        # (a request told to wait in a worker and parked right after stores WAITING twice:
        # the second says parked)
        assert wait_until(lambda: results[-1].state == "WAITING"
                          and (results[-1].info or {}).get("parked") is True, timeout=10), \
            (results[-1].state, results[-1].info)
        shown = run_cli(cluster.env, "status", "images", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["parked"] == 80 - 2 * 3
        # `workers`: what each worker parked, and what the broker holds parked now (the long
        # tasks may end meanwhile, and the drain begin)
        replies = json.loads(run_cli(cluster.env, "workers", "--json").stdout)
        # only this cluster's workers: the module's shared cluster may answer too
        ours = [info for name, info in replies.items() if name.startswith("park")]
        assert len(ours) == 2
        # each parked at least once; one a worker parked, another may have pulled back
        parked = sum(info["parked"].get("images", 0) for info in ours)
        pulled = sum(info["pulled"].get("images", 0) for info in ours)
        assert parked - pulled <= 80 - 2 * 3 <= parked <= 80
        shown = run_cli(cluster.env, "workers")
        assert re.search(r"since it started: \d+ parked, \d+ pulled back", shown.stdout)
        assert re.search(r"^images\s+\d+$", shown.stdout, re.M), shown.stdout + shown.stderr
        done.touch()
        assert [r.get(timeout=30) for r in long] == ["long0", "long1"]
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"p{i}" for i in range(80))
        assert cluster.probe.max_concurrent("guarded:p") == 2
        assert all(n == 1 for n in cluster.probe.completed("guarded:p").values())
        logs = "".join(worker.output() for worker in cluster.workers)
        assert "requeueing" not in logs
        assert logs.count(" received") <= 2 * 80 + 2
        assert wait_until(lambda: _parked(cluster, "images") == 0)
        assert cluster.held("images") == 0
    finally:
        cluster.stop()


@pytest.mark.parametrize("point, park_on_send", [
    ("parking", False), ("pulling", False), ("granted-not-started", False),
    ("pulling", True), ("granted-not-started", True)])
def test_sigkill_at_each_point_of_the_waiting_room_loses_no_task(point, park_on_send, redis_url,
                                                                 amqp_url, tmp_path):
    """SIGKILL of the only worker while it parks the backlog, while it pulls it back, or while
    pulled tasks hold slots their stopped pool processes never started (the backlog parked by
    the worker, or on send): every task runs (the broker returns the unacked originals and
    pulls; a duplicate is possible), never two copies of one task at once, never more than
    the limit while leases are valid."""
    tasks = 200
    name = f"kill-{point}-{'send' if park_on_send else 'worker'}"
    accepted = Probe(str(tmp_path / "accepted.log"))
    cluster = Cluster(str(tmp_path), redis_url, amqp_url, redis_url, workers=1, concurrency=2,
                      names=name, CS_LEASE_TTL="3", CS_ACCEPTED_PROBE=accepted.path,
                      CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 3,
                                              "semaphore_park_on_send": park_on_send}))
    blockers = [Semaphore("images", 2, redis_url, key_prefix=cluster.env["CS_KEY_PREFIX"],
                          ttl=60) for _ in range(2)]
    leases = [b.acquire(timeout=10) for b in blockers]  # the worker can only park
    keys = {f"guarded:k{i}" for i in range(tasks)}
    try:
        guarded = cluster.task("guarded")
        results = [guarded.delay(f"k{i}", 0.01) for i in range(tasks)]
        worker = cluster.workers[0]
        if point == "parking":
            assert wait_until(lambda: _parked(cluster, "images") >= 10, timeout=20)
        else:
            assert wait_until(lambda: _parked(cluster, "images") == tasks - 3, timeout=30)
        if point == "granted-not-started":
            children = worker.pool_pids()
            for pid in children:
                os.kill(pid, signal.SIGSTOP)

            def granted_to_parked():
                status = cluster.backend.status("images")
                return status is not None and status.held == 2 and all(
                    h.meta.get("task_id") for h in status.holders)
        for lease in leases:
            lease.release()
        if point == "pulling":
            assert wait_until(lambda: len(cluster.probe.completed("guarded:k")) >= 5)
        elif point == "granted-not-started":
            assert wait_until(granted_to_parked, timeout=10)
            assert not cluster.probe.intervals()  # granted, never started
        worker.kill()
        killed_at = time.monotonic_ns()
        if point == "parking":  # it was: the rest are still in the task queue
            assert _parked(cluster, "images") < tasks - 3
        elif point == "pulling":
            assert _parked(cluster, "images") > 0
        # Tasks that a pool process accepted before the kill were acked by Celery then (acks_late
        # off): one killed before its body began (as k0 was once, its body's first mark not yet
        # written), mid-body, or before its result was stored, is Celery's own at-most-once,
        # not the waiting room's. Every other task must run.
        started = set(cluster.probe.intervals()) | {key for _, key, _, _ in accepted.events()}
        spare = Worker(cluster.env, f"{name}-spare", 4)
        spare.wait_ready()
        cluster.workers.append(spare)
        for i, result in enumerate(results):
            if f"guarded:k{i}" not in started:
                result.get(timeout=90)
        assert set(cluster.probe.completed("guarded:k")) | started == keys
        assert cluster.probe.max_concurrent("guarded:k", killed_at) <= 2
        assert cluster.probe.run_twice_at_once("guarded:k", killed_at) == []
        assert wait_until(lambda: _parked(cluster, "images") == 0)
    finally:
        for lease in leases:
            lease.release()
        cluster.stop()


def test_a_worker_started_after_the_backlog_was_parked_drains_it(redis_url, tmp_path):
    """The only worker stops with a backlog it parked; a new worker, which never received one
    of those tasks and hears no broadcast, finds the parking queue from the backend's
    semaphore names at start and drains it."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, names="before",
                      CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 2,
                                              "semaphore_park_on_send": False}))
    try:
        guarded = cluster.task("guarded")
        long = [guarded.delay(f"long{i}", 2) for i in range(2)]
        assert wait_until(lambda: all(cluster.started(f"guarded:long{i}") for i in range(2)))
        results = [guarded.delay(f"d{i}", 0.02) for i in range(20)]
        assert wait_until(lambda: _parked(cluster, "images") == 20 - 2, timeout=20)
        cluster.workers[0].stop()  # warm: the running two finish; the two waiting go back
        assert [r.get(timeout=5) for r in long] == ["long0", "long1"]
        assert _parked(cluster, "images") == 20 - 2
        # Nothing pulled after the consumer stopped took a slot it would keep for a lease TTL.
        assert cluster.held("images") == 0
        assert "Traceback" not in cluster.workers[0].output()
        after = Worker(cluster.env, "after", 4)
        after.wait_ready()
        cluster.workers.append(after)
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"d{i}" for i in range(20))
        assert all(n == 1 for n in cluster.probe.completed("guarded:d").values())
        assert cluster.probe.max_concurrent("guarded:") <= 2
        assert wait_until(lambda: _parked(cluster, "images") == 0)
    finally:
        cluster.stop()


def test_a_parked_task_is_revoked_while_parked(redis_url, tmp_path):
    """Parked by the worker, revoked by id or by stamped header while it waits in the parking
    queue: REVOKED at once (not when a worker pulls it), and it never runs."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, names="revoke",
                      CS_SETTINGS=json.dumps({"semaphore_worker_max_waiting": 2,
                                              "semaphore_park_on_send": False}))
    try:
        slow = cluster.task("slow")
        first = slow.delay("r0", 30)
        assert wait_until(lambda: cluster.started("slow:r0"))
        waiting = [slow.delay(f"r{i}", 0.05) for i in range(1, 6)]
        stamped = slow.s("rs", 0.05)
        stamped.stamp(batch="cancel-parked")
        stamped = stamped.apply_async()
        assert wait_until(lambda: _parked(cluster, "slow") == 6 - 2, timeout=20)
        by_id = waiting[-1]
        assert wait_until(lambda: by_id.state == "WAITING" and stamped.state == "WAITING")
        by_id.revoke()
        cluster.app.control.revoke_by_stamped_headers({"batch": "cancel-parked"})
        assert wait_until(lambda: by_id.state == "REVOKED", timeout=5)
        assert wait_until(lambda: stamped.state == "REVOKED", timeout=5)
        first.revoke(terminate=True)
        for result in waiting[:-1]:
            result.get(timeout=30)
        assert wait_until(lambda: _parked(cluster, "slow") == 0)
        assert not cluster.started("slow:r5") and not cluster.started("slow:rs")
        assert by_id.state == "REVOKED" and stamped.state == "REVOKED"
    finally:
        cluster.stop()


def test_semaphore_max_wait_fails_a_parked_task(redis_url, tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, names="maxwait", CS_SETTINGS=json.dumps(
                          {"semaphore_max_wait": 1.0, "semaphore_worker_max_waiting": 1}))
    try:
        slow = cluster.task("slow")
        slow.delay("m0", 6)
        assert wait_until(lambda: cluster.started("slow:m0"))
        late = [slow.delay(f"m{i}", 0.01) for i in range(1, 4)]
        assert wait_until(lambda: _parked(cluster, "slow") >= 1, timeout=10)
        for result in late:
            with pytest.raises(SemaphoreTimeout) as err:
                result.get(timeout=10)
            assert "semaphore_max_wait" in str(err.value)
        assert not any(cluster.started(f"slow:m{i}") for i in range(1, 4))
    finally:
        cluster.stop()


# -- parking on send ------------------------------------------------------------------------


@pytest.mark.parametrize("broker_kind", ["redis", "amqp"])
def test_guarded_sends_go_straight_to_the_waiting_room(broker_kind, redis_url, amqp_url,
                                                       tmp_path):
    """With both slots held elsewhere, guarded tasks wait in their parking queue, never in the
    task queue: unguarded tasks sent after them run at once; each worker pulls only what it
    can start soon; every guarded task is delivered once (no park, no requeue), runs once,
    never more than the limit at once."""
    broker = servers.redis_broker(redis_url) if broker_kind == "redis" else amqp_url
    cluster = Cluster(str(tmp_path), redis_url, broker, redis_url, names="onsend")
    blockers = [Semaphore("images", 2, redis_url, key_prefix=cluster.env["CS_KEY_PREFIX"],
                          ttl=60) for _ in range(2)]
    leases = [b.acquire(timeout=10) for b in blockers]
    try:
        waiting = _waiting_elsewhere(cluster, "images", 2)  # a backlog: sends are parked
        guarded, unguarded = cluster.task("guarded"), cluster.task("unguarded")
        results = [guarded.delay(f"s{i}", 0.02) for i in range(60)]
        free = [unguarded.delay(f"s{i}") for i in range(5)]
        assert [r.get(timeout=20) for r in free] == [f"s{i}" for i in range(5)]
        # two workers x 4 processes hold at most 2 x 8 waiting; the rest stays parked
        assert wait_until(lambda: 60 - 16 <= _parked(cluster, "images") < 60, timeout=10)
        assert not any(cluster.started(f"guarded:s{i}") for i in range(60))
        assert run_cli(cluster.env, "status", "images", "--json").returncode == 0
        for lease in leases:
            lease.release()
        waiting.join(30)
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"s{i}" for i in range(60))
        assert cluster.probe.max_concurrent("guarded:s") == 2
        assert all(n == 1 for n in cluster.probe.completed("guarded:s").values())
        logs = "".join(worker.output() for worker in cluster.workers)
        assert "requeueing" not in logs
        # one delivery each, so nothing was parked by a worker; doorbells log nothing
        assert logs.count(" received") == 60 + 5
        assert wait_until(lambda: _parked(cluster, "images") == 0)
        # released by the worker's main process once the pool reports the end, which may
        # come after the result is stored
        assert wait_until(lambda: cluster.held("images") == 0)
    finally:
        for lease in leases:
            lease.release()
        cluster.stop()


def test_tasks_parked_on_send_while_no_worker_runs_are_found_by_their_doorbell(redis_url,
                                                                               tmp_path):
    """Sent while no worker runs and the semaphore has a backlog: the doorbell waits in the
    task queue, and the first worker to start takes it, pulls and runs every task (no worker
    looks for parking queues any other way)."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=0)
    blocker = Semaphore("api:77", 1, redis_url, key_prefix=cluster.env["CS_KEY_PREFIX"], ttl=60)
    lease = blocker.acquire(timeout=10)
    try:
        waiting = _waiting_elsewhere(cluster, "api:77", 1)
        per_customer = cluster.task("per_customer")
        results = [per_customer.delay(77, f"n{i}", 0.01) for i in range(12)]
        # (the first send of a key this process has not sent goes the plain way, unasked:
        # waiting_room.UNKNOWN_AFTER; the late worker parks it or runs it)
        assert _parked(cluster, "api:77") == 11
        lease.release()
        waiting.join(30)
        worker = Worker(cluster.env, "late", 2)
        worker.wait_ready()
        cluster.workers.append(worker)
        assert sorted(r.get(timeout=30) for r in results) == sorted(f"n{i}" for i in range(12))
        assert cluster.probe.max_concurrent("customer-77:") == 1
        assert wait_until(lambda: _parked(cluster, "api:77") == 0)
    finally:
        cluster.stop()


def test_a_pulled_task_celery_requeues_is_pulled_again(redis_url, tmp_path):
    """A task parked on send, pulled and then rejected with requeue (``Reject(requeue=True)``)
    goes back to its parking queue, which its worker had found empty and forgotten: the worker
    learns it again and the task runs (before: it waited for the next send of its semaphore)."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, names="requeued")
    try:
        result = cluster.task("rejects_once").delay("r1")
        assert result.get(timeout=20) == "r1"
        assert cluster.probe.completed("rejecting:r1") == {"rejecting:r1": 2}
        assert wait_until(lambda: _parked(cluster, "rejecting") == 0)
    finally:
        cluster.stop()
