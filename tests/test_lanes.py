"""The waiting room's pulling decisions (:mod:`celery_semaphore.worker.lanes`), driven event by
event: no threads, no Celery, no broker. Each test feeds events and checks the commands that
come out, in order; the clock and what the book reads of the worker are the test's. A bell's
state is never set or read here: it is reached by events and seen in the commands."""

from celery_semaphore.waiting_room import RERING_EVERY, SHORT_RERING_EVERY, lane_of
from celery_semaphore.worker.lanes import (
    PULL_BATCH,
    RECHECK_AFTER,
    REDELIVERY_MARGIN,
    REFUSE_FOR,
    AckDuplicate,
    Hold,
    LaneBook,
    LetGo,
    Pull,
    Recheck,
    Ring,
)


class Worker:
    """The book's surroundings, set by the test."""

    def __init__(self, room=8):
        self.open = True
        self.rooms = {}
        self.default_room = room
        self.pending = False
        self.unsettled_by_lane = {}
        self.now = 100.0
        self.redelivered_after = None  # AMQP; a Redis broker's visibility_timeout otherwise
        self.short = set()  # semaphores whose requests here wait for a process, with room

    def room(self, semaphore):
        return self.rooms.get(semaphore, self.default_room)

    def short_of_processes(self, semaphore):
        return semaphore in self.short

    def settling(self):
        return self.pending

    def unsettled(self, lane):
        return self.unsettled_by_lane.get(lane, 0)


def make(**worker):
    w = Worker(**worker)
    return LaneBook(w, clock=lambda: w.now), w


def kinds(commands):
    return [type(c).__name__ for c in commands]


LANE = lane_of("s", None, "celery")


def ring(book, lane=LANE, message="bell"):
    """A doorbell of ``lane`` arrives: its bell, as the Recheck command names it."""
    commands = book.doorbell(lane, message)
    assert kinds(commands)[0] == "Hold" and kinds(commands)[-1] == "Recheck"
    return commands[-1].bell


def drain_while_one_runs(book, worker, bell, lane=LANE):
    """A pull begun RECHECK_AFTER after the ring finds the lane empty (no pull on its way)
    while a task pulled from it still runs: the lane is proven empty, the doorbell still held
    (nothing to do yet)."""
    worker.now += RECHECK_AFTER
    worker.unsettled_by_lane[lane] = 1
    assert book.pulled(bell, 0, True, worker.now, lane) == []
    assert book.recheck(bell) == []  # a drained lane is not pulled again
    assert book.held() == [bell.message]


def test_a_doorbell_is_held_pulled_and_looked_at_again_later():
    book, _ = make(room=5)
    commands = book.doorbell(LANE, "bell-1")
    assert kinds(commands) == ["Hold", "Pull", "Recheck"]
    assert commands[:2] == [Hold(), Pull(LANE, 5, 100.0)]
    assert commands[2].delay == RECHECK_AFTER and commands[2].bell.lane == LANE
    # a second doorbell of the same lane: acked at once, the lane rearmed, pulled again
    commands = book.doorbell(LANE, "bell-2")
    assert commands[0] == AckDuplicate("bell-2") and kinds(commands)[1:] == ["Pull", "Recheck"]
    assert book.held() == ["bell-1"]


def test_the_held_doorbell_delivered_again_is_held_in_its_place_never_acked():
    """A Redis broker's visibility timeout restores a doorbell held too long, with its delivery
    tag, and it may come back to the worker that holds it: acking it as a duplicate would drop
    the broker's only record of the lane's doorbell (a fresh-clone CI run lost a killed
    worker's parked tasks that way). It takes the held one's place; a new ring of the lane, with
    a tag of its own, is still acked at once."""
    book, worker = make(room=5)
    book.doorbell(LANE, "bell-1", 7)
    worker.now += 1.0
    commands = book.doorbell(LANE, "bell-1 again", 7)
    assert kinds(commands) == ["Pull", "Recheck"]  # nothing acked, no second hold
    assert book.held() == ["bell-1 again"]
    commands = book.doorbell(LANE, "bell-2", 8)
    assert commands[0] == AckDuplicate("bell-2")
    assert book.held() == ["bell-1 again"]
    # the lane, proven empty, lets go of the message it holds now
    bell = commands[-1].bell
    book.pull_landed(LANE, 5)
    worker.now += RECHECK_AFTER
    assert book.pulled(bell, 0, True, worker.now, LANE) == [LetGo(bell)]
    assert bell.message == "bell-1 again"


