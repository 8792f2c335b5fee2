"""The backend contract of issue #36 (backends/base.py: "Pauses", "Quotas", "Units",
"Settling", "Rate" with several rates, "Front of the queue", "Adaptive limits") over every
backend: Redis (every deployment), PostgreSQL, SQLite and memory apply it; RabbitMQ's two
backends and Consul refuse it, naming themselves.

Time is the backend's: a test that needs a quota window to turn waits for the window the
backend reports (``status().quotas``) to change, and never asserts that something did not
happen after a sleep. A window that must not turn during a test is put half an hour away
(an hourly window with an offset).
"""

import math
import threading
import time

import pytest

from celery_semaphore import ConfigurationError
from celery_semaphore.backends.base import (
    Pause,
    Release,
    Resume,
    Settle,
    window_of,
)
from tests.test_contract import start_waiter
from tests.util import wait_until

#: Backends that refuse quotas, units, adaptive limits and pauses (and settle).
REFUSE = ("amqp", "amqp+slots", "consul")


def far_hour():
    """A quota period and offset whose window turns half an hour from now (an hour's window,
    shifted): a test using it never sees it turn."""
    return 3600.0, 1800.0 - time.time() % 3600.0


def refused(spec, **meta):
    """A refusing backend says so, naming itself, for an acquire asking ``meta`` and for
    every pause operation; nothing is held or queued."""
    backend = spec.backend()
    with pytest.raises(ConfigurationError, match=r"Backend .*cannot"):
        backend.acquire("refused", "r:1", limit=4, ttl=30, meta=meta, wait=True)
    for operation in (lambda: backend.pause("refused", 10, "429"),
                      lambda: backend.resume("refused"),
                      lambda: backend.settle("refused", "r:1", 3),
                      lambda: backend.perform(Pause("refused", 10.0))):
        with pytest.raises(ConfigurationError, match=type(backend).__name__):
            operation()
    status = backend.status("refused")
    assert status is None or (status.held == 0 and status.waiting == 0)


def next_window(backend, name, index=0, timeout=15.0, after=None):
    """Wait until the backend's clock enters a new window of quota ``index`` of ``name`` (as
    its status reports it), one that starts after ``after`` (default: the current one's
    start); return the new window's status."""
    start = backend.status(name).quotas[index].window_start if after is None else after
    assert wait_until(lambda: backend.status(name).quotas[index].window_start > start,
                      timeout=timeout, interval=0.005), "the quota window never turned"
    return backend.status(name).quotas[index]


# -- pauses -------------------------------------------------------------------------------


def test_a_pause_closes_admission_extends_only_and_resume_reopens(spec):
    if spec.kind in REFUSE:
        return refused(spec, units=2)
    backend = spec.backend()
    sem = spec.semaphore("paused", 2)
    held = sem.acquire(timeout=5)
    until = backend.pause("paused", 30, "429 from the API")
    assert 25 < until - time.time() < 35
    status = backend.status("paused")
    assert status.paused_until == pytest.approx(until)
    assert status.pause_reason == "429 from the API"
    assert status.as_dict()["paused_until"] == pytest.approx(until)
    # a slot is free, but nobody starts; a waiter queues and is told when to try
    assert sem.try_acquire() is None
    attempt = backend.acquire("paused", "w:1", limit=2, ttl=30, meta={}, wait=True)
    assert attempt.grant is None and attempt.waits_for == "pause" and attempt.position == 0
    assert 25 < attempt.due <= 30 and attempt.rate_due is None
    assert backend.pause_after(attempt, 60.0) == pytest.approx(backend.waiter_ttl / 3)
    # the holder keeps its slot and renews
    assert held.renew() and held.verify()
    # pauses only extend: a shorter one changes nothing, its reason included
    assert backend.pause("paused", 5, "shorter") == pytest.approx(until)
    assert backend.status("paused").pause_reason == "429 from the API"
    longer = backend.pause("paused", 60, "longer")
    assert longer > until + 20 and backend.status("paused").pause_reason == "longer"
    # a release while paused admits nobody: the waiter, trying again, still waits
    assert held.release()
    again = backend.acquire("paused", "w:1", limit=2, ttl=30, meta={}, wait=True)
    assert again.waits_for == "pause" and again.position == 0
    assert backend.status("paused").held == 0
    # several semaphores at once: the paused one blocks
    blocked = backend.acquire_all([("open", 2), ("paused", 2)], "both:1", ttl=30, meta={},
                                  wait=False)
    assert blocked.grants is None and blocked.blocking == "paused"
    assert blocked.waits_for == "pause" and blocked.due > 50
    assert backend.resume("paused") is True
    assert backend.resume("paused") is False
    status = backend.status("paused")
    assert status.paused_until is None and status.pause_reason == ""
    assert backend.acquire("paused", "w:1", limit=2, ttl=30, meta={}, wait=True).grant
    backend.release("paused", "w:1")


