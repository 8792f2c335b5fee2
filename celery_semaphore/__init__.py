"""celery-semaphore: cluster-wide named counting semaphores for Celery tasks."""

from typing import Any

from . import autoinstall  # noqa: F401 -- connects the worker_init receiver
from .backends.base import FencingToken, SemaphoreStatus
from .backoff import Adaptive, Backoff
from .exceptions import (
    BackendUnavailable,
    BrokerUnavailable,
    ConfigurationError,
    InvalidHeader,
    InvalidLimit,
    InvalidName,
    LeaseLost,
    NotHeld,
    SemaphoreError,
    SemaphoreFull,
    SemaphoreTimeout,
    UnknownBackend,
    UnknownSemaphore,
)
from .guards import task
from .semaphore import Lease, LeaseGroup, Semaphore, acquire_all, try_acquire_all
from .task_lease import current_lease, current_leases


def install(app: Any) -> Any:
    """Install celery-semaphore into ``app`` (idempotent) and return ``app``: the worker gate
    (a consumer bootstep), ``WAITING`` ranked for Flower, eager calls guarded, and semaphore
    options checked where tasks are defined and sent. Loads the worker machinery."""
    from .worker import install as install_worker_side

    return install_worker_side(app)

__version__ = "0.1.0"

__all__ = [
    "Adaptive",
    "BackendUnavailable",
    "Backoff",
    "BrokerUnavailable",
    "ConfigurationError",
    "FencingToken",
    "InvalidHeader",
    "InvalidLimit",
    "InvalidName",
    "Lease",
    "LeaseGroup",
    "LeaseLost",
    "NotHeld",
    "Semaphore",
    "SemaphoreError",
    "SemaphoreFull",
    "SemaphoreStatus",
    "SemaphoreTimeout",
    "UnknownBackend",
    "UnknownSemaphore",
    "acquire_all",
    "current_lease",
    "current_leases",
    "install",
    "task",
    "try_acquire_all",
]