def _proven_empty_after(book, worker, bell, held_for):
    """The lane of ``bell`` is proven empty ``held_for`` seconds after its message arrived."""
    book.pull_landed(bell.lane, 5)
    worker.now += held_for
    return book.pulled(bell, 0, True, worker.now, bell.lane)


def test_a_doorbell_held_past_the_visibility_timeout_is_let_go_unacked():
    """On a Redis broker a doorbell held about as long as the visibility timeout may have been
    delivered again, with its delivery tag, to another worker: acking it would drop that
    worker's record, and the lane would go unrung if that worker died. It is let go unacked
    (the broker delivers it again; whoever gets it finds the lane empty, or not). Before
    that, and on AMQP whatever the time, it is acked."""
    for timeout, held_for, acked in [
            (4.0, 2.9, True), (4.0, 3.0, False), (4.0, 60.0, False),  # a quarter of 4 s: 1 s
            (3600.0, 3600.0 - REDELIVERY_MARGIN - 0.1, True),  # at most REDELIVERY_MARGIN
            (3600.0, 3600.0 - REDELIVERY_MARGIN, False),
            (None, 10_000.0, True)]:  # AMQP
        book, worker = make(room=5)
        worker.redelivered_after = timeout
        bell = book.doorbell(LANE, "bell-1", 7)[-1].bell
        assert _proven_empty_after(book, worker, bell, held_for) == [LetGo(bell, acked)], (
            timeout, held_for)


def test_the_held_doorbell_delivered_again_counts_its_time_from_then():
    """The same doorbell delivered again to the worker that holds it (same tag) is a new
    record of it in the broker: its age starts again."""
    book, worker = make(room=5)
    worker.redelivered_after = 4.0
    book.doorbell(LANE, "bell-1", 7)
    worker.now += 3.5
    book.doorbell(LANE, "bell-1 again", 7)
    bell = book.doorbell(LANE, "bell-2", 8)[-1].bell  # a new ring meanwhile does not
    assert _proven_empty_after(book, worker, bell, 2.0) == [LetGo(bell, True)]


def test_an_early_empty_pull_is_no_proof_and_a_late_one_lets_go_once_settled():
    book, worker = make()
    bell = ring(book)
    book.pull_landed(LANE, 8)
    worker.now += RECHECK_AFTER / 4  # the pull began too early: look again once it is not
    assert book.pulled(bell, 0, True, 100.0, LANE) == [Recheck(bell, RECHECK_AFTER * 3 / 4)]
    worker.now = 100.0 + RECHECK_AFTER
    assert book.recheck(bell) == [Pull(LANE, 8, worker.now)]  # still pulled: not proven empty
    book.pull_landed(LANE, 8)
    worker.unsettled_by_lane[LANE] = 1  # a task pulled from it still runs
    assert book.pulled(bell, 0, True, worker.now, LANE) == []  # proven empty, held on
    assert book.recheck(bell) == [] and book.held() == ["bell"]
    worker.unsettled_by_lane[LANE] = 0
    assert book.last_settled(LANE) == [LetGo(bell)]
    assert book.held() == [] and book.refill("s") == [] and book.last_settled(LANE) == []
    assert kinds(book.doorbell(LANE, "next")) == ["Hold", "Pull", "Recheck"]  # a fresh start


