"""The traffic rules (costs, priorities, rates, fair-share weights) over every backend.

Concurrency and rates are checked by external probes (shared-memory counters and start times
taken by the contenders), never by the library's bookkeeping. RabbitMQ's backends refuse costs
and rates (they cannot apply them atomically): they must say so, naming the backend.
"""

import random
import threading
import time

import pytest

from celery_semaphore import ConfigurationError
from tests.test_contract import FORK, start_waiter
from tests.util import wait_until

REFUSE_COST_AND_RATE = ("amqp", "amqp+slots")


class UnitProbe:
    """Units held right now, as the holders say (shared memory); the highest seen."""

    def __init__(self):
        self.lock = FORK.Lock()
        self.current = FORK.Value("i", 0, lock=False)
        self.highest = FORK.Value("i", 0, lock=False)

    def add(self, units):
        with self.lock:
            self.current.value += units
            self.highest.value = max(self.highest.value, self.current.value)


def admission_order(holder, results, count):
    """Release ``holder``, then each waiter as soon as it is admitted: the waiters' keys in
    the order they were admitted (``results`` filled by :func:`start_waiter`)."""
    order = []
    current = holder
    for _ in range(count):
        current.release()
        assert wait_until(lambda n=len(order): len(results) > n)
        key, current, _ = results[len(order)]
        order.append(key)
    current.release()
    return order


def _refused(spec, **acquire):
    sem = spec.semaphore("refused", 4, rate=acquire.pop("rate", None))
    with pytest.raises(ConfigurationError, match="Backend .*cannot apply"):
        sem.acquire(timeout=5, **acquire)
    assert sem.status().held == 0 and sem.status().waiting == 0


def test_cost_storm_units_held_never_exceed_the_limit(spec):
    """Contenders of cost 1, 2 or 4 on a limit-8 semaphore: the probe's units never pass 8,
    and reach at least 6 (tasks do run side by side)."""
    if spec.kind in REFUSE_COST_AND_RATE:
        return _refused(spec, cost=2)
    limit, workers, rounds = 8, 12, 4
    probe = UnitProbe()
    errors = FORK.Value("i", 0)

    def contender(seed):
        rng = random.Random(seed)
        sem = spec.semaphore("units", limit, ttl=30, poll_interval=0.5)
        try:
            for _ in range(rounds):
                cost = rng.choice((1, 2, 4))
                with sem.acquire(timeout=60, cost=cost):
                    probe.add(cost)
                    time.sleep(0.02)
                    probe.add(-cost)
        except Exception:
            with errors.get_lock():
                errors.value += 1
            raise

    kind = FORK.Process if spec.multiprocess else threading.Thread
    runners = [kind(target=contender, args=(i,)) for i in range(workers)]
    for r in runners:
        r.start()
    for r in runners:
        r.join(120)
    assert not any(r.is_alive() for r in runners)
    assert errors.value == 0
    assert probe.current.value == 0
    assert 6 <= probe.highest.value <= limit, probe.highest.value
    status = spec.semaphore("units", limit).status()
    assert status.held == 0 and status.waiting == 0 and status.units == 0


def test_a_big_waiter_blocks_those_behind_it_and_is_woken_when_its_units_free(spec):
    """FIFO with costs: a cost-3 waiter that finds 1 unit free keeps a cost-1 newcomer out
    (no starvation of big tasks); a release that frees its units wakes it at once (poll
    interval 10 s), then the one behind it fits too."""
    if spec.kind in REFUSE_COST_AND_RATE:
        return _refused(spec, cost=3)
    sem = spec.semaphore("bigfirst", 4, poll_interval=10)
    first = sem.acquire(cost=3)
    assert sem.status().units == 3
    results = []
    start_waiter(sem, results, "big", timeout=30, cost=3)
    assert wait_until(lambda: sem.status().waiting == 1)
    assert sem.try_acquire(cost=1) is None  # one unit is free, but "big" is ahead
    start_waiter(sem, results, "small", timeout=30)
    assert wait_until(lambda: sem.status().waiting == 2)
    assert [w.meta.get("cost", 1) for w in sem.status().waiters] == [3, 1]
    released_at = time.monotonic()
    first.release()
    assert wait_until(lambda: len(results) == 2, timeout=5)
    # (once both fit, either may take its units first: "small" counts "big"'s as taken)
    assert min(at for _, _, at in results) - released_at < 2.0  # woken, not polled
    status = sem.status()
    assert status.units == 4 and status.held == 2
    for _, lease, _ in results:
        lease.release()
    assert sem.status().units == 0


