"""The semaphore's rules as plain Python over one semaphore's state.

The backends that store each semaphore's state as one document (memory, SQLite, RabbitMQ,
Consul) apply these rules through :mod:`.engine`; the Redis backend's Lua scripts implement the
same rules, and the contract test suite holds every backend to them. See :mod:`.base` for the
rules in prose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from ..exceptions import ConfigurationError
from ..stats import FIRST_WAIT_META, WORKER_COUNTERS, SemaphoreStats, observe
from .base import (
    EMPTY_TTL,
    Attempt,
    Grant,
    HolderInfo,
    Meta,
    MultiAttempt,
    SemaphoreStatus,
    WaiterInfo,
    cost_of,
    fair_key_of,
    priority_of,
    rate_of,
    task_of,
    weight_of,
)


def effective_limit(stored: int, declared: Optional[int], pinned: bool) -> int:
    """The limit in force: the newest declaration's (``declared``: the limit the most recently
    started process declared; None: nobody declared one yet), unless an operator pinned the
    ``stored`` limit (``resize``). Limits follow the code: see :mod:`.base`, "Limits"."""
    return stored if pinned or declared is None else declared


def next_epoch(previous: int, now: float) -> int:
    """Strictly above ``previous``, and above any epoch issued before ``now`` (microseconds).

    The time floor keeps epochs increasing even after an idle semaphore's state expired or an
    operator reset it, as long as the server's clock does not step back.
    """
    return max(previous + 1, int(now * 1_000_000))


class Place(NamedTuple):
    """Where a caller that does not hold stands (:meth:`State.place`)."""

    #: Its 0-based place in the queue order (as queued, or as it would queue).
    rank: int
    #: Its fair-share round (0: none).
    round: int
    #: The slot the rule would give it now; None: not admissible.
    slot: Optional[int]
    #: Seconds until the rate lets it start, when the rate alone holds it back.
    rate_due: Optional[float] = None
    #: What it waits for (:attr:`.base.Attempt.waits_for`); None when admissible.
    waits_for: Optional[str] = None


@dataclass
class Holder:
    slot: int
    epoch: int
    since: float
    expires: float
    meta: Meta = field(default_factory=dict)

    def grant(self, now: float) -> Grant:
        """This holder's grant as it stands (a repeated acquire gets it back unchanged)."""
        return Grant(self.slot, self.epoch, self.expires, self.expires - now)


@dataclass
class Waiter:
    ticket: int
    since: float
    expires: float
    client: str
    meta: Meta = field(default_factory=dict)
    #: Its fair-share round (:mod:`.base`, "Fair shares"); 0: queued while not fair.
    round: int = 0


