"""The doorbells one worker holds and how it pulls their lanes: every decision of the waiting
room's pulling side, with no threads, no Celery and no I/O (as :mod:`.core` is for admission).

The shell (:class:`.ParkingLot`) tells it what happened (a doorbell arrived, a refill is due,
a pull came back, the last message pulled from a lane was settled, a recheck is due) and
carries out the commands it returns, in order: pull so many messages from a lane, ring a
lane's doorbell again for the other workers, ack a duplicate doorbell, hold or let go of one
(the consumer's prefetch), look at a lane again later. It reads what it needs to know of the
rest of the worker from :class:`LaneSurroundings` (main-process memory, never I/O), and the
time from the clock it was given.

A held doorbell's life (:class:`BellState`)::

    doorbell ─> PULLING ──(a pull begun RECHECK_AFTER after the last ring finds the lane
                  ^  │      empty, nothing given back on its way)──> DRAINED
                  │  │                                                   │
                  └──┴── (a pulled message went back; a new ring) ───────┤
                                                                         v
                                     (no message pulled from it unsettled) let go: acked
                                     (held past the visibility timeout: left to the broker)

Guarantees: a lane's doorbell is acked only once a pull begun at least
:data:`RECHECK_AFTER` after the lane's last ring found it empty and no message pulled from it
is unsettled or on its way back, and only while its broker record is surely this worker's
(held for less than a Redis broker's visibility timeout, less a margin: past it the broker
may have delivered it again to another worker, whose record an ack would drop; it is left to
the broker instead); a lane this worker has no room for, or whose requests wait here for a
process while its semaphore has room (:meth:`LaneSurroundings.short_of_processes`), is rung
again at most once every :data:`..waiting_room.RERING_EVERY` (resp.
:data:`..waiting_room.SHORT_RERING_EVERY`); a lane whose tasks this worker does not know is left to
the others for :data:`REFUSE_FOR`.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Union

from ..waiting_room import DOORBELL_EVERY, RERING_EVERY, SHORT_RERING_EVERY, semaphore_of

#: After a doorbell, pull once more this much later: a sender rings at most once every
#: :data:`DOORBELL_EVERY`, so what it parked after ringing is there by then.
RECHECK_AFTER = 2.5 * DOORBELL_EVERY
#: Messages one pull takes at most.
PULL_BATCH = 16
#: Seconds a lane whose tasks this worker does not know is left to the other workers.
REFUSE_FOR = 30.0
#: Seconds at most, before a Redis broker's visibility timeout, from which a held doorbell is
#: no longer acked when its lane is proven empty (:class:`LetGo`).
REDELIVERY_MARGIN = 30.0


class BellState(enum.Enum):
    """A doorbell this worker holds (unacked on the consumer's channel) for one lane."""

    PULLING = "pulling"  # the lane may hold parked tasks: pulled while there is room
    DRAINED = "drained"  # found empty late enough; acked once its pulled tasks are settled


@dataclass(eq=False)
class Bell:
    lane: str
    message: Any  # the doorbell's message on the consumer channel
    tag: Any = None  # its delivery tag
    state: BellState = BellState.PULLING
    #: Monotonic time of the last doorbell of this lane (held or not): a pull must begin
    #: RECHECK_AFTER later to prove the lane empty.
    rung: float = field(default_factory=time.monotonic)
    #: Monotonic time the message held now arrived (its broker record's age, near enough).
    since: float = field(default_factory=time.monotonic)
    rerung: float = 0.0
    #: Monotonic time before which pulled tasks of this lane go back (a task this worker
    #: does not know): the lane is left to the other workers meanwhile.
    refused_until: float = 0.0


class LaneSurroundings(Protocol):
    """What the lane book reads of the rest of the worker (main-process memory)."""

    @property
    def open(self) -> bool:
        """The consumer runs: lanes are pulled."""

    def room(self, semaphore: str) -> int:
        """How many more requests of ``semaphore`` this worker should hold waiting."""

    def short_of_processes(self, semaphore: str) -> bool:
        """Requests of ``semaphore`` wait in this worker with every pool process busy while
        the semaphore has room: another worker's free processes could run them now."""

    def settling(self) -> bool:
        """Messages this worker gives back have not all reached the broker yet."""

    def unsettled(self, lane: str) -> int:
        """Messages pulled from ``lane`` not acked or rejected yet."""

    @property
    def redelivered_after(self) -> Optional[float]:
        """Seconds after which the broker delivers an unacked message again while the
        connection that took it lives (a Redis broker's ``visibility_timeout``), or None
        where it never does (AMQP)."""


# -- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pull:
    """Take up to ``want`` messages from ``lane`` (a pull begun at monotonic ``began``)."""

    lane: str
    want: int
    began: float


@dataclass(frozen=True)
class Ring:
    """Ring ``lane``'s doorbell again, for another worker that consumes its queue."""

    lane: str


@dataclass(frozen=True)
class AckDuplicate:
    """Ack a doorbell of a lane this worker holds one for already."""

    message: Any


@dataclass(frozen=True)
class Hold:
    """A doorbell is held from now on: the consumer may fetch one more message."""


@dataclass(frozen=True)
class LetGo:
    """``bell``'s lane is proven empty: ack its doorbell and lower the prefetch it raised.
    With ``ack`` False (held about as long as the broker's visibility timeout, or longer)
    the doorbell is not acked but left unacked in the broker, taken out of the channel's
    unacked set: the broker may have delivered it again, with its delivery tag, to another
    worker, and an ack would drop that worker's record of it. The broker delivers it again
    in time, and whoever gets it finds the lane empty, or not."""

    bell: Bell
    ack: bool = True


@dataclass(frozen=True)
class Recheck:
    """Report :meth:`LaneBook.recheck` for ``bell`` in ``delay`` seconds."""

    bell: Bell
    delay: float


LaneCommand = Union[Pull, Ring, AckDuplicate, Hold, LetGo, Recheck]


class LaneBook:
    """The doorbells one worker holds, by lane and by semaphore, and the pulls on their way.
    Loop thread only. See the module docstring."""

    def __init__(self, surroundings: LaneSurroundings, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.surroundings = surroundings
        self.clock = clock
        self.bells: Dict[str, Bell] = {}  # lane -> the doorbell this worker holds for it
        self.lanes: Dict[str, Deque[str]] = {}  # semaphore -> its held lanes, in turn
        self.pulling: Dict[str, int] = {}  # lane -> gets on their way
        self._rung: Dict[str, float] = {}  # lane -> when this worker last rang it
        self._out: List[LaneCommand] = []

    def _flush(self) -> List[LaneCommand]:
        out, self._out = self._out, []
        return out

    # -- events ------------------------------------------------------------------------------

    def doorbell(self, lane: str, message: Any, tag: Any = None) -> List[LaneCommand]:
        """A doorbell of ``lane`` reached this worker: hold it (or, holding one already, ack
        this one) and pull; look again :data:`RECHECK_AFTER` later, for what was parked after
        it was rung.

        ``tag`` is the message's delivery tag. A doorbell with the tag of the one held is
        that same message delivered again (a Redis broker's ``visibility_timeout`` restored it
        while it was held, with its tag): it is held in its place, never acked, for acking it
        would drop the broker's only record of the lane's doorbell, and the lane's parked
        tasks would wait for a new send once this worker is gone."""
        bell = self.bells.get(lane)
        if bell is None:
            now = self.clock()
            bell = self.bells[lane] = Bell(lane, message, tag=tag, rung=now, since=now)
            self._out.append(Hold())
            self.lanes.setdefault(semaphore_of(lane), deque()).append(lane)
        elif tag is not None and tag == bell.tag:
            bell.message = message
            bell.rung = bell.since = self.clock()
            bell.state = BellState.PULLING
        else:
            self._out.append(AckDuplicate(message))
            bell.rung = self.clock()
            bell.state = BellState.PULLING
        self._refill(lane)
        self._out.append(Recheck(bell, RECHECK_AFTER))
        return self._flush()

    def refill(self, name: str) -> List[LaneCommand]:
        """Pull parked requests of semaphore ``name`` (or of a lane's semaphore) while this
        worker has room for them: from the lanes it holds a doorbell for, in turn (with
        ``semaphore_fair_by``, one per fair key), an equal part of the room each, the next
        refill starting at the next lane, so that the backend's fair queue sees every key
        that has parked requests. A lane it has no room for is rung again for the others."""
        self._refill(name)
        return self._flush()

    def refill_all(self) -> List[LaneCommand]:
        for semaphore in list(self.lanes):
            self._refill(semaphore)
        return self._flush()

    def recheck(self, bell: Bell) -> List[LaneCommand]:
        if self.bells.get(bell.lane) is bell:
            self._refill(bell.lane)
        return self._flush()

    def pull_landed(self, lane: str, asked: int) -> None:
        """A pull of ``asked`` messages from ``lane`` came back (before its messages are
        delivered)."""
        self.pulling[lane] -= asked
        if not self.pulling[lane]:
            del self.pulling[lane]

    def pulled(self, bell: Any, delivered: int, empty: bool, began: float,
               lane: str) -> List[LaneCommand]:
        """The pull of ``lane`` begun at ``began`` delivered ``delivered`` messages (``bell``:
        the doorbell held when it came back, or None); ``empty``: it found the lane empty.
        A pull begun late enough that found nothing proves the lane empty; one begun earlier
        is looked at again once it would be; otherwise pull on."""
        if bell is None:
            return self._flush()
        if empty and not delivered and bell.state is BellState.PULLING:
            if began >= bell.rung + RECHECK_AFTER:
                self._drained(bell)
            else:  # what was parked after the doorbell may not have been there yet
                self._out.append(Recheck(bell, max(bell.rung + RECHECK_AFTER - self.clock(),
                                                   0.0)))
            return self._flush()
        self._refill(lane)  # more of this lane, or the room it left to the others
        return self._flush()

    def rung_here(self, lane: str) -> List[LaneCommand]:
        """This worker parked a copy in ``lane`` (its doorbell rung before it): if it holds
        the lane's doorbell, a pull begun from now on must find the copy."""
        bell = self.bells.get(lane)
        if bell is not None:
            bell.rung = self.clock()
            bell.state = BellState.PULLING
            self._out.append(Recheck(bell, RECHECK_AFTER))
        return self._flush()

    def refused(self, lane: str) -> List[LaneCommand]:
        """A pulled task of ``lane`` is not one this worker knows: leave the lane to the other
        workers for :data:`REFUSE_FOR` (ring it for them now), then look again."""
        bell = self.bells.get(lane)
        if bell is not None:
            bell.refused_until = self.clock() + REFUSE_FOR
            bell.rerung = 0.0
            self._ring_again(bell)
            self._out.append(Recheck(bell, REFUSE_FOR))
        return self._flush()

    def back_in_lane(self, lane: str) -> List[LaneCommand]:
        """A pulled message went back to ``lane`` (rejected with requeue): the lane must be
        proven empty anew before its doorbell goes."""
        bell = self.bells.get(lane)
        if bell is not None:
            bell.state, bell.rung = BellState.PULLING, self.clock()
            self._refill(lane)
        return self._flush()

    def last_settled(self, lane: str) -> List[LaneCommand]:
        """The last message pulled from ``lane`` was settled."""
        bell = self.bells.get(lane)
        if bell is not None:
            if bell.state is BellState.DRAINED:
                self._drained(bell)
            else:
                self._refill(lane)
        return self._flush()

    def rearm(self) -> List[LaneCommand]:
        """Messages pulled from the held lanes went back: pull every held lane again, proving
        it empty anew before its doorbell goes."""
        now = self.clock()
        for bell in self.bells.values():
            bell.state, bell.rung = BellState.PULLING, now
        return self.refill_all()

    def ring_failed(self, lane: str) -> None:
        """The broker did not take ``lane``'s doorbell: the next refill with no room may ring
        it again at once."""
        self._rung.pop(lane, None)

    def let_go_of_all(self) -> List[Any]:
        """The consumer stops: stop holding every doorbell (none is acked); their messages."""
        messages = []
        for bell in list(self.bells.values()):
            self._let_go(bell, ack=False)
            messages.append(bell.message)
        self._out.clear()
        return messages

    def held(self) -> List[Any]:
        """The doorbell messages this worker holds."""
        return [bell.message for bell in self.bells.values()]

    # -- steps -------------------------------------------------------------------------------

    def _refill(self, name: str) -> None:
        semaphore = semaphore_of(name)
        lanes = self.lanes.get(semaphore)
        if not lanes or not self.surroundings.open:
            return
        want = min(self.surroundings.room(semaphore), PULL_BATCH)
        if want <= 0:
            for lane in lanes:
                self._ring_again(self.bells[lane])
            return
        if self.surroundings.short_of_processes(semaphore):
            # What this worker pulled waits for a process while another worker's may be free:
            # ring the next lane again for the others, sooner than for a lack of room (a
            # worker whose consumer took every doorbell of a backlog as it was sent pulled it
            # alone, the others idle beside it).
            self._ring_again(self.bells[lanes[0]], SHORT_RERING_EVERY)
        part = max(1, want // len(lanes))
        now = self.clock()
        for _ in range(len(lanes)):
            if want <= 0:
                break
            lane = lanes[0]
            lanes.rotate(-1)
            bell = self.bells[lane]
            if bell.state is not BellState.PULLING or bell.refused_until > now:
                continue
            take = min(part, want)
            want -= take
            self.pulling[lane] = self.pulling.get(lane, 0) + take
            self._out.append(Pull(lane, take, now))

    def _drained(self, bell: Bell) -> None:
        """A pull begun late enough found ``bell``'s lane empty: let go of the doorbell once no
        task pulled from the lane is unsettled (else when the last one is: :meth:`last_settled`).
        While a message this worker gives back has not reached the broker yet, the lane is not
        proven empty: look again later."""
        if self.surroundings.settling():
            self._out.append(Recheck(bell, RECHECK_AFTER))
            return
        bell.state = BellState.DRAINED
        if self.surroundings.unsettled(bell.lane):
            return
        self._let_go(bell, ack=True)

    def _let_go(self, bell: Bell, ack: bool) -> None:
        if self.bells.get(bell.lane) is not bell:
            return
        del self.bells[bell.lane]
        semaphore = semaphore_of(bell.lane)
        lanes = self.lanes[semaphore]
        lanes.remove(bell.lane)
        if not lanes:
            del self.lanes[semaphore]
        if ack:
            self._out.append(LetGo(bell, self._ackable(bell)))

    def _ackable(self, bell: Bell) -> bool:
        """Whether ``bell``'s broker record is surely still this worker's: held for less than
        the broker's visibility timeout, less a margin (a quarter of it, at most
        :data:`REDELIVERY_MARGIN`) for the time between the broker's record and its arrival
        here, and for clocks apart."""
        after = self.surroundings.redelivered_after
        if after is None:
            return True
        return self.clock() - bell.since < after - min(after / 4, REDELIVERY_MARGIN)

    def _ring_again(self, bell: Bell, every: float = RERING_EVERY) -> None:
        """This worker holds ``bell`` but has no room for its lane (or is short of processes
        for it): ring it again (at most once every ``every`` seconds) for another worker that
        consumes the same queue."""
        now = self.clock()
        if bell.state is BellState.PULLING and now - bell.rerung >= every:
            bell.rerung = now
            if now - self._rung.get(bell.lane, -every) >= every:
                self._rung[bell.lane] = now
                if len(self._rung) > 10_000:
                    self._rung = {k: t for k, t in self._rung.items() if now - t < RERING_EVERY}
                self._out.append(Ring(bell.lane))
