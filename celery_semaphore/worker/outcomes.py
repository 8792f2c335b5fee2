"""Every result-backend write the gate makes for a request it holds, in one ordered component.

The gate writes three kinds of state for a task that has not run: ``WAITING`` while it waits
(:mod:`.reporting`), and the outcome it settles it with when it never runs: a failure (bad
template, ``semaphore_max_wait`` passed, ``semaphore_on_full="fail"``) or a skip
(``semaphore_on_full="skip"``, stored as revoked). All of them are written on the gate's one
I/O thread, in the order the loop asked for them, so:

* an outcome is never overwritten by a ``WAITING`` asked for before it (it is written first);
* a ``WAITING`` is written only while its waiter is still in the worker core, read just
  before the write (a waiter that left for the pool meanwhile may have stored ``STARTED``:
  the write is dropped), except the one that announces a parked task;
* the loop never waits for a result backend: it hands the write over and goes on; the
  request's message is acknowledged, and Celery told it is done, on the loop thread once
  the outcome is written (a worker killed in between leaves the message to be delivered
  again, and the outcome written again: at-least-once, as for any task).

No lock is held across a write.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from ..exceptions import SemaphoreFull
from ..guards import Guard
from ..signals import task_skipped
from ..states import SKIPPED_EVENT, SKIPPED_REASON, WAITING
from . import celery_internals
from .claim import Claim, State
from .context import GateContext

logger = logging.getLogger(__name__)


def stores_results(backend: Any) -> bool:
    """Whether ``backend`` (a Celery result backend) keeps states at all."""
    return (getattr(backend, "persistent", True)
            and type(backend).__name__ != "DisabledBackend")


class Outcomes:
    """See the module docstring. ``waiting``, ``fail`` and ``skip`` are called on the loop
    thread; the writes run on the I/O thread."""

    def __init__(self, ctx: GateContext) -> None:
        self.ctx = ctx

    def waiting(self, claim: Claim, fields: Dict[str, Any], parked: bool = False) -> None:
        """Write ``WAITING`` with ``fields`` for ``claim`` (unless its task ignores results)."""
        if not claim.request.ignore_result:
            self.ctx.io.call(self._write_waiting, claim, fields, parked)

    def _write_waiting(self, claim: Claim, fields: Dict[str, Any],
                       parked: bool) -> None:  # I/O thread
        if not parked and claim.state not in (State.LINED, State.QUEUED):
            return  # it left: it may run, or have run, and stored a later state
        request = claim.request
        backend = request.task.backend
        if not stores_results(backend):
            return
        try:
            backend.store_result(request.id, fields, WAITING, request=request._context)
        except Exception as exc:
            logger.debug("celery-semaphore: storing WAITING for %s failed: %s", request.id, exc)

    def fail(self, request: Any, exc: BaseException) -> None:
        """``request`` fails without running: log it, announce it, write the failure, then
        acknowledge its message."""
        logger.error("celery-semaphore: task %s[%s] failed: %s", request.name, request.id, exc)
        request.send_event("task-failed", exception=repr(exc), traceback="")
        self._write_then_settle(request, "failure", exc)

    def full(self, request: Any, guard: Guard, limit: Any,
             blocking: Optional[str] = None) -> None:
        """The one try of a request whose ``semaphore_on_full`` is ``skip`` or ``fail`` found
        its semaphore full (no free slot, others queued for one, or a twin of the task
        holding one; under several semaphores: ``blocking``, the one that refused it): skip
        or fail it, without running it."""
        policy = guard.settings.on_full
        name = blocking or guard.name
        why = (f"semaphore {name!r} is full (limit {limit}); "
               f"semaphore_on_full={policy!r}")
        if policy == "fail":
            return self.fail(request, SemaphoreFull(why))
        logger.info("celery-semaphore: task %s[%s] skipped: %s", request.name, request.id, why)
        request.send_event(SKIPPED_EVENT, semaphore=name, limit=limit, reason=why)
        try:
            task_skipped.send(sender=request.task, task_id=request.id, semaphore=name,
                              limit=limit, request=request)
        except Exception:  # a receiver's bug must not keep the message unacked
            logger.exception("celery-semaphore: a task_skipped receiver failed")
        self.skip(request, f"{SKIPPED_REASON}: {why}")

    def skip(self, request: Any, reason: str) -> None:
        """``request`` is skipped (stored as revoked with ``reason``); its message acked once
        the state is written. The caller announces it."""
        self._write_then_settle(request, "revoked", reason)

    def _write_then_settle(self, request: Any, outcome: str, detail: Any) -> None:
        self.ctx.io.call(self._write, request, outcome, detail, self._settle)

    def _write(self, request: Any, outcome: str, detail: Any,
               then: Optional[Callable[[Any], None]]) -> None:  # I/O thread
        try:
            if outcome == "failure":
                request.task.backend.mark_as_failure(
                    request.id, detail, request=request._context,
                    store_result=request.store_errors)
            else:
                request.task.backend.mark_as_revoked(
                    request.id, detail, request=request._context,
                    store_result=request.store_errors)
        except Exception as store_exc:
            logger.warning("celery-semaphore: storing the %s of %s failed: %s", outcome,
                           request.id, store_exc)
        if then is not None:
            self.ctx.loop.post(then, request)

    def _settle(self, request: Any) -> None:  # loop thread
        request.acknowledge()
        celery_internals.task_ready(request)

    def parked_outcome(self, task_id: str, task_name: str, outcome: str,
                       exc: Optional[BaseException]) -> None:
        """Write the outcome of a task parked in the waiting room (``"revoked"`` or
        ``"failure"``): its message is settled by whoever pulls it."""
        self.ctx.io.call(self._write_parked, task_id, task_name, outcome, exc)

    def _write_parked(self, task_id: str, task_name: str, outcome: str,
                      exc: Optional[BaseException]) -> None:  # I/O thread
        task = self.ctx.app.tasks.get(task_name)
        backend = task.backend if task is not None else self.ctx.app.backend
        try:
            if outcome == "revoked":
                backend.mark_as_revoked(task_id, "revoked")
            else:
                backend.mark_as_failure(task_id, exc)
        except Exception as store_exc:
            logger.warning("celery-semaphore: storing %s for %s failed: %s", outcome, task_id,
                           store_exc)
