"""``make demo`` works with no server: it exits 0, keeps every limit, and draws its timeline."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.workers import ROOT

pytestmark = pytest.mark.slow

LIMITS = {"uploads": 4, "api:1": 2, "api:2": 2, "api:3": 1}  # api:3 from semaphore_limits


def run_demo(var, timeout=150):
    env = dict(os.environ, EXAMPLE_VAR_DIR=str(var), PYTHONPATH=ROOT)
    env.pop("EXAMPLE_BROKER_URL", None)
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


def test_demo_runs_without_servers(tmp_path):
    var = tmp_path / "var"
    returncode, output, elapsed = run_demo(var)
    assert returncode == 0, output[-3000:]
    assert elapsed < 120, f"the demo took {elapsed:.0f}s"

    summary = next(line for line in output.splitlines() if line.startswith("summary:"))
    found = {name: (int(most), int(limit))
             for name, most, limit in re.findall(r"(\S+) max (\d+)/(\d+)", summary)}
    assert set(found) == set(LIMITS), summary
    for name, (most, limit) in found.items():
        assert limit == LIMITS[name], summary
        assert 1 <= most <= limit, summary
    assert re.search(r"makespan \d+\.\d+s", summary), summary
    assert "the store rejected a late write with the stale token" in output

    # The first frame shows the declared limits, before any task asked for a slot.
    first = output.split("semaphore  slots")[1].splitlines()[1:1 + len(LIMITS)]
    for line in first:
        name, held = re.match(r"\s*(\S+)\s+\[[^\]]*\]\s+(\S+)", line).groups()
        assert held == f"0/{LIMITS[name]}", first
    assert "/-" not in output
    # Every figure on screen is explained there.
    assert "running: tasks holding a slot / the limit" in output
    assert "fencing: every lease carries a token (slot:epoch)" in output
    assert "util: the share of the semaphore's slots" in output
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
