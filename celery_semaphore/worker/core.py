"""The worker core: every decision the worker makes about a request, from Celery's hand-off to
the release of its slot, with no threads, no Celery and no I/O.

It follows h11's sans-I/O shape: the shell (:mod:`.gate`) feeds it events
(:meth:`WorkerCore.handle`) and carries out the commands it returns, in order. The core owns
its state (every request's :class:`.Claim`, the worker's line, the counts per semaphore, the
pool's occupancy) and nothing else touches it; it reads the time from the clock it was given
and what it needs to know of the pool from :class:`Surroundings` (reads of the main process's
memory, never I/O). So it is driven event by event in a test, deterministically, through what
it emits (``tests/test_core.py``).

What it decides, in order of a request's life (:mod:`.claim` has the state machine):

* **admission**: who waits in the worker's line, who enters the backend's queue (only while a
  pool process is free for it), who tries ahead while every process is busy, what an answer, a
  wake-up or a pushed grant means, when a waiter leaves and how (failed, skipped, parked,
  requeued, revoked, given back): every way out goes through one exit that cleans up the same
  way;
* **capacity**: which pool processes are free, from the requests it handed to the pool and
  their endings (unguarded requests included: every request passes through the gate);
* **holding**: the slots its requests hold in the pool, their renewal, a lease found lost, the
  release when a task ends (after its child has exited, when the child was killed);
* **orphans**: a request whose pool job a broker reconnect dropped while a child may run it,
  settled once that child moved on or exited;
* **the waiting room's bounds**: how many requests of a semaphore the worker holds waiting
  (:meth:`WorkerCore.room`; beyond it they are parked in the broker).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
    Union,
)

from ..backends.base import Attempt, Grant, MultiAttempt, PushedGrant
from ..exceptions import ConfigurationError, SemaphoreTimeout
from ..guards import Guard
from .claim import IN_POOL, Claim, State

logger = logging.getLogger(__name__)

#: Seconds a woken waiter waits at most for a free pool process before it tries anyway.
WAKE_DEFER_MAX = 0.1
#: The share of its TTL a lease must still have, as far as this worker knows, for a grant to
#: start its task; a grant read later than that (a stopped worker, a stalled loop) is given
#: back and the request waits again.
GRANT_MIN_LEFT = 0.25
#: Requests of one semaphore a worker holds waiting, per pool process.
SHARE_PER_PROCESS = 2
#: :attr:`WorkerCore.spare` of a semaphore that refused a try here: none tried ahead until a
#: grant says there is room.
FULL = -1
#: Seconds to wait for a timed-out or terminated pool child to exit before releasing anyway.
CHILD_EXIT_WAIT = 30.0
#: First and longest pause between tries of a release the backend did not answer.
RETRY_FIRST = 0.1
RETRY_MAX = 2.0


class ChildFacts(NamedTuple):
    """What the shell reads of one pool child process."""

    pid: int
    alive: bool  # it runs (a zombie counts as gone)
    busy: bool  # an active request (one Celery knows it gave it) runs in it
    up: bool  # it has started and takes jobs
    #: whether it acknowledged the orphan's job (a child acknowledges a job as it starts
    #: it); None where the pool tells no such thing
    took_job: Optional[bool] = None
    #: whether it reported the orphan's job done (its task ran to its end, whatever became
    #: of the child since); None where the pool tells no such thing
    ran_job: Optional[bool] = None


class Surroundings(Protocol):
    """What the core reads of the rest of the worker (main-process memory, never I/O)."""

    def pool_size(self) -> int:
        """Pool processes (threads, greenlets) in all."""

    def lookahead(self) -> int:
        """Granted requests the pool may hold beyond its free processes, each waiting in its
        queue for the next one (``semaphore_worker_lookahead``; 0 for a pool that runs a
        request as it is handed one)."""

    def pulling(self, name: str) -> Tuple[int, int]:
        """Requests being pulled from the waiting room: of semaphore ``name``, and in all."""

    def max_waiting(self) -> int:
        """``semaphore_worker_max_waiting``."""

    def child(self, pid: int) -> ChildFacts:
        """What pool child ``pid`` does now."""

    def orphan_child(self, claim: Claim) -> Optional[ChildFacts]:
        """The pool child that has orphaned ``claim``'s job now: the one that acknowledged
        it, else the one that reads the pipe it was written to (the child it was written to
        until the pool reaps it, then the one the pool gives its pipe to); None while that
        pipe waits for a child; one that is not alive once the pool destroyed the pipe, the
        job unread with it."""

    def held_by_celery(self, request: Any) -> bool:
        """Celery's worker state still counts ``request`` reserved or active."""


class Answer(NamedTuple):
    """What one acquire attempt came back with (``attempt`` None: the call raised)."""

    holder: str
    attempt: Optional[Union[Attempt, MultiAttempt]]
    error: Optional[BaseException]
    requested_at: float
    #: The claim's attempt number it answers (:attr:`.Claim.attempts_sent`).
    sent: int = 0
    #: Seconds to wait for a wake-up before trying again (:meth:`.Backend.pause_after`).
    pause: float = 1.0


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrived:
    """A request reached the gate (``guard`` None: unguarded; ``pulled``: from the waiting
    room)."""

    request: Any
    guard: Optional[Guard]
    holder: str = ""
    pulled: bool = False
    front: bool = False


@dataclass(frozen=True)
class Answered:
    """An acquire attempt of ``claim`` came back."""

    claim: Claim
    answer: Answer


@dataclass(frozen=True)
class Woken:
    """The backend woke ``holder`` (a slot of a semaphore it waits for may be free)."""

    claim: Claim
    holder: str


@dataclass(frozen=True)
class Pushed:
    """The backend granted ``claim`` a slot while it waited (:class:`.PushedGrant`)."""

    claim: Claim
    pushed: PushedGrant


@dataclass(frozen=True)
class GrantReturned:
    """The grant the pool had no process for was given back (``released``: the backend
    confirmed it; if not, the claim waits on as ``new_holder``)."""

    claim: Claim
    released: bool
    new_holder: str