@dataclass
class State:
    limit: int
    declared: Dict[int, float] = field(default_factory=dict)
    holders: Dict[str, Holder] = field(default_factory=dict)
    waiters: Dict[str, Waiter] = field(default_factory=dict)
    epochs: Dict[int, int] = field(default_factory=dict)
    next_ticket: int = 1
    #: The highest fair-share round admitted so far.
    round: int = 0
    #: Counters and histograms in the storage form of :mod:`celery_semaphore.stats`, updated
    #: by the rules below in the same step as what they count.
    stats: Dict[str, int] = field(default_factory=dict)
    #: An operator's ``resize`` pinned ``limit``: declarations do not change it until unpinned.
    pinned: bool = False
    #: The newest declaration (:meth:`declare`): its limit (None: none yet) and the start time
    #: of the process that made it.
    wanted: Optional[int] = None
    stamp: float = 0.0
    #: The rate (:mod:`.base`, "Rate"): ``[interval, burst]``, None: no rate; and its
    #: theoretical arrival time (storage clock, seconds).
    rate: Optional[List[float]] = None
    tat: float = 0.0

    # -- (de)serialization, for backends that store the state as one document ---------------

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready document. Field by field, not dataclasses.asdict: asdict deep-copies
        every meta dict, and dumping the state was a tenth of a busy semaphore's client CPU."""
        return {
            "limit": self.limit,
            "declared": self.declared,
            "holders": {holder: vars(entry) for holder, entry in self.holders.items()},
            "waiters": {holder: vars(entry) for holder, entry in self.waiters.items()},
            "epochs": self.epochs,
            "next_ticket": self.next_ticket,
            "round": self.round,
            "stats": self.stats,
            "pinned": self.pinned,
            "wanted": self.wanted,
            "stamp": self.stamp,
            "rate": self.rate,
            "tat": self.tat,
        }

    @classmethod
    def loads(cls, text: str) -> "State":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "State":
        """From :meth:`dumps`'s document, already parsed. A document stored before limits
        followed the code (no ``stamp``) keeps its limit pinned when no caller declared it
        (an operator resized it): an upgrade undoes no resize."""
        declared = {int(k): v for k, v in raw["declared"].items()}
        legacy = "stamp" not in raw
        return cls(
            limit=raw["limit"],
            declared=declared,
            holders={k: Holder(**v) for k, v in raw["holders"].items()},
            waiters={k: Waiter(**v) for k, v in raw["waiters"].items()},
            epochs={int(k): v for k, v in raw["epochs"].items()},
            next_ticket=raw["next_ticket"],
            round=raw.get("round", 0),
            stats=dict(raw.get("stats") or {}),  # absent in documents stored before counters
            pinned=raw["limit"] not in declared if legacy else raw["pinned"],
            wanted=raw.get("wanted"),
            stamp=raw.get("stamp", 0.0),
            rate=raw.get("rate"),  # absent in documents stored before rates
            tat=raw.get("tat", 0.0),
        )

    # -- queries -------------------------------------------------------------------------

    def queue(self) -> List[str]:
        """The waiters in admission order: by (-priority, ticket), or by (-priority, round,
        ticket) while the semaphore is fair."""
        waiters = self.waiters
        if self.fair():
            return sorted(waiters, key=lambda h: (-priority_of(waiters[h].meta),
                                                  waiters[h].round, waiters[h].ticket))
        return sorted(waiters, key=lambda h: (-priority_of(waiters[h].meta), waiters[h].ticket))

    def units(self) -> int:
        """Units of the limit the holders hold (their costs)."""
        return sum(cost_of(h.meta) for h in self.holders.values())

    def costly(self) -> bool:
        """A holder or waiter holds or needs more than one unit."""
        return (any(cost_of(h.meta) > 1 for h in self.holders.values())
                or any(cost_of(w.meta) > 1 for w in self.waiters.values()))

    def rate_wait(self, now: float, ahead: int = 0) -> float:
        """Seconds until the rate allows the start of a caller with ``ahead`` waiters before
        it (0: now; always 0 without a rate)."""
        if self.rate is None:
            return 0.0
        interval, burst = self.rate
        return max(0.0, self.tat + (ahead - (burst - 1)) * interval - now)

    def fair(self) -> bool:
        """A waiter queued with a fair-share round waits."""
        return any(w.round for w in self.waiters.values())

    def next_round(self, key: Optional[str], weight: int = 1) -> int:
        """The round a waiter of fair key ``key`` and fair weight ``weight`` that queues now
        gets (:mod:`.base`, "Weights")."""
        rounds = [w.round for w in self.waiters.values()
                  if w.round and fair_key_of(w.meta) == key]
        last = max(rounds, default=0)
        if weight > 1 and last > self.round and rounds.count(last) < weight:
            return last
        return 1 + max(self.round, last)

    def wakeups(self, before: Set[Tuple[str, str]], now: Optional[float] = None
                ) -> Set[Tuple[str, str]]:
        """Waiters that became admissible since ``before`` (:meth:`admissible` then)."""
        return self.admissible(now) - before

    def admissible(self, now: Optional[float] = None) -> Set[Tuple[str, str]]:
        """(client, holder) of the waiters the FIFO rule would admit now: the longest prefix
        of the queue whose costs fit in the free units (but those whose task another holder
        holds); none while the rate allows no start at ``now`` (given: with a rate, a waiter
        is told when to try, not woken)."""
        free = self.limit - self.units()
        if free <= 0 or (now is not None and self.rate_wait(now) > 0):
            return set()
        held = self.held_tasks()
        out = set()
        for h in self.queue():
            free -= cost_of(self.waiters[h].meta)
            if free < 0:
                break
            if task_of(h) not in held:
                out.add((self.waiters[h].client, h))
        return out

    def held_tasks(self) -> Set[str]:
        """The tasks (:func:`.base.task_of`) that have a holder."""
        return {task for task in map(task_of, self.holders) if task is not None}

    def twin_holds(self, holder: str) -> bool:
        """Another holder of ``holder``'s task holds: ``holder`` may not be admitted yet."""
        task = task_of(holder)
        return task is not None and holder not in self.holders and task in self.held_tasks()

    def earliest_expiry(self, now: float) -> Optional[float]:
        if not self.holders:
            return None
        return max(0.0, min(h.expires for h in self.holders.values()) - now)

    # -- operations ----------------------------------------------------------------------

    def declare(self, limit: int, stamp: float, now: float) -> None:
        """A caller declares ``limit``; its process started at ``stamp`` (seconds, clamped to
        ``now``: a client clock ahead cannot date a declaration in the future). The newest
        declaration (the latest stamp; between equal stamps, the latest call) becomes the
        limit in force unless it is pinned (:func:`effective_limit`)."""
        self.declared[limit] = now
        stamp = min(stamp, now)
        if self.wanted is None or stamp >= self.stamp:
            self.wanted, self.stamp = limit, stamp
        self.limit = effective_limit(self.limit, self.wanted, self.pinned)

    def pin(self, limit: int) -> None:
        """An operator's ``resize``: ``limit`` is in force until :meth:`unpin`."""
        self.limit, self.pinned = limit, True

    def unpin(self) -> None:
        """Release the pin: the newest declaration (if any) is in force again."""
        self.pinned = False
        self.limit = effective_limit(self.limit, self.wanted, self.pinned)

    def count(self, counter: str, n: int = 1) -> None:
        self.stats[counter] = self.stats.get(counter, 0) + n

    def keep_for(self, now: float, idle_ttl: float) -> float:
        """Seconds to keep this state after a write at ``now``: ``idle_ttl`` while anyone
        holds or waits or an operator pinned the limit; else :data:`.base.EMPTY_TTL`, or
        until the rate's next start is due if that is later, never above ``idle_ttl``."""
        if self.holders or self.waiters or self.pinned:
            return idle_ttl
        return min(idle_ttl, max(EMPTY_TTL, self.tat - now + 1.0))

    def prune(self, now: float, idle_ttl: float) -> None:
        for holder in [h for h, v in self.holders.items() if v.expires <= now]:
            del self.holders[holder]
            self.count("expired")  # a lease reclaimed by its TTL
        for holder in [h for h, v in self.waiters.items() if v.expires <= now]:
            del self.waiters[holder]
        for limit in [k for k, seen in self.declared.items() if seen < now - idle_ttl]:
            del self.declared[limit]

    def acquire(
        self,
        holder: str,
        *,
        declared: int,
        ttl: float,
        meta: Meta,
        wait: bool,
        client: str,
        now: float,
        waiter_ttl: float,
        slots: Optional[Iterable[int]] = None,
    ) -> Attempt:
        """Apply the FIFO rule; ``slots`` (default: any) are the slots the caller can take."""
        self.check_cost(meta)
        self.declared[declared] = now
        self.declare_rate(meta)
        current = self.holders.get(holder)
        if current is not None:
            return Attempt(current.grant(now), limit=self.limit)
        spot = self.place(holder, meta, slots, now)
        if spot.slot is not None:
            return Attempt(self.grant(holder, spot.slot, spot.round, ttl, meta, now),
                           limit=self.limit)
        position = self.queue_up(holder, spot.rank, spot.round, meta, client, now, waiter_ttl) \
            if wait else None
        return Attempt(None, position, self.earliest_expiry(now), self.limit, spot.rate_due,
                       spot.waits_for)

    def check_cost(self, meta: Meta) -> None:
        """Refuse, before anything changes, a cost the stored limit could never admit."""
        if cost_of(meta) > self.limit:
            raise ConfigurationError(f"cost {cost_of(meta)} is above the semaphore's limit "
                                     f"({self.limit}): it could never be admitted")

    def declare_rate(self, meta: Meta) -> None:
        """A call that declares a rate sets the semaphore's (:mod:`.base`, "Rate")."""
        rate = rate_of(meta)
        if rate is not None and list(rate) != self.rate:
            self.rate = list(rate)

    def place(self, holder: str, meta: Meta, slots: Optional[Iterable[int]] = None,
              now: Optional[float] = None) -> Place:
        """Where a caller that does not hold stands (:class:`Place`): its place in the
        queue, its fair-share round, and the slot the rule (:mod:`.base`: priorities, fair
        rounds, costs, rate, one holder per task) would give it now at ``now`` (None: no
        rate check). Changes nothing."""
        waiter = self.waiters.get(holder)
        priority = priority_of(meta)
        if waiter is not None:
            order = self.queue()
            rank, round_ = order.index(holder), waiter.round
            ahead = order[:rank]
        else:
            if fair_key_of(meta) is not None or self.fair():
                round_ = self.next_round(fair_key_of(meta), weight_of(meta))
            else:
                round_ = 0
            ahead = [h for h, w in self.waiters.items()
                     if priority_of(w.meta) > priority
                     or (priority_of(w.meta) == priority and w.round <= round_)]
            rank = len(ahead)
        cost = cost_of(meta)
        units = self.units()
        need = units + cost + sum(cost_of(self.waiters[h].meta) for h in ahead)
        used = {h.slot for h in self.holders.values()}
        if slots is None:  # the lowest free slot: one of the first len(used) + 1 is free
            lowest = next(s for s in range(len(used) + 1) if s not in used)
            free = [lowest] if lowest < self.limit else []
        else:
            free = [s for s in sorted(slots) if 0 <= s < self.limit and s not in used]
        twin = self.twin_holds(holder)
        fits = need <= self.limit
        rate_due = self.rate_wait(now, rank) if now is not None else 0.0
        if fits and free and not twin and rate_due <= 0:
            return Place(rank, round_, free[0])
        if fits and not twin and rate_due > 0:
            return Place(rank, round_, None, rate_due, "rate")
        return Place(rank, round_, None, None,
                     "units" if cost > 1 or need - units - cost > rank or units > len(used)
                     else "slots")

    def grant(self, holder: str, slot: int, round_: int, ttl: float, meta: Meta,
              now: float) -> Grant:
        """Give ``holder`` ``slot`` (as :meth:`place` found it), leaving the queue."""
        epoch = next_epoch(self.epochs.get(slot, 0), now)
        self.epochs[slot] = epoch
        if self.rate is not None:  # a start: the rate's next one is an interval later
            self.tat = max(self.tat, now) + self.rate[0]
        self.holders[holder] = Holder(slot, epoch, now, now + ttl, meta)
        queued = self.waiters.pop(holder, None)
        self.round = max(self.round, round_)
        self.count("acquired")
        first_wait = meta.get(FIRST_WAIT_META)
        since = (first_wait if isinstance(first_wait, (int, float))
                 else queued.since if queued is not None else now)
        observe(self.stats, "wait", now - since)
        return Grant(slot, epoch, now + ttl, ttl)

    def queue_up(self, holder: str, rank: int, round_: int, meta: Meta, client: str,
                 now: float, waiter_ttl: float) -> int:
        """Queue ``holder`` at its place (as :meth:`place` found it), or refresh its entry;
        its position."""
        waiter = self.waiters.get(holder)
        if waiter is None:
            self.waiters[holder] = Waiter(self.next_ticket, now, now + waiter_ttl, client,
                                          meta, round_)
            self.next_ticket += 1
        else:
            waiter.expires = now + waiter_ttl
        return rank

    def release(self, holder: str, now: Optional[float] = None) -> bool:
        """Free ``holder``'s slot; with ``now``, observe its hold time."""
        gone = self.holders.pop(holder, None)
        if gone is not None and now is not None:
            observe(self.stats, "hold", now - gone.since)
        return gone is not None

    def renew(self, holder: str, ttl: float, now: float) -> Optional[float]:
        current = self.holders.get(holder)
        if current is None:
            self.count("lost")  # a renewal that finds its lease gone
            return None
        current.expires = now + ttl
        return current.expires

    def cancel(self, holder: str) -> None:
        self.waiters.pop(holder, None)

    def add_counts(self, counts: Mapping[str, int]) -> None:
        """Add worker-side counts (:data:`.stats.WORKER_COUNTERS` only)."""
        for counter, n in counts.items():
            if counter in WORKER_COUNTERS and n > 0:
                self.count(counter, int(n))

    def status(self, name: str, now: Optional[float] = None) -> SemaphoreStatus:
        holders = sorted(self.holders.items(), key=lambda kv: kv[1].slot)
        return SemaphoreStatus(
            name=name,
            limit=self.limit,
            declared=dict(self.declared),
            holders=tuple(
                HolderInfo(h, v.slot, v.epoch, v.since, v.expires, v.meta) for h, v in holders
            ),
            waiters=tuple(
                WaiterInfo(h, self.waiters[h].ticket, self.waiters[h].since, self.waiters[h].meta)
                for h in self.queue()
            ),
            stats=SemaphoreStats.from_fields(self.stats),
            pinned=self.pinned,
            newest_declared=self.wanted,
            rate=None if self.rate is None else (float(self.rate[0]), int(self.rate[1])),
            next_start=None if self.rate is None else
            max(self.tat, now or 0.0) - (self.rate[1] - 1) * self.rate[0],
        )


