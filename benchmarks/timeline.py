"""Slot utilization over time from a workload run's probe log: where a run loses its time.

    python -m benchmarks.timeline /tmp/bench-gate-XXXX/probe.log --limit 4 [--window 0.5]

Each line is one window from the first body's start: the share of ``limit`` slots that ran a
body in it. On W2 with the gate, this shows the phase in which the workers receive and park
the backlog apart from the phase in which they only drain it.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import List, Tuple

from tests.probe import Probe


def timeline(probe: Probe, limit: int, window: float = 0.5) -> List[Tuple[float, float]]:
    """(window start in seconds, utilization) for each window of the run."""
    spans = [(start, end) for runs in probe.intervals().values()
             for start, end in runs if end is not None]
    if not spans:
        return []
    origin, width = min(start for start, _ in spans), int(window * 1e9)
    busy: Counter = Counter()
    for start, end in spans:
        at = start
        while at < end:
            index = (at - origin) // width
            upto = min(end, origin + (index + 1) * width)
            busy[index] += upto - at
            at = upto
    return [(index * window, round(busy[index] / (limit * width), 2))
            for index in range(max(busy) + 1)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline")
    parser.add_argument("probe_log")
    parser.add_argument("--limit", type=int, required=True)
    parser.add_argument("--window", type=float, default=0.5, help="seconds (default 0.5)")
    args = parser.parse_args(argv)
    for start, utilization in timeline(Probe(args.probe_log), args.limit, args.window):
        print(f"{start:7.1f}s  {utilization:.2f}")


if __name__ == "__main__":
    main()
