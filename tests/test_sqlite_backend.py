"""SQLite-specific behaviour: URLs, forking while another thread is inside a transaction."""

import multiprocessing
import os
import threading
import time

import pytest

from celery_semaphore import ConfigurationError, Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.backends.sqlite import database_path

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