def acquire_all(
    states: Dict[str, State],
    requests: Sequence[Tuple[str, int]],
    holder: str,
    *,
    ttl: float,
    meta: Meta,
    wait: bool,
    client: str,
    now: float,
    waiter_ttl: float,
) -> MultiAttempt:
    """The multi-semaphore rule (:meth:`.base.Backend.acquire_all`) over the states of every
    requested semaphore, applied in one atomic step: all granted together, or none held and,
    with ``wait``, queued in the first listed semaphore that refuses (and out of the others'
    queues). A semaphore held on its own (a lease of the set that outlived the others' give
    back, say) is given back when the set is refused: a waiting request holds no slot."""
    for name, _ in requests:
        states[name].check_cost(meta)
    for name, limit in requests:
        states[name].declared[limit] = now
        states[name].declare_rate(meta)
    limits = {name: states[name].limit for name, _ in requests}
    current = {name: states[name].holders.get(holder) for name, _ in requests}
    held_all = {name: h for name, h in current.items() if h is not None}
    if len(held_all) == len(current):
        return MultiAttempt({name: h.grant(now) for name, h in held_all.items()},
                            limits=limits)
    places = {name: states[name].place(holder, meta, None, now)
              for name, _ in requests if current[name] is None}
    refused = [name for name, spot in places.items() if spot.slot is None]
    if not refused:
        grants = {}
        for name, _ in requests:
            held = current[name]
            if held is not None:
                grants[name] = held.grant(now)
            else:
                spot = places[name]
                assert spot.slot is not None  # none refused
                grants[name] = states[name].grant(holder, spot.slot, spot.round, ttl, meta,
                                                  now)
        return MultiAttempt(grants, limits=limits)
    blocking = refused[0]
    for name, _ in requests:
        if current[name] is not None:
            states[name].release(holder, now)
    position = None
    if wait:
        for name, _ in requests:
            if name != blocking:
                states[name].cancel(holder)
        spot = places[blocking]
        position = states[blocking].queue_up(holder, spot.rank, spot.round, meta, client, now,
                                             waiter_ttl)
    state = states[blocking]
    return MultiAttempt(None, blocking, position, state.earliest_expiry(now), state.limit,
                        rate_due=places[blocking].rate_due,
                        waits_for=places[blocking].waits_for)


def as_json(meta: Optional[Meta]) -> Dict[str, Any]:
    """Copy ``meta``, refusing what JSON cannot hold (fails before anything changes)."""
    meta = dict(meta or {})
    json.dumps(meta)
    return meta