def test_a_resume_wakes_the_waiters_a_pause_held(spec):
    """A waiter the pause holds is woken by the resume (poll interval 10 s): it starts well
    before its next try was due."""
    if spec.kind in REFUSE:
        return refused(spec, quota=[[10, 60.0, 0.0]])
    backend = spec.backend()
    sem = spec.semaphore("woken", 1, poll_interval=10, waiter_ttl=60)
    backend.pause("woken", 120, "maintenance")
    results = []
    start_waiter(sem, results, "w", timeout=60)
    assert wait_until(lambda: sem.status().waiting == 1)
    resumed_at = time.monotonic()
    assert backend.perform(Resume("woken")) is True
    assert wait_until(lambda: results, timeout=8)
    assert results[0][2] - resumed_at < 2.0
    results[0][1].release()


def test_a_pause_of_an_unknown_name_keeps_its_state_until_it_ends(spec):
    """A template key nobody used yet: the pause creates it (limit 0, no declaration, shown
    by names and status) and keeps it while the pause lasts, though an empty semaphore's
    state is otherwise forgotten after ``idle_ttl`` here: a semaphore created at the same
    time without a pause (pinned, so kept ``idle_ttl``) goes first."""
    if spec.kind in REFUSE:
        return refused(spec, adaptive={"min": 1, "max": 4})
    from celery_semaphore.backends import get_backend

    backend = get_backend(spec.url, **{**spec.options, "idle_ttl": 2.0})
    until = backend.pause("tenant-42", 20, "tenant over its plan")
    backend.resize("marker", 1)
    status = backend.status("tenant-42")
    assert (status.limit, status.newest_declared, status.held) == (0, None, 0)
    assert status.paused_until == pytest.approx(until)
    assert "tenant-42" in backend.names()
    assert wait_until(lambda: backend.status("marker") is None, timeout=30)  # idle_ttl passed
    status = backend.status("tenant-42")
    assert status is not None and status.paused_until == pytest.approx(until)
    # its first caller declares its limit, and waits for the pause
    attempt = backend.acquire("tenant-42", "t:1", limit=3, ttl=1, meta={}, wait=False)
    assert attempt.waits_for == "pause" and backend.status("tenant-42").limit == 3
    assert backend.resume("tenant-42")
    assert backend.acquire("tenant-42", "t:1", limit=3, ttl=1, meta={}, wait=False).grant


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), "10", True, 2e9])
def test_a_bad_pause_is_refused_and_changes_nothing(spec, seconds):
    if spec.kind in REFUSE:
        return
    backend = spec.backend()
    with pytest.raises(ConfigurationError, match="pause must last"):
        backend.pause("badpause", seconds)
    assert backend.status("badpause") is None


# -- quotas and units -----------------------------------------------------------------------


def test_quota_windows_are_aligned_to_the_epoch_and_admit_again_when_they_turn(spec):
    """2 starts per 3 s window (starts, not concurrency: each releases at once); the third
    waits for the quota, told when the window turns; once the backend's window turns it
    starts. Windows start at multiples of the period (shifted by the offset)."""
    if spec.kind in REFUSE:
        return refused(spec, quota=[[2, 3.0, 0.0]])
    backend = spec.backend()
    meta = {"quota": [[2, 3.0, 0.0], [5, 4.0, 1.0]]}
    sem = spec.semaphore("quota", 10, meta=meta)
    sem.try_acquire().release()  # declares the quotas
    window = next_window(backend, "quota")  # a fresh window: 3 s for what follows
    assert window.window_start % 3.0 == pytest.approx(0.0, abs=1e-6)
    assert window.window_end == pytest.approx(window.window_start + 3.0)
    shifted = backend.status("quota").quotas[1]
    assert (shifted.window_start + 1.0) % 4.0 == pytest.approx(0.0, abs=1e-6)
    sem.acquire(timeout=5).release()
    sem.acquire(timeout=5).release()
    attempt = backend.acquire("quota", "third:1", limit=10, ttl=30, meta=meta, wait=True)
    assert attempt.grant is None and attempt.waits_for == "quota" and attempt.position == 0
    assert 0 < attempt.due <= 3.0
    status = backend.status("quota")
    assert (status.quotas[0].count, status.quotas[0].used) == (2, 2)
    assert status.held == 0 and status.waiting == 1  # holds nothing while it waits
    assert sem.try_acquire() is None  # nor does anyone behind it start
    turned = next_window(backend, "quota")
    assert turned.window_start == pytest.approx(window.window_end)
    assert backend.acquire("quota", "third:1", limit=10, ttl=30, meta=meta, wait=True).grant
    assert backend.status("quota").quotas[0].used == 1
    backend.release("quota", "third:1")


def test_several_quotas_each_hold_back_until_their_own_window_turns(spec):
    """3 per 2 s and 4 per 4 s at once: after three starts the 2 s quota holds the fourth
    back until its window turns (the 4 s one has not); the fifth then waits for the 4 s
    window."""
    if spec.kind in REFUSE:
        return refused(spec, quota=[[3, 2.0, 0.0]])
    backend = spec.backend()
    meta = {"quota": [[3, 2.0, 0.0], [4, 4.0, 0.0]]}
    sem = spec.semaphore("quotas", 10, meta=meta)
    sem.try_acquire().release()
    window = next_window(backend, "quotas", index=1)  # a 4 s window starts (and a 2 s one)
    for _ in range(3):
        sem.acquire(timeout=5).release()
    fourth = backend.acquire("quotas", "four:1", limit=10, ttl=30, meta=meta, wait=True)
    assert fourth.waits_for == "quota" and fourth.due <= 2.0
    short, long_ = backend.status("quotas").quotas
    assert (short.used, long_.used) == (3, 3)
    next_window(backend, "quotas", index=0, after=window.window_start)
    assert backend.status("quotas").quotas[1].window_start == window.window_start
    assert backend.acquire("quotas", "four:1", limit=10, ttl=30, meta=meta, wait=True).grant
    backend.release("quotas", "four:1")
    short, long_ = backend.status("quotas").quotas
    assert (short.used, long_.used) == (1, 4)
    fifth = backend.acquire("quotas", "five:1", limit=10, ttl=30, meta=meta, wait=True)
    assert fifth.waits_for == "quota" and 0 < fifth.due <= long_.window_end - short.window_start
    backend.cancel("quotas", "five:1")


