"""W7 (cluster-wide rate) and W8 (weighted slots) of ``../shared/workloads.md``, each beside
its baseline, with real ``celery worker`` processes (2 x 4 prefork) on a Redis broker and the
Redis backend. Runnable alone: ``python -m benchmarks.traffic`` (prints a JSON line per row).

* W7: 300 x 10 ms with ``semaphore_rate="50/s"`` (limit 100, so only the rate binds): achieved
  starts/s (starts - 1 over the first to the last start) and the most starts in any window of
  one second, beside Celery's own ``rate_limit="25/s"`` on each of the two workers (a per-worker
  limit: the cluster gets up to 2 x 25/s, and nothing holds it to a cluster-wide figure); also
  with ``semaphore_burst=2`` (one interval of slack for the hand-off latency, at the price of
  up to 51 starts in a window of one second).
* W8: 200 x 50 ms with ``semaphore_cost`` 1, 2 or 4 (random, seeded), limit 8 units: unit
  utilization = sum of cost x body time / (limit x makespan, first send to last end), beside
  the ideal FIFO schedule of the same costs in the same order with the same body times and
  zero handoff (:func:`ideal_fifo`), and their ratio.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import sys
from typing import Any, Dict, List, Sequence, Tuple

from benchmarks.workload import broker_url, run_setup


def starts_per_window(starts: Sequence[float], window: float = 1.0) -> int:
    """The most of ``starts`` (seconds, sorted) in any half-open window of ``window``."""
    best, first = 0, 0
    for last, t in enumerate(starts):
        while t - starts[first] >= window:
            first += 1
        best = max(best, last - first + 1)
    return best


def rate(broker: str, backend: str, tasks: int = 300, hold: float = 0.01
         ) -> List[Dict[str, Any]]:
    """W7: the gate's cluster-wide rate beside Celery's per-worker ``rate_limit``."""
    rows = []
    for label, task, asked in (("semaphore_rate=50/s", "paced", 50.0),
                               ("semaphore_rate=50/s, semaphore_burst=2", "paced_burst", 50.0),
                               ("celery rate_limit=25/s per worker", "celery_paced", 50.0)):
        probe, received, sent_at = run_setup(
            "gate", broker, backend, 100, [[(task, (f"t{i}", hold)) for i in range(tasks)]])
        starts = sorted(run[0] / 1e9 for runs in probe.intervals().values() for run in runs)
        achieved = (len(starts) - 1) / (starts[-1] - starts[0])
        row = {"workload": "W7", "setup": label, "tasks": f"{tasks} x {int(hold * 1000)} ms",
               "starts_per_s": round(achieved, 2),
               "vs_asked": round(achieved / asked, 3),
               "max_starts_in_1s": starts_per_window(starts),
               "makespan_s": round((max(run[1] for runs in probe.intervals().values()
                                        for run in runs) - sent_at[0]) / 1e9, 3),
               "deliveries_per_task": round(received / tasks, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def ideal_fifo(jobs: Sequence[Tuple[int, float]], limit: int) -> float:
    """Makespan of strict FIFO over ``jobs`` ((cost, seconds), in order) on ``limit`` units
    with zero handoff: each job starts as soon as its units are free and every job before it
    has started (a job that does not fit blocks those behind it, as the semaphore's rule)."""
    now, free = 0.0, limit
    running: List[Tuple[float, int]] = []  # (end, cost)
    end = 0.0
    for cost, seconds in jobs:
        while free < cost:
            finished, units = heapq.heappop(running)
            now, free = max(now, finished), free + units
        heapq.heappush(running, (now + seconds, cost))
        free -= cost
        end = max(end, now + seconds)
    return end


def weighted(broker: str, backend: str, tasks: int = 200, hold: float = 0.05,
             limit: int = 8, seed: int = 8) -> List[Dict[str, Any]]:
    """W8: unit utilization of costs 1, 2 or 4 on a limit of 8, beside ideal FIFO; and, as a
    control for the per-task overhead of the machine at the time, the same tasks all of
    cost 1 (every pool process busy: what W4 measures)."""
    rng = random.Random(seed)
    mixed = [rng.choice((1, 2, 4)) for _ in range(tasks)]
    rows = []
    for label, costs in (("semaphore_cost 1/2/4, limit 8", mixed),
                         ("control: every cost 1, limit 8", [1] * tasks)):
        probe, received, sent_at = run_setup(
            "gate", broker, backend, limit,
            [[("weighted", (cost, f"w{i}:{cost}", hold)) for i, cost in enumerate(costs)]])
        spans = {key: runs[0] for key, runs in probe.intervals().items()}
        unit_seconds = sum(int(key.rsplit(":", 1)[1]) * (e - s) / 1e9
                           for key, (s, e) in spans.items())
        makespan = (max(e for _, e in spans.values()) - sent_at[0]) / 1e9
        utilization = unit_seconds / (limit * makespan)
        durations = [(spans[f"w{i}:{c}"][1] - spans[f"w{i}:{c}"][0]) / 1e9
                     for i, c in enumerate(costs)]
        ideal = unit_seconds / (limit * ideal_fifo(list(zip(costs, durations)), limit))
        points = sorted(p for key, (s, e) in spans.items() for p in
                        ((s, int(key.rsplit(":", 1)[1])), (e, -int(key.rsplit(":", 1)[1]))))
        units = peak = 0
        for _, delta in points:
            units += delta
            peak = max(peak, units)
        row = {"workload": "W8", "setup": label, "tasks": f"{tasks} x {int(hold * 1000)} ms",
               "unit_utilization": round(utilization, 4),
               "ideal_fifo_utilization": round(ideal, 4),
               "vs_ideal": round(utilization / ideal, 3), "makespan_s": round(makespan, 3),
               "max_units": peak, "deliveries_per_task": round(received / tasks, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run(redis_url: str) -> List[Dict[str, Any]]:
    broker = broker_url(redis_url)
    return rate(broker, redis_url) + weighted(broker, redis_url)


def main() -> int:
    from tests.servers import redis_url, sweep_redis

    url = os.environ.get("REDIS_URL") or redis_url()
    try:
        run(url)
    finally:  # this run's own keys and queues only
        sweep_redis(url)
        sweep_redis(broker_url(url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
