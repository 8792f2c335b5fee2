"""``python -m benchmarks``: run every benchmark, write benchmarks/results/{results.json,
results.md, *.png}. The README's benchmark table is results.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone

from benchmarks import backends, backlog, keys, pertask, scaling, traffic, upstream, workload

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
    uniform = [r for r in data["workload"] if r["workload"] not in ("W3", "W5")]
    hot = [r for r in data["workload"] if r["workload"] == "W3"]
    fair = [r for r in data["workload"] if r["workload"] == "W5"]
    return "\n\n".join([
        f"Measured {data['date']} on {data['machine']}; Redis, RabbitMQ and PostgreSQL on "
        "loopback.",
        "Backends: acquire+release pairs/s and acquire latency (limit above the number of "
        "processes, so no waiting):",
        table(data["backends"], ["backend", "processes", "pairs_per_s", "acquire_p50_ms",
                                 "acquire_p99_ms", "note"]),
        "The row \"redis (server only)\" divides a second by Redis's own time per "
        "acquire+release (two script calls): the server's capacity. The runs above it are "
        "bound by the Python clients, which share the machine's cores with Redis. The row "
        "after it says where one pair's server CPU goes, and the next what a script call costs "
        "the server beside 1 to 256 other holders.",
        "Celery workloads (`docs/benchmarks.md`), Redis broker; the gate (Redis backend "
        "unless named) and diy on 2 workers x 4 prefork processes, the dedicated queue on one "
        "worker with concurrency = limit, prefetch 1, acks late; `vs_dedicated` = utilization / "
        "the dedicated queue's utilization in the same run:",
        table(uniform, ["workload", "setup", "tasks", "limit", "utilization", "vs_dedicated",
                        "deliveries_per_task", "handoff_p50_ms", "handoff_p99_ms",
                        "makespan_s", "max_concurrent"]),
        "W3, a hot tenant: the 60 small-tenant tasks' makespan (first send to last end), alone "
        "and sent behind the hot tenant's 400:",
        table(hot, ["setup", "tasks", "limit", "small_makespan_s", "vs_alone",
                    "deliveries_per_task", "max_concurrent"]),
        "W5, fair shares (`semaphore_fair_by=\"{tenant}\"`, limit 4): the 60 small-tenant "
        "tasks' makespan alone and behind tenant big's 200, with fair shares and in FIFO; "
        "`speed_vs_alone` = makespan alone / makespan:",
        table(fair, ["setup", "tasks", "limit", "small_makespan_s", "speed_vs_alone",
                     "deliveries_per_task", "max_concurrent"]),
        "W6, many keys: one template `t:{key}` at limit 1 per key, K keys x M tasks x 20 ms "
        "sent key after key in rounds, against the same tasks with no semaphore on the same "
        "two workers (x 4 prefork) in the same run; `vs_unguarded` = unguarded makespan / "
        "guarded makespan; CPU: the workers' main processes, seconds per 1,000 tasks:",
        table([r for r in data.get("keys", []) if r["shape"] != "state"],
              ["broker", "shape", "unguarded_s", "guarded_s", "vs_unguarded",
               "unguarded_deliveries", "guarded_deliveries", "max_per_key",
               "unguarded_cpu_s_per_1000", "guarded_cpu_s_per_1000"]),
        "W6, what the run left: the broker's queues (RabbitMQ) or keys (Redis) and the "
        "backend's keys with the run's prefix, before, right after the last shape, and 60 s "
        "later:",
        table([r for r in data.get("keys", []) if r["shape"] == "state"],
              ["broker", "broker_before", "broker_after", "broker_60s_after",
               "backend_before", "backend_after", "backend_60s_after"]),
        "W7, a cluster-wide rate (`semaphore_rate=\"50/s\"`, 300 x 10 ms) beside Celery's own "
        "`rate_limit=\"25/s\"` on each of the two workers; W8, weighted slots (200 x 50 ms, "
        "`semaphore_cost` 1, 2 or 4, limit 8 units) beside the ideal FIFO schedule of the same "
        "costs with zero handoff:",
        table(data.get("traffic", []), [
            "workload", "setup", "tasks", "starts_per_s", "vs_asked", "max_starts_in_1s",
            "unit_utilization", "ideal_fifo_utilization", "vs_ideal", "max_units",
            "makespan_s", "deliveries_per_task"]),
        "W9, the gate's cost per task: N tasks on one semaphore whose limit (1,000) never "
        "binds (and W6's 1,000 x 1: one task per key, limit 1 per key, 20 ms), beside the "
        "same tasks unguarded on the same two workers (x 4 prefork), rounds "
        "in alternating order; the workers' main processes (every thread): CPU seconds per "
        "1,000 tasks and context switches per task; their pool processes' CPU seconds per 1,000 "
        "tasks (pool_cpu); the whole machine's CPU seconds per 1,000 "
        "tasks (machine_cpu) and how busy its cores were (machine_busy); the backend server's "
        "CPU seconds per 1,000 tasks; commands per task on the backend (a Redis "
        "of its own: scripts' own commands included) and on the broker (the shared server):",
        table([r for r in data.get("pertask", []) if r.get("kind") == "guarded"],
              ["workload", "tasks", "round", "makespan_s", "vs_unguarded", "cpu_s_per_1000",
               "cpu_vs_unguarded", "pool_cpu_s_per_1000", "machine_cpu_vs_unguarded",
               "backend_server_cpu_s_per_1000",
               "machine_busy", "switches_per_task", "backend_cmds_per_task",
               "broker_cmds_per_task"]),
        table([r for r in data.get("pertask", []) if r.get("kind") == "unguarded"],
              ["workload", "tasks", "round", "makespan_s", "cpu_s_per_1000",
               "pool_cpu_s_per_1000", "machine_cpu_s_per_1000", "machine_busy", "switches_per_task",
               "broker_cmds_per_task"]),
        "W11, cost as workers grow: 400 x 10 ms on one semaphore of limit 2, workers of "
        "concurrency 1, the backend on a Redis of its own; commands per task inside scripts "
        "included:",
        table(data.get("scaling", []), ["workers", "tasks", "limit", "backend_cmds_per_task",
                                        "cmds_vs_smallest", "utilization", "makespan_s",
                                        "max_concurrent"]),
        "W10, an API behind the task: a partner API on loopback (20 ms a call) that answers "
        "429 past limits of its own; the library's way beside Celery's own (`autoretry_for` "
        "the 429, `retry_backoff`) and an oracle that knows the API's limits, in the same run "
        "(W10a a window quota and Backoff(retry_after) from the header; W10b an unknown "
        "concurrency that halves halfway, Adaptive and Backoff(); W10c a token budget, a "
        "quota in tokens, settle() after each call). `early_calls`: calls that reached the API "
        "more than 0.1 s after it answered a 429 and before that 429's Retry-After ran out:",
        table(data.get("upstream", []), ["workload", "way", "calls", "goodput_per_s",
                                         "vs_oracle", "share_429", "share_429_after_10s",
                                         "recovered_s", "celery_retries", "early_calls",
                                         "max_calls_in_a_window", "max_tokens_in_a_window",
                                         "least_share_used", "makespan_s"]),
        "The waiting room under a deep backlog: guarded tasks sent while their semaphore is "
        "full reach one worker (-c 4), parked on send (the default) or parked by the worker "
        "(`semaphore_park_on_send = False`). `parked_per_s`: on send, the sender's rate into "
        "the parking queue, beside the same sender's rate for plain tasks (`floor_per_s`); by "
        "the worker, its parking rate read from the broker, beside the same worker's rate of "
        "receiving and discarding expired unguarded tasks (Celery's own floor for a message it "
        "does not run). Then the start of an unguarded task sent behind the first 5,000 (from "
        "the worker's ready; and with two workers, from the first one's ready), the RSS of the "
        "worker's main process, and the drain at limit 4:",
        table(data["backlog"], ["tasks", "parked", "parked_per_s", "floor_per_s",
                                "parked_vs_floor", "unguarded_started_s",
                                "unguarded_started_2_workers_s", "rss_idle_mb",
                                "rss_peak_mb", "rss_growth_mb", "drained_s",
                                "rss_after_drain_mb", "ran_once", "max_concurrent",
                                "received_per_task"]),
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

    rows = [r for r in data["workload"] if "utilization" in r]  # W3 and W5 have no utilization
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['workload']} {r['tasks']}\n{r['setup']}" for r in rows]
    left.barh(labels, [r["utilization"] for r in rows], color="#55a868")
    left.set_xlim(0, 1.05)
    left.invert_yaxis()
    left.set_title("Slot utilization")
    right.barh(labels, [r["handoff_p99_ms"] or 0 for r in rows], color="#c44e52")
    right.set_xscale("log")
    right.invert_yaxis()
    right.set_yticklabels([])
    right.set_title("Handoff latency p99 (ms, log)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "workload.png"), dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run every benchmark (a few minutes) against the local Redis and RabbitMQ.")
    parser.add_argument("--output", default=RESULTS, metavar="DIR",
                        help="where results.json, results.md and the plots go "
                             "(default: benchmarks/results, the README's figures)")
    parser.add_argument("--backlog", type=int, default=20000, metavar="N",
                        help="guarded tasks in the backlog benchmark (default: 20000)")
    args = parser.parse_args(argv)
    out = args.output
    from tests.servers import (
        amqp_url,
        postgres_url,
        redis_url,
        sweep_amqp,
        sweep_postgres,
        sweep_redis,
    )

    os.makedirs(out, exist_ok=True)
    url = os.environ.get("REDIS_URL") or redis_url()
    rabbit = amqp_url()
    postgres = postgres_url()
    try:
        with backends.ha_redis() as ha:
            more = {"postgres": postgres, **ha}
            print("backends:", flush=True)
            data = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                    "machine": machine(), "backends": backends.run(url, rabbit, more)}
            print("celery workloads:", flush=True)
            data["workload"] = workload.run(url, rabbit, more)
        print("the gate's cost per task (W9):", flush=True)
        broker = workload.broker_url(url)
        data["pertask"] = (pertask.run(broker, 3000, 0.001, rounds=2)
                           + pertask.run(broker, 2000, 0.0, rounds=2)
                           + pertask.run(broker, 1000, 0.02, rounds=2, shape="w6"))
        print("cost as workers grow (W11):", flush=True)
        data["scaling"] = scaling.run(broker)
        print("many keys (W6):", flush=True)
        data["keys"] = keys.run(url, rabbit, workload.broker_url(url))
        print("rates and costs (W7, W8):", flush=True)
        data["traffic"] = traffic.run(url)
        print("an API behind the task (W10):", flush=True)
        data["upstream"] = upstream.run(url)
        print("backlog:", flush=True)
        broker = workload.broker_url(url)
        data["backlog"] = []
        for park_on_send in (True, False):
            row = backlog.run(broker, url, args.backlog, drain=True, park_on_send=park_on_send)
            if not park_on_send:
                row["floor_per_s"] = backlog.discard_floor(broker, url)
            row["parked_vs_floor"] = round(row["parked_per_s"] / row["floor_per_s"], 2)
            row["unguarded_started_2_workers_s"] = backlog.unguarded_behind(
                broker, url, park_on_send=park_on_send)
            data["backlog"].append(row)
    finally:  # the benchmarks' own queues and keys (their names carry this run's tags)
        sweep_amqp(rabbit)
        sweep_postgres(postgres)
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
