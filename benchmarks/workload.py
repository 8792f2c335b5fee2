"""The Celery workloads of ``docs/benchmarks.md`` (W1 - W5), each beside its baseline in
the same run, on one Redis broker, with real ``celery worker`` processes (prefork):

* W1 burst: 120 x 50 ms, limit 4; also with the RabbitMQ backends, PostgreSQL, Redis Sentinel
  and Redis Cluster (private servers, :func:`benchmarks.backends.ha_redis`), and "diy" (a
  Redis semaphore taken in the task body, ``self.retry(countdown=1)`` when full);
* W2 backlog: 2,000 x 10 ms, and 1,000 x 50 ms, sent at once, limit 4;
* W4 wider than one worker: 400 x 50 ms, limit 8;
* W3 hot tenant: 400 x 20 ms of tenant "hot" (limit 1), then 60 x 20 ms over 6 other tenants
  (limit 2 each), one template ``tenant:{tenant}``; baseline: the same 60 with no backlog;
* W5 fair share: 200 x 20 ms of tenant "big", then 20 x 20 ms each of b, c, d, one semaphore
  (limit 4) with ``semaphore_fair_by="{tenant}"``; baseline: the same 60 alone (and the same
  run in FIFO, as before fair shares).

The gate runs on 2 workers x 4 processes; the dedicated-queue baseline is one worker with
concurrency = limit on its own queue, prefetch 1, acks late (Celery's advice for a limit).

Measured from the probe file the bodies write (CLOCK_MONOTONIC, system-wide) and the workers'
logs: utilization = sum of body time / (limit x makespan, first send to last end);
deliveries per task = "received" log lines / tasks; handoff = a body's end to the start of the
body that took its slot (the k-th start minus the (k - limit)-th end).
"""

from __future__ import annotations

import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tests.probe import Probe, probe_for
from tests.servers import redis_db, slots_url, unique_tag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A send: (task name in bench_app, args).
Send = Tuple[str, tuple]
SMALL_TENANTS = ("a", "b", "c", "d", "e", "f")


def _start_worker(env: Dict[str, str], name: str, concurrency: int, log: str,
                  extra: Sequence[str] = ()):
    cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.bench_app", "worker", "-P",
           "prefork", "-c", str(concurrency), "-n", f"{name}@%h", "-Q", env["BENCH_QUEUE"],
           "-l", env.get("BENCH_LOGLEVEL", "info"), "--without-gossip", "--without-mingle",
           "--without-heartbeat", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while " ready." not in open(log, errors="replace").read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {name} failed: {open(log).read()[-2000:]}")
        time.sleep(0.1)
    return proc


def wait_for_ends(probe: Probe, base: int, total: int, prefix: str, timeout: float,
                  what: str) -> None:
    """Wait until ``total`` bodies of keys starting with ``prefix`` have ended, ``base``
    having ended before: a cheap count while they run (the sender shares the machine's cores
    with the workers: parsing the whole record 20 times a second would slow them), then one
    parse to check that each key ended (a task run twice is not a task that ran)."""
    deadline = time.monotonic() + timeout
    while True:
        if probe.ended() - base >= total:
            done = probe.completed(prefix)
            if len(done) >= total and all(n > 0 for n in done.values()):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: only {len(probe.completed(prefix))} of {total} "
                               f"tasks finished in {timeout}s")
        time.sleep(0.05)


def probe_target(tmp: str, tag: str) -> str:
    """Where the bodies record their start and end: a file (the default: no load on any
    server), or with ``BENCH_PROBE_KIND=redis`` a list in database 15 of the benchmarks'
    Redis server with about five commands per body, as the probe of the issues' figures
    (:class:`tests.probe.RedisProbe`)."""
    if os.environ.get("BENCH_PROBE_KIND", "file") == "redis":
        from tests.servers import redis_url

        return f"{redis_db(redis_url(), 15)}#{tag}:probe"
    return os.path.join(tmp, "probe.log")


def new_run(kind: str, broker: str, backend: str, limit: int, park_on_send: bool = True
            ) -> Tuple[str, str, Dict[str, str], Any]:
    """A fresh temporary directory, tag (queue and key prefix), worker environment and bench
    app (reloaded with that environment) for one run: ``(tmp, tag, env, bench_app)``.
    ``park_on_send`` False: guarded tasks go to the task queue (``semaphore_park_on_send``)."""
    tmp = tempfile.mkdtemp(prefix=f"bench-{kind}-")
    tag = unique_tag()
    env = dict(os.environ, BENCH_BROKER=broker, BENCH_SEMAPHORE_BACKEND=backend,
               BENCH_PREFIX=f"{tag}:", BENCH_QUEUE=f"{tag}.q", BENCH_LIMIT=str(limit),
               BENCH_PROBE=probe_target(tmp, tag), PYTHONPATH=ROOT,
               BENCH_PARK_ON_SEND="1" if park_on_send else "0")
    os.environ.update({k: env[k] for k in env if k.startswith("BENCH_")})
    import benchmarks.bench_app as bench_app

    return tmp, tag, env, importlib.reload(bench_app)


