"""``install(app)``: the consumer bootstep that runs the gate, and its remote-control command."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from celery import bootsteps, signals
from celery import states as celery_states
from celery.exceptions import ImproperlyConfigured
from celery.worker.control import inspect_command

from . import states
from .autoinstall import INSTALLED, guarded_tasks
from .backends import get_backend
from .backends.base import Backend
from .eager import (
    acquire_for_eager,
    acquires_in_before_start,
    guard_eager_calls,
    release_for_eager,
)
from .exceptions import ConfigurationError
from .gate import GATE_HEADERS, Gate
from .guards import check_definitions_and_sends, check_options
from .settings import Settings, lookup
from .task_lease import lease_record

logger = logging.getLogger(__name__)


class SemaphoreStep(bootsteps.StartStopStep):
    """Consumer step: validates the settings at worker start and runs the :class:`Gate`.

    It wraps ``consumer.on_task_request`` in ``__init__``: the consumer sets that callable
    before it applies its steps, and the Tasks step reads it only when it starts, so every path
    to the pool (direct, ETA, rate limit) goes through the gate.
    """

    label = "Semaphore gate"
    name = "celery_semaphore.worker.SemaphoreStep"

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        app = consumer.app
        try:
            settings = Settings.from_app(app)
            backend = get_backend(settings.backend_url(app), key_prefix=settings.key_prefix)
            check_tasks(app, settings, backend)
        except ConfigurationError as exc:
            raise ImproperlyConfigured(f"celery-semaphore: {exc}") from None
        self.gate = Gate(consumer, settings, backend)
        self.announced = False
        consumer.semaphore_gate = self.gate

    def start(self, consumer: Any) -> None:
        if not self.announced:
            self.announced = True
            logger.info("celery-semaphore: gate on, backend %r; guarded tasks: %s",
                        self.gate.backend, describe_guarded(consumer.app) or "none")
        try:
            self.gate.backend.ping()
        except Exception as exc:
            logger.warning("celery-semaphore: backend %r unreachable at start (guarded tasks "
                           "wait until it answers): %s", self.gate.backend, exc)
        self.gate.start()

    def stop(self, consumer: Any) -> None:
        self.gate.stop()

    def shutdown(self, consumer: Any) -> None:
        self.gate.shutdown()


def check_tasks(app: Any, settings: Settings, backend: Backend) -> None:
    """Fail worker start on a task whose semaphore options are wrong, naming the task, or on a
    lease TTL the backend would outlast (``Backend.max_lease_ttl``), naming the setting."""
    _check_lease_ttl(lookup(app, "semaphore_lease_ttl")[1], settings.lease_ttl, backend)
    for name, task in guarded_tasks(app).items():
        check_options({key: getattr(task, key) for key in dir(type(task))
                       if key in ("semaphore", "limit") or key.startswith("semaphore_")}, name)
        try:
            _check_lease_ttl("semaphore_lease_ttl", settings.for_task(task).lease_ttl, backend)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {name}: {exc}") from None


def _check_lease_ttl(key: str, ttl: float, backend: Backend) -> None:
    if ttl > backend.max_lease_ttl:
        raise ConfigurationError(f"{key} ({ttl:g}s) must not exceed 15/16 of the backend's "
                                 f"idle_ttl ({backend.idle_ttl:g}s)")


def describe_guarded(app: Any) -> str:
    """``name (semaphore 'x', limit 4)`` for each guarded task, comma-separated."""
    settings = Settings.from_app(app)
    parts = []
    for name, task in guarded_tasks(app).items():
        template = task.semaphore
        limit = (settings.limits.get(template) or getattr(task, "limit", None)
                 or settings.default_limit)
        kind = "template" if "{" in template else "semaphore"
        parts.append(f"{name} ({kind} {template!r}, limit {limit})")
    return ", ".join(parts)


@inspect_command(alias="semaphores")
def semaphore_requests(state: Any, **kwargs: Any) -> Any:
    """Requests this worker holds for a slot ("waiting") and runs with one ("held")."""
    gate: Optional[Gate] = getattr(state.consumer, "semaphore_gate", None)
    if gate is None:
        return {"error": "celery-semaphore is not installed on this worker"}
    return gate.snapshot()


def install(app: Any) -> Any:
    """Install celery-semaphore into ``app`` (idempotent); returns ``app``.

    Adds the consumer step (the gate) and makes ``WAITING`` rank between ``RECEIVED`` and
    ``STARTED`` for Celery's event state (Flower).
    """
    if getattr(app, INSTALLED, False):
        return app
    states.register_precedence()
    app.steps["consumer"].add(SemaphoreStep)
    guard_eager_calls(app)
    check_definitions_and_sends(app)
    signals.task_prerun.connect(_eager_acquire, weak=False, dispatch_uid="celery_semaphore_pre")
    signals.task_postrun.connect(_eager_release, weak=False, dispatch_uid="celery_semaphore_post")
    signals.task_prerun.connect(_store_started, weak=False,
                                dispatch_uid="celery_semaphore_started")
    signals.before_task_publish.connect(_strip_gate_headers, weak=False,
                                        dispatch_uid="celery_semaphore_publish")
    setattr(app, INSTALLED, True)
    return app


def _eager_acquire(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """Eager calls of a task whose class lacks the ``before_start`` guard acquire here."""
    if task is not None and not acquires_in_before_start(task):
        acquire_for_eager(task)


def _store_started(sender: Any = None, task: Any = None, task_id: str = "",
                   **kwargs: Any) -> None:
    """A task that waited for its slot has ``WAITING`` stored: once it runs, store
    ``STARTED`` (Celery does that itself only with ``task_track_started``), so that
    ``AsyncResult.state`` does not say WAITING for the whole run."""
    request = getattr(task, "request", None)
    lease = lease_record(request)
    if (lease is None or not lease.waited or request.is_eager or task.track_started
            or task.ignore_result):
        return
    try:
        task.backend.store_result(task_id, {"pid": os.getpid(), "hostname": request.hostname},
                                  celery_states.STARTED, request=request)
    except Exception as exc:
        logger.warning("celery-semaphore: storing STARTED for %s failed: %s", task_id, exc)


def _strip_gate_headers(headers: Optional[dict] = None, **kwargs: Any) -> None:
    """Keep what the gate adds to a running request out of messages it publishes: a retry
    copies the request's custom headers, and would carry the lease (the backend URL with its
    password) and the requeue count and first-wait time (so ``semaphore_max_wait`` would count
    from the first run's wait)."""
    if headers:
        for key in GATE_HEADERS:
            headers.pop(key, None)


def _eager_release(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    release_for_eager(task)
