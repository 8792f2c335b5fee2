"""Settling what a lost Redis broker connection leaves unacknowledged, once the broker answers.

kombu's Redis transport keeps every message it delivered and that is not settled yet in the
broker's ``unacked`` hash; an ack removes it there, a reject with requeue puts it back in its
queue, and closing a channel puts back every message of the channel. On a lost connection
that last rule runs tasks twice: a task acknowledged late that was running (or had just run)
is put back and delivered again, and an ack that failed because the broker was away (before
the worker noticed the connection was gone) leaves its message to be put back too.

:class:`Settlements` keeps Celery's at-least-once promise without those second runs:

* An ack or reject on a watched channel that fails is *taken over*: the message leaves the
  channel's unacked set (a close will not put it back) and the same settlement is made through
  a connection of the gate's own once the broker answers, retried until it lands.
* When the connection is lost (:meth:`detach`), a message whose request left for the pool
  (it runs or ran: Celery's active requests, a reserved one with a pool job, or one Celery
  acknowledged already) is not put back: it stays in the unacked hash, and whatever Celery
  later does with its request (ack, reject, requeue) is made the same way. The other messages
  (requests that waited, or that Celery forgets on the reconnect) are put back at once, by
  the caller.
* A settlement that never lands (the worker stops first, or is killed) leaves the message in
  the unacked hash, where the transport's ``visibility_timeout`` puts it back: delivered
  again, never lost.

Only kombu's Redis transport has such a hash; on AMQP the broker requeues a closed channel's
messages itself and nothing here applies. Threads: :meth:`watch` and :meth:`detach` run where
the channel's callers run (the loop thread, the I/O thread for the parking channel); settling
runs on the gate's I/O thread.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Container, Dict, List, Optional

from . import celery_internals
from .context import GateContext
from .core import RETRY_FIRST, RETRY_MAX

logger = logging.getLogger(__name__)

#: Attribute set on a kombu QoS whose acks and rejects this module watches.
WATCHED = "_celery_semaphore_watched"


class _EveryMessage:
    """A container of every delivery tag (:meth:`Settlements.detach`: keep them all)."""

    def __contains__(self, tag: object) -> bool:
        return True


#: :meth:`Settlements.detach` keeps every message: each is settled by whoever holds it.
EVERY_MESSAGE: Container[str] = _EveryMessage()


class Settle(enum.Enum):
    """What is made of a message in the broker's unacked hash."""

    ACK = "ack"  # removed: its task ran (or Celery rejected it without requeue)
    REQUEUE = "requeue"  # put back at the head of its queue, to be delivered again


