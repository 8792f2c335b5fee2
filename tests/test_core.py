"""The worker core (:mod:`celery_semaphore.worker.core`), driven event by event: no threads, no
Celery, no backend. Each test feeds events and checks the commands that come out, in order;
the clock and what the core reads of the pool are the test's. Assertions read the commands and
the core's public readings (``len``, ``count``, ``blocked``, ``free_processes``, ``room``), not
its private bookkeeping."""

from types import SimpleNamespace

import pytest

from celery_semaphore.backends.base import Attempt, Grant, MultiAttempt, PushedGrant
from celery_semaphore.exceptions import ConfigurationError, SemaphoreTimeout
from celery_semaphore.guards import Guard
from celery_semaphore.settings import Settings
from celery_semaphore.worker.claim import TRANSITIONS, State
from celery_semaphore.worker.core import (
    CHILD_EXIT_WAIT,
    WAKE_DEFER_MAX,
    Answer,
    Answered,
    Arrived,
    CapacityChanged,
    ChildExited,
    ChildFacts,
    Command,
    Ended,
    Exit,
    GrantReturned,
    How,
    LetGo,
    PoolFlushed,
    Pushed,
    Release,
    Renew,
    Renewed,
    ReportWaiting,
    Revoked,
    SendAttempt,
    Start,
    Stop,
    Tick,
    Woken,
    WorkerCore,
)

GRANT = Grant(slot=0, epoch=1, expires_at=0.0, ttl=60.0)


class World:
    """The core's surroundings and clocks, set by the test."""

    def __init__(self, processes=4, lookahead=0, max_waiting=100):
        self.processes = processes
        self.ahead = lookahead
        self.waiting_max = max_waiting
        self.pulls = {}  # name -> requests being pulled
        self.children = {}  # pid -> ChildFacts
        self.forgotten = set()  # ids of requests Celery no longer holds
        self.now = 1000.0
        self.wall = 1_700_000_000.0

    def pool_size(self):
        return self.processes

    def lookahead(self):
        return self.ahead

    def pulling(self, name):
        return self.pulls.get(name, 0), sum(self.pulls.values())

    def max_waiting(self):
        return self.waiting_max

    def child(self, pid):
        return self.children.get(pid, ChildFacts(pid, alive=False, busy=False, up=False))

    def orphan_child(self, claim):
        return self.child(claim.child)

    def held_by_celery(self, request):
        return id(request) not in self.forgotten

    def advance(self, seconds):
        self.now += seconds
        self.wall += seconds


def make(**world):
    w = World(**world)
    core = WorkerCore(w, clock=lambda: w.now, wall_clock=lambda: w.wall)
    return core, w


def guard(name="s", limit=1, priority=0, **settings):
    return Guard(name, limit, Settings(poll_interval=5.0, **settings), priority=priority)


_ids = iter(range(10**6))


def arrive(core, g="default", pulled=False):
    """A request reaches the core; returns its claim (from what the core emits: the claim
    its first command names, or a lookup by request), the commands and the request."""
    n = next(_ids)
    request = SimpleNamespace(id=f"t{n}", name="tasks.t", request_dict={})
    g = guard() if g == "default" else g
    commands = core.handle(Arrived(request, g, f"t{n}:h" if g is not None else "", pulled))
    return claim_of(core, request, commands), commands, request


def claim_of(core, request, commands=()):
    for command in commands:
        claim = getattr(command, "claim", None)
        if claim is not None and claim.request is request:
            return claim
    return next((c for c in core.waiters.values() if c.request is request), None)


def kinds(commands):
    return [type(c).__name__ for c in commands]


def last_sent(commands):
    return [c for c in commands if isinstance(c, SendAttempt)][-1]


def answer(claim, attempt=None, error=None, sent=None, pause=5.0, requested_at=1000.0):
    return Answered(claim, Answer(claim.holder, attempt, error, requested_at,
                                  claim.attempts_sent if sent is None else sent, pause))


def wait_answer(position=0, limit=1, **kw):
    return Attempt(None, position=position, limit=limit, **kw)


def exit_of(commands):
    (done,) = [c for c in commands if isinstance(c, Exit)]
    return done


def started(commands):
    return [c.claim for c in commands if isinstance(c, Start)]


def releases(commands):
    return [(c.names, c.holder) for c in commands if isinstance(c, Release)]


def run(core, claim, attempt=None):
    """``claim``'s attempt comes back granted: it goes to the pool."""
    commands = core.handle(answer(claim, attempt or Attempt(GRANT, limit=1)))
    assert started(commands) == [claim], kinds(commands)
    return commands


# -- a semaphore with room ----------------------------------------------------------------


def test_a_semaphore_with_room_costs_one_attempt_then_one_release():
    core, _ = make()
    claim, commands, request = arrive(core)
    assert kinds(commands) == ["SendAttempt"]
    assert commands[0].delay == 0 and commands[0].sent == 1 and not commands[0].ahead
    commands = core.handle(answer(claim, Attempt(GRANT, limit=1), requested_at=999.0))
    assert kinds(commands) == ["StopAttempts", "Refill", "Start"]
    assert claim.grants == {"s": GRANT} and claim.deadline == 999.0 + GRANT.ttl
    assert len(core) == 0 and core.count("s") == 0 and core.free_processes() == 3
    commands = core.handle(Ended(claim))
    assert kinds(commands) == ["Release"]
    assert commands[0].names == ("s",) and commands[0].holder == claim.holder
    assert commands[0].until == claim.deadline
    assert core.free_processes() == 4
    assert core.handle(Ended(claim)) == []  # released exactly once


def test_an_unguarded_request_goes_straight_to_the_pool_and_takes_a_process():
    core, _ = make(processes=1)
    claim, commands, _ = arrive(core, None)
    assert kinds(commands) == ["Start"] and claim.grants is None
    waiting, commands, _ = arrive(core)  # no process free: it waits in the line
    assert commands == [] and waiting.state is State.LINED
    commands = core.handle(Ended(claim))
    assert kinds(commands) == ["SendAttempt"] and commands[0].claim is waiting
    assert "Release" not in kinds(commands)  # an unguarded request holds no slot