def run_setup(kind: str, broker: str, backend: str, limit: int, batches: List[List[Send]],
              timeout: float = 600) -> Tuple[Probe, int, List[int]]:
    """Start the workers of ``kind`` (gate: 2 x 4; dedicated: 1 x limit, prefetch 1), send
    each batch in turn, wait until every body has ended. Returns the probe, the deliveries
    counted in the workers' logs, and the monotonic_ns time each batch began to be sent."""
    tmp, _, env, bench_app = new_run(kind, broker, backend, limit)
    if kind == "dedicated":
        workers = [(f"{kind}1", limit, ["--prefetch-multiplier", "1"])]
    else:
        workers = [(f"{kind}1", 4, []), (f"{kind}2", 4, [])]
    logs = [os.path.join(tmp, f"{name}.log") for name, _, _ in workers]
    procs = [_start_worker(env, name, c, log, extra)
             for (name, c, extra), log in zip(workers, logs)]
    probe = probe_for(env["BENCH_PROBE"])
    total = sum(len(batch) for batch in batches)
    sent_at = []
    try:
        for batch in batches:
            sent_at.append(time.monotonic_ns())
            for task, args in batch:
                bench_app.app.tasks[f"benchmarks.bench_app.{task}"].delay(*args)
        wait_for_ends(probe, 0, total, "", timeout, kind)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        bench_app.app.close()
    received = sum(open(log, errors="replace").read().count(" received") for log in logs)
    return probe, received, sent_at


def analyse(probe: Probe, limit: int, sent_at: int, prefix: str = "") -> Dict[str, Any]:
    """The figures of one run whose first send was at ``sent_at`` (monotonic ns)."""
    spans = [run for key, runs in probe.intervals().items() if key.startswith(prefix)
             for run in runs]
    starts = sorted(s for s, _ in spans)
    ends = sorted(e for _, e in spans)
    makespan = (ends[-1] - sent_at) / 1e9
    busy = sum(e - s for s, e in spans) / 1e9
    handoffs = [(starts[limit + i] - ends[i]) / 1e6 for i in range(len(starts) - limit)]
    handoffs = sorted(h for h in handoffs if h >= 0)
    return {
        "makespan_s": round(makespan, 3),
        "utilization": round(busy / (limit * makespan), 4),
        "max_concurrent": probe.max_concurrent(prefix),
        "handoff_p50_ms": round(statistics.median(handoffs), 2) if handoffs else None,
        "handoff_p99_ms": round(handoffs[int(len(handoffs) * 0.99)], 2) if handoffs else None,
    }


def turnaround(probe: Probe, prefix: str, since_ns: int) -> Dict[str, Any]:
    """How long a freed pool process waited for its next body (:meth:`.Probe.turnarounds`),
    for bodies of ``prefix`` that ended from ``since_ns`` on: mean, p50 and p99 in ms. Where a
    limit never binds, what the gate adds to it is what it costs in throughput."""
    gaps = sorted(probe.turnarounds(prefix, since_ns))
    if not gaps:
        return {}
    return {"turnaround_mean_ms": round(statistics.fmean(gaps), 2),
            "turnaround_p50_ms": round(statistics.median(gaps), 2),
            "turnaround_p99_ms": round(gaps[int(len(gaps) * 0.99)], 2)}


def uniform(workload: str, tasks: int, hold: float, limit: int, broker: str,
            setups: List[Tuple[str, str, str]]) -> List[Dict[str, Any]]:
    """One semaphore, ``tasks`` bodies of ``hold`` seconds sent at once; a row per setup and
    each gate row's utilization as a ratio of the dedicated queue's."""
    rows = []
    for label, kind, backend in setups:
        task = {"gate": "gated", "dedicated": "plain", "diy": "diy"}[kind]
        probe, received, sent_at = run_setup(kind, broker, backend, limit,
                                             [[(task, (f"t{i}", hold)) for i in range(tasks)]])
        row = {"workload": workload, "setup": label, "tasks": f"{tasks} x {int(hold * 1000)} ms",
               "limit": limit, **analyse(probe, limit, sent_at[0]),
               "deliveries_per_task": round(received / tasks, 3)}
        print(f"  {row}", flush=True)
        rows.append(row)
    base = next(r for r in rows if r["setup"] == "dedicated")
    for row in rows:
        row["vs_dedicated"] = round(row["utilization"] / base["utilization"], 3)
    return rows


