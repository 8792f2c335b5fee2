"""The library's background threads: the scheduler and the lease keeper built on it."""

import gc
import os
import threading
import time
import weakref

from celery_semaphore import Semaphore
from celery_semaphore.keeper import LeaseKeeper
from celery_semaphore.scheduler import Scheduler
from tests.util import wait_until


def test_calls_run_in_due_order_and_a_cancelled_one_never_runs():
    scheduler = Scheduler("test-order")
    ran, done = [], threading.Event()
    # Delays far apart: a loaded machine may pause this thread between two calls (60 ms
    # apart, 3 came due before 1 was scheduled).
    scheduler.call(ran.append, 3, delay=0.6)
    scheduler.call(ran.append, 1)
    cancelled = scheduler.call(ran.append, "cancelled", delay=0.3)
    scheduler.call(ran.append, 2, delay=0.3)
    cancelled.cancel()
    scheduler.call(done.set, delay=0.9)
    assert done.wait(5)
    scheduler.stop()
    assert ran == [1, 2, 3]


def test_a_call_due_sooner_than_the_sleeping_threads_next_one_runs_on_time():
    """The thread is woken only for a call due before the one it sleeps until: an earlier
    call added later still runs when due, and a later one waits its turn."""
    scheduler = Scheduler("test-wake")
    ran = {}
    scheduler.call(lambda: ran.setdefault("late", time.monotonic()), delay=30)
    time.sleep(0.05)  # the thread sleeps until the late call
    sent = time.monotonic()
    scheduler.call(lambda: ran.setdefault("soon", time.monotonic()), delay=0.2)
    scheduler.call(lambda: ran.setdefault("later", time.monotonic()), delay=0.4)
    assert wait_until(lambda: "later" in ran, timeout=10)
    assert 0.2 <= ran["soon"] - sent < 0.4 + 2 and ran["later"] - sent >= 0.4
    assert "late" not in ran
    scheduler.stop()


def test_a_stopped_scheduler_runs_what_is_left_and_its_thread_ends():
    """Releases scheduled a little ahead (waiting for a pool child to exit) must not be dropped
    when the worker shuts down."""
    scheduler = Scheduler("test-stop")
    ran = []
    scheduler.call(ran.append, "later", delay=30)
    scheduler.call(ran.append, "now")
    assert wait_until(lambda: ran == ["now"])
    scheduler.stop(timeout=5)
    assert ran == ["now", "later"]
    assert not any(t.name == "test-stop" for t in threading.enumerate())
    scheduler.call(ran.append, "after stop")  # runs at once, in the caller
    assert ran[-1] == "after stop"


def test_a_failing_call_is_logged_and_the_next_ones_run(caplog):
    scheduler = Scheduler("test-fail")
    done = threading.Event()
    scheduler.call(lambda: 1 / 0)
    scheduler.call(done.set)
    assert done.wait(5)
    scheduler.stop()
    assert "ZeroDivisionError" in caplog.text


def test_a_forked_child_schedules_and_runs_calls_of_its_own():
    """A fork can come while another thread schedules (holding the scheduler's lock) and the
    parent's thread does not exist in the child: the child must still run its calls, and never
    the parent's."""
    scheduler = Scheduler("test-fork")
    parents = []
    scheduler.call(parents.append, "parent's", delay=60)
    busy = threading.Event()

    def schedule_constantly():
        while not busy.is_set():
            scheduler.call(lambda: None, delay=120)

    thread = threading.Thread(target=schedule_constantly)
    thread.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                ran = threading.Event()
                scheduler.call(ran.set)
                os._exit(0 if ran.wait(2) and scheduler.pending() == 0 else 1)
            assert _exit_code(pid, timeout=10) == 0
    finally:
        busy.set()
        thread.join()
    assert parents == []


def test_the_keeper_keeps_a_lease_past_its_ttl_and_a_release_is_not_reported_lost(caplog):
    keeper = LeaseKeeper()
    sem = Semaphore("kept", 1, "memory://keeper", ttl=0.3, auto_renew=False)
    for _ in range(3):
        lease = sem.acquire()
        keeper.add(lease)
        time.sleep(0.5)  # sleep-ok: past its TTL, only the keeper's renewals keep it
        assert lease.verify() and lease.remaining > 0
        lease.release()
        keeper.discard(lease)
        assert len(keeper) == 0
    lease = sem.acquire()
    keeper.add(lease)
    lease.release()  # released without discard: its next renewal finds it released
    assert wait_until(lambda: len(keeper) == 0)
    # only this test's leases: a keeper another test left running in this process logs too
    ours = [r.getMessage() for r in caplog.records if "'kept'" in r.getMessage()]
    assert not [message for message in ours if "lost" in message], ours


def _exit_code(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child is stuck")


def test_a_cancelled_call_keeps_nothing_alive():
    """A cancelled timer waits in the heap until it is due; what it would have run with must
    not (the lease keeper cancels thousands of renewals due a third of a TTL later)."""

    class Payload:
        pass

    scheduler = Scheduler("test-cancelled")
    payload = Payload()
    alive = weakref.ref(payload)
    timer = scheduler.call(lambda p: None, payload, delay=3600)
    del payload
    timer.cancel()
    gc.collect()
    assert alive() is None
    assert scheduler.pending() == 1  # still in the heap, as an empty shell
    scheduler.stop()


class _Hub:
    """What LoopCaller uses of kombu's hub: the pipe's reader and the tick callbacks."""

    def __init__(self):
        self.readers = {}
        self.on_tick = set()

    def add_reader(self, fd, callback):
        self.readers[fd] = callback

    def remove_reader(self, fd):
        self.readers.pop(fd, None)


def _pipe_readable(fd) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def _post_from_another_thread(caller, fn) -> None:
    poster = threading.Thread(target=caller.post, args=(fn,))
    poster.start()
    poster.join()


def test_a_post_racing_the_loops_drain_still_wakes_the_loop_for_the_next_one(monkeypatch):
    """A post from another thread lands while the loop thread drains the pipe (between its
    read and its bookkeeping): every later post must still leave the loop's pipe readable, so
    that the hub wakes for it. Before, the loop cleared its "woken" flag before reading, the
    racing post's byte was read with it, the flag stayed set with the pipe empty, and later
    posts wrote nothing: the loop slept through them (the amqp:// token backend's stalls)."""
    from celery_semaphore.worker import threads

    caller = threads.LoopCaller()
    caller.start(_Hub())  # this thread is the loop thread
    ran = []
    try:
        _post_from_another_thread(caller, lambda: ran.append(1))
        assert _pipe_readable(caller._rfd)
        real_read, raced = os.read, []

        def read_with_a_racing_post(fd, n):
            if not raced:  # another thread posts just as the loop reads the pipe
                raced.append(True)
                _post_from_another_thread(caller, lambda: ran.append(2))
            return real_read(fd, n)

        monkeypatch.setattr(threads.os, "read", read_with_a_racing_post)
        caller._drain()  # what the hub runs once the pipe is readable
        monkeypatch.setattr(threads.os, "read", real_read)
        assert ran == [1, 2] and raced
        _post_from_another_thread(caller, lambda: ran.append(3))
        assert _pipe_readable(caller._rfd), "the loop would sleep through this post"
        caller._drain()
        assert ran == [1, 2, 3]
    finally:
        caller.stop()