# -- waiting ------------------------------------------------------------------------------


def test_told_to_wait_raises_prefetch_reports_and_tries_again_after_the_pause():
    core, _ = make()
    claim, _, _ = arrive(core)
    commands = core.handle(answer(claim, wait_answer(position=2, limit=1), pause=0.7))
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "SendAttempt"]
    assert commands[1].position == 2 and last_sent(commands).delay == 0.7
    assert core.blocked("s") == 1
    # the same place again: no new report
    commands = core.handle(answer(claim, wait_answer(position=2, limit=1), pause=0.7))
    assert kinds(commands) == ["SendAttempt"]
    # woken: try at once; granted: the prefetch goes back down
    assert kinds(core.handle(Woken(claim, claim.holder))) == ["SendAttempt"]
    commands = core.handle(answer(claim, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "LowerPrefetch", "Refill", "Start"]
    assert core.blocked("s") == 0


def test_a_stale_wait_answer_does_not_cancel_the_attempt_a_wake_up_sent():
    core, _ = make()
    claim, _, _ = arrive(core)  # attempt 1 goes out
    woken = core.handle(Woken(claim, claim.holder))  # the wake-up reaches the loop first
    assert last_sent(woken).sent == 2 and last_sent(woken).delay == 0
    assert core.handle(answer(claim, wait_answer(), sent=1)) == []  # attempt 1's "wait"
    assert started(core.handle(answer(claim, Attempt(GRANT), sent=2))) == [claim]


def test_a_stale_answer_that_is_a_grant_still_decides():
    core, _ = make()
    claim, _, _ = arrive(core)
    core.handle(Woken(claim, claim.holder))
    assert started(core.handle(answer(claim, Attempt(GRANT), sent=1))) == [claim]


def test_a_wake_up_for_an_old_holder_or_a_claim_not_queued_does_nothing():
    core, _ = make()
    claim, _, _ = arrive(core)
    assert core.handle(Woken(claim, "someone-else")) == []
    run(core, claim)
    assert core.handle(Woken(claim, claim.holder)) == []


def test_a_rate_due_pause_counts_from_the_send():
    core, world = make()
    claim, _, _ = arrive(core)
    world.advance(0.3)  # the answer took 0.3 s to come back
    commands = core.handle(answer(claim, wait_answer(rate_due=1.0, waits_for="rate"),
                                  pause=1.0, requested_at=1000.0))
    assert last_sent(commands).delay == pytest.approx(0.7)


def test_backend_down_keeps_the_request_waiting_and_tries_after_the_poll_interval():
    core, _ = make()
    claim, _, _ = arrive(core)
    for _ in range(3):
        commands = core.handle(answer(claim, error=ConnectionError("refused")))
        assert kinds(commands) == ["SendAttempt"] and commands[0].delay == 5.0
    assert len(core) == 1  # never runs unguarded, never fails for it


def test_a_request_the_backend_refuses_fails_alone_and_leaves_its_queue():
    core, _ = make()
    claim, _, _ = arrive(core)
    error = ConfigurationError("cost 9 above the limit 4")
    commands = core.handle(answer(claim, error=error))
    assert kinds(commands) == ["StopAttempts", "Cancel", "Refill", "Exit"]
    assert exit_of(commands).how is How.FAIL and exit_of(commands).error is error


def test_on_full_skip_or_fail_makes_one_try_and_never_queues():
    core, _ = make()
    claim, _, _ = arrive(core, guard(on_full="skip"))
    commands = core.handle(answer(claim, wait_answer(position=None, limit=3)))
    done = exit_of(commands)
    assert done.how is How.FULL and done.limit == 3 and done.blocking == "s"
    assert "Cancel" not in kinds(commands) and "RaisePrefetch" not in kinds(commands)


def test_a_call_waiting_out_a_pause_reports_until_when_and_again_when_the_pause_moves():
    """Waiting for a pause (or a quota window): the report says until when, as a Unix time
    (the backend's seconds left, counted from when the attempt was sent); a pause extended
    by more than a second is reported again, the same end is not; waiting for a slot has no
    end to report."""
    core, w = make()
    claim, _, _ = arrive(core, guard())
    w.advance(0.5)  # the answer arrives 0.5 s after the attempt was sent (at now - 0.5)
    commands = core.handle(answer(claim, wait_answer(waits_for="pause", due=30.0),
                                  requested_at=w.now - 0.5))
    (report,) = [c for c in commands if isinstance(c, ReportWaiting)]
    assert report.until == round(w.wall + 29.5, 1)
    w.advance(5.0)  # the same pause, asked again: nothing new to say
    commands = core.handle(answer(claim, wait_answer(waits_for="pause", due=24.7),
                                  requested_at=w.now))
    assert not [c for c in commands if isinstance(c, ReportWaiting)]
    commands = core.handle(answer(claim, wait_answer(waits_for="pause", due=60.0),
                                  requested_at=w.now))  # another Backoff extended it
    (report,) = [c for c in commands if isinstance(c, ReportWaiting)]
    assert report.until == round(w.wall + 60.0, 1)
    commands = core.handle(answer(claim, wait_answer(waits_for="slots"), requested_at=w.now))
    (report,) = [c for c in commands if isinstance(c, ReportWaiting)]
    assert report.until is None


def test_several_semaphores_report_the_one_that_blocks_and_hold_every_grant():
    core, _ = make()
    g = Guard("a", 1, Settings(poll_interval=5.0), also=(("b", 2),))
    claim, _, _ = arrive(core, g)
    commands = core.handle(answer(claim, MultiAttempt(None, blocking="b", position=0, limit=2)))
    (report,) = [c for c in commands if isinstance(c, ReportWaiting)]
    assert report.claim.blocking == "b" and report.limit == 2
    other = Grant(slot=1, epoch=7, expires_at=0.0, ttl=30.0)
    commands = core.handle(answer(claim, MultiAttempt({"a": GRANT, "b": other},
                                                      limits={"a": 1, "b": 2})))
    assert started(commands) == [claim] and claim.limits == {"a": 1, "b": 2}
    assert claim.ttl == 30.0  # the shortest lease of the group
    assert releases(core.handle(Ended(claim))) == [(("a", "b"), claim.holder)]


# -- pushed grants ------------------------------------------------------------------------


def pushed(claim, ttl=60.0, name="s"):
    return Pushed(claim, PushedGrant(name, claim.holder, Grant(2, 9, 0.0, ttl), 1, 0.0))


def test_a_pushed_grant_starts_a_queued_claim_with_a_deadline_from_its_last_wait():
    core, world = make()
    claim, _, _ = arrive(core)
    world.advance(1.0)
    core.handle(answer(claim, wait_answer(), pause=0.5, requested_at=1000.0))
    world.advance(0.5)
    commands = core.handle(pushed(claim))
    assert kinds(commands) == ["StopAttempts", "LowerPrefetch", "Refill", "Start"]
    # the grant was made after the attempt answered "wait" reached the backend, or after
    # the one still on its way (sent at 1001.0): counted from the earlier of them
    assert claim.deadline == 1000.0 + 60.0
    # the answer of the attempt on its way carries the very same grant: nothing more
    assert core.handle(answer(claim, Attempt(GRANT))) == []


def test_a_pushed_grant_for_a_claim_that_left_or_runs_does_nothing():
    core, _ = make()
    claim, _, _ = arrive(core)
    run(core, claim)
    assert core.handle(pushed(claim)) == []
    gone, _, _ = arrive(core)
    core.handle(Revoked(gone))
    assert core.handle(pushed(gone)) == []  # (its cancel releases that grant)


def test_a_pushed_grant_with_no_free_process_is_given_back():
    core, world = make(processes=1)
    claim, _, _ = arrive(core)
    core.handle(answer(claim, wait_answer()))
    arrive(core, None)  # an unguarded request takes the one process
    commands = core.handle(pushed(claim))
    assert kinds(commands) == ["StopAttempts", "GiveBackGrant"]
    assert commands[1].holder == claim.holder and commands[1].names == ("s",)


# -- the line and the pool ------------------------------------------------------------------


def test_requests_enter_the_backends_queue_only_while_processes_are_free():
    core, world = make(processes=1)
    first, commands, _ = arrive(core)
    assert kinds(commands) == ["SendAttempt"]
    second, commands, _ = arrive(core)
    assert commands == []  # one process: one per name
    other, commands, _ = arrive(core, guard("other"))
    assert commands == []  # the first attempt may take the one process
    commands = core.handle(answer(first, wait_answer()))  # told to wait: it needs none
    assert [c.claim for c in commands if isinstance(c, SendAttempt)][-1] is other
    world.processes = 0
    assert core.handle(CapacityChanged()) == []
    world.processes = 3
    commands = core.handle(CapacityChanged())
    assert kinds(commands) == ["SendAttempt"] and commands[0].claim is second


def test_first_attempts_of_many_keys_never_outnumber_the_free_processes():
    """A thousand keys with room (W6): each first attempt is a grant, so no more go out than
    processes are free; none is granted only to be given back."""
    core, world = make(processes=4)
    sent = []
    for k in range(40):
        _, commands, _ = arrive(core, guard(f"t:{k}"))
        sent += [c.claim for c in commands if isinstance(c, SendAttempt)]
    assert len(sent) == 4
    running = []
    done = 0
    while done < 40:
        if sent:
            commands = core.handle(answer(sent.pop(0), Attempt(GRANT)))
            assert "GiveBackGrant" not in kinds(commands)
            running += started(commands)
            sent += [c.claim for c in commands if isinstance(c, SendAttempt)]
        else:
            commands = core.handle(Ended(running.pop(0)))
            done += 1
            sent += [c.claim for c in commands if isinstance(c, SendAttempt)]
        assert len(sent) + len(running) <= 4
    assert len(core) == 0 and core.free_processes() == 4


def test_a_priority_request_enters_the_queue_at_once_and_lines_up_ahead():
    core, world = make(processes=1)
    arrive(core)
    low, _, _ = arrive(core)
    high, commands, _ = arrive(core, guard(priority=5))
    assert kinds(commands) == ["SendAttempt"] and commands[0].claim is high
    world.processes = 0
    mid, _, _ = arrive(core, guard(priority=1))
    world.processes = 3
    commands = core.handle(CapacityChanged())
    assert [c.claim for c in commands if isinstance(c, SendAttempt)][:1] == [mid]


def test_a_grant_with_no_free_process_is_given_back_and_the_claim_lines_up_first():
    core, world = make(processes=1)
    claim, _, _ = arrive(core)
    behind, _, _ = arrive(core)
    world.processes = 0  # the pool filled up meanwhile
    commands = core.handle(answer(claim, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "GiveBackGrant"]
    # an answer of an earlier attempt carries this very grant: nothing to do
    assert core.handle(answer(claim, Attempt(GRANT), sent=0)) == []
    assert core.handle(GrantReturned(claim, released=False, new_holder="t:new")) == []
    world.processes = 1
    commands = core.handle(CapacityChanged())
    assert [(c.claim, c.holder) for c in commands if isinstance(c, SendAttempt)] == [
        (claim, "t:new")]  # first in line, under its new holder id


def test_late_answers_release_a_grant_or_cancel_after_an_error():
    core, _ = make()
    claim, _, _ = arrive(core)
    core.handle(Woken(claim, claim.holder))
    run(core, claim)  # attempt 2's grant started it
    assert core.handle(answer(claim, Attempt(GRANT), sent=1)) == []  # it holds that grant
    gone, _, _ = arrive(core)
    core.handle(Revoked(gone))
    commands = core.handle(answer(gone, Attempt(GRANT), sent=1))
    assert releases(commands) == [(("s",), gone.holder)]  # a grant nobody runs with
    lost, _, _ = arrive(core)
    core.handle(Revoked(lost))
    commands = core.handle(answer(lost, error=TimeoutError("lost reply"), sent=1))
    assert kinds(commands) == ["Cancel"] and commands[0].holder == lost.holder


# -- holding: release, renewal, killed children, reconnects --------------------------------


def test_a_held_lease_is_renewed_every_third_of_its_ttl_and_lost_when_gone():
    core, world = make()
    claim, _, _ = arrive(core)
    run(core, claim, Attempt(Grant(0, 1, 0.0, 30.0)))
    assert core.tick_every(5.0) == 5.0  # a sixth of the TTL
    world.advance(9.0)
    assert "Renew" not in kinds(core.handle(Tick()))
    world.advance(1.5)
    (renew,) = [c for c in core.handle(Tick()) if isinstance(c, Renew)]
    assert renew.names == ("s",) and renew.ttl == 30.0
    assert "Renew" not in kinds(core.handle(Tick()))  # one at a time
    core.handle(Renewed(claim, world.now, held=True))
    assert claim.deadline == world.now + 30.0
    world.advance(10.5)
    (renew,) = [c for c in core.handle(Tick()) if isinstance(c, Renew)]
    assert kinds(core.handle(Renewed(claim, world.now, held=False))) == ["LeaseLost"]
    assert "LeaseLost" not in kinds(core.handle(Tick()))  # reported once
    assert releases(core.handle(Ended(claim))) == [(("s",), claim.holder)]


def test_a_lease_not_renewed_by_its_deadline_is_lost():
    core, world = make()
    claim, _, _ = arrive(core)
    run(core, claim, Attempt(Grant(0, 1, 0.0, 30.0)), )
    world.advance(11)
    core.handle(Tick())
    core.handle(Renewed(claim, world.now, held=False, error=ConnectionError("down")))
    world.advance(20)
    assert "LeaseLost" in kinds(core.handle(Tick()))


def test_a_killed_childs_slot_is_kept_until_the_child_exits():
    core, world = make(processes=1)
    claim, _, _ = arrive(core)
    run(core, claim)
    nxt, _, _ = arrive(core)
    commands = core.handle(Ended(claim, killed=4242))
    assert kinds(commands) == ["WatchChild", "SendAttempt"]  # the process is free: next
    assert commands[0].pid == 4242 and releases(commands) == []
    world.children[4242] = ChildFacts(4242, alive=True, busy=False, up=False)
    assert releases(core.handle(Tick())) == []
    assert releases(core.handle(ChildExited(4242))) == [(("s",), claim.holder)]
    assert core.handle(ChildExited(4242)) == []


def test_a_killed_childs_slot_goes_at_the_latest_after_the_wait_or_when_seen_gone():
    core, world = make()
    claim, _, _ = arrive(core)
    run(core, claim)
    core.handle(Ended(claim, killed=7))
    world.children[7] = ChildFacts(7, alive=True, busy=False, up=False)
    world.advance(CHILD_EXIT_WAIT + 1)
    assert releases(core.handle(Tick())) == [(("s",), claim.holder)]
    other, _, _ = arrive(core)
    run(core, other)
    core.handle(Ended(other, killed=8))  # 8 is gone already (no pidfd: the tick sees it)
    assert releases(core.handle(Tick())) == [(("s",), other.holder)]


def test_a_reconnects_flush_releases_dropped_jobs_and_orphans_wait_for_their_child():
    core, world = make(processes=4)
    dropped, _, _ = arrive(core)
    run(core, dropped)
    orphan, _, _ = arrive(core)
    run(core, orphan)
    plain, _, _ = arrive(core, None)
    commands = core.handle(PoolFlushed(((dropped, None), (orphan, 11), (plain, 12))))
    assert kinds(commands) == ["Dropped", "Release"] and commands[0].claim is dropped
    assert core.free_processes() == 2  # the orphans' children are busy with them
    # 11 runs it still (nothing Celery knows of runs there); 12 exited
    world.children[11] = ChildFacts(11, alive=True, busy=False, up=False)
    world.children[12] = ChildFacts(12, alive=False, busy=False, up=False)
    commands = core.handle(Tick())
    assert [(c.claim, c.requeue) for c in commands if type(c).__name__ == "Settle"] == [
        (plain, True)]  # it may have died before running it: delivered again
    world.children[11] = ChildFacts(11, alive=True, busy=True, up=True)  # moved on: it ran
    commands = core.handle(Tick())
    assert [(c.claim, c.requeue) for c in commands if type(c).__name__ == "Settle"] == [
        (orphan, False)]
    assert releases(commands) == [(("s",), orphan.holder)]
    assert core.free_processes() == 4
    assert core.handle(Ended(orphan)) == []  # no callback comes; if one did: nothing twice


def test_an_idle_orphans_child_counts_as_moved_on_after_a_lease_ttl():
    core, world = make()
    orphan, _, _ = arrive(core)
    run(core, orphan)
    core.handle(PoolFlushed(((orphan, 5),)))
    world.children[5] = ChildFacts(5, alive=True, busy=False, up=True)
    assert "Settle" not in kinds(core.handle(Tick()))  # first seen up now
    world.advance(GRANT.ttl + 1)
    assert "Settle" in kinds(core.handle(Tick()))


def test_an_orphan_whose_child_reported_it_done_is_acknowledged_even_if_the_child_is_gone():
    """Chaos seed 4242028: the job of an orphan went to the child that replaced a killed one,
    which ran it to its end; the pool killed that child a moment later (its start-up message
    unread while the worker reconnected and was frozen), and the gate put the message back
    as from a child that "exited or never started it": the task ran twice. A child's report
    that the job is done settles it as run (acknowledged, slot released) at the next tick,
    alive or not, idle or not."""
    core, world = make(processes=4)
    gone, _, _ = arrive(core)
    run(core, gone)
    idle, _, _ = arrive(core)
    run(core, idle)
    core.handle(PoolFlushed(((gone, 5), (idle, 6))))
    world.children[5] = ChildFacts(5, alive=False, busy=False, up=False, took_job=True,
                                   ran_job=True)
    world.children[6] = ChildFacts(6, alive=True, busy=False, up=True, took_job=True,
                                   ran_job=True)
    commands = core.handle(Tick())
    assert [(c.claim, c.requeue, c.ran) for c in commands if type(c).__name__ == "Settle"] == [
        (gone, False, True), (idle, False, True)]
    assert sorted(releases(commands)) == sorted([(("s",), gone.holder), (("s",), idle.holder)])
    assert core.free_processes() == 4
    # without the report, a child that exited may have died before running it: put back
    other, _, _ = arrive(core)
    run(core, other)
    core.handle(PoolFlushed(((other, 7),)))
    world.children[7] = ChildFacts(7, alive=False, busy=False, up=False, took_job=True)
    assert [(c.claim, c.requeue) for c in core.handle(Tick())
            if type(c).__name__ == "Settle"] == [(other, True)]


def test_an_orphan_whose_job_no_child_started_is_put_back_once_its_child_moved_on():
    """A child acknowledges a job as it starts it: one up and idle for a lease TTL, or busy
    with a later request, that never acknowledged the orphan's job never got it (the job was
    lost with the pipe of a child that exited, or with the pool's buffer). Its message goes
    back to be delivered again; a job the child did take is acknowledged."""
    core, world = make(processes=4)
    idle, _, _ = arrive(core)
    run(core, idle)
    busy_after, _, _ = arrive(core)
    run(core, busy_after)
    took, _, _ = arrive(core)
    run(core, took)
    core.handle(PoolFlushed(((idle, 5), (busy_after, 6), (took, 7))))
    world.children[5] = ChildFacts(5, alive=True, busy=False, up=True, took_job=False)
    world.children[6] = ChildFacts(6, alive=True, busy=True, up=True, took_job=False)
    world.children[7] = ChildFacts(7, alive=True, busy=False, up=True, took_job=True)
    settled = [(c.claim, c.requeue) for c in core.handle(Tick()) if type(c).__name__ == "Settle"]
    assert settled == [(busy_after, True)]  # it moved on without ever starting it
    world.advance(GRANT.ttl + 1)
    commands = core.handle(Tick())
    assert [(c.claim, c.requeue) for c in commands if type(c).__name__ == "Settle"] == [
        (idle, True), (took, False)]
    assert sorted(releases(commands)) == sorted([(("s",), idle.holder), (("s",), took.holder)])
    assert core.free_processes() == 4


def test_a_request_celery_forgot_leaves_the_pool():
    core, world = make(processes=1)
    claim, _, request = arrive(core)
    run(core, claim)
    world.forgotten.add(id(request))  # revoked unseen, say: no callback will come
    assert releases(core.handle(Tick())) == [(("s",), claim.holder)]
    assert core.free_processes() == 1


def test_shutdown_releases_every_slot_still_held():
    core, world = make()
    a, _, _ = arrive(core)
    run(core, a)
    b, _, _ = arrive(core)
    run(core, b)
    core.handle(Ended(b, killed=3))  # its child never exits: the pool has stopped
    world.children[3] = ChildFacts(3, alive=True, busy=False, up=False)
    assert sorted(releases(core.shutdown())) == sorted([(("s",), a.holder),
                                                        (("s",), b.holder)])
    assert core.shutdown() == []


# -- trying ahead ---------------------------------------------------------------------------


def busy(core, n=1, name="busy"):
    """``n`` requests of their own semaphores that start and keep their processes busy."""
    claims = []
    for k in range(n):
        claim, _, _ = arrive(core, guard(f"{name}{k}"))
        run(core, claim)
        claims.append(claim)
    return claims


def test_with_every_process_busy_a_key_with_room_is_tried_ahead_and_waits_in_the_pool():
    """W6's handoff: the next request of an idle key is granted before a process frees, so
    it starts the moment one does (no acquire between a task's end and the next start)."""
    core, world = make(processes=1, lookahead=1)
    (running,) = busy(core)
    claim, commands, _ = arrive(core, guard("t:1"))
    assert kinds(commands) == ["SendAttempt"]
    assert commands[0].ahead and commands[0].delay == 0  # wait=False: it never queues
    later, commands, _ = arrive(core, guard("t:2"))
    assert commands == []  # the lookahead is taken
    commands = core.handle(answer(claim, Attempt(GRANT)))
    assert kinds(commands) == ["StopAttempts", "Refill", "Start"]  # to the pool's queue
    assert core.free_processes() == -1  # it waits there for the next process
    commands = core.handle(Ended(running))  # the queued one takes that process
    assert kinds(commands) == ["Release", "SendAttempt"]
    assert commands[1].claim is later and commands[1].ahead  # the pool's queue is empty again


def test_a_refused_try_ahead_lines_up_again_in_front_and_waits_for_a_process():
    core, world = make(processes=1, lookahead=2)
    (running,) = busy(core)
    first, _, _ = arrive(core, guard("t:1"))
    second, _, _ = arrive(core, guard("t:2"))
    commands = core.handle(answer(first, wait_answer()))  # t:1 is held elsewhere
    assert commands == [] and core.blocked("t:1") == 0  # nothing reported, nothing raised
    commands = core.handle(answer(second, error=ConnectionError("refused")))
    assert "SendAttempt" not in kinds(commands)  # each tries ahead once
    commands = core.handle(Ended(running))  # a process frees: the first in line queues for it
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (first, False)]


def test_no_try_ahead_for_a_semaphore_this_worker_queues_or_waits_for():
    core, world = make(processes=2, lookahead=4)
    hot, _, _ = arrive(core, guard("hot"))
    core.handle(answer(hot, wait_answer()))  # told to wait: hot is full
    busy(core, n=1)
    queued, commands, _ = arrive(core, guard("q"))  # the last free process: it queues
    assert not last_sent(commands).ahead and core.free_processes() == 1
    _, behind_hot, _ = arrive(core, guard("hot"))
    _, behind_queued, _ = arrive(core, guard("q"))
    idle, commands, _ = arrive(core, guard("idle"))
    _, twin, _ = arrive(core, guard("idle"))
    assert "SendAttempt" not in kinds(behind_hot) + kinds(behind_queued)
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (idle, True)]
    assert twin == []  # one per name


