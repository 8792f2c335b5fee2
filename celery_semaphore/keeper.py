"""Background renewal of leases, with lost-lease detection.

A scheduler thread renews every registered lease each time a third of its TTL has
passed, so two renewals can fail before the lease expires. A renewal that finds the lease gone
marks it lost at once; a renewal that cannot reach the backend is retried until the lease's
local deadline passes, and then the lease is marked lost too: never later than the backend
could have expired it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Protocol

from .scheduler import Scheduler, Timer


class Renewable(Protocol):
    """What the keeper renews: a :class:`.Lease`, or a :class:`.LeaseGroup` renewed as one."""

    @property
    def ttl(self) -> float: ...

    @property
    def remaining(self) -> float:
        """Seconds until the local deadline (0 once it passed)."""

    @property
    def released(self) -> bool: ...

    @property
    def releasing(self) -> bool: ...

    def renew(self) -> bool:
        """Extend the lease by its TTL; False when the backend no longer holds it."""

    def mark_lost(self) -> None:
        """Report the lease lost to its ``on_lost`` callbacks."""

logger = logging.getLogger(__name__)

#: Seconds between retries of a renewal that failed with an error.
RETRY_DELAY = 0.5


class LeaseKeeper:
    """Renews leases on a :class:`.scheduler.Scheduler` thread (one per keeper and process)."""

    def __init__(self) -> None:
        self._scheduler = Scheduler("celery-semaphore-keeper")
        self._forked()
        if hasattr(os, "register_at_fork"):
            # The parent's leases are not the child's (the scheduler drops its calls too).
            os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._timers: Dict[Renewable, Timer] = {}

    def add(self, lease: Renewable) -> None:
        """Renew ``lease`` every third of its TTL until it is discarded, released or lost."""
        self._reschedule(lease, lease.ttl / 3, add=True)

    def discard(self, lease: Renewable) -> None:
        with self._lock:
            timer = self._timers.pop(lease, None)
        if timer is not None:
            timer.cancel()

    def __len__(self) -> int:
        return len(self._timers)

    def _renew(self, lease: Renewable) -> None:
        try:
            renewed = lease.renew()
        except Exception as exc:
            if lease.remaining > 0:
                logger.warning("renewing %r failed, retrying: %s", lease, exc)
                self._reschedule(lease, RETRY_DELAY)
                return
            logger.error("lease %r lost: could not renew before its deadline: %s", lease, exc)
            self.discard(lease)
            lease.mark_lost()
            return
        if renewed:
            self._reschedule(lease, lease.ttl / 3)
        elif lease.released or lease.releasing:  # released meanwhile: nothing was lost
            self.discard(lease)
        else:
            logger.error("lease %r lost: the backend no longer holds it", lease)
            self.discard(lease)

    def _reschedule(self, lease: Renewable, delay: float, add: bool = False) -> None:
        with self._lock:
            old = self._timers.get(lease)
            if old is None and not add:  # discarded meanwhile
                return
            if old is not None:
                old.cancel()
            self._timers[lease] = self._scheduler.call(self._renew, lease, delay=delay)


default_keeper = LeaseKeeper()
