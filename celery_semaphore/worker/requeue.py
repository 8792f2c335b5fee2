"""Requeue: a request the worker will not keep waiting goes back to the broker as a copy with
a backoff ETA (the original is acknowledged once the copy is published: at-least-once, never
lost, possibly delivered twice if the worker dies in between). Requeues do not count against
``max_retries``; the copy carries the requeue count and the first-wait time in its headers."""

from __future__ import annotations

import logging
import random
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Optional

from ..waiting_room import FIRST_WAIT_HEADER, PARKED_BY_HEADER, PARKED_HEADER, ROUTE_HEADER
from . import celery_internals
from .claim import Claim
from .context import GateContext
from .headers import REQUEUES_HEADER
from .tally import Tally

logger = logging.getLogger(__name__)


def backoff(claim: Claim) -> float:
    """Seconds until the requeued copy is due: ``semaphore_retry_backoff`` doubling per
    requeue up to ``semaphore_retry_backoff_max``, with jitter if ``semaphore_retry_jitter``."""
    settings = claim.guard.settings
    delay: float = min(settings.retry_backoff * 2 ** min(claim.requeues, 64),
                       settings.retry_backoff_max)
    if settings.retry_jitter:
        delay = random.uniform(delay / 2, delay)
    return delay


def publish_copy(producer: Any, request: Any, exchange: str, routing_key: Optional[str],
                 headers: Dict[str, Any], **options: Any) -> None:
    """Publish a copy of ``request``'s message (its body, content type, reply address,
    priority and delivery mode, persistent unless given) with ``headers`` added to or
    replacing its own; a header given as None is removed (an ``eta`` of None: no ETA)."""
    message = request.message
    merged = {**message.headers, **headers}
    for key, value in headers.items():  # None: remove the header
        if value is None:
            merged.pop(key, None)
    properties = message.properties or {}
    options.setdefault("delivery_mode", properties.get("delivery_mode", 2))
    producer.publish(
        message.body, exchange=exchange, routing_key=routing_key, headers=merged,
        content_type=message.content_type, content_encoding=message.content_encoding,
        correlation_id=properties.get("correlation_id"), reply_to=properties.get("reply_to"),
        priority=(request.delivery_info or {}).get("priority"), **options)


class Requeue:
    def __init__(self, ctx: GateContext, tally: Tally) -> None:
        self.ctx = ctx
        self.tally = tally

    def requeue(self, claim: Claim, countdown: Optional[float] = None) -> None:
        """Publish a copy of the message of ``claim`` (which left the core) with a backoff
        ETA, then ack the original (loop). Only for what the waiting room cannot take (the
        broker refused the parked copy, no lane for its queue, a priority request held past
        ``semaphore_worker_max_hold``)."""
        if countdown is None:
            countdown = backoff(claim)
        self.ctx.in_transit.add(claim.request.message.delivery_tag)
        logger.warning("celery-semaphore: requeueing %s with a backoff of %.2fs: the waiting "
                       "room could not take it", claim.request.id, countdown)
        self.ctx.io.call(self._republish, claim, countdown)

    def _republish(self, claim: Claim, countdown: float) -> None:  # I/O thread
        request = claim.request
        delivery = request.delivery_info or {}
        eta = (datetime.now(timezone.utc) + timedelta(seconds=countdown)).isoformat()
        try:
            with self.ctx.app.producer_or_acquire() as producer:
                publish_copy(producer, request, delivery.get("exchange") or "",
                             delivery.get("routing_key"),
                             {REQUEUES_HEADER: claim.requeues + 1,
                              FIRST_WAIT_HEADER: claim.first_wait, "eta": eta,
                              # a pulled request's copy goes to its task queue: unparked
                              PARKED_HEADER: None, PARKED_BY_HEADER: None, ROUTE_HEADER: None},
                             retry=True, retry_policy={"max_retries": 3})
        except Exception as exc:
            logger.warning("celery-semaphore: requeue of %s failed, rejecting for redelivery: %s",
                           request.id, exc)
            self.ctx.loop.post(self._settle, claim, False)
            return
        self.ctx.loop.post(self._settle, claim, True)

    def _settle(self, claim: Claim, republished: bool) -> None:
        request = claim.request
        self.ctx.in_transit.discard(request.message.delivery_tag)
        if republished:
            self.tally.add(claim.guard.name, "requeued")
            request.acknowledge()
        else:
            request.reject(requeue=True)
        celery_internals.task_ready(request)
