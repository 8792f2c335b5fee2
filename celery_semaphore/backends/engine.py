"""One transaction engine for the backends that store each semaphore's state as one document.

Memory, SQLite, both RabbitMQ backends and Consul differ only in where the document lives and
how a write detects a concurrent one. Each implements the storage primitives of
:class:`DocumentBackend`; the engine applies the rules of :mod:`.model` the same way for all:

1. :meth:`~DocumentBackend._load` opens a transaction: the stored state (None when absent), the
   storage's time, and whatever :meth:`~DocumentBackend._commit` needs to detect a race (a
   ModifyIndex, a held registry message). While it is open the storage may hold a lock;
   leaving it without a successful commit gives everything back unchanged.
2. The engine prunes what expired, then applies one rule: a function of the transaction that
   changes ``txn.state`` and returns the operation's result.
3. :meth:`~DocumentBackend._commit` stores the new state (None: delete) and answers whether it
   won the race. A lost race is retried from a new load, the rule applied again, up to
   ``max_attempts`` times (then :class:`BackendUnavailable`).
4. After a won commit: :meth:`~DocumentBackend._after_commit` (work that must follow the store,
   such as destroying a Consul session the state no longer names), then a wake-up to every
   waiter the operation made admissible.

5. Where the storage has multi-document transactions (:attr:`~DocumentBackend.multi_document`:
   :meth:`~DocumentBackend._load_many` and :meth:`~DocumentBackend._commit_many`), a rule over
   several semaphores (:meth:`~DocumentBackend.acquire_all`) is applied the same way to all
   their documents at once; elsewhere ``acquire_all`` is the generic protocol of
   :meth:`.base.Backend.acquire_all`.

A rule must be safe to apply more than once (a lost race applies it again) and must not do
I/O that a retry cannot undo; anything it must remember across attempts lives in the caller.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, TypeVar

from ..exceptions import BackendUnavailable
from .base import (
    ALL_TRAFFIC,
    Attempt,
    Backend,
    Meta,
    MultiAttempt,
    Requests,
    SemaphoreStatus,
    adaptive_of,
    check_outcome,
    check_pause,
    check_units,
)
from .model import State, acquire_all, as_json

Result = TypeVar("Result")


class Transaction:
    """One semaphore's state inside a transaction: ``state`` (None: absent; a rule may replace
    it), ``now`` (the storage's clock, seconds) and ``version`` (the storage's, opaque to the
    engine). Storages subclass it to keep what they store beside the state."""

    def __init__(self, name: str, state: Optional[State], now: float, version: Any = None) -> None:
        self.name = name
        self.state = state
        self.now = now
        self.version = version

    def new_state(self, limit: int) -> State:
        """The state of a semaphore created by this transaction."""
        return State(limit=limit)


Rule = Callable[[Transaction], Result]


class DocumentBackend(Backend):
    """A backend that keeps each semaphore's :class:`.model.State` as one document.

    Storage primitives a subclass implements: :meth:`_load`, :meth:`_commit`,
    :meth:`_stored_names`, :meth:`_send_wakeup`. Optional hooks: :meth:`_prune`,
    :meth:`_after_commit`, :meth:`_lost_race`.
    """

    #: Loads and commits an operation may lose to concurrent writers before it gives up.
    max_attempts = 10

    #: The rules of :mod:`.model` apply every traffic option; a storage that cannot keep
    #: some (a clock it cannot trust) narrows this.
    traffic_options = ALL_TRAFFIC

    # -- storage primitives ----------------------------------------------------------------

    def _load(self, name: str) -> ContextManager[Transaction]:
        """Open a transaction on ``name`` (see the module docstring)."""
        raise NotImplementedError

    def _read(self, name: str) -> ContextManager[Transaction]:
        """Open a transaction on ``name`` that stores nothing (``status``, ``verify``): a
        consistent state, by default :meth:`_load`'s. A storage that can give one without the
        writers' lock (SQLite in WAL mode, PostgreSQL's snapshot) overrides it, so that
        readers (``celery semaphore top``, the exporter) never hold up an acquire."""
        return self._load(name)

    def _commit(self, txn: Transaction) -> bool:
        """Store ``txn.state`` (None: delete it). False when another writer changed the state
        since :meth:`_load`: nothing was stored."""
        raise NotImplementedError

    def _stored_names(self) -> List[str]:
        raise NotImplementedError

    #: The storage implements :meth:`_load_many` and :meth:`_commit_many`.
    multi_document = False

    def _load_many(self, names: Sequence[str]) -> ContextManager[List[Transaction]]:
        """Open one transaction over the documents of ``names`` (sorted, distinct): the same
        contract as :meth:`_load`, for all of them at once."""
        raise NotImplementedError

    def _commit_many(self, txns: Sequence[Transaction]) -> bool:
        """Store every transaction's state in one atomic write, as :meth:`_commit`."""
        raise NotImplementedError

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        raise NotImplementedError

    # -- hooks ---------------------------------------------------------------------------

    def _prune(self, txn: Transaction) -> None:
        """Drop expired holders, waiters and declared limits before a rule decides."""
        if txn.state is not None:
            txn.state.prune(txn.now, self.idle_ttl)

    def _after_commit(self, txn: Transaction) -> None:  # noqa: B027 - optional hook
        """Runs once the state is stored (or, for a read, after the rule)."""

    def _lost_race(self, attempt: int) -> None:  # noqa: B027 - optional hook
        """Runs after the ``attempt``-th lost race, before the next load (e.g. a backoff)."""

    # -- the engine ------------------------------------------------------------------------

    def _transact(self, name: str, rule: Rule[Result], *, write: bool = True) -> Result:
        """Apply ``rule`` to ``name``'s state atomically and return its result; ``write``
        False: a read, nothing is stored."""
        for attempt in range(self.max_attempts):
            with (self._load(name) if write else self._read(name)) as txn:
                before = txn.state.admissible(txn.now) if txn.state is not None else set()
                self._prune(txn)
                result = rule(txn)
                if write and not self._commit(txn):
                    won = False
                else:
                    won = True
            if won:
                self._after_commit(txn)
                if txn.state is not None:
                    for client, holder in txn.state.wakeups(before, txn.now):
                        self._send_wakeup(client, name, holder)
                return result
            self._lost_race(attempt)
        raise BackendUnavailable(
            f"semaphore {name!r}: {self.max_attempts} attempts to store its state lost the race "
            "to other clients"
        )

    def _transact_many(self, names: Sequence[str],
                       rule: Callable[[Dict[str, Transaction]], Result]) -> Result:
        """:meth:`_transact` over several documents in one transaction (``multi_document``)."""
        names = sorted(set(names))  # one lock order for everyone
        for attempt in range(self.max_attempts):
            with self._load_many(names) as txns:
                before = {t.name: t.state.admissible(t.now) if t.state is not None else set()
                          for t in txns}
                for txn in txns:
                    self._prune(txn)
                result = rule({t.name: t for t in txns})
                won = self._commit_many(txns)
            if won:
                for txn in txns:
                    self._after_commit(txn)
                    if txn.state is not None:
                        for client, holder in txn.state.wakeups(before[txn.name], txn.now):
                            self._send_wakeup(client, txn.name, holder)
                return result
            self._lost_race(attempt)
        raise BackendUnavailable(
            f"semaphores {names!r}: {self.max_attempts} attempts to store their state lost the "
            "race to other clients"
        )

    # -- the operations, as rules --------------------------------------------------------

    @property
    def atomic_acquire_all(self) -> bool:  # type: ignore[override]
        return self.multi_document

    def acquire_all(self, requests: Requests, holder: str, *, ttl: float, meta: Meta,
                    wait: bool) -> MultiAttempt:
        """One transaction over every requested semaphore's document where the storage has
        them (:mod:`.model`'s ``acquire_all``), else the generic protocol of the base class."""
        if not self.multi_document:
            return super().acquire_all(requests, holder, ttl=ttl, meta=meta, wait=wait)
        meta = as_json(meta)
        self.check_meta(meta)
        requests = list(requests)

        def rule(txns: Dict[str, Transaction]) -> MultiAttempt:
            declared: Dict[str, State] = {}
            for name, limit in requests:
                declared[name] = self._declare(txns[name], limit, meta)
            return acquire_all(
                {name: declared[name] for name in txns}, requests, holder, ttl=ttl,
                meta=meta, wait=wait, client=self.client_id, now=min(t.now for t in
                                                                     txns.values()),
                waiter_ttl=self.waiter_ttl)

        return self._transact_many([name for name, _ in requests], rule)

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        meta = as_json(meta)
        self.check_meta(meta)
        return self._transact(name, lambda txn: self._admit(txn, holder, limit, ttl, meta, wait))

    def _admit(self, txn: Transaction, holder: str, limit: int, ttl: float, meta: Meta,
               wait: bool, slots: Optional[List[int]] = None) -> Attempt:
        """The acquire rule (``slots``: the slots this caller can take; default any)."""
        state = self._declare(txn, limit, meta)
        return state.acquire(
            holder, declared=limit, ttl=ttl, meta=meta, wait=wait, client=self.client_id,
            now=txn.now, waiter_ttl=self.waiter_ttl, slots=slots,
        )

    def _declare(self, txn: Transaction, limit: int, meta: Optional[Meta] = None) -> State:
        """This client declares ``limit`` (and the adaptive limit ``meta`` declares, if any:
        :meth:`.model.State.declare`), creating the state; a rule may call it before it looks
        at the limit, and again: it is idempotent."""
        if txn.state is None:
            txn.state = txn.new_state(limit)
        txn.state.declare(limit, self.declared_at, txn.now, adaptive_of(meta))
        return txn.state

    def release(self, name: str, holder: str, outcome: Optional[str] = None,
                latency: Optional[float] = None) -> bool:
        check_outcome(outcome)
        return self._transact(
            name,
            lambda txn: txn.state is not None and txn.state.release(holder, txn.now, outcome)
        )

    def pause(self, name: str, seconds: float, reason: str = "") -> float:
        if "pause" not in self.traffic_options:
            self._refuse(f"pause {name!r}")
        seconds, reason = check_pause(seconds), str(reason or "")

        def pause(txn: Transaction) -> float:
            if txn.state is None:  # a name nobody used: limit 0 until a caller declares one
                txn.state = txn.new_state(0)
            return txn.state.pause(seconds, reason, txn.now)

        return self._transact(name, pause)

    def resume(self, name: str) -> bool:
        if "pause" not in self.traffic_options:
            self._refuse(f"resume {name!r}")
        return self._transact(
            name, lambda txn: txn.state is not None and txn.state.resume(txn.now))

    def settle(self, name: str, holder: str, units: int) -> bool:
        if "pause" not in self.traffic_options:
            self._refuse(f"settle {name!r}")
        units = check_units(units)
        return self._transact(
            name, lambda txn: txn.state is not None and txn.state.settle(holder, units, txn.now))

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        return self._transact(
            name, lambda txn: txn.state.renew(holder, ttl, txn.now) if txn.state else None
        )

    def verify(self, name: str, holder: str) -> bool:
        return self._transact(
            name, lambda txn: txn.state is not None and holder in txn.state.holders, write=False
        )

    def cancel(self, name: str, holder: str) -> None:
        self._transact(name, lambda txn: txn.state.cancel(holder) if txn.state else None)

    def count(self, name: str, counts: Mapping[str, int]) -> None:
        self._transact(name, lambda txn: txn.state.add_counts(counts) if txn.state else None)

    def resize(self, name: str, limit: int) -> bool:
        def resize(txn: Transaction) -> bool:
            created = txn.state is None
            if txn.state is None:
                txn.state = txn.new_state(limit)
            txn.state.pin(limit)
            return created

        return self._transact(name, resize)

    def unpin(self, name: str) -> Optional[int]:
        def unpin(txn: Transaction) -> Optional[int]:
            if txn.state is None:
                return None
            txn.state.unpin()
            return txn.state.limit

        return self._transact(name, unpin)

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        return self._transact(
            name, lambda txn: txn.state.status(name, txn.now) if txn.state else None,
            write=False
        )

    def names(self) -> List[str]:
        return sorted(self._stored_names())

    def reset(self, name: str) -> bool:
        def reset(txn: Transaction) -> bool:
            existed = txn.state is not None
            txn.state = None
            return existed

        return self._transact(name, reset)
