"""The waiting room under a deep backlog: one worker (prefork, 4 processes), a Redis broker and
backend, ``tasks`` guarded tasks of 5 ms queued before the worker starts, on a semaphore of
limit 1 whose one slot the benchmark holds, so that the worker can only park.

Measured: how fast the worker parks the backlog (parked messages per second, read from the
broker: the parking queue's length), its main process's RSS idle and at its peak while it
parks; then, with ``drain``, the slot is released and the semaphore resized to 4: every task
must run exactly once, never more than 4 at once (from the probe).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from typing import Any, Dict

import redis

from benchmarks.workload import ROOT, _start_worker
from celery_semaphore.waiting_room import parking_queue_name
from tests.probe import Probe
from tests.servers import unique_tag


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def run(broker: str, backend: str, tasks: int = 20000, drain: bool = False) -> Dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="bench-backlog-")
    tag = unique_tag()
    env = dict(os.environ, BENCH_BROKER=broker, BENCH_SEMAPHORE_BACKEND=backend,
               BENCH_PREFIX=f"{tag}:", BENCH_QUEUE=f"{tag}.q", BENCH_LIMIT="1",
               BENCH_PROBE=os.path.join(tmp, "probe.log"), PYTHONPATH=ROOT)
    os.environ.update({k: env[k] for k in env if k.startswith("BENCH_")})
    import benchmarks.bench_app as bench_app

    bench_app = importlib.reload(bench_app)
    client = redis.Redis.from_url(broker)
    parked_key = parking_queue_name(f"{tag}:", "bench")
    with bench_app.app.producer_or_acquire() as producer:
        for i in range(tasks):
            bench_app.gated.apply_async((f"b{i}", 0.005), producer=producer)
    from celery_semaphore import Semaphore

    semaphore = Semaphore("bench", 1, backend, key_prefix=f"{tag}:", ttl=3600)
    blocker = semaphore.acquire()
    log = os.path.join(tmp, "worker.log")
    proc = _start_worker(env, "backlog", 4, log)
    row: Dict[str, Any] = {"tasks": tasks}
    try:
        idle = rss_mb(proc.pid)
        peak, first, last, count = idle, None, None, 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            now, count = time.monotonic(), client.llen(parked_key)
            peak = max(peak, rss_mb(proc.pid))
            if count and first is None:
                first = (now, count)
            if count >= tasks - 16:  # all but the few the worker holds waiting
                last = (now, count)
                break
            time.sleep(0.02)
        if first is None or last is None:
            raise RuntimeError(f"backlog: only {count} of {tasks} parked")
        row.update(parked_per_s=round((last[1] - first[1]) / max(last[0] - first[0], 1e-3)),
                   rss_idle_mb=round(idle, 1), rss_peak_mb=round(peak, 1),
                   rss_growth_mb=round(peak - idle, 1))
        if drain:
            blocker.release()
            semaphore.resize(4)
            probe = Probe(env["BENCH_PROBE"])
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
