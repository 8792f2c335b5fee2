"""Redis-specific guarantees: key layout and expiry, server time, errors, wake-up recovery."""

import threading
import time
import uuid

import pytest
import redis

from celery_semaphore import BackendUnavailable, Semaphore
from celery_semaphore.backends import get_backend
from tests.util import wait_until


@pytest.fixture
def prefix():
    return f"rt{uuid.uuid4().hex[:8]}:"


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


def test_wake_ups_survive_a_killed_pubsub_connection(redis_url, prefix):
    # Polls are 20 s apart here, so a prompt admission can only come from a wake-up.
    sem = Semaphore("wake", 1, redis_url, key_prefix=prefix, poll_interval=30, waiter_ttl=60)
    held = sem.acquire()
    got = []
    first = threading.Thread(target=lambda: got.append(sem.acquire(timeout=30)))
    first.start()
    assert wait_until(lambda: sem.status().waiting == 1)
    held.release()
    first.join(5)
    assert got, "no wake-up before the kill"
    client = redis.Redis.from_url(redis_url)
    assert client.client_kill_filter(_type="pubsub") >= 1
    time.sleep(2.0)  # the listener resubscribes (backoff starts at 0.1 s)
    second = threading.Thread(target=lambda: got.append(sem.acquire(timeout=30)))
    second.start()
    assert wait_until(lambda: sem.status().waiting == 1)
    released_at = time.monotonic()
    got[0].release()
    second.join(10)
    assert len(got) == 2 and time.monotonic() - released_at < 5
    got[1].release()
