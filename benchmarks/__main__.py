"""``python -m benchmarks``: run every benchmark, write benchmarks/results/{results.json,
results.md, *.png}. The README's benchmark table is results.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone

from benchmarks import backends, workload

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(rows, columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def markdown(data) -> str:
    base = next(r for r in data["workload"] if r["setup"] == "dedicated")
    ratios = ", ".join(
        f"{r['setup']} **{round(r['utilization'] / base['utilization'], 3)}**"
        for r in data["workload"] if r["setup"].startswith("gate")
    )
    return "\n\n".join([
        f"Measured {data['date']} on {data['machine']}; Redis and RabbitMQ on loopback.",
        "Backends: acquire+release pairs/s and acquire latency (limit above the number of "
        "processes, so no waiting):",
        table(data["backends"], ["backend", "processes", "pairs_per_s", "acquire_p50_ms",
                                 "acquire_p99_ms", "note"]),
        "The last row divides a second by Redis's own time per acquire+release (two script "
        "calls): the server's capacity. The runs above it are bound by the Python clients, "
        "which share the machine's cores with Redis.",
        f"Celery workload: {workload.TASKS} tasks of {int(workload.HOLD * 1000)} ms, limit "
        f"{workload.LIMIT}, Redis broker; gate and diy on 2 workers x 4 prefork processes, "
        "dedicated queue on 1 worker x 4; the gate with the Redis backend unless named:",
        table(data["workload"], ["setup", "utilization", "deliveries_per_task",
                                 "handoff_p50_ms", "handoff_p99_ms", "makespan_s",
                                 "max_concurrent"]),
        f"Gate utilization / dedicated-queue utilization: {ratios}.",
    ]) + "\n"


def plots(data, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = [r for r in data["backends"] if not r.get("note")]
    labels = [f"{r['backend']}\n{r['processes']} proc" for r in rows]
    ax.bar(labels, [r["pairs_per_s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("acquire+release pairs/s")
    ax.set_title("Backend throughput")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "backends.png"), dpi=110)

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    setups = [r["setup"] for r in data["workload"]]
    left.bar(setups, [r["utilization"] for r in data["workload"]], color="#55a868")
    left.set_ylim(0, 1.05)
    left.set_title("Slot utilization")
    right.bar(setups, [r["handoff_p50_ms"] or 0 for r in data["workload"]], color="#c44e52",
              label="p50")
    right.set_yscale("log")
    right.set_title("Handoff latency p50 (ms, log)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "workload.png"), dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run every benchmark (a few minutes) against the local Redis and RabbitMQ.")
    parser.add_argument("--output", default=RESULTS, metavar="DIR",
                        help="where results.json, results.md and the plots go "
                             "(default: benchmarks/results, the README's figures)")
    out = parser.parse_args(argv).output
    from tests.servers import amqp_url, redis_url, sweep_amqp, sweep_redis

    os.makedirs(out, exist_ok=True)
    url = os.environ.get("REDIS_URL") or redis_url()
    rabbit = amqp_url()
    try:
        print("backends:", flush=True)
        data = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine(),
                "backends": backends.run(url, rabbit)}
        print("celery workload:", flush=True)
        data["workload"] = workload.run(url, rabbit)
    finally:  # the benchmarks' own queues and keys (their names carry this run's tags)
        sweep_amqp(rabbit)
        sweep_redis(url)
        sweep_redis(workload.broker_url(url))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(data, f, indent=2)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(data))
    plots(data, out)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
