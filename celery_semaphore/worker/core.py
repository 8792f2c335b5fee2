"""The worker core: every decision about a guarded request from its arrival in the worker to
the moment it leaves for the pool (or for the waiting room, the broker, a failure), with no
threads, no Celery and no I/O.

It follows h11's sans-I/O shape: the shell (:mod:`.admission`, :mod:`.gate`) feeds it events
(:meth:`AdmissionCore.handle`) and carries out the commands it returns, in order. The core
owns its state (the waiters, the worker's line, the per-semaphore counts) and nothing else
touches it; it reads the time from the clock it was given and what it needs to know about
the pool and the waiting room from :class:`Surroundings` (reads of the main process's memory,
never I/O). So it can be driven event by event in a test, deterministically.

A waiter's life (:class:`.WaitState`)::

    Arrived ─> LINED ──> QUEUED ──> GRANTED ──> Exit(START): to the pool
                 │  ^       │          │
                 │  └───────┼──────────┘  (the pool filled up: GiveBackGrant, GrantReturned)
                 └──────────┴────────────> Exit(FAIL | FULL | PARK | REQUEUE | REVOKED |
                                                GIVE_BACK | LET_GO)

Every way out goes through one place (:meth:`AdmissionCore._exit`): the waiter stops its
attempts, stops watching for wake-ups, lowers the prefetch it raised, leaves the backend's
queue when it had entered it (``Cancel``; not when it leaves with its grant), lets the
waiting room refill that semaphore, and the shell gets one :class:`Exit` to settle its
message by.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Protocol, Tuple, Union

from ..backends.base import Attempt, MultiAttempt
from ..exceptions import ConfigurationError, SemaphoreTimeout
from ..guards import Guard
from .waiter import Waiter, WaitState

logger = logging.getLogger(__name__)

#: Seconds a woken waiter waits at most for a free pool process before it tries anyway.
WAKE_DEFER_MAX = 0.1


class Surroundings(Protocol):
    """What the core reads of the rest of the worker (main-process memory, never I/O)."""

    def free_processes(self, waiting: int) -> int:
        """Pool processes free for a waiter, given that ``waiting`` of the requests Celery
        holds reserved are this core's waiters (they do not occupy a process)."""

    def room(self, name: str, waiting_of_name: int, waiting: int) -> int:
        """How many more requests of semaphore ``name`` this worker should hold waiting
        (:meth:`.ParkingLot.room`): beyond it, a request that must wait goes to the waiting
        room."""

    def lookahead(self) -> int:
        """Granted requests the pool may hold beyond its free processes, each waiting in its
        queue for the next one (``semaphore_worker_lookahead``; 0 for a pool that runs a
        request as it is handed one)."""


class Answer(NamedTuple):
    """What one acquire attempt came back with (``attempt`` None: the call raised)."""

    holder: str
    attempt: Optional[Union[Attempt, MultiAttempt]]
    error: Optional[BaseException]
    requested_at: float
    #: The waiter's attempt number it answers (:attr:`.Waiter.attempts_sent`).
    sent: int = 0
    #: Seconds to wait for a wake-up before trying again (:meth:`.Backend.pause_after`).
    pause: float = 1.0


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrived:
    """A guarded request reached the gate (``pulled``: from the waiting room)."""

    request: Any
    guard: Guard
    holder: str
    pulled: bool = False


@dataclass(frozen=True)
class Answered:
    """An acquire attempt of ``waiter`` came back."""

    waiter: Waiter
    answer: Answer


@dataclass(frozen=True)
class Woken:
    """The backend woke ``holder`` (a slot of a semaphore it waits for may be free)."""

    waiter: Waiter
    holder: str


@dataclass(frozen=True)
class GrantReturned:
    """The grant the pool had no process for was given back (``released``: the backend
    confirmed it; if not, the waiter waits on as ``new_holder``)."""

    waiter: Waiter
    released: bool
    new_holder: str


@dataclass(frozen=True)
class Revoked:
    """Celery found ``waiter``'s request revoked (and announced and acked it)."""

    waiter: Waiter


@dataclass(frozen=True)
class Leave:
    """The shell takes ``waiter`` out: ``how`` is :attr:`How.GIVE_BACK` (the consumer
    stops), :attr:`How.LET_GO` (its pulled message went back with the parking connection),
    :attr:`How.PARK` or :attr:`How.REQUEUE`."""

    waiter: Waiter
    how: "How"
    why: str = ""


