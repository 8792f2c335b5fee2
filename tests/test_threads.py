"""The library's background threads: the lease keeper and the gate's I/O thread."""

import os
import threading
import time

from celery_semaphore import Semaphore
from celery_semaphore.gate import IOThread
from celery_semaphore.keeper import LeaseKeeper


def test_a_fork_while_the_keeper_holds_its_lock_does_not_deadlock_the_child():
    keeper = LeaseKeeper()
    holding, forked = threading.Event(), threading.Event()

    def keeper_thread():  # as the keeper's thread does while it looks for due leases
        with keeper._cond:
            holding.set()
            forked.wait(10)

    thread = threading.Thread(target=keeper_thread)
    thread.start()
    holding.wait(5)
    pid = os.fork()
    if pid == 0:
        ok = keeper._cond.acquire(timeout=2)
        os._exit(0 if ok and len(keeper) == 0 else 1)
    forked.set()
    thread.join()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    raise AssertionError("the forked child is stuck on the keeper's lock")


def test_the_keeper_renews_and_a_released_lease_is_not_reported_lost(caplog):
    keeper = LeaseKeeper()
    lease = Semaphore("kept", 1, "memory://keeper", ttl=0.3).acquire()
    keeper.add(lease)
    time.sleep(0.5)  # past its TTL: only renewals keep it
    assert lease.verify()
    lease.release()
    keeper._renew(lease)  # a renewal that was due when the release came
    assert len(keeper) == 0 and "lost" not in caplog.text


def test_a_stopped_io_thread_runs_what_is_left_before_it_exits():
    """Releases scheduled a little ahead (waiting for a pool child to exit) must not be dropped
    when the worker shuts down."""
    io = IOThread("test-io")
    io.start()
    ran = []
    io.call(ran.append, "later", delay=30)
    io.call(ran.append, "now")
    assert _wait(lambda: ran == ["now"])
    io.stop(timeout=5)
    assert ran == ["now", "later"]
    assert not io._thread.is_alive()


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_io_thread_runs_calls_in_due_order():
    io = IOThread("test-io-order")
    io.start()
    ran, done = [], threading.Event()
    io.call(ran.append, 2, delay=0.05)
    io.call(ran.append, 1)
    io.call(done.set, delay=0.1)
    assert done.wait(5)
    io.stop()
    assert ran == [1, 2]
