"""``amqp+slots://``, ``amqps+slots://``: the persistent slot-queue semaphore of amqp-locks.

Selected by the URL scheme: ``amqp+slots://user:pass@host:5672/vhost`` is the broker URL
``amqp://user:pass@host:5672/vhost`` with this design.

Each slot ``i`` of a semaphore is a durable queue ``<prefix><name>.slot.<i>`` (an *A queue*,
``0 <= i < limit``), so the limit survives broker restarts and an operator sees it with
``rabbitmqctl list_queues``. A holder of slot ``i`` declares ``<prefix><name>.held.<i>`` as an
exclusive queue (a *B queue*) on its connection: the broker refuses a second holder with
RESOURCE_LOCKED and deletes the B queue when the holder's connection dies. Exclusivity is per
connection, so within one process (one connection) the backend checks its own hands first.

Beyond amqp-locks, and why:

* **Registry.** As for the token backend (see :mod:`.registry`), admission, FIFO order, lease
  expiry and fencing epochs live in the registry message; the B queue is the holder's physical
  claim. A slot the registry grants but whose B queue is still locked (its previous holder has
  not yet noticed its lease lapsed) is handed back, and the caller tries another slot, up to
  ``lock_retries`` times with jitter, then waits like any waiter.
* **Resize** runs while holding the registry message (the administration mutex): grow declares
  A queues, shrink deletes them in descending order, each delete confirmed before the next, and
  overshoots by ``overshoot`` queues to clean up after an interrupted administrator. Holders of
  removed slots keep them until they release (they are counted against the new limit).
* **Waiting** is not push by nature here: there is nothing to consume. Waiters are woken by
  the registry's wake-up messages (sent by the operation that made them admissible) and poll
  as a fallback.
* **Verify** probes the holder's own B queue on its channel, then reads the registry.

Guarantee under a partition: the broker deletes a cut-off holder's B queue once it notices the
connection is gone (heartbeat), but the registry lease still blocks the slot until it expires,
and the holder's Lease reports the loss by its local deadline.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any, Optional, Set

from amqp import exceptions as amqp_errors

from ..base import Attempt, Meta
from ..engine import Transaction
from ..model import Waiter
from .registry import Hand, RabbitBackend, RegistryTransaction

logger = logging.getLogger(__name__)


class SlotHand(Hand):
    """A holder's channel; ``claimed`` while its exclusive B queue is declared on it."""

    def __init__(self, name: str, holder: str, channel: Any) -> None:
        super().__init__(name, holder, channel)
        self.claimed = False


