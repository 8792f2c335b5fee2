"""Testing helpers: check that your guarded tasks never ran more than N at once.

:class:`ConcurrencyRecorder` records, per semaphore name, when each body of a guarded task
started and ended, and answers :meth:`~ConcurrencyRecorder.max_concurrent` and
:meth:`~ConcurrencyRecorder.assert_max_concurrent`. It observes the bodies themselves, not
the semaphore's bookkeeping: :meth:`~ConcurrencyRecorder.watch` wraps the ``run`` of every
guarded task (of every Celery app in the process, and of every task defined while it
watches), and :meth:`~ConcurrencyRecorder.running` records a block you mark yourself. A
run is recorded under the names the task's ``semaphore`` option (or the call's
``semaphore`` header) fills in from the call's arguments.

It records in the process it lives in: eager calls (``task.apply()``,
``task_always_eager``) and Celery's in-process test worker (``celery_worker``, with the
``solo`` or ``threads`` pool). Bodies run in other processes (a prefork pool, a worker
started apart) are not seen.

The pytest plugin (:mod:`celery_semaphore.pytest_plugin`, loaded by pytest through the
``pytest11`` entry point) gives it as the ``semaphore_recorder`` fixture.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["ConcurrencyRecorder", "Run", "use_backend"]


@dataclass
class Run:
    """One recorded body: the semaphore name it ran under, a label (``task[id]``), and its
    start and end (``time.monotonic_ns()``; ``end`` is None while it runs)."""

    name: str
    label: str
    start: int
    end: Optional[int] = None


class ConcurrencyRecorder:
    """Records which bodies ran at once, per semaphore name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: Dict[str, List[Run]] = {}
        self._patched: List[Tuple[Any, bool, Any]] = []  # (class, had its own run, run)
        self._watching = False

    # -- recording ----------------------------------------------------------------------

    @contextmanager
    def running(self, *names: str, label: str = "") -> Iterator[None]:
        """Record the block as one run under each of ``names`` (for use in a task body)."""
        runs = [Run(name, label, 0) for name in names]
        with self._lock:
            start = time.monotonic_ns()
            for run in runs:
                run.start = start
                self._runs.setdefault(run.name, []).append(run)
        try:
            yield
        finally:
            with self._lock:
                end = time.monotonic_ns()
                for run in runs:
                    run.end = end

    def runs(self, name: str) -> List[Run]:
        """Every run recorded under ``name``, in the order they started."""
        with self._lock:
            return sorted(self._runs.get(name, []), key=lambda run: run.start)

    def names(self) -> List[str]:
        """Every semaphore name a run was recorded under."""
        with self._lock:
            return sorted(self._runs)

    def clear(self) -> None:
        """Forget every run recorded so far."""
        with self._lock:
            self._runs.clear()

    # -- questions ----------------------------------------------------------------------

    def max_concurrent(self, name: str) -> int:
        """The most runs under ``name`` that ran at once (one that has not ended counts as
        running; a run that ended exactly when another started does not overlap it)."""
        return self._peak(name)[0]

    def _peak(self, name: str) -> Tuple[int, List[Run]]:
        runs = self.runs(name)
        now = time.monotonic_ns()
        points = sorted((point for index, run in enumerate(runs) for point in (
            (run.start, 1, index), (run.end if run.end is not None else now, -1, index))),
            key=lambda point: (point[0], point[1]))
        current: Dict[int, None] = {}
        best: List[Run] = []
        for _, delta, index in points:
            if delta > 0:
                current[index] = None
                if len(current) > len(best):
                    best = [runs[i] for i in current]
            else:
                current.pop(index, None)
        return len(best), best

    def assert_max_concurrent(self, name: str, limit: int) -> None:
        """Raise AssertionError if more than ``limit`` runs under ``name`` ran at once (naming
        them), or if no run under ``name`` was recorded at all (the task did not run, or ran
        where the recorder cannot see it: a check that saw nothing would prove nothing)."""
        __tracebackhide__ = True  # pytest: show the test's line, not this one
        count, overlapping = self._peak(name)
        if count == 0:
            known = ", ".join(map(repr, self.names())) or "none"
            raise AssertionError(f"no run under semaphore {name!r} was recorded (recorded: "
                                 f"{known}); did the tasks run in this process?")
        if count > limit:
            labels = ", ".join(run.label or "?" for run in overlapping)
            raise AssertionError(f"{count} runs under semaphore {name!r} ran at once, more "
                                 f"than {limit}: {labels}")

    # -- watching task bodies ------------------------------------------------------------

    def watch(self) -> "ConcurrencyRecorder":
        """Record every body of a guarded task from now on: the tasks of every Celery app in
        this process, and the tasks defined until :meth:`unwatch`. Returns ``self``."""
        from celery._state import _get_active_apps

        from .autoinstall import TASK_CLASS_CALLBACKS

        if self._watching:
            return self
        self._watching = True
        TASK_CLASS_CALLBACKS.append(self._class_made)
        for app in list(_get_active_apps()):
            for task in list(app._tasks.values()):
                self._wrap(type(task))
        return self

    def unwatch(self) -> None:
        """Stop recording task bodies: give every wrapped task its own ``run`` back."""
        from .autoinstall import TASK_CLASS_CALLBACKS

        if self._class_made in TASK_CLASS_CALLBACKS:
            TASK_CLASS_CALLBACKS.remove(self._class_made)
        for cls, had_own, original in reversed(self._patched):
            if had_own:
                cls.run = original
            else:
                delattr(cls, "run")
            _forget_tracer(cls)
        self._patched.clear()
        self._watching = False

    def __enter__(self) -> "ConcurrencyRecorder":
        return self.watch()

    def __exit__(self, *exc: Any) -> None:
        self.unwatch()

    def _class_made(self, cls: Any) -> None:
        self._wrap(cls)

    def _wrap(self, cls: Any) -> None:
        if getattr(cls, "semaphore", None) is None or any(c is cls for c, _, _ in self._patched):
            return
        raw = inspect.getattr_static(cls, "run", None)
        if raw is None or getattr(getattr(raw, "__func__", raw), _RECORDS, False):
            return  # no body, or one this recorder already records (a guarded base's)
        had_own = "run" in cls.__dict__
        recorder = self
        if isinstance(raw, staticmethod):
            body = raw.__func__

            @functools.wraps(body)
            def run(*args: Any, **kwargs: Any) -> Any:
                with recorder.running(*recorder._names(cls, None, args, kwargs),
                                      label=_label(cls, None)):
                    return body(*args, **kwargs)

            setattr(run, _RECORDS, True)
            cls.run = staticmethod(run)
        elif inspect.isfunction(raw):
            method = raw

            @functools.wraps(method)
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:  # bind=True, class-based
                with recorder.running(*recorder._names(cls, self, args, kwargs),
                                      label=_label(cls, self)):
                    return method(self, *args, **kwargs)

            setattr(run, _RECORDS, True)
            cls.run = run
        else:
            return
        self._patched.append((cls, had_own, raw))
        _forget_tracer(cls)

    @staticmethod
    def _names(cls: Any, task: Any, args: Any, kwargs: Any) -> List[str]:
        """The semaphore names this call fills in (none when it cannot: the guard then fails
        the call before its body runs anyway)."""
        from .guards import Guards
        from .settings import Settings

        task = task if task is not None else _current_task(cls)
        if task is None:
            return []
        request = getattr(task, "request", None)
        headers: Dict[str, Any] = dict(getattr(request, "headers", None) or {})
        for key in ("semaphore", "semaphore_limit"):
            value = getattr(request, key, None)
            if value is not None:
                headers.setdefault(key, value)
        try:
            guard = Guards(Settings.from_app(task.app)).resolve_call(task, args, kwargs,
                                                                     headers)
        except Exception:
            return []
        return list(guard.names) if guard is not None else []


