"""``amqp://``, ``amqps://``, ``pyamqp://``: the token-queue semaphore (RabbitMQ blog, 2014).

A durable classic queue ``<prefix><name>.tokens`` holds one persistent message per slot,
numbered ``0 .. limit-1`` and published with publisher confirms. A holder takes a token and
never acks it: the unacked delivery on the holder's own channel *is* the slot. Release is
``basic.reject(requeue=True)``; a holder whose connection dies gives its token back through the
broker, which is also how a restarted broker restores every token (they are persistent and were
never acked).

Beyond the blog, and why:

* **Registry.** A token alone cannot tell a crashed holder from a partitioned one still
  running (the blog's own 2014 edits), nor give FIFO order, fencing or status. So every grant
  also goes through the registry (see :mod:`.registry`): a slot needs both a token and an
  unexpired registry lease for that token's number, and a token the broker hands back early
  waits until the previous holder's lease expires (or it releases). Status and verify read the
  registry; no management plugin is needed.
* **No greed.** Only the waiters next in line (position < limit) hold a consumer, with prefetch
  1, and it is cancelled as soon as a token arrives. Everyone else is woken by the registry.
  A try also takes a ready token with ``basic.get``; should our consumer's delivery cross
  that get, the hand keeps the delivered token and gives the other back, so a hand's channel
  never holds a token the hand does not know of (see :meth:`TokenBackend._take_token`).
* **Round trips.** An acquire likely to be admitted (the semaphore was not crowded when this
  process last wrote it, or the caller was woken) takes its token with ``basic.get`` while
  its registry consume is on its way, then commits: two round trips. One that will queue takes
  no token: the registry, then the commit. A release gives its token back and wakes the next
  waiters while it still holds the registry, then commits: two. Releases and likely admissions
  consume the registry with a higher priority; a woken waiter's attempt goes first on the
  connection's thread.
* **Numbered tokens.** Each token carries its number and a generation; the registry keeps the
  current generation of every number below the limit. A token above the limit or of an old
  generation (a duplicate left by a shrink and regrow, or by re-creation) is acked away when
  seen, so drift heals itself.
* **Resize** runs while holding the registry message, so two resizes never interleave: grow
  publishes new tokens before the registry lists them; shrink acks the surplus tokens in the
  queue in the same AMQP transaction that commits the smaller limit, and holders of surplus
  tokens ack theirs on release. An interrupted grow leaves stale tokens, which heal as below.
* **Classic queue.** Quorum queues drop a message requeued more than ``delivery-limit`` times
  (20 by default in RabbitMQ 4), which would shrink the semaphore to zero over time; classic
  queues have no delivery limit.
* **consumer_timeout.** RabbitMQ closes a channel holding an unacked delivery longer than
  ``consumer_timeout`` (30 min by default). The hand's channel watcher records it: the next
  renewal reports the lease lost and frees its registry entry. Raise ``consumer_timeout`` (or
  the per-queue ``x-consumer-timeout`` on RabbitMQ >= 3.12) above your longest task.

Fencing: the token ``(slot, epoch)`` uses the token number as the slot and the registry's
per-slot epoch, which strictly increases (see :func:`.model.next_epoch`) and is kept in the
registry message. Under a partition the broker requeues a holder's token when it stops seeing
the connection; the next holder still waits for the registry lease, so two holders of one slot
overlap only if the partitioned holder runs past its own local deadline, which its Lease reports.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import amqp

from ..base import Attempt, Meta
from ..engine import Result, Transaction
from ..model import State, next_epoch
from .registry import Hand, RabbitBackend, RegistryTransaction, _text


def token_of(message: Optional[amqp.Message]) -> Optional[Tuple[int, int]]:
    """``(number, generation)`` of a token message."""
    if message is None:
        return None
    data = json.loads(_text(message.body))
    return int(data["n"]), int(data["gen"])


def is_current(tokens: Dict[str, int], token: Tuple[int, int]) -> bool:
    return tokens.get(str(token[0])) == token[1]


class TokenHand(Hand):
    """A holder's channel with its token: delivered to ``message`` (unacked), or awaited by
    the consumer ``consumer_tag``."""

    def __init__(self, name: str, holder: str, channel: amqp.Channel) -> None:
        super().__init__(name, holder, channel)
        self.message: Optional[amqp.Message] = None
        self.consumer_tag: Optional[str] = None

    def forget_evidence(self) -> None:
        self.message = None
        self.consumer_tag = None

    def holds_nothing(self) -> bool:
        return self.consumer_tag is None and self.message is None and not self.lost

    def awaits_delivery(self) -> bool:
        return self.consumer_tag is not None and self.message is None


class TokenVerdict(NamedTuple):
    """What the acquire rule decided, and what it saw of the token we hold."""

    attempt: Attempt
    token: Optional[Tuple[int, int]]  # the token we hold, taken before or by the rule
    created: bool  # the semaphore did not exist: this attempt created it
    token_stale: bool  # our token is above the limit or of an old generation
    token_slot_held: bool  # another holder's lease still covers our token's slot
    free: int  # limit - holders, before admitting us
    twin_holds: bool  # another holder of our task holds: we may not be admitted yet


class TokenBackend(RabbitBackend[TokenHand]):
    """The token-queue semaphore on RabbitMQ. Options: ``heartbeat`` (s, default 10),
    ``connect_timeout``, ``registry_timeout``, plus the common backend options."""

    hand_class = TokenHand
    #: At most this many semaphores remembered as crowded (see :meth:`_look_for_token`).
    crowded_memory = 1024

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        #: Semaphores whose registry, when this process last wrote it, had waiters or no
        #: free slot. A hint, never trusted for a decision: read and written on the I/O
        #: thread only.
        self._crowded: Dict[str, None] = {}

    def _note_crowding(self, name: str, state: State) -> None:
        self._crowded.pop(name, None)
        if state.waiters or len(state.holders) >= state.limit:
            self._crowded[name] = None
            if len(self._crowded) > self.crowded_memory:
                del self._crowded[next(iter(self._crowded))]

    def tokens_queue(self, name: str) -> str:
        return self.queue_name(name, "tokens")

    # -- physical side (registry message held) -------------------------------------------

    def _publish_tokens(self, name: str, numbers: range, generation: int) -> None:
        channel = self._channel("confirm")
        for number in numbers:
            channel.basic_publish_confirm(
                amqp.Message(
                    json.dumps({"n": number, "gen": generation, "semaphore": name}),
                    delivery_mode=2, content_type="application/json",
                    application_headers={"x-semaphore-token": number},
                ),
                exchange="", routing_key=self.tokens_queue(name),
            )

    def _create_physical(self, txn: RegistryTransaction) -> None:
        assert txn.state is not None  # a registry is created for a state
        name, limit = txn.name, txn.state.limit
        channel = self._channel("confirm")
        queue_name = self.tokens_queue(name)
        channel.queue_declare(
            queue_name, durable=True, auto_delete=False, arguments={"x-queue-type": "classic"}
        )
        channel.queue_purge(queue_name)  # tokens of an earlier incarnation
        generation = next_epoch(0, time.time())
        txn.tokens = {str(n): generation for n in range(limit)}
        self._publish_tokens(name, range(limit), generation)

    def _resize_physical(self, txn: RegistryTransaction) -> None:
        assert txn.state is not None and txn.loaded_limit is not None  # a stored state resized
        name, tokens, limit, old_limit = txn.name, txn.tokens, txn.state.limit, txn.loaded_limit
        if limit > old_limit:
            # Published before the registry lists them: if we die first, they are stale
            # tokens (not listed) and whoever takes one acks it away.
            generation = next_epoch(max(tokens.values(), default=0), time.time())
            for number in range(old_limit, limit):
                tokens[str(number)] = generation
            self._publish_tokens(name, range(old_limit, limit), generation)
        else:
            for number in range(limit, old_limit):
                tokens.pop(str(number), None)
            self._ack_surplus(name, tokens)

    def _ack_surplus(self, name: str, tokens: Dict[str, int]) -> None:
        """Ack the queued tokens that are no longer current; requeue the rest. On the
        registry's transactional channel: the acks take effect with the smaller limit's
        commit, or not at all (a connection lost before it returns every token)."""
        channel = self._channel("tx")
        taken: List[amqp.Message] = []
        while True:
            message = channel.basic_get(self.tokens_queue(name), no_ack=False)
            if message is None:
                break
            taken.append(message)
        for message in taken:
            token = token_of(message)
            if token is not None and is_current(tokens, token):
                channel.basic_reject(message.delivery_tag, requeue=True)
            else:
                channel.basic_ack(message.delivery_tag)

    def _delete_physical(self, txn: RegistryTransaction) -> None:
        self._channel("confirm").queue_delete(self.tokens_queue(txn.name))
        self._known.discard(self.tokens_queue(txn.name))

    # -- hands ---------------------------------------------------------------------------

    def _take_token(self, hand: TokenHand) -> None:
        """Take a ready token into ``hand.message`` (``basic.get``) if it holds none.

        The hand may still be consuming (next in line on an earlier try), and py-amqp
        dispatches the frames that arrive while it waits for the get's answer: a token
        delivered to our own consumer then lands in ``hand.message`` (:meth:`_on_token`)
        before the get returns, typically ``get-empty`` since that token was the ready one.
        The hand keeps that token and gives the get's back: every token a hand's channel
        holds unacked is ``hand.message``, a parked one, or on its way back. (Overwriting it
        left it unacked on a channel that lives on, unreachable: one slot fewer for as long
        as the process's connection lasts.)"""
        queue_name = self.tokens_queue(hand.name)
        if hand.message is None and self._exists(queue_name):
            try:
                message = hand.channel.basic_get(queue_name, no_ack=False)
            except amqp.exceptions.NotFound:  # reset meanwhile; the channel held nothing
                self._known.discard(queue_name)
                self._rehome(hand)  # the broker closed its channel (py-amqp reopened it bare)
                return
            if hand.message is None:
                hand.message = message
            elif message is not None:  # both: the delivery crossed our get
                hand.channel.basic_reject(message.delivery_tag, requeue=True)

    def _consume(self, hand: TokenHand) -> None:
        if hand.consumer_tag is None and hand.message is None:
            hand.consumer_tag = hand.channel.basic_consume(
                self.tokens_queue(hand.name),
                callback=lambda message: self._on_token(hand, message),
                on_cancel=lambda tag: self._consumer_cancelled(hand, tag),
            )

    def _consumer_cancelled(self, hand: TokenHand, tag: str) -> None:
        """The broker cancelled our consumer: the token queue was deleted (a reset)."""
        if hand.consumer_tag == tag:
            hand.consumer_tag = None
            self._known.discard(self.tokens_queue(hand.name))
            self._notify(hand.name, hand.holder)  # re-try: the semaphore is gone or new

    def _stop_consuming(self, hand: TokenHand) -> None:
        tag, hand.consumer_tag = hand.consumer_tag, None
        if tag is not None and hand.channel.is_open:
            # nowait (this runs inside delivery callbacks too): py-amqp would keep the
            # callbacks until a CancelOk it never reads; without them it rejects (requeues)
            # a token that crossed the cancel.
            hand.channel.basic_cancel(tag, nowait=True)
            hand.channel.callbacks.pop(tag, None)
            hand.channel.cancel_callbacks.pop(tag, None)

    def _on_token(self, hand: TokenHand, message: amqp.Message) -> None:
        self._stop_consuming(hand)
        if self._hands.get((hand.name, hand.holder)) is not hand or hand.message is not None:
            hand.channel.basic_reject(message.delivery_tag, requeue=True)
            return
        hand.message = message
        hand.woken = True
        self._notify(hand.name, hand.holder)

    def _drop_evidence(self, hand: TokenHand, keep: bool) -> None:
        self._stop_consuming(hand)
        message, hand.message = hand.message, None
        if message is None or not hand.channel.is_open:
            return
        if keep:
            hand.channel.basic_reject(message.delivery_tag, requeue=True)
        else:
            hand.channel.basic_ack(message.delivery_tag)

    def _give_up(self, hand: TokenHand, tokens: Optional[Dict[str, int]]) -> None:
        """Return the hand's token (ack it when no longer current) and close its channel."""
        token = token_of(hand.message) if not hand.lost else None
        self._drop_evidence(hand, keep=token is not None and tokens is not None
                            and is_current(tokens, token))
        self._close_hand(hand)

    # -- operations ----------------------------------------------------------------------

    def _acquire_here(
        self, name: str, holder: str, limit: int, ttl: float, meta: Meta, wait: bool,
        requested_at: float,
    ) -> Attempt:
        stale_hand = self._hands.get((name, holder))
        if stale_hand is not None and stale_hand.lost:
            self._release_here(name, holder)  # its token is gone: so is its lease
        hand = self._open_hand(name, holder)
        granted_before = hand.granted
        # Tokens whose slot another lease still holds (the broker returned them when their
        # holder's connection died): set aside while we look for a usable one.
        parked: List[amqp.Message] = []
        try:
            return self._look_for_token(hand, name, holder, limit, ttl, meta, wait,
                                        requested_at, parked)
        except BaseException:
            if not granted_before:  # give back what this call took, or it is stuck with us
                try:
                    for message in parked:
                        hand.channel.basic_reject(message.delivery_tag, requeue=True)
                    self._drop_evidence(hand, keep=True)
                    self._close_hand(hand)
                except Exception:  # the connection is gone: the broker returns it all
                    pass
            raise

    def _look_for_token(self, hand: TokenHand, name: str, holder: str, limit: int, ttl: float,
                        meta: Meta, wait: bool, requested_at: float,
                        parked: List[amqp.Message]) -> Attempt:
        """Admit ``holder`` with a token, or queue it.

        A token is taken (``basic.get``) before the registry is taken when the caller is
        likely to be admitted: the semaphore was not crowded when this process last wrote
        its registry, or the caller was woken since its last try, or it is looking again.
        Otherwise the rule takes one only if the registry admits the caller (one round trip
        more while the registry is held): a newcomer behind a queue would take the token a
        woken waiter is about to look for, and only give it back after its registry write,
        while the waiter, finding none, consumes and waits for it."""
        created = False
        missed = 0
        take_first = hand.woken or name not in self._crowded
        hand.woken = False
        for _ in range(limit + 64):
            if take_first:  # its round trip overlaps the registry's (see _wait_for_message)
                self._alongside_registry[name] = functools.partial(self._take_token, hand)
                self._urgent.add(name)  # likely admitted: a handoff (see _take)
            verdict: TokenVerdict = self._transact(
                name, functools.partial(self._admit_with_token, hand, limit, ttl, meta, wait,
                                        not take_first)
            )
            take_first = True
            token = verdict.token
            attempt = verdict.attempt
            if verdict.created and not created:
                created = True  # the tokens exist now: look again
                continue
            if token is None and attempt.grant is None and not wait and verdict.free > 0 \
                    and missed < verdict.free + 1:
                # A try that found no token while the registry shows free slots: the tokens
                # were in other callers' hands between their take and their transaction (or
                # the queue was created after we looked). Each such hand is about to be
                # admitted or to give its token back: look again, a bounded number of times,
                # so that a try answers "full" only when the semaphore is.
                missed += 1
                continue
            if attempt.grant is not None or token is None:
                break
            if verdict.token_stale:
                self._drop_evidence(hand, keep=False)
            elif verdict.token_slot_held:
                parked.append(hand.message)
                hand.message = None
            else:
                # Not ours by the FIFO rule: pass it on, and stop consuming so it goes on.
                self._drop_evidence(hand, keep=True)
                break
        if attempt.grant is None and wait and parked and hand.message is None:
            # Keep one until its lease ends: we are in line for that slot anyway.
            hand.message = parked.pop(0)
        while parked:
            hand.channel.basic_reject(parked.pop().delivery_tag, requeue=True)
        if attempt.grant is not None:
            self._stop_consuming(hand)
            if not hand.granted:
                hand.granted = True
                hand.slot = attempt.grant.slot
                self._arm_deadline(hand, attempt.grant.ttl, requested_at)
        elif not wait:
            self._close_hand(hand)
        elif (attempt.position is not None and attempt.position < verdict.free
              and not verdict.twin_holds):
            self._consume(hand)  # next in line, only the token is missing
        else:
            self._stop_consuming(hand)
        return attempt

    def _admit_with_token(
        self, hand: TokenHand, limit: int, ttl: float, meta: Meta, wait: bool,
        may_take: bool, txn: Transaction,
    ) -> "TokenVerdict":
        """The acquire rule, restricted to the slot of the token we hold (if any). With
        ``may_take`` (no token was looked for just before), a caller holding none that the
        registry admits but for the token takes one first: the only I/O of the rule, done
        once (a retry finds the token in the hand)."""
        assert isinstance(txn, RegistryTransaction)
        holder = hand.holder
        created = txn.state is None
        state = self._declare(txn, limit)  # first: the limit in force may change
        if may_take and hand.message is None and not created and holder not in state.holders \
                and state.place(holder, meta, None, txn.now).slot is not None:
            self._take_token(hand)
        token = token_of(hand.message)
        stale = token is not None and not is_current(txn.tokens, token)
        slot_held = token is not None and any(
            h.slot == token[0] for k, h in state.holders.items() if k != holder
        )
        free = state.limit - len(state.holders)
        twin_holds = state.twin_holds(holder)
        slots = [token[0]] if token is not None and not stale else []
        attempt = self._admit(txn, holder, limit, ttl, meta, wait, slots=slots)
        self._note_crowding(txn.name, state)
        return TokenVerdict(attempt, token, created, stale, slot_held, free, twin_holds)

    def _with_tokens(self, name: str, rule: Callable[[State, float], Result], missing: Result
                     ) -> Tuple[Result, Optional[Dict[str, int]]]:
        """Apply ``rule`` to the semaphore (``missing`` when it does not exist); also return
        the current token generations (None when the semaphore is gone): whether a held token
        goes back to the queue or away."""

        def with_tokens(txn: Transaction) -> Tuple[Result, Optional[Dict[str, int]]]:
            assert isinstance(txn, RegistryTransaction)
            if txn.state is None:
                return missing, None
            return rule(txn.state, txn.now), dict(txn.tokens)

        return self._transact(name, with_tokens)

    def _release_here(self, name: str, holder: str, cancel: bool = False) -> bool:
        """Release ``holder`` (``cancel``: leave the waiter queue too, in the same write).

        The token goes back to its queue while the registry message is still held, just
        before the smaller state commits, and then the waiters this makes admissible are
        woken (:meth:`_wake_early`): a woken waiter's ``basic.get`` finds the token (had
        it missed it, it would wait for a delivery and a third registry write), and its
        registry request waits at the broker for our commit. Whoever takes the token
        meanwhile needs the registry to be admitted, so it sees the new state; if the
        commit fails, the old lease still covers the slot and a taker parks the token."""
        returned: List[TokenHand] = []

        def release(txn: Transaction) -> Tuple[bool, Optional[Dict[str, int]]]:
            assert isinstance(txn, RegistryTransaction)
            if txn.state is None:
                return False, None
            before = txn.state.admissible(txn.now)
            if cancel:
                txn.state.cancel(holder)
            tokens = dict(txn.tokens)
            released = txn.state.release(holder, txn.now)
            self._note_crowding(name, txn.state)
            txn.before_commit.append(
                functools.partial(self._return_token, name, holder, tokens, returned))
            txn.before_commit.append(
                functools.partial(self._wake_early, name, txn.state, before, txn.now))
            return released, tokens

        try:
            self._urgent.add(name)  # it frees a slot (see _take)
            released, tokens = self._transact(name, release)
        except BaseException:
            for gone in returned:  # its token is back, its lease perhaps not released
                gone.lost = True
            raise
        hand = self._hands.get((name, holder))
        if hand is not None:
            self._give_up(hand, tokens)
        return released

    def _return_token(self, name: str, holder: str, tokens: Dict[str, int],
                      returned: List[TokenHand]) -> None:
        """Give ``holder``'s token back (ack it if no longer current): registry held."""
        hand = self._hands.get((name, holder))
        if hand is None or hand.message is None or hand.lost:
            return
        token = token_of(hand.message)
        self._drop_evidence(hand, keep=token is not None and is_current(tokens, token))
        returned.append(hand)

    def abandon(self, name: str, holder: str) -> None:
        """Leave the waiter queue and release, in one registry write (two elsewhere)."""
        self.link.call(self._abandon_here, name, holder)

    def _abandon_here(self, name: str, holder: str) -> None:
        self._stop_waiting(name, holder)
        self._release_here(name, holder, cancel=True)

    def cancel(self, name: str, holder: str) -> None:
        self.link.call(self._cancel_here, name, holder)

    def _cancel_here(self, name: str, holder: str) -> None:
        self._stop_waiting(name, holder)
        self._transact(name, lambda txn: txn.state.cancel(holder) if txn.state else None)

    def _stop_waiting(self, name: str, holder: str) -> None:
        """A waiter leaves: give back what its hand holds (a parked token, a consumer)."""
        hand = self._hands.get((name, holder))
        if hand is not None and not hand.granted:
            self._drop_evidence(hand, keep=True)
            self._close_hand(hand)

    def _renew_here(self, name: str, holder: str, ttl: float, requested_at: float
                    ) -> Optional[float]:
        hand = self._hands.get((name, holder))
        if hand is not None and hand.lost:  # the broker took the token back
            self._release_here(name, holder)
            self._transact(name, lambda txn: txn.state.count("lost") if txn.state else None)
            return None
        expiry, tokens = self._with_tokens(
            name, lambda state, now: state.renew(holder, ttl, now), None
        )
        if hand is not None:
            if expiry is None:
                self._give_up(hand, tokens)
            else:
                self._arm_deadline(hand, ttl, requested_at)
        return expiry
