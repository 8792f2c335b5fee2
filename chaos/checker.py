"""The external checker of a chaos run: it reads the run's history, never the library's books.

Inputs, all written outside the library: the sender's log (every task id whose send returned),
the probe (every body's start and end, written by the body itself), the backoff log (every
body that raised :class:`celery_semaphore.Backoff`, written by the body just before it raised:
both clocks and the end of the pause it asked for), the nemesis's log (every fault: when it
began and ended, which processes it killed or froze, each resize), and, at the very end, how
many slots the backend's ``status`` says are held. The figures are defined in
the package docstring (:mod:`chaos`); :func:`check` computes them.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

NS = 1_000_000_000
#: A run that ended this long before its process (or its worker) was SIGKILLed may not have
#: been acknowledged: a second completed run of it is an at-least-once redelivery.
ACK_GRACE_NS = 2 * NS
#: After a broker outage, how long a worker may still be reconnecting (acknowledging nothing).
RECONNECT_GRACE_NS = 10 * NS
#: A task sent this soon before the broker was SIGKILLed (or up to 0.1 s after the kill was
#: recorded: the signal is sent just after), and never started, may have been taken off its
#: queue by a worker's BRPOP whose reply the kill lost (kombu's own window).
BROKER_KILL_WINDOW_NS = NS // 2
#: A start this soon after a shrink may have been granted before it (the grant precedes the
#: body's start mark by the trip to the pool): the larger limit is in force meanwhile.
RESIZE_GRACE_NS = 2 * NS
#: A Backoff reaches the backend as a pause this long after its body raised it, at the most,
#: when no fault stopped its worker, the broker or the backend meanwhile: the pool hands the
#: exception to the worker's main process, whose gate makes the pause in its next write to
#: the backend (7-102 ms over the pauses no fault touched in six runs, by the workers'
#: "paused for" log lines). A body granted its slot before then is not judged by the pause.
PAUSE_LAG_NS = NS // 4
#: Between the body's clock and the backend's: one host, one wall clock; each mark's wall
#: time goes to the probe's monotonic clock through its own pair of readings.
CLOCK_SLACK_NS = NS // 20
#: Faults during which a pause may not reach the backend: the gate makes it once (a failed
#: call is logged, not made again).
BACKEND_OUTAGES = ("backend_restart", "backend_wipe", "backend_freeze", "backend_cut",
                   "failover")


def units_of(marked: str) -> Tuple[str, int]:
    """(semaphore, units) of a name as the probe marks it: ``name*k`` holds k units (a
    ``semaphore_cost``), a plain name one."""
    name, _, units = marked.partition("*")
    return name, int(units) if units else 1


@dataclass
class Run:
    """One execution of a task body, as the probe saw it."""

    task_id: str
    start: int
    pid: int
    tid: int
    node: str
    names: Tuple[str, ...]
    end: Optional[int] = None  # the end mark; None: the body never finished
    cut_at: Optional[int] = None  # when it stopped without an end mark (its process died)
    #: monotonic time by which the backend had granted its slots: the earliest fencing epoch of
    #: its leases (an epoch never falls below the backend's clock at the grant), on the
    #: probe's clock; None when the mark carries none
    granted: Optional[int] = None
    #: when it raised Backoff (the backoff log; the body wrote no end mark): it did not
    #: complete, and stopped holding a process then
    backed_off: Optional[int] = None

    @property
    def stop(self) -> int:
        return self.end if self.end is not None else self.cut_at  # type: ignore[return-value]


@dataclass
class BackoffMark:
    """A body that raised Backoff, as its line in the backoff log says."""

    task_id: str
    at: int  # monotonic ns, just before it raised
    pid: int
    tid: int
    node: str
    names: Tuple[str, ...]
    #: the end of the pause it asked for (``Backoff.at``) on the probe's monotonic clock;
    #: None: a Backoff with no time (overload only, nothing paused)
    until: Optional[int] = None


@dataclass
class Fault:
    kind: str
    start: int
    end: int
    node: Optional[str] = None
    killed: List[int] = field(default_factory=list)  # pids SIGKILLed at ``start``
    frozen: List[int] = field(default_factory=list)  # pids SIGSTOPped from start to end
    window_ns: int = 0  # a documented window lasts from ``start`` to ``end + window_ns``
    #: limit changes: (name, old limit, new limit, call made at, call returned at)
    resizes: List[Tuple[str, int, int, int, int]] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], 0, "")}


@dataclass
class Report:
    seconds: float
    faults: int
    tasks_sent: int
    tasks_run: int
    lost: int
    duplicates: int
    over_limit: int
    over_limit_outside_documented_windows: int
    stuck_slots_at_end: int
    max_recovery_s: float
    backoffs: int = 0
    backed_off_not_rerun: int = 0
    started_in_pause: int = 0
    started_in_pause_outside_documented_windows: int = 0
    details: Dict[str, object] = field(default_factory=dict)

    def summary(self) -> Dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "details"}

    def json_line(self) -> str:
        return json.dumps(self.summary(), sort_keys=False)

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicates == 0
                and self.over_limit_outside_documented_windows == 0
                and self.stuck_slots_at_end == 0 and self.backed_off_not_rerun == 0
                and self.started_in_pause_outside_documented_windows == 0)


def parse_probe(lines: Iterable[str]) -> List[Run]:
    """Pair each ``start`` with the ``end`` of the same task id in the same process and thread."""
    runs: List[Run] = []
    open_: Dict[Tuple[str, int, int], List[Run]] = defaultdict(list)
    for line in lines:
        parts = line.split()
        if len(parts) == 8:
            parts.append("-")
        if len(parts) != 9:
            continue  # not a mark (a mark is one write with O_APPEND: never cut short)
        kind, task_id, mono, wall, pid, tid, node, names, epoch_us = parts
        key = (task_id, int(pid), int(tid))
        if kind == "start":
            run = Run(task_id, int(mono), int(pid), int(tid), node, tuple(names.split(",")))
            if epoch_us.isdigit():  # wall clock microseconds -> the mark's monotonic clock
                run.granted = int(epoch_us) * 1000 - (int(wall) - int(mono))
            runs.append(run)
            open_[key].append(run)
        elif kind == "end" and open_[key]:
            open_[key].pop().end = int(mono)
    return runs


def parse_backoffs(lines: Iterable[str]) -> List[BackoffMark]:
    """The backoff log's lines: ``backoff task_id monotonic_ns wall_ns pid tid node names
    seconds until_us`` (``until_us``: the pause's end, wall clock microseconds, or ``-``)."""
    marks: List[BackoffMark] = []
    for line in lines:
        parts = line.split()
        if len(parts) != 10 or parts[0] != "backoff":
            continue
        _, task_id, mono, wall, pid, tid, node, names, _seconds, until_us = parts
        until = (int(until_us) * 1000 - (int(wall) - int(mono)) if until_us.isdigit()
                 else None)
        marks.append(BackoffMark(task_id, int(mono), int(pid), int(tid), node,
                                 tuple(names.split(",")), until))
    return marks


def attach_backoffs(runs: List[Run], marks: List[BackoffMark]) -> List[BackoffMark]:
    """Close each run that raised Backoff at its mark (the run of the same task id, process
    and thread that started last before the mark and wrote no end mark); the marks that
    match no such run."""
    by_key: Dict[Tuple[str, int, int], List[Run]] = defaultdict(list)
    for run in runs:
        by_key[(run.task_id, run.pid, run.tid)].append(run)
    unmatched = []
    for mark in sorted(marks, key=lambda m: m.at):
        candidates = [r for r in by_key.get((mark.task_id, mark.pid, mark.tid), [])
                      if r.start <= mark.at and r.end is None and r.backed_off is None]
        if not candidates:
            unmatched.append(mark)
            continue
        run = max(candidates, key=lambda r: r.start)
        run.backed_off = run.cut_at = mark.at
    return unmatched


def close_unended(runs: List[Run], faults: List[Fault], horizon: int) -> None:
    """A run with no end mark stopped when its process was killed, else at the next start in
    the same process and thread (the process went on: the body was cut short some other way),
    else at ``horizon`` (it may still be running)."""
    kills: Dict[int, List[int]] = defaultdict(list)
    for fault in faults:
        for pid in fault.killed:
            kills[pid].append(fault.start)
    starts: Dict[Tuple[int, int], List[int]] = defaultdict(list)
    for run in runs:
        starts[(run.pid, run.tid)].append(run.start)
    for run in runs:
        if run.end is not None or run.cut_at is not None:  # ended, or raised Backoff
            continue
        later = [t for t in kills.get(run.pid, []) if t >= run.start]
        later += [t for t in starts[(run.pid, run.tid)] if t > run.start]
        run.cut_at = min(later) if later else horizon


def limit_at(name: str, t: int, declared: int, faults: List[Fault]) -> int:
    """The limit in force for ``name`` at ``t``: the declared one, changed by each resize from
    its call on; while a resize is on its way and for RESIZE_GRACE_NS after it returned, the
    larger of the old and the new limit."""
    limit = declared
    changes = sorted(r for f in faults for r in f.resizes if r[0] == name)
    for _, old, new, t0, t1 in sorted(changes, key=lambda r: r[3]):
        if t < t0:
            break
        limit = new if t >= t1 + RESIZE_GRACE_NS else max(old, new)
    return limit


def _windows(faults: List[Fault]) -> List[Tuple[int, int, str]]:
    return [(f.start, f.end + f.window_ns, f.kind) for f in faults if f.window_ns]


def _frozen(faults: List[Fault], ttl_ns: int) -> Dict[int, List[Tuple[int, int]]]:
    """pid -> freezes longer than the lease TTL."""
    out: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
    for fault in faults:
        if fault.end - fault.start > ttl_ns:
            for pid in fault.frozen:
                out[pid].append((fault.start, fault.end))
    return out


def over_limit(runs: List[Run], faults: List[Fault], ttl_ns: int,
               declared: Callable[[str], int]) -> Tuple[int, int, List[dict]]:
    """(moments over the limit, those outside every documented window, their details). A
    moment is a body's start that made the bodies of one semaphore running at once hold more
    units than its limit in force (a body marked ``name*k`` holds k units, one otherwise;
    concurrency only rises at a start). Documented: the start falls in a fault's
    documented window, or one of the bodies running then was paused (its process SIGSTOPped)
    past the lease TTL: the README's "paused holder" that no backend can stop. That body ran
    during the pause, or was granted its slot before the pause began and started after it
    ended (its worker held the slot, paused, while the lease lapsed)."""
    by_name: Dict[str, List[Run]] = defaultdict(list)
    units: Dict[str, List[int]] = defaultdict(list)
    for run in runs:
        for marked in run.names:
            name, k = units_of(marked)
            by_name[name].append(run)
            units[name].append(k)
    windows = _windows(faults)
    frozen = _frozen(faults, ttl_ns)
    total = outside = 0
    seen: List[dict] = []
    for name, named in by_name.items():
        points = sorted([(r.start, 1, i) for i, r in enumerate(named)]
                        + [(r.stop, 0, i) for i, r in enumerate(named)])
        running: set = set()
        for t, is_start, i in points:
            if not is_start:
                running.discard(i)
                continue
            running.add(i)
            limit = limit_at(name, t, declared(name), faults)
            if sum(units[name][j] for j in running) <= limit:
                continue
            total += 1
            why = next((kind for a, b, kind in windows if a <= t <= b), None)
            if why is None:
                for j in running:
                    r = named[j]
                    if any(a <= t and (a < r.stop and r.start < b
                                       or r.granted is not None and r.granted < a <= b <= r.start)
                           for a, b in frozen.get(r.pid, [])):
                        why = "paused holder"
                        break
            if why is None:
                outside += 1
            if len(seen) < 50:
                seen.append({"semaphore": name, "at_ns": t,
                             "running": sum(units[name][j] for j in running),
                             "limit": limit, "documented": why,
                             "tasks": sorted(named[j].task_id for j in running)})
    return total, outside, seen


def duplicates(runs: List[Run], faults: List[Fault]) -> Tuple[int, List[dict]]:
    """Task ids whose body ran to its end more than once, but for an at-least-once
    redelivery: a completed run followed by another is excused only when the process that ran
    it, or its worker's main process, was SIGKILLed before its acknowledgement could leave:
    while it ran (a pool child can write its end mark a few milliseconds after its worker's
    main process died), within ACK_GRACE_NS after its end, or, for a run that ended while the
    broker was away (a ``broker_restart`` or ``broker_cut`` in progress), within
    RECONNECT_GRACE_NS after the broker came back (a worker acknowledges nothing while its
    consumer reconnects: Celery retries the connection 2, 4, 6... s apart, and the completion
    waits)."""
    kills_by_pid: Dict[int, List[int]] = defaultdict(list)
    kills_by_node: Dict[str, List[int]] = defaultdict(list)
    outages = [(f.start, f.end) for f in faults if f.kind in ("broker_restart", "broker_cut")]
    for fault in faults:
        for pid in fault.killed:
            kills_by_pid[pid].append(fault.start)
        if fault.killed and fault.node and fault.kind == "worker_kill":
            kills_by_node[fault.node].append(fault.start)

    def grace_until(end: int) -> int:
        during = [b for a, b in outages if a <= end <= b]
        return max([end + ACK_GRACE_NS] + [b + RECONNECT_GRACE_NS for b in during])
    done: Dict[str, List[Run]] = defaultdict(list)
    for run in runs:
        if run.end is not None:
            done[run.task_id].append(run)
    count = 0
    seen: List[dict] = []
    for task_id, completed in done.items():
        if len(completed) < 2:
            continue
        completed.sort(key=lambda r: r.start)
        excused = all(
            any(r.start <= k <= grace_until(r.end)  # type: ignore[operator,arg-type]
                for k in kills_by_pid.get(r.pid, []) + kills_by_node.get(r.node, []))
            for r in completed[:-1])
        if not excused:
            count += 1
            if len(seen) < 50:
                seen.append({"task": task_id, "runs": [
                    {"node": r.node, "pid": r.pid, "start_ns": r.start, "end_ns": r.end}
                    for r in completed]})
    return count, seen


def pause_excuse(mark: BackoffMark, faults: List[Fault]) -> Optional[str]:
    """Why the pause ``mark`` asked for may never have been in force as asked, or None. The
    gate makes the pause once, within PAUSE_LAG_NS of the raise unless a fault stopped it
    (module constants): the whole pause is excused when, at some moment from the raise to
    PAUSE_LAG_NS after it,

    * the backend was out (a fault of BACKEND_OUTAGES in progress): the one call that makes
      the pause may have failed, or reached the backend after other workers' grants;
    * the process that raised it, or its worker's main process, was SIGKILLed (from 0.1 s
      before the mark: a kill is recorded just before its signal): the exception may never
      have reached the gate;
    * that process was paused (``worker_freeze``): the pause reaches the backend after the
      SIGCONT, with what is left of its time (nothing, past a lease TTL of freeze);
    * the broker was out (``broker_restart``, ``broker_cut``): a worker's consumer stops while
      it reconnects (for up to RECONNECT_GRACE_NS after the broker is back), and with it the
      pool's results, among them the exception."""
    lo, hi = mark.at, mark.at + PAUSE_LAG_NS
    for fault in faults:
        if fault.kind in BACKEND_OUTAGES and fault.start <= hi and fault.end >= lo:
            return f"{fault.kind} as it was made"
        if fault.kind in ("broker_restart", "broker_cut") and fault.start <= hi \
                and fault.end + RECONNECT_GRACE_NS >= lo:
            return f"{fault.kind} as it was made"
        killed = mark.pid in fault.killed or (
            fault.kind == "worker_kill" and bool(fault.killed) and fault.node == mark.node)
        if killed and lo - NS // 10 <= fault.start <= hi:
            return "its worker killed"
        if mark.pid in fault.frozen and fault.start <= hi and fault.end >= lo:
            return "its worker paused"
    return None


def started_in_pause(runs: List[Run], marks: List[BackoffMark],
                     faults: List[Fault]) -> Tuple[int, int, Dict[str, object]]:
    """(body starts granted while a pause of their semaphore asked for by a Backoff was in
    force, those outside every documented window, details). A Backoff with a time raised at
    ``at`` asks for a pause of its semaphore until ``until``; it is in force on the backend
    from at most PAUSE_LAG_NS after ``at`` until ``until`` or later (the gate asks for the
    time left until ``until`` on the backend's clock, so a pause made late ends no sooner). A
    body of that semaphore counts when it was granted (its fencing epoch; with none, its
    start) from ``at + PAUSE_LAG_NS`` to ``until - CLOCK_SLACK_NS``. Documented: every pause
    it falls in is excused as a whole (:func:`pause_excuse`), or was forgotten before the
    grant: a ``backend_wipe`` began after the raise (a backend restarted empty forgets its
    pauses, the README's "state survives a restart only if Redis persists it"), or a
    ``failover`` did (the promoted replica may not have had the pause yet: replication is
    asynchronous, the README's failover window)."""
    timed = [m for m in marks if m.until is not None]
    excuses = {id(m): pause_excuse(m, faults) for m in timed}
    forgets = sorted((f.start, f.kind) for f in faults if f.kind in ("backend_wipe", "failover"))
    by_name: Dict[str, List[Run]] = defaultdict(list)
    for run in runs:
        for marked in run.names:
            by_name[units_of(marked)[0]].append(run)
    excused_by: Dict[str, int] = defaultdict(int)
    too_short = 0
    windows: Dict[str, List[Tuple[int, int, BackoffMark]]] = defaultdict(list)
    for mark in timed:
        lo, hi = mark.at + PAUSE_LAG_NS, mark.until - CLOCK_SLACK_NS  # type: ignore[operator]
        why = excuses[id(mark)]
        if why is not None:
            excused_by[why] += 1
        if hi < lo:
            too_short += 1
            continue
        for name in {units_of(marked)[0] for marked in mark.names}:
            windows[name].append((lo, hi, mark))
    total = outside = 0
    seen: List[Dict[str, object]] = []
    for name, pauses in windows.items():
        for run in by_name.get(name, []):
            granted = run.granted if run.granted is not None else run.start
            inside = [(lo, hi, m) for lo, hi, m in pauses
                      if lo <= granted <= hi and run.start >= m.at]
            if not inside:
                continue
            total += 1
            reasons = []
            for _, _, m in inside:
                why = excuses[id(m)]
                if why is None:
                    why = next((f"{kind} during it" for t, kind in forgets
                                if m.at <= t <= granted), None)
                reasons.append(why)
            documented = all(reasons)
            if not documented:
                outside += 1
            if len(seen) < 50:
                seen.append({"semaphore": name, "task": run.task_id, "granted_ns": granted,
                             "start_ns": run.start, "documented": reasons if documented
                             else None,
                             "pauses": [{"task": m.task_id, "raised_ns": m.at,
                                         "until_ns": m.until} for _, _, m in inside]})
    # information: how long after the end of the pause it asked for the call's next run was
    # granted (it waits out its own pause: under 0, it was granted early)
    reruns = []
    for mark in timed:
        later = [r for r in runs if r.task_id == mark.task_id and r.start > mark.at]
        if later and excuses[id(mark)] is None:
            rerun = min(later, key=lambda r: r.start)
            granted = rerun.granted if rerun.granted is not None else rerun.start
            reruns.append((granted - mark.until) / NS)  # type: ignore[operator]
    return total, outside, {
        "pauses_asked": len(timed), "pauses_excused": dict(excused_by),
        "pauses_shorter_than_the_lag": too_short,
        "rerun_granted_after_pause_end_s": ({"min": round(min(reruns), 3),
                                             "max": round(max(reruns), 3)} if reruns else {}),
        "started_in_pause_moments": seen}


def backed_off_not_rerun(runs: List[Run], marks: List[BackoffMark],
                         sends: Dict[str, int]) -> List[str]:
    """Sent tasks that raised Backoff and have no completed run that started after their last
    Backoff: the call the library gave back never ran to its end."""
    last: Dict[str, int] = {}
    for mark in marks:
        last[mark.task_id] = max(mark.at, last.get(mark.task_id, mark.at))
    done_after = {run.task_id for run in runs
                  if run.end is not None and run.start > last.get(run.task_id, run.start)}
    return sorted(t for t in last if t in sends and t not in done_after)


def recovery(runs: List[Run], sends: Dict[str, int], faults: List[Fault],
             horizon: int) -> Tuple[float, List[dict]]:
    """Longest time from a fault's end to the next body start, over the faults at whose end a
    sent task had not started yet (work was waiting); with no start after it, until
    ``horizon``."""
    first_start: Dict[str, int] = {}
    for run in runs:
        first_start[run.task_id] = min(run.start, first_start.get(run.task_id, run.start))
    starts = sorted(run.start for run in runs)
    worst = 0.0
    per_fault = []
    for fault in faults:
        waiting = any(sent <= fault.end and first_start.get(task_id, horizon + 1) > fault.end
                      for task_id, sent in sends.items())
        if not waiting:
            continue
        i = bisect.bisect_right(starts, fault.end)
        seconds = ((starts[i] if i < len(starts) else horizon) - fault.end) / NS
        per_fault.append({"kind": fault.kind, "recovery_s": round(seconds, 3)})
        worst = max(worst, seconds)
    return worst, per_fault


def check(*, seconds: float, sends: Dict[str, int], probe_lines: Iterable[str],
          faults: List[Fault], ttl: float, declared: Callable[[str], int],
          held_at_end: Dict[str, int], horizon: int,
          backoff_lines: Iterable[str] = ()) -> Report:
    """The figures of one run. ``sends``: task id -> monotonic ns of its send;
    ``held_at_end``: semaphore -> slots the backend says are held after the drain;
    ``horizon``: monotonic ns at the end of the drain; ``backoff_lines``: the backoff log."""
    ttl_ns = int(ttl * NS)
    runs = parse_probe(probe_lines)
    marks = parse_backoffs(backoff_lines)
    unmatched = attach_backoffs(runs, marks)
    close_unended(runs, faults, horizon)
    completed = {run.task_id for run in runs if run.end is not None}
    never_ran = sorted(task_id for task_id in sends if task_id not in completed)
    started = {run.task_id for run in runs}
    kills = [f.start for f in faults if f.kind == "broker_restart"]
    # kombu's Redis transport takes a message off its queue (BRPOP) before it records it as
    # unacknowledged: a broker SIGKILLed between the two loses it (Celery's own window, the
    # README's "a Redis broker loses a message it had handed out as it died"); only a task
    # sent just before such a kill and never started is counted there
    in_window = [t for t in never_ran if t not in started and any(
        -NS // 10 <= k - sends[t] <= BROKER_KILL_WINDOW_NS for k in kills)]
    lost = [t for t in never_ran if t not in in_window]
    over, outside, over_seen = over_limit(runs, faults, ttl_ns, declared)
    dup, dup_seen = duplicates(runs, faults)
    running_at_end: Dict[str, int] = defaultdict(int)
    for run in runs:
        if run.end is None and run.cut_at == horizon:
            for marked in run.names:
                running_at_end[units_of(marked)[0]] += 1
    stuck = sum(max(0, held - running_at_end.get(name, 0))
                for name, held in held_at_end.items())
    worst, per_fault = recovery(runs, sends, faults, horizon)
    in_pause, in_pause_outside, pause_details = started_in_pause(runs, marks, faults)
    not_rerun = backed_off_not_rerun(runs, marks, sends)
    by_kind: Dict[str, int] = defaultdict(int)
    for fault in faults:
        by_kind[fault.kind] += 1
    return Report(
        seconds=round(seconds, 1),
        faults=len(faults),
        tasks_sent=len(sends),
        tasks_run=len(completed & set(sends)),
        lost=len(lost),
        duplicates=dup,
        over_limit=over,
        over_limit_outside_documented_windows=outside,
        stuck_slots_at_end=stuck,
        max_recovery_s=round(worst, 3),
        backoffs=len(marks) - len(unmatched),
        backed_off_not_rerun=len(not_rerun),
        started_in_pause=in_pause,
        started_in_pause_outside_documented_windows=in_pause_outside,
        details={
            "faults_by_kind": dict(by_kind),
            "runs_started": len(runs),
            "runs_cut_short": sum(1 for r in runs if r.end is None and r.backed_off is None),
            "runs_backed_off": sum(1 for r in runs if r.backed_off is not None),
            "backoffs_without_time": sum(1 for m in marks if m.until is None),
            "backoff_marks_unmatched": [m.task_id for m in unmatched][:50],
            "backed_off_not_rerun": not_rerun[:50],
            **pause_details,
            "runs_not_sent": len({r.task_id for r in runs} - set(sends)),
            "lost_tasks": lost[:50],
            "lost_in_broker_kill_window": in_window[:50],
            "duplicate_tasks": dup_seen,
            "over_limit_moments": over_seen,
            "held_at_end": {k: v for k, v in held_at_end.items() if v},
            "recovery_by_fault": per_fault,
        },
    )
