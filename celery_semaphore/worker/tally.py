"""What only a worker can count (requests it requeued or parked, tasks parked on send that it
pulled), carried to the backend's counters of each semaphore (:mod:`celery_semaphore.stats`).

Counts are added on the loop thread and sent from the I/O thread in one
:meth:`~celery_semaphore.backends.base.Backend.count` call per semaphore, at most every
:data:`~celery_semaphore.stats.FLUSH_EVERY` seconds, and at worker shutdown (the I/O thread
runs what is left when it stops). A call that fails is tried again with the next batch. A
worker killed with SIGKILL loses at most the last :data:`~celery_semaphore.stats.FLUSH_EVERY`
seconds of these counts: one backend round trip per park would cost the parking rate more.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Dict

from ..stats import FLUSH_EVERY
from .context import GateContext

logger = logging.getLogger(__name__)


class Tally:
    def __init__(self, ctx: GateContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._pending: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._scheduled = False

    def add(self, name: str, counter: str, n: int = 1) -> None:
        """Count ``n`` more ``counter`` for semaphore ``name`` (any thread)."""
        with self._lock:
            self._pending[name][counter] += n
            if self._scheduled:
                return
            self._scheduled = True
        self.ctx.io.call(self.flush, delay=FLUSH_EVERY)

    def flush(self) -> None:  # I/O thread
        with self._lock:
            pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
            self._scheduled = False
        for name, counts in pending.items():
            try:
                self.ctx.backend.count(name, dict(counts))
            except Exception as exc:
                if not self.ctx.running:  # at shutdown: no next time
                    logger.warning("celery-semaphore: counts %s of %r lost at shutdown: %s",
                                   dict(counts), name, exc)
                    continue
                logger.debug("celery-semaphore: counting %s for %r failed, next time: %s",
                             dict(counts), name, exc)
                for counter, n in counts.items():
                    self.add(name, counter, n)
