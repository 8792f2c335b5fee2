"""Issue #36 through real ``celery worker`` processes: a Backoff closes its semaphore on every
worker and the call runs again, first, without a Celery retry; quotas in calendar windows; a
cost settled after the call; an adaptive limit learned from the calls. On the Redis and the
PostgreSQL backends (Redis broker); the external probe (the bodies' marks) is the judge."""

import math
import os
import time

import pytest

from tests import servers
from tests.test_worker import Cluster
from tests.util import wait_until

BACKENDS = ["redis", "postgres"]


@pytest.fixture(params=BACKENDS)
def cluster(request, redis_url, tmp_path):
    backend = (redis_url if request.param == "redis"
               else request.getfixturevalue("postgres_url"))
    c = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), backend, workers=2)
    yield c
    c.stop()


def starts(cluster, prefix):
    return sorted(s for key, runs in cluster.probe.intervals().items()
                  if key.startswith(prefix) for s, _ in runs)


def test_a_backoff_closes_the_semaphore_everywhere_and_the_call_runs_again_first(cluster):
    partner = cluster.task("partner")
    first = partner.delay("a", 2.0)
    # the first run raised Backoff(retry_after=2): the semaphore is paused, on the backend
    assert wait_until(lambda: (cluster.backend.status("partner") is not None
                               and cluster.backend.status("partner").paused_until
                               is not None), timeout=20)
    status = cluster.backend.status("partner")
    assert status.pause_reason == "429 from the API"
    later = [partner.delay(key, 0.0) for key in ("b", "c", "d")]  # arrive during the pause

    def shown_paused():  # what Flower and the result backend show of a waiting call
        return next((r.info for r in later if r.state == "WAITING"
                     and (r.info or {}).get("waits_for") == "pause"), None)

    seen = []
    assert wait_until(lambda: seen.append(shown_paused()) or seen[-1], timeout=10)
    assert abs(seen[-1]["waits_until"] - status.paused_until) < 1.0  # (one host's clocks)
    assert first.get(timeout=30) == ["a", 0]  # no Celery retry was used
    assert [r.get(timeout=30) for r in later] == [["b", 0], ["c", 0], ["d", 0]]
    runs = cluster.probe.intervals()
    (_, backed_off_at), (again, _) = runs["api:a"]  # ran twice: before and after the pause
    assert again - backed_off_at >= 1.8e9  # the pause (2 s), less the clocks' slack
    others = sorted(runs[f"api:{key}"][0][0] for key in "bcd")
    assert others[0] >= backed_off_at + 1.8e9  # nobody started while it was closed
    # the call given back went first: admitted with the first pair of the limit of 2 (the
    # other of the pair may start its body a moment earlier, on the other worker)
    assert again <= others[1]
    assert cluster.probe.max_concurrent("api:") <= 2
    for worker in cluster.workers:
        assert " Retry in " not in worker.output()
        # closed by the pool process that raised the Backoff, before the gate heard of it
        # (the gate pauses, and logs it, only when that did not happen)
        assert "paused for" not in worker.output()
    assert first.state == "SUCCESS"


def test_a_call_granted_before_the_pause_and_not_started_does_not_start_during_it(
        redis_url, tmp_path):
    """A worker hands a granted request to its pool even while every process is busy (it
    starts as one frees). When a Backoff closes the semaphore meanwhile, that request gives
    its slot back as its process takes it, and runs after the pause (its pool processes
    share the pause: celery_semaphore.pause_board)."""
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=1, concurrency=2)
    try:
        call = cluster.task("ahead_call")
        release_a, release_b = str(tmp_path / "a.go"), str(tmp_path / "b.go")
        a = call.delay("a", release_a, 3.0)
        b = call.delay("b", release_b)
        assert wait_until(lambda: cluster.started("api:a") and cluster.started("ahead:b"),
                          timeout=20)
        c = call.delay("c", 0.0)  # both processes busy: granted, waits in the pool's queue
        assert wait_until(lambda: cluster.held("ahead") == 3, timeout=20)
        open(release_a, "w").close()  # a ends with Backoff(3): its process takes c
        assert c.get(timeout=30) == "c"
        open(release_b, "w").close()
        assert a.get(timeout=30) == "a" and b.get(timeout=30) == "b"
        runs = cluster.probe.intervals()
        (_, backed_off_at), _ = runs["api:a"]
        (c_started, _), = runs["ahead:c"]
        assert c_started >= backed_off_at + 2.5e9  # not before the pause ran out
    finally:
        cluster.stop()


def test_semaphore_max_wait_bounds_the_whole_wait_of_a_call_given_back(cluster):
    from celery_semaphore import SemaphoreTimeout

    result = cluster.task("partner_short").delay("z", 30.0)
    with pytest.raises(SemaphoreTimeout):
        result.get(timeout=30)
    assert len(cluster.probe.intervals()["api:z"]) == 1  # never ran again
    cluster.backend.resume("partner")


def test_a_quota_allows_so_many_starts_per_calendar_window(cluster):
    """The probe sees a body start, a little after its admission: the sends begin just after
    a window turns, so that no body admitted at a window's end is seen to start in the next
    (the windows are the backend's, 2 s from the epoch)."""
    call = cluster.task("quota_call")
    offset = time.time() - time.monotonic()  # the probe's clock (monotonic) to the wall
    assert wait_until(lambda: time.time() % 2.0 < 0.3, timeout=3.0, interval=0.01)
    results = [call.delay("t", f"k{i}") for i in range(8)]
    assert [r.get(timeout=60) for r in results] == [f"k{i}" for i in range(8)]
    windows = {}
    for start in starts(cluster, "quota-t:"):
        window = math.floor((start / 1e9 + offset) / 2.0)
        windows[window] = windows.get(window, 0) + 1
    assert max(windows.values()) <= 3 and sum(windows.values()) == 8
    assert len(windows) >= 3  # 8 starts at 3 per window take three windows at least


def test_a_cost_settled_after_the_call_frees_its_estimate_for_the_next(cluster):
    call = cluster.task("token_call")
    offset = time.time() - time.monotonic()
    # each estimates 50 of a 100-per-2s quota, and spends 5: the refunds let more start
    results = [call.delay(f"k{i}", 50, 5, 0.2) for i in range(6)]
    assert [r.get(timeout=60) for r in results] == [f"k{i}" for i in range(6)]
    windows = {}
    for start in starts(cluster, "tokens:"):
        window = math.floor((start / 1e9 + offset) / 2.0)
        windows[window] = windows.get(window, 0) + 1
    assert max(windows.values()) >= 3  # on estimates alone, 2 per window at most
    status = cluster.backend.status("tokens")
    assert status is not None and all(q.used <= q.count for q in status.quotas)


def test_an_adaptive_limit_grows_while_calls_succeed_and_falls_on_overload(cluster):
    call = cluster.task("learned")
    results = [call.delay(f"k{i}", False, 0.1) for i in range(40)]
    assert [r.get(timeout=120) for r in results] == [f"k{i}" for i in range(40)]
    grown = cluster.backend.status("learned").adaptive
    assert grown is not None and grown.current > 1.5  # learned from the successes
    assert cluster.probe.max_concurrent("learned:") >= 2
    assert call.delay("over", True, 0.01).get(timeout=60) == "over"  # backed off once
    assert wait_until(lambda: cluster.backend.status("learned").adaptive.current
                      < grown.current, timeout=10)
    assert os.path.exists(os.path.join(os.path.dirname(cluster.probe.path), "backed-off-over"))
