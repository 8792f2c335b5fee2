"""A guarded request's life in the worker before it runs, as one explicit state machine.

Its transitions are made by the worker core (:mod:`.core`) alone, on the consumer's loop
thread; the shell reads a waiter (its request, its timer) but never moves it.

::

    LINED ──> QUEUED ──> GRANTED ──> DONE (handed to the pool)
      │  ^       │          │
      │  └───────┼──────────┘  (the pool filled up: the grant is given back)
      └──────────┴────────────> DONE (revoked, failed, requeued, given back to the broker)
      │  ^
      └> AHEAD ──> DONE (granted while every process is busy: waits in the pool's queue)
         (refused, or no answer: back to LINED)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Set

from ..guards import Guard
from ..scheduler import Timer
from ..task_lease import LEASE_KEY
from ..waiting_room import FIRST_WAIT_HEADER, PARKED_BY_HEADER, PARKED_HEADER, ROUTE_HEADER
from .headers import REQUEUES_HEADER, first_wait_of, requeues_of

#: What the gate adds to a request; kept out of messages the task publishes (``self.retry``).
GATE_HEADERS = (REQUEUES_HEADER, FIRST_WAIT_HEADER, PARKED_HEADER, PARKED_BY_HEADER,
                ROUTE_HEADER, LEASE_KEY)


class WaitState(enum.Enum):
    LINED = "lined"  # in this worker's line, until a pool process is free for it
    QUEUED = "queued"  # in the backend's waiter queue: acquire attempts go out
    GRANTED = "granted"  # a grant reached the loop; the pool had no process: giving it back
    #: every process is busy: one try (``wait=False``) for a free slot nobody queues for, so
    #: that the request waits in the pool's queue with its slot when a process frees
    AHEAD = "ahead"
    DONE = "done"  # left the gate: handed to the pool, revoked, failed, requeued, given back


ALLOWED: Dict[WaitState, Set[WaitState]] = {
    WaitState.LINED: {WaitState.QUEUED, WaitState.AHEAD, WaitState.DONE},
    WaitState.AHEAD: {WaitState.LINED, WaitState.DONE},
    WaitState.QUEUED: {WaitState.GRANTED, WaitState.DONE},
    WaitState.GRANTED: {WaitState.LINED, WaitState.DONE},
    WaitState.DONE: set(),
}


@dataclass(eq=False)
class Waiter:
    """A guarded request held in the worker's main process until it gets a slot."""

    request: Any
    guard: Guard
    #: ``<task id>:<random>``: the backend admits one holder per task, so a duplicate delivery
    #: of this task waits for its twin (:func:`.base.new_holder_id`).
    holder: str
    state: WaitState = WaitState.LINED
    entered: float = field(default_factory=time.monotonic)
    entered_wall: float = field(default_factory=time.time)
    #: Acquire answers that were "wait"; > 0 means WAITING was reported.
    attempts: int = 0
    position: Optional[int] = None
    #: The semaphore whose queue it waits in (a request under several: the one that refused
    #: it last; under one: that one), once an attempt said "wait".
    blocking: Optional[str] = None
    #: What its last attempt said it waits for: "slots", "units" or "rate".
    waits_for: Optional[str] = None
    #: The next acquire attempt scheduled on the I/O thread (the shell's).
    next_attempt: Optional[Timer] = None
    #: Monotonic time the first acquire was sent (None: it never reached the backend).
    first_sent: Optional[float] = None
    #: Acquire attempts sent so far; an answer to an older one than the last is stale.
    attempts_sent: int = 0
    last_sent: float = 0.0
    backend_down: bool = False
    #: An attempt sent at once (a first one, or after a wake-up) has not been answered: it
    #: may come back a grant, which needs a free pool process (:attr:`.AdmissionCore.trying`).
    in_flight: bool = False
    #: Woken while no process was free for another attempt in flight: it tries once one is.
    wake_pending: bool = False
    #: Its try ahead (:attr:`WaitState.AHEAD`) was refused or failed: it waits for a free
    #: process like any other, and tries ahead no more.
    tried_ahead: bool = False
    #: Reported WAITING while still in the line (its semaphore full): once is enough.
    announced: bool = False
    #: Pulled from the parking queue: its message is acked on the parking channel, and it
    #: never raises the consumer's prefetch.
    pulled: bool = False
    #: It raised the consumer's prefetch (``qos.increment_eventually``) when the backend first
    #: told it to wait, so that the consumer fetches other work meanwhile; lowered when it
    #: leaves. Until then it counts against the prefetch like any request the consumer holds.
    raised_prefetch: bool = False
    #: Taken out of the consumer channel's unacked set when the broker connection was lost:
    #: the gate puts its message back in its queue (``Gate.on_connection_lost``; a pulled one
    #: goes back with the parking connection, ``ParkingLot.reset``).
    detached: bool = False

    @property
    def waits(self) -> bool:
        """It joins the backend's queue when the semaphore is full (``semaphore_on_full`` is
        ``"wait"``); else its one attempt, made once a pool process is free for it, is a
        try (``wait=False``) and "full" skips or fails it."""
        return self.guard.settings.on_full == "wait"

    @property
    def parks(self) -> bool:
        """It may go to the waiting room: not with a priority above the default, which would
        put it behind the backlog of its semaphore there; it waits in this worker and enters
        the backend's queue, where its priority orders it ahead of the parked ones."""
        return self.guard.priority <= 0

    def move(self, to: WaitState) -> None:
        if to not in ALLOWED[self.state]:
            raise RuntimeError(f"waiter {self.holder}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def requeues(self) -> int:
        """Times the gate requeued this task (``semaphore_requeues``, checked where the
        request entered the gate: :func:`.headers.check_gate_headers`)."""
        return requeues_of(self.request.request_dict, self.request)

    @property
    def first_wait(self) -> float:
        """Unix time this task first waited for a slot, across requeues and parking; never
        later than its arrival here (a sender's clock may run ahead of this worker's)."""
        first = first_wait_of(self.request.request_dict, self.request)
        return self.entered_wall if first is None else min(first, self.entered_wall)
