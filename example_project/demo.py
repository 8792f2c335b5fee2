"""``make demo``: run the example with no server at all and watch the semaphores work.

Starts 2 ``celery worker`` processes with 4 pool processes each (8 tasks could run at once,
twice the "uploads" limit of 4) on kombu's filesystem transport and the SQLite semaphore
backend. Sends 24 thumbnails, each of which sends its upload (limit 4 across both workers),
18 calls to a partner API for 3 customers (limit 2 per customer, 1 for customer 3), and 20
orders to a partner's HTTP API (partner_api.py, on 127.0.0.1) that serves 2 calls at once and
answers 429 with ``Retry-After: 1`` beyond: the "partner" semaphore's adaptive limit learns
that capacity and each 429 pauses it on both workers. While they run it shows, per semaphore,
which worker holds each slot and how many tasks run, wait and are done; at the end it writes
``var/timeline.png`` and a summary.

``EXAMPLE_VAR_DIR`` moves var/ (broker files, the SQLite file, worker logs, the timeline, the
partner API's log ``partner_api.log`` and the "partner" semaphore's sampled status
``partner_status.log``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS, CONCURRENCY = 2, 4
IMAGES, CUSTOMERS, CALLS, ORDERS = 24, (1, 2, 3), 6, 20  # CALLS per customer
NAMES = ["uploads"] + [f"api:{c}" for c in CUSTOMERS] + ["partner"]
TOTAL = {"uploads": IMAGES, **{f"api:{c}": CALLS for c in CUSTOMERS}, "partner": ORDERS}
#: The partner's order API (partner_api.py): 2 calls at once, 0.25 s each, 429 beyond.
PARTNER = {"capacity": 2, "service_time": 0.25, "retry_after": 1}
SAMPLE_EVERY = 0.01  # seconds between two samples of the "partner" semaphore's status
#: Seconds from a 429 to its pause in force on the backend (the pool child raises Backoff, its
#: worker stores the pause) that the report allows: 7 to 25 ms on a quiet 2-core machine, more
#: when the test suite shares it. A call admitted in that moment may still reach the API.
PAUSE_LATENCY = 0.25
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
    """{semaphore: [(start, end, slot, worker, token, state, task id)]} of the guarded runs
    that ended.

    A task runs more than once when a Backoff gave it back (its first run ends IGNORED): each
    end is paired with the start before it of the same task."""
    started: Dict[str, dict] = {}
    found = defaultdict(list)
    for e in events:
        if e["kind"] == "start":
            started[e["id"]] = e
        elif e["semaphore"] and e["id"] in started:
            s = started.pop(e["id"])
            found[e["semaphore"]].append(
                (s["t"], e["t"], s["slot"], worker_no(s["worker"]), s["token"], e["state"],
                 e["id"]))
    return found


def finished(events: list) -> int:
    """Tasks that ended for good (a run a Backoff gave back ends IGNORED, and runs again)."""
    return sum(e["kind"] == "end" and e["state"] != "IGNORED" for e in events)


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
        (tasks.call_customer_api, (customer, "invoices")) for customer in CUSTOMERS] + [
        (tasks.sync_order, (0,))]
    # The registered task, as the gate gets it: the module's name for it is a proxy, on
    # which the gate would not find the task's own limit. An adaptive limit starts at its min.
    return {guard.name: guard.adaptive.min if guard.adaptive else guard.limit for guard in
            (guards.resolve_call(app.tasks[task.name], args, {}, {}) for task, args in calls)}


# -- the live display ------------------------------------------------------------------------

class Display:
    """Per semaphore: the worker holding each slot, running/limit, waiting, done; for an
    adaptive limit the value learned, and a pause in force with its reason."""

    def __init__(self, backend, declared: dict, tty: bool) -> None:
        self.backend, self.declared, self.tty, self.lines = backend, declared, tty, 0

    def show(self, events: list, elapsed: float) -> None:
        started, ended, done = defaultdict(int), defaultdict(int), defaultdict(int)
        for e in events:
            key = e["semaphore"] or e["task"]
            if e["kind"] == "start":
                started[key] += 1
            else:
                ended[key] += 1
                done[key] += e["state"] != "IGNORED"  # IGNORED: a Backoff gave it back
        sent = {**TOTAL, "uploads": done["make_thumbnail"]}
        lines = [f"  {elapsed:4.1f}s  thumbnails (no semaphore) done "
                 f"{done['make_thumbnail']}/{IMAGES}",
                 f"  {'semaphore':<9}  {'slots':<9}  {'running':>7}  {'waiting':>7}  {'done':>6}"]
        for name in NAMES:
            status = self.backend.status(name)  # None until a task first asks for a slot
            limit = status.limit if status else self.declared[name]
            owners = {h.slot: worker_no(h.meta.get("worker")) for h in
                      (status.holders if status else ())}
            width = max([limit, *(s + 1 for s in owners)])
            slots = "[" + " ".join(owners.get(s, ".") for s in range(width)) + "]"
            held = f"{len(owners)}/{limit}"
            waiting = max(0, sent[name] - done[name] - (started[name] - ended[name]))
            count = f"{done[name]}/{TOTAL[name]}"
            line = f"  {name:<9}  {slots:<9}  {held:>7}  {waiting:>7}  {count:>6}"
            if status and status.adaptive:
                line += f"  learned {status.adaptive.current:.2f}"
            left = (status.paused_until - time.time()) if status and status.paused_until else 0
            if left > 0:
                line += f"  PAUSED {left:.1f}s: {status.pause_reason}"
            lines.append(line)
        if self.tty and self.lines:
            sys.stdout.write(f"\x1b[{self.lines}F")  # back up and draw over the last frame
        end = "\x1b[K\n" if self.tty else "\n"
        sys.stdout.write("".join(line + end for line in lines))
        sys.stdout.flush()
        self.lines = len(lines)


# -- the partner API scenario ----------------------------------------------------------------

def sample(status: Any, now: float) -> Optional[dict]:
    """What the picture shows of the "partner" semaphore at ``now`` (None: no state yet)."""
    if status is None:
        return None
    return {"t": now, "limit": status.limit, "held": status.held, "waiting": status.waiting,
            "current": status.adaptive.current if status.adaptive else None,
            "paused_until": status.paused_until, "reason": status.pause_reason}


class Sampler(threading.Thread):
    """Samples the "partner" semaphore's status every SAMPLE_EVERY seconds, until
    :meth:`stop`: ``samples`` (:func:`sample`, timed when the status came back)."""

    def __init__(self, backend: Any) -> None:
        super().__init__(name="sampler", daemon=True)
        self.backend, self.samples, self.stopped = backend, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_EVERY):
            status = self.backend.status("partner")
            found = sample(status, time.time())
            if found:
                self.samples.append(found)

    def stop(self) -> List[dict]:
        """Stop sampling; return the samples."""
        self.stopped.set()
        if self.is_alive():
            self.join()
        return self.samples


def pauses(samples: list) -> list:
    """[(start, end, reason)]: each pause the samples saw in force, from the first sample that
    saw it to its end (``paused_until``, the backend's clock: this host's); a pause extended
    while in force is one pause."""
    found: List[list] = []
    for s in samples:
        until = s["paused_until"]
        if until is None or s["t"] >= until:
            continue
        if found and s["t"] < found[-1][1]:
            found[-1][1] = max(found[-1][1], until)
        else:
            found.append([s["t"], until, s["reason"]])
    return [tuple(p) for p in found]


def calls_during_retry_after(api_log: list) -> list:
    """[(answer, call)]: each call that reached the API while a Retry-After it had given was
    running: after the 429 was sent, before its Retry-After had passed counted from when the
    429's call arrived."""
    return [(no, call) for no in api_log if no["status"] == 429 for call in api_log
            if no["end"] < call["t"] < no["t"] + no["retry_after"]]