@dataclass(frozen=True)
class CapacityChanged:
    """A pool process may be free (a task ended, a parked copy was published)."""


@dataclass(frozen=True)
class Tick:
    """Every poll interval: bounds (``semaphore_max_wait``, ``semaphore_worker_max_hold``)."""


Event = Union[Arrived, Answered, Woken, GrantReturned, Revoked, Leave, CapacityChanged, Tick]


# -- commands ---------------------------------------------------------------------------------


class How(enum.Enum):
    """How a waiter left the core (:class:`Exit`)."""

    START = "start"  # granted, a process free: lease it and hand it to the pool
    FAIL = "fail"  # store the failure, ack
    FULL = "full"  # its one try found the semaphore full: skip or fail by its policy
    PARK = "park"  # to the waiting room
    REQUEUE = "requeue"  # a copy with a backoff ETA to its queue
    REVOKED = "revoked"  # settled by Celery already
    GIVE_BACK = "give_back"  # the consumer stops: back to the broker
    LET_GO = "let_go"  # its pulled message is back in the broker already


@dataclass(frozen=True)
class Exit:
    """``waiter`` left; settle its message as ``how`` says. ``answer``: its grant (START);
    ``error``: why it fails (FAIL); ``limit``/``blocking``: what refused it (FULL);
    ``why``: a reason for the log (PARK, REQUEUE)."""

    waiter: Waiter
    how: How
    answer: Optional[Answer] = None
    error: Optional[BaseException] = None
    limit: Any = None
    blocking: Optional[str] = None
    why: str = ""


@dataclass(frozen=True)
class Watch:
    """Ask the backend to wake ``waiter`` (every semaphore of its guard)."""

    waiter: Waiter


@dataclass(frozen=True)
class Unwatch:
    waiter: Waiter
    holder: str


@dataclass(frozen=True)
class SendAttempt:
    """Make acquire attempt number ``sent`` for ``waiter`` in ``delay`` seconds, replacing the
    one scheduled before it."""

    waiter: Waiter
    holder: str
    sent: int
    delay: float
    #: A try ahead (:attr:`.WaitState.AHEAD`): ``wait=False``, whatever the waiter's policy.
    ahead: bool = False


@dataclass(frozen=True)
class StopAttempts:
    """Drop ``waiter``'s scheduled attempt, if any."""

    waiter: Waiter


@dataclass(frozen=True)
class Cancel:
    """Leave the backend's queues of ``names`` as ``holder`` and release a grant an attempt
    still on its way may get, retrying until ``expires`` (monotonic)."""

    names: Tuple[str, ...]
    holder: str
    expires: float


@dataclass(frozen=True)
class ReleaseLate:
    """An answer reached ``waiter`` after it stopped waiting under that holder: release the
    grant it carries (``answer.attempt.grant``), unless that holder runs with it."""

    waiter: Waiter
    answer: Answer


@dataclass(frozen=True)
class GiveBackGrant:
    """Release ``answer``'s grant (no pool process for it); answer with
    :class:`GrantReturned`."""

    waiter: Waiter
    answer: Answer


@dataclass(frozen=True)
class RaisePrefetch:
    """The consumer may fetch one more message (a waiter waits for a slot, not a process)."""


@dataclass(frozen=True)
class LowerPrefetch:
    pass


@dataclass(frozen=True)
class ReportWaiting:
    """Announce that ``waiter`` waits (event, WAITING state): at ``position`` of the backend's
    queue, or None (in this worker's line, behind those that wait for the same slot)."""

    waiter: Waiter
    position: Optional[int]
    limit: Any


@dataclass(frozen=True)
class Refill:
    """The worker holds fewer requests of ``name``: pull parked ones if it has room."""

    name: str


Command = Union[Exit, Watch, Unwatch, SendAttempt, StopAttempts, Cancel, ReleaseLate,
                GiveBackGrant, RaisePrefetch, LowerPrefetch, ReportWaiting, Refill]


# -- the core ---------------------------------------------------------------------------------


@dataclass
class _Counts:
    """Per semaphore name: its waiters, those QUEUED, those the backend told to wait, those
    trying AHEAD."""

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


