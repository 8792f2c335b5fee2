"""Per-task policies on real prefork workers: what a request does when its semaphore is full
(``semaphore_on_full``), fair shares between tenants (``semaphore_fair_by``).

Concurrency and runs are read from the probe file the task bodies write, never from the
library.
"""

import pytest
from celery.exceptions import TaskRevokedError

from celery_semaphore import Semaphore, SemaphoreFull
from tests import servers
from tests.test_worker import Cluster
from tests.util import wait_until
from tests.workers import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    tmp_dir = str(tmp_path_factory.mktemp("policies"))
    cluster = Cluster(tmp_dir, redis_url, servers.redis_broker(redis_url), redis_url,
                      names="policies")
    yield cluster
    cluster.stop()


def _blocker(cluster, name, limit=1):
    return Semaphore(name, limit, cluster.backend.url,
                     key_prefix=cluster.env["CS_KEY_PREFIX"], ttl=60).acquire(timeout=10)


def test_skip_does_not_run_a_task_whose_semaphore_is_full(cluster):
    """Skipped: not run, acked, REVOKED with a reason saying why (so ``get`` raises at once),
    a log line; once the slot is free the same task runs."""
    run_once = cluster.task("run_once")
    lease = _blocker(cluster, "once:held")
    try:
        skipped = [run_once.delay("held", i) for i in range(3)]
        for result in skipped:
            with pytest.raises(TaskRevokedError, match="skipped: semaphore 'once:held' is full"):
                result.get(timeout=20)
        assert not cluster.probe.completed("once:held")
        logs = "".join(worker.output() for worker in cluster.workers)
        assert logs.count("skipped: semaphore 'once:held' is full") == 3
    finally:
        lease.release()
    assert run_once.delay("held", "after").get(timeout=20) == "after"
    assert cluster.probe.completed("once:held") == {"once:held:after": 1}
    assert wait_until(lambda: cluster.backend.status("once:held").waiting == 0)


def test_skip_with_limit_1_runs_once_at_a_time(cluster):
    """The celery-once recipe: of five sends at once, one runs and four are skipped."""
    run_once = cluster.task("run_once")
    results = [run_once.delay("burst", i, 2.0) for i in range(5)]
    outcomes = []
    for result in results:
        try:
            outcomes.append(result.get(timeout=30))
        except TaskRevokedError:
            outcomes.append("skipped")
    assert outcomes.count("skipped") == 4, outcomes
    assert sum(cluster.probe.completed("once:burst:").values()) == 1
    assert cluster.probe.max_concurrent("once:burst:") == 1
    assert wait_until(lambda: cluster.held("once:burst") == 0)


def test_fail_raises_semaphore_full(cluster):
    strict = cluster.task("strict")
    lease = _blocker(cluster, "strict")
    try:
        with pytest.raises(SemaphoreFull, match="semaphore_on_full='fail'"):
            strict.delay("f0").get(timeout=20)
        assert not cluster.started("strict:f0")
    finally:
        lease.release()
    assert strict.delay("f1").get(timeout=20) == "f1"


def test_fair_shares_serve_tenants_in_turn_behind_a_backlog(cluster):
    """A backlog of one tenant parked on send, then two small tenants: with
    ``semaphore_fair_by`` the small ones are served in turn with the big one (FIFO would run
    them after all of it); never more than the limit at once."""
    fair = cluster.task("fair_tenant")
    # 40 of the big tenant: the workers hold some of them (their share of waiters) before the
    # small ones arrive, and those run first; the rest is the margin fair shares must keep
    results = [fair.delay("big", f"b{i}") for i in range(40)]
    results += [fair.delay(tenant, f"{tenant}{i}") for i in range(5) for tenant in "xy"]
    for result in results:
        result.get(timeout=60)
    starts = sorted((runs[0][0], key) for key, runs in cluster.probe.intervals().items()
                    if key.startswith("fair:"))
    assert len(starts) == 50
    assert cluster.probe.max_concurrent("fair:") == 1
    last_small = max(i for i, (_, key) in enumerate(starts) if not key.startswith("fair:big"))
    big_after = sum(1 for _, key in starts[last_small:] if key.startswith("fair:big"))
    assert big_after >= 8, [key for _, key in starts]


def test_several_semaphores_a_global_cap_plus_a_per_tenant_limit(cluster):
    """``semaphore=["saas", "saas:{customer_id}"]``, limits 3 and 1: by the probe, never more
    than 3 tenants' tasks at once and never two of one tenant; a request whose tenant is busy
    waits in that tenant's queue holding no global slot, so other tenants run meanwhile; the
    task sees a lease (own fencing token) per semaphore, under one holder id."""
    tenant_call = cluster.task("tenant_call")
    busy = _blocker(cluster, "saas:9")
    blocked = tenant_call.delay(9, "w", 0.05)
    assert wait_until(lambda: cluster.backend.status("saas:9").waiting == 1, timeout=15)
    status = cluster.backend.status("saas")
    assert status is None or (status.held == 0 and status.waiting == 0)
    assert wait_until(lambda: blocked.state == "WAITING", timeout=5)
    assert blocked.info["semaphore"] == "saas:9"
    assert blocked.info["semaphores"] == ["saas", "saas:9"]
    listing = run_cli(cluster.env, "workers", "--timeout", "1")
    assert "saas:9 (+saas)" in listing.stdout, listing.stdout + listing.stderr

    sent = [(c, tenant_call.delay(c, f"k{i}", 0.2)) for i in range(4) for c in (1, 2, 3, 4)]
    infos = [(c, result.get(timeout=60)) for c, result in sent]
    assert not cluster.started("tenant:9:w")  # its tenant stayed busy all along
    busy.release()
    info = blocked.get(timeout=20)
    assert set(info) == {"saas", "saas:9"}
    assert all(lease["verified"] for lease in info.values())
    assert len({lease["holder"] for lease in info.values()}) == 1
    assert info["saas"]["limit"] == 3 and info["saas:9"]["limit"] == 1
    for customer, one in infos:
        assert set(one) == {"saas", f"saas:{customer}"}
    assert cluster.probe.max_concurrent("tenant:") == 3  # the global cap, reached
    for customer in (1, 2, 3, 4):
        assert cluster.probe.max_concurrent(f"tenant:{customer}:") == 1
    assert all(n == 1 for n in cluster.probe.completed("tenant:").values())
    assert len(cluster.probe.completed("tenant:")) == 17
    assert wait_until(lambda: cluster.held("saas") == 0 and cluster.held("saas:9") == 0)
