"""Guarded tasks called eagerly (``task.apply()``, ``task_always_eager``) hold the semaphore too.

There is no worker gate on that path, so the calling thread blocks in :meth:`Semaphore.acquire`
(bounded by ``semaphore_max_wait``) before the body and releases after it:

* acquire in ``before_start``, which :func:`guard_eager_calls` gives the app's ``Task`` class:
  an exception there (``SemaphoreTimeout``, ``BackendUnavailable``, a template the call cannot
  fill) fails the call like one from the body, which then does not run;
* release in the ``task_postrun`` signal, which fires on every ending of the call.

A task whose class does not reach that ``before_start`` (a ``base=`` that is not the app's
``Task``, or its own ``before_start`` that does not call ``super()``) acquires in
``task_prerun`` instead, where Celery only logs an exception: a failed acquire is logged and
the body runs without a slot. Call ``super().before_start(...)`` from such a method.

``semaphore_on_full`` ``skip`` or ``fail``: one try instead of a wait; a full semaphore raises
``SemaphoreFull`` (``fail``) or ``celery.exceptions.Ignore`` (``skip``: the call's state is
``IGNORED``, its body does not run).

A body that raises :class:`.Backoff` closes its semaphore for the Backoff's time (before the
release), releases reporting overload, and runs again once the semaphore reopens, its acquire
queued ahead of later arrivals, within ``semaphore_max_wait`` counted from the first wait
(``Task.apply``, which :func:`guard_eager_calls` wraps, calls it again). Every release reports
the call's outcome (``ok``, ``overload``, ``error``): an adaptive limit learns from it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Optional, Tuple

from celery import states
from celery.exceptions import Ignore

from .backoff import Backoff, outcome_of
from .exceptions import SemaphoreFull
from .guards import Guards
from .semaphore import Semaphore, acquire_all, try_acquire_all
from .settings import Settings
from .signals import task_skipped
from .states import SKIPPED_REASON
from .task_lease import LEASE_KEY, give_back_if_paused, lease_record_of

logger = logging.getLogger(__name__)

_guards: "weakref.WeakKeyDictionary[Any, Tuple[str, Guards, str]]" = weakref.WeakKeyDictionary()
_LEASE_ATTR = "_celery_semaphore_lease"
_GUARD_ATTR = "_celery_semaphore_eager_guard"


def _guards_for(app: Any) -> Tuple[Guards, str]:
    """The app's guards and backend URL, read again when a setting they come from was
    changed on ``app.conf`` (``app.conf.semaphore_backend = ...`` in a test, as
    :mod:`celery_semaphore.testing` does); settings read from a configuration object are
    read once."""
    key = repr([(k, v) for k, v in app.conf.changes.items() if isinstance(k, str) and (
        "semaphore_" in k.lower() or k in ("broker_url", "result_backend"))])
    cached = _guards.get(app)
    if cached is None or cached[0] != key:
        settings = Settings.from_app(app)
        cached = _guards[app] = (key, Guards(settings), settings.backend_url(app))
    return cached[1], cached[2]


#: The eager call this thread runs again after a Backoff: (when it first waited, Unix time).
_again = threading.local()


def guard_eager_calls(app: Any) -> None:
    """Give ``app.Task`` a ``before_start`` that acquires for eager calls, and an ``apply``
    that runs a call again after a Backoff (idempotent)."""
    base = app.Task
    if getattr(base.__dict__.get("before_start"), _GUARD_ATTR, False):
        return

    def before_start(self: Any, task_id: str, args: Any, kwargs: Any) -> None:
        acquire_for_eager(self)
        give_back_if_paused(self)  # a worker's run granted before its semaphore closed
        super(base, self).before_start(task_id, args, kwargs)

    original_apply = base.apply

    def apply(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        result = original_apply(self, args, kwargs, **options)
        if not getattr(self, "semaphore", None):
            return result
        first_wait = time.time()
        while result.state == states.IGNORED and isinstance(result.result, Backoff):
            # given back: it waits for its semaphore to reopen, ahead of later arrivals
            options["task_id"] = result.id
            _again.first_wait = first_wait
            try:
                result = original_apply(self, args, kwargs, **options)
            finally:
                _again.first_wait = None
        return result

    setattr(before_start, _GUARD_ATTR, True)
    base.before_start = before_start
    base.apply = apply


def acquires_in_before_start(task: Any) -> bool:
    """True when the ``before_start`` that runs for ``task`` is the eager guard itself. An
    override may or may not call ``super()``: then ``task_prerun`` acquires, and the guard,
    if reached, finds the lease already taken."""
    return getattr(getattr(type(task), "before_start", None), _GUARD_ATTR, False)


def acquire_for_eager(task: Any) -> None:
    request = getattr(task, "request", None)
    if request is None or not request.is_eager or not getattr(task, "semaphore", None):
        return
    if getattr(request, _LEASE_ATTR, None) is not None:
        return  # acquired already (task_prerun, for a class without the guard)
    guards, url = _guards_for(task.app)
    guard = guards.resolve_call(task, request.args, request.kwargs, request.headers)
    if guard is None:
        return
    settings = guard.settings
    semaphores = [Semaphore(name, guard.adaptive if i == 0 and guard.adaptive else limit, url,
                            ttl=settings.lease_ttl, poll_interval=settings.poll_interval,
                            auto_renew=True, key_prefix=settings.key_prefix)
                  for i, (name, limit) in enumerate(guard.pairs)]
    first_wait: Optional[float] = getattr(_again, "first_wait", None)
    meta = {"task_id": request.id, "task": task.name,
            **guard.traffic_meta(front=first_wait is not None)}
    timeout = settings.max_wait
    if timeout is not None and first_wait is not None:  # bounds the whole wait
        timeout = max(0.0, timeout - (time.time() - first_wait))
    lease: Any
    if settings.on_full == "wait":
        if guard.multi:
            lease = acquire_all(semaphores, timeout=timeout, meta=meta, fair_key=guard.fair)
        else:
            lease = semaphores[0].acquire(timeout=timeout, meta=meta, fair_key=guard.fair)
    else:
        if guard.multi:
            lease = try_acquire_all(semaphores, meta=meta, fair_key=guard.fair)
        else:
            lease = semaphores[0].try_acquire(meta=meta, fair_key=guard.fair)
        if lease is None:
            full = next((s for s in semaphores if _is_full(s)), semaphores[0])
            _full(task, request, full.name, full.status().limit, settings.on_full)
    setattr(request, _LEASE_ATTR, lease)
    setattr(request, LEASE_KEY, lease_record_of(lease, url, settings.key_prefix).to_header())


def _is_full(semaphore: Semaphore) -> bool:
    status = semaphore.status()
    return status.held + status.waiting >= status.limit


def _full(task: Any, request: Any, name: str, limit: int, policy: str) -> None:
    """An eager call whose semaphore is full: raise SemaphoreFull (``fail``), or Ignore
    (``skip``: the call ends IGNORED, its body not run, after a log line and the
    ``task_skipped`` signal)."""
    why = f"semaphore {name!r} is full (limit {limit}); semaphore_on_full={policy!r}"
    if policy == "fail":
        raise SemaphoreFull(why)
    logger.info("celery-semaphore: eager call of %s[%s] skipped: %s", task.name, request.id, why)
    task_skipped.send(sender=task, task_id=request.id, semaphore=name, limit=limit,
                      request=None)
    raise Ignore(f"{SKIPPED_REASON}: {why}")


def release_for_eager(task: Any, retval: Any = None, state: Optional[str] = None) -> None:
    """Release an eager call's lease as it ends (``task_postrun``: its return value or the
    exception it raised, and its state), reporting the call's outcome; a :class:`.Backoff`
    closes the semaphore for its time first."""
    request = getattr(task, "request", None)
    lease = getattr(request, _LEASE_ATTR, None)
    if lease is None:
        return
    setattr(request, _LEASE_ATTR, None)
    exc = retval if isinstance(retval, BaseException) and state != states.SUCCESS else None
    if isinstance(exc, Backoff):
        seconds = exc.remaining()
        if seconds:
            try:
                lease.backend.pause(lease.name, seconds, exc.reason)
            except Exception as error:  # the call still goes back: it tries again at once
                logger.warning("celery-semaphore: pausing %r after a Backoff failed: %s",
                               lease.name, error)
        lease.release(outcome="overload")
        return
    lease.release(outcome=outcome_of(exc, getattr(lease, "adaptive", None)))
