"""The gate's two threads: the consumer's loop thread, which owns all gate state, and one I/O
thread (a :class:`~celery_semaphore.scheduler.Scheduler`, as the lease keeper uses) for every
backend and broker call, so that a slow or unreachable backend never stalls the event loop.

Work goes to the I/O thread with ``io.call``; results come back with :meth:`LoopCaller.post`,
through a pipe the hub watches, which wakes the loop at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any, Callable, Deque, Tuple

logger = logging.getLogger(__name__)

#: First and longest pause between retries of a release or cancel the backend did not answer.
RETRY_FIRST = 0.1
RETRY_MAX = 2.0


class LoopCaller:
    """Runs callables on the consumer's loop thread, waking the hub through a pipe.

    Without a hub (``synloop``) the callable runs at once in the calling thread, under the
    gate's lock; Celery itself calls ``on_task_request`` from its timer thread there.
    """

    def __init__(self, hub: Any, lock: threading.RLock, after: Callable[[], None]) -> None:
        self.hub = hub
        self.lock = lock
        self.after = after  # runs after each call, outside the lock
        self._calls: Deque[Tuple[Callable[..., Any], Tuple[Any, ...]]] = deque()
        self._rfd = self._wfd = -1
        # Held while the pipe is written or closed: a write racing stop() could otherwise hit
        # the fd number after it was closed and reused (the reconnected broker's socket).
        self._pipe_lock = threading.Lock()

    def start(self) -> None:
        with self._pipe_lock:
            if self.hub is None or self._rfd >= 0:
                return
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
        self.hub.add_reader(self._rfd, self._drain)

    def stop(self) -> None:
        with self._pipe_lock:
            rfd, wfd, self._rfd, self._wfd = self._rfd, self._wfd, -1, -1
        if rfd >= 0:
            try:
                self.hub.remove_reader(rfd)
            except Exception:
                pass
            os.close(rfd)
            os.close(wfd)
        self._drain_calls()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._pipe_lock:
            if self._wfd >= 0:
                self._calls.append((fn, args))
                try:
                    os.write(self._wfd, b"\0")
                except (BlockingIOError, OSError):  # a full pipe already wakes the hub
                    pass
                return
        self._run(fn, args)  # no loop to wake (synloop, or stopped): run it here

    def _drain(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._drain_calls()

    def _drain_calls(self) -> None:
        while self._calls:
            fn, args = self._calls.popleft()
            self._run(fn, args)

    def _run(self, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        try:
            with self.lock:
                fn(*args)
        except Exception:
            logger.exception("celery-semaphore: %r failed on the loop thread", fn)
        self.after()
