"""The worker side: the gate bootstep and what it is made of. Loaded by :func:`install` only,
so that the client API (``from celery_semaphore import Semaphore``) stays light."""

from .install import install
from .step import SemaphoreStep

__all__ = ["SemaphoreStep", "install"]
