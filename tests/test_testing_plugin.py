"""The pytest plugin (``celery_semaphore.pytest_plugin``) as a user meets it: a fresh project
of its own (a tasks module, a conftest, tests: docs/examples/testing/, the project the
"Testing your tasks" page shows), run by pytest in a subprocess with the
installed package, using only the plugin's public fixtures with Celery's ``celery_app`` /
``celery_worker`` and with eager mode. The same project with its limits raised above what
its tests assert must fail, caught by ``assert_max_concurrent``. This module also uses the
plugin itself (``semaphore_backend``, ``semaphore_recorder``, Celery's fixtures)."""

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from celery_semaphore import Semaphore
from celery_semaphore.testing import ConcurrencyRecorder
from tests.util import wait_until

pytest_plugins = ("celery.contrib.pytest", "pytester")

#: The project the "Testing your tasks" page shows (its tests are those of the page).
PROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "docs", "examples", "testing")


def write_project(path, exports, reports):
    """A copy of the documented project, its tasks declared with these limits."""
    shutil.copytree(PROJECT, path, ignore=shutil.ignore_patterns("__pycache__"))
    tasks = path / "shop_tasks.py"
    text = tasks.read_text()
    for old, new in (('semaphore="exports", limit=2', f'semaphore="exports", limit={exports}'),
                     ('semaphore="reports:{customer_id}", limit=1',
                      f'semaphore="reports:{{customer_id}}", limit={reports}')):
        assert old in text, old
        text = text.replace(old, new)
    tasks.write_text(text)
    return path


def run_pytest(project):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYTEST", "CS_"))}
    env["PYTHONPATH"] = str(project)  # the project's own modules, as its rootdir would be
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
                           "-p", "no:randomly"], cwd=project, env=env, capture_output=True,
                          text=True, timeout=240, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_a_fresh_project_checks_its_limits_with_the_plugin(tmp_path):
    keeps = write_project(tmp_path / "shop", exports=2, reports=1)
    breaks = write_project(tmp_path / "shop_over_limit", exports=4, reports=4)
    with ThreadPoolExecutor(2) as pool:
        kept, broken = pool.map(run_pytest, [keeps, breaks])
    assert kept.returncode == 0, kept.stdout[-4000:] + kept.stderr[-2000:]
    assert "3 passed" in kept.stdout
    assert broken.returncode == 1, broken.stdout[-4000:] + broken.stderr[-2000:]
    # the two tests that record concurrency fail, naming the semaphore and the runs (the
    # third, a full semaphore, depends on the declared limit: limits follow the code)
    assert "FAILED test_shop.py::test_the_worker_keeps_the_limits" in broken.stdout
    assert "FAILED test_shop.py::test_eager_calls_take_turns" in broken.stdout
    assert "runs under semaphore 'exports' ran at once, more than 2" in broken.stdout
    assert "runs under semaphore 'reports:7' ran at once, more than 1" in broken.stdout


@pytest.fixture(scope="session")
def celery_worker_pool():
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters():
    return {"concurrency": 6}


def test_the_in_process_worker_runs_the_gate(celery_app, celery_worker, semaphore_recorder,
                                             semaphore_backend):
    """A task defined in the test after the worker started: the gate holds it to its limit,
    and a slot held from outside keeps the task waiting until it is released."""

    @celery_app.task(semaphore="plugin-images", limit=2, name="plugin.resize", shared=False)
    def resize(n):
        time.sleep(0.1)
        return n

    celery_worker.reload()  # Celery's way to tell its test worker of a new task
    assert celery_app.conf.semaphore_backend == semaphore_backend
    results = [resize.delay(n) for n in range(6)]
    assert [r.get(timeout=30) for r in results] == list(range(6))
    semaphore_recorder.assert_max_concurrent("plugin-images", 2)
    assert semaphore_recorder.max_concurrent("plugin-images") == 2

    held = [Semaphore("plugin-images", 2, semaphore_backend).acquire() for _ in range(2)]
    waiting = resize.delay(99)
    assert wait_until(lambda: waiting.state == "WAITING", timeout=10), waiting.state
    assert not any(run.label.endswith(f"[{waiting.id}]")
                   for run in semaphore_recorder.runs("plugin-images"))
    for lease in held:
        lease.release()
    assert waiting.get(timeout=30) == 99


def test_the_recorder_sees_overlaps_and_refuses_an_empty_check():
    recorder = ConcurrencyRecorder()
    with pytest.raises(AssertionError, match="no run under semaphore 'x' was recorded"):
        recorder.assert_max_concurrent("x", 1)
    started = threading.Barrier(3)

    def body(label):
        with recorder.running("x", label=label):
            started.wait(5)

    threads = [threading.Thread(target=body, args=(f"t{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert recorder.max_concurrent("x") == 3
    recorder.assert_max_concurrent("x", 3)
    with pytest.raises(AssertionError, match=r"3 runs under semaphore 'x' ran at once, more "
                                             r"than 2: t\d, t\d, t\d"):
        recorder.assert_max_concurrent("x", 2)
    with recorder.running("y"):
        pass
    with recorder.running("y"):
        pass
    assert recorder.max_concurrent("y") == 1


def test_the_backend_fixture_follows_the_ini_option(pytester):
    pytester.makepyfile(textwrap.dedent("""
        from celery_semaphore import Semaphore

        def test_backend(semaphore_backend, tmp_path):
            assert semaphore_backend == "sqlite:///" + str(tmp_path / "celery-semaphore.db")
            with Semaphore("x", 1, semaphore_backend).acquire():
                assert Semaphore("x", 1, semaphore_backend).try_acquire() is None
    """))
    pytester.makeini("[pytest]\nsemaphore_test_backend = sqlite\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nsemaphore_test_backend = redis\n")
    refused = pytester.runpytest("-p", "no:cacheprovider")
    refused.assert_outcomes(errors=1)
    assert ("semaphore_test_backend must be one of memory, sqlite, not 'redis'"
            in refused.stdout.str())


def test_each_test_gets_an_empty_memory_backend(semaphore_backend):
    assert semaphore_backend.startswith("memory://test-")
    assert Semaphore("fresh", 1, semaphore_backend).status().holders == ()
