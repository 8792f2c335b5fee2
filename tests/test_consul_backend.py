"""The Consul backend beyond the contract suite, and the Consul test double's own protocol.

Backend tests run against ``consul_url`` (the double, or a real agent via CONSUL_HTTP_ADDR);
the protocol tests start doubles of their own, so the double is checked against what Consul's
API documentation says, not only against what the backend happens to use.
"""

import base64
import http.client
import json
import multiprocessing
import os
import threading
import time

import pytest

from celery_semaphore import BackendUnavailable, ConfigurationError, Semaphore
from celery_semaphore.backends import close_all, get_backend
from celery_semaphore.backends.consul.backend import (
    ConsulBackend,
    ConsulConfig,
    kv_root,
    session_ttl,
)
from tests import servers
from tests.consul_double import ConsulDouble
from tests.util import wait_until

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def prefix():
    yield f"{servers.unique_tag()}:"
    close_all()


def sem(url, prefix, name="c", limit=1, **kwargs):
    return Semaphore(name, limit, url, key_prefix=prefix, **kwargs)


def admin(url):
    """A plain py-consul client, as an operator's tooling would use."""
    return ConsulConfig.parse(url).client()


def contenders(url, prefix, name):
    """The contender keys of a semaphore (``<prefix><session>``)."""
    _, keys = admin(url).kv.get(f"{kv_root(prefix)}{name}/", keys=True)
    return [k for k in keys or [] if not k.endswith("/.lock")]


def lock_doc(url, prefix, name):
    _, pair = admin(url).kv.get(f"{kv_root(prefix)}{name}/.lock")
    return json.loads(pair["Value"])


# -- sessions and leases ------------------------------------------------------------------


def test_operator_destroying_the_session_loses_the_lease_within_a_second(consul_url, prefix):
    s = sem(consul_url, prefix, ttl=0.6, auto_renew=True)
    lease = s.acquire()
    lost = threading.Event()
    lease.on_lost(lambda _lease: lost.set())
    session = lock_doc(consul_url, prefix, "c")["Sessions"][lease.holder]
    destroyed_at = time.monotonic()
    admin(consul_url).session.destroy(session)  # consul session destroy <id>
    assert lost.wait(1.0)
    assert time.monotonic() - destroyed_at < 1.0
    assert not lease.verify()
    assert s.status().held == 0
    assert s.try_acquire() is not None


def test_invalidated_session_drops_its_holder_on_the_next_operation(consul_url, prefix):
    s = sem(consul_url, prefix, ttl=60)
    lease = s.acquire()
    doc = lock_doc(consul_url, prefix, "c")
    assert doc["Limit"] == 1 and doc["Holders"] == [doc["Sessions"][lease.holder]]
    admin(consul_url).session.destroy(doc["Holders"][0])
    assert s.status().held == 0  # status prunes what it shows without writing
    assert lock_doc(consul_url, prefix, "c")["Holders"] == doc["Holders"]
    other = s.try_acquire()  # the next write drops it from .lock for good
    assert other is not None
    assert lock_doc(consul_url, prefix, "c")["Holders"] == [
        lock_doc(consul_url, prefix, "c")["Sessions"][other.holder]]
    assert lease.renew() is False and lease.lost


def test_a_holder_that_stops_renewing_is_pruned_and_its_session_destroyed(consul_url, prefix):
    s = sem(consul_url, prefix, ttl=0.5)
    stale = s.acquire()
    session = lock_doc(consul_url, prefix, "c")["Sessions"][stale.holder]
    client = admin(consul_url)
    _, info = client.session.info(session)
    assert info["TTL"] == "10s" and info["Behavior"] == "delete"  # Consul's minimum TTL
    _, keys = client.kv.get(f"{kv_root(prefix)}c/", keys=True)
    assert f"{kv_root(prefix)}c/{session}" in keys  # the contender key
    assert s.try_acquire() is None
    time.sleep(0.6)  # sleep-ok: the stale holder's 0.5 s lease runs out unrenewed
    fresh = s.try_acquire()
    assert fresh is not None
    assert client.session.info(session)[1] is None
    _, keys = client.kv.get(f"{kv_root(prefix)}c/", keys=True)
    assert f"{kv_root(prefix)}c/{session}" not in keys
    assert stale.release() is False and fresh.release() is True