def hot_tenant(broker: str, backend: str, hot: int = 400, per_small: int = 10,
               hold: float = 0.02) -> List[Dict[str, Any]]:
    """W3: the small tenants' makespan (from their first send to their last body's end) behind
    the hot tenant's backlog, against the same tasks alone."""
    small = [("tenant", (t, f"s{t}:{i}", hold)) for i in range(per_small) for t in SMALL_TENANTS]
    rows = []
    alone: Optional[float] = None
    for label, batches in (("small tenants alone", [small]),
                           ("small tenants behind the hot backlog",
                            [[("tenant", ("hot", f"hot:{i}", hold)) for i in range(hot)],
                             small])):
        probe, received, sent_at = run_setup("gate", broker, backend, 2, batches)
        ends = [e for key, runs in probe.intervals().items() if key.startswith("s")
                for _, e in runs]
        small_makespan = (max(ends) - sent_at[-1]) / 1e9
        alone = alone or small_makespan
        row = {"workload": "W3", "setup": label, "tasks": f"{len(small)} x {int(hold * 1000)} ms"
               + (f" behind {hot}" if len(batches) > 1 else ""),
               "limit": "1 / 2", "small_makespan_s": round(small_makespan, 3),
               "vs_alone": round(small_makespan / alone, 2),
               "max_concurrent": max(probe.max_concurrent(f"s{t}:") for t in SMALL_TENANTS),
               "deliveries_per_task": round(received / sum(map(len, batches)), 3)}
        if len(batches) > 1:
            row["max_concurrent"] = f"{probe.max_concurrent('hot:')} hot, " \
                                    f"{row['max_concurrent']} small"
        print(f"  {row}", flush=True)
        rows.append(row)
    return rows


def fair_share(broker: str, backend: str, big: int = 200, per_small: int = 20,
               hold: float = 0.02, small_tenants: Sequence[str] = ("b", "c", "d")
               ) -> List[Dict[str, Any]]:
    """W5: ``big`` tasks of tenant "big", then ``per_small`` of each small tenant, on one
    semaphore (limit 4) with ``semaphore_fair_by="{tenant}"``; the small tenants' makespan
    (their first send to their last body's end) alone, behind the backlog with fair shares,
    and behind it in FIFO (no ``semaphore_fair_by``, as before). ``speed_vs_alone`` = makespan
    alone / makespan here (the issue asks >= 0.5 with fair shares)."""
    rows = []
    alone: Optional[float] = None
    for label, task, with_big in (("small tenants alone", "fair", False),
                                  ("behind the big backlog, fair", "fair", True),
                                  ("behind the big backlog, FIFO", "unfair", True)):
        small = [(task, (t, f"s{t}:{i}", hold)) for i in range(per_small) for t in small_tenants]
        batches = [small]
        if with_big:
            batches = [[(task, ("big", f"big:{i}", hold)) for i in range(big)], small]
        probe, received, sent_at = run_setup("gate", broker, backend, 4, batches)
        ends = [e for key, runs in probe.intervals().items() if key.startswith("s")
                for _, e in runs]
        small_makespan = (max(ends) - sent_at[-1]) / 1e9
        alone = alone or small_makespan
        row = {"workload": "W5", "setup": label,
               "tasks": f"{len(small)} x {int(hold * 1000)} ms"
               + (f" behind {big}" if with_big else ""),
               "limit": 4, "small_makespan_s": round(small_makespan, 3),
               "speed_vs_alone": round(alone / small_makespan, 2),
               "max_concurrent": probe.max_concurrent(""),
               "deliveries_per_task": round(received / sum(map(len, batches)), 3)}
        print(f"  {row}", flush=True)
        rows.append(row)
    return rows


def broker_url(redis_url: str) -> str:
    """The workloads' broker: database 12 of the benchmarks' Redis server."""
    return redis_db(redis_url, 12)


def run(redis_url: str, amqp_url: str, more: Dict[str, str]) -> List[Dict[str, Any]]:
    """Every workload; ``more``: more backends for W1 by name (PostgreSQL, Sentinel,
    Cluster)."""
    broker = broker_url(redis_url)
    gate_vs_dedicated = [("dedicated", "dedicated", redis_url), ("gate", "gate", redis_url)]
    rows = uniform("W1", 120, 0.05, 4, broker, gate_vs_dedicated + [
        ("gate amqp tokens", "gate", amqp_url),
        ("gate amqp slots", "gate", slots_url(amqp_url)),
        *((f"gate {name}", "gate", url) for name, url in more.items()),
        ("diy", "diy", redis_url)])
    rows += uniform("W2", 2000, 0.01, 4, broker, gate_vs_dedicated)
    rows += uniform("W2", 1000, 0.05, 4, broker, gate_vs_dedicated)
    rows += uniform("W4", 400, 0.05, 8, broker, gate_vs_dedicated)
    rows += hot_tenant(broker, redis_url)
    rows += fair_share(broker, redis_url)
    return rows
