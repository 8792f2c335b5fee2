"""The semaphore's rules as plain Python over one semaphore's state.

The memory and SQLite backends run these rules inside their own atomic section (a lock, a
``BEGIN IMMEDIATE`` transaction); the Redis backend's Lua scripts implement the same rules, and
the contract test suite holds every backend to them. See :mod:`.base` for the rules in prose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Set, Tuple

from .base import Attempt, Backend, Grant, HolderInfo, Meta, SemaphoreStatus, WaiterInfo


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


@dataclass
class Waiter:
    ticket: int
    since: float
    expires: float
    client: str
    meta: Meta = field(default_factory=dict)


@dataclass
class State:
    limit: int
    declared: Dict[int, float] = field(default_factory=dict)
    holders: Dict[str, Holder] = field(default_factory=dict)
    waiters: Dict[str, Waiter] = field(default_factory=dict)
    epochs: Dict[int, int] = field(default_factory=dict)
    next_ticket: int = 1
    #: Backend-specific data stored with the state (the AMQP token backend's token numbers).
    extra: Dict[str, Any] = field(default_factory=dict)

    # -- (de)serialization, for backends that store the state as one document ---------------

    def dumps(self) -> str:
        # Field by field, not dataclasses.asdict: asdict deep-copies every meta dict, and
        # dumping the state was a tenth of a busy semaphore's client CPU.
        document = {
            "limit": self.limit,
            "declared": self.declared,
            "holders": {holder: vars(entry) for holder, entry in self.holders.items()},
            "waiters": {holder: vars(entry) for holder, entry in self.waiters.items()},
            "epochs": self.epochs,
            "next_ticket": self.next_ticket,
            "extra": self.extra,
        }
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "State":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "State":
        """From :meth:`dumps`'s document, already parsed."""
        return cls(
            limit=raw["limit"],
            declared={int(k): v for k, v in raw["declared"].items()},
            holders={k: Holder(**v) for k, v in raw["holders"].items()},
            waiters={k: Waiter(**v) for k, v in raw["waiters"].items()},
            epochs={int(k): v for k, v in raw["epochs"].items()},
            next_ticket=raw["next_ticket"],
            extra=raw.get("extra", {}),
        )

    # -- queries -------------------------------------------------------------------------

    def queue(self) -> List[str]:
        return sorted(self.waiters, key=lambda h: self.waiters[h].ticket)

    def admissible(self) -> Set[Tuple[str, str]]:
        """(client, holder) of the waiters the FIFO rule would admit now."""
        free = self.limit - len(self.holders)
        return {(self.waiters[h].client, h) for h in self.queue()[: max(free, 0)]}

    def earliest_expiry(self, now: float) -> Optional[float]:
        if not self.holders:
            return None
        return max(0.0, min(h.expires for h in self.holders.values()) - now)

    # -- operations ----------------------------------------------------------------------

    def prune(self, now: float, idle_ttl: float) -> None:
        for holder in [h for h, v in self.holders.items() if v.expires <= now]:
            del self.holders[holder]
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
            return Attempt(
                Grant(current.slot, current.epoch, current.expires, current.expires - now),
                limit=self.limit,
            )
        queue = self.queue()
        rank = queue.index(holder) if holder in self.waiters else len(queue)
        used = {h.slot for h in self.holders.values()}
        if slots is None:  # the lowest free slot: one of the first len(used) + 1 is free
            lowest = next(s for s in range(len(used) + 1) if s not in used)
            free = [lowest] if lowest < self.limit else []
        else:
            free = [s for s in sorted(slots) if 0 <= s < self.limit and s not in used]
        if len(self.holders) + rank < self.limit and free:
            slot = free[0]
            epoch = next_epoch(self.epochs.get(slot, 0), now)
            self.epochs[slot] = epoch
            self.holders[holder] = Holder(slot, epoch, now, now + ttl, meta)
            self.waiters.pop(holder, None)
            return Attempt(Grant(slot, epoch, now + ttl, ttl), limit=self.limit)
        position = None
        if wait:
            waiter = self.waiters.get(holder)
            if waiter is None:
                self.waiters[holder] = Waiter(self.next_ticket, now, now + waiter_ttl, client, meta)
                self.next_ticket += 1
            else:
                waiter.expires = now + waiter_ttl
            position = rank
        return Attempt(None, position, self.earliest_expiry(now), self.limit)

    def release(self, holder: str) -> bool:
        return self.holders.pop(holder, None) is not None

    def renew(self, holder: str, ttl: float, now: float) -> Optional[float]:
        current = self.holders.get(holder)
        if current is None:
            return None
        current.expires = now + ttl
        return current.expires

    def cancel(self, holder: str) -> None:
        self.waiters.pop(holder, None)

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
        )