def test_sessions_another_process_pruned_are_forgotten(consul_url, prefix):
    """A lease of ours that another process pruned (and whose session it destroyed) must not
    stay in our table of sessions for ever: one entry per lost lease would add up."""
    ours, theirs = (ConsulBackend(consul_url, key_prefix=prefix) for _ in range(2))
    try:
        assert ours.acquire("c", "a", limit=1, ttl=0.3, meta={}, wait=False).grant
        [session] = ours.sessions.owned
        time.sleep(0.4)  # sleep-ok: our 0.3 s lease runs out unrenewed
        assert theirs.acquire("c", "b", limit=1, ttl=30, meta={}, wait=False).grant  # prunes a
        assert admin(consul_url).session.info(session)[1] is None
        ttl, renewed = ours.sessions.owned[session]
        ours.sessions.owned[session] = (ttl, renewed - 2 * ttl - 1)  # twice its TTL without renewal
        assert theirs.release("c", "b")
        assert ours.acquire("c", "c", limit=1, ttl=30, meta={}, wait=False).grant
        assert session not in ours.sessions.owned and len(ours.sessions.owned) == 1
    finally:
        ours.close()
        theirs.close()


def test_release_lends_the_session_to_our_next_waiter_and_reset_destroys_sessions(
    consul_url, prefix
):
    s = sem(consul_url, prefix, "r", 2)
    a, b = s.acquire(), s.acquire()
    sessions = lock_doc(consul_url, prefix, "r")["Sessions"]
    mine, theirs = sessions[a.holder], sessions[b.holder]
    a.release()
    get_backend(consul_url, key_prefix=prefix).reset("r")
    client = admin(consul_url)
    assert client.session.info(theirs)[1] is None  # reset: destroyed at once
    assert not b.verify()
    c = s.acquire()  # this process's next holder reuses the released session
    assert lock_doc(consul_url, prefix, "r")["Sessions"] == {c.holder: mine}
    c.release()
    # Unused, a released session lives spare_keep (1 s) more, then goes with its key.
    assert wait_until(lambda: client.session.info(mine)[1] is None, timeout=5)
    _, keys = client.kv.get(f"{kv_root(prefix)}r/", keys=True)
    assert keys == [f"{kv_root(prefix)}r/.lock"]


def test_a_failed_try_acquire_leaves_no_session_behind(consul_url, prefix):
    s = sem(consul_url, prefix, "f", 1)
    held = s.acquire()
    _, before = admin(consul_url).session.list()
    for _ in range(3):
        assert s.try_acquire() is None
    _, after = admin(consul_url).session.list()
    assert len(after) == len(before)
    held.release()


def test_a_waiter_whose_early_session_died_gets_a_new_one_on_admission(consul_url, prefix):
    s = sem(consul_url, prefix, "e", 1)
    held = s.acquire()
    results = []
    waiter = threading.Thread(target=lambda: results.append(s.acquire(timeout=20)))
    waiter.start()
    client = admin(consul_url)
    holding = set(lock_doc(consul_url, prefix, "e")["Holders"])

    def early_sessions():  # contender keys are named after their session
        return {k.rsplit("/", 1)[1] for k in contenders(consul_url, prefix, "e")} - holding

    assert wait_until(early_sessions)  # made while it waits first in line
    destroyed = early_sessions()
    for session in destroyed:
        client.session.destroy(session)  # an operator, or a missed renewal
    held.release()
    waiter.join(10)
    (lease,) = results
    assert lease.verify()
    (session,) = lock_doc(consul_url, prefix, "e")["Holders"]
    assert session not in destroyed and client.session.info(session)[1] is not None
    lease.release()


