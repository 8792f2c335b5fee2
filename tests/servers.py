"""Find the Redis and RabbitMQ servers the tests need, or start private ones.

Order: the URL in ``REDIS_URL`` / ``AMQP_URL``; else the machine's default port; else a server
started here (``redis-server`` on a free port, ``rabbitmq-server -detached``). When none can be
had, the test run fails saying how to get one: tests that need a server are never skipped.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlsplit

import pytest

DEFAULT_REDIS = "redis://127.0.0.1:6379/15"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"


def reachable(url: str, default_port: int, timeout: float = 1.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if reachable(url, port, timeout=0.5):
            return True
        time.sleep(0.2)
    return False


def redis_url() -> str:
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    if reachable(url, 6379):
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"no Redis at {url} and no redis-server to start: install the Debian package "
                    "redis-server (make test does) or set REDIS_URL", pytrace=False)
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="celery-semaphore-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    atexit.register(proc.terminate)
    url = f"redis://127.0.0.1:{port}/15"
    if not wait_for(url, port, 10):
        pytest.fail(f"started redis-server on port {port}, but it does not answer", pytrace=False)
    os.environ["REDIS_URL"] = url  # worker subprocesses use the same server
    return url


def amqp_url() -> str:
    url = os.environ.get("AMQP_URL", DEFAULT_AMQP)
    if reachable(url, 5672):
        return url
    binary = shutil.which("rabbitmq-server") or (
        "/usr/sbin/rabbitmq-server" if os.path.exists("/usr/sbin/rabbitmq-server") else None)
    if binary is None:
        pytest.fail(f"no RabbitMQ at {url} and no rabbitmq-server to start: install the Debian "
                    "package rabbitmq-server (make test does) or set AMQP_URL", pytrace=False)
    subprocess.run([binary, "-detached"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for(url, 5672, 60):
        pytest.fail("started rabbitmq-server -detached, but it does not answer on 5672",
                    pytrace=False)
    return url