def test_a_priority_request_never_tries_ahead_and_lookahead_zero_turns_it_off():
    core, world = make(processes=1, lookahead=0)
    busy(core)
    _, commands, _ = arrive(core, guard("t:1"))
    assert commands == []
    core, world = make(processes=1, lookahead=1)
    (running,) = busy(core)
    urgent, commands, _ = arrive(core, guard("t:1", priority=3))
    assert commands == []  # it queues once one frees
    commands = core.handle(Ended(running))
    assert last_sent(commands).claim is urgent and not last_sent(commands).ahead


def test_a_try_ahead_counts_against_the_process_it_would_take():
    """A process frees while a try ahead is in flight: its grant takes that process, so the
    next in line does not queue for it as well."""
    core, world = make(processes=1, lookahead=1)
    (running,) = busy(core)
    claim, _, _ = arrive(core, guard("t:1"))
    nxt, _, _ = arrive(core, guard("t:2"))
    commands = core.handle(Ended(running))  # the free process is the try ahead's
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (nxt, True)]  # nxt may only try ahead too
    assert started(core.handle(answer(claim, Attempt(GRANT)))) == [claim]


def test_a_key_this_worker_released_is_tried_ahead_again():
    """W6 with a backlog per key: a key's last grant here said it left no room (``free=0``),
    so nothing of it tried ahead while it ran; once this worker released it, its units are
    free as far as this worker knows, and its next request tries ahead while every process
    is busy (and starts the moment one frees), instead of acquiring after a process freed."""
    core, world = make(processes=1, lookahead=1)
    first, _, _ = arrive(core, guard("t:1"))
    run(core, first, Attempt(GRANT, limit=1, free=0))
    behind, commands, _ = arrive(core, guard("t:1"))
    assert commands == []  # t:1 has no room: no try ahead while it runs
    commands = core.handle(Ended(first))
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (behind, False)]  # a process is free: it queues for it
    run(core, behind, Attempt(GRANT, limit=1, free=0))
    core.handle(Ended(behind))  # t:1 released again, nothing waits
    other, commands, _ = arrive(core, guard("t:2"))
    assert not last_sent(commands).ahead  # the free process is its
    run(core, other, Attempt(GRANT, limit=1, free=0))
    again, commands, _ = arrive(core, guard("t:1"))
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (again, True)]  # every process busy, and t:1 has room: tried ahead
    assert started(core.handle(answer(again, Attempt(GRANT, limit=1, free=0)))) == [again]
    assert core.free_processes() == -1  # it waits in the pool's queue for the next process
    _, commands, _ = arrive(core, guard("t:2"))
    assert commands == []  # t:2 still runs here, its grant said no room


