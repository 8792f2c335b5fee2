"""The external checker of a chaos run: it reads the run's history, never the library's books.

Inputs, all written outside the library: the sender's log (every task id whose send returned),
the probe (every body's start and end, written by the body itself), the nemesis's log (every
fault: when it began and ended, which processes it killed or froze, each resize), and, at the
very end, how many slots the backend's ``status`` says are held. The figures are defined in
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

    @property
    def stop(self) -> int:
        return self.end if self.end is not None else self.cut_at  # type: ignore[return-value]


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
    details: Dict[str, object] = field(default_factory=dict)

    def summary(self) -> Dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "details"}

    def json_line(self) -> str:
        return json.dumps(self.summary(), sort_keys=False)

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicates == 0
                and self.over_limit_outside_documented_windows == 0
                and self.stuck_slots_at_end == 0)


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


def _close_unended(runs: List[Run], faults: List[Fault], horizon: int) -> None:
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
        if run.end is not None:
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
          held_at_end: Dict[str, int], horizon: int) -> Report:
    """The figures of one run. ``sends``: task id -> monotonic ns of its send;
    ``held_at_end``: semaphore -> slots the backend says are held after the drain;
    ``horizon``: monotonic ns at the end of the drain."""
    ttl_ns = int(ttl * NS)
    runs = parse_probe(probe_lines)
    _close_unended(runs, faults, horizon)
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
        details={
            "faults_by_kind": dict(by_kind),
            "runs_started": len(runs),
            "runs_cut_short": sum(1 for r in runs if r.end is None),
            "runs_not_sent": len({r.task_id for r in runs} - set(sends)),
            "lost_tasks": lost[:50],
            "lost_in_broker_kill_window": in_window[:50],
            "duplicate_tasks": dup_seen,
            "over_limit_moments": over_seen,
            "held_at_end": {k: v for k, v in held_at_end.items() if v},
            "recovery_by_fault": per_fault,
        },
    )
