"""W11, cost as workers grow (``../shared/workloads.md``): 400 x 10 ms on one semaphore of
limit 2, with 2, 8 and 16 workers of concurrency 1 on a Redis broker, the backend on a Redis
server of its own (so that ``INFO commandstats`` counts the semaphore's commands alone, those
run inside scripts included).

Per size: backend commands per task (and the commands that make them up), limit utilization
(sum of body time / (limit x makespan), first send to last end) and the most bodies that ran
at once (never above the limit). ``python -m benchmarks.scaling [--sizes 2,8,16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Sequence

import redis

from benchmarks.pertask import _commands, _private_redis
from benchmarks.workload import _start_worker, analyse, broker_url, new_run
from tests.probe import probe_for

TASKS = 400
HOLD = 0.01
LIMIT = 2


def run_size(broker: str, workers: int, tasks: int = TASKS, hold: float = HOLD
             ) -> Dict[str, Any]:
    server, backend, workdir = _private_redis()
    tmp, tag, env, bench_app = new_run(f"w11-{workers}", broker, backend, LIMIT)
    env = dict(env, BENCH_LOGLEVEL="warning")
    procs = []
    client = redis.Redis.from_url(backend)
    try:
        for i in range(workers):
            procs.append(_start_worker(env, f"w11-{workers}-{i}", 1,
                                       os.path.join(tmp, f"w{i}.log")))
        probe = probe_for(env["BENCH_PROBE"])
        send = bench_app.app.tasks["benchmarks.bench_app.gated"]
        for i in range(4):  # warm: scripts loaded, connections made
            send.delay(f"warm{i}", 0.0)
        deadline = time.monotonic() + 60
        while len(probe.completed("warm")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _commands(client)
        base = probe.ended()
        began = time.monotonic_ns()
        for i in range(tasks):
            send.delay(f"t{i}", hold)
        deadline = time.monotonic() + 600
        while True:
            if probe.ended() - base >= tasks:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"W11 at {workers} workers: not every task ran")
            time.sleep(0.1)
        commands = _commands(client) - before
        figures = analyse(probe, LIMIT, began, prefix="t")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        bench_app.app.close()
        client.close()
        server.terminate()
        server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    return {"workload": "W11", "workers": workers, "tasks": f"{tasks} x {int(hold * 1000)} ms",
            "limit": LIMIT,
            "backend_cmds_per_task": round(sum(commands.values()) / tasks, 1),
            "backend_cmds": {k: round(v / tasks, 2) for k, v in commands.most_common()},
            "utilization": figures["utilization"], "makespan_s": figures["makespan_s"],
            "max_concurrent": figures["max_concurrent"]}


def run(broker: str, sizes: Sequence[int] = (2, 8, 16)) -> List[Dict[str, Any]]:
    rows = []
    for size in sizes:
        row = run_size(broker, size)
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = rows[0]["backend_cmds_per_task"]
    for row in rows:
        row["cmds_vs_smallest"] = round(row["backend_cmds_per_task"] / base, 2)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling")
    parser.add_argument("--sizes", default="2,8,16")
    args = parser.parse_args(argv)
    from tests.servers import redis_url

    for row in run(broker_url(redis_url()), [int(s) for s in args.sizes.split(",")]):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