def test_a_key_found_full_is_not_tried_ahead_after_this_worker_releases_it():
    """A refused try says the semaphore is full or others queue for it: a release of this
    worker's most likely went to one of them, so the key is not tried ahead again until a
    grant says it has room (a try would only be refused)."""
    core, world = make(processes=2, lookahead=1)
    held, _, _ = arrive(core, guard("t:1"))
    run(core, held, Attempt(GRANT, limit=2))  # the backend gives no hint
    busy(core)
    refused, commands, _ = arrive(core, guard("t:1"))
    assert last_sent(commands).ahead
    core.handle(answer(refused, wait_answer()))  # t:1 is full, or others queue for it
    core.handle(Revoked(refused))
    core.handle(Ended(held))  # this worker releases t:1
    busy(core, name="more")  # every process busy again
    _, commands, _ = arrive(core, guard("t:1"))
    assert commands == []
    idle, commands, _ = arrive(core, guard("t:3"))
    assert [(c.claim, c.ahead) for c in commands if isinstance(c, SendAttempt)] == [
        (idle, True)]  # the lookahead was free: only t:1 was passed over


def test_a_one_try_policy_never_tries_ahead_and_a_claim_leaving_ahead_cancels():
    """A skip or fail policy makes its one try once a process is free for it (as
    documented: a duplicate sent meanwhile is judged then), never ahead."""
    core, world = make(processes=1, lookahead=1)
    busy(core)
    _, commands, _ = arrive(core, guard("t:1", on_full="skip"))
    assert commands == []
    gone, _, _ = arrive(core, guard("t:2"))
    commands = core.handle(Revoked(gone))
    assert kinds(commands) == ["StopAttempts", "Cancel", "Refill", "Exit"]
    # its try's grant arrives after it left: released, never kept
    assert releases(core.handle(answer(gone, Attempt(GRANT)))) == [(("t:2",), gone.holder)]


