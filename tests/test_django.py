"""``python -m django semaphore ...`` runs the same subcommands as ``celery semaphore``."""

import json
import os
import subprocess
import sys

from tests import servers
from tests.workers import ROOT


def manage(redis_url, prefix, *args):
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.django_project.settings",
               CS_SEMAPHORE_BACKEND=redis_url, CS_KEY_PREFIX=prefix, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "django", "semaphore", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_django_command_shares_the_cli(redis_url):
    prefix = f"{servers.unique_tag()}:"
    created = manage(redis_url, prefix, "resize", "reports", "2")
    assert created.returncode == 0, created.stderr
    assert "created semaphore 'reports' with limit 2" in created.stdout
    status = json.loads(manage(redis_url, prefix, "status", "reports", "--json").stdout)
    assert status["limit"] == 2 and status["holders"] == []
    assert manage(redis_url, prefix, "status", "missing").returncode == 1
    bad = manage(redis_url, prefix, "resize", "reports", "0")
    assert bad.returncode == 2 and "Usage:" in bad.stderr
    assert json.loads(manage(redis_url, prefix, "status", "reports", "--json").stdout)[
        "limit"] == 2
