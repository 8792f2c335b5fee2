"""Redis-specific guarantees: key layout and expiry, server time, errors, wake-up recovery,
the listener thread across a server restart and a fork."""

import multiprocessing
import threading
import time

import pytest
import redis

from celery_semaphore import BackendUnavailable, Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.backends.base import EMPTY_TTL
from celery_semaphore.backends.redis.backend import KEY_SUFFIXES, RedisBackend, _redis_url
from celery_semaphore.traffic import traffic_meta
from tests import servers
from tests.util import hand_over, wait_until

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def prefix():
    return f"{servers.unique_tag()}:"


def keys_of(client, prefix):
    return sorted(k.decode() for k in client.scan_iter(match=f"{prefix}*"))


def test_keys_share_the_hash_tag_and_expire_when_idle(redis_url, prefix):
    sem = Semaphore("imgs", 1, redis_url, key_prefix=prefix, idle_ttl=120)
    held = sem.acquire()
    waiter = threading.Thread(target=lambda: sem.acquire(timeout=5).release())
    waiter.start()
    assert wait_until(lambda: sem.status().waiting == 1)
    client = redis.Redis.from_url(redis_url)
    keys = keys_of(client, prefix)
    assert len(keys) >= 6
    for key in keys:
        assert key.startswith(f"{prefix}{{imgs}}:")
        assert 0 < client.pttl(key) <= 120_000  # nothing lives forever
    held.release()
    waiter.join(10)
    for key in keys_of(client, prefix):
        assert 0 < client.pttl(key) <= 120_000
    assert get_backend(redis_url, key_prefix=prefix, idle_ttl=120).names() == ["imgs"]


def test_time_comes_from_the_server(redis_url, prefix, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 4_000_000_000.0)  # the client's clock is off
    sem = Semaphore("clock", 1, redis_url, key_prefix=prefix, ttl=30)
    lease = sem.acquire()
    monkeypatch.undo()
    (holder,) = sem.status().holders
    assert abs(holder.since - time.time()) < 5
    assert 25 < holder.expires_at - time.time() <= 30
    assert lease.verify() and lease.release()


def test_unreachable_server_names_the_url_without_password():
    backend = get_backend("redis://:s3cret@127.0.0.1:1/0", socket_connect_timeout=1)
    with pytest.raises(BackendUnavailable) as err:
        backend.ping()
    assert "127.0.0.1:1" in str(err.value) and "s3cret" not in str(err.value)
    with pytest.raises(BackendUnavailable):
        Semaphore("x", 1, backend).try_acquire()


@pytest.mark.serial  # kills every pub/sub connection of the shared server
def test_wake_ups_survive_a_killed_pubsub_connection(redis_url, prefix):
    # Polls are 20 s apart here, so a prompt admission can only come from a wake-up.
    sem = Semaphore("wake", 1, redis_url, key_prefix=prefix, poll_interval=30, waiter_ttl=60)
    got = []
    hand_over(sem, sem.acquire(), got, join_timeout=5)
    assert got, "no wake-up before the kill"
    client = redis.Redis.from_url(redis_url)
    assert client.client_kill_filter(_type="pubsub") >= 1
    time.sleep(2.0)  # the listener resubscribes (backoff starts at 0.1 s)
    released_at = hand_over(sem, got[0], got, join_timeout=10)
    assert len(got) == 2 and time.monotonic() - released_at < 5
    got[1].release()


# -- key layout and expiry, in detail --------------------------------------------------------------