def test_a_cost_above_the_limit_is_refused_and_changes_nothing(spec):
    sem = spec.semaphore("toobig", 4)
    with pytest.raises(ConfigurationError, match="cost 5 is above the limit"):
        sem.acquire(timeout=1, cost=5)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ConfigurationError, match="cost"):
            sem.try_acquire(cost=bad)
    if spec.kind in REFUSE_COST_AND_RATE:
        return
    sem.resize(2)  # the stored limit rules: a cost of 3 could never be admitted now
    with pytest.raises(ConfigurationError, match="cost 3 is above the semaphore's limit"):
        sem.acquire(timeout=1, cost=3)
    status = sem.status()
    assert status.held == 0 and status.waiting == 0


def test_priorities_go_first_fifo_among_equals(spec):
    sem = spec.semaphore("prio", 1, poll_interval=5)
    holder = sem.acquire()
    results = []
    arrivals = [("a", 0), ("b", 0), ("c", 5), ("d", 1), ("e", 5), ("f", -2), ("g", 0)]
    for count, (key, priority) in enumerate(arrivals, 1):
        start_waiter(sem, results, key, timeout=30, priority=priority)
        assert wait_until(lambda n=count: sem.status().waiting == n)
    expected = ["c", "e", "d", "a", "b", "g", "f"]
    assert [w.meta.get("priority", 0) for w in sem.status().waiters] == [5, 5, 1, 0, 0, 0, -2]
    assert admission_order(holder, results, len(arrivals)) == expected


def test_fair_weights_share_admissions_in_proportion(spec):
    """gold (weight 3) and silver (weight 1) both waiting: three gold per silver."""
    sem = spec.semaphore("weights", 1, poll_interval=5)
    holder = sem.acquire()
    results = []
    arrivals = [(f"g{i}", "gold", 3) for i in range(1, 7)] + \
        [(f"s{i}", "silver", 1) for i in range(1, 4)]
    for count, (key, tenant, weight) in enumerate(arrivals, 1):
        start_waiter(sem, results, key, timeout=30, fair_key=tenant, fair_weight=weight)
        assert wait_until(lambda n=count: sem.status().waiting == n)
    assert admission_order(holder, results, len(arrivals)) == \
        ["g1", "g2", "g3", "s1", "g4", "g5", "g6", "s2", "s3"]


def test_rate_storm_starts_per_window_never_exceed_the_rate(spec):
    """20 starts/s, burst 1, from contenders that release at once (the limit never binds):
    the starts the contenders saw, in any window of one second (less 100 ms for the reply's
    jitter on a loaded machine), number at most 20; all 36 starts take about 1.75 s (under
    7 s on a slow backend), paced by the rate and not by the 10 s poll interval (each
    held-back waiter tries when its start is due)."""
    if spec.kind in REFUSE_COST_AND_RATE:
        return _refused(spec, rate="20/s")
    total, workers = 36, 6
    starts = FORK.Array("d", total)
    count = FORK.Value("i", 0)

    def contender():
        sem = spec.semaphore("rated", 100, poll_interval=10, rate="20/s")
        while True:
            lease = sem.acquire(timeout=30)
            with count.get_lock():
                n = count.value
                if n < total:
                    starts[n] = time.monotonic()
                count.value += 1
            lease.release()
            if n >= total - 1:
                return

    kind = FORK.Process if spec.multiprocess else threading.Thread
    runners = [kind(target=contender) for _ in range(workers)]
    for r in runners:
        r.start()
    assert wait_until(lambda: count.value >= total, timeout=30)
    for r in runners:
        r.join(30)
    seen = sorted(starts[:total])
    most = max(sum(1 for t in seen if s <= t < s + 0.9) for s in seen)
    assert most <= 20, most
    elapsed = seen[-1] - seen[0]
    assert (total - 1) / 20 - 0.1 <= elapsed < 7, elapsed