def test_close_destroys_the_sessions_kept_for_reuse(consul_url, prefix):
    backend = ConsulBackend(consul_url, key_prefix=prefix, spare_keep=60)
    s = Semaphore("k", 1, backend, key_prefix=prefix)
    s.acquire().release()  # its session is kept for a minute for this process's next holder
    (key,) = contenders(consul_url, prefix, "k")
    assert admin(consul_url).session.info(key.rsplit("/", 1)[1])[1] is not None
    backend.close()
    assert contenders(consul_url, prefix, "k") == []


def test_short_lived_threads_leave_no_connection_open(consul_url, prefix):
    """Callers' threads, the spare-session sweeper and the watchers come and go; they share
    a few pooled HTTP connections (one per thread would pile up to Consul's per-client
    connection limit in a long-lived worker)."""
    from celery_semaphore.backends.consul import http as module

    operator = admin(consul_url)  # one client (one pooled connection) for every look below

    def contenders_left():
        _, keys = operator.kv.get(f"{kv_root(prefix)}t/", keys=True)
        return [k for k in keys or [] if not k.endswith("/.lock")]

    assert contenders_left() == []
    fds = len(os.listdir("/proc/self/fd"))
    backend = ConsulBackend(consul_url, key_prefix=prefix, spare_keep=0.05)
    s = Semaphore("t", 1, backend, key_prefix=prefix)
    for _ in range(10):
        held = s.acquire()
        waiter = threading.Thread(target=lambda: s.acquire(timeout=10).release())
        waiter.start()  # queues, so a watcher thread starts
        assert wait_until(lambda: s.status().waiting == 1)
        held.release()
        waiter.join(10)
        # the sweeper destroys the spare sessions (Consul deletes their contender keys)
        assert wait_until(lambda: contenders_left() == [], timeout=10)
    transport = backend.client.http
    assert len(transport._idle) <= module.MAX_IDLE_CONNECTIONS
    assert len(os.listdir("/proc/self/fd")) < fds + 8  # not one per thread (30 threads ran)
    backend.close()
    assert transport._idle == []


def test_a_lock_document_over_consuls_value_limit_is_refused_clearly(consul_url, prefix,
                                                                     monkeypatch):
    from celery_semaphore.backends.consul import backend as module

    monkeypatch.setattr(module, "MAX_VALUE_SIZE", 3000)  # Consul's is 512 KiB
    s = sem(consul_url, prefix, "v", 1)
    held = s.acquire()
    backend = get_backend(consul_url, key_prefix=prefix)
    with pytest.raises(BackendUnavailable, match="512 KiB value limit"):
        for n in range(50):
            backend.acquire("v", f"w{n}", limit=1, ttl=30, meta={"pad": "x" * 50}, wait=True)
    assert s.status().held == 1  # nothing half-written
    assert held.release()  # a smaller document still goes through


# -- limits and wake-ups across processes ---------------------------------------------------


def _wait_in_child(url, prefix, name, limit, admitted):
    lease = Semaphore(name, limit, url, key_prefix=prefix, poll_interval=30).acquire(timeout=20)
    admitted.set()
    lease.release()


def _child_waiter(url, prefix, name, limit):
    admitted = FORK.Event()
    child = FORK.Process(target=_wait_in_child, args=(url, prefix, name, limit, admitted))
    child.start()
    return child, admitted


def test_release_wakes_a_waiter_in_another_process(consul_url, prefix):
    s = sem(consul_url, prefix, "x", 1)
    held = s.acquire()
    child, admitted = _child_waiter(consul_url, prefix, "x", 1)
    assert wait_until(lambda: s.status().waiting == 1)
    released_at = time.monotonic()
    held.release()
    assert admitted.wait(5)
    assert time.monotonic() - released_at < 1.0  # a blocking query, not the 30 s poll
    child.join(5)


