"""The backend contract: the few atomic operations every semaphore backend provides.

A backend stores, per semaphore name:

* the **limit** in force, whether an operator **pinned** it, the **newest declaration** (the
  limit the most recently started process declared, and that start time), and the limits
  callers have declared lately (for operators to spot a mismatch): see "Limits" below;
* the **holders**: holder id -> slot, fencing epoch, since, absolute expiry, caller metadata;
* the **waiters**: a FIFO queue of holder ids by ticket, each with an expiry that a live waiter
  keeps pushing forward, so a crashed waiter stops blocking the queue after ``waiter_ttl``;
* one fencing **epoch per slot**, strictly increasing.

Every operation is atomic on the server and reads time from the server, never a client clock.
Expired holders and waiters are pruned by every operation before it decides anything.

Admission rule (FIFO): a caller is admitted when ``len(holders) + rank < limit`` where ``rank``
is its place in the waiter queue (a caller that is not queued ranks behind every waiter). The
admitted caller takes the lowest free slot ``s < limit`` and bumps ``epoch[s]``.

Fair shares (round-robin across keys): a caller whose ``meta`` carries a non-empty string under
:data:`FAIR_KEY` (the task's ``semaphore_fair_by`` value, e.g. a tenant) makes the semaphore
*fair* while such a waiter is queued. A waiter that queues while the semaphore is fair gets a
**round**, fixed for good: one more than the later of the semaphore's current round (the
highest round admitted so far) and the round of the last waiter of its own key still queued
(waiters with no key form one key of their own). The queue is then ordered by ``(round,
ticket)``; a waiter queued before the semaphore became fair has round 0. Consequences: a key
has at most one waiter per round, so while several keys wait they are admitted in turn, FIFO
within one key; a key that starts waiting joins the next round, behind at most two waiters of
each other key (the current round's and the next's); with one key, or none, the order is plain
FIFO. ``rank`` in the admission rule is a caller's place in that order (a caller not yet queued
ranks behind every waiter of its round or an earlier one).

Weights: a waiter whose ``meta`` carries :data:`WEIGHT_KEY` ``w`` (default 1) may share a
round with up to ``w - 1`` earlier waiters of its own key: it joins its key's last queued round
when that round is above the current one and holds fewer than ``w`` of the key's waiters, else
the next round as above. While several keys wait, each round admits up to ``w`` waiters of a key
of weight ``w``: admissions go to the waiting keys in proportion to their weights.

Priorities: a caller's ``meta`` may carry :data:`PRIORITY_KEY` (an int, default 0, higher
first). The queue is ordered by ``(-priority, round, ticket)``: priority first, then the fair
rounds, then arrival. A newcomer ranks behind every waiter of its priority or a higher one and
ahead of every waiter of a lower one. Starvation of low priorities is not bounded: while
higher-priority callers keep arriving faster than the semaphore serves them, a lower one waits
(its queue entry stays alive as long as it keeps trying).

Costs: a caller's ``meta`` may carry :data:`COST_KEY` ``k`` (an int from 1 to the limit,
default 1): it holds ``k`` units of the limit. Admission: ``units + ahead + k <= limit``, where
``units`` is the sum of the holders' costs and ``ahead`` the sum of the costs of the waiters
ahead of it in the queue order (with every cost 1 this is the rule above). So a waiter that
needs more units than are free blocks every waiter behind it (nobody overtakes a big task) and
is admitted, and woken, as soon as its units are free. Each holder still takes one slot number
(its fencing token), below the limit.

Rate: a caller's ``meta`` may carry :data:`RATE_KEY` ``[interval, burst]``, or a list of them
``[[interval, burst], ...]`` (several rates, each of which must allow every start): each rate
is a GCRA with its own ``tat`` (theoretical arrival time). A start that spends ``u`` units
(:data:`UNITS_KEY`, default 1, see "Units") is allowed at time ``now`` when, for every rate,
``now >= tat - max(0, burst - u) * interval``, and moves each rate's ``tat`` to ``max(tat, now)
+ u * interval``, on the backend's clock. So with 1 unit per start any window of ``n *
interval`` seconds holds at most ``n + burst - 1`` starts; a start of more units than the
burst starts only when that rate owes nothing (``tat <= now``) and its units are then paid
for before the next start (a debt, as a settled overdraft below). The rates are the
semaphore's, like its limit: the latest call that declares rates sets them all (a rate in the
same place of the new list keeps its ``tat``; a call that declares none leaves them; an empty
list removes them), and they apply to every caller of the semaphore. Because they are one rule
for the whole queue, a head a rate holds back holds back everyone behind it too: no slot is
kept idle for it that someone behind could use, and a rate holds no slot (units are spent at
the start only). A caller the rates alone hold back gets :attr:`Attempt.rate_due` (and
:attr:`Attempt.due`), when its own start is due with the units of the waiters ahead of it
counted (``max(tat, now) + (ahead - max(0, burst - u)) * interval`` for the slowest rate,
``ahead`` the units of the waiters ahead of it), and tries again then; no wake-up is sent for
a rate. Backends that cannot apply these rules atomically refuse them
(:meth:`Backend.check_traffic`).

Units: a caller's ``meta`` may carry :data:`UNITS_KEY` ``u`` (an int >= 1, default 1): the units
of the rates and quotas its start spends, as estimated at admission (an LLM call's maximum
tokens), settled later with the actual amount (:meth:`Backend.settle`). Distinct from costs
(:data:`COST_KEY`: units of the concurrency limit held while it runs).

Quotas (calendar windows): a caller's ``meta`` may carry :data:`QUOTA_KEY` ``[[count, period,
offset], ...]`` (seconds): at most ``count`` units started per window of each. ``period > 0``:
a window starts at ``floor((t + offset) / period) * period - offset`` (aligned to the UTC
epoch: a 5 s window starts at a multiple of 5 s; ``offset`` moves a day's boundary to another
zone's midnight, +3600 for UTC+1); ``period == 0``: one calendar month (UTC, shifted by
``offset``) (:func:`window_of`). Declared like the rates: the latest call that declares quotas
sets the semaphore's (a call declaring none leaves them; an empty list removes them). Each
(period, offset) has a counter of the units started in its current window; it counts from 0
again when its window turns, and is forgotten once its window is over (a counter outlives
changes of ``count``: the new count applies to what the window already used). Admission, in the
same atomic step as the limit, costs, rates and the queue order: a caller is admitted only when
for every quota ``used + ahead + u <= count`` (``ahead``: the units of the waiters ahead of it,
so nobody overtakes a waiter the quota holds back); its start adds ``u`` to every quota's
counter, and its holder remembers the windows it counted in (for :meth:`Backend.settle`). A
caller that needs more units than a quota's count could never be admitted: refused with
ConfigurationError before anything changes. A caller only a quota holds back waits (``waits_for
== "quota"``; ``due``: seconds until the last of the windows that hold it back turns, or until
its rate allows it if that is later); like a rate, a quota holds back everyone behind the head
it holds back, and nobody is woken when a window turns (waiters try again at ``due``). The
state of a semaphore is kept at least until the end of every window that counted a start (a
month's, too).

Settling (:meth:`Backend.settle`): ``settle(name, holder, units)`` says that ``holder`` (holding
now) actually spent ``units`` (an int >= 0) instead of what its admission counted. The
difference from what was counted so far adjusts every quota window its admission counted in
that has not turned yet (a refund frees room at once, waking, or pushing grants to, the waiters
it makes admissible; an overdraft leaves ``used > count``: later admissions wait for the window
to turn; a counter never goes below 0), and every rate's ``tat``: a refund moves it back by
``difference * interval`` but never before the backend's now; an overdraft moves it to
``max(tat, now) + difference * interval`` (the units are spent now). Absolute and idempotent:
settling again with another value adjusts by the change only; the holder's record keeps what
has been counted. False, changing nothing, when ``holder`` does not hold; True otherwise (also
when nothing changed).

Pauses (:meth:`Backend.pause`, :meth:`Backend.resume`): a pause closes the semaphore until a
time of the backend's clock (``paused_until``). While it is in force (``now <
paused_until``) no acquire is admitted and no grant is pushed: holders keep their slots and
renew, releases and cancels work, a caller that waits queues as usual (at its place in the
order) and is told ``waits_for == "pause"`` with ``due`` the seconds until the pause ends,
whatever else holds it back. Pauses only extend: a pause asked for that ends before the one in
force changes nothing (the reason stays that of the pause in force); one that ends later
replaces it, reason included. A pause works on a name with no state (a template key never
used): the semaphore then exists with limit 0 and no declaration until a caller declares one,
and its state is kept at least until the pause ends (beyond ``idle_ttl`` if need be). Nobody
is woken when a pause ends: waiters try again at their ``due``. :meth:`Backend.resume` ends
the pause in force at once and wakes (or pushes grants to) the waiters that are admissible
then.

Front of the queue: a waiter whose ``meta`` carries a truthy :data:`FRONT_KEY` queues ahead of
every waiter of its priority that does not, whatever the fair rounds, FIFO among such waiters
(its ticket); it takes no fair round (round 0) and admitting it moves no round on. The queue
order is thus ``(-priority, not front, round, ticket)``. (A call a pause gave back re-queues
this way: ahead of later arrivals.)

Adaptive limits: a caller's ``meta`` may carry :data:`ADAPTIVE_KEY` ``{"min": m, "max": M,
"decrease": d, "increase": i}`` (``1 <= m <= M``, ``0 < d < 1``, ``i > 0``; defaults d = 0.9, i =
1.0): the limit of the semaphore is then learned. Adaptation is part of the limit's
declaration (see "Limits"): the newest declaration says whether the semaphore is adaptive and
with which bounds (the caller's ``limit`` is ``M`` then); an older process cannot change it,
and a newest declaration without it makes the limit fixed again (the learned value is
dropped). The semaphore keeps a learned ``current`` (a float): ``m`` when a declaration first
makes it adaptive, moved into ``[m, M]`` when a newer declaration changes the bounds. Unless
the limit is pinned, the limit in force is ``floor(current)``. :meth:`Backend.release` takes the
outcome of the holder's call, applied in the same atomic step, only when that holder held and
only while the semaphore is adaptive and not pinned:

* ``"ok"``: ``current = min(M, current + i / current)`` (about +1 per limit's worth of
  successes), only when the limit was in use: the units held before this release (its own
  included) are at least ``current / 2``; :data:`ADAPTIVE_PROBE_SLOWER` times slower while
  the next limit (``floor(current) + 1``) would reach the *ceiling*, the limit in force at the
  last decrease (so the limit climbs back fast to just below the level that overloaded, then
  probes it slowly: few overloads while the capacity stays, as in CUBIC); once
  ``floor(current)`` passes the ceiling without an overload, the ceiling is forgotten;
* ``"overload"``: the ceiling becomes ``floor(current)``, then ``current = max(m, current *
  d)``, at most once per round trip of work: only when the holder was granted at or after
  the last decrease (its grant time >= the time of the last decrease), which then becomes
  now;
* ``"error"`` or None: nothing.

A change of the limit in force takes effect at once, as any (growing wakes or pushes to the
waiters that fit). ``resize`` pins the limit (no adaptation while pinned; the learned value
stays); ``unpin`` resumes adaptation from the learned value. A cost is checked against ``M``,
not against the learned limit (a big call waits until the limit grows enough). The state of an
adaptive semaphore is kept for ``idle_ttl`` even when empty (as a pinned one), so the learned
limit survives a quiet spell.

Where several rules hold a caller back it is told, in this order: ``"pause"`` (a pause is in
force), ``"slots"`` or ``"units"`` (the limit: no ``due``, a release will wake it), ``"quota"``,
``"rate"``.

One holder per task: a holder id of the form ``<task id>:<random>`` (:func:`new_holder_id`
with a task id) names its task, and a caller is not admitted while another holder of the same
task holds; it keeps its place in the queue and is woken when that twin goes. A duplicate
delivery of a task (Celery is at-least-once) therefore never runs beside its twin.

Several semaphores (:meth:`Backend.acquire_all`): a caller is admitted to all of the listed
semaphores together, under one holder id, when the FIFO rule admits it in each; otherwise it
holds none of them and waits in the queue of one of them only, the one that refused it (the
first listed that does), so it never keeps a slot, or a place ahead of others, in a semaphore
that would admit it while it waits for another. Backends that can decide over several
semaphores atomically do so in one step; the others use the generic protocol of the base
class (tries in sorted name order, give-back on refusal). The caller's traffic options apply in
each semaphore: its cost is held, and its units spent, in each, and a pause of any one of them
holds it back (``blocking`` names the one that refuses, with what it waits for).

Limits (they follow the code): every ``acquire`` declares the caller's limit, dated by the
start of the caller's process (:attr:`Backend.declared_at`, clamped to the server's clock).
The declaration with the latest date (between equal dates, the latest call) is the *newest*;
its limit is in force unless an operator pinned one with ``resize``
(:func:`.model.effective_limit`).
So after a deploy that changes a declared limit, the new processes' first acquire puts the new
limit in force, and the old processes still running cannot put theirs back: during a rolling
deploy the limit in force is the old one, then the new one, never anything else. ``resize``
pins a limit that no declaration changes until :meth:`Backend.unpin` releases it (the newest
declaration is then in force again). A change of limit takes effect in the same atomic step as
the call that makes it: growing admits waiters at once; shrinking admits nobody until the
holders drop below the new limit (running holders keep their slots).

Wake-ups: whenever an operation can make a waiter admissible (release, cancel, resize, pruning,
resume, a settle that refunds, an adaptive limit that grows),
the backend notifies the waiters whose rank is now below ``limit - len(holders)`` (and whose
task no other holder holds), addressed to
the process that queued them (its ``client_id``). A notification is only a hint: waiters also
re-try after ``retry_after`` or their poll interval, because a notification can be lost and an
expiring lease notifies nobody.

Pushed grants (backends with :attr:`Backend.pushes_grants`): a waiter that queued with
``push`` (:attr:`Acquire.push`) is not woken to try again: the operation that makes it
admissible (a release, a cancel, a resize, pruning, a resume, a refund) grants it the slot
there and then, under the same rules and in the same order as its own acquire would have been
granted (the pause, the quotas and the rates decide as for an acquire), for the lease
TTL it asked for, and its wake-up carries the grant (:class:`PushedGrant`). So a slot freed by
a release goes to the next waiter in that one operation, with no round trip of the waiter's
own. Nothing else changes for it: its next acquire returns that grant, a cancel (``abandon``)
releases it, and it expires with its TTL if nobody takes it up (a pushed notification can be
lost like any other: the waiter's next try finds its grant). With a rate, one grant at most is
pushed per operation; the others admissible are woken. A waiter of several semaphores at once
(``acquire_all``) is never pushed a grant.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    List,
    Mapping,
    NamedTuple,
    NoReturn,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

from ..stats import SemaphoreStats

logger = logging.getLogger(__name__)

#: When this process loaded the library (seconds since the epoch): the default date of its
#: limit declarations (:attr:`Backend.declared_at`). A forked child keeps its parent's.
PROCESS_STARTED = time.time()

Meta = Dict[str, Any]
WakeCallback = Callable[[], None]

#: Default seconds a waiter's queue entry lives without being refreshed.
DEFAULT_WAITER_TTL = 5.0
#: Default seconds an idle semaphore's state (limit included) is kept.
DEFAULT_IDLE_TTL = 7 * 24 * 3600.0
#: Seconds the state of an *empty* semaphore is kept after its last holder or waiter left:
#: nobody holds or waits, no operator pinned its limit and its rate (if any) has no start
#: due later. Then it is forgotten (at most ``idle_ttl``): a template's thousands of keys
#: leave nothing behind a minute after their backlog. What it forgets: the limit in force
#: (the next caller's declaration sets it again), the declared limits seen, its counters and
#: histograms; fencing epochs stay increasing (:func:`.model.next_epoch`: never below the
#: server's clock).
EMPTY_TTL = 60.0


class FencingToken(NamedTuple):
    """``(slot, epoch)``: the epoch strictly increases for each slot.

    A protected resource remembers the highest epoch it has seen per slot and rejects writes
    carrying a lower one, so a holder whose lease lapsed cannot overwrite its successor.
    """

    slot: int
    epoch: int

    def __str__(self) -> str:
        return f"{self.slot}:{self.epoch}"


@dataclass(frozen=True)
class Grant:
    """A slot granted to a holder. ``ttl`` is the lease length in seconds as granted."""

    slot: int
    epoch: int
    expires_at: float
    ttl: float

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.slot, self.epoch)


@dataclass(frozen=True)
class Attempt:
    """The outcome of one ``acquire`` call.

    ``grant`` is set when admitted. Otherwise ``position`` is the caller's 0-based place in the
    waiter queue (None when it did not queue) and ``retry_after`` the seconds until the earliest
    holder lease expires (None when nobody holds), a hint for when to try again.
    """

    grant: Optional[Grant]
    position: Optional[int] = None
    retry_after: Optional[float] = None
    limit: Optional[int] = None
    #: Not admitted because of the semaphore's rate only: seconds until this caller's start
    #: is due (its turn in line counted), by the backend's clock. None otherwise.
    rate_due: Optional[float] = None
    #: What the caller waits for: ``"pause"``, ``"slots"`` (plain count), ``"units"`` (costs
    #: are in play), ``"quota"`` or ``"rate"`` (module docs: the first that applies); None when
    #: admitted.
    waits_for: Optional[str] = None
    #: Admitted: the units of the limit still free after this grant that nobody waits for
    #: (None: the backend does not say). A hint, as of the grant.
    free: Optional[int] = None
    #: Not admitted, and time alone can let this caller start (a pause ending, a quota window
    #: turning, a rate): seconds until then, by the backend's clock. None otherwise. Equal to
    #: :attr:`rate_due` when ``waits_for == "rate"``.
    due: Optional[float] = None


@dataclass(frozen=True)
class MultiAttempt:
    """The outcome of one :meth:`Backend.acquire_all` call over several semaphores.

    ``grants`` (name -> :class:`Grant`, in the order asked) is set when the caller was admitted
    to every semaphore; ``limits`` then holds each one's limit in force. Otherwise nothing is held
    and ``blocking`` names the semaphore that refused it: the caller waits in that semaphore's
    queue only, at ``position`` (None when it did not queue); ``retry_after`` and ``limit`` are
    that semaphore's, as in :class:`Attempt`.
    """

    grants: Optional[Dict[str, Grant]]
    blocking: Optional[str] = None
    position: Optional[int] = None
    retry_after: Optional[float] = None
    limit: Optional[int] = None
    limits: Dict[str, int] = field(default_factory=dict)
    rate_due: Optional[float] = None
    waits_for: Optional[str] = None
    due: Optional[float] = None

    @property
    def grant(self) -> Optional[Grant]:
        """The first semaphore's grant (None: not admitted), as :attr:`Attempt.grant`."""
        return None if self.grants is None else next(iter(self.grants.values()))