@dataclass(frozen=True)
class Revoked:
    """Celery found waiting ``claim``'s request revoked (and announced and acked it)."""

    claim: Claim


@dataclass(frozen=True)
class Stop:
    """The consumer stops (a shutdown, or a broker reconnect): every waiting request goes back
    to the broker."""


@dataclass(frozen=True)
class LetGo:
    """The messages of these waiting (pulled) claims are back in the broker already."""

    claims: Tuple[Claim, ...]


@dataclass(frozen=True)
class Ended:
    """``claim``'s task ended (a pool callback; or Celery revoked it before it ran).
    ``killed``: the pool child that ran it was killed or is being terminated (its pid), and the
    body may run until it exits. ``outcome``: ``"ok"``, ``"overload"`` or ``"error"`` (an
    adaptive limit learns from it), None when it did not run."""

    claim: Claim
    killed: Optional[int] = None
    outcome: Optional[str] = None


@dataclass(frozen=True)
class BackedOff:
    """``claim``'s task raised a :class:`.Backoff`: close its semaphore for ``seconds`` (None:
    do not close it; ``paused``: the pool process closed it already), release its slot
    reporting overload (``unstarted``: it never ran, nothing to report), and give the call
    back to wait ahead of later arrivals."""

    claim: Claim
    seconds: Optional[float]
    reason: str = ""
    paused: bool = False
    unstarted: bool = False


@dataclass(frozen=True)
class ChildExited:
    """Pool child ``pid`` has exited."""

    pid: int


@dataclass(frozen=True)
class Renewed:
    """A renewal of ``claim``'s lease sent at monotonic ``sent`` came back: ``held`` False
    when the backend no longer holds it; ``error``: it raised (not known)."""

    claim: Claim
    sent: float
    held: bool
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class PoolFlushed:
    """A broker reconnect flushed the pool: each of ``dropped`` lost its job, with the child
    it was being written to (it runs there, with no callback), or None (no child got it)."""

    dropped: Tuple[Tuple[Claim, Optional[int]], ...]


@dataclass(frozen=True)
class CapacityChanged:
    """Something outside the core may have changed the room it has (a parked copy published,
    the pool resized)."""


@dataclass(frozen=True)
class Tick:
    """Every :meth:`WorkerCore.tick_every` seconds: bounds, renewals, orphans, child exits."""


Event = Union[Arrived, Answered, Woken, Pushed, GrantReturned, Revoked, Stop, LetGo, Ended,
              BackedOff, ChildExited, Renewed, PoolFlushed, CapacityChanged, Tick]


# -- commands ---------------------------------------------------------------------------------


class How(enum.Enum):
    """How a waiting claim left the core without running (:class:`Exit`)."""

    FAIL = "fail"  # store the failure, ack
    FULL = "full"  # its one try found the semaphore full: skip or fail by its policy
    PARK = "park"  # to the waiting room
    REQUEUE = "requeue"  # a copy with a backoff ETA to its queue
    REVOKED = "revoked"  # settled by Celery already
    GIVE_BACK = "give_back"  # the consumer stops: back to the broker
    LET_GO = "let_go"  # its pulled message is back in the broker already


@dataclass(frozen=True)
class Start:
    """Hand ``claim``'s request to the pool (guarded: with the slots it holds,
    ``claim.grants``)."""

    claim: Claim


@dataclass(frozen=True)
class Exit:
    """Waiting ``claim`` left without running; settle its message as ``how`` says.
    ``error``: why it fails (FAIL); ``limit``/``blocking``: what refused it (FULL); ``why``: a
    reason for the log (PARK, REQUEUE)."""

    claim: Claim
    how: How
    error: Optional[BaseException] = None
    limit: Any = None
    blocking: Optional[str] = None
    why: str = ""


@dataclass(frozen=True)
class SendAttempt:
    """Make acquire attempt number ``sent`` for ``claim`` in ``delay`` seconds, replacing the
    one scheduled before it. ``ahead``: a try (``wait=False``) whatever its policy."""

    claim: Claim
    holder: str
    sent: int
    delay: float
    ahead: bool = False


@dataclass(frozen=True)
class StopAttempts:
    """Drop ``claim``'s scheduled attempt, if any."""

    claim: Claim


@dataclass(frozen=True)
class Cancel:
    """Leave the backend's queues of ``names`` as ``holder`` and release a grant an attempt
    still on its way may get, retrying until ``until`` (monotonic)."""

    names: Tuple[str, ...]
    holder: str
    until: float


@dataclass(frozen=True)
class Release:
    """Release the slots ``holder`` holds of ``names``; while the backend does not answer,
    again (:data:`RETRY_FIRST` doubling to :data:`RETRY_MAX`) until
    ``until``, monotonic: the backend's expiry frees them then."""

    names: Tuple[str, ...]
    holder: str
    until: float
    #: what the call came to (an adaptive limit learns from it), and how long it ran
    outcome: Optional[str] = None
    latency: Optional[float] = None


@dataclass(frozen=True)
class Pause:
    """Close semaphore ``name`` for ``seconds``, never shortening a pause in force."""

    name: str
    seconds: float
    reason: str


@dataclass(frozen=True)
class Redeliver:
    """Hand ``claim``'s message to Celery's task strategy again, as a new request that
    queues ahead of later arrivals (a Backoff gave it back; ``seconds``: the time it asked
    for, None: none)."""

    claim: Claim
    seconds: Optional[float] = None


@dataclass(frozen=True)
class GiveBackGrant:
    """Release ``claim``'s grant as ``holder`` (no pool process for it); answer with
    :class:`GrantReturned`."""

    claim: Claim
    holder: str
    names: Tuple[str, ...]
    until: float


@dataclass(frozen=True)
class Renew:
    """Renew every slot ``claim`` holds; answer with :class:`Renewed`."""

    claim: Claim
    holder: str
    names: Tuple[str, ...]
    ttl: float


@dataclass(frozen=True)
class LeaseLost:
    """``claim``'s lease is gone (the backend no longer holds it, or it could not be renewed
    before its deadline): apply ``semaphore_on_lost_lease``."""

    claim: Claim