#: Marks the ``run`` wrappers of a :class:`ConcurrencyRecorder`.
_RECORDS = "_celery_semaphore_records"
#: ``semaphore_poll_interval`` of an app :func:`use_backend` points at a test's backend.
TEST_POLL_INTERVAL = 0.05


@contextmanager
def use_backend(app: Any, backend_url: str, **settings: Any) -> Iterator[Any]:
    """Point ``app`` at ``backend_url`` while the block runs (``semaphore_backend``; also
    ``semaphore_poll_interval = 0.05`` unless the app sets it, so that a waiting task sees a
    freed slot quickly), with any other ``semaphore_*`` ``settings`` given, and install
    celery-semaphore into it; yields ``app``. The settings are given back on exit (the
    install stays: it is idempotent). An unknown setting name raises ConfigurationError.
    For the tests of your own app in eager mode::

        @pytest.fixture(autouse=True)
        def semaphores(semaphore_backend):
            with use_backend(app, semaphore_backend):
                yield
    """
    from . import install
    from .exceptions import ConfigurationError
    from .settings import known_settings

    unknown = sorted(set(settings) - set(known_settings()))
    if unknown:
        raise ConfigurationError(f"use_backend: unknown setting(s) {', '.join(unknown)}")
    missing = object()
    wanted = {"semaphore_backend": backend_url, **settings}
    if app.conf.get("semaphore_poll_interval") is None and "semaphore_poll_interval" not in \
            settings:
        wanted["semaphore_poll_interval"] = TEST_POLL_INTERVAL
    previous = {key: app.conf.changes.get(key, missing) for key in wanted}
    app.conf.update(wanted)
    try:
        yield install(app)
    finally:
        for key, value in previous.items():
            if value is missing:
                app.conf.changes.pop(key, None)
            else:
                app.conf[key] = value


def _forget_tracer(cls: Any) -> None:
    """A worker builds a task's tracer once, with the ``run`` of that moment: make it build
    a new one (eager calls build theirs per call)."""
    app = cls.__dict__.get("app") or getattr(cls, "_app", None)
    task = app._tasks.get(getattr(cls, "name", None)) if app is not None else None
    if task is not None and not getattr(task.app, "use_fast_trace_task", False):
        task.__trace__ = None  # (a prefork child traces with what it built: not seen here)


def _current_task(cls: Any) -> Any:
    from celery._state import get_current_task

    task = get_current_task()
    if task is not None and isinstance(task, cls):
        return task
    app = cls.__dict__.get("app") or getattr(cls, "_app", None)
    return app._tasks.get(getattr(cls, "name", None)) if app is not None else None


def _label(cls: Any, task: Any) -> str:
    task = task if task is not None else _current_task(cls)
    request = getattr(task, "request", None)
    name = getattr(task, "name", None) or getattr(cls, "name", None) or cls.__name__
    return f"{name}[{getattr(request, 'id', None) or '?'}]"