def test_resize_up_wakes_another_process_and_down_admits_nobody(consul_url, prefix):
    s = sem(consul_url, prefix, "g", 1)
    held = s.acquire()
    child, admitted = _child_waiter(consul_url, prefix, "g", 1)
    assert wait_until(lambda: s.status().waiting == 1)
    get_backend(consul_url, key_prefix=prefix).resize("g", 3)  # as `celery semaphore resize`
    assert admitted.wait(1.0)  # its watcher, not its retry (every waiter_ttl / 3 = 1.7 s)
    child.join(5)
    assert lock_doc(consul_url, prefix, "g")["Limit"] == 3
    more = [s.acquire(), s.acquire()]
    assert s.resize(1) is False
    assert lock_doc(consul_url, prefix, "g")["Limit"] == 1
    held.release()
    more[0].release()
    assert s.try_acquire() is None  # still 1 holder: at the new limit
    more[1].release()
    assert s.try_acquire() is not None


def test_contenders_with_different_declared_limits(consul_url, prefix):
    """The newest declaration (a process started later) is in force, in .lock's Limit too."""
    two = sem(consul_url, prefix, "d", 2, declared_at=1000.0)
    five = sem(consul_url, prefix, "d", 5, declared_at=2000.0)
    leases = [two.acquire()]  # "two" came first: it created the semaphore
    assert lock_doc(consul_url, prefix, "d")["Limit"] == 2
    leases += [five.acquire() for _ in range(4)]  # "five" started later: its limit rules
    assert two.try_acquire() is None  # and the older declaration does not put 2 back
    status = five.status()
    assert status.limit == 5 and set(status.declared) == {2, 5}
    assert lock_doc(consul_url, prefix, "d")["Limit"] == 5
    for lease in leases:
        lease.release()


# -- configuration --------------------------------------------------------------------------


def test_url_and_options_parsing():
    c = ConsulConfig.parse("consul://10.0.0.5?token=s3cr3t&dc=eu1")
    assert (c.host, c.port, c.scheme, c.token, c.dc, c.verify) == (
        "10.0.0.5", 8500, "http", "s3cr3t", "eu1", True)
    c = ConsulConfig.parse("consuls://consul.internal?verify=false")
    assert (c.port, c.scheme, c.verify, c.token) == (8501, "https", False, None)
    c = ConsulConfig.parse("consuls://h:9999?verify=/etc/ca.pem", token="kw", dc="dc2")
    assert (c.port, c.verify, c.token, c.dc) == (9999, "/etc/ca.pem", "kw", "dc2")
    with pytest.raises(ConfigurationError):
        ConsulConfig.parse("consul://h?tokn=x")
    assert kv_root("semaphore:") == "semaphore/" and kv_root("app/sem/") == "app/sem/"
    assert session_ttl(0.3) == 10 and session_ttl(42.1) == 43 and session_ttl(1e9) == 86400
    backend = ConsulBackend("consul://h?token=s3cr3t")
    assert "s3cr3t" not in repr(backend) and "token=**" in repr(backend)


def test_token_and_datacenter_reach_consul(prefix):
    double = ConsulDouble(acl_token="s3cr3t", datacenter="dc1").start()
    try:
        base = double.url
        with pytest.raises(BackendUnavailable) as err:
            sem(base, prefix).try_acquire()
        assert "s3cr3t" not in str(err.value)
        assert sem(f"{base}?token=s3cr3t&dc=dc1", prefix).try_acquire() is not None
        assert "s3cr3t" in double.tokens_seen
        assert sem(base, prefix, token="s3cr3t").status().held == 1
        with pytest.raises(BackendUnavailable):
            sem(f"{base}?token=s3cr3t&dc=mars", prefix).status()
    finally:
        double.stop()


def test_unreachable_agent_is_backend_unavailable(prefix):
    with pytest.raises(BackendUnavailable):
        get_backend("consul://127.0.0.1:1?timeout=1", key_prefix=prefix).ping()


