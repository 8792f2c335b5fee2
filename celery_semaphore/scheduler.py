"""Timed calls: one heap of due callables, and one daemon thread that runs them.

:class:`Timers` is the heap alone, for a thread that has its own loop (the AMQP link runs its
lease deadlines between socket reads). :class:`Scheduler` is a thread running a heap: the
gate's releases and retries, the lease keeper's renewals, Consul's spare-session sweeps.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Tuple

logger = logging.getLogger(__name__)


def _nothing() -> None:
    pass


class Timer:
    """A scheduled call; :meth:`cancel` keeps it from running if it has not started."""

    __slots__ = ("due", "fn", "args", "cancelled")

    def __init__(self, due: float, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        self.due = due
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        # A cancelled timer stays in its heap until it is due: keep nothing alive till then
        # (a lease keeper's timers are due a third of a lease TTL later, thousands of them).
        self.cancelled = True
        self.fn = _nothing
        self.args = ()

    def run(self) -> None:
        if not self.cancelled:
            self.fn(*self.args)


class Timers:
    """Callables due at ``time.monotonic()`` times, earliest first, ties in insertion order.
    Not thread-safe: its owner guards it."""

    def __init__(self) -> None:
        self._heap: List[Tuple[float, int, Timer]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due: float, fn: Callable[..., Any], *args: Any) -> Timer:
        timer = Timer(due, fn, args)
        heapq.heappush(self._heap, (due, next(self._order), timer))
        return timer

    def next_due(self) -> Optional[float]:
        """When the earliest timer is due (None: no timers)."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: Optional[float] = None) -> Optional[Timer]:
        """The earliest timer due by ``now`` (None: every timer if ``now`` is None; else
        none due), removed from the heap."""
        if self._heap and (now is None or self._heap[0][0] <= now):
            return heapq.heappop(self._heap)[2]
        return None


class Scheduler:
    """One daemon thread running each call when due, in due order, logging what raises.

    The thread starts on the first :meth:`call`. In a forked child the parent's calls are
    dropped and a new thread starts on the child's first call (a fork can happen while the
    parent's thread holds the lock). :meth:`stop` runs what is left at once, then ends the
    thread; calls made after it run at once in the caller's thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._reset()
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _reset_in_child(ref))

    def _reset(self) -> None:
        self._timers = Timers()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def call(self, fn: Callable[..., Any], *args: Any, delay: float = 0.0) -> Timer:
        """Run ``fn(*args)`` on the thread after ``delay`` seconds."""
        with self._cond:
            if self._stopped:
                timer = Timer(0.0, fn, args)
            else:
                earliest = self._timers.next_due()
                timer = self._timers.add(time.monotonic() + delay, fn, *args)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name,
                                                    daemon=True)
                    self._thread.start()
                # The thread sleeps until the earliest call is due: wake it only when this
                # one is earlier (a lease keeper adds a renewal due in a third of a TTL per
                # task; waking its thread for each would cost a context switch per task).
                if earliest is None or timer.due < earliest:
                    self._cond.notify()
                return timer
        self._run_one(timer)
        return timer

    def pending(self) -> int:
        """Calls not yet run (cancelled ones included until their time comes)."""
        with self._cond:
            return len(self._timers)

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is left at once, then end the thread (waiting up to ``timeout``)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    timer = self._timers.pop_due(None if self._stopped else time.monotonic())
                    if timer is not None:
                        break
                    if self._stopped:
                        return
                    due = self._timers.next_due()
                    self._cond.wait(None if due is None else due - time.monotonic())
            self._run_one(timer)

    @staticmethod
    def _run_one(timer: Timer) -> None:
        try:
            timer.run()
        except Exception:
            logger.exception("celery-semaphore: %r failed", timer.fn)


def _reset_in_child(ref: "weakref.ref[Scheduler]") -> None:
    scheduler = ref()
    if scheduler is not None:
        scheduler._reset()