#: (name, declared limit) of each semaphore a multi-semaphore request asks for.
Requests = Sequence[Tuple[str, int]]


# -- operations as values ---------------------------------------------------------------------
# What a caller that makes many calls at once (the worker's gate) hands a backend: each is one
# of the contract's operations below, with its arguments. :meth:`Backend.perform_all` runs a
# batch of them (in one round trip where the backend can), and :meth:`Backend.event_loop_link`
# runs them on an event loop without blocking it, where the backend can.


@dataclass(frozen=True)
class Acquire:
    """:meth:`Backend.acquire`. ``push``: while it waits, the caller may be granted a slot by
    another caller's operation (:attr:`Backend.pushes_grants`: "Pushed grants" in the module
    docs); a backend that does not push ignores it and wakes the caller, as always."""

    name: str
    holder: str
    limit: int
    ttl: float
    meta: Meta
    wait: bool
    push: bool = False


@dataclass(frozen=True)
class AcquireAll:
    """:meth:`Backend.acquire_all`."""

    requests: Tuple[Tuple[str, int], ...]
    holder: str
    ttl: float
    meta: Meta
    wait: bool


@dataclass(frozen=True)
class Release:
    """:meth:`Backend.release` (``outcome``, ``latency``: the call's, for an adaptive limit)."""

    name: str
    holder: str
    outcome: Optional[str] = None
    latency: Optional[float] = None