# -- the double's protocol ------------------------------------------------------------------


@pytest.fixture
def double():
    d = ConsulDouble(min_ttl=0.0, ttl_multiplier=1.0).start()
    yield d
    d.stop()


def call(double, method, path, body=None, timeout=10):
    host, port = double.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request(method, path, body=body)
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    data = json.loads(raw) if raw and response.getheader("Content-Type", "").startswith(
        "application/json") else raw.decode()
    index = response.getheader("X-Consul-Index")
    return response.status, (int(index) if index else None), data


def new_session(double, **fields):
    status, _, data = call(double, "PUT", "/v1/session/create", json.dumps(fields))
    assert status == 200
    return data["ID"]


def test_double_kv_put_get_cas_and_indexes(double):
    assert call(double, "GET", "/v1/kv/a/b")[0] == 404
    assert call(double, "PUT", "/v1/kv/a/b?cas=0", b"one")[2] is True
    assert call(double, "PUT", "/v1/kv/a/b?cas=0", b"two")[2] is False  # exists
    status, index, [entry] = call(double, "GET", "/v1/kv/a/b")
    assert status == 200 and base64.b64decode(entry["Value"]) == b"one"
    assert entry["CreateIndex"] == entry["ModifyIndex"] == index
    assert entry["LockIndex"] == 0 and entry["Flags"] == 0 and "Session" not in entry
    assert call(double, "PUT", f"/v1/kv/a/b?cas={index - 1}", b"x")[2] is False
    assert call(double, "PUT", f"/v1/kv/a/b?cas={index}&flags=7", b"three")[2] is True
    _, index2, [entry] = call(double, "GET", "/v1/kv/a/b")
    assert index2 > index and entry["CreateIndex"] == index and entry["Flags"] == 7
    call(double, "PUT", "/v1/kv/a/c", b"")
    _, _, keys = call(double, "GET", "/v1/kv/a/?keys")
    assert keys == ["a/b", "a/c"]
    _, _, entries = call(double, "GET", "/v1/kv/a/?recurse&consistent")
    assert [e["Key"] for e in entries] == ["a/b", "a/c"] and entries[1]["Value"] is None
    _, single, _ = call(double, "GET", "/v1/kv/a/b")
    assert single > index2  # a single key answers with the KV table's index (a/c was last)
    assert call(double, "PUT", "/v1/kv/a/c", b"")[2] is True  # equal to the entry: no write
    _, list_index, _ = call(double, "GET", "/v1/kv/a/?recurse")
    assert list_index == single
    assert call(double, "DELETE", "/v1/kv/a/nothing?cas=5")[2] is True  # nothing to delete
    status, _, message = call(double, "PUT", "/v1/kv/a/big", b"x" * (512 * 1024 + 1))
    assert status == 413 and "too large" in message
    assert call(double, "DELETE", f"/v1/kv/a/b?cas={index}")[2] is False
    assert call(double, "DELETE", f"/v1/kv/a/b?cas={index2}")[2] is True
    _, after, _ = call(double, "GET", "/v1/kv/a/?recurse")
    assert after > list_index  # a delete raises the prefix's index (tombstone)
    assert call(double, "DELETE", "/v1/kv/a/?recurse")[2] is True
    assert call(double, "GET", "/v1/kv/a/?recurse")[0] == 404