def test_the_rate_holds_no_slot_and_says_when_the_next_start_is_due(spec):
    if spec.kind in REFUSE_COST_AND_RATE:
        return _refused(spec, rate="1/m")
    sem = spec.semaphore("slow", 5, rate="1/m")
    first = sem.acquire(timeout=5)
    backend = spec.backend()
    attempt = backend.acquire("slow", "late", limit=5, ttl=30, wait=True,
                              meta={"rate": [60.0, 1]})
    assert attempt.grant is None and attempt.waits_for == "rate"
    assert 50 < attempt.rate_due <= 60
    assert 50 < backend.pause_after(attempt, 1.0) or backend.waiter_ttl / 3 < 50
    status = sem.status()
    assert status.held == 1 and status.waiting == 1  # waits, holds nothing
    assert status.rate == (60.0, 1) and status.next_start > time.time() + 50
    assert sem.try_acquire() is None
    backend.abandon("slow", "late")
    first.release()


# -- real workers ---------------------------------------------------------------------------


def _units_at_once(spans):
    """Most units held at once, from probe spans keyed ``gpu:<key>:<cost>``."""
    points = sorted(point for key, runs in spans.items() for start, end in runs
                    for point in ((start, int(key.rsplit(":", 1)[1])),
                                  (end, -int(key.rsplit(":", 1)[1]))))
    current = best = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


def test_workers_hold_units_not_slots_and_a_bad_cost_fails_its_task_alone(redis_url, tmp_path):
    """Two workers x 4 processes, tasks of cost 1, 2 or 4 on a limit of 8: the probe's units
    never pass 8 and every task runs once; a call whose template fills in a cost of 9 fails
    alone, naming why."""
    from tests import servers
    from tests.test_worker import Cluster

    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url)
    try:
        gpu = cluster.task("gpu")
        rng = random.Random(7)
        costs = [rng.choice((1, 2, 4)) for _ in range(24)]
        results = [gpu.delay(cost, f"t{i}", 0.1) for i, cost in enumerate(costs)]
        bad = gpu.delay(9, "bad")
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"t{i}"
                                                                     for i in range(24))
        with pytest.raises(ConfigurationError, match="above the limit"):
            bad.get(timeout=30)
        spans = cluster.probe.spans("gpu:")
        assert all(len(runs) == 1 for runs in spans.values()) and len(spans) == 24
        assert 5 <= _units_at_once(spans) <= 8
    finally:
        cluster.stop()


def test_workers_keep_a_cluster_wide_rate_and_a_priority_goes_first(redis_url, tmp_path):
    """semaphore_rate="20/s" over two workers (Celery's own rate_limit would be per worker):
    60 starts, at most 20 in any window of 0.8 s (a second, less up to 200 ms of jitter in
    the hand-off to the pool on a loaded machine), taking about 3 s. Then, behind a running
    task, three waiting tasks of priority 0 and one of priority 9 sent last: the priority-9
    task runs next."""
    from tests import servers
    from tests.test_worker import Cluster

    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      workers=2, concurrency=6)
    try:
        paced = cluster.task("paced")
        results = [paced.delay(f"p{i}") for i in range(60)]
        assert sorted(r.get(timeout=60) for r in results) == sorted(f"p{i}" for i in range(60))
        starts = sorted(runs[0][0] / 1e9 for runs in cluster.probe.spans("paced:").values())
        most = max(sum(1 for t in starts if s <= t < s + 0.8) for s in starts)
        assert most <= 20, most
        assert 59 / 20 - 0.3 <= starts[-1] - starts[0] < 20, starts[-1] - starts[0]

        ranked = cluster.task("ranked")
        first = ranked.delay("first", 1.0)
        assert wait_until(lambda: cluster.started("ranked:first"))
        low = [ranked.delay(f"low{i}") for i in range(3)]
        assert wait_until(lambda: cluster.backend.status("ranked").waiting == 3)
        high = ranked.apply_async(("high",), headers={"semaphore_priority": 9})
        assert wait_until(lambda: cluster.backend.status("ranked").waiting == 4)
        # WAITING says what it waits for, and the priority it waits with (once the backend
        # has answered: a request in the worker's line behind a full semaphore is announced
        # WAITING before it asks, with no waits_for yet, and the queue entry the backend
        # counts comes before the worker stores the answer)
        assert wait_until(lambda: high.state == "WAITING" and low[0].state == "WAITING"
                          and (high.info or {}).get("waits_for") == "slots")
        assert high.info["priority"] == 9
        assert "priority" not in low[0].info
        assert [w.meta.get("priority", 0) for w in cluster.backend.status("ranked").waiters] \
            == [9, 0, 0, 0]
        for r in [first, high, *low]:
            r.get(timeout=30)
        order = sorted(cluster.probe.spans("ranked:").items(), key=lambda kv: kv[1][0][0])
        assert [key for key, _ in order][:2] == ["ranked:first", "ranked:high"]
    finally:
        cluster.stop()


