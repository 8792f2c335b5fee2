"""``make demo`` works with no server: it exits 0, keeps every limit, and draws its timeline;
the partner API's 429s pause the "partner" semaphore on both workers and its limit is learned.

The demo runs once for the module (2 real ``celery worker`` processes x 4 pool processes, as
``make demo`` runs them); the tests judge what it left in its var folder: the timeline the
tasks wrote, the log the partner API kept of its answers, and the "partner" semaphore's status
as the demo sampled it every 10 ms.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from example_project.demo import limit_changes
from tests.workers import ROOT

pytestmark = pytest.mark.slow

LIMITS = {"uploads": 4, "api:1": 2, "api:2": 2, "api:3": 1}  # api:3 from semaphore_limits
ORDERS, CAPACITY, RETRY_AFTER = 20, 2, 1  # the partner API's scenario (demo.py, PARTNER)
#: Seconds from a 429 to its pause in force that the tests allow (the demo's PAUSE_LATENCY):
#: a call admitted in that moment may still reach the API after the 429.
LATENCY = 0.25


def run_demo(var, timeout=150):
    env = dict(os.environ, EXAMPLE_VAR_DIR=str(var), PYTHONPATH=ROOT)
    env.pop("EXAMPLE_BROKER_URL", None)
    env.pop("EXAMPLE_PARTNER_URL", None)
    started = time.monotonic()
    demo = subprocess.Popen([sys.executable, "-m", "example_project.demo"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = demo.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGTERM)  # the demo then stops its workers
        output, _ = demo.communicate(timeout=30)
        pytest.fail(f"the demo ran over {timeout}s:\n{output[-3000:]}")
    return demo.returncode, output, time.monotonic() - started


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    var = tmp_path_factory.mktemp("demo") / "var"
    returncode, output, elapsed = run_demo(var)
    return SimpleNamespace(var=var, returncode=returncode, output=output, elapsed=elapsed)


@pytest.fixture(scope="module")
def partner(demo):
    """What the partner scenario left: the API's answers, the orders' timeline events, the
    sampled status of "partner" (judged here even when the demo's own report failed it)."""
    events = read_lines(demo.var / "timeline.log")
    return SimpleNamespace(
        api=read_lines(demo.var / "partner_api.log"),
        orders=[e for e in events if e["task"] == "sync_order"],
        samples=read_lines(demo.var / "partner_status.log"))


def test_demo_runs_without_servers(demo):
    var, output = demo.var, demo.output
    assert demo.returncode == 0, output[-3000:]
    assert demo.elapsed < 120, f"the demo took {demo.elapsed:.0f}s"

    summary = next(line for line in output.splitlines() if line.startswith("summary:"))
    found = {name: (int(most), int(limit))
             for name, most, limit in re.findall(r"(\S+) max (\d+)/(\d+)", summary)}
    assert set(found) == set(LIMITS), summary
    for name, (most, limit) in found.items():
        assert limit == LIMITS[name], summary
        assert 1 <= most <= limit, summary
    assert re.search(r"makespan \d+\.\d+s", summary), summary
    assert "the store rejected a late write with the stale token" in output

    # The first frame shows the declared limits (an adaptive limit, partner's, from its min, 1,
    # to its max, 8; the frame comes after every send, and a task may hold a slot by then).
    declared = {**LIMITS, "partner": (1, 8)}
    first = output.split("semaphore  slots")[1].splitlines()[1:1 + len(declared)]
    assert [line.split()[0] for line in first] == list(declared), first
    for line in first:
        name, running, limit = re.match(r"\s*(\S+)\s+\[[^\]]*\]\s+(\d+)/(\d+)",
                                        line).groups()
        low, high = declared[name] if name == "partner" else (declared[name],) * 2
        assert low <= int(limit) <= high and int(running) <= int(limit), first
    assert "/-" not in output
    # Every figure on screen is explained there.
    assert "running: tasks holding a slot / the limit" in output
    assert "fencing: every lease carries a token (slot:epoch)" in output
    assert "util: the share of the semaphore's slots" in output
    assert "partner: the limit is learned" in output
    # Every semaphore got its running/waiting panel in the picture.
    panels = next(line for line in output.splitlines() if "for each semaphore:" in line)
    assert panels.split("for each semaphore: ")[1].split(", ") == list(LIMITS), panels

    png = var / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    uploaded = [name for name in os.listdir(var / "store") if name.startswith("thumbs_")]
    assert len(uploaded) == 24

    # The demo stopped its workers: no process runs with its var folder any more.
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"EXAMPLE_VAR_DIR={var}".encode() in f.read():
                    leftovers.append(int(pid))
        except OSError:
            continue
    assert not leftovers, f"processes left running: {leftovers}"


def test_every_order_reaches_the_partner_api_once_answered_200_without_a_celery_retry(
        demo, partner):
    served = [e["id"] for e in partner.api if e["status"] == 200]
    assert len(served) == ORDERS and len(set(served)) == ORDERS
    ends = [e for e in partner.orders if e["kind"] == "end"]
    assert sorted(e["id"] for e in ends if e["state"] == "SUCCESS") == sorted(served)
    refused = [e for e in partner.api if e["status"] == 429]
    assert refused, (
        "the API never answered 429: the scenario showed nothing (the limit in force reached "
        f"{max(s['limit'] for s in partner.samples)}, slots held at once "
        f"{max(s['held'] for s in partner.samples)}, calls at the API at once "
        f"{max(e['in_progress'] for e in partner.api) + 1})")
    assert all(e["retry_after"] == RETRY_AFTER and e["in_progress"] == CAPACITY
               for e in refused)
    # A 429's call was given back (its run ended IGNORED) and ran again, with no Celery retry;
    # so was a call granted before the pause that had not started its body yet (it called
    # nothing: no 429 of its own)
    assert [e["state"] for e in ends if e["state"] != "SUCCESS" and not e["unstarted"]] == [
        "IGNORED"] * len(refused)
    assert all(e["state"] == "IGNORED" for e in ends if e["unstarted"])
    for e in ends:
        if e["unstarted"]:  # no call of that run reached the API
            start = max(s["t"] for s in partner.orders
                        if s["kind"] == "start" and s["id"] == e["id"] and s["t"] <= e["t"])
            assert not [c for c in partner.api if c["id"] == e["id"] and start <= c["t"] <= e["t"]]
    assert {e["retries"] for e in partner.orders} == {0}
    for n in (1, 2):
        with open(demo.var / f"worker{n}.log", errors="replace") as f:
            assert " Retry in " not in f.read()


def test_each_429_pauses_the_semaphore_for_its_retry_after_and_nobody_starts_meanwhile(
        partner):
    refused = [e for e in partner.api if e["status"] == 429]
    assert refused
    for no in refused:
        over = no["t"] + no["retry_after"]
        # Every status sampled from LATENCY after the 429 until its Retry-After is over
        # shows "partner" paused, for that reason, until the Retry-After is over at least.
        during = [s for s in partner.samples if no["end"] + LATENCY <= s["t"] < over]
        assert during, "the demo sampled nothing during a Retry-After"
        for s in during:
            assert s["paused_until"] is not None and s["paused_until"] >= over, s
            assert s["reason"] == "HTTP 429", s

    # No call was admitted while a pause was seen in force. A lease's fencing epoch is the
    # time of its grant in microseconds (celery_semaphore.backends.model.next_epoch), on the
    # SQLite backend's clock: this host's.
    paused = [(s["t"], s["paused_until"]) for s in partner.samples
              if s["paused_until"] is not None and s["t"] < s["paused_until"]]
    grants = {}  # (task id, start of its run) -> when its slot was granted
    for e in partner.orders:
        if e["kind"] == "start":
            grants[e["id"], e["t"]] = int(e["token"].split(":")[1]) / 1e6
            assert e["t"] - 60 < grants[e["id"], e["t"]] <= e["t"]  # granted, then started
    for granted in grants.values():
        assert not any(seen <= granted < until for seen, until in paused), granted

    # The API's log: a call that reached it while a Retry-After it had given was running
    # had been admitted before the 429, or in the moment before the pause took hold.
    for no in refused:
        for call in partner.api:
            if no["end"] < call["t"] < no["t"] + no["retry_after"]:
                granted = max(g for (task, start), g in grants.items()
                              if task == call["id"] and start <= call["t"])
                assert granted <= no["end"] + LATENCY, (no, call)


def test_the_adaptive_limit_grows_from_successes_and_falls_on_a_429(partner):
    samples, first = partner.samples, min(e["t"] for e in partner.api if e["status"] == 429)
    assert samples[0]["limit"] == 1 and samples[0]["current"] == 1.0  # it starts at min
    before = [s for s in samples if s["t"] < first]
    # The first 429's pause: from its first sample to the end of the Retry-After.
    within = [s for s in samples if first < s["t"] < first + RETRY_AFTER and s["paused_until"]]
    assert before and within, "no sample before the first 429, or none of its pause"
    assert max(s["limit"] for s in before) > 1  # learned from the successes
    assert min(s["current"] for s in within) < max(s["current"] for s in before)
    assert min(s["limit"] for s in within) < max(s["limit"] for s in before)
    assert all(1 <= s["limit"] <= 8 for s in samples)  # Adaptive(min=1, max=8)


def test_the_picture_shows_the_limit_the_pauses_the_calls_and_the_429s(demo, partner):
    line = next(line for line in demo.output.splitlines() if "and for partner:" in line)
    labels = line.split("and for partner: ")[1].split("; ")
    assert labels == [
        "calls in progress at the API (answered 200)",
        f"the API's capacity ({CAPACITY} at once, not told to clients)",
        "adaptive limit in force",
        "learned value (the limit in force is its floor)",
        f"429 Too Many Requests (Retry-After: {RETRY_AFTER})",
        "paused on every worker: HTTP 429",
    ], labels
    # The summary says it too.
    assert f"{ORDERS} orders sent, {ORDERS} answered 200 in the end; Celery retries used: 0" \
        in demo.output
    assert "calls admitted while paused: 0" in demo.output
    # The limit's path as printed is the one sampled: it starts at 1, rises, and falls at a 429
    # (1 -> 2 -> 1 is as good as 1 -> 2 -> 3 -> 2: how far it climbs depends on timing).
    went = re.search(r"the limit in force went ((?:\d+ -> )+\d+)", demo.output)
    assert went, demo.output[-3000:]
    path = [int(n) for n in went.group(1).split(" -> ")]
    assert path == limit_changes(partner.samples), (path, went.group(0))
    top = path.index(max(path))
    assert path[0] == 1 and top > 0 and min(path[top:]) < path[top], path