# -- the waiting room -----------------------------------------------------------------------


def test_beyond_its_share_a_claim_told_to_wait_is_parked_and_leaves_the_queue():
    core, world = make(processes=1, max_waiting=1)  # this worker's room for "s": one
    first, _, _ = arrive(core)
    world.processes = 2
    second, _, _ = arrive(core)  # both asked before either was told to wait
    assert core.room("s") == -1
    commands = core.handle(answer(first, wait_answer(position=0)))
    assert kinds(commands) == ["StopAttempts", "Cancel", "Refill", "Exit"]
    assert exit_of(commands).how is How.PARK and "RaisePrefetch" not in kinds(commands)
    commands = core.handle(answer(second, wait_answer(position=0)))  # within the room now
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "SendAttempt"]


def test_an_arrival_while_full_and_beyond_the_share_parks_without_asking_the_backend():
    core, world = make(max_waiting=2)
    first, _, _ = arrive(core)
    core.handle(answer(first, wait_answer()))
    second, commands, _ = arrive(core)
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting", "SendAttempt"]
    assert commands[1].position is None  # in the line, waiting for the same slot: WAITING
    third, commands, _ = arrive(core)
    assert kinds(commands) == ["Refill", "Exit"] and exit_of(commands).how is How.PARK
    # pulled from the waiting room, or above the default priority: never parked again
    _, commands, _ = arrive(core, pulled=True)
    assert "Exit" not in kinds(commands) and "RaisePrefetch" not in kinds(commands)
    _, commands, _ = arrive(core, guard(priority=3))
    assert "Exit" not in kinds(commands)