def test_units_are_spent_in_quotas_and_units_no_quota_could_admit_are_refused(spec):
    if spec.kind in REFUSE:
        return refused(spec, units=3)
    backend = spec.backend()
    period, offset = far_hour()
    meta = {"quota": [[10, period, offset]], "units": 4}
    sem = spec.semaphore("units", 5)
    first = sem.acquire(timeout=5, meta=meta)
    second = sem.acquire(timeout=5, meta=meta)
    assert backend.status("units").quotas[0].used == 8
    attempt = backend.acquire("units", "third:1", limit=5, ttl=30, meta=meta, wait=True)
    assert attempt.waits_for == "quota" and attempt.due > 1500  # half an hour away
    assert sem.try_acquire(meta={"units": 2}) is None  # FIFO: not past the one waiting
    backend.cancel("units", "third:1")
    small = sem.try_acquire(meta={"units": 2})  # 8 + 2 <= 10
    assert small is not None
    small.release()
    with pytest.raises(ConfigurationError, match="units 11 are above the semaphore's quota"):
        sem.acquire(timeout=1, meta={"units": 11})
    assert backend.status("units").waiting == 0
    first.release()
    second.release()


def test_a_refund_frees_room_at_once_and_wakes_the_waiter(spec):
    """A call estimated at 6 units of a 10-unit quota spends 2: its settle frees room, and
    the waiter the quota held (poll interval and retry far away) is woken and starts."""
    if spec.kind in REFUSE:
        return refused(spec, units=6)
    backend = spec.backend()
    period, offset = far_hour()
    meta = {"quota": [[10, period, offset]], "units": 6}
    sem = spec.semaphore("refund", 5, poll_interval=10, waiter_ttl=60)
    spender = sem.acquire(timeout=5, meta=meta)
    results = []
    start_waiter(sem, results, "w", timeout=60, meta=meta)
    assert wait_until(lambda: sem.status().waiting == 1)
    settled_at = time.monotonic()
    assert backend.settle("refund", spender.holder, 2) is True
    assert wait_until(lambda: results, timeout=8)
    assert results[0][2] - settled_at < 2.0  # woken, not polled
    assert backend.status("refund").quotas[0].used == 8
    results[0][1].release()
    spender.release()


def test_an_overdraft_is_a_debt_later_starts_wait_for_the_window_to_turn(spec):
    if spec.kind in REFUSE:
        return refused(spec, quota=[[4, 3.0, 0.0]])
    backend = spec.backend()
    meta = {"quota": [[4, 3.0, 0.0]]}
    sem = spec.semaphore("debt", 5, meta=meta)
    sem.try_acquire().release()
    next_window(backend, "debt")
    lease = sem.acquire(timeout=5)
    assert backend.settle("debt", lease.holder, 7) is True
    assert backend.status("debt").quotas[0].used == 7  # above its count: a debt
    attempt = backend.acquire("debt", "later:1", limit=5, ttl=30, meta=meta, wait=True)
    assert attempt.waits_for == "quota" and 0 < attempt.due <= 3.0
    next_window(backend, "debt")
    assert backend.acquire("debt", "later:1", limit=5, ttl=30, meta=meta, wait=True).grant
    assert backend.status("debt").quotas[0].used == 1  # the debt went with its window
    # the holder of the old window settles again: that window turned, the new one is untouched
    assert backend.settle("debt", lease.holder, 2) is True
    assert backend.status("debt").quotas[0].used == 1
    lease.release()
    backend.release("debt", "later:1")


def test_settle_is_absolute_idempotent_and_refused_for_a_non_holder(spec):
    if spec.kind in REFUSE:
        return refused(spec, units=5)
    backend = spec.backend()
    period, offset = far_hour()
    meta = {"quota": [[100, period, offset]], "units": 5}
    sem = spec.semaphore("settle", 5, meta=meta)
    lease = sem.acquire(timeout=5)

    def used():
        return backend.status("settle").quotas[0].used

    assert used() == 5
    assert backend.settle("settle", lease.holder, 2) and used() == 2
    assert backend.perform(Settle("settle", lease.holder, 2)) and used() == 2  # idempotent
    assert backend.settle("settle", lease.holder, 9) and used() == 9
    assert backend.settle("settle", lease.holder, 0) and used() == 0
    assert backend.settle("settle", "nobody:1", 3) is False and used() == 0
    for bad in (-1, 1.5, "3", True, None):
        with pytest.raises(ConfigurationError, match="settled units"):
            backend.settle("settle", lease.holder, bad)
    assert used() == 0
    lease.release()
    assert backend.settle("settle", lease.holder, 4) is False and used() == 0


