"""The limit cannot be lost by accident: a worker that was never told to install the gate,
a broker the default backend cannot follow, the states a waiting task reports, the start-up
line. Real ``celery worker`` subprocesses; concurrency is read from the probe."""

import json

import pytest

from tests import servers
from tests.plain_app import create_app
from tests.probe import Probe
from tests.test_worker import RESULTS_DB, Cluster
from tests.util import wait_until
from tests.workers import Worker, cluster_env

pytestmark = pytest.mark.slow


def test_a_worker_guards_tasks_of_an_app_that_never_called_install(redis_url, tmp_path):
    """``celery -A tests.plain_app worker``: the app module never imports celery_semaphore;
    the ``celery`` command loads it through its entry point, and the worker installs the
    gate before its consumer is built (before: four ran at once, with no warning)."""
    env = cluster_env(str(tmp_path), servers.redis_broker(redis_url), redis_url,
                      servers.redis_db(redis_url, RESULTS_DB))
    worker = Worker(env, "plain", 4, app="tests.plain_app")
    try:
        worker.wait_ready()
        app = create_app(env)
        results = [app.send_task("tests.plain_app.solo", args=(f"s{i}",)) for i in range(4)]
        assert [r.get(timeout=30) for r in results] == [f"s{i}" for i in range(4)]
        assert Probe(env["CS_PROBE"]).max_concurrent("solo:") == 1
        assert "did not call celery_semaphore.install(app)" in worker.output()
    finally:
        worker.stop()


def test_a_shared_broker_without_semaphore_backend_stops_the_worker(tmp_path):
    """A Redis Sentinel broker is shared between hosts: the worker must not fall back to an
    SQLite file, which would give each host its own limit."""
    env = cluster_env(str(tmp_path), "sentinel://127.0.0.1:1", None, "")
    worker = Worker(env, "perhost", 1)
    assert worker.proc.wait(30) != 0
    assert "semaphore_backend is not set" in worker.output()


def test_the_worker_says_the_gate_is_on_and_a_task_that_waited_reports_started(redis_url,
                                                                               tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, CS_SETTINGS=json.dumps({"task_track_started": False}))
    try:
        output = cluster.workers[0].output()
        line = next(line for line in output.splitlines() if "gate on" in line)
        assert "INFO" in line and "RedisBackend redis://" in line
        assert "tests.celery_app.guarded (semaphore 'images', limit 2)" in line
        assert "tests.celery_app.per_customer (template 'api:{customer_id}', limit 1)" in line
        slow = cluster.task("slow")
        first = slow.delay("t0", 1.0)
        assert wait_until(lambda: cluster.started("slow:t0"))
        second = slow.delay("t1", 1.5)
        assert wait_until(lambda: second.state == "WAITING", timeout=5)
        assert wait_until(lambda: cluster.started("slow:t1"), timeout=10)
        assert wait_until(lambda: second.state == "STARTED", timeout=5)
        assert first.get(timeout=10) == "t0" and second.get(timeout=10) == "t1"
        assert second.state == "SUCCESS"
    finally:
        cluster.stop()