def test_redis_scripts_and_model_agree_on_random_traffic(redis_url):
    """The rules are written twice (model.py, the Redis scripts): the same random sequence of
    acquires (costs, priorities, fair keys and weights), releases and cancels gives the same
    grants, the same queue order and the same units on both."""
    from celery_semaphore.backends import get_backend
    from tests import servers

    memory = get_backend(f"memory://{servers.unique_tag()}")
    redis_backend = get_backend(redis_url, key_prefix=f"{servers.unique_tag()}:")
    rng = random.Random(28)
    for round_ in range(6):
        name, holders = f"mix{round_}", []
        for step in range(60):
            op = rng.random()
            if op < 0.6 or not holders:
                holder = f"h{step}"
                meta = {}
                if rng.random() < 0.5:
                    meta["cost"] = rng.choice((2, 3))
                if rng.random() < 0.4:
                    meta["priority"] = rng.choice((-1, 1, 2))
                if round_ % 2 and rng.random() < 0.8:
                    meta["fair_key"] = rng.choice("abc")
                    if rng.random() < 0.5:
                        meta["fair_weight"] = rng.choice((2, 3))
                holders.append((holder, meta))
                answers = [b.acquire(name, holder, limit=5, ttl=60, meta=meta, wait=True)
                           for b in (memory, redis_backend)]
            else:
                holder, meta = rng.choice(holders)
                verb = rng.choice(("release", "cancel", "retry"))
                for b in (memory, redis_backend):
                    if verb == "retry":
                        b.acquire(name, holder, limit=5, ttl=60, meta=meta, wait=True)
                    else:
                        getattr(b, verb)(name, holder)
                answers = None
            if answers:
                assert [a.grant is not None for a in answers] == [answers[0].grant is not None] * 2
                assert answers[0].position == answers[1].position, (round_, step)
            mine, theirs = memory.status(name), redis_backend.status(name)
            assert [w.holder for w in mine.waiters] == [w.holder for w in theirs.waiters], \
                (round_, step)
            assert {h.holder for h in mine.holders} == {h.holder for h in theirs.holders}
            assert mine.units == theirs.units <= 5
        redis_backend.reset(name)


# -- options: where they are written, eager calls ---------------------------------------------


def _app(**conf):
    from celery import Celery

    app = Celery("traffic_test", set_as_current=False)
    app.conf.update({"broker_url": "memory://", **conf})
    return app


