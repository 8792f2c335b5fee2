"""Background renewal of leases, with lost-lease detection.

One daemon thread per process renews every registered lease each time a third of its TTL has
passed, so two renewals can fail before the lease expires. A renewal that finds the lease gone
marks it lost at once; a renewal that cannot reach the backend is retried until the lease's
local deadline passes, and then the lease is marked lost too: never later than the backend
could have expired it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from .semaphore import Lease

logger = logging.getLogger(__name__)

#: Seconds between retries of a renewal that failed with an error.
RETRY_DELAY = 0.5


class LeaseKeeper:
    """Renews leases from a daemon thread started on first use (per process)."""

    def __init__(self) -> None:
        self._forked()
        if hasattr(os, "register_at_fork"):
            # A fork can happen while the keeper's thread holds the condition's lock; the
            # child would wait for it for ever. The parent's leases are not the child's.
            os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._due: Dict["Lease", float] = {}
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def add(self, lease: "Lease") -> None:
        with self._cond:
            self._due[lease] = time.monotonic() + lease.ttl / 3
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-semaphore-keeper", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def discard(self, lease: "Lease") -> None:
        with self._cond:
            self._due.pop(lease, None)

    def __len__(self) -> int:
        return len(self._due)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [lease for lease, at in self._due.items() if at <= now]
                if not due:
                    wait = min(self._due.values(), default=now + 60) - now
                    self._cond.wait(max(wait, 0.001))
                    continue
            for lease in due:
                self._renew(lease)

    def _renew(self, lease: "Lease") -> None:
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

    def _reschedule(self, lease: "Lease", delay: float) -> None:
        with self._cond:
            if lease in self._due:
                self._due[lease] = time.monotonic() + delay


default_keeper = LeaseKeeper()