def test_settle_moves_every_rates_next_start(spec):
    """A rate of one unit per 10 s: a start estimated at 1 unit that spent 3 pushes the next
    start 20 s later; settling back to 1 undoes it; a refund to 0 never moves it before
    now."""
    if spec.kind in REFUSE:
        return refused(spec, units=3)
    backend = spec.backend()
    sem = spec.semaphore("paced", 5, rate="6/m")
    lease = sem.acquire(timeout=5)
    first = backend.status("paced").next_start
    assert first == pytest.approx(time.time() + 10, abs=2)
    assert backend.settle("paced", lease.holder, 3)
    assert backend.status("paced").next_start == pytest.approx(first + 20, abs=0.01)
    assert backend.settle("paced", lease.holder, 1)
    assert backend.status("paced").next_start == pytest.approx(first, abs=0.01)
    assert backend.settle("paced", lease.holder, 0)
    assert backend.status("paced").next_start == pytest.approx(time.time(), abs=2)
    lease.release()


# -- rates ------------------------------------------------------------------------------------


def test_several_rates_each_must_allow_every_start(spec):
    """[30 s, burst 3] and [60 s, burst 2]: two start at once, the third is held by the
    second rate alone (due in about a minute); status lists both. Declaring the first rate
    alone lets it start (the first rate's ``tat`` kept)."""
    if spec.kind in ("amqp", "amqp+slots"):
        return
    backend = spec.backend()
    both = {"rate": [[30.0, 3], [60.0, 2]]}
    sem = spec.semaphore("rates", 5)
    for i in range(2):
        assert backend.acquire("rates", f"r{i}:1", limit=5, ttl=30, meta=both, wait=False).grant
    third = backend.acquire("rates", "r2:1", limit=5, ttl=30, meta=both, wait=False)
    assert third.waits_for == "rate" and 50 < third.rate_due <= 60
    assert third.due == third.rate_due
    status = sem.status()
    assert status.rates == ((30.0, 3), (60.0, 2)) and status.rate == (30.0, 3)
    assert status.next_start > time.time() + 50
    assert status.as_dict()["rates"] == [{"interval": 30.0, "burst": 3},
                                         {"interval": 60.0, "burst": 2}]
    one = {"rate": [30.0, 3]}
    assert backend.acquire("rates", "r2:1", limit=5, ttl=30, meta=one, wait=False).grant
    assert sem.status().rates == ((30.0, 3),)
    fourth = backend.acquire("rates", "r3:1", limit=5, ttl=30, meta=one, wait=False)
    assert fourth.waits_for == "rate" and 20 < fourth.rate_due <= 30  # its tat: 3 starts
    for i in range(3):
        backend.release("rates", f"r{i}:1")


def test_units_spend_the_rate_and_a_start_above_the_burst_waits_for_a_rested_rate(spec):
    """One unit per 60 s, burst 5: a start of 3 units moves the rate 180 s on; another of 3
    must wait (60 s), one of 2 fits the burst; a start of 7 (above the burst) waits until the
    rate owes nothing."""
    if spec.kind in REFUSE:
        return refused(spec, units=3)
    backend = spec.backend()

    def start(holder, units):
        return backend.acquire("spent", holder, limit=9, ttl=30,
                               meta={"rate": [60.0, 5], "units": units}, wait=False)

    assert start("a:1", 3).grant
    late = start("b:1", 3)
    assert late.waits_for == "rate" and 50 < late.rate_due <= 60
    assert start("c:1", 2).grant
    big = start("d:1", 7)
    assert big.waits_for == "rate" and 290 < big.rate_due <= 300  # tat = now + 5 * 60
    fresh = backend.acquire("spent2", "e:1", limit=9, ttl=30,
                            meta={"rate": [60.0, 5], "units": 7}, wait=False)
    assert fresh.grant  # a rested rate: it starts, and owes 7 minutes (2 past the burst)
    assert backend.status("spent2").next_start == pytest.approx(time.time() + 3 * 60, abs=5)


# -- the front of the queue ------------------------------------------------------------------


def test_front_waiters_go_ahead_of_their_priority_fifo_among_them(spec):
    from tests.test_traffic import admission_order

    sem = spec.semaphore("front", 1, poll_interval=5)
    holder = sem.acquire()
    results = []
    arrivals = [("a", 0, False), ("b", 0, True), ("c", 1, False), ("d", 0, True),
                ("e", 0, False), ("f", 1, True), ("g", -1, True)]
    for count, (key, priority, front) in enumerate(arrivals, 1):
        start_waiter(sem, results, key, timeout=30, priority=priority,
                     meta={"front": True} if front else None)
        assert wait_until(lambda n=count: sem.status().waiting == n)
    expected = ["f", "c", "b", "d", "a", "e", "g"]
    assert [w.meta.get("priority", 0) for w in sem.status().waiters] == [1, 1, 0, 0, 0, 0, -1]
    assert admission_order(holder, results, len(arrivals)) == expected