def test_a_lane_is_not_proven_empty_while_given_back_messages_are_on_their_way():
    book, worker = make()
    bell = ring(book)
    book.pull_landed(LANE, 8)
    worker.pending = True
    assert book.pulled(bell, 0, True, 200.0, LANE) == [Recheck(bell, RECHECK_AFTER)]
    assert book.recheck(bell) == [Pull(LANE, 8, worker.now)]  # still pulling the lane


def test_a_message_back_in_its_lane_rearms_it_and_delivered_ones_pull_on():
    book, worker = make()
    bell = ring(book)
    book.pull_landed(LANE, 8)
    assert kinds(book.pulled(bell, 3, False, 100.0, LANE)) == ["Pull"]  # more of it
    book.pull_landed(LANE, 8)
    drain_while_one_runs(book, worker, bell)
    worker.now = 150.0
    assert book.back_in_lane(LANE) == [Pull(LANE, 8, 150.0)]
    # rung anew at 150: a pull begun then finding it empty proves nothing yet
    book.pull_landed(LANE, 8)
    assert book.pulled(bell, 0, True, 150.0, LANE) == [Recheck(bell, RECHECK_AFTER)]


def test_no_room_rings_the_lane_again_for_the_others_at_most_every_rering():
    book, worker = make(room=0)
    commands = book.doorbell(LANE, "bell")
    assert kinds(commands) == ["Hold", "Ring", "Recheck"] and commands[1] == Ring(LANE)
    assert book.refill("s") == []  # rung a moment ago
    worker.now += RERING_EVERY
    assert book.refill("s") == [Ring(LANE)]
    book.ring_failed(LANE)  # the broker did not take it: the bell's own throttle still holds
    assert book.refill("s") == []


def test_requests_waiting_for_a_process_ring_the_lane_again_while_pulling_on():
    """A worker with room that still pulls a lane whose requests wait here for a process
    (the semaphore has room) rings the lane again for the other workers, at most every
    SHORT_RERING_EVERY: one whose consumer took every doorbell of a backlog kept the others
    idle beside it."""
    book, worker = make(room=8)
    bell = ring(book)
    book.pull_landed(LANE, 8)
    assert book.pulled(bell, 8, False, worker.now, LANE) == [Pull(LANE, 8, worker.now)]
    book.pull_landed(LANE, 8)
    worker.short.add("s")
    assert book.refill("s") == [Ring(LANE), Pull(LANE, 8, worker.now)]  # and pulls on
    book.pull_landed(LANE, 8)
    assert book.refill("s") == [Pull(LANE, 8, worker.now)]  # rung a moment ago
    book.pull_landed(LANE, 8)
    worker.now += SHORT_RERING_EVERY
    assert SHORT_RERING_EVERY < RERING_EVERY
    assert book.refill("s") == [Ring(LANE), Pull(LANE, 8, worker.now)]
    book.pull_landed(LANE, 8)
    worker.short.clear()
    worker.now += RERING_EVERY
    assert book.refill("s") == [Pull(LANE, 8, worker.now)]  # a free process: no ring


def test_a_worker_short_of_processes_rings_one_lane_of_a_semaphore_at_a_time():
    """With fair keys (a lane each), only the next lane in turn is rung again: a doorbell of
    any lane brings another worker in, without a doorbell per key every time."""
    book, worker = make(room=PULL_BATCH)
    lanes = [lane_of("s", f"k{i}", "celery") for i in range(3)]
    for lane in lanes:
        ring(book, lane)
    worker.short.add("s")
    worker.now += 10.0
    rings = [c for c in book.refill("s") if isinstance(c, Ring)]
    assert len(rings) == 1


def test_the_room_is_shared_between_the_lanes_of_a_semaphore_in_turn():
    book, worker = make(room=PULL_BATCH)
    lanes = [lane_of("s", f"k{i}", "celery") for i in range(3)]
    worker.default_room = 0
    for lane in lanes:
        book.doorbell(lane, lane)
    worker.default_room = 6
    commands = book.refill("s")
    assert [(c.lane, c.want) for c in commands] == [(lanes[0], 2), (lanes[1], 2), (lanes[2], 2)]
    worker.default_room = 1
    assert [c.lane for c in book.refill("s")] == [lanes[0]]
    assert [c.lane for c in book.refill("s")] == [lanes[1]]  # the next refill, the next lane


