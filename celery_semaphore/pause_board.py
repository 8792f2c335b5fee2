"""Pauses a worker's pool processes tell each other, so that a request granted before a
:class:`.Backoff` closed its semaphore does not start its body after it.

A worker hands a request to its pool as soon as it is granted a slot, even while every
process is busy (it waits in the pool's queue and starts as soon as one frees: the handoff at
the floor). A Backoff raised in one process closes the semaphore on the backend at once
(:func:`.task_lease.pause_where_raised`), but requests of it granted before that and waiting
in the pool's queue would still start, and call the API that just answered 429. So the process
that closed the semaphore also writes the pause here, in memory the worker's processes share
(an anonymous ``mmap`` made in the main process before the pool forks); a guarded request
about to start (the task's ``before_start``) whose grant predates a pause still running gives
its slot back and waits again, ahead of later arrivals, without running its body.

A hint, never a guarantee: entries are found by a hash of the semaphore's name (two names
may share one; the later write wins), read without a lock (a torn read is as good as a
miss), and only this worker's processes see them; the backend's pause is what holds every
worker. Times are ``time.monotonic()``, one clock for every process of the host. A grant made
after the pause was written here (an operator's ``resume``) starts as usual.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import time
from typing import Optional

#: Entries on the board (a semaphore's name picks one by its hash).
SLOTS = 1024
#: name hash (8 bytes), written at, until: monotonic seconds.
_ENTRY = struct.Struct("<Qdd")


def _key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class PauseBoard:
    """The shared entries (module docs)."""

    def __init__(self) -> None:
        self._memory = mmap.mmap(-1, SLOTS * _ENTRY.size)

    def _offset(self, key: int) -> int:
        return (key % SLOTS) * _ENTRY.size

    def close(self, name: str, seconds: float) -> None:
        """Semaphore ``name`` was closed on the backend for ``seconds`` from now."""
        now = time.monotonic()
        key = _key(name)
        offset = self._offset(key)
        self._memory[offset:offset + _ENTRY.size] = _ENTRY.pack(key, now, now + seconds)

    def left(self, name: str, granted: float) -> Optional[float]:
        """Seconds left of a pause of ``name`` written after ``granted`` (the monotonic time
        the grant was asked for) and still running; None when there is none."""
        key = _key(name)
        offset = self._offset(key)
        found, written, until = _ENTRY.unpack(self._memory[offset:offset + _ENTRY.size])
        left = float(until) - time.monotonic()
        if found != key or written <= granted or left <= 0:
            return None
        return left


#: The board of this worker (None outside a worker, and in one whose gate has not started).
_board: Optional[PauseBoard] = None


def create() -> PauseBoard:
    """Make this worker's board (its main process, before the pool forks); idempotent."""
    global _board
    if _board is None:
        _board = PauseBoard()
    return _board


def board() -> Optional[PauseBoard]:
    """This worker's board, as every process of it sees it."""
    return _board