@dataclass(frozen=True)
class WatchChild:
    """Report :class:`ChildExited` once pool child ``pid`` has exited."""

    pid: int


@dataclass(frozen=True)
class Dropped:
    """A broker reconnect dropped ``claim``'s pool job before any child got it: it never runs
    (its message goes back)."""

    claim: Claim


@dataclass(frozen=True)
class Settle:
    """Orphaned ``claim``'s child moved on (``requeue`` False: it ran; ack its message) or
    exited (``requeue``: put its message back, at-least-once); ``ran``: the child reported
    the job done."""

    claim: Claim
    requeue: bool
    ran: bool = False


@dataclass(frozen=True)
class RaisePrefetch:
    """The consumer may fetch one more message (a request waits for a slot, not a process)."""


@dataclass(frozen=True)
class LowerPrefetch:
    pass


@dataclass(frozen=True)
class ReportWaiting:
    """Announce that ``claim`` waits (event, WAITING state): at ``position`` of the backend's
    queue, or None (in this worker's line, behind those that wait for the same slot).
    ``until``: when time alone lets it start, for a pause or a quota window (Unix time, as
    this host's clock reads the backend's answer), else None."""

    claim: Claim
    position: Optional[int]
    limit: Any
    until: Optional[float] = None


@dataclass(frozen=True)
class Refill:
    """The worker holds fewer requests of ``name``: pull parked ones if it has room."""

    name: str


Command = Union[Start, Exit, SendAttempt, StopAttempts, Cancel, Release, Pause, Redeliver,
                GiveBackGrant, Renew, LeaseLost, WatchChild, Dropped, Settle, RaisePrefetch,
                LowerPrefetch, ReportWaiting, Refill]


# -- the core ---------------------------------------------------------------------------------


@dataclass
class _Counts:
    """Per semaphore name: its waiting claims, those QUEUED, those the backend told to wait,
    those trying AHEAD."""

    waiting: Dict[str, int] = field(default_factory=dict)
    queued: Dict[str, int] = field(default_factory=dict)
    blocked: Dict[str, int] = field(default_factory=dict)
    ahead: Dict[str, int] = field(default_factory=dict)

    @staticmethod
    def add(counts: Dict[str, int], name: str, n: int) -> None:
        value = counts.get(name, 0) + n
        if value:
            counts[name] = value
        else:
            counts.pop(name, None)


