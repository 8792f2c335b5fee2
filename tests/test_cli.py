"""``celery -A app semaphore ...`` in subprocesses, against real Redis, with real workers."""

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from celery_semaphore import Semaphore
from tests.test_worker import Cluster
from tests.util import wait_until
from tests.workers import ROOT


@pytest.fixture
def cli(redis_url):
    prefix = f"cli{uuid.uuid4().hex[:8]}:"
    env = dict(os.environ, CS_SEMAPHORE_BACKEND=redis_url, CS_KEY_PREFIX=prefix,
               PYTHONPATH=ROOT)

    def run(*args, env_extra=None):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "semaphore", *args],
            cwd=ROOT, env={**env, **(env_extra or {})}, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=60,
        )

    run.prefix, run.url = prefix, redis_url
    return run


def test_resize_creates_then_changes_and_status_lists(cli):
    created = cli("resize", "thumbs", "3", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout) == {"name": "thumbs", "limit": 3, "previous": None,
                                          "created": True}
    changed = cli("resize", "thumbs", "5")
    assert changed.returncode == 0 and "3 -> 5" in changed.stdout
    lease = Semaphore("thumbs", 2, cli.url, key_prefix=cli.prefix).acquire(
        meta={"task_id": "t-42", "worker": "w@h"})
    status = json.loads(cli("status", "thumbs", "--json").stdout)
    assert status["name"] == "thumbs" and status["limit"] == 5 and status["waiting"] == 0
    (holder,) = status["holders"]
    assert holder["holder"] == lease.holder and holder["meta"]["task_id"] == "t-42"
    assert holder["token"] == str(lease.token)
    assert "2" in status["declared"]
    human = cli("status", "thumbs").stdout
    assert "t-42" in human and "limit 5" in human
    listed = json.loads(cli("list", "--json").stdout)
    assert {"name": "thumbs", "limit": 5, "held": 1, "waiting": 0} in listed
    released = cli("release", "thumbs", lease.holder)
    assert released.returncode == 0 and not lease.verify()
    again = cli("release", "thumbs", lease.holder)
    assert again.returncode == 1 and "holds no slot" in again.stderr


def test_reset_needs_confirmation(cli):
    cli("resize", "gone", "2")
    refused = cli("reset", "gone")
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert cli("status", "gone").returncode == 0
    assert cli("reset", "gone", "--yes").returncode == 0
    unknown = cli("status", "gone")
    assert unknown.returncode == 1 and "unknown semaphore" in unknown.stderr


@pytest.mark.parametrize("args", [("resize", "x", "0"), ("resize", "x", "-1"),
                                  ("resize", "x", "abc"), ("status", "bad name"),
                                  ("resize", "x"), ("frobnicate",)])
def test_usage_errors_exit_2_and_change_nothing(cli, args):
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    assert "Usage:" in done.stderr
    assert json.loads(cli("list", "--json").stdout) == []


def test_unreachable_backend_is_one_line(cli):
    done = cli("--backend", "redis://:secret@127.0.0.1:1/0", "list")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0]
    assert "secret" not in done.stderr and "Traceback" not in done.stderr


def test_sync_applies_configured_limits(cli):
    settings = json.dumps({"semaphore_limits": {"reports": 3, "api:{customer_id}": 2}})
    extra = {"CS_SETTINGS": settings}
    cli("resize", "reports", "1")
    dry = cli("sync", "--dry-run", env_extra=extra)
    assert "would set reports: 1 -> 3" in dry.stdout
    assert json.loads(cli("status", "reports", "--json").stdout)["limit"] == 1
    assert cli("sync", env_extra=extra).returncode == 0
    assert json.loads(cli("status", "reports", "--json").stdout)["limit"] == 3


def running_at(probe, prefix, t_ns):
    return sum(1 for key, runs in probe.intervals().items() if key.startswith(prefix)
               for start, end in runs if start <= t_ns and (end is None or end > t_ns))


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_live_resize_under_load(broker, redis_url, amqp_url, tmp_path):
    broker_url = redis_url.rsplit("/", 1)[0] + "/14" if broker == "redis" else amqp_url
    cluster = Cluster(str(tmp_path), broker_url, redis_url)
    env = dict(cluster.env)

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "semaphore", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    try:
        guarded = cluster.task("guarded")  # semaphore "images", limit 2
        results = [guarded.delay(f"r{i}", 0.25) for i in range(100)]
        assert wait_until(lambda: cluster.started("guarded:r3"), timeout=20)
        assert cluster.probe.max_concurrent("guarded:r") == 2
        # The workers list what they hold and what waits.
        listing = json.loads(cli("workers", "--json").stdout)
        assert len(listing) == 2
        assert sum(len(w["held"]) for w in listing.values()) <= 2
        assert sum(len(w["waiting"]) for w in listing.values()) >= 1
        assert cli("resize", "images", "4").returncode == 0
        grown = time.monotonic_ns()
        time.sleep(1.2)
        assert running_at(cluster.probe, "guarded:r", grown + 1_000_000_000) == 4
        assert cli("resize", "images", "1").returncode == 0
        shrunk = time.monotonic_ns()
        results += [guarded.delay(f"s{i}", 0.1) for i in range(8)]  # a backlog after the shrink
        for result in results:
            result.get(timeout=90)
        after = [(s, e) for key, runs in cluster.probe.intervals().items() for s, e in runs
                 if key.startswith("guarded:") and s > shrunk + 1_000_000_000]
        assert after, "nothing ran after the shrink"
        points = sorted([(s, 1) for s, _ in after] + [(e, -1) for _, e in after])
        level = peak = 0
        for _, delta in points:
            level += delta
            peak = max(peak, level)
        assert peak == 1
        assert cluster.probe.max_concurrent("guarded:r") == 4
    finally:
        cluster.stop()


def test_no_app_and_no_backend_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "celery", "semaphore", "list"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no app" in done.stderr
    with_backend = subprocess.run(
        [sys.executable, "-m", "celery", "semaphore", "--backend",
         f"sqlite:///{tmp_path}/s.db", "list", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert with_backend.returncode == 0 and json.loads(with_backend.stdout) == []