def test_the_room_counts_the_requests_being_pulled_and_the_worker_bound():
    core, world = make(processes=4, max_waiting=6)
    assert core.room("s") == 6  # min(2 per process = 8, the bound 6)
    world.pulls["s"] = 3
    assert core.room("s") == 3
    world.pulls = {"other": 2}
    assert core.room("s") == 4


# -- bounds and leaving ---------------------------------------------------------------------


def test_max_wait_fails_a_claim_and_worker_max_hold_parks_or_requeues_it():
    core, world = make()
    late, _, _ = arrive(core, guard(max_wait=10.0))
    arrive(core, guard("h", worker_max_hold=30.0))
    arrive(core, guard("u", priority=2, worker_max_hold=30.0))
    assert [c for c in core.handle(Tick()) if isinstance(c, Exit)] == []
    world.advance(11)
    (failed,) = [c for c in core.handle(Tick()) if isinstance(c, Exit)]
    assert failed.claim is late and isinstance(failed.error, SemaphoreTimeout)
    world.advance(20)
    exits = {c.claim.guard.name: c.how for c in core.handle(Tick()) if isinstance(c, Exit)}
    assert exits == {"h": How.PARK, "u": How.REQUEUE}
    assert len(core) == 0


def test_a_claim_leaves_exactly_once_with_the_same_cleanup_every_way():
    for leave, how in ((Stop(), How.GIVE_BACK), ("let go", How.LET_GO),
                       ("revoked", How.REVOKED)):
        core, _ = make()
        claim, _, _ = arrive(core)
        core.handle(answer(claim, wait_answer()))  # raised the prefetch, in the queue
        event = (LetGo((claim,)) if leave == "let go" else Revoked(claim)
                 if leave == "revoked" else leave)
        commands = core.handle(event)
        assert kinds(commands) == ["StopAttempts", "LowerPrefetch", "Cancel", "Refill",
                                   "Exit"], how
        assert exit_of(commands).how is how
        assert core.handle(event) == [] and core.handle(Revoked(claim)) == []
        assert len(core) == 0 and core.count("s") == 0 and core.blocked("s") == 0