@dataclass(frozen=True)
class Renew:
    """:meth:`Backend.renew`."""

    name: str
    holder: str
    ttl: float


@dataclass(frozen=True)
class Abandon:
    """:meth:`Backend.abandon_all`: leave the queues of ``names`` for good, and release a grant
    whose reply was lost."""

    names: Tuple[str, ...]
    holder: str


#: How many times slower an adaptive limit grows while it probes the level that last
#: overloaded (module docs, "Adaptive limits").
ADAPTIVE_PROBE_SLOWER = 32


@dataclass(frozen=True)
class Pause:
    """:meth:`Backend.pause`."""

    name: str
    seconds: float
    reason: str = ""


@dataclass(frozen=True)
class Resume:
    """:meth:`Backend.resume`."""

    name: str


@dataclass(frozen=True)
class Settle:
    """:meth:`Backend.settle`."""

    name: str
    holder: str
    units: int


Operation = Union[Acquire, AcquireAll, Release, Renew, Abandon, Pause, Resume, Settle]
#: What one operation of a batch came to: ``(result, None)``, or ``(None, the exception it
#: raised)``.
Outcome = Tuple[Any, Optional[BaseException]]


@dataclass(frozen=True)
class PushedGrant:
    """A grant another caller's operation made to a waiter that asked for pushed grants
    (:attr:`Acquire.push`), as its wake-up announced it: the same grant the waiter's next
    acquire returns. ``server_now``: the backend's clock when it was made (seconds)."""

    name: str
    holder: str
    grant: Grant
    limit: int
    server_now: float


