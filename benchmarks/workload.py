"""The [celery] workload: 120 tasks of 50 ms, limit 4, 2 workers x 4 prefork processes.

Three set-ups in one run, on one Redis broker:

* ``gate``: celery-semaphore (``@app.task(semaphore=..., limit=4)``), 2 workers x 4;
* ``dedicated queue``: the Celery docs' advice, 1 worker with concurrency 4, unguarded;
* ``diy``: a Redis semaphore taken in the task body, ``self.retry(countdown=1)`` when full.

Measured from the probe file the bodies write (CLOCK_MONOTONIC, system-wide) and the workers'
logs: slot utilization = sum of body time / (limit x makespan, first start to last end);
deliveries per task = "received" log lines / tasks; handoff = a body's end to the start of the
body that took its slot (the i-th start after the first ``limit`` pairs with the i-th end).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from tests.probe import Probe
from tests.servers import redis_db, slots_url, unique_tag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS, HOLD, LIMIT = 120, 0.05, 4


def _start_worker(env: Dict[str, str], name: str, concurrency: int, log: str):
    cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.bench_app", "worker", "-P",
           "prefork", "-c", str(concurrency), "-n", f"{name}@%h", "-Q", env["BENCH_QUEUE"],
           "-l", "info", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while " ready." not in open(log, errors="replace").read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {name} failed: {open(log).read()[-2000:]}")
        time.sleep(0.1)
    return proc


def run_setup(kind: str, broker: str, backend: str) -> Dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix=f"bench-{kind}-")
    tag = unique_tag()
    env = dict(os.environ, BENCH_BROKER=broker, BENCH_SEMAPHORE_BACKEND=backend,
               BENCH_PREFIX=f"{tag}:", BENCH_QUEUE=f"{tag}.q",
               BENCH_PROBE=os.path.join(tmp, "probe.log"), PYTHONPATH=ROOT)
    workers = [(f"{kind}1", 4)] if kind == "dedicated" else [(f"{kind}1", 4), (f"{kind}2", 4)]
    logs = [os.path.join(tmp, f"{name}.log") for name, _ in workers]
    procs = [_start_worker(env, name, c, log) for (name, c), log in zip(workers, logs)]
    os.environ.update({k: env[k] for k in env if k.startswith("BENCH_")})
    import importlib

    import benchmarks.bench_app as bench_app

    bench_app = importlib.reload(bench_app)
    task = {"gate": bench_app.gated, "dedicated": bench_app.plain, "diy": bench_app.diy}[kind]
    probe = Probe(env["BENCH_PROBE"])
    try:
        for i in range(TASKS):
            task.delay(f"t{i}", HOLD)
        deadline = time.monotonic() + 300
        while len(probe.completed()) < TASKS or any(
                n == 0 for n in probe.completed().values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: only {len(probe.completed())} tasks finished")
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        bench_app.app.close()
    received = sum(open(log, errors="replace").read().count(" received") for log in logs)
    return {"setup": kind, **analyse(probe), "deliveries_per_task": round(received / TASKS, 3)}


def analyse(probe: Probe) -> Dict[str, Any]:
    spans = [run for runs in probe.intervals().values() for run in runs]
    starts = sorted(s for s, _ in spans)
    ends = sorted(e for _, e in spans)
    makespan = (ends[-1] - starts[0]) / 1e9
    busy = sum(e - s for s, e in spans) / 1e9
    handoffs = [(starts[LIMIT + i] - ends[i]) / 1e6 for i in range(len(starts) - LIMIT)]
    handoffs = sorted(h for h in handoffs if h >= 0)
    return {
        "makespan_s": round(makespan, 3),
        "utilization": round(busy / (LIMIT * makespan), 4),
        "max_concurrent": probe.max_concurrent(),
        "handoff_p50_ms": round(statistics.median(handoffs), 2) if handoffs else None,
        "handoff_p99_ms": round(handoffs[int(len(handoffs) * 0.99)], 2) if handoffs else None,
    }


def broker_url(redis_url: str) -> str:
    """The workload's broker: database 12 of the benchmarks' Redis server."""
    return redis_db(redis_url, 12)


def run(redis_url: str, amqp_url: str) -> List[Dict[str, Any]]:
    broker = broker_url(redis_url)
    rows = []
    setups = [("dedicated", "dedicated", redis_url), ("gate", "gate", redis_url),
              ("gate amqp tokens", "gate", amqp_url),
              ("gate amqp slots", "gate", slots_url(amqp_url)),
              ("diy", "diy", redis_url)]
    for label, kind, backend in setups:
        row = {**run_setup(kind, broker, backend), "setup": label}
        print(f"  {row}", flush=True)
        rows.append(row)
    return rows