class Settlements:
    """Settles, through the gate's own connection, what a lost channel could not. See the
    module docstring. What is pending belongs to the I/O thread (every settlement is made
    there); the loop thread keeps how many are pending (:meth:`__len__`), told by it."""

    def __init__(self, ctx: GateContext) -> None:
        self.ctx = ctx
        #: delivery tag -> what to make of it (taken over, not landed yet): the I/O thread's
        self._pending: Dict[str, Settle] = {}
        self._flushing = False
        #: how many are pending, as the loop thread last heard
        self._count = 0

    def __len__(self) -> int:
        """Settlements not landed yet (loop thread)."""
        return self._count

    def _counted(self, count: int) -> None:  # loop thread
        self._count = count

    # -- channels ----------------------------------------------------------------------------

    def watch(self, channel: Any) -> None:
        """Take over every ack or reject on ``channel`` (kombu's Redis transport) that fails.
        Idempotent; does nothing for another transport."""
        qos = celery_internals.redis_qos(channel)
        if qos is None or getattr(qos, WATCHED, False):
            return
        setattr(qos, WATCHED, True)
        ack, reject = qos.ack, qos.reject

        def watched_ack(delivery_tag: str) -> None:
            try:
                ack(delivery_tag)
            except Exception as exc:
                self._take_over(qos, delivery_tag, Settle.ACK, exc)

        def watched_reject(delivery_tag: str, requeue: bool = False) -> None:
            try:
                reject(delivery_tag, requeue=requeue)
            except Exception as exc:
                self._take_over(qos, delivery_tag, Settle.REQUEUE if requeue else Settle.ACK,
                                exc)

        qos.ack, qos.reject = watched_ack, watched_reject

    def detach(self, channel: Any, keep: Optional[Container[str]] = None) -> List[str]:
        """``channel``'s connection is lost: forget every message unacked on it (closing it
        must not put them back through a transport that is gone; kombu 5.7 raises there and
        the worker exits). Those whose tag is in ``keep`` (default: the requests that left
        for the pool, :func:`.celery_internals.handed_to_pool`) stay in the unacked hash and
        are settled as Celery later settles their request; the others' delivery tags are
        returned, for the caller to put back. [] for another transport."""
        qos = celery_internals.redis_qos(channel)
        if qos is None:
            return []
        tags = celery_internals.forget_unacked(qos)
        # from now on every settlement on this channel is made through the gate's connection
        setattr(qos, WATCHED, True)
        qos.ack = lambda delivery_tag: self.later(delivery_tag, Settle.ACK)
        qos.reject = lambda delivery_tag, requeue=False: self.later(
            delivery_tag, Settle.REQUEUE if requeue else Settle.ACK)
        if keep is None:
            keep = celery_internals.handed_to_pool()
        kept = [tag for tag in tags if tag in keep]
        if kept and keep is not EVERY_MESSAGE:
            logger.info("celery-semaphore: %d tasks that left for the pool stay unacknowledged "
                        "in the broker until they end (not delivered again)", len(kept))
        return [tag for tag in tags if tag not in keep]

    def settle_kept(self, message: Any, settle: Settle) -> None:
        """Make ``settle`` of ``message``, which a lost connection left unacknowledged in the
        broker for whoever settles it (a task a pool child got: :meth:`detach`'s ``keep``, or
        any message pulled from the waiting room); nothing for another transport than
        Redis, whose broker requeued it when the channel closed."""
        if celery_internals.redis_qos(getattr(message, "channel", None)) is not None:
            self.later(message.delivery_tag, settle)

    # -- settling ----------------------------------------------------------------------------

    def _take_over(self, qos: Any, delivery_tag: str, settle: Settle,
                   exc: BaseException) -> None:
        qos._delivered.pop(delivery_tag, None)  # a close must not put it back now
        logger.warning("celery-semaphore: the broker did not take the %s of %s (%s: %s); "
                       "made again once it answers", settle.value, delivery_tag,
                       type(exc).__name__, exc)
        self.later(delivery_tag, settle)

    def later(self, delivery_tag: str, settle: Settle) -> None:
        """Make ``settle`` of ``delivery_tag`` through the gate's own connection (any thread:
        it is made on the I/O thread)."""
        self.ctx.io.call(self._later, delivery_tag, settle)

    def _later(self, delivery_tag: str, settle: Settle) -> None:  # I/O thread
        self._pending[delivery_tag] = settle
        self.ctx.loop.post(self._counted, len(self._pending))
        if not self._flushing:
            self._flushing = True
            self.ctx.io.call(self.flush)

    def flush(self, retry: float = RETRY_FIRST) -> None:
        """Make every pending settlement (I/O thread), retrying while the broker is away and
        the gate runs."""
        pending = dict(self._pending)
        landed: List[str] = []
        try:
            celery_internals.settle_unacked(
                self.ctx.app, [(tag, settle is Settle.REQUEUE) for tag, settle in pending.items()],
                landed.append)
        except Exception as exc:
            self._landed(pending, landed)
            if self.ctx.running:
                self.ctx.io.call(self.flush, min(retry * 2, RETRY_MAX), delay=retry)
            else:
                self._give_up(exc)
            return
        self._landed(pending, landed)
        self._flushing = bool(self._pending)
        if self._flushing:
            self.ctx.io.call(self.flush)

    def _landed(self, pending: Dict[str, Settle], landed: List[str]) -> None:
        for tag in landed:
            if self._pending.get(tag) is pending[tag]:
                del self._pending[tag]
        self.ctx.loop.post(self._counted, len(self._pending))

    def _give_up(self, exc: BaseException) -> None:  # I/O thread
        left, self._flushing = len(self._pending), False
        if left:
            logger.warning("celery-semaphore: %d acks or requeues did not reach the broker "
                           "before the worker stopped; its visibility_timeout delivers those "
                           "messages again: %s", left, exc)

    def final_flush(self, then: Optional[Callable[[], None]] = None) -> None:
        """The worker stops (I/O thread): one last try for what is pending."""
        if self._pending:
            try:
                self.flush()
            except Exception as exc:  # pragma: no cover - flush catches its own
                self._give_up(exc)
        if then is not None:
            then()
