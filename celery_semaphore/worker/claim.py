"""A request's life in the worker, from Celery's hand-off to its release, as one state machine.

Every request that reaches the gate gets a :class:`Claim`; the worker core (:mod:`.core`) alone
moves it, on the loop thread, and every transition it may make is in :data:`TRANSITIONS`::

    unguarded ──────────────────────────────────────────────────────> POOL ──> DONE
                                                                      ^  │
    LINED ──> QUEUED ──(granted or pushed a grant, a process free)────┤  ├──> ENDING ──> DONE
      │ ^ ^      │                                                    │  │   (its child exits)
      │ │ └──────┴── RETURNING <─(granted, no process free: given back)  │
      │ └──────── AHEAD ──(granted: waits in the pool's queue)────────┘  └──> ORPHANED ──> DONE
      │           (refused)                                   (a reconnect dropped its job
      └──> DONE  (failed, full, parked, requeued, revoked,     while a child may run it)
                  given back, let go)

Waiting (LINED, AHEAD, QUEUED, RETURNING): its message is unacknowledged in the worker, and it
holds no slot (but a grant on its way). In the pool (POOL, ENDING, ORPHANED): it was handed to
the pool (unguarded requests go there at once); a guarded one holds its slot, renewed, until
it is released. DONE: it left the worker core.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Optional, Tuple

from ..backends.base import Grant
from ..guards import Guard
from ..task_lease import LEASE_KEY
from ..waiting_room import FIRST_WAIT_HEADER, PARKED_BY_HEADER, PARKED_HEADER, ROUTE_HEADER
from .headers import REQUEUES_HEADER, first_wait_of, requeues_of

#: What the gate adds to a request; kept out of messages the task publishes (``self.retry``).
GATE_HEADERS = (REQUEUES_HEADER, FIRST_WAIT_HEADER, PARKED_HEADER, PARKED_BY_HEADER,
                ROUTE_HEADER, LEASE_KEY)


class State(enum.Enum):
    LINED = "lined"  # in this worker's line: for a pool process, or behind its full semaphore
    #: every process busy: one try (``wait=False``) for a free slot nobody queues for, so that
    #: the request waits in the pool's queue with its slot when a process frees
    AHEAD = "ahead"
    QUEUED = "queued"  # in the backend's waiter queue, a process free for it: attempts go out
    RETURNING = "returning"  # granted while no process was free: the grant is being given back
    POOL = "pool"  # handed to the pool: queued there or running; a guarded one holds its slot
    ENDING = "ending"  # ended as its pool child was killed: the slot is kept until it exits
    ORPHANED = "orphaned"  # a reconnect dropped its pool job while a child may run it
    DONE = "done"


#: Every transition a claim may make (the core moves claims; :meth:`Claim.move` checks).
TRANSITIONS: Dict[State, FrozenSet[State]] = {
    State.LINED: frozenset({State.QUEUED, State.AHEAD, State.POOL, State.DONE}),
    State.AHEAD: frozenset({State.LINED, State.POOL, State.DONE}),
    State.QUEUED: frozenset({State.RETURNING, State.POOL, State.DONE}),
    State.RETURNING: frozenset({State.LINED, State.DONE}),
    State.POOL: frozenset({State.ENDING, State.ORPHANED, State.DONE}),
    State.ENDING: frozenset({State.DONE}),
    State.ORPHANED: frozenset({State.DONE}),
    State.DONE: frozenset(),
}
WAITING = frozenset({State.LINED, State.AHEAD, State.QUEUED, State.RETURNING})
IN_POOL = frozenset({State.POOL, State.ENDING, State.ORPHANED})


@dataclass(eq=False)
class Claim:
    """One request in the worker (module docs). Fields are the core's; the shell reads them."""

    request: Any
    #: None: an unguarded request (it only passes through, to the pool); see :attr:`guard`.
    guard_or_none: Optional[Guard]
    #: ``<task id>:<random>``: the backend admits one holder per task, so a duplicate delivery
    #: of this task waits for its twin (:func:`.base.new_holder_id`); "" when unguarded.
    holder: str = ""
    state: State = State.LINED
    #: Pulled from the parking queue: its message is settled on the parking channel, and it
    #: never raises the consumer's prefetch.
    pulled: bool = False
    entered: float = field(default_factory=time.monotonic)
    entered_wall: float = field(default_factory=time.time)
    #: Given back by a Backoff of its own earlier run: it queues ahead of every waiter of
    #: its priority (:data:`.base.FRONT_KEY`).
    front: bool = False

    # -- waiting ------------------------------------------------------------------------------
    #: Acquire answers that were "wait"; > 0 means WAITING was reported.
    attempts: int = 0
    position: Optional[int] = None
    #: The semaphore whose queue it waits in (under several: the one that refused it last).
    blocking: Optional[str] = None
    #: What its last attempt said it waits for: "slots", "units" or "rate".
    waits_for: Optional[str] = None
    #: the Unix time its pause or quota window lets it start (last reported), else None
    waits_until: Optional[float] = None
    #: Monotonic time the first acquire was sent (None: it never reached the backend).
    first_sent: Optional[float] = None
    #: Acquire attempts sent so far; an answer to an older one than the last is stale.
    attempts_sent: int = 0
    last_sent: float = 0.0
    #: Monotonic send time of each attempt not answered yet (attempt number -> time), and of
    #: the last one answered "wait": a grant pushed to it was made after that one reached the
    #: backend, so its lease runs at least a TTL from then (:meth:`.WorkerCore._pushed`).
    sent_at: Dict[int, float] = field(default_factory=dict)
    waited_sent: Optional[float] = None
    #: An attempt sent at once has not been answered: it may come back a grant, which needs a
    #: free pool process (:attr:`.WorkerCore.trying`).
    in_flight: bool = False
    #: Woken while no process was free for another attempt in flight: it tries once one is.
    wake_pending: bool = False
    #: Its try ahead (:attr:`State.AHEAD`) was refused or failed: it tries ahead no more.
    tried_ahead: bool = False
    #: Reported WAITING while still in the line (its semaphore full): once is enough.
    announced: bool = False
    #: It raised the consumer's prefetch while it waits for its semaphore (lowered as it
    #: leaves), so that the consumer fetches other work meanwhile.
    raised_prefetch: bool = False
    #: Taken out of the consumer channel's unacked set when the broker connection was lost.
    detached: bool = False

    # -- holding ------------------------------------------------------------------------------
    #: The grant of each semaphore it holds (in the pool), and each one's limit in force.
    grants: Optional[Dict[str, Grant]] = None
    limits: Optional[Dict[str, Optional[int]]] = None
    #: Monotonic time until which its lease is valid as far as this worker knows (a margin
    #: below the backend's expiry: counted from before the request that set it was sent).
    deadline: float = 0.0
    ttl: float = 0.0
    #: Monotonic time its grant was asked for (before the backend made it).
    granted_since: Optional[float] = None
    #: A renewal is on its way (sent at that monotonic time), or None.
    renewing: Optional[float] = None
    #: The lease was found gone (or its deadline passed unrenewed): reported once.
    lost: bool = False
    #: ENDING, ORPHANED: the pool child that has (or had) it; ORPHANED: when it was first seen
    #: up (a child that never moves on is given a lease TTL).
    child: Optional[int] = None
    child_up: Optional[float] = None
    #: ENDING: monotonic time its task ended (the slot is released at the latest
    #: :data:`.core.CHILD_EXIT_WAIT` later).
    ended: Optional[float] = None
    #: Monotonic time it went to the pool (its call's latency is counted from there), and
    #: what the call came to: "ok", "overload", "error" (None: it did not run).
    started: Optional[float] = None
    outcome: Optional[str] = None

    def move(self, to: State) -> None:
        if to not in TRANSITIONS[self.state]:
            raise RuntimeError(f"claim {self.holder or self.request!r}: "
                               f"{self.state.value} -> {to.value}")
        self.state = to

    @property
    def guarded(self) -> bool:
        return self.guard_or_none is not None

    @property
    def guard(self) -> Guard:
        """The semaphores of a guarded request (an unguarded one has none)."""
        guard = self.guard_or_none
        if guard is None:
            raise AttributeError(f"{self.request!r} is not guarded")
        return guard

    @property
    def waiting(self) -> bool:
        return self.state in WAITING

    @property
    def waits(self) -> bool:
        """It joins the backend's queue when the semaphore is full (``semaphore_on_full`` is
        ``"wait"``); else its one attempt, made once a pool process is free for it, is a
        try (``wait=False``) and "full" skips or fails it."""
        return self.guarded and self.guard.settings.on_full == "wait"

    @property
    def parks(self) -> bool:
        """It may go to the waiting room: not with a priority above the default, which would
        put it behind the backlog of its semaphore there."""
        return self.guarded and self.guard.priority <= 0

    @property
    def names(self) -> Tuple[str, ...]:
        return self.guard.names if self.guarded else ()

    @property
    def requeues(self) -> int:
        """Times the gate requeued this task (``semaphore_requeues``)."""
        return requeues_of(self.request.request_dict, self.request)

    @property
    def first_wait(self) -> float:
        """Unix time this task first waited for a slot, across requeues and parking; never
        later than its arrival here (a sender's clock may run ahead of this worker's)."""
        first = first_wait_of(self.request.request_dict, self.request)
        return self.entered_wall if first is None else min(first, self.entered_wall)