def granted_at(token: str) -> float:
    """When the lease of fencing token ``token`` (``slot:epoch``) was granted, on the backend's
    clock (SQLite's: this host's ``time.time()``): a grant's epoch is its time in
    microseconds, unless the slot's previous epoch was as late
    (``celery_semaphore.backends.model.next_epoch``)."""
    return int(token.split(":")[1]) / 1e6


def paused_for(no: dict, samples: list) -> bool:
    """The 429 ``no`` paused "partner" for its Retry-After: every sample taken from
    PAUSE_LATENCY after it was sent until its Retry-After was over (one at least) shows a pause
    for "HTTP 429" lasting at least that long."""
    over = no["t"] + no["retry_after"]
    during = [s for s in samples if no["end"] + PAUSE_LATENCY <= s["t"] < over]
    return bool(during) and all((s["paused_until"] or 0) >= over and s["reason"] == "HTTP 429"
                                for s in during)


def limit_changes(samples: list) -> list:
    """The limit in force, each time it changed: [1, 2, 3, 4, 2, ...]."""
    found: List[int] = []
    for s in samples:
        if not found or s["limit"] != found[-1]:
            found.append(s["limit"])
    return found


def draw_partner(panel: Any, api_log: list, samples: list, t0: float) -> None:
    """The "partner" panel: calls in progress at the API, its capacity, its 429 answers, the
    adaptive limit in force and its learned value, each pause shaded with its reason."""
    served = [e for e in api_log if e["status"] == 200]
    at_api = steps([e["t"] for e in served], [e["end"] for e in served])
    xs = [0.0] + [t - t0 for t, _ in at_api]
    ys = [0] + [n for _, n in at_api]
    panel.step(xs, ys, where="post", lw=1.8, color="#4c72b0",
               label="calls in progress at the API (answered 200)")
    panel.fill_between(xs, ys, step="post", alpha=0.2, color="#4c72b0")
    capacity = PARTNER["capacity"]
    panel.axhline(capacity, color="#777777", ls="--", lw=1,
                  label=f"the API's capacity ({capacity} at once, not told to clients)")
    if samples:
        xs = [s["t"] - t0 for s in samples]
        panel.step(xs, [s["limit"] for s in samples], where="post", lw=2, color="#c44e52",
                   label="adaptive limit in force")
        panel.plot(xs, [s["current"] for s in samples], lw=0.9, ls=":", color="#c44e52",
                   label="learned value (the limit in force is its floor)")
    refused = [e for e in api_log if e["status"] == 429]
    if refused:
        panel.plot([e["t"] - t0 for e in refused], [e["in_progress"] + 1 for e in refused],
                   "x", ms=9, mew=2.2, color="#8c1c13",
                   label=f"429 Too Many Requests (Retry-After: {PARTNER['retry_after']})")
    top = max([capacity + 2] + [n + 1 for _, n in at_api]
              + [s["limit"] + 1 for s in samples])
    labelled = set()
    for start, end, reason in pauses(samples):
        panel.axvspan(start - t0, end - t0, color="#c44e52", alpha=0.15, lw=0,
                      label=None if reason in labelled else f"paused on every worker: {reason}")
        labelled.add(reason)
        panel.text((start + end) / 2 - t0, top - 0.35, f"paused: {reason}", ha="center",
                   va="top", fontsize=8, color="#8c1c13")
    panel.set_ylim(0, top + 2.2)  # the legend goes above the data
    panel.set_ylabel("calls")
    panel.set_title("partner: the limit is learned from the API's answers; each 429 pauses "
                    "the semaphore on every worker until its Retry-After is over",
                    loc="left", fontsize=10)