class AdmissionCore:
    """The guarded requests one worker holds until they get a slot. See the module docstring.

    Guarantees: a request enters the backend's queue only while a pool process is free for
    it (as many per semaphore as processes are free; one with a priority above the default
    at once); attempts sent at once and not answered yet (:attr:`trying`) never outnumber the
    free processes, except a priority request's, or a woken one's when no process is free and
    none is promised (its grant moves on), or one deferred past :data:`WAKE_DEFER_MAX`; a
    grant that finds no free process is given back before the request lines up again; an
    answer to an attempt older than the last one sent decides only if it is a grant; a
    request leaves exactly once, and every way out emits the same cleanup.

    Trying ahead: while every process is busy or promised, up to
    :meth:`Surroundings.lookahead` lined requests (counting the granted ones already waiting
    in the pool's queue) make one try with ``wait=False``, each one that would wait for a
    full semaphore (``semaphore_on_full="wait"``: a skip or fail policy makes its one try
    once a process is free, as documented), each of a semaphore this worker
    neither queues for nor was told to wait for: the backend grants it only a free slot
    nobody queues for, and the request goes to the pool's queue with it, to start the moment
    a process frees (no acquire round trip between one task's end and the next one's start).
    Refused, it lines up again and waits for a process like any other. Such a slot is held
    by a request that does not run yet, for at most the time a process takes to free.
    """

    def __init__(self, surroundings: Surroundings, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.surroundings = surroundings
        self.clock = clock
        self.wall_clock = wall_clock
        self.waiters: Dict[str, Waiter] = {}  # holder -> waiter
        self.line: Deque[Waiter] = deque()  # LINED, by priority then arrival
        self.counts = _Counts()
        #: QUEUED waiters with an attempt in flight (:attr:`.Waiter.in_flight`): each may take
        #: a pool process (a grant) when its answer comes.
        self.trying = 0
        #: Tries ahead in flight (:attr:`.WaitState.AHEAD`).
        self.trying_ahead = 0
        #: QUEUED waiters woken while no process was free for their attempt, in wake order.
        self.woken: Deque[Waiter] = deque()
        self._out: List[Command] = []

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.waiters)

    def count(self, name: str) -> int:
        """This worker's waiters of semaphore ``name``."""
        return self.counts.waiting.get(name, 0)

    def blocked(self, name: str) -> int:
        """Waiters of semaphore ``name`` the backend told to wait."""
        return self.counts.blocked.get(name, 0)

    def free_processes(self) -> int:
        return self.surroundings.free_processes(len(self.waiters))

    # -- events in, commands out -------------------------------------------------------------

    def handle(self, event: Event) -> List[Command]:
        """Apply ``event``; return the commands it leads to, in the order to carry them out."""
        handler = self._handlers[type(event)]
        handler(self, event)
        out, self._out = self._out, []
        return out

    def _arrived(self, event: Arrived) -> None:
        guard, name = event.guard, event.guard.name
        # This worker's waiters of the semaphore were told to wait: it is full. One more waits
        # for it too (raising the prefetch), or, beyond this worker's share, goes to the
        # waiting room without asking the backend again.
        full = self.blocked(name) > 0
        room = self.surroundings.room(name, self.count(name), len(self.waiters))
        waiter = Waiter(event.request, guard, event.holder, pulled=event.pulled,
                        entered=self.clock(), entered_wall=self.wall_clock())
        self.waiters[waiter.holder] = waiter
        _Counts.add(self.counts.waiting, name, 1)
        if full and waiter.waits:
            if room <= 0 and not event.pulled and waiter.parks:
                return self._exit(waiter, How.PARK, why="this worker holds its share already")
            self._announce_lined(waiter)
        self._line_up(waiter)
        self._pump()

    def _answered(self, event: Answered) -> None:
        waiter, answer = event.waiter, event.answer
        if (waiter.in_flight and waiter.holder == answer.holder
                and answer.sent == waiter.attempts_sent):
            self._land(waiter)
        self._answer(waiter, answer)
        self._pump()  # a process it was counted on may be free for the line now

    def _answer(self, waiter: Waiter, answer: Answer) -> None:
        current = waiter.holder == answer.holder
        if waiter.state is WaitState.AHEAD and current:
            return self._answered_ahead(waiter, answer)
        if waiter.state is not WaitState.QUEUED or not current:
            return self._late_answer(waiter, answer, current)
        if answer.sent != waiter.attempts_sent and (answer.attempt is None
                                                    or answer.attempt.grant is None):
            # A newer attempt is on its way (a wake-up sent it after this one was made): its
            # answer decides. Rescheduling from this one would cancel it, and the waiter
            # would sleep a poll interval through the slot it was woken for.
            return
        if isinstance(answer.error, ConfigurationError):
            # The backend refused the request itself (a cost above the stored limit, an
            # option this backend cannot apply): it fails alone; trying again cannot help.
            return self._exit(waiter, How.FAIL, error=answer.error)
        if answer.error is not None:
            if not waiter.backend_down:
                logger.warning("celery-semaphore: %s waits: backend unavailable: %s",
                               getattr(waiter.request, "id", waiter.holder), answer.error)
            waiter.backend_down = True
            return self._send(waiter, delay=min(waiter.guard.settings.poll_interval, 1.0))
        waiter.backend_down = False
        attempt = answer.attempt
        assert attempt is not None
        if attempt.grant is not None:
            return self._granted(waiter, answer)
        blocking = getattr(attempt, "blocking", None) or waiter.guard.name
        if not waiter.waits:  # semaphore_on_full skip or fail: it never queued
            return self._exit(waiter, How.FULL, limit=attempt.limit, blocking=blocking)
        waiter.attempts += 1
        if waiter.attempts == 1 and self._told_to_wait(waiter):
            return
        waits_for = getattr(attempt, "waits_for", None)
        if (attempt.position != waiter.position or blocking != waiter.blocking
                or waits_for != waiter.waits_for):
            waiter.position, waiter.blocking, waiter.waits_for = (attempt.position, blocking,
                                                                  waits_for)
            self._out.append(ReportWaiting(waiter, attempt.position, attempt.limit))
        pause = answer.pause
        if getattr(attempt, "rate_due", None) is not None:
            # Due counts from when the backend decided, which was after the attempt was sent:
            # count from the send, so the next try reaches it as its start falls due rather
            # than a round trip later (each late start delays every later one).
            pause = max(0.0, pause - (self.clock() - answer.requested_at))
        self._send(waiter, delay=pause)

    def _answered_ahead(self, waiter: Waiter, answer: Answer) -> None:
        """The answer to ``waiter``'s try ahead: a grant sends it to the pool's queue; a
        refusal or an error lines it up again."""
        attempt = answer.attempt
        if attempt is not None and attempt.grant is not None:
            return self._exit(waiter, How.START, answer=answer)
        if isinstance(answer.error, ConfigurationError):
            return self._exit(waiter, How.FAIL, error=answer.error)
        waiter.tried_ahead = True
        self._move(waiter, WaitState.LINED)
        # back where it was: behind those that tried ahead before it, ahead of the rest
        priority = waiter.guard.priority
        index = next((i for i, w in enumerate(self.line) if w.guard.priority < priority
                      or (w.guard.priority == priority and not w.tried_ahead)),
                     len(self.line))
        self.line.insert(index, waiter)

    def _woken(self, event: Woken) -> None:
        waiter = event.waiter
        if waiter.state is not WaitState.QUEUED or waiter.holder != event.holder:
            return
        free = self.free_processes()
        if (waiter.in_flight or waiter.guard.priority > 0 or free - self.trying > 0
                or (free <= 0 and self.trying == 0)):
            # (no process free and none promised: a grant is given back at once, and the
            # slot goes on to whoever waits behind it in another worker)
            self._send(waiter)
        elif not waiter.wake_pending:
            # the free processes are promised to attempts in flight: try once they land,
            # rather than be granted a slot only to give it back; at the latest after
            # WAKE_DEFER_MAX (a token-queue backend's wake-up hands this waiter the token)
            waiter.wake_pending = True
            self.woken.append(waiter)
            self._send(waiter, delay=WAKE_DEFER_MAX)

    def _grant_returned(self, event: GrantReturned) -> None:
        waiter = event.waiter
        if waiter.state is not WaitState.GRANTED:
            return
        if not event.released:  # the release is being retried: wait under another holder id
            del self.waiters[waiter.holder]
            waiter.holder = event.new_holder
            self.waiters[waiter.holder] = waiter
            waiter.first_sent = None
        self._move(waiter, WaitState.LINED)
        waiter.position = waiter.blocking = None
        self.line.appendleft(waiter)
        self._pump()

    def _revoked(self, event: Revoked) -> None:
        self._exit(event.waiter, How.REVOKED)

    def _leave(self, event: Leave) -> None:
        self._exit(event.waiter, event.how, why=event.why)
        if event.how in (How.PARK, How.REQUEUE):
            self._pump()

    def _capacity_changed(self, event: CapacityChanged) -> None:
        self._pump()

    def _tick(self, event: Tick) -> None:
        now, wall = self.clock(), self.wall_clock()
        for waiter in list(self.waiters.values()):
            settings = waiter.guard.settings
            if settings.max_wait is not None and wall - waiter.first_wait > settings.max_wait:
                self._exit(waiter, How.FAIL, error=SemaphoreTimeout(
                    f"no slot of semaphore {waiter.blocking or waiter.guard.name!r} in "
                    f"{settings.max_wait}s (semaphore_max_wait)"))
            elif now - waiter.entered > settings.worker_max_hold and waiter.waits:
                # a priority above the default goes back to its queue, never behind a backlog
                self._exit(waiter, How.PARK if waiter.parks else How.REQUEUE,
                           why="semaphore_worker_max_hold passed")
        self._pump()

    _handlers: Dict[type, Callable[["AdmissionCore", Any], None]] = {
        Arrived: _arrived, Answered: _answered, Woken: _woken, GrantReturned: _grant_returned,
        Revoked: _revoked, Leave: _leave, CapacityChanged: _capacity_changed, Tick: _tick,
    }

    # -- steps -------------------------------------------------------------------------------

    def _line_up(self, waiter: Waiter) -> None:
        """``waiter`` joins the line: after those of its priority or higher
        (``semaphore_priority``), ahead of lower ones, so that it enters the backend's queue
        (ordered by priority there too) first."""
        priority = waiter.guard.priority
        if not self.line or self.line[-1].guard.priority >= priority:
            self.line.append(waiter)
        else:
            index = next(i for i, w in enumerate(self.line) if w.guard.priority < priority)
            self.line.insert(index, waiter)

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
            waiter = self.woken.popleft()
            if waiter.wake_pending and waiter.state is WaitState.QUEUED:
                waiter.wake_pending = False
                budget -= 0 if waiter.in_flight else 1
                self._send(waiter)
        for waiter in list(self.line):
            urgent = waiter.guard.priority > 0
            if urgent or (budget > 0 and self.counts.queued.get(waiter.guard.name, 0) < free):
                self.line.remove(waiter)
                self._move(waiter, WaitState.QUEUED)
                budget -= 1
                self._out.append(Watch(waiter))
                self._send(waiter)
        self._try_ahead(free)

    def _try_ahead(self, free: int) -> None:
        """Tries ahead (class docstring) for the first lined requests that may make one, as
        many as the lookahead leaves room for."""
        room = self.surroundings.lookahead() + free - self.trying - self.trying_ahead
        if room <= 0 or not self.line:
            return
        counts = self.counts
        for waiter in list(self.line):
            name = waiter.guard.name
            if (waiter.tried_ahead or not waiter.waits or waiter.guard.priority > 0
                    or name in counts.blocked or name in counts.queued or name in counts.ahead):
                continue
            self.line.remove(waiter)
            self._move(waiter, WaitState.AHEAD)
            self._send(waiter, ahead=True)
            room -= 1
            if room <= 0:
                return

    def _send(self, waiter: Waiter, delay: float = 0.0, ahead: bool = False) -> None:
        now = self.clock()
        if waiter.first_sent is None:
            waiter.first_sent = now
        waiter.last_sent = now + delay
        waiter.attempts_sent += 1
        if delay == 0 and not waiter.in_flight and not ahead:
            waiter.in_flight = True
            self.trying += 1
        self._out.append(SendAttempt(waiter, waiter.holder, waiter.attempts_sent, delay,
                                     ahead))

    def _told_to_wait(self, waiter: Waiter) -> bool:
        """The backend told ``waiter`` to wait for the first time: its semaphore is full. It
        stops counting against the consumer's prefetch (the consumer fetches other work
        meanwhile); beyond this worker's share of that semaphore's waiters it goes to the
        waiting room instead (True: it left)."""
        name = waiter.guard.name
        _Counts.add(self.counts.blocked, name, 1)  # _exit undoes it
        if not waiter.pulled and waiter.parks and self.surroundings.room(
                name, self.count(name), len(self.waiters)) < 0:
            self._exit(waiter, How.PARK, why="this worker holds its share of waiters already")
            return True
        self._raise_prefetch(waiter)
        # those of its semaphore still in the line (they arrived while its first attempt was
        # on its way) wait for the same slot: say so now
        for lined in [w for w in self.line if w.guard.name == name and not w.announced]:
            self._announce_lined(lined)
        return False

    def _announce_lined(self, waiter: Waiter) -> None:
        """``waiter`` is in the line while its semaphore is full: it waits for the slot its
        peers wait for, not for a pool process. Raise the prefetch for it and report it
        waiting (no position: it has not asked the backend yet), once."""
        waiter.announced = True
        if waiter.waits:
            self._raise_prefetch(waiter)
            self._out.append(ReportWaiting(waiter, None, waiter.guard.limit))

    def _raise_prefetch(self, waiter: Waiter) -> None:
        """``waiter`` waits for its semaphore (not for a pool process): raise the consumer's
        prefetch while it does (never for a pulled one, which is not on the consumer's
        channel), so that the consumer fetches other work meanwhile."""
        if not waiter.pulled and not waiter.raised_prefetch:
            waiter.raised_prefetch = True
            self._out.append(RaisePrefetch())

    def _late_answer(self, waiter: Waiter, answer: Answer, current: bool) -> None:
        """An answer to an attempt sent before the waiter left the backend's queue. Repeating
        an acquire returns the holder's own grant: while the waiter gives that grant back
        (GRANTED) or its task holds it, the answer is that very slot and changes nothing
        (the shell knows which holders run). Otherwise a grant, or an error that may hide
        one, must not keep a slot."""
        if current and waiter.state is WaitState.GRANTED:
            return
        if answer.attempt is not None and answer.attempt.grant is not None:
            self._out.append(ReleaseLate(waiter, answer))
        elif answer.error is not None:
            self._out.append(Cancel(waiter.guard.names, answer.holder,
                                    answer.requested_at + waiter.guard.settings.lease_ttl))

    def _granted(self, waiter: Waiter, answer: Answer) -> None:
        self._move(waiter, WaitState.GRANTED)
        self._out.append(Unwatch(waiter, waiter.holder))
        if self.free_processes() <= 0:
            # The pool filled up meanwhile: never sit on a slot waiting for a process. The
            # waiter stays GRANTED until the release is done: an answer to an attempt made
            # before it would carry this very grant, about to be freed.
            self._out.append(GiveBackGrant(waiter, answer))
            return
        self._exit(waiter, How.START, answer=answer)

    def _move(self, waiter: Waiter, to: WaitState) -> None:
        name = waiter.guard.name
        if waiter.state is WaitState.QUEUED:
            _Counts.add(self.counts.queued, name, -1)
            self._land(waiter)
            waiter.wake_pending = False  # left in self.woken, skipped there
        if waiter.state is WaitState.QUEUED and to is not WaitState.QUEUED:
            self._out.append(StopAttempts(waiter))
        if waiter.state is WaitState.AHEAD:
            _Counts.add(self.counts.ahead, name, -1)
            self.trying_ahead -= 1
            if to is WaitState.DONE:
                self._out.append(StopAttempts(waiter))
        waiter.move(to)
        if to is WaitState.QUEUED:
            _Counts.add(self.counts.queued, name, 1)
        elif to is WaitState.AHEAD:
            _Counts.add(self.counts.ahead, name, 1)
            self.trying_ahead += 1

    def _land(self, waiter: Waiter) -> None:
        """``waiter``'s attempt in flight is answered (or it left the queue)."""
        if waiter.in_flight:
            waiter.in_flight = False
            self.trying -= 1

    def _exit(self, waiter: Waiter, how: How, **details: Any) -> None:
        """The one way out of the core (module docstring)."""
        if waiter.state is WaitState.DONE:
            return
        if waiter.state is WaitState.LINED and waiter in self.line:
            self.line.remove(waiter)
        watching = waiter.state is WaitState.QUEUED  # a grant stopped the watch already
        self._move(waiter, WaitState.DONE)
        del self.waiters[waiter.holder]
        name = waiter.guard.name
        _Counts.add(self.counts.waiting, name, -1)
        if waiter.attempts:
            _Counts.add(self.counts.blocked, name, -1)
        if watching:
            self._out.append(Unwatch(waiter, waiter.holder))
        if waiter.raised_prefetch:
            self._out.append(LowerPrefetch())
        # START leaves with its grant; FULL made one try that did not queue
        if waiter.first_sent is not None and how not in (How.START, How.FULL):
            # leave the backend's queue, and release the grant an attempt still on its way
            # may get (its answer may never be read: the loop stops at shutdown)
            self._out.append(Cancel(waiter.guard.names, waiter.holder,
                                    waiter.last_sent + waiter.guard.settings.lease_ttl))
        self._out.append(Refill(name))
        self._out.append(Exit(waiter, how, **details))