class EventLoopLink(Protocol):
    """A backend's operations on an event loop (:meth:`Backend.event_loop_link`): calls are
    queued and go out together once per turn of the loop (a pipeline), their outcomes come
    back on the loop's thread, and nothing blocks the loop."""

    def submit(self, op: Operation, done: Callable[[Any, Optional[BaseException]], None]
               ) -> None:
        """Queue ``op``; ``done(result, None)`` or ``done(None, exc)`` later, on the loop."""

    def start(self) -> None:
        """(Re)connect on the loop; wake-ups flow from now on."""

    @property
    def running(self) -> bool:
        """Started, and neither closed nor reset with its loop since (kombu closes its hub
        before the consumer's steps stop on Celery 5.3's shutdown): calls made meanwhile go
        elsewhere."""

    def close(self) -> None:
        """Drop the connections; every call queued or on its way gets
        :class:`~celery_semaphore.exceptions.LinkClosed`."""


@dataclass(frozen=True)
class HolderInfo:
    holder: str
    slot: int
    epoch: int
    since: float
    expires_at: float
    meta: Meta = field(default_factory=dict)

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.slot, self.epoch)


@dataclass(frozen=True)
class WaiterInfo:
    holder: str
    ticket: int
    since: float
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True)
class QuotaUsage:
    """One quota of a semaphore and its current window (module docs, "Quotas")."""

    count: int
    #: Seconds; 0: a calendar month.
    period: float
    offset: float
    #: The current window, in backend epoch seconds.
    window_start: float
    window_end: float
    #: Units started in the current window (may exceed ``count``: a debt).
    used: int


@dataclass(frozen=True)
class AdaptiveState:
    """An adaptive limit (module docs, "Adaptive limits"): its bounds and learned value; the
    limit in force is ``floor(current)`` unless ``pinned``."""

    min: int
    max: int
    current: float
    pinned: bool


