"""The gate's threads: the consumer's loop thread, which owns every state of the gate, and one
I/O thread (a :class:`~celery_semaphore.scheduler.Scheduler`) for the calls that must not run
on the loop (result-backend writes, the waiting room's broker calls, a backend that has no
event-loop link of its own).

Other threads hand the loop facts with :meth:`LoopCaller.post`: they are queued and run on the
loop thread, in order, woken through a pipe the hub watches (once per batch of posts, not per
post). On the loop thread itself, a post runs at the end of the current turn of the loop.

Without a hub (Celery's ``synloop``: a transport with no event loop, or a green pool) there is
no loop thread to own the state: Celery itself calls ``on_task_request`` from its consumer
and timer threads there. Then every entry into the gate, and every post, runs at once in the
calling thread under :attr:`LoopCaller.lock`; with a hub that lock is never taken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from typing import Any, Callable, Deque, Iterator, Tuple

logger = logging.getLogger(__name__)


class LoopCaller:
    """Runs callables on the consumer's loop thread (module docs)."""

    def __init__(self, after: Callable[[], None] = lambda: None) -> None:
        """``after``: runs after each call made under the lock, outside it (without a hub)."""
        self.after = after
        self.hub: Any = None
        #: Held by every entry into the gate without a hub (``synloop``); never with one.
        self.lock = threading.RLock()
        self._calls: Deque[Tuple[Callable[..., Any], Tuple[Any, ...]]] = deque()
        self._rfd = self._wfd = -1
        self._thread = -1
        self._woken = False  # a wake-up byte is in the pipe, not drained yet
        # Held while the pipe is written or closed: a write racing stop() could otherwise hit
        # the fd number after it was closed and reused (the reconnected broker's socket).
        self._pipe_lock = threading.Lock()

    def start(self, hub: Any) -> None:
        """The consumer starts (on the loop thread) with ``hub``, or without one (None)."""
        self.hub = hub
        if hub is None:
            return
        self._thread = threading.get_ident()
        with self._pipe_lock:
            if self._rfd < 0:
                self._rfd, self._wfd = os.pipe()
                os.set_blocking(self._rfd, False)
                os.set_blocking(self._wfd, False)
                self._woken = False
        hub.add_reader(self._rfd, self._drain)
        hub.on_tick.add(self._drain_calls)

    def stop(self) -> None:
        with self._pipe_lock:
            rfd, wfd, self._rfd, self._wfd = self._rfd, self._wfd, -1, -1
        hub = self.hub
        if hub is not None:
            hub.on_tick.discard(self._drain_calls)
        if rfd >= 0:
            try:
                hub.remove_reader(rfd)
            except Exception:
                pass
            os.close(rfd)
            os.close(wfd)
        self._thread = -1
        self._drain_calls()

    @property
    def owned(self) -> bool:
        """True with a hub (the loop thread owns the state: no lock)."""
        return self._thread != -1

    def on_loop(self) -> bool:
        """True in the loop thread (with a hub)."""
        return threading.get_ident() == self._thread

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """An entry into the gate from Celery: under the lock without a hub (then ``after``,
        outside it)."""
        if self.owned:
            yield
            return
        with self.lock:
            yield
        self.after()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread, soon (module docs)."""
        if self._thread == -1:
            self._run(fn, args)  # no loop to wake (synloop, or stopped): run it here
            return
        self._calls.append((fn, args))
        if threading.get_ident() == self._thread or self._woken:
            return  # the end of this turn drains it (or a wake-up byte is on its way)
        with self._pipe_lock:
            if self._wfd >= 0 and not self._woken:
                self._woken = True
                try:
                    os.write(self._wfd, b"\0")
                except (BlockingIOError, OSError):  # a full pipe already wakes the hub
                    pass
                return
        if self._wfd < 0:
            self._drain_calls()

    def _drain(self) -> None:
        # The pipe is read before the flag is cleared, and the calls run after: a post whose
        # byte this read takes has queued its call already, so the drain below runs it; a
        # post after the flag is cleared writes again. (Clearing the flag first lost
        # wake-ups: a post between the two wrote a byte that this read took, leaving the flag
        # set with the pipe empty, and every later post trusted the flag and wrote none. The
        # loop then slept in epoll, its posted calls waiting for some other event: up to a
        # second on the amqp:// token backend, whose answers come from another thread.)
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._woken = False
        self._drain_calls()

    def _drain_calls(self) -> None:
        calls = self._calls
        while calls:
            try:
                fn, args = calls.popleft()
            except IndexError:
                return
            self._run(fn, args)

    def _run(self, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        try:
            if self.owned:
                fn(*args)
                return
            with self.lock:
                fn(*args)
            self.after()
        except Exception:
            logger.exception("celery-semaphore: %r failed", fn)
