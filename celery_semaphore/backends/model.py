"""The semaphore's rules as plain Python over one semaphore's state.

The backends that store each semaphore's state as one document (memory, SQLite, RabbitMQ,
Consul) apply these rules through :mod:`.engine`; the Redis backend's Lua scripts implement the
same rules, and the contract test suite holds every backend to them. See :mod:`.base` for the
rules in prose.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from ..exceptions import ConfigurationError
from ..stats import FIRST_WAIT_META, WORKER_COUNTERS, SemaphoreStats, observe
from .base import (
    ADAPTIVE_PROBE_SLOWER,
    EMPTY_TTL,
    AdaptiveState,
    Attempt,
    Grant,
    HolderInfo,
    Meta,
    MultiAttempt,
    QuotaUsage,
    SemaphoreStatus,
    WaiterInfo,
    cost_of,
    fair_key_of,
    front_of,
    priority_of,
    quotas_of,
    rates_of,
    task_of,
    units_of,
    weight_of,
    window_of,
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
    #: Seconds until time alone can let it start (:attr:`.base.Attempt.due`).
    due: Optional[float] = None


@dataclass
class Holder:
    slot: int
    epoch: int
    since: float
    expires: float
    meta: Meta = field(default_factory=dict)
    #: Units of the rates and quotas counted for it so far (:mod:`.base`, "Settling"); None:
    #: its meta's units (:func:`.base.units_of`), as its admission counted.
    counted: Optional[int] = None
    #: The quota windows its admission counted in: ``[period, offset, window start]`` each;
    #: None: none.
    windows: Optional[List[List[float]]] = None

    def grant(self, now: float) -> Grant:
        """This holder's grant as it stands (a repeated acquire gets it back unchanged)."""
        return Grant(self.slot, self.epoch, self.expires, self.expires - now)

    def to_dict(self) -> Dict[str, Any]:
        """Its document: the accounting fields only when set (a holder of a semaphore using
        none of them is stored as before they existed)."""
        out = {"slot": self.slot, "epoch": self.epoch, "since": self.since,
               "expires": self.expires, "meta": self.meta}
        if self.counted is not None:
            out["counted"] = self.counted
        if self.windows is not None:
            out["windows"] = self.windows
        return out


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
    #: The rates (:mod:`.base`, "Rate"): ``[interval, burst, tat]`` each (tat: the
    #: theoretical arrival time, storage clock, seconds); empty: no rate.
    rates: List[List[float]] = field(default_factory=list)
    #: The quotas (:mod:`.base`, "Quotas"): ``[count, period, offset]`` each.
    quotas: List[List[float]] = field(default_factory=list)
    #: Their counters: ``[period, offset, window start, window end, used]`` each, until the
    #: window ends.
    windows: List[List[float]] = field(default_factory=list)
    #: The end of the pause (:mod:`.base`, "Pauses"; in force while ``now <
    #: paused_until``) and its reason.
    paused_until: float = 0.0
    pause_reason: str = ""
    #: The adaptive limit (:mod:`.base`, "Adaptive limits"): ``[min, max, decrease,
    #: increase]`` of the newest declaration, None: not adaptive; the learned value, when it
    #: last decreased, and the limit in force at that overload (0: none remembered).
    adaptive: Optional[List[float]] = None
    current: float = 0.0
    decreased_at: float = 0.0
    ceiling: float = 0.0

    # -- (de)serialization, for backends that store the state as one document ---------------

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready document. Field by field, not dataclasses.asdict: asdict deep-copies
        every meta dict, and dumping the state was a tenth of a busy semaphore's client CPU.
        The first rate is stored as ``rate`` and ``tat`` (as before several rates), the others
        under ``rates``; what a semaphore does not use is left out (its document is the same
        as before those rules existed, and an older client reads it)."""
        first = self.rates[0] if self.rates else None
        doc: Dict[str, Any] = {
            "limit": self.limit,
            "declared": self.declared,
            "holders": {holder: entry.to_dict() for holder, entry in self.holders.items()},
            "waiters": {holder: vars(entry) for holder, entry in self.waiters.items()},
            "epochs": self.epochs,
            "next_ticket": self.next_ticket,
            "round": self.round,
            "stats": self.stats,
            "pinned": self.pinned,
            "wanted": self.wanted,
            "stamp": self.stamp,
            "rate": None if first is None else [first[0], first[1]],
            "tat": 0.0 if first is None else first[2],
        }
        if len(self.rates) > 1:
            doc["rates"] = self.rates[1:]
        if self.quotas:
            doc["quotas"] = self.quotas
        if self.windows:
            doc["windows"] = self.windows
        if self.paused_until:
            doc["paused_until"] = self.paused_until
            doc["pause_reason"] = self.pause_reason
        if self.adaptive is not None:
            doc["adaptive"] = self.adaptive
            doc["current"] = self.current
            doc["decreased_at"] = self.decreased_at
            if self.ceiling:
                doc["ceiling"] = self.ceiling
        return doc

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
        rate = raw.get("rate")  # absent in documents stored before rates
        rates = [] if rate is None else [[rate[0], rate[1], raw.get("tat", 0.0)]]
        rates += [list(r) for r in raw.get("rates", ())]
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
            rates=rates,
            quotas=[list(q) for q in raw.get("quotas", ())],
            windows=[list(w) for w in raw.get("windows", ())],
            paused_until=raw.get("paused_until", 0.0),
            pause_reason=raw.get("pause_reason", ""),
            adaptive=None if raw.get("adaptive") is None else list(raw["adaptive"]),
            current=raw.get("current", 0.0),
            decreased_at=raw.get("decreased_at", 0.0),
            ceiling=raw.get("ceiling", 0.0),
        )

    # -- queries -------------------------------------------------------------------------

    def queue(self) -> List[str]:
        """The waiters in admission order: by (-priority, not front, round, ticket) (rounds
        are all 0 while the semaphore is not fair, and a front waiter's is 0)."""
        waiters = self.waiters
        return sorted(waiters, key=lambda h: (-priority_of(waiters[h].meta),
                                              not front_of(waiters[h].meta),
                                              waiters[h].round, waiters[h].ticket))

    def units(self) -> int:
        """Units of the limit the holders hold (their costs)."""
        return sum(cost_of(h.meta) for h in self.holders.values())

    def costly(self) -> bool:
        """A holder or waiter holds or needs more than one unit."""
        return (any(cost_of(h.meta) > 1 for h in self.holders.values())
                or any(cost_of(w.meta) > 1 for w in self.waiters.values()))

    def paused(self, now: float) -> bool:
        """A pause is in force at ``now``."""
        return now < self.paused_until

    def rate_wait(self, now: float, ahead: int = 0, units: int = 1) -> float:
        """Seconds until every rate allows the start of ``units`` units by a caller with
        ``ahead`` units of waiters before it (0: now; always 0 without a rate)."""
        wait = 0.0
        for interval, burst, tat in self.rates:
            wait = max(wait, max(tat, now) + (ahead - max(0, burst - units)) * interval - now)
        return wait

    def window(self, period: float, offset: float, now: float) -> List[float]:
        """The counter of quota (``period``, ``offset``) for the window holding ``now``:
        ``[period, offset, start, end, used]``, a new one (used 0) when none counted in that
        window yet (not stored until :meth:`grant` stores it)."""
        start, end = window_of(now, period, offset)
        for counter in self.windows:
            if counter[0] == period and counter[1] == offset and counter[2] == start:
                return counter
        return [period, offset, start, end, 0]

    def quota_wait(self, now: float, ahead: int = 0, units: int = 1) -> float:
        """Seconds until the last of the quota windows that do not leave room for ``units``
        units after ``ahead`` units of waiters before it turns (0: room in every one)."""
        wait = 0.0
        for count, period, offset in self.quotas:
            counter = self.window(period, offset, now)
            if counter[4] + ahead + units > count:
                wait = max(wait, counter[3] - now)
        return wait

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
        """(client, holder) of the waiters the rules would admit now: none while a pause is
        in force or while the rates allow the head no start at ``now`` (given: a waiter held
        back by time is told when to try, not woken); else the longest prefix of the queue
        whose costs fit in the free units and whose units fit in every quota (but those whose
        task another holder holds)."""
        if now is not None and self.paused(now):
            return set()
        free = self.limit - self.units()
        if free <= 0:
            return set()
        held = self.held_tasks()
        out = set()
        ahead = 0
        for rank, h in enumerate(self.queue()):
            waiter = self.waiters[h]
            free -= cost_of(waiter.meta)
            if free < 0:
                break
            units = units_of(waiter.meta)
            if now is not None:
                if rank == 0 and self.rate_wait(now, 0, units) > 0:
                    return set()
                if self.quota_wait(now, ahead, units) > 0:
                    break
            ahead += units
            if task_of(h) not in held:
                out.add((waiter.client, h))
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

    def in_force(self) -> int:
        """The limit in force: the pinned one; else ``floor(current)`` of an adaptive limit;
        else the newest declaration's (:func:`effective_limit`)."""
        if self.adaptive is not None and not self.pinned:
            return math.floor(self.current)
        return effective_limit(self.limit, self.wanted, self.pinned)

    def declare(self, limit: int, stamp: float, now: float,
                adaptive: Optional[Sequence[float]] = None) -> None:
        """A caller declares ``limit`` (and ``adaptive``: ``(min, max, decrease, increase)``
        of an adaptive limit, or None); its process started at ``stamp`` (seconds, clamped to
        ``now``: a client clock ahead cannot date a declaration in the future). The newest
        declaration (the latest stamp; between equal stamps, the latest call) becomes the
        limit in force unless it is pinned (:meth:`in_force`), and says whether the limit
        is adaptive (:mod:`.base`, "Adaptive limits")."""
        self.declared[limit] = now
        stamp = min(stamp, now)
        if self.wanted is None or stamp >= self.stamp:
            self.wanted, self.stamp = limit, stamp
            self.make_adaptive(adaptive)
        self.limit = self.in_force()

    def make_adaptive(self, spec: Optional[Sequence[float]]) -> None:
        """The newest declaration's adaptive limit: ``current`` starts at ``min`` when the
        semaphore becomes adaptive, and is moved into the new bounds when they change; None
        makes the limit fixed again (the learned value is dropped)."""
        if spec is None:
            self.adaptive, self.current, self.decreased_at, self.ceiling = None, 0.0, 0.0, 0.0
            return
        low, high = spec[0], spec[1]
        if self.adaptive is None:
            self.current = float(low)
        else:
            self.current = float(min(max(self.current, low), high))
        self.adaptive = [low, high, float(spec[2]), float(spec[3])]

    def pin(self, limit: int) -> None:
        """An operator's ``resize``: ``limit`` is in force until :meth:`unpin`."""
        self.limit, self.pinned = limit, True

    def unpin(self) -> None:
        """Release the pin: the newest declaration (if any) is in force again, an adaptive
        limit's learned value."""
        self.pinned = False
        self.limit = self.in_force()

    def count(self, counter: str, n: int = 1) -> None:
        self.stats[counter] = self.stats.get(counter, 0) + n

    def keep_until(self) -> float:
        """The time until which this state must be kept whatever else: the end of the pause
        and of every quota window that counted a start (0: none)."""
        return max([self.paused_until, *(w[3] for w in self.windows)])

    def keep_for(self, now: float, idle_ttl: float) -> float:
        """Seconds to keep this state after a write at ``now``: ``idle_ttl`` while anyone
        holds or waits, an operator pinned the limit or it is adaptive; else
        :data:`.base.EMPTY_TTL`, or until the rates' next start is due if that is later,
        never above ``idle_ttl``; in any case at least until :meth:`keep_until` (and a
        second)."""
        if self.holders or self.waiters or self.pinned or self.adaptive is not None:
            keep = idle_ttl
        else:
            tat = max((r[2] for r in self.rates), default=0.0)
            keep = min(idle_ttl, max(EMPTY_TTL, tat - now + 1.0))
        return max(keep, self.keep_until() - now + 1.0)

    def prune(self, now: float, idle_ttl: float) -> None:
        for holder in [h for h, v in self.holders.items() if v.expires <= now]:
            del self.holders[holder]
            self.count("expired")  # a lease reclaimed by its TTL
        for holder in [h for h, v in self.waiters.items() if v.expires <= now]:
            del self.waiters[holder]
        for limit in [k for k, seen in self.declared.items() if seen < now - idle_ttl]:
            del self.declared[limit]
        if self.windows:  # a counter is forgotten once its window is over
            self.windows = [w for w in self.windows if w[3] > now]

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
        """Apply the rules; ``slots`` (default: any) are the slots the caller can take."""
        self.check_cost(meta)
        self.declared[declared] = now
        self.declare_traffic(meta)
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
                       spot.waits_for, due=spot.due)

    def check_cost(self, meta: Meta) -> None:
        """Refuse, before anything changes, a cost the stored limit (an adaptive one's
        maximum) could never admit."""
        limit = (int(self.adaptive[1]) if self.adaptive is not None and not self.pinned
                 else self.limit)
        if cost_of(meta) > limit:
            raise ConfigurationError(f"cost {cost_of(meta)} is above the semaphore's limit "
                                     f"({limit}): it could never be admitted")

    def declare_traffic(self, meta: Meta) -> None:
        """A call that declares rates or quotas sets the semaphore's (:mod:`.base`, "Rate",
        "Quotas"); a rate keeps the ``tat`` of the rate in its place before. Then refuses
        units a quota could never admit (the caller's rule fails: nothing is stored)."""
        rates = rates_of(meta)
        if rates is not None:
            tats = [r[2] for r in self.rates]
            self.rates = [[interval, burst, tats[i] if i < len(tats) else 0.0]
                          for i, (interval, burst) in enumerate(rates)]
        quotas = quotas_of(meta)
        if quotas is not None:
            self.quotas = [[count, period, offset] for count, period, offset in quotas]
        units = units_of(meta)
        for count, period, _ in self.quotas:
            if units > count:
                raise ConfigurationError(
                    f"units {units} are above the semaphore's quota of {int(count)} per "
                    f"{'month' if period == 0 else f'{period:g} s'}: it could never be "
                    "admitted")

    def place(self, holder: str, meta: Meta, slots: Optional[Iterable[int]] = None,
              now: Optional[float] = None) -> Place:
        """Where a caller that does not hold stands (:class:`Place`): its place in the
        queue, its fair-share round, and the slot the rules (:mod:`.base`: pause, priorities,
        front, fair rounds, costs, quotas, rates, one holder per task) would give it now at
        ``now`` (None: no pause, quota or rate check). Changes nothing."""
        waiter = self.waiters.get(holder)
        priority = priority_of(meta)
        if waiter is not None:
            order = self.queue()
            rank, round_ = order.index(holder), waiter.round
            ahead = order[:rank]
        else:
            front = front_of(meta)
            if front:
                round_ = 0
            elif fair_key_of(meta) is not None or self.fair():
                round_ = self.next_round(fair_key_of(meta), weight_of(meta))
            else:
                round_ = 0
            ahead = [h for h, w in self.waiters.items()
                     if priority_of(w.meta) > priority
                     or (priority_of(w.meta) == priority and (
                         front_of(w.meta) or (not front and w.round <= round_)))]
            rank = len(ahead)
        if now is not None and self.paused(now):
            return Place(rank, round_, None, None, "pause", self.paused_until - now)
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
        if fits and not twin and now is not None:
            own = units_of(meta)
            before = sum(units_of(self.waiters[h].meta) for h in ahead)
            quota_due = self.quota_wait(now, before, own)
            rate_due = self.rate_wait(now, before, own)
            if quota_due > 0:
                return Place(rank, round_, None, None, "quota", max(quota_due, rate_due))
            if rate_due > 0:
                return Place(rank, round_, None, rate_due, "rate", rate_due)
        if fits and free and not twin:
            return Place(rank, round_, free[0])
        return Place(rank, round_, None, None,
                     "units" if cost > 1 or need - units - cost > rank or units > len(used)
                     else "slots")

    def grant(self, holder: str, slot: int, round_: int, ttl: float, meta: Meta,
              now: float) -> Grant:
        """Give ``holder`` ``slot`` (as :meth:`place` found it), leaving the queue; its start
        spends its units of every rate and quota."""
        epoch = next_epoch(self.epochs.get(slot, 0), now)
        self.epochs[slot] = epoch
        spent = units_of(meta)
        for rate in self.rates:  # a start: each rate's next one is units * interval later
            rate[2] = max(rate[2], now) + spent * rate[0]
        windows = None
        if self.quotas:
            windows = []
            for _, period, offset in self.quotas:
                counter = self.window(period, offset, now)
                if not any(w is counter for w in self.windows):  # the window's first start
                    self.windows = [w for w in self.windows
                                    if not (w[0] == period and w[1] == offset)] + [counter]
                counter[4] += spent
                windows.append([period, offset, counter[2]])
        self.holders[holder] = Holder(slot, epoch, now, now + ttl, meta, windows=windows)
        queued = self.waiters.pop(holder, None)
        self.round = max(self.round, round_)
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

    def release(self, holder: str, now: Optional[float] = None,
                outcome: Optional[str] = None) -> bool:
        """Free ``holder``'s slot; with ``now``, observe its hold time, and apply
        ``outcome`` to an adaptive limit (:mod:`.base`, "Adaptive limits")."""
        gone = self.holders.pop(holder, None)
        if gone is not None and now is not None:
            observe(self.stats, "hold", now - gone.since)
            if outcome is not None and self.adaptive is not None and not self.pinned:
                self.adapt(outcome, gone, now)
        return gone is not None

    def adapt(self, outcome: str, gone: Holder, now: float) -> None:
        """Move the learned limit by the outcome of ``gone``'s call (just released)."""
        assert self.adaptive is not None
        low, high, decrease, increase = self.adaptive
        if outcome == "ok":
            if self.units() + cost_of(gone.meta) >= self.current / 2:
                step = increase / self.current
                if self.ceiling and math.floor(self.current) + 1 >= self.ceiling:
                    step /= ADAPTIVE_PROBE_SLOWER  # the next limit is the one that overloaded
                self.current = min(float(high), self.current + step)
                if self.ceiling and math.floor(self.current) > self.ceiling:
                    self.ceiling = 0.0  # it held: the capacity grew
        elif outcome == "overload" and gone.since >= self.decreased_at:
            self.ceiling = float(math.floor(self.current))
            self.current = max(float(low), self.current * decrease)
            self.decreased_at = now
        self.limit = self.in_force()

    def renew(self, holder: str, ttl: float, now: float) -> Optional[float]:
        current = self.holders.get(holder)
        if current is None:
            self.count("lost")  # a renewal that finds its lease gone
            return None
        current.expires = now + ttl
        return current.expires

    def cancel(self, holder: str) -> None:
        self.waiters.pop(holder, None)

    def pause(self, seconds: float, reason: str, now: float) -> float:
        """Close the semaphore until ``now + seconds`` unless the pause in force ends later
        (:mod:`.base`, "Pauses"); the end of the pause in force."""
        if now + seconds > self.paused_until:
            self.paused_until, self.pause_reason = now + seconds, reason
        return self.paused_until

    def resume(self, now: float) -> bool:
        """End the pause; True when one was in force."""
        was = self.paused(now)
        self.paused_until, self.pause_reason = 0.0, ""
        return was

    def settle(self, holder: str, units: int, now: float) -> bool:
        """``holder`` spent ``units`` (:mod:`.base`, "Settling"); False when it does not
        hold."""
        current = self.holders.get(holder)
        if current is None:
            return False
        counted = current.counted if current.counted is not None else units_of(current.meta)
        change = units - counted
        if change == 0:
            return True
        for period, offset, start in current.windows or ():
            for counter in self.windows:  # its window, unless it turned
                if counter[:3] == [period, offset, start] and counter[3] > now:
                    counter[4] = max(0, counter[4] + change)
        for rate in self.rates:
            if change < 0:  # a refund, never before now
                rate[2] = max(now, rate[2] + change * rate[0])
            else:  # an overdraft: spent now
                rate[2] = max(rate[2], now) + change * rate[0]
        current.counted = units
        return True

    def add_counts(self, counts: Mapping[str, int]) -> None:
        """Add worker-side counts (:data:`.stats.WORKER_COUNTERS` only)."""
        for counter, n in counts.items():
            if counter in WORKER_COUNTERS and n > 0:
                self.count(counter, int(n))

    def status(self, name: str, now: Optional[float] = None) -> SemaphoreStatus:
        now = 0.0 if now is None else now
        holders = sorted(self.holders.items(), key=lambda kv: kv[1].slot)
        rates = tuple((float(interval), int(burst)) for interval, burst, _ in self.rates)
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
            rate=rates[0] if rates else None,
            next_start=max(max(tat, now) - (burst - 1) * interval
                           for interval, burst, tat in self.rates) if self.rates else None,
            paused_until=self.paused_until if self.paused(now) else None,
            pause_reason=self.pause_reason if self.paused(now) else "",
            quotas=tuple(
                QuotaUsage(int(count), float(period), float(offset), counter[2], counter[3],
                           int(counter[4]))
                for count, period, offset in self.quotas
                for counter in [self.window(period, offset, now)]),
            rates=rates,
            adaptive=None if self.adaptive is None else AdaptiveState(
                int(self.adaptive[0]), int(self.adaptive[1]), self.current, self.pinned),
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
        states[name].declare_traffic(meta)
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
                        waits_for=places[blocking].waits_for, due=places[blocking].due)


def as_json(meta: Optional[Meta]) -> Dict[str, Any]:
    """Copy ``meta``, refusing what JSON cannot hold (fails before anything changes)."""
    meta = dict(meta or {})
    json.dumps(meta)
    return meta