def test_stop_gives_back_every_waiting_claim_and_keeps_those_in_the_pool():
    core, _ = make(processes=1)
    running, _, _ = arrive(core)
    run(core, running)
    lined, _, _ = arrive(core)
    commands = core.handle(Stop())
    assert [(c.claim, c.how) for c in commands if isinstance(c, Exit)] == [
        (lined, How.GIVE_BACK)]
    assert "Cancel" not in kinds(commands)  # it never asked the backend
    assert releases(commands) == []  # the running one keeps its slot


def test_a_revoked_claim_in_the_line_leaves_without_touching_the_backend():
    core, _ = make(processes=0)
    claim, commands, _ = arrive(core)
    assert commands == []
    commands = core.handle(Revoked(claim))
    assert kinds(commands) == ["Refill", "Exit"] and exit_of(commands).how is How.REVOKED


def test_wake_ups_beyond_the_free_processes_wait_for_one():
    """Many keys' waiters woken at once (500 keys x 2): as many try as processes are free, the
    others once one is, instead of being granted a slot only to give it back."""
    core, world = make(processes=2)
    claims = [arrive(core, guard(f"t:{k}"))[0] for k in range(2)]
    for claim in claims:
        core.handle(answer(claim, wait_answer()))  # both told to wait: no attempt in flight
    claims += [arrive(core, guard(f"t:{k}"))[0] for k in range(2, 4)]
    for claim in claims[2:]:
        core.handle(answer(claim, wait_answer()))
    world.processes = 1
    sent = [core.handle(Woken(c, c.holder)) for c in claims]
    assert [kinds(c) for c in sent] == [["SendAttempt"]] * 4
    # the first tries at once; the others at the latest after WAKE_DEFER_MAX
    assert [c[0].delay for c in sent] == [0, WAKE_DEFER_MAX, WAKE_DEFER_MAX, WAKE_DEFER_MAX]
    runner = started(core.handle(answer(claims[0], Attempt(GRANT))))[0]
    world.processes = 3  # two more processes are free, and the task ends
    commands = core.handle(Ended(runner))
    assert [c.claim for c in commands if isinstance(c, SendAttempt)] == claims[1:4]


def test_a_wake_up_with_every_process_busy_tries_so_that_the_slot_moves_on():
    """No process free and none promised: the woken claim tries anyway; a grant is given back
    at once, and the backend wakes whoever waits behind it (in a worker with room)."""
    core, world = make(processes=1)
    claim, _, _ = arrive(core)
    core.handle(answer(claim, wait_answer()))
    world.processes = 0  # busy with other work
    assert kinds(core.handle(Woken(claim, claim.holder))) == ["SendAttempt"]
    assert "GiveBackGrant" in kinds(core.handle(answer(claim, Attempt(GRANT))))


def test_peers_lined_behind_a_first_attempt_report_waiting_once_it_is_told_to_wait():
    """Flower's case: three of one key reach the worker in a burst while the slot is held; the
    first asks, the others wait in the line; once the first is told to wait, the others show
    WAITING too (they wait for the same slot), once each."""
    core, world = make(processes=2)
    arrive(core, None)  # busy with other work: one process free
    first, _, _ = arrive(core)
    lined = [arrive(core)[1] for _ in range(2)]
    assert lined == [[], []]
    commands = core.handle(answer(first, wait_answer(position=0)))
    reports = [(c.claim is first, c.position) for c in commands if isinstance(c, ReportWaiting)]
    assert reports == [(False, None), (False, None), (True, 0)]
    assert kinds(commands).count("RaisePrefetch") == 3
    _, commands, _ = arrive(core)  # arriving now: reported at once, and only then
    assert kinds(commands) == ["RaisePrefetch", "ReportWaiting"]
    commands = core.handle(answer(first, wait_answer(position=0)))
    assert not [c for c in commands if isinstance(c, ReportWaiting)]


