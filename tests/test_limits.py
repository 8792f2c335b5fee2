"""Limits follow the code (backends/base.py, "Limits"): the rule in isolation, the upgrade of
state stored before it, and real workers restarted with a new limit (rolling deploy, pin).

Concurrency under real workers is read from the probe file the task bodies write.
"""

import json
import re

import pytest
import redis

from celery_semaphore import Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.backends.model import State, effective_limit
from tests import servers
from tests.test_worker import Cluster, urls
from tests.util import wait_until
from tests.workers import Worker, run_cli

# -- the rule -----------------------------------------------------------------------------


def test_effective_limit():
    assert effective_limit(4, 8, pinned=False) == 8
    assert effective_limit(4, 8, pinned=True) == 4
    assert effective_limit(4, None, pinned=False) == 4


def test_the_newest_declaration_wins_and_a_pin_holds_it():
    state = State(limit=4)
    state.declare(4, stamp=100.0, now=1000.0)
    state.declare(8, stamp=200.0, now=1001.0)  # a process started later
    assert (state.limit, state.wanted) == (8, 8)
    state.declare(4, stamp=100.0, now=1002.0)  # the old process, still running
    assert state.limit == 8 and state.declared == {4: 1002.0, 8: 1001.0}
    state.declare(6, stamp=5000.0, now=1003.0)  # a clock ahead dates it "now", no later
    assert (state.limit, state.stamp) == (6, 1003.0)
    state.pin(3)
    state.declare(9, stamp=1003.0, now=1004.0)
    assert (state.limit, state.pinned, state.wanted) == (3, True, 9)
    state.unpin()
    assert (state.limit, state.pinned) == (9, False)
    copy = State.loads(state.dumps())
    assert (copy.limit, copy.pinned, copy.wanted, copy.stamp) == (9, False, 9, 1003.0)


def test_state_stored_before_the_rule_keeps_an_operators_resize():
    """A document without ``stamp`` (stored by an older version): its limit is pinned when
    no caller declared it (an operator resized it), and follows the code otherwise."""
    resized = State(limit=8, declared={4: 10.0}).to_dict()
    for key in ("pinned", "wanted", "stamp"):
        del resized[key]
    state = State.from_dict(resized)
    state.declare(4, stamp=50.0, now=60.0)
    assert (state.limit, state.pinned) == (8, True)
    declared = State(limit=4, declared={4: 10.0, 8: 20.0}).to_dict()
    for key in ("pinned", "wanted", "stamp"):
        del declared[key]
    state = State.from_dict(declared)
    state.declare(8, stamp=50.0, now=60.0)
    assert (state.limit, state.pinned) == (8, False)


def test_redis_config_stored_before_the_rule_keeps_an_operators_resize(redis_url):
    prefix = f"{servers.unique_tag()}:"
    backend = get_backend(redis_url, key_prefix=prefix)
    client = redis.Redis.from_url(redis_url)
    # as an older version left them: a limit an operator resized (8, nobody declares it) and
    # one a caller declared (4)
    for name, limit, declared in (("resized", 8, 4), ("kept", 4, 4)):
        config = backend.key_names(name)["config"]
        client.hset(config, mapping={"limit": limit, f"d:{declared}": 1_000_000})
        client.pexpire(config, 60_000)
    assert backend.status("resized").pinned is True
    assert backend.status("kept").pinned is False
    Semaphore("resized", 4, backend).try_acquire().release()
    Semaphore("kept", 6, backend).try_acquire().release()
    resized, kept = backend.status("resized"), backend.status("kept")
    assert (resized.limit, resized.pinned, resized.newest_declared) == (8, True, 4)
    assert (kept.limit, kept.pinned, kept.newest_declared) == (6, False, 6)
    assert backend.unpin("resized") == 4


@pytest.mark.parametrize("bad", ["yesterday", -1, float("nan"), float("inf"), True])
def test_a_bad_declared_at_is_refused_naming_it(bad):
    from celery_semaphore import ConfigurationError

    with pytest.raises(ConfigurationError, match="declared_at must be a time in seconds"):
        Semaphore("x", 1, f"memory://{servers.unique_tag()}", declared_at=bad)


# -- real workers, restarted with a new limit ---------------------------------------------


def burst(cluster, task, label, count=16, **kwargs):
    """Send ``count`` tasks at once and wait for all of them."""
    results = [task.delay(*kwargs.get("args", ()), f"{label}-{i}", 0.3) for i in range(count)]
    for result in results:
        result.get(timeout=90)


def restart(cluster, index, **env):
    """Warm-stop worker ``index`` and start it again with ``env`` on top of the cluster's."""
    old = cluster.workers[index]
    old.stop()
    worker = Worker({**cluster.env, **env}, old.name, concurrency=8)
    worker.wait_ready()
    cluster.workers[index] = worker
    return worker


