"""What the two RabbitMQ backends share: a registry of each semaphore kept as a single
message (the storage of :mod:`..engine`), wake-up queues, and the channels holders keep. All of
it runs on one :class:`.link.AMQPLink` thread per backend instance.

**Registry.** RabbitMQ stores messages, not records, so a semaphore's state (limit, holders with
lease expiry and fencing epochs, FIFO waiters: :class:`.model.State`) is ONE persistent message
in the durable classic queue ``<prefix><name>.registry``. Taking that message (a consumer with
prefetch 1, unacked, cancelled once it arrives) is the semaphore's mutex; the update
publishes the new state and acks the old one in one AMQP transaction on that one queue, so a
client that dies mid-update leaves the old state requeued by the broker, never two or none.
Deletion removes the queue while holding its message. One window is left: a client killed
between declaring a new registry queue and publishing its first state leaves it empty, and
operations on that name time out (BackendUnavailable) until the queue is deleted by hand
(``rabbitmqctl delete_queue <prefix><name>.registry``). Nothing recreates the message
automatically: a frozen process may still hold it, and two states could admit twice the limit.
Creation and deletion happen under ``<queue>.admin``, an exclusive queue (RESOURCE_LOCKED when
another connection holds it). ``<prefix>names`` is a registry message of its own listing the
names. Queues need no management plugin and live until ``reset``.

**Clock.** RabbitMQ has no clock a client can read: lease times are the clock of the client
applying the change, so hosts must keep their clocks synchronized (NTP); a skew of ``d``
seconds makes a lease last ``d`` seconds longer or shorter on the registry.

**Holders.** Each waiting or holding caller gets a channel of its own (a *hand*) holding the
backend's physical evidence of the slot (a token message or an exclusive queue). A slot needs
both the registry's admission and that evidence. The hand is given up when the lease ends,
when its local deadline passes unrenewed, or when the broker closes the channel or connection;
renewal then reports the lease lost.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    TypeVar,
    cast,
)

import amqp
from amqp import exceptions as amqp_errors
from amqp import spec

from ...exceptions import BackendUnavailable, ConfigurationError
from ..base import Attempt, Meta
from ..engine import DocumentBackend, Result, Rule, Transaction
from ..model import State, as_json
from .link import CONNECTION_ERRORS, AMQPLink

logger = logging.getLogger(__name__)

def _text(body: Any) -> str:
    return body.decode("utf-8") if isinstance(body, bytes) else body


def _add(name: str, names: List[str]) -> None:
    if name not in names:
        names.append(name)


def _discard(name: str, names: List[str]) -> None:
    if name in names:
        names.remove(name)


def watch_channel(channel: amqp.Channel, on_closed: Callable[[], None]) -> None:
    """Call ``on_closed`` when the broker closes ``channel`` (consumer_timeout, an error).

    py-amqp reopens a channel the broker closed and raises the error to whoever reads the
    frame; the reopened channel holds nothing, so whatever it held must be counted as lost.
    """
    revive = channel._do_revive

    def closed() -> None:
        on_closed()
        revive()

    channel._do_revive = closed


@dataclass
class Hand:
    """One holder's channel and the physical evidence of its slot (kept by subclasses)."""

    name: str
    holder: str
    channel: amqp.Channel
    lost: bool = False
    granted: bool = False
    deadline: float = 0.0
    slot: Optional[int] = None
    #: a wake-up came since its last try: the registry found it admissible
    woken: bool = False

    def forget_evidence(self) -> None:
        """The broker closed the channel, and took back what it held."""

    def holds_nothing(self) -> bool:
        """Nothing of this hand is left on its channel: the channel can serve another hand."""
        return not self.lost

    def awaits_delivery(self) -> bool:
        """Its consumer will be delivered the evidence itself (no wake-up needed)."""
        return False


#: The hands of a backend (its :attr:`RabbitBackend.hand_class`).
HandT = TypeVar("HandT", bound=Hand)


