"""Each install extra, alone in a fresh virtualenv, brings what its broker and backend need:
a worker of a small app starts there with the gate on (before: ``[redis]`` lacked kombu's
``packaging`` and the worker died at start)."""

import fcntl
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import servers
from tests.workers import ROOT

pytestmark = pytest.mark.slow

APP = textwrap.dedent("""
    import os
    from celery import Celery

    app = Celery("extra_app")
    app.conf.update(
        broker_url=os.environ["X_BROKER"],
        broker_transport_options={"data_folder_in": os.environ["X_DIR"],
                                  "data_folder_out": os.environ["X_DIR"]},
        semaphore_backend=os.environ.get("X_BACKEND") or None,
        task_default_queue=os.environ["X_QUEUE"],
    )


    @app.task(semaphore="extra", limit=1)
    def guarded():
        return 1
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # one build of the source tree at a time: two test processes building at once share its
    # build/ folder, and one of their wheels came out empty
    with open(os.path.join(ROOT, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                        ROOT], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("*.whl")
    return built


def make_venv(path, requirement):
    # A venv without pip of its own, filled by this interpreter's pip (``--python``), with no
    # bytecode compiled ahead: what lands in it is the same, in a fifth of the time.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(path / "bin" / "python"),
                           "install", "-q", "--no-compile", "--disable-pip-version-check",
                           requirement], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def start_worker(venv, workdir, broker, backend=""):
    (workdir / "extra_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(X_BROKER=broker, X_BACKEND=backend, X_DIR=str(workdir),
               X_QUEUE=f"{servers.unique_tag()}.q", PYTHONPATH=str(workdir))
    log = workdir / "worker.log"
    proc = subprocess.Popen([str(venv / "bin" / "celery"), "-A", "extra_app", "worker", "-c",
                             "1", "-l", "info", "--without-gossip", "--without-mingle"],
                            cwd=workdir, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if " ready." in log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        return proc.poll(), log.read_text(errors="replace")
    finally:
        proc.terminate()
        proc.wait(30)


def test_each_extra_alone_starts_a_worker(wheel, tmp_path, redis_url, amqp_url):
    cases = {
        "": ("filesystem://", "", "SQLiteBackend sqlite:///celery-semaphore.db"),
        "redis": (servers.redis_broker(redis_url), "", "RedisBackend redis://"),
        "amqp": (amqp_url, "", "TokenBackend amqp://"),
        "consul": ("filesystem://", "consul://127.0.0.1:1", "ConsulBackend consul://"),
    }
    with ThreadPoolExecutor(2) as pool:
        venvs = dict(zip(cases, pool.map(
            lambda extra: make_venv(tmp_path / f"venv-{extra or 'base'}",
                                    f"{wheel}[{extra}]" if extra else str(wheel)),
            cases)))

    def start(extra):
        broker, backend, _ = cases[extra]
        workdir = tmp_path / f"app-{extra or 'base'}"
        workdir.mkdir()
        return start_worker(venvs[extra], workdir, broker, backend)

    with ThreadPoolExecutor(len(cases)) as pool:
        started = dict(zip(cases, pool.map(start, cases)))
    for extra, (_, _, shown) in cases.items():
        exited, output = started[extra]
        assert exited is None and " ready." in output, (extra, output[-3000:])
        assert "gate on" in output and shown in output, (extra, output[-3000:])
        assert "extra_app.guarded (semaphore 'extra', limit 1)" in output


def test_the_wheel_ships_py_typed_and_the_pytest_plugin(wheel):
    """Type checkers read the package's hints (PEP 561), and pytest finds the plugin."""
    import zipfile

    with zipfile.ZipFile(wheel) as built:
        names = built.namelist()
        entry_points = next(built.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    assert "celery_semaphore/py.typed" in names
    assert "celery_semaphore/pytest_plugin.py" in names
    assert "[pytest11]\ncelery_semaphore = celery_semaphore.pytest_plugin" in entry_points