def test_a_front_waiter_goes_ahead_of_every_fair_round(spec):
    from tests.test_traffic import admission_order

    sem = spec.semaphore("frontfair", 1, poll_interval=5)
    holder = sem.acquire()
    results = []
    arrivals = [("a1", "A", False), ("a2", "A", False), ("b1", "B", False),
                ("x", "A", True), ("b2", "B", False), ("y", "B", True)]
    for count, (key, tenant, front) in enumerate(arrivals, 1):
        start_waiter(sem, results, key, timeout=30, fair_key=tenant,
                     meta={"front": True} if front else None)
        assert wait_until(lambda n=count: sem.status().waiting == n)
    assert admission_order(holder, results, len(arrivals)) == ["x", "y", "a1", "b1", "a2", "b2"]


# -- adaptive limits --------------------------------------------------------------------------


def adaptive(low=2, high=6, decrease=0.5, increase=1.0):
    return {"adaptive": {"min": low, "max": high, "decrease": decrease, "increase": increase}}


def test_an_adaptive_limit_grows_with_successes_while_in_use_up_to_its_max(spec):
    if spec.kind in REFUSE:
        return refused(spec, **adaptive())
    backend = spec.backend()
    meta = adaptive()

    def get(holder):
        return backend.acquire("learn", holder, limit=6, ttl=30, meta=meta, wait=False)

    def current():
        return backend.status("learn").adaptive.current

    assert get("h1:1").limit == 2  # starts at min
    status = backend.status("learn")
    assert (status.limit, status.adaptive.min, status.adaptive.max) == (2, 2, 6)
    assert status.as_dict()["adaptive"] == {"min": 2, "max": 6, "current": 2.0, "pinned": False}
    assert get("h2:1").grant and get("h3:1").grant is None  # 2 in force
    assert backend.release("learn", "h1:1", "ok")  # 2 held >= 2 / 2: + 1 / 2
    assert current() == pytest.approx(2.5)
    assert get("h3:1").grant
    assert backend.perform(Release("learn", "h2:1", "ok")) and current() == pytest.approx(2.9)
    assert get("h4:1").grant and get("h5:1").grant is None
    # a success that makes the limit 3 admits a third holder
    assert backend.release("learn", "h3:1", "ok") and current() == pytest.approx(2.9 + 1 / 2.9)
    assert backend.status("learn").limit == 3
    assert get("h5:1").grant and get("h6:1").grant
    # the limit not in use (1 held of 3): no growth; "error" and None: nothing
    for holder in ("h4:1", "h5:1"):
        assert backend.release("learn", holder, "error")
    before = current()
    assert backend.release("learn", "h6:1", "ok") and current() == pytest.approx(before)
    # up to max, not beyond
    for i in range(60):
        held = [f"m{i}-{k}:1" for k in range(backend.status("learn").limit)]
        for h in held:
            assert get(h).grant
        for h in held:
            backend.release("learn", h, "ok")
    assert current() == 6.0 and backend.status("learn").limit == 6
    # a release that finds nothing held changes nothing
    assert backend.release("learn", "gone:1", "overload") is False and current() == 6.0
    with pytest.raises(ConfigurationError, match="outcome"):
        backend.release("learn", "x:1", "fine")


def test_an_overload_decreases_at_most_once_per_round_trip_of_work(spec):
    if spec.kind in REFUSE:
        return refused(spec, **adaptive())
    backend = spec.backend()
    meta = adaptive(low=2, high=16, decrease=0.5, increase=4.0)

    def get(holder):
        return backend.acquire("brake", holder, limit=16, ttl=30, meta=meta, wait=False)

    def current():
        return backend.status("brake").adaptive.current

    get("seed:1")
    backend.resize("brake", 16)  # pinned: outcomes change nothing
    backend.release("brake", "seed:1", "overload")
    assert current() == 2.0
    assert backend.status("brake").adaptive.pinned is True
    # learn up to 16 while unpinned (8 held of 8 in force...)
    assert backend.unpin("brake") == 2
    for i in range(200):
        held = [f"u{i}-{k}:1" for k in range(backend.status("brake").limit)]
        for h in held:
            get(h)
        for h in held:
            backend.release("brake", h, "ok")
        if current() == 16.0:
            break
    assert current() == 16.0
    early = [f"e{k}:1" for k in range(4)]
    for h in early:
        assert get(h).grant
    assert backend.release("brake", early[0], "overload") and current() == 8.0
    # the others were granted before that decrease: the same round trip, no more decrease
    for h in early[1:]:
        assert backend.release("brake", h, "overload") and current() == 8.0
    assert backend.status("brake").limit == 8
    late = "late:1"
    assert get(late).grant  # granted after the decrease
    assert backend.release("brake", late, "overload") and current() == 4.0
    for i in range(3):  # never below min
        assert get(f"l{i}:1").grant
        backend.release("brake", f"l{i}:1", "overload")
    assert current() == 2.0 and backend.status("brake").limit == 2


