"""The worker core (:mod:`celery_semaphore.worker.core`), driven event by event: no threads, no
Celery, no backend. Each test feeds events and checks the commands that come out, in order;
the clock and what the core reads of the pool and the waiting room are the test's."""

from types import SimpleNamespace

import pytest

from celery_semaphore.backends.base import Attempt, Grant, MultiAttempt
from celery_semaphore.exceptions import ConfigurationError, SemaphoreTimeout
from celery_semaphore.guards import Guard
from celery_semaphore.settings import Settings
from celery_semaphore.worker.core import (
    WAKE_DEFER_MAX,
    AdmissionCore,
    Answer,
    Answered,
    Arrived,
    CapacityChanged,
    Exit,
    GrantReturned,
    How,
    Leave,
    ReportWaiting,
    Revoked,
    SendAttempt,
    Tick,
    Watch,
    Woken,
)
from celery_semaphore.worker.waiter import WaitState

GRANT = Grant(slot=0, epoch=1, expires_at=0.0, ttl=60.0)


class World:
    """The core's surroundings and clocks, set by the test."""

    def __init__(self, processes=4, room=100, lookahead=0):
        self.processes = processes  # pool processes
        self.ahead = lookahead  # granted requests the pool may queue beyond its processes
        self.reserved = 0  # requests Celery holds: the core's waiters and those running
        self.rooms = {}
        self.default_room = room
        self.now = 1000.0
        self.wall = 1_700_000_000.0

    def free_processes(self, waiting):
        return self.processes - (self.reserved - waiting)

    def ended(self, core):
        """A task that ran ends: its process is free."""
        self.reserved -= 1
        return core.handle(CapacityChanged())

    def room(self, name, waiting_of_name, waiting):
        return self.rooms.get(name, self.default_room) - waiting_of_name

    def lookahead(self):
        return self.ahead

    def advance(self, seconds):
        self.now += seconds
        self.wall += seconds


def make(**world):
    w = World(**world)
    core = AdmissionCore(w, clock=lambda: w.now, wall_clock=lambda: w.wall)
    return core, w


def guard(name="s", limit=1, priority=0, **settings):
    return Guard(name, limit, Settings(poll_interval=5.0, **settings), priority=priority)


_ids = iter(range(10**6))


def arrive(core, g=None, pulled=False):
    n = next(_ids)
    core.surroundings.reserved += 1
    request = SimpleNamespace(id=f"t{n}", name="tasks.t", request_dict={})
    commands = core.handle(Arrived(request, g or guard(), f"t{n}:h", pulled))
    waiter = next((w for w in core.waiters.values() if w.request is request), None)
    return waiter, commands, request


def kinds(commands):
    return [type(c).__name__ for c in commands]


def last_sent(commands):
    return [c for c in commands if isinstance(c, SendAttempt)][-1]


def answer(waiter, attempt=None, error=None, sent=None, pause=5.0, requested_at=1000.0):
    return Answered(waiter, Answer(waiter.holder, attempt, error, requested_at,
                                   waiter.attempts_sent if sent is None else sent, pause))


def wait_answer(position=0, limit=1, **kw):
    return Attempt(None, position=position, limit=limit, **kw)


def exit_of(commands):
    (done,) = [c for c in commands if isinstance(c, Exit)]
    return done


# -- a semaphore with room ----------------------------------------------------------------


def test_a_semaphore_with_room_costs_one_attempt_and_nothing_else():
    core, _ = make()
    waiter, commands, request = arrive(core)
    assert kinds(commands) == ["Watch", "SendAttempt"]
    assert commands[1].delay == 0 and commands[1].sent == 1
    commands = core.handle(answer(waiter, Attempt(GRANT, limit=1)))
    assert kinds(commands) == ["StopAttempts", "Unwatch", "Refill", "Exit"]
    assert exit_of(commands).how is How.START and exit_of(commands).answer.attempt.grant is GRANT
    assert len(core) == 0 and core.count("s") == 0 and waiter.state is WaitState.DONE


# -- waiting ------------------------------------------------------------------------------


