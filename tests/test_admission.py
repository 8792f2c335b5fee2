"""The gate's admission state machine under an interleaving real threads make rare: a
wake-up that reaches the loop before the answer to an attempt made just before it.

The backend is real (memory://); the gate's I/O thread and event loop are replaced by two
queues that this test drains in the order it chooses, because no timing of real threads
produces that order on demand."""

from types import SimpleNamespace

from celery_semaphore import Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.backends.base import new_holder_id
from celery_semaphore.guards import Guard
from celery_semaphore.settings import Settings
from celery_semaphore.worker.admission import Admission
from celery_semaphore.worker.waiter import Waiter, WaitState
from tests import servers


class Calls:
    """What a thread was asked to run, run only when the test says so."""

    def __init__(self):
        self.pending = []

    def call(self, fn, *args, delay=0.0):
        timer = SimpleNamespace(fn=fn, args=args, delay=delay, cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.pending.append(timer)
        return timer

    def post(self, fn, *args):
        self.call(fn, *args)

    def run(self, fn):
        """Run the first pending call of ``fn`` (by name); return it."""
        timer = next(t for t in self.pending if getattr(t.fn, "__name__", "") == fn)
        self.pending.remove(timer)
        if not timer.cancelled:
            timer.fn(*timer.args)
        return timer


def test_a_stale_wait_answer_does_not_cancel_the_attempt_a_wake_up_sent():
    backend = get_backend(f"memory://{servers.unique_tag()}")
    settings = Settings(poll_interval=30.0)
    io, loop = Calls(), Calls()
    gate = SimpleNamespace(backend=backend, io=io, loop=loop,
                           consumer=SimpleNamespace(hostname="w@test"),
                           reporting=SimpleNamespace(waiting=lambda *args: None))
    admission = Admission(gate)
    holder = Semaphore("s", 1, backend).acquire(timeout=5)  # the one slot is taken
    request = SimpleNamespace(id="t1", name="tasks.t", request_dict={})
    waiter = Waiter(request, Guard("s", 1, settings), new_holder_id("t1"))
    admission.waiters[waiter.holder] = waiter
    admission._move(waiter, WaitState.QUEUED)
    backend.watch("s", waiter.holder, lambda: loop.post(admission._woken, waiter,
                                                         waiter.holder))
    admission._send(waiter)
    io.run("_acquire")  # attempt 1: "wait" (the slot is held); its answer is posted
    holder.release()  # the backend wakes the waiter: _woken is posted after that answer
    assert [t.fn.__name__ for t in loop.pending] == ["_answered", "_woken"]
    loop.run("_woken")  # ...but reaches the loop first: attempt 2 goes out now
    second = next(t for t in io.pending if t.fn.__name__ == "_acquire")
    loop.run("_answered")  # the stale "wait" of attempt 1
    assert not second.cancelled and second.delay == 0  # attempt 2 still goes out at once
    assert all(t.fn.__name__ != "_acquire" or t is second for t in io.pending)
    io.run("_acquire")
    (answer,) = [t for t in loop.pending if t.fn.__name__ == "_answered"]
    assert answer.args[1].attempt.grant is not None  # the slot it was woken for