class WorkerCore:
    """Every request of one worker, from its arrival to its release. See the module docstring.

    Guarantees: a request enters the backend's queue only while a pool process is free for
    it (as many per semaphore as processes are free; one with a priority above the default at
    once); attempts sent at once and not answered yet (:attr:`trying`) never outnumber the free
    processes, except a priority request's, or a woken one's when no process is free and none
    is promised, or one deferred past :data:`WAKE_DEFER_MAX`; a grant that finds no free
    process is given back before the request lines up again; an answer to an attempt older
    than the last one sent decides only if it is a grant; a waiting request leaves exactly
    once, and every way out emits the same cleanup; a slot is released exactly once, when its
    task ended (and the child of a killed task exited), was dropped unrun, or its orphan's
    child moved on; a held lease is renewed every third of its TTL until then.

    Trying ahead: while every process is busy or promised, up to
    :meth:`Surroundings.lookahead` lined requests (counting the granted ones already waiting
    in the pool's queue) make one try with ``wait=False``, each one that would wait for a
    full semaphore, each of a semaphore this worker neither queues for nor was told to wait
    for: the backend grants it only a free slot nobody queues for, and the request goes to the
    pool's queue with it, to start the moment a process frees. Refused, it lines up again.
    """

    def __init__(self, surroundings: Surroundings, *, lease_ttl: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """``lease_ttl``: the worker's ``semaphore_lease_ttl`` (an unguarded orphan's child
        is given that long to move on)."""
        self.surroundings = surroundings
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.wall_clock = wall_clock
        #: waiting claims by holder id
        self.waiters: Dict[str, Claim] = {}
        #: claims in the pool (POOL, ENDING, ORPHANED), by id of their request
        self.in_pool: Dict[int, Claim] = {}
        #: of those, the ones that occupy a pool process (POOL, ORPHANED)
        self.busy = 0
        #: guarded claims in the pool that hold a slot, by holder id
        self.held: Dict[str, Claim] = {}
        self.line: Deque[Claim] = deque()  # LINED, by priority then arrival
        self.counts = _Counts()
        #: QUEUED claims with an attempt in flight: each may take a pool process.
        self.trying = 0
        #: Tries ahead in flight (:attr:`.State.AHEAD`).
        self.trying_ahead = 0
        #: QUEUED claims woken while no process was free for their attempt, in wake order.
        self.woken: Deque[Claim] = deque()
        #: ENDING claims by the pid of the child they wait for
        self.ending: Dict[int, List[Claim]] = {}
        #: Semaphore name -> units its last grant here left free that nobody waited for
        #: (:attr:`.Attempt.free`), plus the units this worker released since; :data:`FULL`
        #: once a try was refused: room to try ahead in (:meth:`_try_ahead`)
        self.spare: Dict[str, int] = {}
        self.running = True  # False once the worker shuts down: releases go at once
        self._out: List[Command] = []

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Waiting requests."""
        return len(self.waiters)

    def count(self, name: str) -> int:
        """This worker's waiting requests of semaphore ``name``."""
        return self.counts.waiting.get(name, 0)

    def blocked(self, name: str) -> int:
        """Waiting requests of semaphore ``name`` the backend told to wait."""
        return self.counts.blocked.get(name, 0)

    def short_of_processes(self, name: str) -> bool:
        """Requests of semaphore ``name`` wait here with every pool process busy while its
        last grant here left units free that nobody waited for (:attr:`spare`): another
        worker that consumes their queue may have free processes to run its parked backlog
        now (the waiting room rings the lane's doorbell again for it). A semaphore found full,
        or not known here, is not: another worker could only wait for it too."""
        return (self.free_processes() <= 0 and self.count(name) > 0
                and self.spare.get(name, 0) > 0)

    def free_processes(self) -> int:
        """Pool processes no request occupies (a request handed to the pool occupies one
        until it ends, whether it runs or waits in the pool's queue for the next free one)."""
        return self.surroundings.pool_size() - self.busy

    def room(self, name: str, waiting_of_name: Optional[int] = None,
             waiting: Optional[int] = None) -> int:
        """How many more requests of ``name`` this worker should hold waiting, counting those
        it is pulling: what it can start soon (:data:`SHARE_PER_PROCESS` per pool process),
        within ``semaphore_worker_max_waiting`` in all. The rest wait in the parking queue,
        where any worker with room takes them, and a hot semaphore does not crowd out the
        others."""
        if waiting_of_name is None:
            waiting_of_name = self.count(name)
        if waiting is None:
            waiting = len(self.waiters)
        pulling_name, pulling_all = self.surroundings.pulling(name)
        share = (SHARE_PER_PROCESS * self.surroundings.pool_size() - waiting_of_name
                 - pulling_name)
        total = self.surroundings.max_waiting() - waiting - pulling_all
        return min(share, total)

    def tick_every(self, poll_interval: float) -> float:
        """Seconds between two :class:`Tick` events: the poll interval, at most a sixth of the
        shortest lease held (renewed every third of its TTL)."""
        every = poll_interval
        for claim in self.held.values():
            every = min(every, claim.ttl / 6)
        return max(every, 0.01)

    # -- events in, commands out -------------------------------------------------------------

    def handle(self, event: Event) -> List[Command]:
        """Apply ``event``; return the commands it leads to, in the order to carry them out."""
        self._handlers[type(event)](self, event)
        out, self._out = self._out, []
        return out

    def _arrived(self, event: Arrived) -> None:
        guard = event.guard
        claim = Claim(event.request, guard, event.holder, pulled=event.pulled,
                      entered=self.clock(), entered_wall=self.wall_clock(), front=event.front)
        if guard is None:  # unguarded: straight to the pool
            self._to_pool(claim)
            self._out.append(Start(claim))
            return
        name = guard.name
        # This worker's waiters of the semaphore were told to wait: it is full. One more waits
        # for it too (raising the prefetch), or, beyond this worker's share, goes to the
        # waiting room without asking the backend again.
        full = self.blocked(name) > 0
        self.waiters[claim.holder] = claim
        _Counts.add(self.counts.waiting, name, 1)
        if full and claim.waits:
            if (not event.pulled and claim.parks
                    and self.room(name, self.count(name) - 1, len(self.waiters) - 1) <= 0):
                return self._exit(claim, How.PARK, why="this worker holds its share already")
            self._announce_lined(claim)
        self._line_up(claim)
        self._pump()

    def _answered(self, event: Answered) -> None:
        claim, answer = event.claim, event.answer
        claim.sent_at.pop(answer.sent, None)
        if (claim.in_flight and claim.holder == answer.holder
                and answer.sent == claim.attempts_sent):
            self._land(claim)
        self._answer(claim, answer)
        self._pump()  # a process it was counted on may be free for the line now

    def _answer(self, claim: Claim, answer: Answer) -> None:
        current = claim.holder == answer.holder
        if claim.state is State.AHEAD and current:
            return self._answered_ahead(claim, answer)
        if claim.state is not State.QUEUED or not current:
            return self._late_answer(claim, answer, current)
        if answer.sent != claim.attempts_sent and (answer.attempt is None
                                                   or answer.attempt.grant is None):
            # A newer attempt is on its way (a wake-up sent it after this one was made): its
            # answer decides. Rescheduling from this one would cancel it, and the waiter
            # would sleep a poll interval through the slot it was woken for.
            return
        if isinstance(answer.error, ConfigurationError):
            # The backend refused the request itself (a cost above the stored limit, an
            # acquire_all the backend cannot do): it fails alone.
            return self._exit(claim, How.FAIL, error=answer.error)
        if answer.error is not None:
            # The backend did not answer: the request keeps waiting (it never runs
            # unguarded) and tries again after the poll interval.
            return self._send(claim, delay=claim.guard.settings.poll_interval)
        attempt = answer.attempt
        assert attempt is not None
        if attempt.grant is not None:
            self._saw_spare(claim, attempt)
            return self._granted(claim, answer.holder, _grants_of(claim, attempt),
                                 _limits_of(claim, attempt), answer.requested_at)
        self.spare[claim.guard.name] = FULL
        claim.waited_sent = answer.requested_at  # a pushed grant comes after this reached it
        blocking = getattr(attempt, "blocking", None) or claim.guard.name
        if not claim.waits:  # semaphore_on_full skip or fail: it never queued
            return self._exit(claim, How.FULL, limit=attempt.limit, blocking=blocking)
        claim.attempts += 1
        if claim.attempts == 1 and self._told_to_wait(claim):
            return
        waits_for = getattr(attempt, "waits_for", None)
        due = _due(attempt)
        until = None
        if due is not None and waits_for in ("pause", "quota"):  # (the answer's age counted)
            until = round(self.wall_clock() + due - (self.clock() - answer.requested_at), 1)
        if (attempt.position != claim.position or blocking != claim.blocking
                or waits_for != claim.waits_for or not _same_moment(until, claim.waits_until)):
            claim.position, claim.blocking, claim.waits_for, claim.waits_until = (
                attempt.position, blocking, waits_for, until)
            self._out.append(ReportWaiting(claim, attempt.position, attempt.limit, until))
        pause = answer.pause
        if due is not None:
            # Due counts from when the backend decided, which was after the attempt was sent:
            # count from the send, so the next try reaches it as its start falls due rather
            # than a round trip later (each late start delays every later one).
            pause = max(0.0, pause - (self.clock() - answer.requested_at))
        self._send(claim, delay=pause)

    def _answered_ahead(self, claim: Claim, answer: Answer) -> None:
        """The answer to ``claim``'s try ahead: a grant sends it to the pool's queue; a
        refusal or an error lines it up again."""
        attempt = answer.attempt
        if attempt is not None and attempt.grant is not None:
            self._saw_spare(claim, attempt)
            return self._start(claim, answer.holder, _grants_of(claim, attempt),
                               _limits_of(claim, attempt), answer.requested_at)
        if isinstance(answer.error, ConfigurationError):
            return self._exit(claim, How.FAIL, error=answer.error)
        if attempt is not None:
            self.spare[claim.guard.name] = FULL  # no more tries ahead until a grant says
        claim.tried_ahead = True
        self._move(claim, State.LINED)
        # back where it was: behind those that tried ahead before it, ahead of the rest
        priority = claim.guard.priority
        index = next((i for i, c in enumerate(self.line) if c.guard.priority < priority
                      or (c.guard.priority == priority and not c.tried_ahead)),
                     len(self.line))
        self.line.insert(index, claim)

    def _pool_queue_room(self) -> bool:
        """A grant that finds every process busy may wait in the pool's queue (as a grant
        tried ahead does: it starts the moment a process frees) while fewer requests than the
        pool has processes wait there; with no lookahead, or a pool that does not queue,
        never."""
        if self.surroundings.lookahead() <= 0:
            return False
        size = self.surroundings.pool_size()
        return self.busy - size < size

    def _saw_spare(self, claim: Claim, attempt: Union[Attempt, MultiAttempt]) -> None:
        """A grant of ``claim``'s semaphore said how many units it left free (or not)."""
        free = getattr(attempt, "free", None)
        name = claim.guard.name
        if free is None or claim.guard.multi:
            self.spare.pop(name, None)
            return
        if len(self.spare) >= 10_000:  # a template's keys: keep the recent ones
            self.spare.clear()
        self.spare[name] = free

    def _woken(self, event: Woken) -> None:
        claim = event.claim
        if claim.state is not State.QUEUED or claim.holder != event.holder:
            return
        free = self.free_processes()
        if (claim.in_flight or claim.guard.priority > 0 or free - self.trying > 0
                or (free <= 0 and self.trying == 0)):
            # (no process free and none promised: a grant is given back at once, and the
            # slot goes on to whoever waits behind it in another worker)
            self._send(claim)
        elif not claim.wake_pending:
            # the free processes are promised to attempts in flight: try once they land,
            # rather than be granted a slot only to give it back; at the latest after
            # WAKE_DEFER_MAX (a token-queue backend's wake-up hands this waiter the token)
            claim.wake_pending = True
            self.woken.append(claim)
            self._send(claim, delay=WAKE_DEFER_MAX)

    def _pushed(self, event: Pushed) -> None:
        """The backend granted ``claim`` a slot while it waited. Its lease runs a TTL from
        when the grant was made, which was after its last attempt answered "wait" reached
        the backend (or its first one): counted from that attempt's send, the deadline is
        never later than the backend's expiry."""
        claim, pushed = event.claim, event.pushed
        if claim.state is not State.QUEUED or claim.holder != pushed.holder:
            # (it holds this very grant already, from an attempt's answer; or it left the
            # queue meanwhile, and its cancel releases this grant)
            return
        sent = [claim.waited_sent] if claim.waited_sent is not None else []
        sent += claim.sent_at.values()
        since = min(sent) if sent else (claim.first_sent or self.clock())
        grants = {pushed.name: pushed.grant}
        self._granted(claim, pushed.holder, grants, {pushed.name: pushed.limit}, since)
        self._pump()

    def _grant_returned(self, event: GrantReturned) -> None:
        claim = event.claim
        if claim.state is not State.RETURNING:
            return
        if not event.released:  # the release is being retried: wait under another holder id
            del self.waiters[claim.holder]
            claim.holder = event.new_holder
            self.waiters[claim.holder] = claim
            claim.first_sent = None
            claim.waited_sent = None
            claim.sent_at.clear()
        self._move(claim, State.LINED)
        claim.position = claim.blocking = None
        self.line.appendleft(claim)
        self._pump()

    def _revoked(self, event: Revoked) -> None:
        if event.claim.waiting:
            self._exit(event.claim, How.REVOKED)

    def _stop(self, event: Stop) -> None:
        for claim in list(self.waiters.values()):
            self._exit(claim, How.GIVE_BACK)

    def _let_go(self, event: LetGo) -> None:
        for claim in event.claims:
            if claim.waiting:
                self._exit(claim, How.LET_GO)
        self._pump()

    def _ended(self, event: Ended) -> None:
        claim = event.claim
        if claim.state is not State.POOL:
            return
        self._from_pool(claim)
        claim.outcome = event.outcome
        if event.killed is not None and claim.grants is not None and self.running:
            # Celery reports these before the pool child has died; the body may still run
            # (a finally block, a handler): keep the slot until it exits.
            claim.move(State.ENDING)
            claim.child, claim.ended = event.killed, self.clock()
            self.in_pool[id(claim.request)] = claim
            self.ending.setdefault(event.killed, []).append(claim)
            self._out.append(WatchChild(event.killed))
        else:
            self._done(claim)
        self._pump()

    def _backed_off(self, event: BackedOff) -> None:
        """The call raised a Backoff: its semaphore closes (before the release, which would
        otherwise hand the slot on), its slot goes, reporting overload, and the call comes
        back as a new request that queues ahead of later arrivals."""
        claim = event.claim
        if claim.state is not State.POOL or not claim.guarded:
            return
        self._from_pool(claim)
        if event.seconds is not None and event.seconds > 0 and not event.paused:
            self._out.append(Pause(claim.guard.name, event.seconds, event.reason))
        claim.outcome = None if event.unstarted else "overload"
        self._done(claim)
        self._out.append(Redeliver(claim, event.seconds))
        self._pump()

    def _child_exited(self, event: ChildExited) -> None:
        for claim in self.ending.pop(event.pid, []):
            if claim.state is State.ENDING:
                self._done(claim)

    def _renewed(self, event: Renewed) -> None:
        claim = event.claim
        claim.renewing = None
        if claim.state not in IN_POOL or claim.grants is None or claim.lost:
            return
        if event.error is not None:  # not known: tried again at the next tick
            return
        if event.held:
            claim.deadline = max(claim.deadline, event.sent + claim.ttl)
        else:
            self._lose(claim)

    def _pool_flushed(self, event: PoolFlushed) -> None:
        for claim, child in event.dropped:
            if claim.state is not State.POOL:
                continue
            if child is None:  # no child got it: it never runs, and its message goes back
                self._out.append(Dropped(claim))
                self._from_pool(claim)
                self._done(claim)
                continue
            claim.move(State.ORPHANED)  # (its child is busy with it: it occupies a process)
            claim.child = child
        self._pump()

    def _capacity_changed(self, event: CapacityChanged) -> None:
        self._pump()

    def _tick(self, event: Tick) -> None:
        now, wall = self.clock(), self.wall_clock()
        for claim in list(self.waiters.values()):
            settings = claim.guard.settings
            if settings.max_wait is not None and wall - claim.first_wait > settings.max_wait:
                self._exit(claim, How.FAIL, error=SemaphoreTimeout(
                    f"no slot of semaphore {claim.blocking or claim.guard.name!r} in "
                    f"{settings.max_wait}s (semaphore_max_wait)"))
            elif now - claim.entered > settings.worker_max_hold and claim.waits:
                # a priority above the default goes back to its queue, never behind a backlog
                self._exit(claim, How.PARK if claim.parks else How.REQUEUE,
                           why="semaphore_worker_max_hold passed")
        for claim in list(self.in_pool.values()):
            if claim.state is State.POOL and not self.surroundings.held_by_celery(
                    claim.request):  # Celery forgot it (it never ran): nothing else says so
                self._from_pool(claim)
                self._done(claim)
            elif claim.state is State.ORPHANED:
                self._orphan(claim, now)
            elif claim.state is State.ENDING and (
                    now - (claim.ended or now) > CHILD_EXIT_WAIT
                    or not self.surroundings.child(claim.child or 0).alive):
                self._done(claim)  # its child exited (or never will: the lease frees it)
        self._renew_due(now)
        self._pump()

    _handlers: Dict[type, Callable[["WorkerCore", Any], None]] = {
        Arrived: _arrived, Answered: _answered, Woken: _woken, Pushed: _pushed,
        GrantReturned: _grant_returned, Revoked: _revoked, Stop: _stop, LetGo: _let_go,
        Ended: _ended, BackedOff: _backed_off, ChildExited: _child_exited, Renewed: _renewed,
        PoolFlushed: _pool_flushed, CapacityChanged: _capacity_changed, Tick: _tick,
    }

    def shutdown(self) -> List[Command]:
        """The worker exits: every slot still held is released now (the pool has stopped:
        no callback comes any more)."""
        self.running = False
        for claim in list(self.in_pool.values()):
            if claim.state in IN_POOL:
                if claim.state is not State.ENDING:
                    self._from_pool(claim)
                self._done(claim)
        out, self._out = self._out, []
        return out

    # -- waiting: the line, the backend's queue ---------------------------------------------

    def _line_up(self, claim: Claim) -> None:
        """``claim`` joins the line: after those of its priority or higher
        (``semaphore_priority``), ahead of lower ones, so that it enters the backend's queue
        (ordered by priority there too) first."""
        priority = claim.guard.priority
        if not self.line or self.line[-1].guard.priority >= priority:
            self.line.append(claim)
        else:
            index = next(i for i, c in enumerate(self.line) if c.guard.priority < priority)
            self.line.insert(index, claim)

    def _pump(self) -> None:
        """Move waiters from the line into the backend's queue while processes are free: no
        more first attempts on their way than free processes, whatever their semaphores (with
        a thousand keys each with room, every first attempt is a grant, and a grant beyond the
        free processes would only be given back), and no more of one semaphore in its queue
        than processes are free; one whose priority is above the default goes in at once, so
        that the backend's queue orders it ahead of lower ones (a grant that then finds no
        free process is given back)."""
        if not self.line and not self.woken:
            return
        free = self.free_processes()
        if free <= 0:
            return self._try_ahead(free)
        budget = free - self.trying - self.trying_ahead
        while self.woken and budget > 0:
            claim = self.woken.popleft()
            if claim.wake_pending and claim.state is State.QUEUED:
                claim.wake_pending = False
                budget -= 0 if claim.in_flight else 1
                self._send(claim)
        for claim in list(self.line):
            urgent = claim.guard.priority > 0
            if urgent or (budget > 0 and self.counts.queued.get(claim.guard.name, 0) < free):
                self.line.remove(claim)
                self._move(claim, State.QUEUED)
                budget -= 1
                self._send(claim)
        self._try_ahead(free)

    def _try_ahead(self, free: int) -> None:
        """Tries ahead (class docstring) for the first lined requests that may make one, as
        many as the lookahead leaves room for: :meth:`Surroundings.lookahead`, or as many as
        the pool has processes for a semaphore whose last grant left at least that many
        units free that nobody waited for (holding them ahead keeps nobody from a slot); none
        for a semaphore found full here since its last grant (a try would only be refused)."""
        base = self.surroundings.lookahead()
        if base <= 0 or not self.line:
            return
        size = self.surroundings.pool_size()
        in_flight = self.trying + self.trying_ahead
        room, wide = base + free - in_flight, max(base, size) + free - in_flight
        if wide <= 0:
            return
        counts = self.counts
        for claim in list(self.line):
            name = claim.guard.name
            spare = self.spare.get(name)  # None: not known here
            plenty = spare is not None and spare >= size
            if (claim.tried_ahead or not claim.waits or claim.guard.priority > 0
                    or name in counts.blocked or name in counts.queued
                    or (spare is not None and spare <= 0)
                    or (not plenty and (room <= 0 or name in counts.ahead))):
                continue
            self.line.remove(claim)
            self._move(claim, State.AHEAD)
            self._send(claim, ahead=True)
            room, wide = room - 1, wide - 1
            if wide <= 0:
                return

    def _send(self, claim: Claim, delay: float = 0.0, ahead: bool = False) -> None:
        now = self.clock()
        if claim.first_sent is None:
            claim.first_sent = now
        claim.last_sent = now + delay
        claim.attempts_sent += 1
        claim.sent_at[claim.attempts_sent] = now + delay
        if delay == 0 and not claim.in_flight and not ahead:
            claim.in_flight = True
            self.trying += 1
        self._out.append(SendAttempt(claim, claim.holder, claim.attempts_sent, delay, ahead))

    def _told_to_wait(self, claim: Claim) -> bool:
        """The backend told ``claim`` to wait for the first time: its semaphore is full. It
        stops counting against the consumer's prefetch (the consumer fetches other work
        meanwhile); beyond this worker's share of that semaphore's waiters it goes to the
        waiting room instead (True: it left)."""
        name = claim.guard.name
        _Counts.add(self.counts.blocked, name, 1)  # _exit undoes it
        if not claim.pulled and claim.parks and self.room(
                name, self.count(name), len(self.waiters)) < 0:
            self._exit(claim, How.PARK, why="this worker holds its share of waiters already")
            return True
        self._raise_prefetch(claim)
        # those of its semaphore still in the line (they arrived while its first attempt was
        # on its way) wait for the same slot: say so now
        for lined in [c for c in self.line if c.guard.name == name and not c.announced]:
            self._announce_lined(lined)
        return False

    def _announce_lined(self, claim: Claim) -> None:
        """``claim`` is in the line while its semaphore is full: it waits for the slot its
        peers wait for, not for a pool process. Raise the prefetch for it and report it
        waiting (no position: it has not asked the backend yet), once."""
        claim.announced = True
        if claim.waits:
            self._raise_prefetch(claim)
            self._out.append(ReportWaiting(claim, None, claim.guard.limit))

    def _raise_prefetch(self, claim: Claim) -> None:
        """``claim`` waits for its semaphore (not for a pool process): raise the consumer's
        prefetch while it does (never for a pulled one, which is not on the consumer's
        channel), so that the consumer fetches other work meanwhile."""
        if not claim.pulled and not claim.raised_prefetch:
            claim.raised_prefetch = True
            self._out.append(RaisePrefetch())

    def _late_answer(self, claim: Claim, answer: Answer, current: bool) -> None:
        """An answer to an attempt sent before the claim left the backend's queue. Repeating
        an acquire returns the holder's own grant: while the claim gives that grant back
        (RETURNING) or its task holds it, the answer is that very slot and changes nothing.
        Otherwise a grant, or an error that may hide one, must not keep a slot."""
        if current and claim.state is State.RETURNING:
            return
        if answer.holder in self.held:
            return  # that holder runs with this very grant
        names = claim.guard.names
        if answer.attempt is not None and answer.attempt.grant is not None:
            ttl = min(g.ttl for g in _grants_of(claim, answer.attempt).values())
            self._out.append(Release(names, answer.holder, answer.requested_at + ttl))
        elif answer.error is not None:
            self._out.append(Cancel(names, answer.holder,
                                    answer.requested_at + claim.guard.settings.lease_ttl))

    def _granted(self, claim: Claim, holder: str, grants: Dict[str, Grant],
                 limits: Dict[str, Optional[int]], since: float) -> None:
        ttl = min(g.ttl for g in grants.values())
        stale = since + ttl - self.clock() < ttl * GRANT_MIN_LEFT
        if stale or (self.free_processes() <= 0 and not self._pool_queue_room()):
            # The pool filled up meanwhile, and its queue too: never sit on a slot waiting
            # for a process beyond that. Or the grant reached this worker too late to be
            # sure of its lease (the worker was stopped, its loop stalled): the slot may be
            # someone else's already, and a renewal might come too late. The claim stays
            # RETURNING until the release is done (an answer to an attempt made before it
            # would carry this very grant, about to be freed), then waits again.
            self._move(claim, State.RETURNING)
            self._out.append(GiveBackGrant(claim, holder, tuple(grants), since + ttl))
            return
        self._start(claim, holder, grants, limits, since)

    def _move(self, claim: Claim, to: State) -> None:
        name = claim.guard.name if claim.guarded else ""
        if claim.state is State.QUEUED:
            _Counts.add(self.counts.queued, name, -1)
            self._land(claim)
            claim.wake_pending = False  # left in self.woken, skipped there
            if to is not State.QUEUED:
                self._out.append(StopAttempts(claim))
        elif claim.state is State.AHEAD:
            _Counts.add(self.counts.ahead, name, -1)
            self.trying_ahead -= 1
            if to is not State.LINED:
                self._out.append(StopAttempts(claim))
        claim.move(to)
        if to is State.QUEUED:
            _Counts.add(self.counts.queued, name, 1)
        elif to is State.AHEAD:
            _Counts.add(self.counts.ahead, name, 1)
            self.trying_ahead += 1

    def _land(self, claim: Claim) -> None:
        """``claim``'s attempt in flight is answered (or it left the queue)."""
        if claim.in_flight:
            claim.in_flight = False
            self.trying -= 1

    def _leave_waiting(self, claim: Claim, was: State) -> None:
        """``claim`` stopped waiting (it was ``was``; to the pool, or out): the line's and the
        counts' cleanup."""
        if was is State.LINED and claim in self.line:  # (not yet lined: parked on arrival)
            self.line.remove(claim)
        del self.waiters[claim.holder]
        name = claim.guard.name
        _Counts.add(self.counts.waiting, name, -1)
        if claim.attempts:
            _Counts.add(self.counts.blocked, name, -1)
        if claim.raised_prefetch:
            self._out.append(LowerPrefetch())

    def _exit(self, claim: Claim, how: How, **details: Any) -> None:
        """The one way out of the core for a waiting claim that does not run."""
        if not claim.waiting:
            return
        was = claim.state
        self._move(claim, State.DONE)
        self._leave_waiting(claim, was)
        if claim.first_sent is not None and how is not How.FULL:  # FULL made one try only
            # leave the backend's queue, and release the grant an attempt still on its way
            # may get (its answer may never be read: the loop stops at shutdown)
            self._out.append(Cancel(claim.guard.names, claim.holder,
                                    claim.last_sent + claim.guard.settings.lease_ttl))
        self._out.append(Refill(claim.guard.name))
        self._out.append(Exit(claim, how, **details))

    # -- holding: the pool, leases, releases ------------------------------------------------

    def _start(self, claim: Claim, holder: str, grants: Dict[str, Grant],
               limits: Dict[str, Optional[int]], since: float) -> None:
        """``claim`` got its slot(s) (QUEUED, or AHEAD) and goes to the pool; its lease is
        valid a TTL from ``since`` (monotonic: before the grant was made)."""
        was = claim.state
        self._to_pool(claim)
        self._leave_waiting(claim, was)
        claim.holder = holder
        claim.grants, claim.limits = grants, limits
        claim.ttl = min(g.ttl for g in grants.values())
        claim.deadline = since + claim.ttl
        claim.granted_since = since
        self.held[holder] = claim
        self._out.append(Refill(claim.guard.name))
        self._out.append(Start(claim))

    def _to_pool(self, claim: Claim) -> None:
        self._move(claim, State.POOL)
        claim.started = self.clock()
        self.in_pool[id(claim.request)] = claim
        self.busy += 1

    def _from_pool(self, claim: Claim) -> None:
        """``claim`` no longer occupies a pool process (it ended, or was dropped)."""
        if claim.state in (State.POOL, State.ORPHANED):
            self.busy -= 1
        self.in_pool.pop(id(claim.request), None)

    def _done(self, claim: Claim) -> None:
        """``claim`` leaves the core for good: its slot is released."""
        self.in_pool.pop(id(claim.request), None)
        claim.move(State.DONE)
        if claim.grants is not None and self.held.pop(claim.holder, None) is not None:
            self._freed(claim)
            latency = None if claim.started is None else self.clock() - claim.started
            self._out.append(Release(tuple(claim.grants), claim.holder, claim.deadline,
                                     outcome=claim.outcome, latency=latency))

    def _freed(self, claim: Claim) -> None:
        """``claim`` releases its units: a semaphore whose last grant here left room that
        nobody waited for has those units free again, as far as this worker knows, so its
        next request may try ahead (a key with a backlog of its own runs its next task with no
        acquire round trip after a process frees). One found full (a refusal) or with waiters
        (a grant's negative hint) stays so until a grant says otherwise: there, a release most
        likely went to a waiter, and a try would only be refused."""
        if claim.guard.multi:
            return
        spare = self.spare.get(claim.guard.name)
        if spare is not None and spare >= 0:
            self.spare[claim.guard.name] = spare + claim.guard.cost

    def _orphan(self, claim: Claim, now: float) -> None:
        """Settle an orphan once its child has moved on or exited. A child that is up runs the
        job it was written first, and one that takes no other job and does not exit shows
        nothing: a write to a child can also be lost with the pipe of one that exited before
        reading it, and the slot would be held until the worker stops. So a child up for a
        whole lease TTL counts as moved on too: if it runs the job after all, that run has
        lost its lease (fencing tokens reject its writes), as a partitioned holder's would.
        Its message is acknowledged once the child reported the job done (whatever became of
        the child since: one killed after it is not a reason to run the task again) or moved
        on (it ran the job), and put back if the child exited without reporting it done (it
        may have died before running it: at-least-once), or if the child
        moved on without ever acknowledging the job (a child acknowledges a job as it starts
        it, so the job never ran: it was lost with the pipe of a child that exited, or with
        the pool's buffer)."""
        facts = self.surroundings.orphan_child(claim)
        if facts is None:  # its pipe waits for the pool to reap a child, or for its replacement
            return
        if facts.pid != claim.child:  # an exited child's pipe went to its replacement
            logger.info("celery-semaphore: %s's job is in pool child %s, not %s",
                        claim.request.id, facts.pid, claim.child)
            claim.child, claim.child_up = facts.pid, None
        if facts.ran_job:  # its task ran to its end: acknowledged, even if the child is gone
            self._out.append(Settle(claim, requeue=False, ran=True))
            self._from_pool(claim)
            self._done(claim)
            return
        if facts.alive and not facts.busy:  # it runs the orphan still, or sits idle
            if not facts.up:
                return
            if claim.child_up is None:
                claim.child_up = now
                return
            ttl = claim.ttl if claim.grants is not None else self.lease_ttl
            if now - claim.child_up <= ttl:
                return
            logger.warning("celery-semaphore: pool child %s has not moved on in a lease TTL "
                           "after a broker reconnect; settling %s", claim.child,
                           claim.request.id)
        # (busy: it runs a request Celery knows of, after the orphan: it moved on)
        self._out.append(Settle(claim, requeue=not facts.alive or facts.took_job is False))
        self._from_pool(claim)
        self._done(claim)

    def _renew_due(self, now: float) -> None:
        """Renew every lease a third of whose TTL has passed since it was last known valid;
        a lease past its deadline unrenewed is lost."""
        for claim in list(self.held.values()):
            if claim.lost or claim.state not in IN_POOL:
                continue
            if now >= claim.deadline:
                self._lose(claim)
            elif claim.renewing is None and now >= claim.deadline - claim.ttl * 2 / 3:
                claim.renewing = now
                self._out.append(Renew(claim, claim.holder, tuple(claim.grants or ()),
                                       claim.ttl))

    def _lose(self, claim: Claim) -> None:
        if not claim.lost:
            claim.lost = True
            self._out.append(LeaseLost(claim))



def _same_moment(a: Optional[float], b: Optional[float]) -> bool:
    """Two ``until`` times a report would not tell apart (within a second), or both None."""
    return a == b or (a is not None and b is not None and abs(a - b) <= 1.0)


def _due(attempt: Union[Attempt, MultiAttempt]) -> Optional[float]:
    """Seconds until time alone lets the caller start (a rate, a quota window, a pause)."""
    return attempt.due if attempt.due is not None else attempt.rate_due


def _grants_of(claim: Claim, attempt: Union[Attempt, MultiAttempt]) -> Dict[str, Grant]:
    if isinstance(attempt, MultiAttempt):
        return dict(attempt.grants or {})
    assert attempt.grant is not None
    return {claim.guard.name: attempt.grant}


def _limits_of(claim: Claim, attempt: Union[Attempt, MultiAttempt]) -> Dict[str, Optional[int]]:
    if isinstance(attempt, MultiAttempt):
        return {name: attempt.limits.get(name) for name in (attempt.grants or {})}
    return {claim.guard.name: attempt.limit}

