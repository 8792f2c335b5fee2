"""celery-semaphore: cluster-wide named counting semaphores for Celery tasks."""

from .backends.base import FencingToken, SemaphoreStatus
from .exceptions import (
    BackendUnavailable,
    ConfigurationError,
    InvalidLimit,
    InvalidName,
    LeaseLost,
    SemaphoreError,
    SemaphoreTimeout,
    UnknownBackend,
    UnknownSemaphore,
)
from .semaphore import Lease, Semaphore
from .tasks import current_lease, task
from .worker import install

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "ConfigurationError",
    "FencingToken",
    "InvalidLimit",
    "InvalidName",
    "Lease",
    "LeaseLost",
    "Semaphore",
    "SemaphoreError",
    "SemaphoreStatus",
    "SemaphoreTimeout",
    "UnknownBackend",
    "UnknownSemaphore",
    "current_lease",
    "install",
    "task",
]
