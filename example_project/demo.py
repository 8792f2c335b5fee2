"""``make demo``: run the example with no server at all and show the semaphores at work.

Starts 2 ``celery worker`` processes (3 pool processes each) on kombu's filesystem transport and
the SQLite semaphore backend, enqueues 24 thumbnails (each then uploads under the "uploads"
semaphore, limit 4) and 18 calls to a customer API (limit 2 per customer), shows running and
waiting tasks per semaphore live, then writes a PNG timeline of slot occupancy and a summary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THUMBNAILS, CUSTOMERS, CALLS_PER_CUSTOMER = 24, (1, 2, 3), 6


def start_workers(env):
    workers = []
    for n in (1, 2):
        log = open(os.path.join(env["EXAMPLE_VAR_DIR"], f"worker{n}.log"), "wb")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project.app", "worker", "-P",
             "prefork", "-c", "3", "-n", f"demo{n}@%h", "-l", "info", "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return workers


def read_timeline(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def occupancy(events):
    """{semaphore: [(time, running)]} and the most running at once per semaphore."""
    steps, best, running = defaultdict(list), defaultdict(int), defaultdict(int)
    for e in sorted(events, key=lambda e: (e["t"], e["kind"] == "start")):
        running[e["semaphore"]] += 1 if e["kind"] == "start" else -1
        steps[e["semaphore"]].append((e["t"], running[e["semaphore"]]))
        best[e["semaphore"]] = max(best[e["semaphore"]], running[e["semaphore"]])
    return steps, best


def display(backend, names, events, tty):
    done = defaultdict(int)
    for e in events:
        if e["kind"] == "end":
            done[e["semaphore"]] += 1
    lines = []
    for name in names:
        status = backend.status(name)
        limit, held, waiting = ((status.limit, status.held, status.waiting) if status
                                else ("-", 0, 0))
        lines.append(f"  {name:<8} limit {limit}  running {'#' * held:<4} {held}  "
                     f"waiting {waiting:>2}  done {done[name]:>2}")
    if tty:
        sys.stdout.write(f"\x1b[{len(lines)}A" if display.drawn else "")
        display.drawn = True
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


display.drawn = False


def plot(events, limits, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, _ = occupancy(events)
    t0 = min(e["t"] for e in events)
    names = sorted(steps)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.6 * len(names) + 0.6), sharex=True)
    for ax, name in zip(axes, names):
        xs = [t - t0 for t, _ in steps[name]]
        ys = [n for _, n in steps[name]]
        ax.step(xs, ys, where="post", color="#4c72b0")
        ax.fill_between(xs, ys, step="post", alpha=0.3, color="#4c72b0")
        ax.axhline(limits[name], color="#c44e52", linestyle="--", linewidth=1)
        ax.set_ylim(0, max(limits.values()) + 1)
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        ax.text(1.0, limits[name], f" limit {limits[name]}", color="#c44e52", va="center",
                transform=ax.get_yaxis_transform())
    axes[-1].set_xlabel("seconds")
    axes[0].set_title("Tasks holding a slot, per semaphore")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    var = os.path.abspath(os.environ.get("EXAMPLE_VAR_DIR",
                                         os.path.join(ROOT, "example_project", "var")))
    shutil.rmtree(var, ignore_errors=True)
    os.makedirs(var)
    os.environ["EXAMPLE_VAR_DIR"] = var
    env = dict(os.environ, PYTHONPATH=ROOT)
    from celery_semaphore.backends import get_backend
    from example_project import tasks
    from example_project.app import app

    backend = get_backend(app.conf.semaphore_backend, key_prefix="semaphore:")
    names = ["uploads"] + [f"api:{c}" for c in CUSTOMERS]
    limits = {"uploads": 4, **{f"api:{c}": 2 for c in CUSTOMERS}}
    expected = THUMBNAILS + len(CUSTOMERS) * CALLS_PER_CUSTOMER

    print("celery-semaphore demo: 2 workers x 3 processes, filesystem broker, SQLite backend")
    workers = start_workers(env)
    try:
        for image_id in range(THUMBNAILS):
            tasks.make_thumbnail.delay(image_id)
        for n in range(CALLS_PER_CUSTOMER):
            for customer in CUSTOMERS:
                tasks.call_customer_api.delay(customer, n)
        deadline = time.monotonic() + 120
        tty = sys.stdout.isatty()
        while True:
            events = read_timeline(tasks.TIMELINE)
            display(backend, names, events, tty)
            if sum(e["kind"] == "end" for e in events) >= expected:
                break
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                print("the demo did not finish; see the worker logs in", var)
                return 1
            time.sleep(0.25 if tty else 1.0)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(15)
            except subprocess.TimeoutExpired:
                w.kill()

    events = read_timeline(tasks.TIMELINE)
    _, best = occupancy(events)
    png = os.path.join(var, "timeline.png")
    plot(events, limits, png)
    uploads = [e for e in events if e["semaphore"] == "uploads"]
    starts = {e["key"]: e["t"] for e in uploads if e["kind"] == "start"}
    busy = sum(e["t"] - starts[e["key"]] for e in uploads if e["kind"] == "end")
    makespan = max(e["t"] for e in events) - min(e["t"] for e in events)
    span = max(e["t"] for e in uploads) - min(e["t"] for e in uploads)
    concurrency = ", ".join(f"{n} max {best[n]}/{limits[n]}" for n in names)
    cli = subprocess.run([sys.executable, "-m", "celery", "-A", "example_project.app",
                          "semaphore", "list"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    print("$ celery -A example_project.app semaphore list\n" + cli.stdout.rstrip())
    print(f"summary: {concurrency}; uploads utilization "
          f"{busy / (limits['uploads'] * span):.2f}; makespan {makespan:.1f}s; timeline {png}")
    ok = all(best[n] <= limits[n] for n in names)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