class RegistryTransaction(Transaction):
    """A semaphore's registry message held (``version``; None when there is no registry
    yet), its state, and the token generations the token backend stores beside it."""

    def __init__(self, name: str, message: Optional[amqp.Message], now: float) -> None:
        self.body = _text(message.body) if message is not None else None
        document = json.loads(self.body) if self.body is not None else None
        state = None
        if document is not None:  # {"state": ..., "tokens": ...}; before 0.3 the bare state
            state = State.from_dict(document.get("state", document))
        super().__init__(name, state, now, message)
        self.loaded_limit = state.limit if state is not None else None
        legacy = (document or {}).get("extra", {})
        #: token number (as a string) -> its current generation (token backend only)
        self.tokens: Dict[str, int] = dict((document or {}).get("tokens", legacy.get("tokens", {})))
        #: the new state is being stored: a failure now must not give the old message back
        self.settled = False
        #: run while the registry message is still held, right before the store commits
        #: (:meth:`RabbitBackend._put`): what must be in place before anyone can read the
        #: new state, such as a released token back in its queue
        self.before_commit: List[Callable[[], None]] = []

    def dumps(self) -> str:
        assert self.state is not None
        document: Dict[str, Any] = {"state": self.state.to_dict()}
        if self.tokens:
            document["tokens"] = self.tokens
        return json.dumps(document, separators=(",", ":"))


