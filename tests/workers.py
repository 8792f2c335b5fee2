"""Real ``celery worker`` subprocesses for the integration tests."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from tests import servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Worker node names are unique per broker (a RabbitMQ worker's pidbox queue is exclusive):
#: the processes of a parallel test run (pytest-xdist's gw0, gw1, ...) add their own suffix,
#: and so do test runs made side by side against the same broker (``CS_NODE_SUFFIX``: each
#: tox env of ``make compat`` sets its own).
NAME_SUFFIX = os.environ.get("CS_NODE_SUFFIX", "") + (
    f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")


#: Every worker this process started: what a test left running (one that failed before its
#: cleanup, a fixture that raised while starting its workers) is killed at the session's end
#: (tests/conftest.py) and, at the latest, when this process exits.
STARTED: "List[Worker]" = []


def kill_leftovers() -> int:
    """Kill every worker this process started that still runs; how many there were."""
    left = [worker for worker in STARTED if worker.proc.poll() is None]
    for worker in left:
        worker.kill()
    STARTED.clear()
    return len(left)


atexit.register(kill_leftovers)


def children(pid: int) -> List[int]:
    """Direct child pids of ``pid`` (Linux /proc)."""
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
    except FileNotFoundError:
        pass
    return found


class Worker:
    """One ``celery -A tests.celery_app worker`` process with its environment."""

    def __init__(self, env: Dict[str, str], name: str, concurrency: int = 4,
                 pool: str = "prefork", extra: Optional[List[str]] = None,
                 app: str = "tests.celery_app") -> None:
        self.env = env
        self.name = name
        self.log = os.path.join(env["CS_DIR"], f"{name}.log")
        args = [sys.executable, "-m", "celery", "-A", app, "worker",
                "-c", str(concurrency), "-P", pool, "-n", f"{name}{NAME_SUFFIX}@%h", "-E",
                "-l", env.get("CS_LOGLEVEL", "info"), "-Q", env["CS_QUEUE"], "--without-gossip",
                "--without-mingle"]
        self.proc = subprocess.Popen(args + (extra or []), cwd=ROOT, env=env,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        STARTED.append(self)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited: {self.output()[-3000:]}")
            if " ready." in self.output():
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {self.name} not ready: {self.output()[-3000:]}")

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def pool_pids(self) -> List[int]:
        return children(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        pids = self.pool_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_cli(env: Dict[str, str], *args: str, app: bool = True,
            cwd: str = ROOT) -> subprocess.CompletedProcess:
    """``celery [-A tests.celery_app] semaphore ARGS`` in a subprocess."""
    command = [sys.executable, "-m", "celery"] + (["-A", "tests.celery_app"] if app else [])
    return subprocess.run(command + ["semaphore", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60)


def cluster_env(tmp_dir: str, broker: str, backend: Optional[str], result: str,
                **extra: str) -> Dict[str, str]:
    tag = servers.unique_tag()
    env = dict(os.environ)
    env.update(
        CS_DIR=tmp_dir,
        CS_BROKER_URL=broker,
        CS_SEMAPHORE_BACKEND=backend or "",  # empty: the default for the broker
        CS_RESULT_BACKEND=result,
        CS_KEY_PREFIX=f"{tag}:",
        CS_QUEUE=f"{tag}.q",
        CS_PROBE=os.path.join(tmp_dir, "probe.log"),
        PYTHONPATH=ROOT,
    )
    env.update(extra)
    return env