@pytest.mark.slow
def test_a_rolling_deploy_changes_the_limit_and_a_pin_holds_it(redis_url, amqp_url, tmp_path):
    """Redis broker and backend; the contract suite holds every backend to the same rule
    (test_a_rolling_deploy_never_exceeds_the_larger_limit). This one ran green on the
    RabbitMQ broker with the token backend too (``urls("amqp-tokens", ...)``): left out to
    keep the suite fast."""
    broker, backend = urls("redis-redis", redis_url, amqp_url, str(tmp_path))
    cluster = Cluster(str(tmp_path), redis_url, broker, backend, workers=2, concurrency=8,
                      CS_DEPLOY_LIMIT="4")
    probe = cluster.probe
    plain, keyed = cluster.task("deployed"), cluster.task("deployed_key")
    try:
        burst(cluster, plain, "v1")
        burst(cluster, keyed, "v1", args=("a",))
        assert probe.max_concurrent("deploy:v1-") == 4
        assert probe.max_concurrent("deployk:a:v1-") == 4

        # rolling deploy: one worker runs the new code (limit 8), the other the old (4)
        restart(cluster, 0, CS_DEPLOY_LIMIT="8")
        burst(cluster, plain, "mixed", count=24)
        assert probe.max_concurrent("deploy:mixed-") <= 8
        restart(cluster, 1, CS_DEPLOY_LIMIT="8")
        burst(cluster, plain, "v2", count=24)
        burst(cluster, keyed, "v2", count=24, args=("a",))
        assert probe.max_concurrent("deploy:v2-") == 8  # in force with no manual step
        assert probe.max_concurrent("deployk:a:v2-") == 8  # the template's key too
        assert probe.max_concurrent("deploy:") <= 8  # never more than the larger, all along
        status = cluster.backend.status("deploy")
        assert (status.limit, status.pinned, status.newest_declared) == (8, False, 8)

        # an operator pins 3; a deploy with 6 does not undo it, and the worker says so once
        for name in ("deploy", "deployk:a"):
            pinned = run_cli(cluster.env, "resize", name, "3", "--json")
            assert json.loads(pinned.stdout)["pinned"] is True, pinned.stderr
        worker = restart(cluster, 0, CS_DEPLOY_LIMIT="6")
        warning = (r"WARNING/MainProcess\] celery-semaphore: semaphore 'deploy': limit 3 is "
                   r"pinned \(celery semaphore resize\); this worker declares 6")
        assert wait_until(lambda: re.search(warning, worker.output()), timeout=30)
        burst(cluster, plain, "pinned")
        burst(cluster, keyed, "pinned", args=("a",))
        # the restarted worker declares 6 with its first acquire: on a busy machine the other
        # worker may have pulled a whole burst
        for again in range(5):
            if 6 in cluster.backend.status("deploy").declared:
                break
            burst(cluster, plain, f"pinned-{again}")
        assert probe.max_concurrent("deploy:pinned-") == 3
        assert probe.max_concurrent("deployk:a:pinned-") == 3
        log = worker.output()
        assert len(re.findall(warning, log)) == 1, log[-3000:]
        # a template's key: when a worker first sees it (each worker that ran one), once
        keyed_warning = "semaphore 'deployk:a': limit 3 is pinned"
        counts = [w.output().count(keyed_warning) for w in cluster.workers]
        assert max(counts) == 1, counts
        status = cluster.backend.status("deploy")
        assert (status.limit, status.pinned) == (3, True) and {6, 8} <= set(status.declared)

        # unpinned: the newest declaration (the worker restarted last: 6) is in force
        unpinned = run_cli(cluster.env, "resize", "deploy", "--unpin", "--json")
        assert json.loads(unpinned.stdout)["limit"] == 6, unpinned.stderr
        burst(cluster, plain, "unpinned", count=20)
        assert 3 < probe.max_concurrent("deploy:unpinned-") <= 6
    finally:
        cluster.stop()


# -- what a worker logs (the worker's LimitWatch, in-process on memory://) ------------------


def test_a_worker_warns_once_about_a_pinned_limit_and_tasks_that_disagree(caplog):
    from celery import Celery

    from celery_semaphore.backends.base import Attempt
    from celery_semaphore.guards import Guard
    from celery_semaphore.settings import Settings
    from celery_semaphore.worker.limits import LimitWatch

    backend = get_backend(f"memory://{servers.unique_tag()}")
    app = Celery("limits", set_as_current=False)
    for name, options in (("a", {"semaphore": "shared", "limit": 4}),
                          ("b", {"semaphore": "shared", "limit": 8}),
                          ("c", {"semaphore": "pinned", "limit": 5}),
                          ("d", {"semaphore": "k:{x}", "limit": 5})):
        def body(x=None):
            return x

        app.task(name=name, shared=False, **options)(body)
    backend.resize("pinned", 3)
    backend.resize("k:1", 2)
    watch = LimitWatch(backend)
    with caplog.at_level("INFO", logger="celery_semaphore.worker.limits"):
        watch.at_start(app)
        guard = Guard("k:1", 5, Settings())
        for _ in range(3):  # a template's key: when an attempt first shows the difference
            watch.saw(guard, Attempt(None, 0, None, limit=2))
        watch.saw(Guard("k:2", 5, Settings()), Attempt(None, 0, None, limit=5))  # agrees
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and r.name == "celery_semaphore.worker.limits"]
    assert warnings == [
        "celery-semaphore: semaphore 'shared': tasks declare different limits (4: a; 8: b): "
        "the one that runs last sets the limit in force; declare one limit (e.g. in "
        "semaphore_limits)",
        "celery-semaphore: semaphore 'pinned': limit 3 is pinned (celery semaphore resize); "
        "this worker declares 5, which is not in force until `celery semaphore resize pinned "
        "--unpin`",
        "celery-semaphore: semaphore 'k:1': limit 2 is pinned (celery semaphore resize); this "
        "worker declares 5, which is not in force until `celery semaphore resize k:1 --unpin`",
    ]