# -- the picture -----------------------------------------------------------------------------

def plot(events: list, found: dict, limits: dict, t0: float, path: str, api_log: list,
         samples: list) -> Dict[str, List[str]]:
    """Draw slot occupancy and, per semaphore, tasks running and waiting (for "partner": the
    calls at the API, its 429s, the adaptive limit and the pauses); return each panel's
    semaphore and the labels of its legend, in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # A learned limit moves: a semaphore gets a lane for every slot that was used.
    lanes = [(name, slot) for name in NAMES
             for slot in range(max([limits[name], *(span[2] + 1 for span in found[name])]))]
    fig, axes = plt.subplots(
        1 + len(NAMES), 1, figsize=(11, 6.5 + 2.2 * len(NAMES)), sharex=True,
        gridspec_kw={"height_ratios": [len(lanes)] + [2.5 if name != "partner" else 4
                                                       for name in NAMES]})
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
    drawn = {}
    for panel, name in zip(panels, NAMES):
        if name == "partner":
            draw_partner(panel, api_log, samples, t0)
        else:
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
        panel.legend(loc="upper right", fontsize=8, **({"ncol": 2} if name == "partner" else {}))
        drawn[name] = panel.get_legend_handles_labels()[1]
        panel.grid(alpha=0.3)
    panels[-1].set_xlabel("seconds since the first task was sent")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def report_partner(events: list, found: dict, api_log: list, samples: list) -> bool:
    """Print what happened to the orders. True when every order was answered 200 exactly once
    and ran without a Celery retry (a run ends IGNORED only on a 429, or given back before
    its body because a pause closed "partner" after its grant), each 429 was followed within
    PAUSE_LATENCY by a pause of "partner" lasting at least its Retry-After, no call was
    admitted while a pause was seen in force, and each call that reached the API during a
    Retry-After had been admitted before the 429 or within PAUSE_LATENCY of it."""
    ended = [e for e in events if e["task"] == "sync_order" and e["kind"] == "end"]
    unstarted = [e for e in ended if e.get("unstarted")]  # given back before the body ran
    succeeded = {e["id"] for e in ended if e["state"] == "SUCCESS"}
    served = [e["id"] for e in api_log if e["status"] == 200]
    refused = [e for e in api_log if e["status"] == 429]
    retries = sum(e["retries"] for e in events if e["task"] == "sync_order")
    seen = pauses(samples)
    covered = all(paused_for(no, samples) for no in refused)
    grants = {(span[6], span[0]): granted_at(span[4]) for span in found["partner"]}
    while_paused = [g for g in grants.values() for start, end, _ in seen if start <= g < end]

    def granted(call: dict) -> float:  # the grant of the run that made this call
        return max(g for (task, start), g in grants.items()
                   if task == call["id"] and start <= call["t"])

    early = calls_during_retry_after(api_log)
    before = [call for no, call in early if granted(call) <= no["end"] + PAUSE_LATENCY]
    changes = " -> ".join(map(str, limit_changes(samples)))
    print(f"\npartner: {ORDERS} orders sent, {len(succeeded)} answered 200 in the end; Celery "
          f"retries used: {retries}\n"
          f"         429s from the API: {len(refused)} (Retry-After: {PARTNER['retry_after']}); "
          f"pauses of \"partner\" seen: {len(seen)} "
          f"({', '.join(f'{e - s:.1f}s, {why}' for s, e, why in seen) or 'none'})\n"
          f"         every 429 paused \"partner\" within {PAUSE_LATENCY}s until its Retry-After "
          f"was over: {'yes' if covered else 'NO'}\n"
          f"         calls admitted while paused: {len(while_paused)}; granted before a pause "
          f"and given back\n         before they started (they ran later): {len(unstarted)}\n"
          f"         calls that reached the API during a Retry-After it had given: {len(early)}, "
          f"admitted before\n         the 429 or within {PAUSE_LATENCY}s of it: {len(before)} "
          "(a pause stops new starts, not calls already admitted)\n"
          f"         the limit in force went {changes} (the API's capacity: "
          f"{PARTNER['capacity']})")
    return (len(succeeded) == ORDERS == len(ended) - len(refused) - len(unstarted)
            and all(e["state"] == "IGNORED" for e in unstarted)
            and sorted(served) == sorted(succeeded) and retries == 0
            and covered and not while_paused
            and len(before) == len(early))


# -- main --------------------------------------------------------------------------------------

def clean(var: str) -> None:
    """Remove what an earlier run left (only what the demo writes: var may be any folder)."""
    for entry in ("broker", "processed", "control", "store"):
        shutil.rmtree(os.path.join(var, entry), ignore_errors=True)
    for entry in os.listdir(var):
        if entry.startswith(("semaphores.db", "timeline.", "worker", "partner_")):
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
    from example_project.partner_api import PartnerAPI, read_log

    # The partner's API first: the workers' tasks.py reads its URL at import.
    api_path = os.path.join(var, "partner_api.log")
    api = PartnerAPI(api_path, **PARTNER).start()
    os.environ["EXAMPLE_PARTNER_URL"] = env["EXAMPLE_PARTNER_URL"] = api.url

    from example_project import tasks, timeline
    from example_project.app import app
    from example_project.store import StaleToken

    backend = get_backend(app.conf.semaphore_backend)
    display = Display(backend, declared_limits(app, tasks), sys.stdout.isatty())
    print(f"celery-semaphore demo: {WORKERS} workers x {CONCURRENCY} pool processes, "
          f"filesystem broker, SQLite semaphores; files in {var}")
    print("slots: the worker holding each slot ([1 2 . .]: demo1 holds slot 0, demo2 slot 1,\n"
          "       '.' a free slot); running: tasks holding a slot / the limit; waiting: tasks\n"
          "       sent that have not started; done: finished / to run\n"
          f"partner: the limit is learned (shown: the limit in force, and the value learned);\n"
          f"       its API ({api.url}) serves {PARTNER['capacity']} calls at once and answers "
          f"429 beyond,\n       which pauses the semaphore on both workers (PAUSED: time "
          "left and reason)")
    workers = [start_worker(n, var, env) for n in range(1, WORKERS + 1)]
    sampler = Sampler(backend)
    try:
        wait_ready(workers, var)
        sampler.start()
        t0 = time.time()
        for image_id in range(IMAGES):
            tasks.make_thumbnail.delay(image_id)
        for page in range(1, CALLS + 1):
            for customer in CUSTOMERS:
                tasks.call_customer_api.delay(customer, "invoices", page=page)
        for order_id in range(ORDERS):
            tasks.sync_order.delay(order_id)
        expected = IMAGES + sum(TOTAL.values())  # thumbnails, uploads, API calls, orders
        next_frame = 0.0
        while True:
            now = time.time()
            events = timeline.read()
            done = finished(events) >= expected
            if done or now >= next_frame:
                display.show(events, now - t0)
                next_frame = now + (0.2 if display.tty else 1.0)
            if done:
                break
            dead = [n for n, w in enumerate(workers, 1) if w.poll() is not None]
            if dead or now - t0 > DEADLINE:
                why = (f"worker demo{dead[0]} exited" if dead
                       else f"the tasks did not finish in {DEADLINE:.0f}s")
                print(f"{why}; see the worker logs in {var}")
                return 1
            time.sleep(0.05)
        shut_down(workers)  # they take a few seconds: draw and report meanwhile
        samples = sampler.stop()
        api.stop()
        with open(os.path.join(var, "partner_status.log"), "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)

        found = runs(events)
        limits = {name: backend.status(name).limit for name in NAMES}
        makespan = max(e["t"] for e in events) - t0
        png = os.path.join(var, "timeline.png")
        api_log = read_log(api_path)
        panels = plot(events, found, limits, t0, png, api_log, samples)

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
              f"each semaphore: {', '.join(n for n in panels if n != 'partner')}\n"
              f"          and for partner: {'; '.join(panels['partner'])}")

        ok = "rejected" in fencing and report_partner(events, found, api_log, samples)
        parts = []
        for name in NAMES[:-1]:  # partner's limit moves: report_partner tells about it
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
        sampler.stop()
        stop_workers(workers)
        api.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
