"""``install(app)``: the consumer bootstep that runs the gate, and its remote-control command."""

from __future__ import annotations

import logging
from typing import Any, Optional

from celery import bootsteps, signals
from celery.exceptions import ImproperlyConfigured
from celery.worker.control import inspect_command

from . import states
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
from .names import validate_limit, validate_template
from .settings import Settings, lookup

logger = logging.getLogger(__name__)

_INSTALLED = "_celery_semaphore_installed"


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
        consumer.semaphore_gate = self.gate

    def start(self, consumer: Any) -> None:
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
    for name, task in list(app.tasks.items()):
        template = getattr(task, "semaphore", None)
        if template is None:
            continue
        try:
            validate_template(template, "semaphore")
            limit = getattr(task, "limit", None)
            if limit is not None:
                validate_limit(limit)
            _check_lease_ttl("semaphore_lease_ttl", settings.for_task(task).lease_ttl, backend)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {name}: {exc}") from None


def _check_lease_ttl(key: str, ttl: float, backend: Backend) -> None:
    if ttl > backend.max_lease_ttl:
        raise ConfigurationError(f"{key} ({ttl:g}s) must not exceed 15/16 of the backend's "
                                 f"idle_ttl ({backend.idle_ttl:g}s)")


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
    if getattr(app, _INSTALLED, False):
        return app
    states.register_precedence()
    app.steps["consumer"].add(SemaphoreStep)
    guard_eager_calls(app)
    signals.task_prerun.connect(_eager_acquire, weak=False, dispatch_uid="celery_semaphore_pre")
    signals.task_postrun.connect(_eager_release, weak=False, dispatch_uid="celery_semaphore_post")
    signals.before_task_publish.connect(_strip_gate_headers, weak=False,
                                        dispatch_uid="celery_semaphore_publish")
    setattr(app, _INSTALLED, True)
    return app


def _eager_acquire(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """Eager calls of a task whose class lacks the ``before_start`` guard acquire here."""
    if task is not None and not acquires_in_before_start(task):
        acquire_for_eager(task)


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
