"""The per-semaphore counters and histograms every backend keeps (celery_semaphore.stats):
each counted in the same atomic step as the operation it counts, exactly."""

import time

import pytest

from celery_semaphore.stats import BUCKETS, Histogram, SemaphoreStats, bucket_of
from tests.util import wait_until


def test_counters_and_histograms_follow_the_operations(spec):
    backend = spec.backend()
    first = backend.acquire("c", "t1:a", limit=1, ttl=0.5, wait=True,
                            meta={"first_wait": time.time() - 2.0})
    assert first.grant is not None
    assert backend.acquire("c", "t2:a", limit=1, ttl=30, meta={}, wait=True).grant is None
    stats = backend.status("c").stats
    assert stats["acquired"] == 1 and stats.wait.count == 1
    assert 1.9 < stats.wait.total < 3.0  # from the caller's first wait, not from the call
    # the lease expires; its reclaim is counted (status counts one not yet pruned too)
    assert wait_until(lambda: backend.status("c").stats["expired"] == 1, timeout=10)
    assert backend.renew("c", "t1:a", 5) is None  # a renewal that finds its lease gone
    granted = backend.acquire("c", "t2:a", limit=1, ttl=30, meta={}, wait=True)
    assert granted.grant is not None
    time.sleep(0.06)  # sleep-ok: a hold time for the histogram, not a wait for anything
    assert backend.release("c", "t2:a") is True
    assert backend.release("c", "t2:a") is False  # counted once
    backend.count("c", {"parked_send": 3, "requeued": 2, "parked_worker": 1,
                        "acquired": 100})  # not a worker-side counter: ignored
    stats = backend.status("c").stats
    assert {k: stats[k] for k in ("acquired", "expired", "lost", "requeued", "parked_worker",
                                  "parked_send")} == {
        "acquired": 2, "expired": 1, "lost": 1, "requeued": 2, "parked_worker": 1,
        "parked_send": 3}
    assert stats.wait.count == 2 and stats.hold.count == 1  # the expired lease: no hold
    assert 0.05 < stats.hold.total < 5.0
    # the second grant waited from its entry in the queue (no first_wait given)
    assert stats.wait.total - 2.0 > 0.3
    assert backend.statuses(["c", "never-made"]).keys() == {"c"}
    assert backend.statuses(["c"])["c"].stats == stats
    backend.count("never-made", {"parked_send": 1})  # an unknown semaphore: nothing made
    assert backend.status("never-made") is None
    backend.reset("c")  # the counters go with the state
    backend.resize("c", 1)
    assert backend.status("c").stats["acquired"] == 0


def test_histogram_arithmetic_and_quantiles():
    assert bucket_of(0.0) == 0 and bucket_of(BUCKETS[0]) == 0
    assert bucket_of(BUCKETS[-1] + 1) == len(BUCKETS)
    # acquired is the wait histogram's count (a stored one, as earlier releases kept, is not)
    fields = {"wait:3": 10, "wait_sum": 400_000, "hold:7": 1, "acquired": "11"}
    stats = SemaphoreStats.from_fields(fields)
    assert stats["acquired"] == 10 and stats.wait.count == 10 and stats.wait.total == 0.4
    # ten observations in (0.025, 0.05]: the median interpolates to the middle of it
    assert stats.wait.quantile(0.5) == pytest.approx(0.0375)
    assert stats.wait.cumulative()[-1] == ("+Inf", 10)
    assert (stats + stats)["acquired"] == 20
    later = Histogram(tuple(n + (2 if i == 0 else 0) for i, n in enumerate(stats.wait.buckets)),
                      stats.wait.total + 0.001)
    assert (later - stats.wait).count == 2 and (later - stats.wait).quantile(1.0) == BUCKETS[0]
    assert Histogram().quantile(0.99) is None