@pytest.mark.parametrize("options, problem", [
    ({"limit": 4, "semaphore_cost": 5}, "semaphore_cost 5 is above the limit"),
    ({"limit": 4, "semaphore_cost": 0}, "semaphore_cost must be from 1"),
    ({"limit": 4, "semaphore_cost": "gb"}, "integer or a template"),
    ({"limit": 4, "semaphore_cost": "{}"}, "must name the task's parameters"),
    ({"semaphore_rate": "fast"}, "count per period"),
    ({"semaphore_rate": "0/s"}, "above 0"),
    ({"semaphore_rate": "10/s", "semaphore_burst": 0}, "semaphore_burst must be from 1"),
    ({"semaphore_priority": 1.5}, "semaphore_priority must be an integer"),
    ({"semaphore_priority": 10**6}, "semaphore_priority must be from"),
    ({"semaphore_fair_weights": {"gold": 0}}, "must be from 1"),
    ({"semaphore_fair_weights": ["gold"]}, "must be a dict"),
])
def test_bad_traffic_options_are_refused_where_written(options, problem):
    from celery_semaphore import task

    with pytest.raises(ConfigurationError, match=problem):
        task(semaphore="x", **options)


def test_bad_traffic_headers_are_refused_in_the_caller():
    from celery_semaphore.guards import check_call_headers

    with pytest.raises(ConfigurationError, match="header 'semaphore_cost' 3 is above"):
        check_call_headers({"semaphore_cost": 3, "semaphore_limit": 2})
    with pytest.raises(ConfigurationError, match="header 'semaphore_cost' must be an integer"):
        check_call_headers({"semaphore_cost": "{gb}"})
    with pytest.raises(ConfigurationError, match="header 'semaphore_priority'"):
        check_call_headers({"semaphore_priority": "high"})


def test_rabbitmq_backends_refuse_cost_and_rate_at_worker_start():
    from celery_semaphore.backends.rabbitmq.tokens import TokenBackend

    backend = TokenBackend.__new__(TokenBackend)  # no connection: the check is static
    backend.url = "amqp://guest:secret@127.0.0.1:5672//"
    with pytest.raises(ConfigurationError, match="semaphore_cost, semaphore_rate: the "
                                                 "TokenBackend backend .*cannot apply them"):
        backend.check_traffic(["cost", "rate", "priority"], "task t: ")
    backend.check_traffic(["priority", "fair_weight"])  # orderings of the registry: fine


def test_eager_calls_hold_their_units_priority_and_rate():
    """An eager call holds its cost in units, sends its priority and declares its rate, as a
    worker would; a template cost above the limit fails the call, naming why."""
    from celery_semaphore import current_lease, install
    from celery_semaphore.backends import get_backend
    from tests import servers

    url = f"memory://{servers.unique_tag()}"
    app = _app(semaphore_backend=url, task_always_eager=True)
    install(app)
    backend = get_backend(url, key_prefix="semaphore:")
    seen = []

    @app.task(semaphore="eager-gpu", limit=8, semaphore_cost="{gb}", semaphore_priority=3,
              semaphore_rate="100/s", shared=False)
    def body(gb):
        status = backend.status("eager-gpu")
        (holder,) = status.holders
        assert holder.holder == current_lease().holder
        seen.append((status.units, holder.meta.get("priority"), status.rate))
        return gb

    assert body.delay(5).get() == 5
    assert seen == [(5, 3, (0.01, 1))]
    assert backend.status("eager-gpu").units == 0
    with pytest.raises(ConfigurationError, match="above the limit"):
        body.delay(9).get()


def test_a_set_of_semaphores_holds_the_cost_in_each_and_refuses_one_too_big(spec):
    """Under several semaphores the cost is held in each of them; a cost above any one's
    limit is refused and leaves nothing held or queued in any."""
    from celery_semaphore import acquire_all

    if spec.kind in REFUSE_COST_AND_RATE:
        return _refused(spec, cost=2)
    wide, narrow = spec.semaphore("set-wide", 6), spec.semaphore("set-narrow", 3)
    group = acquire_all([wide, narrow], timeout=5, meta={"cost": 2})
    assert (wide.status().units, narrow.status().units) == (2, 2)
    assert narrow.try_acquire(cost=2) is None  # 2 + 2 > 3
    group.release()
    with pytest.raises(ConfigurationError, match="cost 4 is above"):
        acquire_all([wide, narrow], timeout=1, meta={"cost": 4})
    for sem in (wide, narrow):
        status = sem.status()
        assert status.held == 0 and status.waiting == 0 and status.units == 0
