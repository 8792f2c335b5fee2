"""A waiting task shows WAITING in a real Flower, then STARTED and SUCCESS."""

import os
import subprocess
import sys
import time

import pytest
import requests

from tests import servers
from tests.servers import free_port
from tests.test_worker import Cluster
from tests.util import wait_until
from tests.workers import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture
def flower_cluster(redis_url, tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url),
                      f"sqlite:///{tmp_path}/sem.db", workers=1)
    port = free_port()
    env = dict(cluster.env, FLOWER_UNAUTHENTICATED_API="true")
    log = open(tmp_path / "flower.log", "wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "flower",
         f"--port={port}", "--address=127.0.0.1"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _get(f"{base}/api/workers") is not None, timeout=30), \
            (tmp_path / "flower.log").read_text()
        yield cluster, base
    finally:
        flower.terminate()
        flower.wait(10)
        cluster.stop()


def _get(url):
    try:
        response = requests.get(url, timeout=2)
    except requests.RequestException:
        return None
    return response.json() if response.ok else None


def test_waiting_state_in_flower(flower_cluster):
    cluster, base = flower_cluster
    slow = cluster.task("slow")
    # Flower enables events on the worker; give it a moment to subscribe.
    time.sleep(1.0)
    first = slow.delay("fl0", 2.0)
    assert wait_until(lambda: cluster.started("slow:fl0"), timeout=10)
    waiter = slow.delay("fl1", 1.0)
    seen = []

    def state_of(task_id):
        info = _get(f"{base}/api/task/info/{task_id}")
        state = info and info.get("state")
        if state and (not seen or seen[-1] != state):
            seen.append(state)
        return state

    assert wait_until(lambda: state_of(waiter.id) == "WAITING", timeout=10, interval=0.05), seen
    info = _get(f"{base}/api/task/info/{waiter.id}")
    # the result backend too (stored by the gate's I/O thread after the event is sent)
    assert wait_until(lambda: waiter.state == "WAITING", timeout=5), waiter.state
    assert waiter.info.get("semaphore") == "slow"
    first.get(timeout=10)
    assert wait_until(lambda: state_of(waiter.id) == "SUCCESS", timeout=15, interval=0.02), seen
    assert seen.index("WAITING") < seen.index("SUCCESS")
    # STARTED replaced WAITING while the body ran (it ran for a second).
    assert "STARTED" in seen and seen.index("WAITING") < seen.index("STARTED"), seen
    assert info["name"] == "tests.celery_app.slow"
    assert os.path.exists(cluster.env["CS_PROBE"])