class RabbitBackend(DocumentBackend, Generic[HandT]):
    """Base of the RabbitMQ backends: the registry (see module docstring) and the hands.

    Subclasses implement the physical side: :meth:`_create_physical`, :meth:`_resize_physical`,
    :meth:`_delete_physical`, and the operations that involve their evidence, kept in their
    :attr:`hand_class`.
    """

    hand_class: Type[Hand] = Hand
    #: Priorities, fair weights and the front of the queue are orderings of the registry's
    #: queue and work as elsewhere; a cost would need several tokens (slot queues) claimed at
    #: once, and a rate a start that a slot handed back (a token that cannot be claimed)
    #: would not undo: both are refused (:meth:`.base.Backend.check_traffic`), and so are
    #: quotas, units, adaptive limits and pauses (a clock of each client's own).
    traffic_options = frozenset({"priority", "fair_weight", "front"})

    def __init__(
        self,
        url: str,
        *,
        heartbeat: float = 10.0,
        connect_timeout: float = 5.0,
        registry_timeout: float = 30.0,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        for option, value in (("heartbeat", heartbeat), ("connect_timeout", connect_timeout),
                              ("registry_timeout", registry_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"AMQP backend option {option} must be > 0 seconds")
        self.heartbeat = float(heartbeat)
        self.connect_timeout = float(connect_timeout)
        self.registry_timeout = float(registry_timeout)
        self.broker_url = self._broker_url(url)
        self._link_lock = threading.Lock()
        self._link: Optional[AMQPLink] = None
        self._hands: Dict[Tuple[str, str], HandT] = {}
        #: (name, client, holder) woken by :meth:`_wake_early` in the transaction under way
        self._woken_early: Set[Tuple[str, str, str]] = set()
        #: name -> what to run alongside the next take of its registry (:meth:`_take`)
        self._alongside_registry: Dict[str, Callable[[], None]] = {}
        #: names whose next registry take is urgent (:meth:`_take`)
        self._urgent: Set[str] = set()
        self._consumer_serial = 0
        self._reset_connection_state()

    @staticmethod
    def _broker_url(url: str) -> str:
        return url

    def _reset_connection_state(self) -> None:
        """Forget everything tied to the connection. Hands are kept: see _connection_lost."""
        self._channels: Dict[str, amqp.Channel] = {}
        self._retired: List[amqp.Channel] = []
        self._known: Set[str] = set()  # registry queues seen to exist
        self._owners: Dict[int, HandT] = {}  # id(channel) -> the hand using it
        self._spare: List[amqp.Channel] = []
        self._tainted: Set[int] = set()
        self._wake_queue: Optional[str] = None

    @property
    def link(self) -> AMQPLink:
        with self._link_lock:
            if self._link is None:
                self._link = AMQPLink(
                    self.broker_url, heartbeat=self.heartbeat,
                    connect_timeout=self.connect_timeout,
                    on_connection_lost=self._connection_lost,
                )
            return self._link

    # -- names of things on the broker ----------------------------------------------------

    def queue_name(self, name: str, kind: str) -> str:
        return f"{self.key_prefix}{name}.{kind}"

    @property
    def names_queue(self) -> str:
        return f"{self.key_prefix}names"

    # -- channels (I/O thread) -----------------------------------------------------------

    def _channel(self, role: str) -> amqp.Channel:
        """A long-lived channel of the connection: ``tx`` (registry), ``confirm``, ``probe``."""
        while self._retired:  # reopened by py-amqp after the broker closed them: unused
            retired = self._retired.pop()
            try:
                if retired.is_open:
                    retired.close()
            except amqp_errors.ChannelError:
                pass
        channel = self._channels.get(role)
        if channel is None or not channel.is_open:
            channel = self.link.connection().channel()
            if role == "tx":
                channel.basic_qos(0, 1, False)
                channel.tx_select()
                watch_channel(channel, functools.partial(self._retire, role, channel))
            self._channels[role] = channel
        return channel

    def _retire(self, role: str, channel: amqp.Channel) -> None:
        """The broker closed ``channel`` (py-amqp reopens it bare): use a new one for the role."""
        if self._channels.get(role) is channel:
            del self._channels[role]
        self._retired.append(channel)

    def _connection_lost(self) -> None:
        # Hands stay known, marked lost, so that renewals report the lease lost.
        hands = list(self._hands.values())
        self._reset_connection_state()
        for hand in hands:
            hand.lost = True
        self._evidence_lost(hands)

    def _evidence_lost(self, hands: List[HandT]) -> None:
        """The broker took these hands' evidence back; wake their waiters to re-try."""
        for hand in hands:
            if not hand.granted:
                self._notify(hand.name, hand.holder)

    def _open_hand(self, name: str, holder: str) -> HandT:
        hand = self._hands.get((name, holder))
        if hand is not None and hand.channel.is_open and not hand.lost:
            return hand
        while self._spare and not self._spare[-1].is_open:
            self._spare.pop()
        channel = self._spare.pop() if self._spare else self._new_hand_channel()
        hand = cast(HandT, self.hand_class(name, holder, channel))  # a subclass sets it to HandT
        self._owners[id(channel)] = hand
        self._hands[(name, holder)] = hand
        return hand

    def _new_hand_channel(self) -> amqp.Channel:
        channel = self.link.connection().channel()
        channel.basic_qos(0, 1, False)
        watch_channel(channel, functools.partial(self._channel_closed, channel))
        return channel

    def _rehome(self, hand: HandT) -> None:
        """Move a hand that holds nothing to a fresh channel (the broker closed its own)."""
        old = hand.channel
        self._tainted.discard(id(old))
        if self._owners.get(id(old)) is hand:
            del self._owners[id(old)]
        try:
            if old.is_open:
                old.close()
        except amqp_errors.ChannelError:
            pass
        hand.channel = self._new_hand_channel()
        hand.lost = False
        hand.forget_evidence()
        self._owners[id(hand.channel)] = hand

    def _channel_closed(self, channel: amqp.Channel) -> None:
        self._tainted.add(id(channel))  # reopened by py-amqp without its prefetch: retire it
        hand = self._owners.pop(id(channel), None)
        if hand is not None:
            hand.lost = True
            hand.forget_evidence()
            self._evidence_lost([hand])

    def _close_hand(self, hand: HandT) -> None:
        """Forget the hand; its channel, holding nothing now, is kept for the next one."""
        if self._hands.get((hand.name, hand.holder)) is hand:
            del self._hands[(hand.name, hand.holder)]
        channel = hand.channel
        if self._owners.get(id(channel)) is hand:
            del self._owners[id(channel)]
        reusable = hand.holds_nothing()
        try:
            if reusable and id(channel) not in self._tainted and len(self._spare) < 64:
                self._spare.append(channel)
            elif channel.is_open:
                self._tainted.discard(id(channel))
                channel.close()
        except amqp_errors.ChannelError:
            pass

    def _arm_deadline(self, hand: HandT, ttl: float, requested_at: float) -> None:
        """Give the evidence up if the lease is not renewed before its local deadline."""
        hand.deadline = requested_at + ttl
        self.link.call_at(hand.deadline, functools.partial(self._deadline_passed, hand))

    def _deadline_passed(self, hand: HandT) -> None:
        if hand.granted and not hand.lost and time.monotonic() >= hand.deadline:
            logger.info("semaphore %r: lease of %s passed its deadline unrenewed; giving it "
                        "up", hand.name, hand.holder)
            hand.lost = True  # kept in _hands, so that renewal reports the loss
            self._drop_evidence(hand, keep=True)

    def _drop_evidence(self, hand: HandT, keep: bool) -> None:
        """Give the slot's evidence back to the broker (``keep``: for the next holder)."""
        raise NotImplementedError

    # -- the registry (I/O thread) -------------------------------------------------------

    @contextmanager
    def _admin_lock(self, target: str) -> Iterator[amqp.Channel]:
        """Hold ``<target>.admin``, an exclusive queue: another connection declaring it gets
        RESOURCE_LOCKED (bounded retries with jitter). Unlocked by deleting the queue, or by
        the broker when our connection dies."""
        lock = f"{target}.admin"
        channel = self._channel("admin")
        deadline = time.monotonic() + self.registry_timeout
        delay = 0.002
        while True:
            try:
                channel.queue_declare(lock, exclusive=True, auto_delete=False)
                break
            except amqp_errors.ResourceLocked:
                pass  # py-amqp reopened the channel the broker closed: try again on it
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"could not lock {lock} in {self.registry_timeout}s")
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 0.1)
        try:
            yield channel
        finally:
            if channel.is_open:
                channel.queue_delete(lock)

    def _exists(self, queue_name: str) -> bool:
        if queue_name in self._known:
            return True
        channel = self._channel("probe")
        try:
            channel.queue_declare(queue_name, passive=True)
        except amqp_errors.NotFound:
            return False
        self._known.add(queue_name)
        return True

    def _take(self, queue_name: str, alongside: Optional[Callable[[], None]] = None,
              urgent: bool = False) -> Optional[amqp.Message]:
        """The registry message of ``queue_name``, held until :meth:`_put` or
        :meth:`_return_registry`; None when the queue does not exist. ``alongside``: see
        :meth:`_wait_for_message` (not run when the queue is not known to exist).

        ``urgent``: a write that frees a slot or is expected to take one (a release, an
        acquire likely admitted) consumes with priority 1, the rest (a caller that will
        queue, a renewal, a read) with the default 0: when the registry comes back, RabbitMQ
        gives it to a waiting consumer of the highest priority, so a handoff does not wait
        behind newcomers getting in line. No starvation: urgent writes need holders, and
        holders come only from the queue."""
        if not self._exists(queue_name):
            return None
        channel = self._channel("tx")
        try:
            message = self._wait_for_message(channel, queue_name, alongside,
                                             {"x-priority": 1} if urgent else None)
        except amqp_errors.NotFound:  # deleted by a reset elsewhere
            message = None
        if message is None:
            self._known.discard(queue_name)
        return message

    def _wait_for_message(self, channel: amqp.Channel, queue_name: str,
                          alongside: Optional[Callable[[], None]] = None,
                          arguments: Optional[Dict[str, Any]] = None
                          ) -> Optional[amqp.Message]:
        """Consume the registry message: at once when it is in its queue, else when its
        holder gives it back; None when the queue is deleted meanwhile (the broker cancels
        our consumer, or closes the channel: the consume failed). A consumer rather than
        ``basic.get`` first: the message comes right after the ConsumeOk, so a free registry
        costs the same one round trip, and a held one is not asked for twice (an empty get,
        then the consumer).

        ``alongside`` (the token backend's ``basic.get`` of a token) runs once the consume
        is sent, without its ConsumeOk (``nowait``), so that its round trip and the
        registry's overlap; the registry message delivered meanwhile lands in ``got``."""
        got: List[amqp.Message] = []
        cancelled: List[str] = []
        if alongside is None:
            tag = channel.basic_consume(queue_name, callback=got.append,
                                        on_cancel=cancelled.append, arguments=arguments)
        else:
            self._consumer_serial += 1
            tag = channel.basic_consume(
                queue_name, consumer_tag=f"cs-registry-{self._consumer_serial}", nowait=True,
                callback=got.append, on_cancel=cancelled.append, arguments=arguments)
        try:
            if alongside is not None:
                alongside()
            # A channel retired meanwhile was closed by the broker (py-amqp reopened it
            # bare): our consume failed or the queue went, and nothing more will come.
            self.link.wait_for(
                lambda: bool(got or cancelled) or self._channels.get("tx") is not channel,
                self.registry_timeout, queue_name)
            if not got and not cancelled:
                cancelled.append(tag)  # the broker closed the channel: no consumer is left
        finally:
            if channel.is_open and not cancelled:
                if got:
                    # Not waited for (that round trip would be spent holding the registry):
                    # prefetch 1, so nothing more is delivered while we hold the message,
                    # and the broker handles the cancel before what we send after it on this
                    # channel (the store and its commit). py-amqp drops the consumer's
                    # callbacks when the CancelOk arrives.
                    channel.send_method(spec.Basic.Cancel, "sb", (tag, False))
                else:
                    # Synchronous: a delivery that crossed our cancel lands in ``got`` before
                    # the CancelOk, instead of in a callback nobody reads.
                    channel.basic_cancel(tag)
            if got and sys.exc_info()[0] is not None:
                self._return_registry(got.pop())
        return got[0] if got else None

    def _put(self, message: amqp.Message, queue_name: str, body: str,
             before_commit: Sequence[Callable[[], None]] = ()) -> None:
        channel = self._channel("tx")
        channel.basic_publish(
            amqp.Message(body, delivery_mode=2, content_type="application/json"),
            exchange="", routing_key=queue_name,
        )
        channel.basic_ack(message.delivery_tag)
        for step in before_commit:
            step()
        channel.tx_commit()

    def _return_registry(self, message: amqp.Message,
                         before_commit: Sequence[Callable[[], None]] = ()) -> None:
        channel = self._channel("tx")
        channel.basic_reject(message.delivery_tag, requeue=True)
        for step in before_commit:
            step()
        channel.tx_commit()

    def _create(self, queue_name: str, make_body: Callable[[], str]) -> bool:
        """Create the registry queue with its message; False when someone else did first.

        ``make_body`` runs under the admin lock before the message is published.
        """
        with self._admin_lock(queue_name) as lock:
            self._known.discard(queue_name)
            if self._exists(queue_name):
                return False
            body = make_body()
            lock.queue_declare(
                queue_name, durable=True, auto_delete=False, arguments={"x-queue-type": "classic"}
            )
            lock.basic_publish_confirm(
                amqp.Message(body, delivery_mode=2, content_type="application/json"),
                exchange="", routing_key=queue_name,
            )
            self._known.add(queue_name)
            return True

    def _delete(self, message: amqp.Message, queue_name: str, after: Callable[[], None]) -> None:
        with self._admin_lock(queue_name) as lock:
            # Deleted while we hold its message: the message goes with the queue, so no moment
            # leaves an empty registry queue that every later _take would wait on forever.
            lock.queue_delete(queue_name)
            self._known.discard(queue_name)
            channel = self._channel("tx")
            channel.basic_ack(message.delivery_tag)  # a no-op for the broker now
            channel.tx_commit()
            after()

    def _update_document(self, queue_name: str, change: Callable[[Any], Any], default: Any) -> Any:
        """Apply ``change`` to a JSON registry document other than a semaphore's state."""
        while True:
            message = self._take(queue_name)
            if message is None:
                value = default
                change(value)
                if self._create(queue_name, functools.partial(json.dumps, value)):
                    return value
                continue
            value = json.loads(_text(message.body))
            change(value)
            self._put(message, queue_name, json.dumps(value))
            return value

    # -- the engine's storage: the registry message (I/O thread) ---------------------------

    def _transact(self, name: str, rule: Rule[Result], *, write: bool = True) -> Result:
        transact: Callable[[str, Rule[Result], bool], Result] = self._transact_here
        return self.link.call(transact, name, rule, write)

    def _transact_here(self, name: str, rule: Rule[Result], write: bool) -> Result:
        try:
            return super()._transact(name, rule, write=write)
        finally:
            self._woken_early.clear()
            self._alongside_registry.clear()
            self._urgent.clear()

    def _wake_early(self, name: str, state: State, before: Set[Tuple[str, str]],
                    now: float) -> None:
        """Wake the waiters ``state`` makes admissible (``before``: those admissible
        already) now, registry still held, rather than after the commit: a woken waiter's
        attempt then reaches the broker while the commit is under way and is handed the
        registry as soon as it is free. A wake-up is only a hint: should the commit fail,
        the waiter finds the old state and waits on. The engine's wake-ups after the commit
        skip these (a ``before_commit`` step of the transaction under way)."""
        for client, holder in state.wakeups(before, now):
            self._send_wakeup(client, name, holder)
            self._woken_early.add((name, client, holder))

    @contextmanager
    def _load(self, name: str) -> Iterator[Transaction]:
        """Take the registry message (the semaphore's mutex) until :meth:`_commit` stores the
        new state or the transaction ends. Any failure before the store gives the message
        back: the registry is never left held by a live connection that will not touch it."""
        if self._wake_queue is None and self._watchers:
            self._listen_here()  # after a reconnect: the old wake-up queue died with it
        message = self._take(self.queue_name(name, "registry"),
                             self._alongside_registry.pop(name, None), name in self._urgent)
        txn = RegistryTransaction(name, message, time.time())
        try:
            yield txn
        except BaseException:
            if message is not None and not txn.settled and self.link.conn is not None:
                try:
                    self._return_registry(message)
                except CONNECTION_ERRORS + (amqp_errors.ChannelError,):
                    pass  # the broker requeues what a closed channel or connection held
            raise
        if message is not None and not txn.settled:  # a read
            self._return_registry(message)

    def _commit(self, txn: Transaction) -> bool:
        assert isinstance(txn, RegistryTransaction)
        name, queue_name = txn.name, self.queue_name(txn.name, "registry")
        message = txn.version
        if message is None:  # no registry yet
            if txn.state is None:
                return True
            if not self._create(queue_name, functools.partial(self._created, txn)):
                return False  # another client created it first: decide again on its state
            self._update_document(self.names_queue, functools.partial(_add, name), [])
            return True
        if txn.state is None:
            self._delete(message, queue_name, functools.partial(self._after_reset, txn))
            txn.settled = True
            return True
        if txn.state.limit != txn.loaded_limit:
            self._resize_physical(txn)
        body = txn.dumps()
        txn.settled = True
        if body == txn.body:
            self._return_registry(message, txn.before_commit)
        else:
            self._put(message, queue_name, body, txn.before_commit)
        return True

    def _created(self, txn: "RegistryTransaction") -> str:
        self._create_physical(txn)
        return txn.dumps()

    def _after_reset(self, txn: "RegistryTransaction") -> None:
        self._delete_physical(txn)
        self._update_document(self.names_queue, functools.partial(_discard, txn.name), [])

    def _stored_names(self) -> List[str]:
        def read() -> List[str]:
            message = self._take(self.names_queue)
            if message is None:
                return []
            self._return_registry(message)
            return list(json.loads(_text(message.body)))

        return self.link.call(read)

    # -- operations: each runs on the I/O thread, in the subclass's ``_*_here`` ---------------

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        meta = as_json(meta)
        self.check_meta(meta)
        # A woken waiter's attempt goes before calls queued already (a newcomer getting in
        # line, say): the slot waits for it. The hand is read off the I/O thread, as a hint.
        hand = self._hands.get((name, holder))
        return self.link.call(
            self._acquire_here, name, holder, limit, ttl, meta, wait, time.monotonic(),
            urgent=hand is not None and hand.woken,
        )

    def release(self, name: str, holder: str, outcome: Optional[str] = None,
                latency: Optional[float] = None) -> bool:
        """(``outcome`` and ``latency``: no adaptive limit here, ignored.)"""
        # Not urgent: in a process whose I/O thread is saturated, releases that overtake
        # the attempts of waiters not (yet) woken keep fewer slots held than the limit.
        return self.link.call(self._release_here, name, holder)

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        return self.link.call(self._renew_here, name, holder, ttl, time.monotonic())

    def _acquire_here(self, name: str, holder: str, limit: int, ttl: float, meta: Meta,
                      wait: bool, requested_at: float) -> Attempt:
        raise NotImplementedError

    def _release_here(self, name: str, holder: str) -> bool:
        raise NotImplementedError

    def _renew_here(self, name: str, holder: str, ttl: float, requested_at: float
                    ) -> Optional[float]:
        raise NotImplementedError

    # -- physical side, per design (I/O thread, registry message held) -------------------

    def _create_physical(self, txn: "RegistryTransaction") -> None:
        raise NotImplementedError

    def _resize_physical(self, txn: "RegistryTransaction") -> None:
        """Change the physical side from ``txn.loaded_limit`` to ``txn.state.limit`` (registry
        message held; acks and rejects on the ``tx`` channel commit with the new state)."""
        raise NotImplementedError

    def _delete_physical(self, txn: "RegistryTransaction") -> None:
        """Remove the physical side of ``txn.loaded_limit`` slots."""
        raise NotImplementedError

    # -- wake-ups ------------------------------------------------------------------------

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        if (name, client, holder) in self._woken_early:
            return
        if client == self.client_id:  # a waiter of this process: no trip through the broker
            self._wake_here(name, holder)
            return
        body = json.dumps({"name": name, "holder": holder})
        self._channel("probe").basic_publish(
            amqp.Message(body), exchange="", routing_key=f"{self.key_prefix}wake.{client}"
        )

    def _start_listening(self) -> None:
        self.link.call(self._listen_here)

    def _listen_here(self) -> None:
        if self._wake_queue is not None:
            return
        channel = self._channel("wake")
        queue_name = f"{self.key_prefix}wake.{self.client_id}"
        channel.queue_declare(queue_name, exclusive=True, auto_delete=True)
        channel.basic_consume(queue_name, no_ack=True, callback=self._on_wakeup,
                              on_cancel=self._wake_queue_gone)
        self._wake_queue = queue_name

    def _wake_queue_gone(self, consumer_tag: str) -> None:
        """Someone deleted our wake-up queue: listen again on the next operation."""
        self._wake_queue = None

    def _on_wakeup(self, message: amqp.Message) -> None:
        try:
            data = json.loads(_text(message.body))
            name, holder = data["name"], data["holder"]
        except Exception:
            logger.exception("bad semaphore wake-up %r", message.body)
            return
        self._wake_here(name, holder)

    def _wake_here(self, name: str, holder: str) -> None:
        try:
            hand = self._hands.get((name, holder))
            if hand is not None:
                if hand.awaits_delivery():
                    return  # its consumer is delivered the token itself
                hand.woken = True
            self._notify(name, holder)
        except Exception:
            logger.exception("failing semaphore wake-up of %r in %r", holder, name)

    # -- lifecycle -----------------------------------------------------------------------

    def verify(self, name: str, holder: str) -> bool:
        return self.link.call(self._verify_here, name, holder)

    def _verify_here(self, name: str, holder: str) -> bool:
        hand = self._hands.get((name, holder))
        if hand is not None and hand.lost:  # the broker took the evidence back
            return False
        return super().verify(name, holder)

    def ping(self) -> None:
        self.link.call(lambda: self.link.connection() and None)

    def close(self) -> None:
        with self._link_lock:
            link, self._link = self._link, None
        if link is not None:
            link.stop()
        self._hands = {}
        self._reset_connection_state()

    def _forked(self) -> None:
        super()._forked()
        # The parent's socket is shared with us: drop it without closing the AMQP connection.
        self._link_lock = threading.Lock()
        self._link = None
        self._hands = {}
        self._reset_connection_state()