@dataclass(frozen=True)
class SemaphoreStatus:
    """A consistent snapshot of one semaphore, taken in one atomic read."""

    name: str
    limit: int
    declared: Dict[int, float]
    holders: Tuple[HolderInfo, ...]
    waiters: Tuple[WaiterInfo, ...]
    #: Counters and histograms (:mod:`celery_semaphore.stats`); None from a backend that
    #: keeps none.
    stats: Optional[SemaphoreStats] = None
    #: An operator's ``resize`` pinned ``limit``: no declaration changes it until unpinned.
    pinned: bool = False
    #: The limit of the newest declaration (module docs, "Limits"): in force unless pinned;
    #: None when nobody declared one (a semaphore created by ``resize``).
    newest_declared: Optional[int] = None
    #: The semaphore's rate ``(interval seconds, burst)``, None when it has none.
    rate: Optional[Tuple[float, int]] = None
    #: With a rate: the backend time (seconds) from which the next start (of one unit) is
    #: allowed by every rate (in the past: one may start now).
    next_start: Optional[float] = None
    #: The end of the pause in force (backend epoch seconds), None when not paused.
    paused_until: Optional[float] = None
    #: Why it is paused ("" when not, or when no reason was given).
    pause_reason: str = ""
    #: The quotas and their current windows.
    quotas: Tuple[QuotaUsage, ...] = ()
    #: Every rate ``(interval seconds, burst)`` (``rate`` is the first).
    rates: Tuple[Tuple[float, int], ...] = ()
    #: The adaptive limit, None when the limit is not adaptive.
    adaptive: Optional[AdaptiveState] = None

    @property
    def held(self) -> int:
        return len(self.holders)

    @property
    def units(self) -> int:
        """Units of the limit in use: the holders' costs (1 each without costs)."""
        return sum(cost_of(h.meta) for h in self.holders)

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-ready form, as the CLI prints it."""
        return {
            "name": self.name,
            "limit": self.limit,
            "pinned": self.pinned,
            "newest_declared": self.newest_declared,
            "declared": {str(k): v for k, v in sorted(self.declared.items())},
            "held": self.held,
            "units": self.units,
            "waiting": self.waiting,
            "rate": None if self.rate is None else {"interval": self.rate[0],
                                                    "burst": self.rate[1]},
            "next_start": self.next_start,
            "rates": [{"interval": i, "burst": b} for i, b in self.rates],
            "paused_until": self.paused_until,
            "pause_reason": self.pause_reason,
            "quotas": [{"count": q.count, "period": q.period, "offset": q.offset,
                        "window_start": q.window_start, "window_end": q.window_end,
                        "used": q.used} for q in self.quotas],
            "adaptive": None if self.adaptive is None else {
                "min": self.adaptive.min, "max": self.adaptive.max,
                "current": self.adaptive.current, "pinned": self.adaptive.pinned},
            "holders": [
                {
                    "holder": h.holder,
                    "token": str(h.token),
                    "slot": h.slot,
                    "epoch": h.epoch,
                    "since": h.since,
                    "expires_at": h.expires_at,
                    "meta": h.meta,
                }
                for h in self.holders
            ],
            "waiters": [
                {"holder": w.holder, "ticket": w.ticket, "since": w.since, "meta": w.meta,
                 "cost": cost_of(w.meta), "priority": priority_of(w.meta)}
                for w in self.waiters
            ],
            "stats": None if self.stats is None else self.stats.as_dict(),
        }


#: The ``meta`` key whose value is the caller's fair-share key (module docs).
FAIR_KEY = "fair_key"
#: The ``meta`` key whose value is the units of the limit the caller holds (module docs,
#: "Costs"); absent: 1.
COST_KEY = "cost"
#: The ``meta`` key whose value is the caller's priority (higher first; absent: 0).
PRIORITY_KEY = "priority"
#: The ``meta`` key whose value is the rate the caller declares for the semaphore:
#: ``[interval, burst]``, seconds between starts and starts allowed at once (module docs,
#: "Rate").
RATE_KEY = "rate"
#: The ``meta`` key whose value is the caller's fair-share weight (absent: 1).
WEIGHT_KEY = "fair_weight"
#: Priorities are ints in ``[-MAX_PRIORITY, MAX_PRIORITY]`` (the Redis queue keeps them in its
#: scores beside the ticket).
MAX_PRIORITY = 10_000
#: The ``meta`` key whose value is the quotas the caller declares for the semaphore:
#: ``[[count, period, offset], ...]`` (seconds; period 0: a calendar month) (module docs,
#: "Quotas"); an empty list removes the semaphore's quotas.
QUOTA_KEY = "quota"
#: The ``meta`` key whose value is the units of the rates and quotas the caller's start spends,
#: as estimated at admission (module docs, "Units"); absent: 1.
UNITS_KEY = "units"
#: The ``meta`` key whose truthy value queues the caller ahead of every waiter of its priority
#: (module docs, "Front of the queue").
FRONT_KEY = "front"
#: The ``meta`` key whose value makes the semaphore's limit adaptive: ``{"min", "max",
#: "decrease", "increase"}`` (module docs, "Adaptive limits").
ADAPTIVE_KEY = "adaptive"
#: The outcomes :meth:`Backend.release` takes (module docs, "Adaptive limits").
OUTCOMES = ("ok", "overload", "error")
#: The longest pause (seconds, about 31 years): beyond, a time is surely a mistake.
MAX_PAUSE = 1e9
#: The longest quota period (and offset), seconds: 400 days (a year's window fits).
MAX_PERIOD = 400 * 86400.0
#: Defaults of an adaptive limit's factors.
ADAPTIVE_DECREASE = 0.9
ADAPTIVE_INCREASE = 1.0
#: Every traffic option (:attr:`Backend.traffic_options`), and those of a backend that has
#: only costs, rates and orderings.
ALL_TRAFFIC: FrozenSet[str] = frozenset({"cost", "rate", "priority", "fair_weight", "front",
                                         "quota", "units", "adaptive", "pause"})
BASIC_TRAFFIC: FrozenSet[str] = frozenset({"cost", "rate", "priority", "fair_weight", "front"})


def _int_of(meta: Optional[Meta], key: str, default: int) -> int:
    value = (meta or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def cost_of(meta: Optional[Meta]) -> int:
    """The units ``meta`` says its caller holds (at least 1)."""
    return max(1, _int_of(meta, COST_KEY, 1))


def priority_of(meta: Optional[Meta]) -> int:
    """The priority ``meta`` carries (0 when absent)."""
    return _int_of(meta, PRIORITY_KEY, 0)


def weight_of(meta: Optional[Meta]) -> int:
    """The fair-share weight ``meta`` carries (at least 1)."""
    return max(1, _int_of(meta, WEIGHT_KEY, 1))


def _bad(what: str, value: Any, should: str) -> Exception:
    from ..exceptions import ConfigurationError

    return ConfigurationError(f"meta {what!r} must be {should}, not {value!r}")


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def units_of(meta: Optional[Meta]) -> int:
    """The units of the rates and quotas ``meta`` says its caller's start spends (at least
    1)."""
    return max(1, _int_of(meta, UNITS_KEY, 1))


def rates_of(meta: Optional[Meta]) -> Optional[List[Tuple[float, int]]]:
    """``[(interval seconds, burst), ...]`` of the rates ``meta`` declares (one ``[interval,
    burst]`` or a list of them; ``[]``: it declares that there are none), or None when it
    declares none. ConfigurationError when malformed."""
    rates = (meta or {}).get(RATE_KEY)
    if rates is None:
        return None
    if isinstance(rates, (list, tuple)) and len(rates) == 2 and _number(rates[0]):
        rates = [rates]
    should = "[interval, burst] or a list of them (interval > 0, burst an int >= 1)"
    if not isinstance(rates, (list, tuple)):
        raise _bad(RATE_KEY, rates, should)
    out = []
    for rate in rates:
        if not (isinstance(rate, (list, tuple)) and len(rate) == 2 and _number(rate[0])
                and rate[0] > 0 and isinstance(rate[1], int) and not isinstance(rate[1], bool)
                and rate[1] >= 1):
            raise _bad(RATE_KEY, rates, should)
        out.append((float(rate[0]), int(rate[1])))
    return out


def rate_of(meta: Optional[Meta]) -> Optional[Tuple[float, int]]:
    """``(interval seconds, burst)`` of the first rate ``meta`` declares, or None."""
    rates = rates_of(meta)
    return rates[0] if rates else None


def quotas_of(meta: Optional[Meta]) -> Optional[List[Tuple[int, float, float]]]:
    """``[(count, period seconds, offset seconds), ...]`` of the quotas ``meta`` declares
    (``[]``: it declares that there are none), or None when it declares none.
    ConfigurationError when malformed (period 0 is a calendar month, else from 1 ms to
    :data:`MAX_PERIOD`; an offset within ``MAX_PERIOD`` either way)."""
    quotas = (meta or {}).get(QUOTA_KEY)
    if quotas is None:
        return None
    should = (f"a list of [count, period, offset] (count an int >= 1, period 0 or from 0.001 "
              f"to {MAX_PERIOD:g} seconds, an offset of at most {MAX_PERIOD:g} seconds either "
              "way)")
    if not isinstance(quotas, (list, tuple)):
        raise _bad(QUOTA_KEY, quotas, should)
    out = []
    for quota in quotas:
        if not (isinstance(quota, (list, tuple)) and len(quota) == 3
                and isinstance(quota[0], int) and not isinstance(quota[0], bool)
                and quota[0] >= 1 and _number(quota[1]) and _number(quota[2])
                and (quota[1] == 0 or 0.001 <= quota[1] <= MAX_PERIOD)
                and abs(quota[2]) <= MAX_PERIOD):
            raise _bad(QUOTA_KEY, quotas, should)
        out.append((int(quota[0]), float(quota[1]), float(quota[2])))
    return out


def front_of(meta: Optional[Meta]) -> bool:
    """``meta`` queues its caller at the front of its priority (module docs)."""
    return bool((meta or {}).get(FRONT_KEY))


def adaptive_of(meta: Optional[Meta]) -> Optional[Tuple[int, int, float, float]]:
    """``(min, max, decrease, increase)`` of the adaptive limit ``meta`` declares, or None.
    ConfigurationError when malformed."""
    spec = (meta or {}).get(ADAPTIVE_KEY)
    if spec is None:
        return None
    should = ('{"min": int >= 1, "max": int >= min, "decrease": a number in (0, 1), '
              '"increase": a number > 0}')
    if not isinstance(spec, dict) or set(spec) - {"min", "max", "decrease", "increase"}:
        raise _bad(ADAPTIVE_KEY, spec, should)
    low, high = spec.get("min", 1), spec.get("max")
    decrease = spec.get("decrease", ADAPTIVE_DECREASE)
    increase = spec.get("increase", ADAPTIVE_INCREASE)
    if not (isinstance(low, int) and isinstance(high, int) and not isinstance(low, bool)
            and not isinstance(high, bool) and 1 <= low <= high and _number(decrease)
            and 0 < decrease < 1 and _number(increase) and increase > 0):
        raise _bad(ADAPTIVE_KEY, spec, should)
    return low, high, float(decrease), float(increase)


def check_outcome(outcome: Optional[str]) -> None:
    """ConfigurationError unless ``outcome`` is None or one of :data:`OUTCOMES`."""
    if outcome is not None and outcome not in OUTCOMES:
        from ..exceptions import ConfigurationError

        raise ConfigurationError(f"release outcome must be one of {', '.join(OUTCOMES)} or "
                                 f"None, not {outcome!r}")


def check_units(units: Any) -> int:
    """The units a :meth:`Backend.settle` takes: an int >= 0, else ConfigurationError."""
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        from ..exceptions import ConfigurationError

        raise ConfigurationError(f"settled units must be an integer >= 0, not {units!r}")
    return units


def check_pause(seconds: Any) -> float:
    """The seconds a :meth:`Backend.pause` takes: a finite number >= 0, else
    ConfigurationError."""
    if not _number(seconds) or not 0 <= seconds <= MAX_PAUSE:
        from ..exceptions import ConfigurationError

        raise ConfigurationError(f"a pause must last from 0 to {MAX_PAUSE:g} seconds, not "
                                 f"{seconds!r}")
    return float(seconds)


#: Days from 0000-03-01 to 1970-01-01 (the civil calendar's algorithms, as in the Redis scripts).
_EPOCH_DAYS = 719468


def _civil(days: int) -> Tuple[int, int]:
    """(year, month) of the day ``days`` after 1970-01-01 (proleptic Gregorian)."""
    z = days + _EPOCH_DAYS
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (1 if month <= 2 else 0), month


def _days(year: int, month: int) -> int:
    """Days from 1970-01-01 to the first of ``month`` of ``year``."""
    year -= 1 if month <= 2 else 0
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - _EPOCH_DAYS


def window_of(t: float, period: float, offset: float) -> Tuple[float, float]:
    """``(start, end)`` of the quota window holding time ``t`` (seconds; module docs,
    "Quotas"): ``period > 0``: aligned to the UTC epoch shifted by ``offset``; ``period ==
    0``: the calendar month (UTC shifted by ``offset``)."""
    if period > 0:
        start = math.floor((t + offset) / period) * period - offset
        return start, start + period
    year, month = _civil(math.floor((t + offset) / 86400))
    following = (year + 1, 1) if month == 12 else (year, month + 1)
    return (_days(year, month) * 86400.0 - offset,
            _days(*following) * 86400.0 - offset)


def fair_key_of(meta: Optional[Meta]) -> Optional[str]:
    """The fair-share key ``meta`` carries, or None (absent, empty or not a string)."""
    key = (meta or {}).get(FAIR_KEY)
    return key if isinstance(key, str) and key else None


def new_holder_id(task_id: Optional[str] = None) -> str:
    """A random, unguessable holder id; with ``task_id``, ``<task_id>:<random>``, so that the
    backend admits one holder of that task at a time (module docs)."""
    unique = uuid.uuid4().hex
    return f"{task_id}:{unique}" if task_id else unique


#: First and longest pause between two tries of a lost wake-up listener to reconnect: a try
#: costs one connection attempt, and waiters fall back to their poll interval until it is back.
LISTENER_RETRY_FIRST = 0.05
LISTENER_RETRY_MAX = 0.25


def task_of(holder: str) -> Optional[str]:
    """The task a holder id names (:func:`new_holder_id`), or None."""
    return holder.rpartition(":")[0] or None


def _date(value: Any) -> float:
    """``declared_at``: seconds since the epoch, a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < float("inf")):
        from ..exceptions import ConfigurationError

        raise ConfigurationError(f"declared_at must be a time in seconds since the epoch "
                                 f"(a finite number >= 0), not {value!r}")
    return float(value)