def wakeups(before: Set[Tuple[str, str]], state: Optional[State]) -> Set[Tuple[str, str]]:
    """Waiters that an operation made admissible: they get a notification."""
    if state is None:
        return set()
    return state.admissible() - before


def as_json(meta: Optional[Meta]) -> Dict[str, Any]:
    """Copy ``meta``, refusing what JSON cannot hold (fails before anything changes)."""
    meta = dict(meta or {})
    json.dumps(meta)
    return meta


class Box:
    """One semaphore's state inside a backend's atomic section, and the server's time."""

    def __init__(self, state: Optional[State], now: float) -> None:
        self.state = state
        self.now = now


class ModelBackend(Backend):
    """A backend that runs :class:`State`'s rules inside an atomic section of its own.

    Subclasses provide :meth:`_transaction` (load, yield, store one semaphore's state
    atomically), :meth:`_stored_names` and :meth:`_send_wakeup`.
    """

    def _transaction(self, name: str) -> ContextManager[Box]:
        raise NotImplementedError

    def _stored_names(self) -> List[str]:
        raise NotImplementedError

    def _send_wakeup(self, client: str, name: str, holder: str) -> None:
        raise NotImplementedError

    def _run(self, name: str, op: Callable[[Box], Any]) -> Any:
        with self._transaction(name) as box:
            before: Set[Tuple[str, str]] = set()
            if box.state is not None:
                before = box.state.admissible()
                box.state.prune(box.now, self.idle_ttl)
            result = op(box)
            wake = wakeups(before, box.state)
        for client, holder in wake:
            self._send_wakeup(client, name, holder)
        return result

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        meta = as_json(meta)

        def op(box: Box) -> Attempt:
            if box.state is None:
                box.state = State(limit=limit)
            return box.state.acquire(
                holder, declared=limit, ttl=ttl, meta=meta, wait=wait,
                client=self.client_id, now=box.now, waiter_ttl=self.waiter_ttl,
            )

        return self._run(name, op)

    def release(self, name: str, holder: str) -> bool:
        return self._run(name, lambda box: box.state is not None and box.state.release(holder))

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        return self._run(
            name, lambda box: box.state.renew(holder, ttl, box.now) if box.state else None
        )

    def verify(self, name: str, holder: str) -> bool:
        return self._run(name, lambda box: box.state is not None and holder in box.state.holders)

    def cancel(self, name: str, holder: str) -> None:
        self._run(name, lambda box: box.state.cancel(holder) if box.state else None)

    def resize(self, name: str, limit: int) -> bool:
        def op(box: Box) -> bool:
            created = box.state is None
            if created:
                box.state = State(limit=limit)
            box.state.limit = limit
            return created

        return self._run(name, op)

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        return self._run(name, lambda box: box.state.status(name) if box.state else None)

    def names(self) -> List[str]:
        return sorted(self._stored_names())

    def reset(self, name: str) -> bool:
        def op(box: Box) -> bool:
            existed = box.state is not None
            box.state = None
            return existed

        return self._run(name, op)
