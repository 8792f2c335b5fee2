"""``memory://``: semaphores inside one process, for unit tests and eager mode.

Every backend opened on the same ``memory://`` URL in a process shares one store; nothing is
shared between processes. Leases expire by ``time.time()``.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

from .model import Box, ModelBackend, State

_stores: Dict[str, Tuple[threading.Lock, Dict[str, Tuple[State, float]]]] = {}
_stores_lock = threading.Lock()
_clients: "weakref.WeakValueDictionary[str, MemoryBackend]" = weakref.WeakValueDictionary()


class MemoryBackend(ModelBackend):
    """One process's in-memory semaphores. Thread-safe; idle state expires after ``idle_ttl``."""

    def __init__(self, url: str = "memory://", **options: Any) -> None:
        super().__init__(url, **options)
        with _stores_lock:
            self._lock, self._states = _stores.setdefault(url, (threading.Lock(), {}))
        _clients[self.client_id] = self

    @contextmanager
    def _transaction(self, name: str) -> Iterator[Box]:
        with self._lock:
            now = time.time()
            state, expires = self._states.get(name, (None, 0.0))
            box = Box(state if expires > now else None, now)
            yield box
            if box.state is None:
                self._states.pop(name, None)
            else:
                self._states[name] = (box.state, now + self.idle_ttl)

    def _stored_names(self) -> List[str]:
        now = time.time()
        with self._lock:
            return [name for name, (_, expires) in self._states.items() if expires > now]

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        backend = _clients.get(client)
        if backend is not None:
            backend._notify(name, holder)
