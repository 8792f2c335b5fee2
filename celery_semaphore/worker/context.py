"""What every part of the gate's shell shares, and nothing more.

The parts (admission, the waiting room, releases, requeues, outcomes, reporting, settlements,
the tally) each receive one :class:`GateContext` and, by name, the few other parts they call;
none of them reaches the gate. The context holds Celery's app and consumer, the settings and
the backend, the two threads (the loop thread owns every state: :meth:`LoopCaller.post` to it;
the I/O thread makes the calls that must not block the loop: ``io.call``), the gate's
lifecycle, and the delivery tags of requests in transit between the core and the broker.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Set

from ..backends.base import Backend
from ..scheduler import Scheduler
from ..settings import Settings
from .core import RETRY_FIRST, RETRY_MAX
from .threads import LoopCaller

logger = logging.getLogger(__name__)


class GateState(enum.Enum):
    NEW = "new"  # not started
    OPEN = "open"  # the consumer runs: requests are admitted, parked ones pulled
    PAUSED = "paused"  # the consumer stopped (a reconnect): nothing waits; leases still go
    CLOSED = "closed"  # the worker exits


class GateContext:
    """The worker's shared runtime. Its state changes on the loop thread only (the gate's
    lifecycle methods); the parts read it from either thread."""

    def __init__(self, consumer: Any, settings: Settings, backend: Backend,
                 after_each_call: Callable[[], None] = lambda: None) -> None:
        self.consumer = consumer
        self.app = consumer.app
        self.settings = settings
        self.backend = backend
        #: Runs a callable on the loop thread (the owner of every state); without a hub, under
        #: its lock, then ``after_each_call`` outside it.
        self.loop = LoopCaller(after_each_call)
        #: The one I/O thread: the calls that must not block the loop.
        self.io = Scheduler("celery-semaphore-gate")
        self.state = GateState.NEW
        #: Delivery tags of requests that left the core to be parked or requeued and whose
        #: original is not settled yet (loop thread): that path settles it, once its copy is
        #: published or not, so a lost connection must not put it back too.
        self.in_transit: Set[str] = set()

    @property
    def running(self) -> bool:
        """Leases are kept and released (the worker has not shut down)."""
        return self.state in (GateState.OPEN, GateState.PAUSED)

    @property
    def open(self) -> bool:
        """Requests are admitted and parked ones pulled (the consumer runs)."""
        return self.state is GateState.OPEN

    def retry_io(self, again: Callable[[float], None], retry: float, left: float, what: str,
                 exc: BaseException) -> None:  # I/O thread
        """A call failed because the backend did not answer: call ``again(next_retry)`` in
        ``retry`` seconds (the first failure, ``retry`` 0: in :data:`RETRY_FIRST`, logged),
        doubling up to :data:`RETRY_MAX`, while that is within ``left`` seconds and the worker
        runs; else log that the backend's expiry frees it."""
        delay = retry or RETRY_FIRST
        if self.running and delay < left:
            if not retry:
                logger.warning("celery-semaphore: %s failed, retrying until the backend "
                               "answers: %s", what, exc)
            self.io.call(again, min(delay * 2, RETRY_MAX), delay=delay)
        else:
            logger.warning("celery-semaphore: %s failed (the backend's expiry frees it): %s",
                           what, exc)