def test_a_lane_of_an_unknown_task_is_left_to_the_others_for_a_while():
    book, worker = make(room=0)
    bell = ring(book)  # no room: rung again for the others
    book.ring_failed(LANE)  # ... but the broker did not take that ring
    worker.default_room = 8
    # rung again a moment ago, and refused now: refusing rings it anyway
    assert book.refused(LANE) == [Ring(LANE), Recheck(bell, REFUSE_FOR)]
    assert book.refill("s") == []  # refused meanwhile
    worker.now += REFUSE_FOR
    assert kinds(book.recheck(bell)) == ["Pull"]


def test_a_stopped_consumer_pulls_nothing_and_lets_go_of_every_doorbell_unacked():
    book, worker = make()
    bell = ring(book)
    other = lane_of("t", None, "celery")
    book.doorbell(other, "other")
    worker.open = False
    assert book.refill_all() == []
    assert book.let_go_of_all() == ["bell", "other"] and book.held() == []
    assert book.recheck(bell) == [] and book.last_settled(LANE) == []  # nothing held


def test_a_copy_parked_here_makes_the_held_lane_prove_itself_empty_anew():
    book, worker = make()
    bell = ring(book)
    book.pull_landed(LANE, 8)
    drain_while_one_runs(book, worker, bell)
    worker.now = 130.0
    assert book.rung_here(LANE) == [Recheck(bell, RECHECK_AFTER)]
    assert book.recheck(bell) == [Pull(LANE, 8, 130.0)]  # pulled again
    book.pull_landed(LANE, 8)
    assert book.pulled(bell, 0, True, 130.0, LANE) == [Recheck(bell, RECHECK_AFTER)]
    assert book.rung_here(lane_of("t", None, "celery")) == []  # a lane it holds no bell of


def test_a_doorbell_the_broker_does_not_take_resets_the_parking_connection(caplog):
    """The I/O thread's ring of a lane fails on the broker: the lane's parked tasks wait for
    the next doorbell, and the parking connection is dropped, as after any failed call on it,
    so that the next park or pull opens a new one instead of meeting the closed channel (whose
    ``AttributeError`` was logged as a bug). One warning for the ring, one for the outage."""
    import logging
    from types import SimpleNamespace

    import redis

    from celery_semaphore.worker.parking import ParkingLot

    posted, closed, detached = [], [], []
    channel = SimpleNamespace()
    connection = SimpleNamespace(
        connection_errors=(redis.ConnectionError,), channel_errors=(),
        default_channel=channel, close=lambda: closed.append(True))
    lot = ParkingLot.__new__(ParkingLot)
    lot.ctx = SimpleNamespace(loop=SimpleNamespace(post=lambda fn, *a: posted.append(fn)))
    lot.book = SimpleNamespace(ring_failed=lambda lane: None)
    lot.settlements = SimpleNamespace(detach=lambda ch, keep: detached.append(ch))
    lot.guards = SimpleNamespace(forget_all=lambda: None)
    lot._unsettled, lot._faults_seen, lot._unavailable_since = set(), set(), None
    lot._connection = connection

    def refused(lane):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    lot._publish_doorbell = refused
    with caplog.at_level(logging.WARNING, logger="celery_semaphore"):
        lot._ring(LANE)
    assert lot._connection is None and closed == [True], "the parking connection stays"
    assert lot.book.ring_failed in posted and lot._let_go_of_pulled in posted
    said = [r.getMessage() for r in caplog.records]
    assert any("ringing the doorbell of" in m and "failed" in m for m in said), said
    assert sum("broker unavailable" in m for m in said) == 1, said
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], said
