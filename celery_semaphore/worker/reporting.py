"""What the worker tells the world about waiting requests: the ``task-waiting`` event (Flower
shows WAITING with the position), the ``WAITING`` state in the result backend, and the
``semaphore_requests`` remote-control command (``celery semaphore workers``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Protocol

from celery.worker.control import inspect_command

from ..states import WAITING_EVENT
from .claim import Claim, State
from .context import GateContext
from .outcomes import Outcomes

logger = logging.getLogger(__name__)


class Reporting:
    def __init__(self, ctx: GateContext, outcomes: Outcomes) -> None:
        self.ctx = ctx
        self.outcomes = outcomes

    def waiting(self, claim: Claim, position: Optional[int], limit: Any,
                parked: bool = False, until: Optional[float] = None) -> None:
        """``claim`` waits at ``position`` of the backend's queue, or in the parking queue:
        announce it (loop). A request under several semaphores: ``semaphore`` is the one whose
        queue it waits in, ``semaphores`` lists them all. ``until``: the Unix time a pause
        or a quota window lets it start (``waits_until``)."""
        fields = {"semaphore": claim.blocking or claim.guard.name, "limit": limit,
                  "position": position, "attempt": claim.requeues + 1}
        if claim.guard.multi:
            fields["semaphores"] = list(claim.guard.names)
        if claim.waits_for is not None:  # slots, units (costs in play), rate, quota, pause
            fields["waits_for"] = claim.waits_for
        if until is not None:
            fields["waits_until"] = until
        if claim.guard.cost != 1:
            fields["cost"] = claim.guard.cost
        if claim.guard.priority:
            fields["priority"] = claim.guard.priority
        if parked:
            fields["parked"] = True
        claim.request.send_event(WAITING_EVENT, **fields)
        self.outcomes.waiting(claim, fields, parked)

    def revoked_parked(self, task_id: str, task_name: str) -> None:
        """A parked task was revoked: announce it now, as Celery does for a request it holds
        (the message is discarded when pulled). Loop thread."""
        logger.info("celery-semaphore: discarding revoked parked task: %s[%s]", task_name,
                    task_id)
        self.event("task-revoked", task_id, terminated=False, signum=None, expired=False)
        self.outcomes.parked_outcome(task_id, task_name, "revoked", None)

    def failed_parked(self, task_id: str, task_name: str, exc: BaseException) -> None:
        """A parked task failed (``semaphore_max_wait`` ran out): announce it and store the
        failure now (its message waits in the parking queue: whoever pulls it fails it
        again, acking it). Loop thread."""
        logger.error("celery-semaphore: task %s[%s] failed: %s", task_name, task_id, exc)
        self.event("task-failed", task_id, exception=repr(exc), traceback="")
        self.outcomes.parked_outcome(task_id, task_name, "failure", exc)

    def event(self, kind: str, task_id: str, **fields: Any) -> None:
        dispatcher = getattr(self.ctx.consumer, "event_dispatcher", None)
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send(kind, uuid=task_id, **fields)


def snapshot(waiting: Iterable[Claim], held: Iterable[Claim], parked: Mapping[str, int],
             pulled: Mapping[str, int]) -> Dict[str, Any]:
    """What ``celery semaphore workers`` shows of one worker: the requests it holds waiting,
    those that run holding a slot, and per semaphore the requests it parked and pulled back
    since it started. Loop thread."""
    return {
        "waiting": [
            {"id": w.request.id, "task": w.request.name,
             "semaphore": w.blocking or w.guard.name,
             "semaphores": list(w.guard.names),
             "position": w.position, "queued": w.state is State.QUEUED,
             "waits_for": w.waits_for, "cost": w.guard.cost,
             "priority": w.guard.priority,
             "waited": round(time.monotonic() - w.entered, 3),
             "requeues": w.requeues}
            for w in waiting
        ],
        "held": [
            {"id": h.request.id, "task": h.request.name, "semaphore": h.guard.name,
             "semaphores": list(h.guard.names),
             "holder": h.holder, "token": str(next(iter(h.grants.values())).token),
             "tokens": {name: str(grant.token) for name, grant in h.grants.items()}}
            for h in held if h.guarded and h.grants
        ],
        "parked": dict(parked),
        "pulled": dict(pulled),
    }


class Inspectable(Protocol):
    """What the remote-control command reads of a worker's gate."""

    def snapshot(self) -> Dict[str, Any]: ...


@inspect_command(alias="semaphores")
def semaphore_requests(state: Any, **kwargs: Any) -> Any:
    """Requests this worker holds for a slot ("waiting") and runs with one ("held"); per
    semaphore, the requests it parked and pulled back since it started."""
    gate: Optional[Inspectable] = getattr(state.consumer, "semaphore_gate", None)
    if gate is None:
        return {"error": "celery-semaphore is not installed on this worker"}
    return gate.snapshot()