class SlotQueueBackend(RabbitBackend[SlotHand]):
    """The slot-queue semaphore on RabbitMQ. Options: ``lock_retries`` (default 5),
    ``overshoot`` (default 8), and those of :class:`.registry.RabbitBackend`."""

    hand_class = SlotHand

    def __init__(self, url: str, *, lock_retries: int = 5, overshoot: int = 8,
                 **options: Any) -> None:
        super().__init__(url, **options)
        self.lock_retries = int(lock_retries)
        self.overshoot = int(overshoot)

    @staticmethod
    def _broker_url(url: str) -> str:
        scheme, sep, rest = url.partition("://")
        return scheme.replace("+slots", "") + sep + rest

    def slot_queue(self, name: str, slot: int) -> str:
        return self.queue_name(name, f"slot.{slot}")

    def held_queue(self, name: str, slot: int) -> str:
        return self.queue_name(name, f"held.{slot}")

    # -- physical side (registry message held) -------------------------------------------

    def _declare_slots(self, name: str, slots: range) -> None:
        channel = self._channel("confirm")
        for slot in slots:
            channel.queue_declare(self.slot_queue(name, slot), durable=True, auto_delete=False,
                                  arguments={"x-queue-type": "classic"})

    def _delete_slots(self, name: str, down_to: int, top: int) -> None:
        """Delete A queues ``top + overshoot - 1`` down to ``down_to``, one confirmed delete
        at a time (deleting an absent queue is a no-op)."""
        channel = self._channel("confirm")
        for slot in range(top + self.overshoot - 1, down_to - 1, -1):
            channel.queue_delete(self.slot_queue(name, slot))

    def _create_physical(self, txn: RegistryTransaction) -> None:
        assert txn.state is not None  # a registry is created for a state
        limit = txn.state.limit
        self._delete_slots(txn.name, limit, limit)  # leftovers of an earlier life
        self._declare_slots(txn.name, range(limit))

    def _resize_physical(self, txn: RegistryTransaction) -> None:
        assert txn.state is not None and txn.loaded_limit is not None  # a stored state resized
        limit, old_limit = txn.state.limit, txn.loaded_limit
        if limit > old_limit:
            self._declare_slots(txn.name, range(old_limit, limit))
        else:
            self._delete_slots(txn.name, limit, old_limit)

    def _delete_physical(self, txn: RegistryTransaction) -> None:
        assert txn.loaded_limit is not None  # the stored state reset
        self._delete_slots(txn.name, 0, txn.loaded_limit)

    def _claimed_by_another_hand(self, hand: SlotHand, slot: int) -> bool:
        """Exclusive queues belong to the connection: a second hand of this process would
        re-declare a B queue this process holds without an error, so look here first."""
        return any(
            other is not hand and other.claimed and not other.lost and other.name == hand.name
            and other.slot == slot for other in self._hands.values()
        )

    def _claim(self, hand: SlotHand, slot: int) -> bool:
        """Declare the slot's B queue on the hand's channel; False if another holds it."""
        if self._claimed_by_another_hand(hand, slot):
            return False
        try:
            hand.channel.queue_declare(self.held_queue(hand.name, slot), exclusive=True,
                                       auto_delete=False)
        except amqp_errors.ResourceLocked:  # the broker closed (and py-amqp reopened) the channel
            return False
        hand.slot = slot
        hand.claimed = True
        return True

    def _drop_evidence(self, hand: SlotHand, keep: bool) -> None:
        claimed, hand.claimed = hand.claimed, False
        if claimed and hand.slot is not None and hand.channel.is_open and not (
            self._claimed_by_another_hand(hand, hand.slot)
        ):
            try:
                hand.channel.queue_delete(self.held_queue(hand.name, hand.slot))
            except amqp_errors.ChannelError:
                pass

    # -- operations ----------------------------------------------------------------------

    def _acquire_here(
        self, name: str, holder: str, limit: int, ttl: float, meta: Meta, wait: bool,
        requested_at: float,
    ) -> Attempt:
        current = self._hands.get((name, holder))
        if current is not None and current.lost and current.granted:
            self._release_here(name, holder)  # its B queue is gone: so is its lease
        locked: Set[int] = set()
        for attempt_number in range(self.lock_retries + 1):
            def admit(txn: Transaction) -> Attempt:
                state = self._declare(txn, limit)  # first: the limit in force may change
                slots = [s for s in range(state.limit) if s not in locked]
                return self._admit(txn, holder, limit, ttl, meta, wait, slots=slots)

            attempt = self._transact(name, admit)
            if attempt.grant is None:
                if not wait and (name, holder) in self._hands:
                    self._close_hand(self._hands[(name, holder)])
                return attempt
            hand = self._open_hand(name, holder)
            if hand.granted or self._claim(hand, attempt.grant.slot):
                if not hand.granted:
                    hand.granted = True
                    self._arm_deadline(hand, attempt.grant.ttl, requested_at)
                return attempt
            # Granted by the registry, but the previous holder's B queue is still there: give
            # the slot back and stay first in line (we were), then try another slot.
            logger.debug("slot %d of %r granted to %s but still claimed (its B queue exists): "
                         "handed back", attempt.grant.slot, name, holder)
            locked.add(attempt.grant.slot)
            self._transact(name, functools.partial(self._back_to_the_head, holder, meta, wait))
            self._close_hand(hand)
            time.sleep(random.uniform(0.001, 0.005) * (attempt_number + 1))
        return Attempt(None, 0 if wait else None, 0.05, attempt.limit)

    def _back_to_the_head(self, holder: str, meta: Meta, wait: bool, txn: Transaction) -> None:
        state = txn.state
        if state is None or not state.release(holder) or not wait:
            return
        ticket = min((w.ticket for w in state.waiters.values()), default=state.next_ticket) - 1
        state.waiters[holder] = Waiter(ticket, txn.now, txn.now + self.waiter_ttl,
                                       self.client_id, meta)

    def _release_here(self, name: str, holder: str) -> bool:
        released = self._transact(
            name, lambda txn: txn.state is not None and txn.state.release(holder, txn.now)
        )
        hand = self._hands.get((name, holder))
        if hand is not None:
            self._drop_evidence(hand, keep=False)
            self._close_hand(hand)
        return released

    def cancel(self, name: str, holder: str) -> None:
        self._transact(name, lambda txn: txn.state.cancel(holder) if txn.state else None)

    def _renew_here(self, name: str, holder: str, ttl: float, requested_at: float
                    ) -> Optional[float]:
        hand = self._hands.get((name, holder))
        if hand is not None and hand.lost:
            self._release_here(name, holder)
            self._transact(name, lambda txn: txn.state.count("lost") if txn.state else None)
            return None
        expiry = self._transact(
            name, lambda txn: txn.state.renew(holder, ttl, txn.now) if txn.state else None
        )
        if hand is not None:
            if expiry is None:
                self._drop_evidence(hand, keep=False)
                self._close_hand(hand)
            else:
                self._arm_deadline(hand, ttl, requested_at)
        return expiry

    def _verify_here(self, name: str, holder: str) -> bool:
        hand = self._hands.get((name, holder))
        if hand is not None:
            if hand.lost or hand.slot is None:  # lost: its channel may be of a dead connection
                return False
            try:  # the holder's own claim, on its own channel (a shrink may have removed the
                # slot's A queue: its holder keeps the slot until it releases)
                hand.channel.queue_declare(self.held_queue(name, hand.slot), passive=True)
            except amqp_errors.NotFound:
                return False
        return super()._verify_here(name, holder)