# -- the table ------------------------------------------------------------------------------


def test_every_command_the_core_can_emit_has_a_shell_handler():
    from celery_semaphore.worker.gate import Gate

    gate = Gate.__new__(Gate)
    consumer = SimpleNamespace(app=SimpleNamespace(), on_task_request=None, hub=None,
                               on_connection_error_after_connected=None,
                               qos=None, pool=None, hostname="w")
    from celery_semaphore.backends.memory import MemoryBackend

    Gate.__init__(gate, consumer, Settings(), MemoryBackend("memory://core-table"))
    assert set(gate._carry_out) == set(Command.__args__)


def test_a_claim_moves_only_along_the_table():
    core, _ = make()
    claim, _, _ = arrive(core)
    with pytest.raises(RuntimeError):
        claim.move(State.ENDING)  # a waiting claim never ends in a child
    assert State.POOL in TRANSITIONS[State.QUEUED] and State.DONE not in TRANSITIONS[State.DONE]


def test_a_grant_with_every_process_busy_waits_in_the_pools_queue_within_the_lookahead():
    """With a lookahead, a grant (answered or pushed) that finds every process busy goes to
    the pool's queue, as a grant tried ahead does, while fewer requests than the pool has
    processes wait there; beyond that it is given back."""
    core, world = make(processes=1, lookahead=1)
    first, _, _ = arrive(core)
    second, _, _ = arrive(core, guard("b"))
    core.handle(answer(first, wait_answer()))
    core.handle(answer(second, wait_answer()))
    arrive(core, None)  # an unguarded request takes the one process
    assert started(core.handle(pushed(first))) == [first]  # waits in the pool's queue
    commands = core.handle(pushed(second, name="b"))
    assert kinds(commands) == ["StopAttempts", "GiveBackGrant"]  # the queue is full


def test_short_of_processes_only_while_every_process_is_busy_and_the_semaphore_has_room():
    """What makes the waiting room ring a lane again for the other workers: requests of the
    semaphore wait here, no process is free, and its last grant here left units free."""
    core, world = make(processes=1)
    first, _, _ = arrive(core)
    assert not core.short_of_processes("s")  # a free process (its attempt is out)
    run(core, first, Attempt(GRANT, limit=4, free=3))
    second, _, _ = arrive(core)
    assert core.free_processes() == 0 and core.count("s") == 1
    assert core.short_of_processes("s")
    core.spare["s"] = 0  # found full: another worker could only wait too
    assert not core.short_of_processes("s")
    assert not core.short_of_processes("other")


def test_a_backoff_pauses_before_the_release_reports_overload_and_gives_the_call_back():
    from celery_semaphore.worker.core import BackedOff

    core, world = make()
    claim, _, _ = arrive(core)
    run(core, claim)
    world.advance(0.25)
    commands = core.handle(BackedOff(claim, 30.0, "429"))
    assert kinds(commands) == ["Pause", "Release", "Redeliver"]  # in this order
    pause, release, redeliver = commands
    assert (pause.name, pause.seconds, pause.reason) == ("s", 30.0, "429")
    assert release.outcome == "overload" and release.latency == pytest.approx(0.25)
    assert redeliver.claim is claim and redeliver.seconds == 30.0
    assert core.free_processes() == 4 and core.handle(Ended(claim)) == []
    other, _, _ = arrive(core)
    run(core, other)
    # no time given: nothing closes, the call still goes back reporting overload
    assert kinds(core.handle(BackedOff(other, None))) == ["Release", "Redeliver"]
    third, _, _ = arrive(core)
    run(core, third)
    # closed already by the pool process that raised it: not closed twice
    assert kinds(core.handle(BackedOff(third, 30.0, "429", paused=True))) == [
        "Release", "Redeliver"]


def test_a_claim_given_back_queues_in_front_and_every_release_says_how_the_call_went():
    core, _ = make()
    request = SimpleNamespace(id="f1", name="tasks.t", request_dict={})
    commands = core.handle(Arrived(request, guard(), "f1:h", front=True))
    assert commands[0].claim.front  # the shell asks the backend with FRONT_KEY
    ok, _, _ = arrive(core)
    run(core, ok)
    assert [c.outcome for c in core.handle(Ended(ok, outcome="ok"))] == ["ok"]
    failed, _, _ = arrive(core)
    run(core, failed)
    assert [c.outcome for c in core.handle(Ended(failed, outcome="error"))] == ["error"]


def test_a_grant_read_after_its_lease_may_have_lapsed_is_given_back_not_started():
    """Chaos seed 221178855: a worker stopped for 6 s read, as it resumed, a grant pushed to
    it 0.1 s into the stop (TTL 5 s) and started the task on a slot already given to
    another worker. A grant with less than GRANT_MIN_LEFT of its TTL left, as far as the
    worker knows, is given back and the request waits again; the same for an attempt's
    answer read late."""
    from celery_semaphore.backends.base import Attempt, Grant
    from celery_semaphore.worker.core import GRANT_MIN_LEFT

    core, world = make()
    claim, _, _ = arrive(core)  # its attempt sent at 1000.0
    core.handle(answer(claim, wait_answer(), requested_at=1000.0))  # told to wait
    world.advance(7.0)  # stopped; the backend pushed the grant (TTL 5 s) meanwhile
    commands = core.handle(pushed(claim, ttl=5.0))
    assert kinds(commands) == ["StopAttempts", "GiveBackGrant"]
    late, _, _ = arrive(core)
    world.advance(5.0 * (1 - GRANT_MIN_LEFT) + 0.01)  # the answer read with < 1/4 TTL left
    grant = Attempt(Grant(0, 1, 0.0, 5.0), limit=1)
    commands = kinds(core.handle(answer(late, grant, requested_at=world.now - 5.0 * 0.76)))
    assert "GiveBackGrant" in commands and "Start" not in commands
    fresh, _, _ = arrive(core)
    started = core.handle(answer(fresh, grant, requested_at=world.now - 0.5))
    assert "Start" in kinds(started)
