"""Redis and issue #36 (backends/base.py: "Pauses", "Quotas", "Settling", "Adaptive limits"):
the fast path costs what it cost before, pushed grants keep the new rules, the Lua calendar is
base.py's, the scripts agree with model.py on random traffic, and state that must outlive
``idle_ttl`` (a long pause, a month's window) does."""

import random
import time

import pytest
import redis

from celery_semaphore.backends import get_backend
from celery_semaphore.backends.base import Release, _civil, _days
from celery_semaphore.backends.redis.backend import KEY_SUFFIXES, _sources
from tests import servers
from tests.test_redis_backend import _wakes
from tests.util import wait_until

META = {"task_id": "t", "task": "x"}


@pytest.fixture
def prefix():
    return f"{servers.unique_tag()}:"


commands = servers.command_calls


def counted(client, fn):
    """Redis commands ``fn`` made (scripts' commands included; INFO itself left out)."""
    before = commands(client)
    fn()
    after = commands(client)
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    return {k: v for k, v in diff.items() if v and k != "info"}


def test_a_call_that_uses_none_of_the_new_options_costs_the_same_commands(private_redis):
    """An uncontended acquire and release: 39 commands on a new semaphore, 38 on an existing
    one, 30 while another holder holds (EVALSHA and TIME included). Before issue #36 it was 42,
    41 and 27 (and #36 added none); the W11 work took out the acquire's second read of config,
    the free-units hint's ZCARD of an empty queue, the round's read where no round is kept, and
    the release's EXISTS (its HMGET of config says it): 39, 38, 24; then the grant's
    ``acquired`` counter (it is the wait histogram's count): 38, 37, 23. The holders' index
    (scripts/prelude.lua: an acquire no longer reads every holder) costs the last holder's
    release a DEL, and a pair beside other holders its checks and upkeep: a BITCOUNT, a BITPOS
    and an HGET for the HGETALL, a SETBIT and an HSET in the grant, a ZCARD, an HDEL and a
    SETBIT in the release, whatever the number of holders."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="count:")
    backend.acquire("warm", "w:1", limit=1, ttl=30, meta=META, wait=True)  # loads the scripts
    backend.release("warm", "w:1")

    def cycle(name, holder):
        return lambda: (backend.acquire(name, holder, limit=4, ttl=30, meta=META, wait=True),
                        backend.release(name, holder))

    new = counted(client, cycle("s", "a:1"))
    assert sum(new.values()) == 39, new
    existing = counted(client, cycle("s", "b:1"))
    assert sum(existing.values()) == 38, existing
    assert existing == {"del": 1, "evalsha": 2, "exists": 1, "hdel": 2, "hget": 2,
                        "hincrby": 4, "hmget": 3, "hset": 3, "pexpire": 9, "time": 2,
                        "zadd": 1, "zcard": 5, "zrangebyscore": 2, "zrem": 1}
    backend.acquire("s2", "other:1", limit=4, ttl=30, meta=META, wait=True)
    counted(client, cycle("s2", "c:1"))  # the first one beside another builds the index
    beside = counted(client, cycle("s2", "c:1"))
    assert sum(beside.values()) == 30, beside
    assert beside == {"bitcount": 1, "bitpos": 1, "evalsha": 2, "exists": 1, "hdel": 2,
                      "hget": 2, "hincrby": 4, "hmget": 2, "hset": 3, "setbit": 2, "time": 2,
                      "zadd": 1, "zcard": 4, "zrangebyscore": 2, "zrem": 1}
    # a release that gives no outcome sends none
    ((script, _, argv),), _ = backend.calls_of(Release("s", "a:1"))
    assert (script, argv[2:]) == ("release", ["s", "a:1"])



def test_a_queue_entry_and_a_pushed_handoff_cost_what_they_did_after_w11(private_redis):
    """W11's cost per queued task is one queue entry (an acquire that waits, asking for a
    pushed grant) and one handoff (the release ahead of it, which grants it and announces the
    grant): 13 and 26 commands on a semaphore of limit 1 (EVALSHA, TIME and the handoff's two
    PEXPIREs included). 14 before config's ``pl`` (nobody waits at a lower priority) spared a
    newcomer the count of the waiters ahead of it (ZCOUNT: begin's ZCARD is that count);
    17 and 28 before config's ``wn`` spared the pruning of waiters until
    one may have expired, the queue entry's start took config's fields from its one read, its
    reply the first lease from the pruning of holders, and the release read config once for
    itself and its start; 18 and 32 before the release handed what its start had read of
    config and of the holders' count to its wake and pushed grant, and the queue entry its
    count; 21
    and 40 before the W11 work: the wake's second reads of config, of the holders and of the
    waiter's entry, the wfair reads and deletes of a semaphore with no fair
    shares, and the queued acquire's wake where the holders fill the limit; 32 before the
    grant stopped counting ``acquired`` apart from its wait; 17 and 31 before the holders'
    index: a queue entry reads the holders' count and its own entry where it read every
    holder, and the last holder's release drops the index). The handoff still grants the
    head and only it."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="count:")
    backend.acquire("warm", "w:1", limit=1, ttl=30, meta=META, wait=True)  # loads the scripts
    backend.release("warm", "w:1")
    read, pubsub = _wakes(backend)
    try:
        assert backend.acquire("h", "a:1", limit=1, ttl=30, meta=META, wait=True).grant
        entries = [counted(client, lambda i=i: backend.acquire(
            "h", f"q:{i}", limit=1, ttl=30, meta=META, wait=True, push=True)) for i in range(4)]
        # (the first finds the queue empty: nobody to prune or to wake; it sets config's wn
        # and pl in one HSET, and its reply reads the first lease)
        assert [sum(e.values()) for e in entries] == [17, 13, 13, 13], entries
        assert entries[-1] == {"evalsha": 1, "exists": 1, "hget": 1, "hincrby": 1,
                               "hmget": 1, "hset": 1, "time": 1, "zadd": 2, "zcard": 2,
                               "zrangebyscore": 1, "zrank": 1}
        for ahead, head in (("a:1", "q:0"), ("q:0", "q:1")):
            handoff = counted(client, lambda ahead=ahead: backend.release("h", ahead))
            assert sum(handoff.values()) - handoff.get("pexpire", 0) == 24, handoff
            assert handoff["hmget"] == 1 and handoff["zcard"] == 2, handoff
            assert handoff["zrangebyscore"] == 1, handoff  # the holders' pruning only
            assert handoff["publish"] == 1 and handoff["hincrby"] == 4, handoff
            assert wait_until_pushed(read, head)
            status = backend.status("h")
            assert [h.holder for h in status.holders] == [head]
        assert backend.status("h").waiting == 2
    finally:
        pubsub.close()
        backend.reset("h")


def test_a_newcomer_counts_the_waiters_ahead_only_when_one_waits_at_a_lower_priority(
        private_redis):
    """Config's ``pl`` is the lowest priority anybody waits at: a newcomer at that priority or
    a lower one goes behind every waiter without counting them (no ZCOUNT), a newcomer above it
    counts those ahead; ``pl`` falls with a lower newcomer, starts again at the first waiter of
    an empty queue, and a semaphore without it (a version before it) counts, with the same
    positions throughout."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="pl:")
    config = backend._keys("p")[0]

    def entry(holder, priority=0, front=False):
        meta = {**META, "priority": priority, **({"front": True} if front else {})}
        answer = {}
        spent = counted(client, lambda: answer.setdefault("a", backend.acquire(
            "p", holder, limit=1, ttl=30, meta=meta, wait=True)))
        return answer["a"].position, spent.get("zcount", 0)

    def lowest():
        value = client.hget(config, "pl")
        return None if value is None else int(value)

    try:
        assert backend.acquire("p", "a:1", limit=1, ttl=30, meta=META, wait=True).grant
        assert entry("q:0") == (0, 0) and lowest() == 0  # the first of an empty queue
        assert entry("q:1") == (1, 0)
        assert entry("q:2", priority=-1) == (2, 0) and lowest() == -1
        assert entry("q:3") == (2, 1)  # ahead of q:2: counted
        assert entry("q:4", priority=2) == (0, 1)
        assert entry("q:5", front=True) == (1, 1)  # a front one counts, whatever its priority
        assert entry("q:6", priority=-1) == (6, 0) and lowest() == -1
        assert [w.holder for w in backend.status("p").waiters] == [
            "q:4", "q:5", "q:0", "q:1", "q:3", "q:2", "q:6"]
        for holder in ("q:0", "q:1", "q:2", "q:3", "q:4", "q:5", "q:6"):
            backend.cancel("p", holder)
        assert entry("r:0", priority=1) == (0, 0) and lowest() == 1  # started again
        assert entry("r:1", priority=1) == (1, 0)
        assert entry("r:2") == (2, 0) and lowest() == 0
        client.hdel(config, "pl")  # as a version before pl leaves config
        assert entry("r:3", priority=1) == (2, 1)  # counted: nothing says who waits lower
        assert lowest() is None  # (and nothing starts pl but an empty queue)
        assert [w.holder for w in backend.status("p").waiters] == ["r:0", "r:1", "r:3", "r:2"]
    finally:
        backend.reset("p")


def test_a_waiting_caller_dates_its_declaration_at_most_once_a_second(redis_url, prefix):
    """status's last-seen time of a declared limit stays within a second of the last caller
    that declared it, waiting callers included (they date it at most once a second)."""
    backend = get_backend(redis_url, key_prefix=prefix)
    try:
        assert backend.acquire("d", "a:1", limit=1, ttl=30, meta=META, wait=True).grant
        backend.acquire("d", "q:0", limit=1, ttl=30, meta=META, wait=True, push=True)
        first = backend.status("d").declared[1]
        backend.acquire("d", "q:1", limit=1, ttl=30, meta=META, wait=True, push=True)
        assert backend.status("d").declared[1] - first < 1.0
        time.sleep(1.1)
        backend.acquire("d", "q:2", limit=1, ttl=30, meta=META, wait=True, push=True)
        later = backend.status("d").declared[1]
        assert later - first >= 1.1 and abs(later - time.time()) < 1.0
    finally:
        backend.reset("d")

def test_no_grant_is_pushed_while_paused_and_the_resume_pushes_it(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    read, pubsub = _wakes(backend)
    try:
        assert backend.acquire("p", "h:1", limit=1, ttl=30, meta=META, wait=True).grant
        waiting = backend.acquire("p", "w:1", limit=1, ttl=30, meta=META, wait=True, push=True)
        assert waiting.position == 0
        backend.pause("p", 60, "429")
        assert backend.release("p", "h:1")
        assert backend.status("p").held == 0  # the release pushed nothing
        assert backend.resume("p")
        status = backend.status("p")  # the resume granted it, there and then
        assert [h.holder for h in status.holders] == ["w:1"] and status.waiting == 0
        assert wait_until_pushed(read, "w:1")
    finally:
        pubsub.close()
        backend.reset("p")


def wait_until_pushed(read, holder):
    return wait_until(lambda: any(h == holder and pushed is not None
                                  for _, h, pushed in read()))


def test_a_refund_pushes_the_grant_the_quota_held_back(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    read, pubsub = _wakes(backend)
    period, offset = 3600.0, 1800.0 - time.time() % 3600.0
    meta = {**META, "quota": [[4, period, offset]], "units": 3}
    try:
        assert backend.acquire("q", "a:1", limit=3, ttl=30, meta=meta, wait=True).grant
        held_back = backend.acquire("q", "b:1", limit=3, ttl=30, meta=meta, wait=True, push=True)
        assert held_back.waits_for == "quota"
        behind = backend.acquire("q", "c:1", limit=3, ttl=30, meta={**meta, "units": 1},
                                 wait=True, push=True)
        assert behind.waits_for == "quota"  # 3 + 3 ahead + 1 > 4: FIFO
        assert backend.settle("q", "a:1", 3)  # no change: nothing pushed
        assert backend.status("q").held == 1
        assert backend.settle("q", "a:1", 1)  # 1 + 3 <= 4: b is granted; c (1 more) is not
        status = backend.status("q")
        assert {h.holder for h in status.holders} == {"a:1", "b:1"}
        assert status.quotas[0].used == 4 and [w.holder for w in status.waiters] == ["c:1"]
        assert wait_until_pushed(read, "b:1")
        assert backend.settle("q", "b:1", 2)  # 3 used: c fits
        assert {h.holder for h in backend.status("q").holders} == {"a:1", "b:1", "c:1"}
    finally:
        pubsub.close()
        backend.reset("q")


def test_an_adaptive_limit_that_grows_pushes_the_waiter_it_admits(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    meta = {**META, "adaptive": {"min": 1, "max": 4, "decrease": 0.5, "increase": 1.0}}
    try:
        assert backend.acquire("a", "h1:1", limit=4, ttl=30, meta=meta, wait=True).grant
        assert backend.acquire("a", "w1:1", limit=4, ttl=30, meta=meta, wait=True,
                               push=True).position == 0
        assert backend.release("a", "h1:1", "ok")  # 1 -> 2: w1 is granted by this release
        status = backend.status("a")
        assert status.limit == 2 and [h.holder for h in status.holders] == ["w1:1"]
    finally:
        backend.reset("a")


def test_the_scripts_calendar_is_base_pys(redis_url, prefix):
    """days_of and civil of scripts/prelude.lua against base.py's, from 1900 to 2200."""
    source = _sources()["status"][0].split("\nlocal fields = ")[0]
    check = source + """
local out = {}
for days = -25567, 84000, 13 do
  local y, m = P.civil(days)
  table.insert(out, y * 100 + m)
  table.insert(out, P.days_of(y, m))
end
return out
"""
    client = redis.Redis.from_url(redis_url)
    keys = [f"{prefix}{{cal}}:{suffix}" for suffix in KEY_SUFFIXES]
    reply = client.eval(check, len(keys), *keys, 1000, "x", "cal")
    client.close()
    for i, days in enumerate(range(-25567, 84000, 13)):
        year, month = _civil(days)
        assert reply[2 * i] == year * 100 + month, days
        assert reply[2 * i + 1] == _days(year, month), days


def test_a_pause_and_a_months_window_outlive_idle_ttl(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix, idle_ttl=600.0)
    client = redis.Redis.from_url(redis_url)
    try:
        backend.pause("long", 7200, "until the contract renews")
        config = backend.key_names("long")["config"]
        assert client.pttl(config) > 7100_000
        backend.acquire("long", "h:1", limit=2, ttl=30, meta=META, wait=False)  # paused
        assert client.pttl(config) > 7100_000
        month = {**META, "quota": [[100, 0.0, 0.0]]}
        assert backend.acquire("monthly", "m:1", limit=2, ttl=30, meta=month, wait=False).grant
        end = backend.status("monthly").quotas[0].window_end
        backend.release("monthly", "m:1")
        ttl = client.pttl(backend.key_names("monthly")["config"]) / 1000
        assert ttl == pytest.approx(end - time.time() + 1, abs=5)
    finally:
        client.close()
        backend.reset("long")
        backend.reset("monthly")


def test_redis_scripts_and_model_agree_on_the_new_rules(redis_url):
    """The same random mix as test_traffic's agreement test, with units and quotas (a window
    half an hour away), front waiters, settles, pauses and resumes, and an adaptive limit's
    outcomes: the same grants, queue order, quota use and learned limit on both."""
    memory = get_backend(f"memory://{servers.unique_tag()}")
    redis_backend = get_backend(redis_url, key_prefix=f"{servers.unique_tag()}:")
    backends = (memory, redis_backend)
    rng = random.Random(36)
    period, offset = 3600.0, 1800.0 - time.time() % 3600.0
    for round_ in range(8):
        name, holders = f"up{round_}", []
        adaptive = round_ % 2 == 1
        for step in range(70):
            op = rng.random()
            if op < 0.5 or not holders:
                holder = f"h{step}:1"
                meta = {"quota": [[14, period, offset], [20, period * 2, offset]]}
                if rng.random() < 0.5:
                    meta["units"] = rng.choice((2, 3, 5))
                if rng.random() < 0.3:
                    meta["cost"] = 2
                if rng.random() < 0.3:
                    meta["priority"] = rng.choice((-1, 1))
                if rng.random() < 0.25:
                    meta["front"] = True
                if rng.random() < 0.3:
                    meta["fair_key"] = rng.choice("ab")
                if adaptive:
                    meta["adaptive"] = {"min": 3, "max": 10, "decrease": 0.7, "increase": 1.0}
                holders.append((holder, meta))
                answers = [b.acquire(name, holder, limit=10, ttl=60, meta=meta, wait=True)
                           for b in backends]
                assert [a.waits_for for a in answers] == [answers[0].waits_for] * 2, step
                assert answers[0].position == answers[1].position, (round_, step)
            else:
                holder, meta = rng.choice(holders)
                verb = rng.choices(("release", "cancel", "retry", "settle", "pause", "resume",
                                    "ok", "overload"), (3, 1, 3, 3, 0.5, 1.5, 2, 2))[0]
                results = []
                units = rng.randint(0, 6)
                for b in backends:
                    if verb == "retry":
                        results.append(b.acquire(name, holder, limit=10, ttl=60, meta=meta,
                                                 wait=True).grant is not None)
                    elif verb == "settle":
                        results.append(b.settle(name, holder, units))
                    elif verb == "pause":
                        results.append(b.pause(name, 3600) > time.time() + 3000)
                    elif verb == "resume":
                        results.append(b.resume(name))
                    elif verb in ("ok", "overload"):
                        results.append(b.release(name, holder, verb))
                    else:
                        results.append(getattr(b, verb)(name, holder))
                assert results[0] == results[1], (round_, step, verb)
            mine, theirs = memory.status(name), redis_backend.status(name)
            assert [w.holder for w in mine.waiters] == [w.holder for w in theirs.waiters], \
                (round_, step)
            assert {h.holder for h in mine.holders} == {h.holder for h in theirs.holders}
            assert [q.used for q in mine.quotas] == [q.used for q in theirs.quotas], step
            assert mine.units == theirs.units and mine.limit == theirs.limit, step
            assert (mine.paused_until is None) == (theirs.paused_until is None)
            if adaptive:
                assert mine.adaptive.current == pytest.approx(theirs.adaptive.current)
        redis_backend.reset(name)


def test_the_new_operations_on_the_event_loop_link(private_redis):
    """Pause, resume, settle and a release with an outcome through the worker's hub link (its
    scripts loaded on connect: no EVAL), a pushed grant announced by the resume."""
    from celery_semaphore.backends.base import Acquire, Pause, Resume, Settle
    from tests.test_hublink import Loop

    url, client = private_redis
    loop = Loop(url)
    meta = {**META, "quota": [[10, 3600.0, 1800.0 - time.time() % 3600.0]], "units": 3,
            "adaptive": {"min": 1, "max": 4, "decrease": 0.5, "increase": 1.0}}
    try:
        assert loop.backend.status("hub") is None  # (the status script: run once as EVAL)
        evals = commands(client).get("eval", 0)
        assert loop.turn_until(lambda: loop.link._listening)
        paused, error = loop.call(Pause("hub", 60.0, "429"))
        assert error is None and paused > time.time() + 50
        assert loop.call(Acquire("hub", "h:1", 4, 30.0, meta, True, push=True))[0].waits_for \
            == "pause"
        assert loop.call(Resume("hub")) == (True, None)
        assert loop.turn_until(lambda: loop.wakes)
        ((name, holder, pushed),) = loop.wakes
        assert (name, holder) == ("hub", "h:1") and pushed is not None
        assert loop.call(Settle("hub", "h:1", 1)) == (True, None)
        assert loop.backend.status("hub").quotas[0].used == 1
        assert loop.call(Release("hub", "h:1", "ok", 0.5)) == (True, None)
        assert loop.backend.status("hub").adaptive.current == 2.0
        assert commands(client).get("eval", 0) == evals  # the link never fell back to EVAL
    finally:
        loop.close()


def test_pushed_grants_agree_with_the_model_on_random_traffic(redis_url):
    """A release, cancel or settle that pushes several grants at once (costs, units, quotas,
    priorities, fair keys) keeps what it read of config and the holders' count current from one
    grant to the next (prelude's push_grant): the Redis backend with every waiter asking for
    pushed grants ends each step where the model does once every admissible waiter, in queue
    order, has tried again (what a push does where no rate limits it to one), with distinct
    slots below the limit and epochs that rise with every grant."""
    memory = get_backend(f"memory://{servers.unique_tag()}")
    redis_backend = get_backend(redis_url, key_prefix=f"{servers.unique_tag()}:")
    rng = random.Random(2026)
    period, offset = 3600.0, 1800.0 - time.time() % 3600.0
    pushes = several = 0
    for round_ in range(6):
        name, holders, metas, epochs = f"push{round_}", [], {}, {}
        quota = round_ % 3 == 2

        def catch_up():
            """The model's waiters try again, in queue order, until none is admitted."""
            admitted = True
            while admitted:
                admitted = False
                for waiter in memory.status(name).waiters if memory.status(name) else ():
                    if memory.acquire(name, waiter.holder, limit=6, ttl=60,
                                      meta=metas[waiter.holder], wait=True).grant:
                        admitted = True
                        break

        for step in range(80):
            if rng.random() < 0.55 or not holders:
                holder = f"h{step}:1"
                meta = {"task_id": holder, "task": "x"}
                if rng.random() < 0.4:
                    meta["cost"] = rng.choice((2, 3))
                if rng.random() < 0.3:
                    meta["priority"] = rng.choice((-1, 1))
                if round_ % 2 and rng.random() < 0.6:
                    meta["fair_key"] = rng.choice("ab")
                if quota:
                    meta["quota"] = [[30, period, offset]]
                    meta["units"] = rng.choice((1, 2))
                holders.append(holder)
                metas[holder] = meta
                memory.acquire(name, holder, limit=6, ttl=60, meta=meta, wait=True)
                redis_backend.acquire(name, holder, limit=6, ttl=60, meta=meta, wait=True,
                                      push=True)
            else:
                now = redis_backend.status(name)
                held_before = {h.holder for h in now.holders}
                verb = rng.choices(("release", "cancel", "settle"), (6, 1, 1))[0]
                among = [w.holder for w in now.waiters] if verb == "cancel" else held_before
                holder = rng.choice(sorted(among or holders))
                for b in (memory, redis_backend):
                    if verb == "settle":
                        b.settle(name, holder, 0)
                    else:
                        getattr(b, verb)(name, holder)
                status = redis_backend.status(name)
                pushed = {h.holder for h in status.holders} - held_before if status else set()
                pushes += len(pushed)
                several += len(pushed) > 1
            catch_up()
            mine, theirs = memory.status(name), redis_backend.status(name)
            if mine is None or theirs is None:
                assert not (mine and (mine.holders or mine.waiters)), step
                assert not (theirs and (theirs.holders or theirs.waiters)), step
                continue
            assert {h.holder for h in mine.holders} == {h.holder for h in theirs.holders}, \
                (round_, step)
            assert [w.holder for w in mine.waiters] == [w.holder for w in theirs.waiters], \
                (round_, step)
            assert mine.units == theirs.units <= 6, step
            assert [q.used for q in mine.quotas] == [q.used for q in theirs.quotas], step
            slots = [h.slot for h in theirs.holders]
            assert len(set(slots)) == len(slots) and all(0 <= s < 6 for s in slots), slots
            _assert_wn_precedes_every_waiter(redis_backend, name)
            for h in theirs.holders:
                if h.holder not in epochs:
                    assert all(h.epoch > e for e in epochs.values()), (h, epochs)
                    epochs[h.holder] = h.epoch
        redis_backend.reset(name)
    # the test saw many pushed grants, several of them more than one in one operation
    assert pushes > 40 and several > 5, (pushes, several)


def _assert_wn_precedes_every_waiter(backend, name):
    """config's ``wn`` (prelude's prune_waiters) is at or before every waiter's expiry."""
    keys = backend.key_names(name)
    wn = backend.client.hget(keys["config"], "wn")
    first = backend.client.zrange(keys["wexp"], 0, 0, withscores=True)
    if first and wn is not None:
        assert int(wn) <= first[0][1], (wn, first)


def test_a_waiter_that_expires_first_is_pruned_when_it_expires(redis_url, prefix):
    """The pruning of waiters runs once config's ``wn`` has passed: a waiter queued behind
    others with a shorter waiter TTL lowers it, and is pruned as soon as it expires; a config
    without ``wn`` (written by an earlier version) prunes at every call."""
    long_lived = get_backend(redis_url, key_prefix=prefix, waiter_ttl=60.0)
    short_lived = get_backend(redis_url, key_prefix=prefix, waiter_ttl=1.0)
    keys = long_lived.key_names("x")
    client = long_lived.client
    try:
        assert long_lived.acquire("x", "h:1", limit=1, ttl=30, meta=META, wait=True).grant
        long_lived.acquire("x", "w1:1", limit=1, ttl=30, meta=META, wait=True)
        short_lived.acquire("x", "w2:1", limit=1, ttl=30, meta=META, wait=True)
        expires = client.zscore(keys["wexp"], "w2:1")
        assert int(client.hget(keys["config"], "wn")) == expires

        def pruned(holder):
            long_lived.acquire("x", "w1:1", limit=1, ttl=30, meta=META, wait=True)  # a refresh
            return client.zscore(keys["wexp"], holder) is None

        assert wait_until(lambda: pruned("w2:1"), timeout=10)
        assert [w.holder for w in long_lived.status("x").waiters] == ["w1:1"]
        # the pruning moved wn to the next expiry (w1's, refreshed since: at or before it)
        assert int(client.hget(keys["config"], "wn")) <= client.zscore(keys["wexp"], "w1:1")
        short_lived.acquire("x", "w3:1", limit=1, ttl=30, meta=META, wait=True)
        client.hdel(keys["config"], "wn")
        assert wait_until(lambda: pruned("w3:1"), timeout=10)
    finally:
        long_lived.reset("x")


def test_a_queued_reply_says_when_the_first_lease_ends(redis_url, prefix):
    """retry_after is the first lease's remaining time, from the pruning's read of it."""
    backend = get_backend(redis_url, key_prefix=prefix)
    try:
        assert backend.acquire("r", "a:1", limit=2, ttl=30, meta=META, wait=True).grant
        assert backend.acquire("r", "b:1", limit=2, ttl=5, meta=META, wait=True).grant
        queued = backend.acquire("r", "c:1", limit=2, ttl=30, meta=META, wait=True)
        assert queued.grant is None and 4.0 < queued.retry_after <= 5.0, queued
        backend.release("r", "b:1")  # (c is woken, not granted: d queues behind it)
        queued = backend.acquire("r", "d:1", limit=2, ttl=30, meta=META, wait=True)
        assert queued.grant is None and 25.0 < queued.retry_after <= 30.0, queued
        # several semaphores at once: the blocking one's first lease, not the last one read
        assert backend.acquire("s1", "e:1", limit=1, ttl=5, meta=META, wait=True).grant
        assert backend.acquire("s2", "f:1", limit=2, ttl=30, meta=META, wait=True).grant
        refused = backend.acquire_all([("s1", 1), ("s2", 2)], "g:1", ttl=30, meta=META,
                                      wait=True)
        assert refused.blocking == "s1" and 4.0 < refused.retry_after <= 5.0, refused
    finally:
        for name in ("r", "s1", "s2"):
            backend.reset(name)
