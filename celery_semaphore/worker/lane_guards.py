"""Deleting an empty parking queue on RabbitMQ without dropping a message anyone holds.

A parking queue on RabbitMQ is a durable queue per lane. Once its backlog is gone it should go
too (thousands of idle durable queues slow a broker's restart to minutes), but deleting it is
only safe when nobody holds a message pulled from it: a pulled message is unacknowledged on
the puller's channel, and if that channel closes after the queue is gone (the puller is
killed, its connection drops, it gives the message back) the broker has no queue to put it
back in, and drops it.

RabbitMQ cannot tell who holds ``basic.get`` deliveries, but it can tell who consumes a queue,
and it removes a consumer and requeues its channel's messages in the same step when the
channel goes. So each lane has a *holders queue* (never published to; auto-deleted; it lives
in the ``holders.`` namespace beside ``park.``) and:

* a worker pulls a lane only on a channel of its own for that lane (:meth:`LaneGuards.
  channel`) that consumes the lane's holders queue, and keeps that channel open while any
  message it pulled from the lane is unsettled; the lane's parking queue is declared again
  there (it may have been deleted since);
* a worker that proved a lane empty and let go of its doorbell deletes the lane's parking
  queue only after taking its holders queue *exclusively* (:meth:`LaneGuards.lock`: refused
  while anyone consumes it, and while it is held nobody can start), waiting
  :data:`SETTLE` (a holder that just died had its messages requeued by then), and then with
  ``if-empty``: a message put back, or parked meanwhile, keeps the queue.

Senders publish parked tasks with publisher confirms and ``mandatory`` and declare the queue
again when the broker returns one (:mod:`celery_semaphore.waiting_room`), so a send never
needs the queue to exist. The queue's 7-day ``x-expires`` stays as a backstop.

Threads: every call here runs on the gate's I/O thread, which owns the parking connection.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from kombu import Queue

from ..waiting_room import parking_queue_name

logger = logging.getLogger(__name__)

#: Seconds between taking a lane's holders queue and deleting its parking queue: RabbitMQ puts
#: back a dead channel's messages as it drops its consumers, but in another queue process.
SETTLE = 0.5
#: A holders queue nobody ever consumed is not auto-deleted; it expires this long after.
HOLDERS_EXPIRE_MS = 60_000


class LaneBusy(Exception):
    """Another worker is deleting the lane's parking queue: pull it a little later."""


def holders_queue_name(key_prefix: str, lane: str) -> str:
    """``<prefix>holders.<...>`` for the lane whose parking queue is ``<prefix>park.<...>``."""
    parking = parking_queue_name(key_prefix, lane)
    return f"{key_prefix}holders.{parking[len(key_prefix) + len('park.'):]}"


class LaneGuards:
    """One worker's registrations as a holder of lanes, and its deletions of empty ones
    (AMQP). See the module docstring."""

    def __init__(self, key_prefix: str) -> None:
        self.key_prefix = key_prefix
        self._channels: Dict[str, Any] = {}  # lane -> the channel that holds it

    def _declare_holders(self, channel: Any, lane: str) -> str:
        name = holders_queue_name(self.key_prefix, lane)
        channel.queue_declare(queue=name, durable=False, auto_delete=True,
                              arguments={"x-expires": HOLDERS_EXPIRE_MS})
        return name

    def channel(self, connection: Any, lane: str, parking: Queue) -> Any:
        """A channel of ``connection`` that holds ``lane`` (consumes its holders queue), with
        ``parking`` (the lane's parking queue) declared on it: pull the lane there, and its
        messages are acked or rejected there. Raises :class:`LaneBusy` while a deletion holds
        the lane."""
        channel = self._channels.get(lane)
        if channel is not None and getattr(channel, "is_open", False):
            return channel
        channel = connection.channel()
        try:
            holders = self._declare_holders(channel, lane)
            channel.basic_consume(queue=holders, no_ack=True, callback=_never)
            parking(channel).declare()
        except Exception as exc:
            _close(channel)
            if _channel_error(exc):  # refused: a deletion holds the lane, or it just went
                raise LaneBusy(str(exc)) from None
            raise
        self._channels[lane] = channel
        return channel

    def holds(self, lane: str) -> bool:
        return lane in self._channels

    def release(self, lane: str) -> None:
        """Stop holding ``lane``: call it once no message pulled from it is unsettled (its
        channel closes, and with it the registration)."""
        channel = self._channels.pop(lane, None)
        if channel is not None:
            _close(channel)

    def forget_all(self) -> None:
        """The connection is gone, and every registration with it."""
        self._channels.clear()

    def lock(self, connection: Any, lane: str) -> Optional[Any]:
        """Take ``lane``'s holders queue exclusively, on a new channel of ``connection``
        (returned), or None when someone holds the lane (or deletes it already)."""
        self.release(lane)  # this worker's own registration, if any
        channel = connection.channel()
        try:
            holders = self._declare_holders(channel, lane)
            channel.basic_consume(queue=holders, no_ack=True, exclusive=True,
                                  callback=_never)
        except Exception as exc:
            _close(channel)
            if _channel_error(exc):
                return None
            raise
        return channel

    def delete(self, channel: Any, parking: Queue) -> bool:
        """With the lane locked on ``channel`` (:meth:`lock`), delete its parking queue if it
        is empty; then unlock. True if it was deleted."""
        try:
            channel.queue_delete(queue=parking.name, if_unused=True, if_empty=True)
            return True
        except Exception as exc:
            if not _channel_error(exc):
                raise
            return False  # a message came back or was parked meanwhile: it stays
        finally:
            _close(channel)


def _never(message: Any) -> None:  # nothing is ever published to a holders queue
    logger.warning("celery-semaphore: a message reached a parking lane's holders queue; "
                   "dropped")


def _channel_error(exc: BaseException) -> bool:
    """An AMQP channel-level refusal (403 access refused, 404 not found, 405 resource locked,
    406 precondition failed): the broker closed that channel, nothing else."""
    from amqp.exceptions import ChannelError

    return isinstance(exc, ChannelError)


def _close(channel: Any) -> None:
    try:
        channel.close()
    except Exception:
        pass