def test_double_acquire_release_and_lock_index(double):
    s1, s2 = new_session(double), new_session(double)
    assert call(double, "PUT", f"/v1/kv/l?acquire={s1}", b"v1")[2] is True
    assert call(double, "PUT", f"/v1/kv/l?acquire={s2}", b"v2")[2] is False  # held by s1
    assert call(double, "PUT", f"/v1/kv/l?acquire={s1}", b"v3")[2] is True  # re-acquire
    _, _, [entry] = call(double, "GET", "/v1/kv/l")
    assert entry["LockIndex"] == 1 and entry["Session"] == s1
    assert base64.b64decode(entry["Value"]) == b"v3"
    assert call(double, "PUT", f"/v1/kv/l?release={s2}")[2] is False
    assert call(double, "PUT", f"/v1/kv/l?release={s1}")[2] is True
    assert "Session" not in call(double, "GET", "/v1/kv/l")[2][0]
    assert call(double, "PUT", f"/v1/kv/l?acquire={s2}")[2] is True
    assert call(double, "GET", "/v1/kv/l")[2][0]["LockIndex"] == 2
    assert call(double, "PUT", "/v1/kv/m?acquire=no-such-session")[0] == 500


def test_double_sessions_ttl_renew_and_invalidation(double):
    strict = ConsulDouble().start()
    try:
        status, _, message = call(strict, "PUT", "/v1/session/create", '{"TTL": "5s"}')
        assert status == 400 and "TTL" in message  # Consul's minimum is 10s
    finally:
        strict.stop()
    release = new_session(double, TTL="0.3s", LockDelay="0s")
    delete = new_session(double, TTL="0.3s", Behavior="delete", LockDelay="0s")
    call(double, "PUT", f"/v1/kv/r?acquire={release}", b"r")
    call(double, "PUT", f"/v1/kv/d?acquire={delete}", b"d")
    status, _, [info] = call(double, "GET", f"/v1/session/info/{release}")
    assert status == 200 and info["TTL"] == "0.3s" and info["Behavior"] == "release"
    for _ in range(3):
        time.sleep(0.15)
        assert call(double, "PUT", f"/v1/session/renew/{release}")[0] == 200
    assert call(double, "GET", "/v1/kv/r")[2][0]["Session"] == release
    assert wait_until(lambda: call(double, "GET", "/v1/kv/r")[2][0].get("Session") is None,
                      timeout=2)
    assert call(double, "GET", "/v1/kv/d")[0] == 404  # behavior delete
    assert call(double, "PUT", f"/v1/session/renew/{release}")[0] == 404
    assert call(double, "GET", f"/v1/session/info/{release}")[2] == []
    destroyed = new_session(double)  # default lock-delay 15s
    call(double, "PUT", f"/v1/kv/x?acquire={destroyed}")
    assert call(double, "PUT", f"/v1/session/destroy/{destroyed}")[2] is True
    assert call(double, "PUT", f"/v1/kv/x?acquire={new_session(double)}")[2] is False


def test_double_blocking_queries(double):
    call(double, "PUT", "/v1/kv/w/a", b"1")
    _, index, _ = call(double, "GET", "/v1/kv/w/?recurse")
    started = time.monotonic()
    _, same, _ = call(double, "GET", f"/v1/kv/w/?recurse&index={index}&wait=300ms")
    assert same == index and 0.25 < time.monotonic() - started < 2  # waited, nothing changed
    result = {}

    def block():
        result["answer"] = call(double, "GET", f"/v1/kv/w/?recurse&index={index}&wait=10s")
        result["at"] = time.monotonic()

    thread = threading.Thread(target=block)
    thread.start()
    assert wait_until(lambda: double.blocked == 1, timeout=5)  # waiting in the double
    assert "answer" not in result
    woken = double.woken_unchanged
    call(double, "PUT", "/v1/kv/other", b"x")  # outside the prefix: still blocked
    # woken by that write, it read its prefix, found nothing new and waits on
    assert wait_until(lambda: double.woken_unchanged > woken and double.blocked == 1, timeout=5)
    assert "answer" not in result
    written_at = time.monotonic()
    call(double, "PUT", "/v1/kv/w/b", b"2")
    thread.join(5)
    _, new_index, entries = result["answer"]
    assert new_index > index and len(entries) == 2 and result["at"] - written_at < 0.5
    assert call(double, "GET", "/v1/kv/w/a?dc=elsewhere")[0] == 500
