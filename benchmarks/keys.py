"""W6, many keys (``docs``: the workloads): one template ``t:{key}`` at limit 1 per key, K keys
x M tasks x 20 ms, sent key after key in rounds (round r sends task r of every key), against
the same tasks with no semaphore on the same two workers (x 4 prefork) in the same run, on a
Redis broker and on a RabbitMQ broker.

Per shape: makespan (first send to last end) guarded and unguarded and their ratio
(``vs_unguarded`` = unguarded makespan / guarded makespan: 1.0 is "costs nothing"), the time
the send loop took (``*_send_s``: a guarded send of a key the sender sent in the last 30 s asks
the backend whether that key has a backlog, one round trip; a new key is not asked), the
probe's most concurrent bodies of one key (never above 1), deliveries per task (from the
workers' "received" log lines), and the workers' main-process CPU seconds per 1,000 tasks
(``/proc/<pid>/stat``), guarded and unguarded, and how long a freed pool process waited for
its next body (``*_turnaround_*_ms``, from the probe's marks: what a handoff costs where the
limit is per key and the baseline has none). Per broker: the broker's queues (RabbitMQ) or
keys (Redis) and the backend's keys with the run's prefix before the first shape, right after
the last one, and 60 s later.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Dict, List, Sequence, Tuple

import redis

from benchmarks.workload import _start_worker, new_run, turnaround, wait_for_ends
from tests.probe import probe_for

SHAPES: Tuple[Tuple[int, int], ...] = ((1000, 1), (500, 2), (50, 20), (10000, 1))
HOLD = 0.02


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _amqp_queues(tag: str) -> int:
    out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True,
                         text=True, timeout=60).stdout
    return sum(1 for line in out.splitlines() if line.startswith(tag))


def _redis_keys(url: str, tag: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return sum(1 for _ in client.scan_iter(f"{tag}*", count=1000))
    finally:
        client.close()


def _received(logs: Sequence[str]) -> int:
    return sum(open(log, errors="replace").read().count(" received") for log in logs)


def run_broker(label: str, broker: str, backend: str,
               shapes: Sequence[Tuple[int, int]] = SHAPES) -> List[Dict[str, Any]]:
    tmp, tag, env, bench_app = new_run(f"w6-{label}", broker, backend, 1)
    logs = [os.path.join(tmp, f"w{i}.log") for i in (1, 2)]
    procs = [_start_worker(env, f"w6{label}{i}", 4, log) for i, log in zip((1, 2), logs)]
    probe = probe_for(env["BENCH_PROBE"])
    amqp = broker.startswith("amqp")

    def state() -> Dict[str, int]:
        return {"broker": _amqp_queues(tag) if amqp else _redis_keys(broker, tag),
                "backend": _redis_keys(backend, tag)}

    before = state()
    rows = []
    try:
        for keys, per_key in shapes:
            row: Dict[str, Any] = {"workload": "W6", "broker": label,
                                   "shape": f"{keys} keys x {per_key}"}
            for kind, task in (("unguarded", "keyed_plain"), ("guarded", "keyed")):
                prefix = f"{kind[0]}{keys}x{per_key}:"
                received, cpu = _received(logs), sum(_cpu_seconds(p.pid) for p in procs)
                send = bench_app.app.tasks[f"benchmarks.bench_app.{task}"]
                base = probe.ended()
                began = time.monotonic_ns()
                for r in range(per_key):
                    for k in range(keys):
                        send.delay(f"{prefix}{k}", r, HOLD)
                row[f"{kind}_send_s"] = round((time.monotonic_ns() - began) / 1e9, 3)
                total = keys * per_key
                wait_for_ends(probe, base, total, prefix, 600, f"W6 {label} {kind}")
                ends = [e for key, runs in probe.intervals().items() if key.startswith(prefix)
                        for _, e in runs if e is not None]
                row[f"{kind}_s"] = round((max(ends) - began) / 1e9, 3)
                row.update({f"{kind}_{figure}": value for figure, value
                            in turnaround(probe, prefix, began).items()})
                row[f"{kind}_cpu_s_per_1000"] = round(
                    (sum(_cpu_seconds(p.pid) for p in procs) - cpu) * 1000 / total, 3)
                row[f"{kind}_deliveries"] = round((_received(logs) - received) / total, 3)
                if kind == "guarded":
                    row["max_per_key"] = max(probe.max_concurrent(f"{prefix}{k}/")
                                             for k in range(min(keys, 200)))
            row["vs_unguarded"] = round(row["unguarded_s"] / row["guarded_s"], 3)
            print(f"  {row}", flush=True)
            rows.append(row)
        after = state()
        time.sleep(60)
        later = state()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        bench_app.app.close()
    rows.append({"workload": "W6", "broker": label, "shape": "state",
                 "broker_before": before["broker"], "broker_after": after["broker"],
                 "broker_60s_after": later["broker"], "backend_before": before["backend"],
                 "backend_after": after["backend"], "backend_60s_after": later["backend"]})
    print(f"  {rows[-1]}", flush=True)
    return rows


def run(redis_url: str, amqp_url: str, broker: str,
        shapes: Sequence[Tuple[int, int]] = SHAPES) -> List[Dict[str, Any]]:
    """W6 on a Redis broker (``broker``) and on RabbitMQ, the Redis backend for both."""
    return (run_broker("redis", broker, redis_url, shapes)
            + run_broker("rabbitmq", amqp_url, redis_url, shapes))


if __name__ == "__main__":
    import sys

    from benchmarks.workload import broker_url
    from tests.servers import amqp_url, redis_url

    only = sys.argv[1:] or ["redis", "rabbitmq"]
    url = redis_url()
    shapes = SHAPES if os.environ.get("W6_DRAIN", "1") == "1" else SHAPES[:3]
    for name in only:
        run_broker(name, broker_url(url) if name == "redis" else amqp_url(), url, shapes)