def test_told_to_wait_raises_prefetch_reports_and_tries_again_after_the_pause():
    core, _ = make()
    waiter, _, _ = arrive(core)
    commands = core.handle(answer(waiter, wait_answer(position=2, limit=1), pause=0.7))
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "SendAttempt"]
    assert commands[1].position == 2 and last_sent(commands).delay == 0.7
    assert core.blocked("s") == 1
    # the same place again: no new report
    commands = core.handle(answer(waiter, wait_answer(position=2, limit=1), pause=0.7))
    assert kinds(commands) == ["SendAttempt"]
    # woken: try at once; granted: the prefetch goes back down
    assert kinds(core.handle(Woken(waiter, waiter.holder))) == ["SendAttempt"]
    commands = core.handle(answer(waiter, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "Unwatch", "LowerPrefetch", "Refill", "Exit"]
    assert core.blocked("s") == 0


def test_a_stale_wait_answer_does_not_cancel_the_attempt_a_wake_up_sent():
    core, _ = make()
    waiter, _, _ = arrive(core)  # attempt 1 goes out
    woken = core.handle(Woken(waiter, waiter.holder))  # the wake-up reaches the loop first
    assert last_sent(woken).sent == 2 and last_sent(woken).delay == 0
    assert core.handle(answer(waiter, wait_answer(), sent=1)) == []  # attempt 1's "wait"
    commands = core.handle(answer(waiter, Attempt(GRANT), sent=2))
    assert exit_of(commands).how is How.START


def test_a_stale_answer_that_is_a_grant_still_decides():
    core, _ = make()
    waiter, _, _ = arrive(core)
    core.handle(Woken(waiter, waiter.holder))
    assert exit_of(core.handle(answer(waiter, Attempt(GRANT), sent=1))).how is How.START


def test_a_wake_up_for_an_old_holder_or_a_waiter_not_queued_does_nothing():
    core, _ = make()
    waiter, _, _ = arrive(core)
    assert core.handle(Woken(waiter, "someone-else")) == []
    core.handle(answer(waiter, Attempt(GRANT)))
    assert core.handle(Woken(waiter, waiter.holder)) == []


def test_a_rate_due_pause_counts_from_the_send():
    core, world = make()
    waiter, _, _ = arrive(core)
    world.advance(0.3)  # the answer took 0.3 s to come back
    commands = core.handle(answer(waiter, wait_answer(rate_due=1.0, waits_for="rate"),
                                  pause=1.0, requested_at=1000.0))
    assert last_sent(commands).delay == pytest.approx(0.7)


def test_backend_down_retries_within_a_second_and_warns_once(caplog):
    core, _ = make()
    waiter, _, _ = arrive(core)
    for _ in range(3):
        commands = core.handle(answer(waiter, error=ConnectionError("refused")))
        assert kinds(commands) == ["SendAttempt"] and commands[0].delay == 1.0
    assert sum("backend unavailable" in r.getMessage() for r in caplog.records) == 1
    core.handle(answer(waiter, wait_answer()))
    assert not waiter.backend_down


def test_a_request_the_backend_refuses_fails_alone_and_leaves_its_queue():
    core, _ = make()
    waiter, _, _ = arrive(core)
    error = ConfigurationError("cost 9 above the limit 4")
    commands = core.handle(answer(waiter, error=error))
    assert kinds(commands) == ["StopAttempts", "Unwatch", "Cancel", "Refill", "Exit"]
    assert exit_of(commands).how is How.FAIL and exit_of(commands).error is error


def test_on_full_skip_or_fail_makes_one_try_and_never_queues():
    core, _ = make()
    waiter, _, _ = arrive(core, guard(on_full="skip"))
    commands = core.handle(answer(waiter, wait_answer(position=None, limit=3)))
    done = exit_of(commands)
    assert done.how is How.FULL and done.limit == 3 and done.blocking == "s"
    assert "Cancel" not in kinds(commands) and "RaisePrefetch" not in kinds(commands)


def test_several_semaphores_report_the_one_that_blocks():
    core, _ = make()
    g = Guard("a", 1, Settings(poll_interval=5.0), also=(("b", 2),))
    waiter, _, _ = arrive(core, g)
    commands = core.handle(answer(waiter, MultiAttempt(None, blocking="b", position=0, limit=2)))
    (report,) = [c for c in commands if isinstance(c, ReportWaiting)]
    assert waiter.blocking == "b" and report.limit == 2


# -- the line and the pool ------------------------------------------------------------------


def test_requests_enter_the_backends_queue_only_while_processes_are_free():
    core, world = make(processes=1)
    first, commands, _ = arrive(core)
    assert kinds(commands) == ["Watch", "SendAttempt"]
    second, commands, _ = arrive(core)
    assert commands == [] and second.state is WaitState.LINED  # one process: one per name
    other, commands, _ = arrive(core, guard("other"))
    assert commands == []  # the first attempt may take the one process
    commands = core.handle(answer(first, wait_answer()))  # told to wait: it needs none
    assert [c.waiter for c in commands if isinstance(c, Watch)] == [other]
    world.processes = 0
    assert core.handle(CapacityChanged()) == []
    world.processes = 3
    commands = core.handle(CapacityChanged())
    assert kinds(commands) == ["Watch", "SendAttempt"] and commands[0].waiter is second


def test_first_attempts_of_many_keys_never_outnumber_the_free_processes():
    """A thousand keys with room (W6): each first attempt is a grant, so no more go out than
    processes are free; none is granted only to be given back."""
    core, world = make(processes=4)
    waiters = [arrive(core, guard(f"t:{k}"))[0] for k in range(40)]
    assert sum(w.state is WaitState.QUEUED for w in waiters) == 4 and core.trying == 4
    running = 0
    for _ in range(40):
        queued = [w for w in waiters if w.state is WaitState.QUEUED]
        assert len(queued) + running <= 4
        if not queued or running == 4:
            world.ended(core)  # a task ends
            running -= 1
            continue
        commands = core.handle(answer(queued[0], Attempt(GRANT)))
        assert exit_of(commands).how is How.START and "GiveBackGrant" not in kinds(commands)
        running += 1
    while running:
        world.ended(core)
        running -= 1
        for w in [w for w in waiters if w.state is WaitState.QUEUED]:
            core.handle(answer(w, Attempt(GRANT)))
            running += 1
    assert len(core) == 0 and core.trying == 0


def test_a_priority_request_enters_the_queue_at_once_and_lines_up_ahead():
    core, world = make(processes=1)
    arrive(core)
    low, _, _ = arrive(core)
    high, commands, _ = arrive(core, guard(priority=5))
    assert kinds(commands) == ["Watch", "SendAttempt"] and high.state is WaitState.QUEUED
    world.processes = 0
    mid, _, _ = arrive(core, guard(priority=1))
    assert list(core.line) == [mid, low]  # by priority, then arrival


def test_a_grant_with_no_free_process_is_given_back_and_the_waiter_lines_up_first():
    core, world = make(processes=1)
    waiter, _, _ = arrive(core)
    behind, _, _ = arrive(core)
    world.processes = 0  # the pool filled up meanwhile
    commands = core.handle(answer(waiter, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "Unwatch", "GiveBackGrant"]
    assert waiter.state is WaitState.GRANTED
    # an answer of an earlier attempt carries this very grant: nothing to do
    assert core.handle(answer(waiter, Attempt(GRANT), sent=0)) == []
    old_holder = waiter.holder
    assert core.handle(GrantReturned(waiter, released=False, new_holder="t:new")) == []
    assert waiter.holder == "t:new" and old_holder not in core.waiters
    assert list(core.line) == [waiter, behind] and waiter.first_sent is None
    world.processes = 1
    commands = core.handle(CapacityChanged())
    assert commands[0] == Watch(waiter) and last_sent(commands).holder == "t:new"


def test_late_answers_release_a_grant_or_cancel_after_an_error():
    core, _ = make()
    waiter, _, _ = arrive(core)
    core.handle(Woken(waiter, waiter.holder))
    core.handle(answer(waiter, Attempt(GRANT), sent=2))  # started
    commands = core.handle(answer(waiter, Attempt(GRANT), sent=1))
    assert kinds(commands) == ["ReleaseLate"]  # the shell skips it if that holder runs
    gone, _, _ = arrive(core)
    core.handle(Leave(gone, How.GIVE_BACK))
    commands = core.handle(answer(gone, error=TimeoutError("lost reply"), sent=1))
    assert kinds(commands) == ["Cancel"] and commands[0].holder == gone.holder


# -- trying ahead ---------------------------------------------------------------------------


def busy(core, world, n=1, name="busy"):
    """``n`` requests of their own semaphores that start and keep their processes busy."""
    for k in range(n):
        waiter, _, _ = arrive(core, guard(f"{name}{k}"))
        assert exit_of(core.handle(answer(waiter, Attempt(GRANT)))).how is How.START


def test_with_every_process_busy_a_key_with_room_is_tried_ahead_and_waits_in_the_pool():
    """W6's handoff: the next request of an idle key is granted before a process frees, so
    it starts the moment one does (no acquire between a task's end and the next start)."""
    core, world = make(processes=1, lookahead=1)
    busy(core, world)
    waiter, commands, _ = arrive(core, guard("t:1"))
    assert kinds(commands) == ["SendAttempt"] and waiter.state is WaitState.AHEAD
    assert commands[0].ahead and commands[0].delay == 0  # wait=False: it never queues
    assert core.trying == 0 and core.trying_ahead == 1
    later, commands, _ = arrive(core, guard("t:2"))
    assert commands == [] and later.state is WaitState.LINED  # the lookahead is taken
    commands = core.handle(answer(waiter, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "Refill", "Exit"]  # no watch to stop
    assert exit_of(commands).how is How.START  # to the pool's queue, with its slot
    # the pool queues one granted request already: no more tries ahead
    assert later.state is WaitState.LINED and core.trying_ahead == 0
    world.ended(core)  # the busy task ends: the queued one takes its process
    assert later.state is WaitState.AHEAD  # the pool's queue is empty again


def test_a_refused_try_ahead_lines_up_again_in_front_and_waits_for_a_process():
    core, world = make(processes=1, lookahead=2)
    busy(core, world)
    first, _, _ = arrive(core, guard("t:1"))
    second, _, _ = arrive(core, guard("t:2"))
    assert first.state is second.state is WaitState.AHEAD
    commands = core.handle(answer(first, wait_answer()))  # t:1 is held elsewhere
    assert first.state is WaitState.LINED and first.tried_ahead and list(core.line) == [first]
    assert commands == [] and core.blocked("t:1") == 0  # nothing reported, nothing raised
    commands = core.handle(answer(second, error=ConnectionError("refused")))
    assert list(core.line) == [first, second] and second.tried_ahead
    assert "SendAttempt" not in kinds(commands)  # each tries ahead once
    commands = world.ended(core)  # a process frees: the first in line queues for it
    assert kinds(commands) == ["Watch", "SendAttempt"] and commands[0].waiter is first
    assert not commands[1].ahead


def test_no_try_ahead_for_a_semaphore_this_worker_queues_or_waits_for():
    core, world = make(processes=2, lookahead=4)
    hot, _, _ = arrive(core, guard("hot"))
    core.handle(answer(hot, wait_answer()))  # told to wait: hot is full
    busy(core, world, n=1)
    queued, commands, _ = arrive(core, guard("q"))  # the last free process: it queues
    assert queued.state is WaitState.QUEUED and core.free_processes() == 1
    behind_hot, _, _ = arrive(core, guard("hot"))
    behind_queued, _, _ = arrive(core, guard("q"))
    idle, commands, _ = arrive(core, guard("idle"))
    twin, commands2, _ = arrive(core, guard("idle"))
    assert behind_hot.state is behind_queued.state is WaitState.LINED
    assert idle.state is WaitState.AHEAD and twin.state is WaitState.LINED  # one per name
    assert [c.waiter for c in commands if isinstance(c, SendAttempt)] == [idle]
    assert commands2 == []


def test_a_priority_request_never_tries_ahead_and_lookahead_zero_turns_it_off():
    core, world = make(processes=1, lookahead=0)
    busy(core, world)
    waiter, commands, _ = arrive(core, guard("t:1"))
    assert commands == [] and waiter.state is WaitState.LINED
    core, world = make(processes=1, lookahead=1)
    busy(core, world)
    urgent, commands, _ = arrive(core, guard("t:1", priority=3))
    assert urgent.state is WaitState.LINED and commands == []  # it queues once one frees
    commands = world.ended(core)
    assert urgent.state is WaitState.QUEUED and not last_sent(commands).ahead


def test_a_try_ahead_counts_against_the_process_it_would_take():
    """A process frees while a try ahead is in flight: its grant takes that process, so the
    next in line does not queue for it as well."""
    core, world = make(processes=1, lookahead=1)
    busy(core, world)
    waiter, _, _ = arrive(core, guard("t:1"))
    nxt, _, _ = arrive(core, guard("t:2"))
    assert nxt.state is WaitState.LINED
    commands = world.ended(core)  # the free process is the try ahead's: nxt may only try
    assert nxt.state is WaitState.AHEAD and kinds(commands) == ["SendAttempt"]  # ahead too
    assert core.trying == 0 and core.trying_ahead == 2
    commands = core.handle(answer(waiter, Attempt(GRANT)))
    assert exit_of(commands).how is How.START


def test_a_one_try_policy_never_tries_ahead_and_a_waiter_leaving_ahead_cancels():
    """A skip or fail policy makes its one try once a process is free for it (as
    documented: a duplicate sent meanwhile is judged then), never ahead."""
    core, world = make(processes=1, lookahead=1)
    busy(core, world)
    skip, commands, _ = arrive(core, guard("t:1", on_full="skip"))
    assert skip.state is WaitState.LINED and commands == []
    gone, _, _ = arrive(core, guard("t:2"))
    assert gone.state is WaitState.AHEAD
    commands = core.handle(Leave(gone, How.GIVE_BACK))
    assert kinds(commands) == ["StopAttempts", "Cancel", "Refill", "Exit"]
    assert core.trying_ahead == 0 and core.counts.ahead == {}
    # its try's grant arrives after it left: released, never kept
    assert kinds(core.handle(answer(gone, Attempt(GRANT)))) == ["ReleaseLate"]


# -- the waiting room -----------------------------------------------------------------------


def test_beyond_its_share_a_waiter_told_to_wait_is_parked_and_leaves_the_queue():
    core, world = make(room=1)  # this worker's share of "s": one waiter
    first, _, _ = arrive(core)
    second, _, _ = arrive(core)  # both asked before either was told to wait
    commands = core.handle(answer(first, wait_answer(position=0)))
    assert kinds(commands) == ["StopAttempts", "Unwatch", "Cancel", "Refill", "Exit"]
    assert exit_of(commands).how is How.PARK and "RaisePrefetch" not in kinds(commands)
    commands = core.handle(answer(second, wait_answer(position=0)))  # within the share now
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "SendAttempt"]


def test_an_arrival_while_full_and_beyond_the_share_parks_without_asking_the_backend():
    core, world = make(room=2)
    first, _, _ = arrive(core)
    core.handle(answer(first, wait_answer()))
    second, commands, _ = arrive(core)
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "Watch", "SendAttempt"]
    assert commands[1].position is None  # in the line, waiting for the same slot: WAITING
    third, commands, _ = arrive(core)
    assert kinds(commands) == ["Refill", "Exit"] and exit_of(commands).how is How.PARK
    # pulled from the waiting room, or above the default priority: never parked again
    pulled, commands, _ = arrive(core, pulled=True)
    assert "Exit" not in kinds(commands) and "RaisePrefetch" not in kinds(commands)
    high, commands, _ = arrive(core, guard(priority=3))
    assert "Exit" not in kinds(commands)


# -- bounds and leaving ---------------------------------------------------------------------


def test_max_wait_fails_a_waiter_and_worker_max_hold_parks_or_requeues_it():
    core, world = make()
    late, _, _ = arrive(core, guard(max_wait=10.0))
    held, _, _ = arrive(core, guard("h", worker_max_hold=30.0))
    urgent, _, _ = arrive(core, guard("u", priority=2, worker_max_hold=30.0))
    assert [c for c in core.handle(Tick()) if isinstance(c, Exit)] == []
    world.advance(11)
    (failed,) = [c for c in core.handle(Tick()) if isinstance(c, Exit)]
    assert failed.waiter is late and isinstance(failed.error, SemaphoreTimeout)
    world.advance(20)
    exits = {c.waiter.guard.name: c.how for c in core.handle(Tick()) if isinstance(c, Exit)}
    assert exits == {"h": How.PARK, "u": How.REQUEUE}
    assert len(core) == 0


def test_a_waiter_leaves_exactly_once_with_the_same_cleanup_every_way():
    for how in (How.GIVE_BACK, How.LET_GO, How.PARK, How.REQUEUE):
        core, _ = make()
        waiter, _, _ = arrive(core)
        core.handle(answer(waiter, wait_answer()))  # raised the prefetch, in the queue
        commands = core.handle(Leave(waiter, how))
        assert kinds(commands)[:5] == ["StopAttempts", "Unwatch", "LowerPrefetch", "Cancel",
                                       "Refill"], how
        assert exit_of(commands).how is how
        assert core.handle(Leave(waiter, how)) == [] and core.handle(Revoked(waiter)) == []
        assert core.counts.waiting == core.counts.blocked == core.counts.queued == {}


def test_a_revoked_waiter_in_the_line_leaves_without_touching_the_backend():
    core, _ = make(processes=0)
    waiter, commands, _ = arrive(core)
    assert commands == []
    commands = core.handle(Revoked(waiter))
    assert kinds(commands) == ["Refill", "Exit"] and exit_of(commands).how is How.REVOKED
    assert not core.line


def test_the_shell_carries_out_every_command_the_core_can_emit():
    from celery_semaphore.worker.admission import Admission
    from celery_semaphore.worker.core import Command

    shell = Admission(SimpleNamespace(backend=None), None, None, None, None, None,
                      hand_off=print, give_back=print)
    assert set(shell._carry_out) == set(Command.__args__)


def test_wake_ups_beyond_the_free_processes_wait_for_one():
    """Many keys' waiters woken at once (500 keys x 2): as many try as processes are free, the
    others once one is, instead of being granted a slot only to give it back."""
    core, world = make(processes=2)
    waiters = [arrive(core, guard(f"t:{k}"))[0] for k in range(2)]
    for waiter in waiters:
        core.handle(answer(waiter, wait_answer()))  # both told to wait: no attempt in flight
    waiters += [arrive(core, guard(f"t:{k}"))[0] for k in range(2, 4)]
    for waiter in waiters[2:]:
        core.handle(answer(waiter, wait_answer()))
    assert core.trying == 0 and all(w.state is WaitState.QUEUED for w in waiters)
    world.processes = 1
    sent = [core.handle(Woken(w, w.holder)) for w in waiters]
    assert [kinds(c) for c in sent] == [["SendAttempt"]] * 4 and core.trying == 1
    # the first tries at once; the others at the latest after WAKE_DEFER_MAX
    assert [c[0].delay for c in sent] == [0, WAKE_DEFER_MAX, WAKE_DEFER_MAX, WAKE_DEFER_MAX]
    assert list(core.woken) == waiters[1:]
    assert exit_of(core.handle(answer(waiters[0], Attempt(GRANT)))).how is How.START
    assert core.trying == 0 and len(core.woken) == 3  # it runs in the one process
    world.processes = 2  # another process is free
    commands = world.ended(core)  # ...and the task ended
    assert [c.waiter for c in commands if isinstance(c, SendAttempt)] == waiters[1:3]
    assert core.trying == 2 and list(core.woken) == waiters[3:]
    core.handle(Leave(waiters[3], How.GIVE_BACK))  # a pending one leaves: skipped later
    core.handle(answer(waiters[1], wait_answer()))  # taken by someone else: waits again
    assert core.trying == 1 and not waiters[3].wake_pending  # its entry is dropped when reached


def test_a_wake_up_with_every_process_busy_tries_so_that_the_slot_moves_on():
    """No process free and none promised: the woken waiter tries anyway; a grant is given back
    at once, and the backend wakes whoever waits behind it (in a worker with room)."""
    core, world = make(processes=1)
    waiter, _, _ = arrive(core)
    core.handle(answer(waiter, wait_answer()))
    world.processes = 0  # busy with other work
    assert kinds(core.handle(Woken(waiter, waiter.holder))) == ["SendAttempt"]
    commands = core.handle(answer(waiter, Attempt(GRANT)))
    assert "GiveBackGrant" in kinds(commands)


def test_peers_lined_behind_a_first_attempt_report_waiting_once_it_is_told_to_wait():
    """Flower's case: three of one key reach the worker in a burst while the slot is held; the
    first asks, the others wait in the line; once the first is told to wait, the others show
    WAITING too (they wait for the same slot), once each."""
    core, world = make(processes=1)
    first, _, _ = arrive(core)
    lined = [arrive(core)[0] for _ in range(2)]
    assert all(w.state is WaitState.LINED for w in lined)
    commands = core.handle(answer(first, wait_answer(position=0)))
    reports = [c for c in commands if isinstance(c, ReportWaiting)]
    assert [(r.waiter, r.position) for r in reports] == [(lined[0], None), (lined[1], None),
                                                         (first, 0)]
    assert kinds(commands).count("RaisePrefetch") == 3
    other, _, _ = arrive(core)  # arriving now: reported at once, and only then
    assert other.announced
    commands = core.handle(answer(first, wait_answer(position=0)))
    assert not [c for c in commands if isinstance(c, ReportWaiting)]
