"""Make docs/_static/flower-waiting.png: Flower's tasks page while tasks wait for a slot.

The scenario of tests/test_flower.py (issue #29): one prefork worker of 2 processes, the test
app's ``per_customer`` task (semaphore ``api:{customer_id}``, limit 1), one slow task of a
customer holding the slot and 3 more of the same customer, which all show WAITING. Starts the
worker and Flower with the test suite's helpers (tests/), waits through Flower's HTTP API
until the 3 show WAITING, then has headless Chromium capture ``/tasks``.

Needs the servers of the test suite (Redis) and Debian's chromium (``apt-get install
chromium``); the test suite itself never needs chromium. Run from the repository root::

    .venv/bin/python scripts/flower-screenshot.py [OUTPUT.png]
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import servers  # noqa: E402
from tests.test_flower import Flower  # noqa: E402
from tests.test_worker import Cluster  # noqa: E402
from tests.util import wait_until  # noqa: E402

DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "_static", "flower-waiting.png")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("no chromium on PATH: apt-get install -y chromium")


def screenshot(url: str, output: str) -> None:
    profile = tempfile.mkdtemp(prefix="flower-shot-")
    try:
        subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
             "--window-size=1400,700", "--virtual-time-budget=5000", f"--screenshot={output}",
             url],
            check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    output = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUTPUT)
    redis_url = servers.redis_url()
    workdir = tempfile.mkdtemp(prefix="flower-screenshot-")
    settings = {"event_exchange": f"{servers.unique_tag()}.ev"}
    cluster = Cluster(workdir, redis_url, servers.redis_broker(redis_url),
                      f"sqlite:///{workdir}/sem.db", workers=1, concurrency=2,
                      names="screenshot", CS_SETTINGS=json.dumps(settings))
    flower = None
    done = False
    try:
        flower = Flower(cluster, os.path.join(workdir, "flower.log"))
        flower.wait_ready()
        flower.wait_for_events()
        per_customer = cluster.task("per_customer")
        holder = per_customer.delay(7, "hold", 60.0)
        assert wait_until(lambda: cluster.started("customer-7:hold"), timeout=10)
        waiters = [per_customer.delay(7, f"w{i}", 0.05) for i in range(3)]
        if not wait_until(lambda: all(flower.state_of(r.id) == "WAITING" for r in waiters),
                          timeout=5):
            # a known race of the worker (docs/operations/flower.md, "Tested"): run it again
            holder.revoke(terminate=True)
            sys.exit(f"not all 3 WAITING: {[flower.history.get(r.id) for r in waiters]}")
        screenshot(f"{flower.base}/tasks", output)
        # still waiting once the picture was taken: the page showed them WAITING
        assert all(flower.state_of(r.id) == "WAITING" for r in waiters)
        print(f"{output}: {os.path.getsize(output)} bytes")
        holder.revoke(terminate=True)
        for result in waiters:
            result.get(timeout=30)
        done = True
    finally:
        if flower is not None:
            flower.stop()
        cluster.stop()
        for database in (redis_url, servers.redis_broker(redis_url)):
            servers.sweep_redis(database)
        if done:
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # the worker's and Flower's logs, to see why
            print(f"kept {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
