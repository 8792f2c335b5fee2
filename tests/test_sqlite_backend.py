"""SQLite-specific behaviour: URLs, forking while another thread is inside a transaction."""

import multiprocessing
import os
import threading
import time

import pytest

from celery_semaphore import ConfigurationError, Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.backends.sqlite import database_path
from tests.util import forked_child_waits, hand_over

FORK = multiprocessing.get_context("fork")


def test_url_convention():
    assert database_path("sqlite:////abs/path.db") == "/abs/path.db"
    assert database_path("sqlite:///rel.db") == os.path.abspath("rel.db")
    for bad in ("sqlite://", "sqlite:///", "sqlite://host/x.db"):
        with pytest.raises(ConfigurationError):
            database_path(bad)


def _child_uses_the_database(url):
    backend = get_backend(url, busy_timeout=2.0)
    backend.status("forky")
    Semaphore("forky", 1, url, busy_timeout=2.0).try_acquire()


def test_fork_while_another_thread_is_in_a_transaction(tmp_path):
    """A prefork pool forks children while the gate's threads use the database."""
    url = f"sqlite:///{tmp_path}/fork.db"
    sem = Semaphore("busy", 1, url)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            sem.acquire().release()

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        failures = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            child = FORK.Process(target=_child_uses_the_database, args=(url,))
            child.start()
            child.join(20)
            failures += child.exitcode != 0
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == 0


def test_forked_child_gets_its_own_wake_ups(tmp_path):
    """A semaphore made before fork (a module-level one in a prefork pool) and used in the
    child: the child must listen for its own wake-ups, not rely on the poll."""
    url = f"sqlite:///{tmp_path}/forked.db"
    sem = Semaphore("inherited", 1, url, poll_interval=30, waiter_ttl=60)
    held = sem.acquire()
    waiter = threading.Thread(target=lambda: sem.acquire(timeout=20).release())
    waiter.start()  # the parent listens for wake-ups before forking
    held.release()
    waiter.join(10)
    # polls are 20 s apart: only a wake-up is this fast
    assert 0 <= forked_child_waits(sem) < 5


def test_reads_do_not_create_the_database_file(tmp_path):
    """An operator's `status` with a mistyped (or relative, other-directory) path must not
    leave an empty database behind."""
    path = tmp_path / "nowhere.db"
    backend = get_backend(f"sqlite:///{path}")
    assert backend.status("x") is None and backend.names() == []
    assert backend.verify("x", "h") is False
    assert not path.exists()



def test_status_and_verify_neither_wait_for_nor_hold_the_write_lock(tmp_path):
    """A reader (`top`, the exporter, a task's fencing check) reads the last committed state
    while another process holds the database's write lock (it took it with BEGIN IMMEDIATE
    and waited out busy_timeout before, then failed: 'is locked')."""
    import sqlite3

    path = tmp_path / "s.db"
    backend = get_backend(f"sqlite:///{path}", busy_timeout=2.0)
    assert backend.acquire("s", "a:1", limit=2, ttl=30, meta={}, wait=False).grant
    writer = sqlite3.connect(str(path), isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        status = backend.status("s")
        assert [h.holder for h in status.holders] == ["a:1"] and status.limit == 2
        assert backend.verify("s", "a:1") is True and backend.verify("s", "b:1") is False
        writer.execute("ROLLBACK")
        assert backend.release("s", "a:1")  # and a writer still gets the lock after them
    finally:
        writer.close()

def test_a_blocked_wakeup_directory_costs_only_the_wakeups(tmp_path, caplog):
    """The socket directory's name is predictable: if it cannot be used (a file there, another
    user's directory), waiters poll instead of failing."""
    url = f"sqlite:///{tmp_path}/blocked.db"
    backend = get_backend(url)
    open(backend._socket_dir, "w").close()  # a file where the directory goes
    try:
        sem = Semaphore("blocked", 1, url, poll_interval=0.1)
        got = []
        hand_over(sem, sem.acquire(), got, join_timeout=10, acquire_timeout=10)
        assert got and got[0].release()
        assert "no wake-ups" in caplog.text
    finally:
        os.unlink(backend._socket_dir)


def test_an_empty_semaphore_is_kept_a_minute_and_a_pinned_one_its_idle_ttl(tmp_path):
    """Document backends (SQLite here; memory and PostgreSQL write the same expiry, from
    ``State.keep_for``): an empty semaphore's row expires EMPTY_TTL after it empties."""
    import sqlite3

    from celery_semaphore.backends.base import EMPTY_TTL

    path = tmp_path / "sem.db"
    backend = get_backend(f"sqlite:///{path}")
    backend.resize("pinned", 2)

    def left():
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT name, expires FROM semaphores").fetchall()
        prefix = backend.key_prefix
        return {name[len(prefix):]: expires - time.time() for name, expires in rows}

    for name in ("api:1", "pinned"):
        assert backend.acquire(name, "a", limit=1, ttl=30, meta={}, wait=True).grant
    assert all(seconds > EMPTY_TTL for seconds in left().values())
    for name in ("api:1", "pinned"):
        assert backend.release(name, "a")
    seconds = left()
    assert 0 < seconds["api:1"] <= EMPTY_TTL and seconds["pinned"] > EMPTY_TTL
    assert backend.acquire("api:1", "b", limit=1, ttl=30, meta={}, wait=True).grant
    assert left()["api:1"] > EMPTY_TTL  # in use again: kept
