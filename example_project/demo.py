"""``make demo``: run the example with no server at all and watch the semaphores work.

Starts 2 ``celery worker`` processes with 4 pool processes each (8 tasks could run at once,
twice the "uploads" limit of 4) on kombu's filesystem transport and the SQLite semaphore
backend. Sends 24 thumbnails, each of which sends its upload (limit 4 across both workers), and
18 calls to a partner API for 3 customers (limit 2 per customer, 1 for customer 3). While they
run it shows, per semaphore, which worker holds each slot and how many tasks run, wait and are
done; at the end it writes ``var/timeline.png`` and a one-line summary.

``EXAMPLE_VAR_DIR`` moves var/ (broker files, the SQLite file, worker logs, the timeline).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS, CONCURRENCY = 2, 4
IMAGES, CUSTOMERS, CALLS = 24, (1, 2, 3), 6  # CALLS per customer
NAMES = ["uploads"] + [f"api:{c}" for c in CUSTOMERS]
TOTAL = {"uploads": IMAGES, **{name: CALLS for name in NAMES[1:]}}
DEADLINE = 90.0  # seconds for the tasks to finish
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#8172b3"]  # one per worker


# -- workers ---------------------------------------------------------------------------------

def start_worker(n: int, var: str, env: dict) -> subprocess.Popen:
    log = open(os.path.join(var, f"worker{n}.log"), "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
         "-n", f"demo{n}@%h", "-c", str(CONCURRENCY), "-l", "info",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C reaches the demo only; it stops the workers itself
    )


def wait_ready(workers: list, var: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for n, worker in enumerate(workers, 1):
        path = os.path.join(var, f"worker{n}.log")
        while True:
            with open(path, errors="replace") as f:
                if " ready." in f.read():
                    break
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker demo{n} did not start; see {path}")
            time.sleep(0.05)


def shut_down(workers: list) -> None:
    """Start a warm shutdown: each worker finishes its running tasks, then exits.

    Idempotent: another SIGTERM only asks a worker again for the same warm shutdown.
    """
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)


def stop_workers(workers: list, timeout: float = 20.0) -> None:
    """Warm shutdown, then kill whatever is left after ``timeout`` seconds."""
    shut_down(workers)
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"worker pid {worker.pid} still runs {timeout:.0f}s after SIGTERM: killing it")
            os.killpg(worker.pid, signal.SIGKILL)  # the worker and its pool processes
            worker.wait()


# -- what happened -----------------------------------------------------------------------------

def worker_no(hostname: str) -> str:
    """``demo2@host`` -> ``2``."""
    return hostname.split("@")[0].replace("demo", "") if hostname else "?"


def runs(events: list) -> dict:
    """{semaphore: [(start, end, slot, worker, token)]} of the guarded tasks that ended."""
    starts = {e["id"]: e for e in events if e["kind"] == "start"}
    found = defaultdict(list)
    for e in events:
        if e["kind"] == "end" and e["semaphore"] and e["id"] in starts:
            s = starts[e["id"]]
            found[e["semaphore"]].append(
                (s["t"], e["t"], s["slot"], worker_no(s["worker"]), s["token"]))
    return found


def steps(ups: list, downs: list) -> list:
    """[(time, count)]: +1 at each time in ``ups``, -1 at each in ``downs`` (downs first)."""
    edges = sorted([(t, -1) for t in downs] + [(t, 1) for t in ups])
    found, count = [], 0
    for t, delta in edges:
        count += delta
        found.append((t, count))
    return found


def running(spans: list) -> list:
    return steps([s for s, *_ in spans], [e for _, e, *_ in spans])


def declared_limits(app, tasks) -> dict:
    """The limit each semaphore of the demo is declared with, as the gate resolves it
    (``semaphore_limits`` first, then the task's ``limit``): shown until a task first asks."""
    from celery_semaphore.guards import Guards
    from celery_semaphore.settings import Settings

    guards = Guards(Settings.from_app(app))
    calls = [(tasks.upload_thumbnail, (0, b""))] + [
        (tasks.call_customer_api, (customer, "invoices")) for customer in CUSTOMERS]
    # The registered task, as the gate gets it: the module's name for it is a proxy, on
    # which the gate would not find the task's own limit.
    return {guard.name: guard.limit for guard in
            (guards.resolve_call(app.tasks[task.name], args, {}, {}) for task, args in calls)}


# -- the live display ------------------------------------------------------------------------

class Display:
    """Per semaphore: the worker holding each slot, running/limit, waiting, done."""

    def __init__(self, backend, declared: dict, tty: bool) -> None:
        self.backend, self.declared, self.tty, self.lines = backend, declared, tty, 0

    def show(self, events: list, elapsed: float) -> None:
        started, ended = defaultdict(int), defaultdict(int)
        for e in events:
            (started if e["kind"] == "start" else ended)[e["semaphore"] or e["task"]] += 1
        sent = {"uploads": ended["make_thumbnail"], **{name: CALLS for name in NAMES[1:]}}
        lines = [f"  {elapsed:4.1f}s  thumbnails (no semaphore) done "
                 f"{ended['make_thumbnail']}/{IMAGES}",
                 f"  {'semaphore':<9}  {'slots':<9}  {'running':>7}  {'waiting':>7}  {'done':>6}"]
        for name in NAMES:
            status = self.backend.status(name)  # None until a task first asks for a slot
            limit = status.limit if status else self.declared[name]
            owners = {h.slot: worker_no(h.meta.get("worker")) for h in
                      (status.holders if status else ())}
            width = max([limit, *(s + 1 for s in owners)])
            slots = "[" + " ".join(owners.get(s, ".") for s in range(width)) + "]"
            held = f"{len(owners)}/{limit}"
            waiting = max(0, sent[name] - started[name])
            done = f"{ended[name]}/{TOTAL[name]}"
            lines.append(f"  {name:<9}  {slots:<9}  {held:>7}  {waiting:>7}  {done:>6}")
        if self.tty and self.lines:
            sys.stdout.write(f"\x1b[{self.lines}F")  # back up and draw over the last frame
        end = "\x1b[K\n" if self.tty else "\n"
        sys.stdout.write("".join(line + end for line in lines))
        sys.stdout.flush()
        self.lines = len(lines)


# -- the picture -----------------------------------------------------------------------------

def plot(events: list, found: dict, limits: dict, t0: float, path: str) -> list:
    """Draw slot occupancy and, per semaphore, tasks running and waiting; return the names of
    the semaphores that got a running/waiting panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = [(name, slot) for name in NAMES for slot in range(limits[name])]
    fig, axes = plt.subplots(
        1 + len(NAMES), 1, figsize=(11, 5 + 2.2 * len(NAMES)), sharex=True,
        gridspec_kw={"height_ratios": [len(lanes)] + [2.5] * len(NAMES)})
    top, panels = axes[0], axes[1:]

    workers = sorted({span[3] for spans in found.values() for span in spans})
    color = {w: COLORS[i % len(COLORS)] for i, w in enumerate(workers)}
    for y, (name, slot) in enumerate(lanes):
        mine = [span for span in found[name] if span[2] == slot]
        top.broken_barh([(s - t0, e - s) for s, e, *_ in mine], (y - 0.4, 0.8),
                        facecolors=[color[span[3]] for span in mine], edgecolor="white", lw=1)
        if slot == 0 and y:
            top.axhline(y - 0.5, color="black", lw=0.8)
    top.set_yticks(range(len(lanes)), [f"{name}  slot {slot}" for name, slot in lanes])
    top.set_ylim(len(lanes) - 0.5, -0.5)
    top.set_title("Slot occupancy: one bar per task, from start to end", loc="left",
                  fontsize=11)
    top.legend(handles=[Patch(color=color[w], label=f"worker demo{w}") for w in workers],
               loc="lower right", bbox_to_anchor=(1, 1), ncol=len(workers), frameon=False,
               fontsize=9)
    top.grid(axis="x", alpha=0.3)

    thumbnails = {"start": [], "end": []}
    for e in events:
        if e["task"] == "make_thumbnail":
            thumbnails[e["kind"]].append(e["t"])
    drawn = []
    for panel, name in zip(panels, NAMES):
        spans = found[name]
        # Sent: an upload when its thumbnail ends (it sends it); an API call at the start.
        sent = thumbnails["end"] if name == "uploads" else [t0] * TOTAL[name]
        waiting = steps(sent, [s for s, *_ in spans])
        series = [(running(spans), "running (holding a slot)", "-", "#4c72b0"),
                  (waiting, "waiting (sent, not started)", ":", "#dd8452")]
        if name == "uploads":
            series.append((steps(thumbnails["start"], thumbnails["end"]),
                           "thumbnails running (no semaphore)", "-", "#aaaaaa"))
        for points, label, style, shade in series:
            xs = [0.0] + [t - t0 for t, _ in points]
            ys = [0] + [n for _, n in points]
            panel.step(xs, ys, where="post", ls=style, lw=1.8, color=shade, label=label)
            if label.startswith("running"):
                panel.fill_between(xs, ys, step="post", alpha=0.2, color=shade)
        limit = limits[name]
        panel.axhline(limit, color="#c44e52", ls="--", lw=1, label=f"limit ({limit})")
        panel.set_ylim(0, max(n for _, n in waiting + [(0, limit)]) + 1)
        panel.set_ylabel("tasks")
        panel.set_title(f"{name}: never more than {limit} at once, however many wait",
                        loc="left", fontsize=10)
        drawn.append(name)
        panel.legend(loc="upper right", fontsize=8)
        panel.grid(alpha=0.3)
    panels[-1].set_xlabel("seconds since the first task was sent")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


# -- main --------------------------------------------------------------------------------------

def clean(var: str) -> None:
    """Remove what an earlier run left (only what the demo writes: var may be any folder)."""
    for entry in ("broker", "processed", "control", "store"):
        shutil.rmtree(os.path.join(var, entry), ignore_errors=True)
    for entry in os.listdir(var):
        if entry.startswith(("semaphores.db", "timeline.", "worker")):
            os.remove(os.path.join(var, entry))


def main() -> int:
    var = os.path.abspath(os.environ.get("EXAMPLE_VAR_DIR")
                          or os.path.join(ROOT, "example_project", "var"))
    os.makedirs(var, exist_ok=True)
    clean(var)
    os.environ["EXAMPLE_VAR_DIR"] = var  # set before the app is imported: it reads them
    os.environ.pop("EXAMPLE_BROKER_URL", None)  # the demo needs no server
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops workers

    from celery_semaphore import FencingToken
    from celery_semaphore.backends import get_backend
    from example_project import tasks, timeline
    from example_project.app import app
    from example_project.store import StaleToken

    backend = get_backend(app.conf.semaphore_backend)
    display = Display(backend, declared_limits(app, tasks), sys.stdout.isatty())
    print(f"celery-semaphore demo: {WORKERS} workers x {CONCURRENCY} pool processes, "
          f"filesystem broker, SQLite semaphores; files in {var}")
    print("slots: the worker holding each slot ([1 2 . .]: demo1 holds slot 0, demo2 slot 1,\n"
          "       '.' a free slot); running: tasks holding a slot / the limit; waiting: tasks\n"
          "       sent that have not started; done: finished / to run")
    workers = [start_worker(n, var, env) for n in range(1, WORKERS + 1)]
    try:
        wait_ready(workers, var)
        t0 = time.time()
        for image_id in range(IMAGES):
            tasks.make_thumbnail.delay(image_id)
        for page in range(1, CALLS + 1):
            for customer in CUSTOMERS:
                tasks.call_customer_api.delay(customer, "invoices", page=page)
        expected = IMAGES + sum(TOTAL.values())  # thumbnails, uploads, API calls
        while True:
            events = timeline.read()
            display.show(events, time.time() - t0)
            if sum(e["kind"] == "end" for e in events) >= expected:
                break
            dead = [n for n, w in enumerate(workers, 1) if w.poll() is not None]
            if dead or time.time() - t0 > DEADLINE:
                why = (f"worker demo{dead[0]} exited" if dead
                       else f"the tasks did not finish in {DEADLINE:.0f}s")
                print(f"{why}; see the worker logs in {var}")
                return 1
            time.sleep(0.2 if display.tty else 1.0)
        shut_down(workers)  # they take a few seconds: draw and report meanwhile

        found = runs(events)
        limits = {name: backend.status(name).limit for name in NAMES}
        makespan = max(e["t"] for e in events) - t0
        png = os.path.join(var, "timeline.png")
        panels = plot(events, found, limits, t0, png)

        cli = subprocess.run([sys.executable, "-m", "celery", "-A", "example_project.app",
                              "semaphore", "list"], cwd=ROOT, env=env, capture_output=True,
                             text=True)
        print("\n$ celery -A example_project.app semaphore list\n" + cli.stdout.rstrip())

        # Fencing: the first upload on slot 0 comes back late, its lease long gone.
        old = min(span for span in found["uploads"] if span[2] == 0)[4]
        try:
            tasks.store.put("thumbs/0.raw", b"late", token=FencingToken(*map(int, old.split(":"))))
            fencing = f"the store ACCEPTED the stale token {old}"
        except StaleToken:
            fencing = f"the store rejected a late write with the stale token {old}"
        print("\nfencing: every lease carries a token (slot:epoch); the store refuses a write "
              "whose token\n         is older than one it has accepted for that slot, so a "
              "task that lost its lease\n         cannot overwrite newer work. Here "
              f"{fencing}.")
        print(f"timeline: {png}\n          slot occupancy, then running and waiting tasks for "
              f"each semaphore: {', '.join(panels)}")

        parts, ok = [], "rejected" in fencing
        for name in NAMES:
            spans = found[name]
            most = max(n for _, n in running(spans))
            window = max(e for _, e, *_ in spans) - min(s for s, *_ in spans)
            busy = sum(e - s for s, e, *_ in spans)
            parts.append(f"{name} max {most}/{limits[name]} "
                         f"util {busy / (limits[name] * window):.2f} over {window:.1f}s")
            ok = ok and most <= limits[name] and len(spans) == TOTAL[name]
        print("\nmax: most tasks that ran at once / the limit; util: the share of the "
              "semaphore's slots\nthat were busy from its first start to its last end "
              "(1.00: every slot, all the time)")
        print(f"summary: {', '.join(parts)}; makespan {makespan:.1f}s")
    finally:
        stop_workers(workers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