@pytest.fixture
def backends(redis_url, prefix):
    """Make RedisBackends on the test server with a key prefix unique to the test."""
    made = []

    def make(**options):
        backend = RedisBackend(redis_url, key_prefix=prefix, **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def server(redis_url, prefix):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


def our_keys(server, prefix):
    return sorted(server.scan_iter(match=f"{prefix}*"))


def test_all_keys_share_the_prefix_and_hash_tag(backends, server, prefix):
    backend = backends()
    assert backend.acquire("images", "a", limit=2, ttl=30, meta={}, wait=True).grant
    # a second holder: the holders' index (slots, htask) is kept while two or more hold
    assert backend.acquire("images", "b", limit=2, ttl=30, meta={}, wait=True).grant
    # a fair-share waiter: wfair exists only while one waits
    assert backend.acquire("images", "c", limit=2, ttl=30, meta={"fair_key": "t"},
                           wait=True).position == 0
    keys = our_keys(server, prefix)
    assert keys == sorted(f"{prefix}{{images}}:{suffix}" for suffix in KEY_SUFFIXES)
    assert keys == sorted(backend.key_names("images").values())
    assert backend.names() == ["images"]


def test_every_key_has_a_ttl_after_every_operation(backends, server, prefix):
    idle_ttl = 3600.0
    one, two = backends(idle_ttl=idle_ttl), backends(idle_ttl=idle_ttl)

    def check(step):
        keys = our_keys(server, prefix)
        assert keys, step
        for key in keys:
            assert 0 < server.pttl(key) <= idle_ttl * 1000, (step, key, server.pttl(key))

    one.resize("ttl", 2)
    check("resize")
    for holder in ("a", "b"):
        assert one.acquire("ttl", holder, limit=2, ttl=30, meta={}, wait=True).grant
        check(f"acquire {holder}")
    assert two.acquire("ttl", "w1", limit=2, ttl=30, meta={"fair_key": "t"},
                       wait=True).position == 0
    check("queue w1")
    assert two.acquire("ttl", "w2", limit=2, ttl=30, meta={"x": 1}, wait=True).position == 1
    check("queue w2")
    assert one.renew("ttl", "a", 60) is not None
    check("renew")
    assert one.release("ttl", "a")
    check("release")
    assert two.acquire("ttl", "w1", limit=2, ttl=30, meta={}, wait=True).grant
    check("admit w1")
    two.cancel("ttl", "w2")
    check("cancel")
    assert one.release("ttl", "b") and two.release("ttl", "w1")
    check("release all")  # only config is left, and it keeps the limit until idle
    assert our_keys(server, prefix) == [one.key_names("ttl")["config"]]


def test_an_idle_semaphore_leaves_nothing_behind(backends, server, prefix):
    backend = backends(idle_ttl=1.0, waiter_ttl=30.0)
    assert backend.acquire("idle", "a", limit=1, ttl=0.5, meta={}, wait=True).grant
    assert backend.acquire("idle", "b", limit=1, ttl=0.5, meta={}, wait=True).position == 0
    # In use, the keys outlive idle_ttl: each operation keeps them.
    for _ in range(6):
        time.sleep(0.3)
        backend.acquire("idle", "b", limit=1, ttl=0.5, meta={}, wait=True)
    assert backend.status("idle").limit == 1
    assert wait_until(lambda: not our_keys(server, prefix), timeout=3.0)
    assert backend.status("idle") is None and backend.names() == []


def test_an_empty_semaphore_is_forgotten_a_minute_after_it_empties(backends, server, prefix):
    """A template's keys leave nothing behind soon after their backlog (EMPTY_TTL), but a
    semaphore in use, one whose limit an operator pinned, or one whose rate has a start due
    later keeps its state."""
    backend = backends()  # idle_ttl: a week
    config = backend.key_names("api:1")["config"]
    week, empty = backend.idle_ttl * 1000, EMPTY_TTL * 1000
    assert backend.acquire("api:1", "a", limit=1, ttl=30, meta={}, wait=True).grant
    assert backend.acquire("api:1", "b", limit=1, ttl=30, meta={}, wait=True).position == 0
    backend.cancel("api:1", "b")  # a waiter leaves; a holder stays
    assert server.pttl(config) > empty
    assert backend.release("api:1", "a")
    assert 0 < server.pttl(config) <= empty
    assert backend.names() == ["api:1"] and backend.status("api:1").limit == 1
    assert backend.acquire("api:1", "c", limit=1, ttl=30, meta={}, wait=True).grant
    assert all(server.pttl(key) > week - 60_000 for key in our_keys(server, prefix))
    assert backend.release("api:1", "c") and 0 < server.pttl(config) <= empty

    backend.resize("pinned", 3)  # an operator's limit stays
    assert backend.acquire("pinned", "a", limit=1, ttl=30, meta={}, wait=True).grant
    assert backend.release("pinned", "a")
    assert server.pttl(backend.key_names("pinned")["config"]) > week - 60_000

    hourly = traffic_meta(rate=(3600.0, 1))  # the next start is due in an hour
    assert backend.acquire("hourly", "a", limit=2, ttl=30, meta=hourly, wait=True).grant
    assert backend.release("hourly", "a")
    assert 3_500_000 < server.pttl(backend.key_names("hourly")["config"]) <= 3_602_000


# -- the client and the wake-up listener -----------------------------------------------------------


def test_every_operation_raises_backend_unavailable_when_unreachable():
    backend = RedisBackend("redis://:secret@127.0.0.1:1/0", socket_connect_timeout=1.0)
    try:
        for call in (backend.ping, backend.names, lambda: backend.status("x"),
                     lambda: backend.acquire("x", "h", limit=1, ttl=1, meta={}, wait=False)):
            with pytest.raises(BackendUnavailable) as err:
                call()
            assert "127.0.0.1:1" in str(err.value)
            assert "secret" not in str(err.value)
    finally:
        backend.close()


def test_construction_does_not_connect():
    RedisBackend("redis://127.0.0.1:1/0").close()


def test_socket_urls_become_unix_urls():
    assert _redis_url("redis+socket:///run/redis.sock?virtual_host=2") == (
        "unix:///run/redis.sock?db=2")
    assert _redis_url("rediss://:pw@host:6380/1") == "rediss://:pw@host:6380/1"


def test_a_broken_callback_does_not_stop_the_listener(backends):
    backend = backends()
    woken = threading.Event()

    def broken():
        raise RuntimeError("boom")

    backend.acquire("cb", "a", limit=1, ttl=30, meta={}, wait=True)
    backend.watch("cb", "b", broken)
    backend.watch("cb", "c", woken.set)
    backend.acquire("cb", "b", limit=1, ttl=30, meta={}, wait=True)
    backend.acquire("cb", "c", limit=1, ttl=30, meta={}, wait=True)
    backend.resize("cb", 3)  # b and c become admissible: b's callback raises, c's must run
    assert woken.wait(5)
    assert backend._listener.is_alive()
    backend.close()
    assert wait_until(lambda: not backend._listener.is_alive(), timeout=5)


def _wait_in_child(backend, admitted_after):
    # The parent's backend instance, used after fork: it needs its own wake-up channel.
    sem = Semaphore("forked", 1, backend, poll_interval=30)
    started = time.monotonic()
    sem.acquire(timeout=20).release()
    admitted_after.value = time.monotonic() - started


def test_a_forked_child_gets_its_own_wakeups(backends):
    backend = backends()
    backend.watch("other", "x", lambda: None)  # the parent's listener is running
    held = Semaphore("forked", 1, backend).acquire()
    admitted_after = FORK.Value("d", -1.0)
    child = FORK.Process(target=_wait_in_child, args=(backend, admitted_after))
    child.start()
    assert wait_until(lambda: backend.status("forked").waiting == 1)
    time.sleep(0.2)
    held.release()
    child.join(25)
    assert child.exitcode == 0
    assert 0 <= admitted_after.value < 5  # woken, not the 30 s poll


def test_the_listener_outlives_a_server_restart(tmp_path, caplog):
    from tests.servers import free_port

    port = free_port()
    proc, client = servers.start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    waiter, holder = RedisBackend(url), RedisBackend(url)
    woken = threading.Event()
    try:
        waiter.watch("restart", "b", woken.set)
        proc.terminate()
        proc.wait(10)
        time.sleep(1.0)  # the listener notices, logs, and keeps retrying with backoff
        proc, client = servers.start_redis(port, tmp_path)
        assert wait_until(lambda: client.pubsub_numsub(f"semaphore:wake:{waiter.client_id}")
                          [0][1] == 1)
        assert holder.acquire("restart", "a", limit=1, ttl=30, meta={}, wait=True).grant
        assert waiter.acquire("restart", "b", limit=1, ttl=30, meta={}, wait=True).position == 0
        holder.release("restart", "a")
        assert woken.wait(5), "no wake-up after the server came back"
        assert "wake-up channel" in caplog.text and "lost" in caplog.text
    finally:
        waiter.close()
        holder.close()
        proc.terminate()
        proc.wait(10)


def test_the_listener_is_back_promptly_after_an_outage_and_wakes_every_waiter(tmp_path):
    """The server is down long enough for the listener's reconnection pause to reach its
    longest, then returns: the listener resubscribes within a fraction of a second (before:
    its backoff grew to 5 s; ~1.9 s seen after a restart) and wakes every watcher once, since
    what was published while it was away is lost (before: nobody was woken)."""
    port = servers.free_port()
    proc, client = servers.start_redis(port, tmp_path)
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0")
    woken = {holder: threading.Event() for holder in ("a", "b", "c")}
    try:
        for holder, event in woken.items():
            backend.watch("outage", holder, event.set)
        proc.kill()
        proc.wait(10)
        assert wait_until(lambda: backend._listener_lost, timeout=5)
        time.sleep(3.5)  # the outage: the listener keeps trying meanwhile
        proc, client = servers.start_redis(port, tmp_path)
        back_at = time.monotonic()
        assert all(event.wait(5) for event in woken.values()), "not every waiter was woken"
        woken_after = time.monotonic() - back_at
        assert client.pubsub_numsub(f"semaphore:wake:{backend.client_id}")[0][1] == 1
        assert woken_after < 0.6, woken_after
    finally:
        backend.close()
        proc.kill()
        proc.wait(10)


def test_a_holders_repeat_acquire_restores_a_config_that_expired(backends, server, prefix):
    """Keys of one semaphore can expire apart (each has its own TTL): a holder asking again
    must not leave a config without its limit (status would then say nobody holds)."""
    backend = backends()
    assert backend.acquire("cfg", "h1", limit=2, ttl=30, meta={}, wait=False).grant
    server.delete(f"{prefix}{{cfg}}:config")
    assert backend.acquire("cfg", "h1", limit=2, ttl=30, meta={}, wait=False).grant
    status = backend.status("cfg")
    assert status is not None and status.limit == 2 and status.held == 1


def test_a_lease_longer_than_the_idle_ttl_is_refused(redis_url, prefix):
    from celery_semaphore import ConfigurationError

    with pytest.raises(ConfigurationError, match="idle_ttl"):
        Semaphore("long", 1, redis_url, ttl=100, key_prefix=prefix, idle_ttl=60)
    Semaphore("long", 1, redis_url, ttl=50, key_prefix=prefix, idle_ttl=60)  # fine


def test_a_server_that_cannot_serve_raises_backend_unavailable(tmp_path):
    """OOM (maxmemory, no eviction), BUSY (another client's script overran) and NOPERM are
    Redis saying "not now", like a lost connection: one exception type for callers to handle."""
    from tests.servers import free_port

    port = free_port()
    proc, client = servers.start_redis(port, tmp_path)
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0")
    try:
        client.config_set("maxmemory", 1)
        with pytest.raises(BackendUnavailable, match="OOM|maxmemory"):
            backend.acquire("full", "h", limit=1, ttl=30, meta={}, wait=False)
        client.config_set("maxmemory", 0)

        client.config_set("busy-reply-threshold", 50)
        runaway = threading.Thread(target=_run_forever_script, args=(port,), daemon=True)
        runaway.start()
        assert wait_until(lambda: _busy_reply(backend))
        for call in (lambda: backend.acquire("x", "h", limit=1, ttl=30, meta={}, wait=False),
                     lambda: backend.verify("x", "h"), backend.ping):
            with pytest.raises(BackendUnavailable, match="BUSY"):
                call()
        redis.Redis(port=port).script_kill()
        runaway.join(10)

        client.acl_setuser("limited", enabled=True, nopass=True, commands=["+ping", "+hello"],
                           keys=["*"])
        limited = RedisBackend(f"redis://limited@127.0.0.1:{port}/0")
        with pytest.raises(BackendUnavailable, match="NOPERM|permission"):
            limited.acquire("x", "h", limit=1, ttl=30, meta={}, wait=False)
        limited.close()
        assert backend.acquire("x", "h", limit=1, ttl=30, meta={}, wait=False).grant
    finally:
        backend.close()
        proc.terminate()
        proc.wait(10)


def test_a_replica_cut_off_from_its_master_is_unavailable_not_a_cluster(tmp_path):
    """MASTERDOWN (redis-py's MasterDownError is a ClusterDownError) comes from a plain replica
    during a failover, not only from Redis Cluster."""
    from tests.servers import free_port

    port = free_port()
    proc, _ = servers.start_redis(port, tmp_path, "--replicaof", "127.0.0.1", str(free_port()),
                           "--replica-serve-stale-data", "no")
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0")
    try:
        with pytest.raises(BackendUnavailable, match="(?i)master is down"):
            backend.verify("x", "h")
        with pytest.raises(BackendUnavailable, match="(?i)master is down"):
            backend.acquire("x", "h", limit=1, ttl=30, meta={}, wait=False)
    finally:
        backend.close()
        proc.terminate()
        proc.wait(10)


def _run_forever_script(port):
    try:
        redis.Redis(port=port).eval("while true do end", 0)
    except redis.ResponseError:  # killed by the test's SCRIPT KILL
        pass


def _busy_reply(backend):
    try:
        backend.ping()
    except BackendUnavailable as exc:
        return "BUSY" in str(exc)
    return False


def test_a_redis_cluster_node_is_refused_with_a_clear_error(tmp_path):
    from celery_semaphore import ConfigurationError

    port = servers.free_cluster_port()
    proc, _ = servers.start_redis(port, tmp_path, "--cluster-enabled", "yes",
                           "--cluster-config-file", str(tmp_path / "nodes.conf"))
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0")
    try:
        for call in (lambda: backend.acquire("x", "h", limit=1, ttl=30, meta={}, wait=False),
                     lambda: backend.verify("x", "h")):
            with pytest.raises(ConfigurationError, match=r"use a redis\+cluster:// URL"):
                call()
    finally:
        backend.close()
        proc.terminate()
        proc.wait(10)


# -- pushed grants ------------------------------------------------------------------------


def _wakes(backend):
    """Every wake-up the backend's channel carries for this process, parsed."""
    client = redis.Redis.from_url(backend.url, decode_responses=True)
    pubsub = client.pubsub()
    pubsub.subscribe(backend._channel_prefix + backend.client_id)
    assert wait_until(lambda: (pubsub.get_message(timeout=0.1) or {}).get("type")
                      == "subscribe")
    got = []

    def read():
        message = pubsub.get_message(timeout=0.05)
        if message and message["type"] == "message":
            got.append(backend.pushed_grant(message["data"]))
        return got

    read.client = client  # (a client that is collected closes its connections)
    return read, pubsub


META = {"task_id": "t", "task": "x"}


def test_a_release_pushes_the_slot_to_the_next_waiter_in_one_operation(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    read, pubsub = _wakes(backend)
    try:
        assert backend.acquire("p", "h:1", limit=1, ttl=30, meta=META, wait=True).grant
        first = backend.acquire("p", "w1:1", limit=1, ttl=30, meta=META, wait=True, push=True)
        second = backend.acquire("p", "w2:1", limit=1, ttl=30, meta=META, wait=True, push=True)
        assert first.position == 0 and second.position == 1
        assert backend.release("p", "h:1")
        # granted there and then, in FIFO order: the holder is w1 before anyone asks again
        status = backend.status("p")
        assert [h.holder for h in status.holders] == ["w1:1"] and status.waiting == 1
        assert wait_until(lambda: len(read()) == 1)
        ((name, holder, pushed),) = read()
        assert (name, holder) == ("p", "w1:1") and pushed.grant.ttl == pytest.approx(30)
        (held,) = status.holders
        assert (pushed.grant.slot, pushed.grant.epoch) == (held.slot, held.epoch)
        # its next acquire returns that very grant; a cancel (abandon) would release it
        again = backend.acquire("p", "w1:1", limit=1, ttl=30, meta=META, wait=True, push=True)
        assert again.grant.epoch == pushed.grant.epoch
        backend.abandon_all(["p"], "w1:1")
        assert [h.holder for h in backend.status("p").holders] == ["w2:1"]
    finally:
        pubsub.close()
        backend.reset("p")


def test_a_waiter_without_push_is_woken_and_takes_its_slot_itself(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    read, pubsub = _wakes(backend)
    try:
        backend.acquire("q", "h:1", limit=1, ttl=30, meta=META, wait=True)
        backend.acquire("q", "w:1", limit=1, ttl=30, meta=META, wait=True)
        backend.release("q", "h:1")
        assert wait_until(lambda: len(read()) == 1)
        assert read()[0][2] is None  # a plain wake-up
        assert backend.status("q").held == 0
    finally:
        pubsub.close()
        backend.reset("q")


def test_pushed_grants_keep_the_rules_twins_costs_and_rate(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    try:
        # a twin of a holder is not pushed while that holder holds
        backend.acquire("tw", "task1:a", limit=2, ttl=30, meta=META, wait=True)
        backend.acquire("tw", "other:a", limit=2, ttl=30, meta=META, wait=True)
        backend.acquire("tw", "task1:b", limit=2, ttl=30, meta=META, wait=True, push=True)
        backend.release("tw", "other:a")
        assert {h.holder for h in backend.status("tw").holders} == {"task1:a"}
        backend.release("tw", "task1:a")
        assert {h.holder for h in backend.status("tw").holders} == {"task1:b"}
        # costs: a waiter needing 2 units is pushed only once both are free
        cost2 = {**META, **traffic_meta(2, 0, None, 1)}
        backend.acquire("c", "u1:1", limit=2, ttl=30, meta=META, wait=True)
        backend.acquire("c", "big:1", limit=2, ttl=30, meta=cost2, wait=True, push=True)
        backend.acquire("c", "u2:1", limit=2, ttl=30, meta=META, wait=True)  # behind big
        assert backend.status("c").held == 1
        backend.release("c", "u1:1")
        assert [h.holder for h in backend.status("c").holders] == ["big:1"]
        # a rate: one start per operation, whoever waits
        rated = {**META, **traffic_meta(1, 0, (60.0, 1), 1)}
        assert backend.acquire("r", "r0:1", limit=5, ttl=30, meta=rated, wait=True).grant
        for i in (1, 2):
            backend.acquire("r", f"r{i}:1", limit=5, ttl=30, meta=rated, wait=True, push=True)
        backend.release("r", "r0:1")
        assert backend.status("r").held == 0  # the rate holds back the next start
    finally:
        for name in ("tw", "c", "r"):
            backend.reset(name)


def test_a_grant_reports_the_units_left_free_that_nobody_waits_for(redis_url, prefix):
    backend = get_backend(redis_url, key_prefix=prefix)
    try:
        assert backend.acquire("f", "a:1", limit=3, ttl=30, meta=META, wait=True).free == 2
        assert backend.acquire("f", "b:1", limit=3, ttl=30, meta=META, wait=True).free == 1
        assert backend.acquire("f", "c:1", limit=3, ttl=30, meta=META, wait=True).free == 0
    finally:
        backend.reset("f")
