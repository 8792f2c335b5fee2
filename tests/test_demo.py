"""``make demo`` works with no server: it exits 0, keeps every limit, and draws its timeline."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.workers import ROOT

pytestmark = pytest.mark.slow


def test_demo_runs_without_servers(tmp_path):
    env = dict(os.environ, EXAMPLE_VAR_DIR=str(tmp_path / "var"), PYTHONPATH=ROOT)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "example_project.demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.monotonic() - started < 120
    summary = next(line for line in done.stdout.splitlines() if line.startswith("summary:"))
    pairs = re.findall(r"(\S+) max (\d+)/(\d+)", summary)
    assert {name for name, _, _ in pairs} == {"uploads", "api:1", "api:2", "api:3"}
    for _, most, limit in pairs:
        assert 1 <= int(most) <= int(limit)
    png = tmp_path / "var" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