def test_after_an_overload_the_limit_climbs_back_fast_then_probes_that_level_slowly(spec):
    """The limit in force at an overload is remembered (the ceiling): the learned value grows
    as usual while the next limit is below it, ADAPTIVE_PROBE_SLOWER times slower while the
    next limit would reach it, and as usual again once it passed it without an overload."""
    if spec.kind in REFUSE:
        return refused(spec, **adaptive())
    from celery_semaphore.backends.base import ADAPTIVE_PROBE_SLOWER

    backend = spec.backend()
    meta = adaptive(low=1, high=12, decrease=0.5, increase=1.0)
    serial = iter(range(10**6))

    def current():
        return backend.status("probe").adaptive.current

    def outcome(what):
        """One call ends with ``what`` while the limit is in use: (before, after)."""
        held = [f"p{next(serial)}:1" for _ in range(backend.status("probe").limit)]
        for h in held:
            assert backend.acquire("probe", h, limit=12, ttl=30, meta=meta, wait=False).grant
        before = current()
        backend.release("probe", held[0], what)
        after = current()
        for h in held[1:]:
            backend.release("probe", h)
        return before, after

    backend.acquire("probe", "seed:1", limit=12, ttl=30, meta=meta, wait=False)
    backend.release("probe", "seed:1")
    while current() < 6:
        outcome("ok")
    assert 6 <= current() < 7
    before, after = outcome("overload")  # the ceiling: 6
    assert after == pytest.approx(before * 0.5)
    steps = []
    while current() < 7:
        before, after = outcome("ok")
        steps.append((before, after - before))
        assert len(steps) < 5000
    for before, step in steps:
        if before < 5:  # the next limit (<= 5) is below the ceiling: as usual
            assert step == pytest.approx(1 / before)
        else:  # the next limit would be 6 or 7: probing
            assert step == pytest.approx(1 / before / ADAPTIVE_PROBE_SLOWER)
    assert sum(1 for before, _ in steps if before >= 5) > ADAPTIVE_PROBE_SLOWER * 5
    before, after = outcome("ok")  # 7 passed the ceiling without an overload: forgotten
    assert after - before == pytest.approx(1 / before)


def test_resize_pins_an_adaptive_limit_and_unpin_resumes_from_the_learned_value(spec):
    if spec.kind in REFUSE:
        return refused(spec, **adaptive())
    backend = spec.backend()
    meta = adaptive(low=1, high=8)

    def get(holder):
        return backend.acquire("pinned", holder, limit=8, ttl=30, meta=meta, wait=False)

    for i in range(6):  # learn a little: 1 -> 2 -> 2.5 -> ...
        held = [f"p{i}-{k}:1" for k in range(backend.status("pinned").limit
                                           if backend.status("pinned") else 1)]
        for h in held:
            get(h)
        for h in held:
            backend.release("pinned", h, "ok")
    learned = backend.status("pinned").adaptive.current
    assert learned > 2
    backend.resize("pinned", 5)
    status = backend.status("pinned")
    assert (status.limit, status.pinned, status.adaptive.pinned) == (5, True, True)
    for h in ("q1:1", "q2:1"):
        get(h)
    for h in ("q1:1", "q2:1"):
        backend.release("pinned", h, "ok")
    assert backend.status("pinned").adaptive.current == learned  # no adaptation while pinned
    assert backend.unpin("pinned") == math.floor(learned)
    assert backend.status("pinned").limit == math.floor(learned)


def test_the_newest_declaration_says_whether_a_limit_adapts_and_within_what(spec):
    if spec.kind in REFUSE:
        return refused(spec, **adaptive())
    from celery_semaphore.backends import get_backend

    old = get_backend(spec.url, **{**spec.options, "declared_at": 1_000_000.0})
    new = get_backend(spec.url, **{**spec.options, "declared_at": 2_000_000.0})
    newer = get_backend(spec.url, **{**spec.options, "declared_at": 3_000_000.0})
    assert old.acquire("decl", "a:1", limit=4, ttl=30, meta={}, wait=False).limit == 4
    assert new.acquire("decl", "b:1", limit=10, ttl=30, meta=adaptive(3, 10),
                       wait=False).limit == 3
    # an older process's fixed limit does not undo it
    old.acquire("decl", "c:1", limit=4, ttl=30, meta={}, wait=False)
    status = old.status("decl")
    assert status.limit == 3 and status.adaptive.current == 3.0
    # new bounds move the learned value into them
    new.acquire("decl", "d:1", limit=10, ttl=30, meta=adaptive(5, 10), wait=False)
    assert new.status("decl").adaptive.current == 5.0 and new.status("decl").limit == 5
    # a cost is checked against the max, not the learned limit
    assert new.acquire("decl", "big:1", limit=10, ttl=30, meta={**adaptive(5, 10), "cost": 8},
                       wait=True).waits_for == "units"
    with pytest.raises(ConfigurationError, match="cost 11"):
        new.acquire("decl", "huge:1", limit=10, ttl=30, meta={**adaptive(5, 10), "cost": 11},
                    wait=True)
    new.cancel("decl", "big:1")
    # a newer fixed limit ends adaptation
    newer.acquire("decl", "e:1", limit=7, ttl=30, meta={}, wait=False)
    status = newer.status("decl")
    assert status.adaptive is None and status.limit == 7
    for b, h in ((old, "a:1"), (new, "b:1"), (old, "c:1"), (new, "d:1"), (newer, "e:1")):
        b.release("decl", h)


