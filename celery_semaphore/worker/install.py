"""``install(app)``: the worker side (the gate's bootstep, the remote-control command), eager
calls guarded, and the signal receivers that keep task states and published headers right."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

from celery import signals
from celery import states as celery_states

from .. import states
from ..backoff import Backoff
from ..eager import (
    acquire_for_eager,
    acquires_in_before_start,
    guard_eager_calls,
    release_for_eager,
)
from ..guards import INSTALLED, check_definitions_and_sends
from ..task_lease import lease_record, pause_where_raised
from ..waiting_room import (
    DOORBELL_TASK,
    FIRST_WAIT_HEADER,
    PARKED_HEADER,
    ROUTE_HEADER,
    park_on_send,
    parking_now,
)
from . import reporting  # noqa: F401 -- registers the semaphore_requests inspect command
from .claim import GATE_HEADERS
from .step import SemaphoreStep

logger = logging.getLogger(__name__)


def install(app: Any) -> Any:
    """Install celery-semaphore into ``app`` (idempotent); returns ``app``.

    Adds the consumer step (the gate) and makes ``WAITING`` rank between ``RECEIVED`` and
    ``STARTED`` for Celery's event state (Flower); guarded sends go straight to the waiting
    room (:mod:`celery_semaphore.waiting_room`), whose doorbell task it registers.
    """
    if getattr(app, INSTALLED, False):
        return app
    states.register_precedence()
    states.register_event_fields()
    app.steps["consumer"].add(SemaphoreStep)
    guard_eager_calls(app)
    check_definitions_and_sends(app)
    app.task(name=DOORBELL_TASK, shared=False, ignore_result=True,
             Strategy="celery_semaphore.worker.parking:doorbell_strategy")(_doorbell)
    park_on_send(app)
    signals.task_prerun.connect(_eager_acquire, weak=False, dispatch_uid="celery_semaphore_pre")
    signals.task_postrun.connect(_eager_release, weak=False, dispatch_uid="celery_semaphore_post")
    signals.task_postrun.connect(_pause_where_raised, weak=False,
                                 dispatch_uid="celery_semaphore_backoff")
    signals.task_prerun.connect(_store_started, weak=False,
                                dispatch_uid="celery_semaphore_started")
    signals.before_task_publish.connect(_strip_gate_headers, weak=False,
                                        dispatch_uid="celery_semaphore_publish")
    setattr(app, INSTALLED, True)
    return app


def _doorbell(name: str) -> None:
    """A semaphore has parked tasks. Workers with the gate handle this message in their main
    process (:func:`.parking.doorbell_strategy`) and never run it; this body runs only on a
    worker without the gate, where it has nothing to do."""


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
    if (lease is None or request is None or not lease.waited or request.is_eager
            or task.track_started or task.ignore_result):
        return
    try:
        task.backend.store_result(task_id, {"pid": os.getpid(), "hostname": request.hostname},
                                  celery_states.STARTED, request=request)
    except Exception as exc:
        logger.warning("celery-semaphore: storing STARTED for %s failed: %s", task_id, exc)


def _strip_gate_headers(headers: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
    """Keep what the gate adds to a running request out of messages it publishes: a retry
    copies the request's custom headers, and would carry the lease record and the requeue
    count and first-wait time (so ``semaphore_max_wait`` would count from the first run's
    wait). A send parked on send keeps the marks it was just given."""
    if headers:
        parking = parking_now.get()
        for key in GATE_HEADERS:
            if parking is None or parking != headers.get(PARKED_HEADER) or key not in (
                    PARKED_HEADER, FIRST_WAIT_HEADER, ROUTE_HEADER):
                headers.pop(key, None)


def _pause_where_raised(sender: Any = None, task: Any = None, retval: Any = None,
                        **kwargs: Any) -> None:
    """A guarded task run by a worker ended with a :class:`.Backoff` that gives a time: its
    semaphore closes from the pool process, before the result travels to the gate
    (:func:`.task_lease.pause_where_raised`)."""
    if isinstance(retval, Backoff) and retval.seconds is not None:
        pause_where_raised(task, retval)


def _eager_release(sender: Any = None, task: Any = None, retval: Any = None,
                   state: Any = None, **kwargs: Any) -> None:
    release_for_eager(task, retval, state)
