"""The pytest plugin of celery-semaphore (loaded through the ``pytest11`` entry point
whenever the package is installed; ``-p no:celery_semaphore`` turns it off).

Fixtures:

* ``semaphore_backend``: the URL of a semaphore backend of the test's own, empty at its
  start and gone at its end: ``memory://`` (default) or, with the ini option
  ``semaphore_test_backend = sqlite``, an SQLite file in the test's ``tmp_path``.
* ``semaphore_recorder``: a :class:`celery_semaphore.testing.ConcurrencyRecorder` watching
  the bodies of every guarded task while the test runs.

Celery's ``celery_app`` fixture (``celery.contrib.pytest``, which pytest-celery's plugin
provides too) gets celery-semaphore installed (:func:`celery_semaphore.install`) and, unless
its ``celery_config`` names a backend, pointed at the test's ``semaphore_backend`` (a memory
backend of its own in a test without that fixture) by
:func:`celery_semaphore.testing.use_backend`, before ``celery_worker`` starts: the gate runs
in the in-process worker, as it would in a real one, even for a guarded task the test
defines after the worker started (``celery_worker.reload()``, as Celery's docs say).
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack, contextmanager
from typing import Any, Generator, Iterator

import pytest

from . import install
from .testing import ConcurrencyRecorder, use_backend

BACKENDS = ("memory", "sqlite")


def pytest_addoption(parser: Any) -> None:
    parser.addini("semaphore_test_backend",
                  "celery-semaphore: the backend of the semaphore_backend fixture: "
                  f"{' or '.join(BACKENDS)} (default memory)", default="memory")


@pytest.fixture
def semaphore_backend(request: Any, tmp_path: Any) -> Iterator[str]:
    """A semaphore backend URL of this test's own (memory by default, see the module)."""
    kind = request.config.getini("semaphore_test_backend") or "memory"
    if kind not in BACKENDS:
        raise pytest.UsageError(f"semaphore_test_backend must be one of "
                                f"{', '.join(BACKENDS)}, not {kind!r}")
    if kind == "sqlite":
        yield "sqlite:///" + str(tmp_path / "celery-semaphore.db")
        return
    with _memory_backend() as url:
        yield url


@contextmanager
def _memory_backend() -> Iterator[str]:
    url = f"memory://test-{uuid.uuid4().hex}"
    try:
        yield url
    finally:
        from .backends import memory

        memory._stores.pop(url, None)


@pytest.fixture
def semaphore_recorder(semaphore_backend: str) -> Iterator[ConcurrencyRecorder]:
    """A :class:`~celery_semaphore.testing.ConcurrencyRecorder` that records every body of a
    guarded task run in this process during the test."""
    with ConcurrencyRecorder() as recorder:
        yield recorder


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, Any, None]:
    """Once Celery's ``celery_app`` fixture made the test's app (before ``celery_worker``
    starts a worker for it), install celery-semaphore into it and point it at the test's
    ``semaphore_backend`` (or, in a test without that fixture, at a memory backend of its
    own), unless the app's configuration names a backend."""
    outcome = yield
    if fixturedef.argname != "celery_app" or outcome.excinfo is not None:
        return
    app = outcome.get_result()
    if app.conf.get("semaphore_backend"):
        install(app)
        return
    stack = ExitStack()
    request.addfinalizer(stack.close)
    if "semaphore_backend" in request.fixturenames:
        url = request.getfixturevalue("semaphore_backend")
    else:
        url = stack.enter_context(_memory_backend())
    stack.enter_context(use_backend(app, url))
