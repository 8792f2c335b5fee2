"""Guarded tasks called eagerly (``task.apply()``, ``task_always_eager``) hold the semaphore too.

There is no worker gate on that path, so the calling thread blocks in :meth:`Semaphore.acquire`
(bounded by ``semaphore_max_wait``) around the task body, through Celery's ``task_prerun`` and
``task_postrun`` signals, which fire in the process that runs the body.
"""

from __future__ import annotations

import weakref
from typing import Any, Tuple

from .semaphore import Semaphore
from .settings import Settings
from .tasks import LEASE_KEY, Guards

_guards: "weakref.WeakKeyDictionary[Any, Tuple[Guards, str]]" = weakref.WeakKeyDictionary()
_LEASE_ATTR = "_celery_semaphore_lease"


def _guards_for(app: Any) -> Tuple[Guards, str]:
    cached = _guards.get(app)
    if cached is None:
        settings = Settings.from_app(app)
        cached = _guards[app] = (Guards(settings), settings.backend_url(app))
    return cached


def acquire_for_eager(task: Any) -> None:
    request = getattr(task, "request", None)
    if request is None or not request.is_eager or not getattr(task, "semaphore", None):
        return
    guards, url = _guards_for(task.app)
    guard = guards.resolve_call(task, request.args, request.kwargs, request.headers)
    if guard is None:
        return
    settings = guard.settings
    semaphore = Semaphore(guard.name, guard.limit, url, ttl=settings.lease_ttl,
                          poll_interval=settings.poll_interval, auto_renew=True,
                          key_prefix=settings.key_prefix)
    lease = semaphore.acquire(timeout=settings.max_wait, meta={"task_id": request.id,
                                                              "task": task.name})
    setattr(request, _LEASE_ATTR, lease)
    setattr(request, LEASE_KEY, {
        "name": lease.name, "limit": lease.limit, "holder": lease.holder,
        "slot": lease.token.slot, "epoch": lease.token.epoch, "ttl": lease.ttl,
        "backend": url, "key_prefix": settings.key_prefix,
    })


def release_for_eager(task: Any) -> None:
    request = getattr(task, "request", None)
    lease = getattr(request, _LEASE_ATTR, None)
    if lease is not None:
        setattr(request, _LEASE_ATTR, None)
        lease.release()