@pytest.mark.parametrize("bad", [
    {"quota": [[0, 60.0, 0.0]]}, {"quota": [[5, -1.0, 0.0]]}, {"quota": "5/m"},
    {"quota": [[5, 401 * 86400.0, 0.0]]}, {"quota": [[5, 60.0, 1e9]]},
    {"rate": [[0.0, 1]]}, {"rate": [[1.0, 0]]},
    {"adaptive": {"min": 4, "max": 2}}, {"adaptive": {"min": 1, "max": 4, "decrease": 1.0}},
    {"adaptive": {"min": 1}}, {"adaptive": {"min": 1, "max": 4, "extra": 1}},
])
def test_malformed_options_are_refused_before_anything_is_stored(spec, bad):
    if spec.kind in REFUSE:
        return
    backend = spec.backend()
    with pytest.raises(ConfigurationError, match="meta"):
        backend.acquire("malformed", "m:1", limit=4, ttl=30, meta=bad, wait=True)
    assert backend.status("malformed") is None


def test_the_new_options_are_refused_at_start_by_backends_without_them(spec):
    """``check_traffic`` (the worker's start check) names the options and the backend."""
    backend = spec.backend()
    if spec.kind not in REFUSE:
        backend.check_traffic(["quota", "units", "adaptive", "pause", "front"])
        return
    for option in ("quota", "units", "adaptive", "pause"):
        with pytest.raises(ConfigurationError, match=f"semaphore_{option}: the "
                                                     f"{type(backend).__name__} backend"):
            backend.check_traffic([option], "task t: ")
    backend.check_traffic(["front", "priority"])


def test_window_of_calendar_months_and_shifted_days():
    from datetime import datetime, timezone

    def ts(*args):
        return datetime(*args, tzinfo=timezone.utc).timestamp()

    assert window_of(ts(2024, 2, 29, 23, 59), 0, 0) == (ts(2024, 2, 1), ts(2024, 3, 1))
    assert window_of(ts(2024, 12, 31, 12), 0, 0) == (ts(2024, 12, 1), ts(2025, 1, 1))
    assert window_of(ts(2023, 2, 10), 0, 0) == (ts(2023, 2, 1), ts(2023, 3, 1))
    # UTC+1: its month starts an hour earlier by UTC
    assert window_of(ts(2024, 2, 29, 23, 30), 0, 3600) == (ts(2024, 2, 29, 23),
                                                           ts(2024, 3, 31, 23))
    assert window_of(ts(1969, 12, 15), 0, 0) == (ts(1969, 12, 1), ts(1970, 1, 1))
    # 22:30 UTC is 23:30 in UTC+1: that day started at 23:00 UTC the day before
    assert window_of(ts(2024, 5, 5, 22, 30), 86400, 3600) == (ts(2024, 5, 4, 23),
                                                              ts(2024, 5, 5, 23))
    assert window_of(7.5, 5, 0) == (5.0, 10.0)
    assert window_of(7.5, 5, 1) == (4.0, 9.0)


def test_a_month_quota_is_the_backends_calendar_month(spec):
    if spec.kind in REFUSE:
        return
    backend = spec.backend()
    for offset in (0.0, 3600.0, -5 * 3600.0):
        name = f"month{int(offset)}"
        assert backend.acquire(name, "m:1", limit=2, ttl=30,
                               meta={"quota": [[1000, 0.0, offset]]}, wait=False).grant
        (quota,) = backend.status(name).quotas
        assert (quota.window_start, quota.window_end) == window_of(time.time(), 0, offset)
        assert (quota.period, quota.offset, quota.used) == (0.0, offset, 1)
        backend.release(name, "m:1")


def test_pause_after_waits_until_due(spec):
    """``pause_after`` sleeps until ``due`` (capped at a third of the waiter TTL), as for a
    rate."""
    from celery_semaphore.backends.base import Attempt

    backend = spec.backend()
    assert backend.pause_after(Attempt(None, 0, None, 1, None, "quota", due=0.5), 10) == \
        pytest.approx(0.5002)
    assert backend.pause_after(Attempt(None, 0, None, 1, None, "pause", due=100), 10) == \
        pytest.approx(backend.waiter_ttl / 3)


def test_threads_racing_a_quota_never_exceed_it(spec):
    """Eight threads start as fast as they can against 5 units per far window: exactly five
    starts of one unit happen, whatever the interleaving."""
    if spec.kind in REFUSE:
        return
    period, offset = far_hour()
    meta = {"quota": [[5, period, offset]]}
    sem = spec.semaphore("race", 8, meta=meta)
    barrier = threading.Barrier(8)
    started = []

    def race():
        barrier.wait()
        for _ in range(3):
            lease = sem.try_acquire()
            if lease is not None:
                started.append(lease)
                lease.release()

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(started) == 5
    assert sem.status().quotas[0].used == 5


def test_the_waiters_tickets_in_status_are_their_arrival_order(spec):
    """A front waiter's ticket is its arrival's, as any waiter's (Redis keeps it in the
    queue's score beside the priority and the front flag)."""
    backend = spec.backend()
    backend.acquire("tickets", "h:1", limit=1, ttl=30, meta={}, wait=True)
    for i, meta in enumerate(({}, {"front": True}, {"priority": 2, "front": True},
                              {"priority": -3})):
        backend.acquire("tickets", f"w{i}:1", limit=1, ttl=30, meta=meta, wait=True)
    waiters = backend.status("tickets").waiters
    assert [w.holder for w in waiters] == ["w2:1", "w1:1", "w0:1", "w3:1"]
    tickets = {w.holder: w.ticket for w in waiters}
    assert tickets["w0:1"] < tickets["w1:1"] < tickets["w2:1"] < tickets["w3:1"]
    assert tickets["w3:1"] - tickets["w0:1"] == 3
    for i in range(4):
        backend.cancel("tickets", f"w{i}:1")
    backend.release("tickets", "h:1")


