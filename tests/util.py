"""Small helpers shared by the tests."""

import multiprocessing
import threading
import time


def wait_until(predicate, timeout=10.0, interval=0.01):
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def retrying(fn, seconds=60.0, interval=0.5):
    """Call ``fn`` until it stops raising (a server is coming back), for up to ``seconds``;
    its result, or its last exception."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(interval)


def hand_over(sem, holder, got, join_timeout, acquire_timeout=30.0):
    """Queue one waiter on ``sem`` in a thread (its lease goes to the list ``got``), release
    ``holder`` once the waiter is in line, and wait up to ``join_timeout`` seconds for it.
    Returns the monotonic time of the release."""
    waiter = threading.Thread(target=lambda: got.append(sem.acquire(timeout=acquire_timeout)))
    waiter.start()
    assert wait_until(lambda: sem.status().waiting == 1)
    released_at = time.monotonic()
    holder.release()
    waiter.join(join_timeout)
    return released_at


def _wait_in_child(sem, result):
    started = time.monotonic()
    sem.acquire(timeout=20).release()
    result.value = time.monotonic() - started


def forked_child_waits(sem, join_timeout=25.0):
    """Hold ``sem`` (limit 1), fork a child that waits for it, release once the child is in
    line, and return the seconds the child waited (-1.0: it never got the slot)."""
    fork = multiprocessing.get_context("fork")
    held = sem.acquire()
    result = fork.Value("d", -1.0)
    child = fork.Process(target=_wait_in_child, args=(sem, result))
    child.start()
    assert wait_until(lambda: sem.status().waiting == 1)
    held.release()
    child.join(join_timeout)
    return result.value
