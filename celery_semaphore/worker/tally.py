"""What only a worker can count (requests it requeued or parked, tasks parked on send that it
pulled), carried to the backend's counters of each semaphore (:mod:`celery_semaphore.stats`).

Counts are kept on the loop thread and handed to the I/O thread, which sends them in one
:meth:`~celery_semaphore.backends.base.Backend.count` call per semaphore, at most every
:data:`~celery_semaphore.stats.FLUSH_EVERY` seconds, and at worker shutdown (the I/O thread
runs what is left when it stops). A call that fails is tried again with the next batch. A
worker killed with SIGKILL loses at most the last :data:`~celery_semaphore.stats.FLUSH_EVERY`
seconds of these counts: one backend round trip per park would cost the parking rate more.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Dict

from ..stats import FLUSH_EVERY
from .context import GateContext

logger = logging.getLogger(__name__)


class Tally:
    """Counts on the loop thread; the backend calls on the I/O thread (module docs)."""

    def __init__(self, ctx: GateContext) -> None:
        self.ctx = ctx
        self._pending: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._scheduled = False

    def add(self, name: str, counter: str, n: int = 1) -> None:
        """Count ``n`` more ``counter`` for semaphore ``name`` (loop thread)."""
        self._pending[name][counter] += n
        if not self._scheduled:
            self._scheduled = True
            self.ctx.io.call(self.ctx.loop.post, self.flush, delay=FLUSH_EVERY)

    def flush(self) -> None:
        """Hand the counts so far to the I/O thread (loop thread; at shutdown, the last)."""
        pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
        self._scheduled = False
        if pending:
            self.ctx.io.call(self._count, {name: dict(c) for name, c in pending.items()},
                             self.ctx.running)

    def _count(self, pending: Dict[str, Dict[str, int]], again: bool) -> None:  # I/O thread
        for name, counts in pending.items():
            try:
                self.ctx.backend.count(name, counts)
            except Exception as exc:
                if not again or not self.ctx.running:  # at shutdown: no next time
                    logger.warning("celery-semaphore: counts %s of %r lost at shutdown: %s",
                                   counts, name, exc)
                    continue
                logger.debug("celery-semaphore: counting %s for %r failed, next time: %s",
                             counts, name, exc)
                for counter, n in counts.items():
                    self.ctx.loop.post(self.add, name, counter, n)
