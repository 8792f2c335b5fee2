"""The semaphore's rules as plain Python over one semaphore's state.

The backends that store each semaphore's state as one document (memory, SQLite, RabbitMQ,
Consul) apply these rules through :mod:`.engine`; the Redis backend's Lua scripts implement the
same rules, and the contract test suite holds every backend to them. See :mod:`.base` for the
rules in prose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..stats import FIRST_WAIT_META, WORKER_COUNTERS, SemaphoreStats, observe
from .base import (
    Attempt,
    Grant,
    HolderInfo,
    Meta,
    MultiAttempt,
    SemaphoreStatus,
    WaiterInfo,
    fair_key_of,
    task_of,
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
        )

    # -- queries -------------------------------------------------------------------------

    def queue(self) -> List[str]:
        """The waiters in admission order: by ticket, or by (round, ticket) while the
        semaphore is fair."""
        if self.fair():
            return sorted(self.waiters, key=lambda h: (self.waiters[h].round,
                                                       self.waiters[h].ticket))
        return sorted(self.waiters, key=lambda h: self.waiters[h].ticket)

    def fair(self) -> bool:
        """A waiter queued with a fair-share round waits."""
        return any(w.round for w in self.waiters.values())

    def next_round(self, key: Optional[str]) -> int:
        """The round a waiter of fair key ``key`` that queues now gets."""
        return 1 + max([self.round] + [w.round for w in self.waiters.values()
                                       if w.round and fair_key_of(w.meta) == key])

    def wakeups(self, before: Set[Tuple[str, str]]) -> Set[Tuple[str, str]]:
        """Waiters that became admissible since ``before`` (:meth:`admissible` then)."""
        return self.admissible() - before

    def admissible(self) -> Set[Tuple[str, str]]:
        """(client, holder) of the waiters the FIFO rule would admit now."""
        free = self.limit - len(self.holders)
        held = self.held_tasks()
        return {(self.waiters[h].client, h) for h in self.queue()[: max(free, 0)]
                if task_of(h) not in held}

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
        self.declared[declared] = now
        current = self.holders.get(holder)
        if current is not None:
            return Attempt(current.grant(now), limit=self.limit)
        rank, round_, slot = self.place(holder, meta, slots)
        if slot is not None:
            return Attempt(self.grant(holder, slot, round_, ttl, meta, now), limit=self.limit)
        position = self.queue_up(holder, rank, round_, meta, client, now, waiter_ttl) \
            if wait else None
        return Attempt(None, position, self.earliest_expiry(now), self.limit)

    def place(self, holder: str, meta: Meta, slots: Optional[Iterable[int]] = None
              ) -> Tuple[int, int, Optional[int]]:
        """``(rank, round, slot)`` of a caller that does not hold: its place in the queue (as
        it is, or as it would queue), its fair-share round, and the slot the FIFO rule would
        give it now (None: not admissible). Changes nothing."""
        waiter = self.waiters.get(holder)
        if waiter is not None:
            rank, round_ = self.queue().index(holder), waiter.round
        elif fair_key_of(meta) is not None or self.fair():
            round_ = self.next_round(fair_key_of(meta))
            rank = sum(1 for w in self.waiters.values() if w.round <= round_)
        else:
            rank, round_ = len(self.waiters), 0
        used = {h.slot for h in self.holders.values()}
        if slots is None:  # the lowest free slot: one of the first len(used) + 1 is free
            lowest = next(s for s in range(len(used) + 1) if s not in used)
            free = [lowest] if lowest < self.limit else []
        else:
            free = [s for s in sorted(slots) if 0 <= s < self.limit and s not in used]
        if len(self.holders) + rank < self.limit and free and not self.twin_holds(holder):
            return rank, round_, free[0]
        return rank, round_, None

    def grant(self, holder: str, slot: int, round_: int, ttl: float, meta: Meta,
              now: float) -> Grant:
        """Give ``holder`` ``slot`` (as :meth:`place` found it), leaving the queue."""
        epoch = next_epoch(self.epochs.get(slot, 0), now)
        self.epochs[slot] = epoch
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

    def add_counts(self, counts: Dict[str, int]) -> None:
        """Add worker-side counts (:data:`.stats.WORKER_COUNTERS` only)."""
        for counter, n in counts.items():
            if counter in WORKER_COUNTERS and n > 0:
                self.count(counter, int(n))

    def status(self, name: str) -> SemaphoreStatus:
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
    for name, limit in requests:
        states[name].declared[limit] = now
    limits = {name: states[name].limit for name, _ in requests}
    current = {name: states[name].holders.get(holder) for name, _ in requests}
    if all(h is not None for h in current.values()):
        return MultiAttempt({name: h.grant(now) for name, h in current.items()},
                            limits=limits)
    places = {name: states[name].place(holder, meta)
              for name, _ in requests if current[name] is None}
    refused = [name for name, (_, _, slot) in places.items() if slot is None]
    if not refused:
        grants = {}
        for name, _ in requests:
            held = current[name]
            if held is not None:
                grants[name] = held.grant(now)
            else:
                _, round_, slot = places[name]
                grants[name] = states[name].grant(holder, slot, round_, ttl, meta, now)
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
        rank, round_, _ = places[blocking]
        position = states[blocking].queue_up(holder, rank, round_, meta, client, now,
                                             waiter_ttl)
    state = states[blocking]
    return MultiAttempt(None, blocking, position, state.earliest_expiry(now), state.limit)


def as_json(meta: Optional[Meta]) -> Dict[str, Any]:
    """Copy ``meta``, refusing what JSON cannot hold (fails before anything changes)."""
    meta = dict(meta or {})
    json.dumps(meta)
    return meta