# -- stored state: documents written before these rules ------------------------------------


def test_a_document_stored_before_these_rules_loads_and_writes_back_unchanged():
    """memory, SQLite and PostgreSQL store :class:`.model.State` as one JSON document: one
    written by an older version (one rate as ``rate``/``tat``) loads with every new rule off,
    and a semaphore that uses none of them writes back exactly what it read (an older client
    can still read it); the new fields round-trip."""
    import json

    from celery_semaphore.backends.model import State

    old = {"limit": 4, "declared": {"4": 10.0}, "holders": {
        "a:1": {"slot": 0, "epoch": 7, "since": 10.0, "expires": 40.0, "meta": {"cost": 2}}},
        "waiters": {"b:1": {"ticket": 1, "since": 11.0, "expires": 16.0, "client": "c",
                            "meta": {}, "round": 0}},
        "epochs": {"0": 7}, "next_ticket": 2, "round": 0, "stats": {"acquired": 1},
        "pinned": False, "wanted": 4, "stamp": 5.0, "rate": [0.5, 2], "tat": 12.0}
    state = State.from_dict(json.loads(json.dumps(old)))
    assert state.rates == [[0.5, 2, 12.0]] and state.quotas == [] and state.adaptive is None
    assert state.paused_until == 0.0 and state.holders["a:1"].counted is None
    assert json.loads(state.dumps()) == old
    state.pause(30, "429", now=20.0)
    state.quotas = [[5, 60.0, 0.0]]
    state.rates.append([60.0, 1, 0.0])
    state.make_adaptive((1, 8, 0.9, 1.0))
    state.grant("c:1", 1, 0, 30.0, {"units": 2}, now=21.0)
    copy = State.loads(state.dumps())
    assert copy.to_dict() == state.to_dict()
    assert copy.holders["c:1"].windows == [[60.0, 0.0, 0.0]]
    assert (copy.paused_until, copy.pause_reason, copy.current) == (50.0, "429", 1.0)
    assert json.loads(copy.dumps())["rate"] == [0.5, 2]  # the first rate where it was


def test_an_sqlite_database_of_an_older_version_takes_the_new_operations(tmp_path):
    """No schema change: a row an older version wrote is paused, settled and adapted in
    place."""
    import json
    import sqlite3

    from celery_semaphore.backends import get_backend

    path = tmp_path / "old.db"
    url = "sqlite:////" + str(path).lstrip("/")
    backend = get_backend(url, key_prefix="old:")
    assert backend.acquire("legacy", "a:1", limit=3, ttl=60, meta={}, wait=False).grant
    conn = sqlite3.connect(str(path))
    (raw,) = conn.execute("SELECT state FROM semaphores WHERE name = 'old:legacy'").fetchone()
    doc = json.loads(raw)
    assert not {"quotas", "windows", "paused_until", "adaptive", "rates"} & set(doc)
    conn.close()
    assert backend.pause("legacy", 30, "maintenance") > time.time() + 20
    assert backend.acquire("legacy", "b:1", limit=3, ttl=60,
                           meta={"quota": [[10, 3600.0, 0.0]]}, wait=False).waits_for == "pause"
    assert backend.resume("legacy")
    period, offset = far_hour()
    assert backend.acquire("legacy", "b:1", limit=3, ttl=60,
                           meta={"quota": [[10, period, offset]], "units": 4}, wait=False).grant
    assert backend.settle("legacy", "b:1", 1)
    assert backend.status("legacy").quotas[0].used == 1
    backend.close()


def test_the_new_operations_run_in_a_batch_each_on_its_own(spec):
    """:meth:`Backend.perform_all` (one pipeline on Redis) with pause, resume, settle and a
    release with an outcome among the other operations."""
    from celery_semaphore.backends.base import Acquire

    backend = spec.backend()
    period, offset = far_hour()
    meta = {"quota": [[10, period, offset]], "units": 4}
    if spec.kind in REFUSE:
        outcomes = backend.perform_all([Pause("batched", 30.0, "429"), Resume("batched"),
                                        Settle("batched", "a:1", 2)])
        assert all(result is None and isinstance(exc, ConfigurationError)
                   for result, exc in outcomes)
        return
    outcomes = backend.perform_all([
        Pause("batched", 30.0, "429"),
        Acquire("batched", "a:1", 2, 30.0, meta, True),
        Resume("batched"),
        Acquire("batched", "a:1", 2, 30.0, meta, True),
        Settle("batched", "a:1", 2),
        Settle("batched", "a:1", -1),  # refused alone
        Release("batched", "a:1", "ok", 0.25),
    ])
    (paused, e1), (waiting, e2), (resumed, e3), (granted, e4), (settled, e5), \
        (bad, e6), (released, e7) = outcomes
    assert e1 is None and paused > time.time() + 20
    assert e2 is None and waiting.waits_for == "pause" and waiting.due > 20
    assert e3 is None and resumed is True
    assert e4 is None and granted.grant is not None
    assert e5 is None and settled is True
    assert bad is None and isinstance(e6, ConfigurationError)
    assert e7 is None and released is True
    assert backend.status("batched").quotas[0].used == 2
