"""The waiting room under a deep backlog: one worker (prefork, 4 processes), a Redis broker and
backend, ``tasks`` guarded tasks of 5 ms sent before the worker starts, on a semaphore of
limit 1 whose one slot the benchmark holds, so that nothing guarded can start.

Two ways the backlog reaches the waiting room, a row each:

* parked on send (the default, ``semaphore_park_on_send``): the sender publishes each guarded
  task straight to its semaphore's parking queue. Measured: the sender's rate, beside the
  same sender's rate for plain tasks to a queue (Celery's own cost of a send); the worker then
  only pulls what it can start soon.
* parked by the worker (``semaphore_park_on_send = False``): the tasks are in the task queue
  and the worker parks them. Measured: parked messages per second, read from the broker (the
  parking queue's length), beside the same worker's rate of receiving and discarding expired
  unguarded tasks (:func:`discard_floor`, Celery's own cost of a message it does not run: a
  receipt and an ack, as a park has, without the parked copy's publish).

Both: the worker's main-process RSS idle and at its peak while the backlog is parked, how soon
an unguarded task sent behind the first :data:`UNGUARDED_BEHIND` guarded ones starts after the
worker is ready; then, with ``drain``, the slot is released and the semaphore resized to 4:
every task must run exactly once, never more than 4 at once (from the probe), and the
deliveries per task are counted from the worker's log.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Dict

import redis

from benchmarks.workload import _start_worker, new_run
from celery_semaphore.waiting_room import lane_of, parking_queue_name
from tests.probe import probe_for


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


#: Guarded tasks sent ahead of the one unguarded task.
UNGUARDED_BEHIND = 5000
#: Guarded requests the worker holds waiting (two per pool process): the rest stays parked.
HELD = 8


def discard_floor(broker: str, backend: str, tasks: int = 8000) -> float:
    """Messages per second the worker receives and discards (expired unguarded tasks)."""
    tmp, tag, env, bench_app = new_run("backlog", broker, backend, 1)
    expired = datetime.now(timezone.utc) - timedelta(hours=1)
    with bench_app.app.producer_or_acquire() as producer:
        for i in range(tasks):
            bench_app.plain.apply_async((f"x{i}", 0.0), producer=producer, expires=expired)
    client = redis.Redis.from_url(broker)
    proc = _start_worker(env, "floor", 4, os.path.join(tmp, "worker.log"))
    try:
        first = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            now, left = time.monotonic(), client.llen(f"{tag}.q")
            if first is None and left < tasks:
                first = (now, left)
            if left == 0 and first is not None:
                return round(first[1] / max(now - first[0], 1e-3))
            time.sleep(0.02)
        raise RuntimeError("discard floor: the worker did not empty its queue")
    finally:
        proc.terminate()
        proc.wait(120)
        bench_app.app.close()
        client.close()


def unguarded_behind(broker: str, backend: str, guarded: int = UNGUARDED_BEHIND,
                     workers: int = 2, park_on_send: bool = True) -> float:
    """Seconds from the first worker's ready to the start of an unguarded task sent behind
    ``guarded`` guarded ones whose semaphore is full, with ``workers`` workers (-c 4; the
    workloads' two by default), started one after the other."""
    tmp, tag, env, bench_app = new_run("backlog", broker, backend, 1, park_on_send)
    with bench_app.app.producer_or_acquire() as producer:
        for i in range(guarded):
            bench_app.gated.apply_async((f"b{i}", 0.005), producer=producer)
        bench_app.plain.apply_async(("unguarded", 0.0), producer=producer)
    from celery_semaphore import Semaphore

    blocker = Semaphore("bench", 1, backend, key_prefix=f"{tag}:", ttl=3600).acquire()
    probe, procs = probe_for(env["BENCH_PROBE"]), []
    try:
        for n in range(workers):
            procs.append(_start_worker(env, f"behind{n}", 4, os.path.join(tmp, f"w{n}.log")))
            if n == 0:
                ready = time.monotonic_ns()
        deadline = time.monotonic() + 300
        while "unguarded" not in probe.intervals():
            if time.monotonic() > deadline:
                raise RuntimeError("the unguarded task did not start in 300 s")
            time.sleep(0.02)
        return round((probe.intervals()["unguarded"][0][0] - ready) / 1e9, 2)
    finally:
        blocker.release()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(120)
        bench_app.app.close()


def run(broker: str, backend: str, tasks: int = 20000, drain: bool = False,
        park_on_send: bool = True) -> Dict[str, Any]:
    tmp, tag, env, bench_app = new_run("backlog", broker, backend, 1, park_on_send)
    client = redis.Redis.from_url(broker)
    # the lane of semaphore "bench" in the run's task queue (new_run routes every task there)
    parked_key = parking_queue_name(f"{tag}:", lane_of("bench", None, f"{tag}.q"))
    behind = min(UNGUARDED_BEHIND, tasks)
    row: Dict[str, Any] = {"tasks": tasks,
                           "parked": "on send" if park_on_send else "by the worker"}
    with bench_app.app.producer_or_acquire() as producer:
        if park_on_send:  # the floor: the same sender, plain tasks to a queue nobody reads
            began = time.monotonic()
            for i in range(tasks):
                bench_app.plain.apply_async((f"x{i}", 0.0), producer=producer,
                                            queue=f"{tag}.floor")
            row["floor_per_s"] = round(tasks / (time.monotonic() - began))
            client.delete(f"{tag}.floor")
        began = time.monotonic()
        for i in range(tasks):
            if i == behind:
                bench_app.plain.apply_async(("unguarded", 0.0), producer=producer)
            bench_app.gated.apply_async((f"b{i}", 0.005), producer=producer)
        if behind == tasks:
            bench_app.plain.apply_async(("unguarded", 0.0), producer=producer)
        if park_on_send:
            row["parked_per_s"] = round(tasks / (time.monotonic() - began))
    from celery_semaphore import Semaphore

    semaphore = Semaphore("bench", 1, backend, key_prefix=f"{tag}:", ttl=3600)
    blocker = semaphore.acquire()
    log = os.path.join(tmp, "worker.log")
    proc = _start_worker(env, "backlog", 4, log)
    ready = time.monotonic_ns()
    probe = probe_for(env["BENCH_PROBE"])
    try:
        idle = rss_mb(proc.pid)
        peak, first, last, count = idle, None, None, 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            now, count = time.monotonic(), client.llen(parked_key)
            peak = max(peak, rss_mb(proc.pid))
            if count and first is None:
                first = (now, count)
            # all but the few the worker holds waiting, and the unguarded task has run
            if count <= tasks - HELD and count >= tasks - 2 * HELD and (
                    "unguarded" in probe.intervals()):
                last = (now, count)
                break
            time.sleep(0.02)
        if first is None or last is None:
            raise RuntimeError(f"backlog: {count} of {tasks} parked")
        unguarded = probe.intervals()["unguarded"]
        row.update(unguarded_behind=behind,
                   unguarded_started_s=round((unguarded[0][0] - ready) / 1e9, 2))
        if not park_on_send:
            row["parked_per_s"] = round((last[1] - first[1]) / max(last[0] - first[0], 1e-3))
        row.update(rss_idle_mb=round(idle, 1), rss_peak_mb=round(peak, 1),
                   rss_growth_mb=round(peak - idle, 1))
        if drain:
            blocker.release()
            semaphore.resize(4)
            started = time.monotonic()
            while len(probe.completed("b")) < tasks or any(
                    n == 0 for n in probe.completed("b").values()):
                if time.monotonic() - started > tasks / 20 + 120:
                    raise RuntimeError(f"drain: {len(probe.completed('b'))} of {tasks} ran")
                time.sleep(0.5)
            done = probe.completed("b")
            row.update(drained_s=round(time.monotonic() - started, 1),
                       ran_once=all(n == 1 for n in done.values()) and len(done) == tasks,
                       max_concurrent=probe.max_concurrent("b"),
                       rss_after_drain_mb=round(rss_mb(proc.pid), 1),
                       received_per_task=round(open(log).read().count(" received") / tasks, 3))
    finally:
        blocker.release()
        proc.terminate()
        proc.wait(120)
        bench_app.app.close()
        client.close()
    print(f"  {row}", flush=True)
    return row