def _after_fork(ref: "weakref.ref[Backend]") -> None:
    backend = ref()
    if backend is not None:
        backend._forked()


class Backend(abc.ABC):
    """Base class of semaphore backends. Subclasses implement the abstract operations.

    One instance serves a whole process and is thread-safe. It owns the process's notification
    endpoint (``client_id``); :meth:`watch` routes wake-ups for one waiter to a callback.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "semaphore:",
        waiter_ttl: float = DEFAULT_WAITER_TTL,
        idle_ttl: float = DEFAULT_IDLE_TTL,
        declared_at: Optional[float] = None,
    ) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.waiter_ttl = float(waiter_ttl)
        self.idle_ttl = float(idle_ttl)
        #: The date of this client's limit declarations (module docs, "Limits"): by default
        #: when the process loaded the library, so a process started later (the new code of a
        #: deploy) supersedes the declarations of one started earlier.
        self.declared_at = PROCESS_STARTED if declared_at is None else _date(declared_at)
        self._new_identity()
        if hasattr(os, "register_at_fork"):  # POSIX
            os.register_at_fork(after_in_child=functools.partial(_after_fork, weakref.ref(self)))

    @property
    def max_lease_ttl(self) -> float:
        """The longest lease this backend can keep: a semaphore untouched for ``idle_ttl`` is
        forgotten, and a lease is renewed no later than its end."""
        return self.idle_ttl * 15 / 16

    def _new_identity(self) -> None:
        self.client_id = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._watch_lock = threading.Lock()
        self._watchers: Dict[Tuple[str, str], WakeCallback] = {}
        #: The wake-up listener lost its connection and has not got it back yet.
        self._listener_lost = False
        #: Set to end the listener's pause between two reconnection tries at once (an
        #: operation reached the server: it is back; or the backend closes).
        self._listener_kick = threading.Event()

    def _forked(self) -> None:
        """In a forked child: a wake-up identity of its own, no inherited waiters. Subclasses
        extend it to drop the parent's listener and connections."""
        self._new_identity()

    def pause_after(self, attempt: Union[Attempt, "MultiAttempt"],
                    poll_interval: float) -> float:
        """Seconds a waiter should wait for a wake-up before it tries ``acquire`` again: the
        poll interval, at most a third of ``waiter_ttl`` (each try keeps its place in line),
        and no later than just after the earliest holder's lease can expire."""
        pause = min(poll_interval, self.waiter_ttl / 3)
        due: Optional[float] = getattr(attempt, "due", None)
        if due is None:
            due = getattr(attempt, "rate_due", None)
        if due is not None:
            # Held back by time alone (a rate, a quota window, a pause): nothing but time
            # frees it, so the next try is when the start is due (no wake-up is sent for
            # it), not the poll interval; 0.2 ms after it: a try that reaches the backend
            # early is told to wait again (a round trip lost), and with a burst of 1 each
            # late start delays every later one by as much (a 1 ms margin cost W7 5 % of its
            # rate, 0.2 ms about 1 %).
            return min(due + 0.0002, self.waiter_ttl / 3)
        if attempt.retry_after is not None:
            pause = min(pause, attempt.retry_after + 0.001)
        return pause

    #: Which of :data:`ALL_TRAFFIC` (``"cost"``, ``"rate"``, ``"priority"``,
    #: ``"fair_weight"``, ``"front"``, ``"quota"``, ``"units"``, ``"adaptive"``, and
    #: ``"pause"``: :meth:`pause`, :meth:`resume` and :meth:`settle`) this backend implements
    #: (module docs); :meth:`check_traffic` refuses the others.
    traffic_options: FrozenSet[str] = BASIC_TRAFFIC

    def check_traffic(self, options: Sequence[str], where: str = "") -> None:
        """Raise :class:`~celery_semaphore.exceptions.ConfigurationError` naming this backend
        when it cannot apply one of ``options`` (used by the ``semaphore_*`` option of that
        name, e.g. ``"cost"``) atomically."""
        missing = [o for o in options if o not in self.traffic_options]
        if missing:
            from ..exceptions import ConfigurationError
            from ..urls import mask_url

            raise ConfigurationError(
                f"{where}{', '.join('semaphore_' + m for m in missing)}: the "
                f"{type(self).__name__} backend ({mask_url(self.url)}) cannot apply "
                f"{'it' if len(missing) == 1 else 'them'} atomically; use Redis, PostgreSQL, "
                f"SQLite{', Consul' if BASIC_TRAFFIC.issuperset(missing) else ''} or memory")

    def check_meta(self, meta: Optional[Meta]) -> None:
        """:meth:`check_traffic` for what an acquire's ``meta`` asks for."""
        if not meta:
            return
        used = [o for o, key in (("cost", COST_KEY), ("rate", RATE_KEY),
                                 ("priority", PRIORITY_KEY), ("fair_weight", WEIGHT_KEY),
                                 ("front", FRONT_KEY), ("quota", QUOTA_KEY),
                                 ("units", UNITS_KEY), ("adaptive", ADAPTIVE_KEY))
                if key in meta and not (o in ("cost", "units") and meta[key] == 1)
                and not (o == "front" and not meta[key])]
        if used:
            self.check_traffic(used)

    def _refuse(self, operation: str) -> NoReturn:
        """Raise ConfigurationError naming this backend, which cannot :meth:`pause` (nor
        resume nor settle): ``operation`` names what was asked."""
        if "pause" in self.traffic_options:
            raise NotImplementedError(f"{type(self).__name__}: {operation}")
        from ..exceptions import ConfigurationError
        from ..urls import mask_url

        raise ConfigurationError(
            f"{operation}: the {type(self).__name__} backend ({mask_url(self.url)}) cannot "
            "pause, resume or settle semaphores atomically; use Redis, PostgreSQL, SQLite "
            "or memory")

    def abandon(self, name: str, holder: str) -> None:
        """Leave the waiter queue of ``name`` for good, and release in case a grant was made
        whose reply was lost. Raises what the backend raises."""
        self.cancel(name, holder)
        self.release(name, holder)

    def abandon_all(self, names: Sequence[str], holder: str) -> None:
        """:meth:`abandon` each of ``names`` (a multi-semaphore request leaves for good)."""
        for name in names:
            self.abandon(name, holder)

    #: True where a waiter that asks for it (:attr:`Acquire.push`) is granted by whatever
    #: operation makes it admissible, the grant announced by its wake-up ("Pushed grants" in
    #: the module docs).
    pushes_grants = False

    def perform(self, op: Operation) -> Any:
        """Run one operation (:data:`Operation`) with the method it names."""
        if isinstance(op, Acquire):
            return self.acquire(op.name, op.holder, limit=op.limit, ttl=op.ttl, meta=op.meta,
                                wait=op.wait)
        if isinstance(op, AcquireAll):
            return self.acquire_all(op.requests, op.holder, ttl=op.ttl, meta=op.meta,
                                    wait=op.wait)
        if isinstance(op, Release):
            if op.outcome is None and op.latency is None:
                return self.release(op.name, op.holder)
            return self.release(op.name, op.holder, op.outcome, op.latency)
        if isinstance(op, Renew):
            return self.renew(op.name, op.holder, op.ttl)
        if isinstance(op, Abandon):
            return self.abandon_all(op.names, op.holder)
        if isinstance(op, Pause):
            return self.pause(op.name, op.seconds, op.reason)
        if isinstance(op, Resume):
            return self.resume(op.name)
        if isinstance(op, Settle):
            return self.settle(op.name, op.holder, op.units)
        raise TypeError(f"not a backend operation: {op!r}")

    def perform_all(self, ops: Sequence[Operation]) -> List[Outcome]:
        """Run ``ops`` in order, each one's outcome on its own (one failing does not stop the
        others). This default makes one call after the other; a backend that can sends them
        in one round trip."""
        out: List[Outcome] = []
        for op in ops:
            try:
                out.append((self.perform(op), None))
            except Exception as exc:
                out.append((None, exc))
        return out

    def event_loop_link(self, hub: Any,
                        on_wake: Callable[[str, str, Optional[PushedGrant]], None],
                        on_listening: Callable[[], None]) -> Optional[EventLoopLink]:
        """A link that runs this backend's operations on ``hub`` (kombu's event loop, the
        worker's), or None where this backend has none (the caller then runs them on a thread
        of its own). ``on_wake(name, holder, pushed)``: a wake-up for a waiter of this process
        (``pushed``: the grant it announces, or None); ``on_listening()``: the wake-up channel
        is (again) subscribed, after it was lost: what was published meanwhile is lost."""
        return None

    #: True where :meth:`acquire_all` grants every semaphore in one atomic step (an override);
    #: False: the generic protocol below.
    atomic_acquire_all = False

    def acquire_all(self, requests: Requests, holder: str, *, ttl: float, meta: Meta,
                    wait: bool) -> MultiAttempt:
        """Admit ``holder`` to every semaphore of ``requests`` together, or to none.

        Rule (every backend): the caller is admitted when the FIFO rule admits it in each
        semaphore; then it holds all of them, under the one holder id. Otherwise it holds none
        of them and, with ``wait``, waits in the queue of the semaphore that refused it
        (``blocking``), and in no other queue: a request blocked by one semaphore never keeps
        another semaphore's queue or slot from the requests behind it. Each try of a waiter
        places it in the queue of the semaphore that blocks it then; woken there, it tries the
        whole set again. Repeating the call once admitted returns the same grants.

        This default works on any backend with the single-semaphore operations: it tries the
        semaphores one by one in sorted name order (every caller in the same order) and gives
        back what it took as soon as one refuses, so it holds slots only for the round trips
        of one try, never while it waits: no deadlock whatever order tasks list their
        semaphores in, and never over any limit (each grant is an ordinary one). Its limits:
        during those round trips another request can find a semaphore full and queue (it is
        woken by the give-back); and a request waits in the first refusing semaphore in sorted
        order, not necessarily the listed one. Backends that can decide over several
        semaphores in one atomic step override it (``atomic_acquire_all``).
        """
        requests = list(requests)
        order = sorted(requests)
        grants: Dict[str, Grant] = {}
        limits: Dict[str, int] = {}
        refused: Optional[Tuple[str, Attempt]] = None
        try:
            for name, limit in order:
                attempt = self.acquire(name, holder, limit=limit, ttl=ttl, meta=meta, wait=wait)
                if attempt.grant is None:
                    refused = (name, attempt)
                    break
                grants[name] = attempt.grant
                limits[name] = attempt.limit if attempt.limit is not None else limit
        except BaseException:
            self._give_back(grants, holder)
            raise
        if refused is None:
            return MultiAttempt({name: grants[name] for name, _ in requests}, limits=limits)
        self._give_back(grants, holder)
        blocking, attempt = refused
        later = [name for name, _ in order[[n for n, _ in order].index(blocking) + 1:]]
        for name in later:  # queued there by an earlier try, maybe: not any more
            self.cancel(name, holder)
        return MultiAttempt(None, blocking, attempt.position, attempt.retry_after,
                            attempt.limit, rate_due=attempt.rate_due,
                            waits_for=attempt.waits_for, due=attempt.due)

    def _give_back(self, grants: Mapping[str, Grant], holder: str) -> None:
        for name in grants:
            self.release(name, holder)

    # -- operations every backend implements ---------------------------------------------

    @abc.abstractmethod
    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        """Admit ``holder`` if the FIFO rule allows, else (``wait``) queue or refresh it.

        ``limit`` is the caller's declared limit, dated :attr:`declared_at`: it creates the
        semaphore when new, is recorded among the declared limits, and is in force from this
        call on when it is the newest declaration and the limit is not pinned (module docs,
        "Limits"). A holder that already holds gets its existing grant back unchanged.
        """

    @abc.abstractmethod
    def release(self, name: str, holder: str, outcome: Optional[str] = None,
                latency: Optional[float] = None) -> bool:
        """Free the holder's slot. False when it was not held (expired, released, reset).

        ``outcome`` (one of :data:`OUTCOMES`, or None) is the outcome of the holder's call:
        it moves an adaptive limit, in the same atomic step (module docs, "Adaptive
        limits"); ``latency`` (seconds) is accepted for a later rule and ignored for now.
        Backends without adaptive limits ignore both.
        """

    # -- pauses and settling (backends with "pause" in traffic_options) ----------------------

    def pause(self, name: str, seconds: float, reason: str = "") -> float:
        """Close ``name`` until the backend's now + ``seconds`` (>= 0), unless a pause in force
        ends later (pauses only extend), creating the semaphore if needed; returns the end of
        the pause in force (backend epoch seconds). Module docs, "Pauses". ConfigurationError
        on a backend that cannot."""
        self._refuse(f"pause {name!r}")

    def resume(self, name: str) -> bool:
        """End the pause of ``name`` now; True when one was in force. Wakes (or pushes grants
        to) the waiters admissible then. ConfigurationError on a backend that cannot."""
        self._refuse(f"resume {name!r}")

    def settle(self, name: str, holder: str, units: int) -> bool:
        """``holder`` actually spent ``units`` (an int >= 0) of the rates and quotas of
        ``name`` (module docs, "Settling"); False, changing nothing, when it does not hold.
        ConfigurationError on a backend that cannot."""
        self._refuse(f"settle {name!r}")

    @abc.abstractmethod
    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        """Extend a live lease to ``now + ttl``; return the new expiry, or None if not held.

        Never re-acquires: an expired or released lease stays gone.
        """

    @abc.abstractmethod
    def verify(self, name: str, holder: str) -> bool:
        """True while the holder holds an unexpired lease."""

    @abc.abstractmethod
    def cancel(self, name: str, holder: str) -> None:
        """Leave the waiter queue (no-op when not queued)."""

    @abc.abstractmethod
    def resize(self, name: str, limit: int) -> bool:
        """Set the limit and pin it (no declaration changes it until :meth:`unpin`), creating
        the semaphore if needed. True when it was created.

        Growing wakes waiters at once; shrinking admits nobody until holders drop below it.
        """

    @abc.abstractmethod
    def unpin(self, name: str) -> Optional[int]:
        """Release a pin set by :meth:`resize`: the newest declared limit is in force again
        at once (the limit stays as it is when nobody declared one). Returns the limit in
        force, or None when the semaphore is unknown. Wakes waiters a growth admits."""

    @abc.abstractmethod
    def status(self, name: str) -> Optional[SemaphoreStatus]:
        """A snapshot of the semaphore, or None when the backend does not know it."""

    def waiting_count(self, name: str) -> int:
        """How many requests wait in the semaphore's queue (0 when it is unknown): a hint,
        read on every parked-or-not decision of a sender (:mod:`celery_semaphore.
        waiting_room`), so backends make it one cheap read where they can. It may count a
        waiter whose expiry has passed but was not pruned yet. Default: :meth:`status`."""
        status = self.status(name)
        return 0 if status is None else status.waiting

    @abc.abstractmethod
    def names(self) -> List[str]:
        """Names of every semaphore the backend currently knows, sorted."""

    @abc.abstractmethod
    def reset(self, name: str) -> bool:
        """Delete all state of the semaphore (holders lose their leases). False if unknown.

        Fencing epochs survive where the backend can keep them, so tokens still increase.
        """

    def count(self, name: str, counts: Mapping[str, int]) -> None:  # noqa: B027 - optional
        """Add worker-side counts (:data:`celery_semaphore.stats.WORKER_COUNTERS`) to the
        counters of ``name``, in one atomic step; nothing when the semaphore is unknown (its
        counters went with its state). Default: this backend keeps no counters."""

    def statuses(self, names: Sequence[str]) -> Dict[str, SemaphoreStatus]:
        """:meth:`status` of each name the backend knows (unknown names are left out); backends
        override it with one round trip for many names where they can."""
        found = {}
        for name in names:
            status = self.status(name)
            if status is not None:
                found[name] = status
        return found

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and stop the notification listener."""

    def ping(self) -> None:
        """Raise BackendUnavailable unless the backend answers."""
        self.names()

    # -- notifications -------------------------------------------------------------------

    def watch(self, name: str, holder: str, callback: WakeCallback) -> None:
        """Call ``callback`` (from any thread) when the waiter may have become admissible."""
        with self._watch_lock:
            self._watchers[(name, holder)] = callback
            first = len(self._watchers) == 1
        if first:
            self._start_listening()

    def unwatch(self, name: str, holder: str) -> None:
        with self._watch_lock:
            self._watchers.pop((name, holder), None)

    def _notify(self, name: str, holder: str) -> None:
        """Deliver a wake-up received by this process to the waiter's callback, if any."""
        with self._watch_lock:
            callback = self._watchers.get((name, holder))
        if callback is not None:
            callback()

    def _start_listening(self) -> None:  # noqa: B027 - optional hook
        """Start receiving this process's wake-ups (idempotent). Default: nothing to start."""

    # -- the wake-up listener's reconnection (for backends that have one) --------------------

    def _wake_everyone(self) -> None:
        """Call every watcher's callback once: the listener is back, and what was sent to it
        while it was away is lost (each waiter tries again; one that cannot go on waits)."""
        with self._watch_lock:
            callbacks = list(self._watchers.values())
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a broken callback must not stop everyone's wake-ups
                logger.exception("celery-semaphore: wake-up callback failed")

    def _listener_went(self) -> None:
        """The listener lost its connection (listener thread)."""
        self._listener_lost = True

    def _listener_back(self) -> None:
        """The listener got its connection back after losing it (listener thread): wake every
        waiter once."""
        self._listener_lost = False
        self._listener_kick.clear()
        self._wake_everyone()

    def _server_answered(self) -> None:
        """An operation just reached the server: a lost listener tries again at once instead
        of at the end of its pause (any thread; cheap when the listener is up)."""
        if self._listener_lost:
            self._listener_kick.set()

    def _listener_pause(self, backoff: float) -> float:
        """Wait before the listener's next reconnection try: ``backoff`` seconds, ended early by
        :meth:`_server_answered` or a close; returns the next backoff (doubling up to
        :data:`LISTENER_RETRY_MAX`, so the listener is back within that long of the server)."""
        started = time.monotonic()
        self._listener_kick.wait(backoff)
        self._listener_kick.clear()
        rest = LISTENER_RETRY_FIRST - (time.monotonic() - started)
        if rest > 0:  # at most one try per LISTENER_RETRY_FIRST, however often it is kicked
            time.sleep(rest)
        return min(backoff * 2, LISTENER_RETRY_MAX)

    def __repr__(self) -> str:
        from ..urls import mask_url

        return f"<{type(self).__name__} {mask_url(self.url)}>"
