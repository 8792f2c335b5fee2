"""``memory://``: semaphores inside one process, for unit tests and eager mode.

Every backend opened on the same ``memory://`` URL in a process shares one store; nothing is
shared between processes. Leases expire by ``time.time()``.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from .engine import DocumentBackend, Transaction
from .model import State

_stores: Dict[str, Tuple[threading.Lock, Dict[str, Tuple[State, float]]]] = {}
_stores_lock = threading.Lock()
_clients: "weakref.WeakValueDictionary[str, MemoryBackend]" = weakref.WeakValueDictionary()


class MemoryBackend(DocumentBackend):
    """One process's in-memory semaphores. Thread-safe; idle state expires after ``idle_ttl``."""

    def __init__(self, url: str = "memory://", **options: Any) -> None:
        super().__init__(url, **options)
        with _stores_lock:
            self._lock, self._states = _stores.setdefault(url, (threading.Lock(), {}))
        _clients[self.client_id] = self

    @contextmanager
    def _load(self, name: str) -> Iterator[Transaction]:
        """Under the store's lock; the state is a copy, so a rule that raises changes nothing."""
        with self._lock:
            now = time.time()
            state, expires = self._states.get(name, (None, 0.0))
            copy = State.from_dict(state.to_dict()) if state is not None and expires > now else None
            yield Transaction(name, copy, now)

    multi_document = True

    @contextmanager
    def _load_many(self, names: Sequence[str]) -> Iterator[List[Transaction]]:
        """Every document under the store's one lock."""
        with self._lock:
            now = time.time()
            txns = []
            for name in names:
                state, expires = self._states.get(name, (None, 0.0))
                copy = (State.from_dict(state.to_dict()) if state is not None and expires > now
                        else None)
                txns.append(Transaction(name, copy, now))
            yield txns

    def _commit_many(self, txns: Sequence[Transaction]) -> bool:
        for txn in txns:
            self._commit(txn)
        return True

    def _commit(self, txn: Transaction) -> bool:
        if txn.state is None:
            self._states.pop(txn.name, None)
        else:
            self._states[txn.name] = (txn.state,
                                      txn.now + txn.state.keep_for(txn.now, self.idle_ttl))
        return True

    def _stored_names(self) -> List[str]:
        now = time.time()
        with self._lock:
            return [name for name, (_, expires) in self._states.items() if expires > now]

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        backend = _clients.get(client)
        if backend is not None:
            backend._notify(name, holder)
