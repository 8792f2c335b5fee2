"""The consumer bootstep that runs the gate, and the checks it makes at worker start."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.exceptions import ImproperlyConfigured

from .. import pause_board
from ..backends import get_backend
from ..backends.base import Backend
from ..exceptions import ConfigurationError
from ..guards import Guards, check_options, guarded_tasks
from ..limit_sources import describe_limit
from ..settings import Settings, lookup
from . import celery_internals
from .gate import Gate

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
        pause_board.create()  # before the pool forks: its processes share it
        # a heartbeat due as the broker goes away must not hold the event loop (and the gate)
        # for the whole outage
        celery_internals.bound_heartbeat_retries()
        # a delivery the broker recorded as it died must be known here, to be put back
        celery_internals.record_deliveries_first()
        self.announced = self.limits_checked = False
        consumer.semaphore_gate = self.gate

    def start(self, consumer: Any) -> None:
        celery_internals.keep_running_jobs_on_flush(consumer.pool)  # Celery < 5.6
        if not self.announced:
            self.announced = True
            logger.info("celery-semaphore: gate on, backend %r; guarded tasks: %s",
                        self.gate.backend, describe_guarded(consumer.app) or "none")
        try:
            self.gate.backend.ping()
        except Exception as exc:
            logger.warning("celery-semaphore: backend %r unreachable at start (guarded tasks "
                           "wait until it answers): %s", self.gate.backend, exc)
        else:
            if not self.limits_checked:  # a pinned limit this worker's code disagrees with
                self.limits_checked = True
                self.gate.limits.at_start(consumer.app)
        self.gate.start()

    def stop(self, consumer: Any) -> None:
        self.gate.stop()

    def shutdown(self, consumer: Any) -> None:
        self.gate.shutdown()


def check_tasks(app: Any, settings: Settings, backend: Backend) -> None:
    """Fail worker start on a task whose semaphore options are wrong, naming the task, on a
    lease TTL the backend would outlast (``Backend.max_lease_ttl``), naming the setting, or on
    a traffic option the backend cannot apply (``Backend.check_traffic``), naming both."""
    _check_lease_ttl(lookup(app, "semaphore_lease_ttl")[1], settings.lease_ttl, backend)
    for name, task in guarded_tasks(app).items():
        check_options({key: getattr(task, key) for key in dir(type(task))
                       if key in ("semaphore", "limit") or key.startswith("semaphore_")}, name)
        try:
            own = settings.for_task(task)
            _check_lease_ttl("semaphore_lease_ttl", own.lease_ttl, backend)
            backend.check_traffic(own.options_used(getattr(task, "limit", None)))
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {name}: {exc}") from None


def _check_lease_ttl(key: str, ttl: float, backend: Backend) -> None:
    if ttl > backend.max_lease_ttl:
        raise ConfigurationError(f"{key} ({ttl:g}s) must not exceed 15/16 of the backend's "
                                 f"idle_ttl ({backend.idle_ttl:g}s)")


def describe_guarded(app: Any) -> str:
    """``name (semaphore 'x', limit 4)`` for each guarded task, comma-separated (with its
    cost, rate and priority when not the defaults)."""
    settings = Settings.from_app(app)
    parts = []
    for name, task in guarded_tasks(app).items():
        described = []
        own = settings.for_task(task)
        for template, limit in Guards.declared_limits(task.semaphore,
                                                      getattr(task, "limit", None), own):
            kind = "template" if "{" in template else "semaphore"
            described.append(f"{kind} {template!r}, limit {describe_limit(limit)}")
        traffic = [f"{what} {value}" for what, value, default in (
            ("cost", own.cost, 1), ("rate", own.rate, None), ("priority", own.priority, 0))
            if value != default]
        parts.append(f"{name} ({'; '.join(described + traffic)})")
    return ", ".join(parts)
