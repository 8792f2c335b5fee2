"""The headers celery-semaphore itself writes on messages, read defensively where a request
enters the gate: any process can publish a task message, with any headers (a producer
without the library, another language, a replay tool), so none of them is trusted.

Where it is called: :meth:`.Gate._admit`, once the request's guard is resolved and before
anything reads these headers (:func:`check_gate_headers`); the doorbell task and the
``semaphore_parked`` broadcast check the lane they name with :func:`lane_or_none`.

Per header, what a bad value does:

* ``semaphore_requeues`` (the gate's requeue count: the backoff exponent and the reported
  attempt) and ``semaphore_first_wait`` (the Unix time the wait began: ``semaphore_max_wait``
  counts from it, and the backend's wait statistics): a bad value **fails the task**, naming
  the header (:class:`.InvalidHeader`), as a bad ``semaphore`` or ``semaphore_limit`` header
  does. Ignoring them would change when the task times out or how long it backs off, without
  a word. A first-wait time after the request reached this worker (a sender's clock ahead of
  the worker's) counts as "now" (:meth:`.Waiter.first_wait`).
* ``semaphore_parked``, ``semaphore_parked_by``, ``semaphore_route``: marks of a message pulled
  from a parking queue. On a request that did not come from a parking queue they mean nothing
  and are **removed** (a forged ``semaphore_parked`` would otherwise make the gate settle the
  message on the wrong channel, and leave it in the consumer channel's unacked set when the
  broker connection is lost). On a pulled one, ``semaphore_parked`` must name a valid lane and
  ``semaphore_route`` must be ``[exchange, routing key]`` (strings; the key may be null), or
  the task **fails**, naming the header: its retries and requeues would go nowhere. Any value
  of ``semaphore_parked_by`` is harmless (only whether it is present is read, to count a
  pulled task as parked by a worker rather than on send) and is left alone.
* ``semaphore_lease``: written by the gate into the request in the worker's own process when
  it grants the slot, and kept out of every message (:func:`.install._strip_gate_headers`). One
  that arrives in a message is forged or stale: it is **removed** from every request (guarded
  or not), so that ``current_lease()`` never shows a task a slot it does not hold.
* ``semaphore_doorbell`` (on the doorbell task) and the ``name`` of a ``semaphore_parked``
  broadcast: a lane that is not valid is **ignored** with a warning (there is no task to fail:
  the doorbell message is acked, the broadcast answers with an error).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ..exceptions import InvalidHeader, InvalidName
from ..names import validate_name
from ..task_lease import LEASE_KEY
from ..waiting_room import (
    FIRST_WAIT_HEADER,
    PARKED_BY_HEADER,
    PARKED_HEADER,
    ROUTE_HEADER,
    parking_queue_name,
    semaphore_of,
)

#: Message header the gate writes when it requeues a request (how many times it was requeued).
REQUEUES_HEADER = "semaphore_requeues"
#: Marks only a message pulled from a parking queue carries.
PULLED_MARKS = (PARKED_HEADER, PARKED_BY_HEADER, ROUTE_HEADER)


def _bad(request: Any, header: str, value: Any, wanted: str) -> InvalidHeader:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return InvalidHeader(
        f"task {getattr(request, 'name', '?')}: header {header!r} must be {wanted}, not {shown} "
        f"(celery-semaphore writes this header itself; was the message sent by a process "
        f"without it?)")


def requeues_of(request_dict: Dict[str, Any], request: Any = None) -> int:
    """The ``semaphore_requeues`` header: a non-negative int, 0 when absent; raises
    :class:`.InvalidHeader` naming it otherwise."""
    value = request_dict.get(REQUEUES_HEADER)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(request, REQUEUES_HEADER, value, "a whole number from 0 up")
    return value


def first_wait_of(request_dict: Dict[str, Any], request: Any = None) -> Optional[float]:
    """The ``semaphore_first_wait`` header: a finite, non-negative Unix time, None when
    absent; raises :class:`.InvalidHeader` naming it otherwise."""
    value = request_dict.get(FIRST_WAIT_HEADER)
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise _bad(request, FIRST_WAIT_HEADER, value, "a Unix time (seconds, a finite number)")
    return float(value)


def lane_or_none(value: Any) -> Optional[str]:
    """``value`` if it is a parking lane (a valid semaphore name, with ``"\\n<fair key>"``
    after it under ``semaphore_fair_by``), else None."""
    if not isinstance(value, str):
        return None
    try:
        validate_name(semaphore_of(value))
    except InvalidName:
        return None
    return value


def _route_ok(route: Any) -> bool:
    return (isinstance(route, (list, tuple)) and len(route) == 2
            and isinstance(route[0], str) and (route[1] is None or isinstance(route[1], str)))


def from_consumer(request: Any, consumer: Any) -> Optional[bool]:
    """Whether ``request`` was delivered by the consumer's own task channel (True) rather
    than pulled from a parking queue on the waiting room's connection (False); None when
    that cannot be told (no task consumer)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    channel = getattr(task_consumer, "channel", None)
    if channel is None:
        return None
    return getattr(request.message, "channel", None) is channel


def _route_back(request: Any, headers: Dict[str, Any]) -> None:
    """A message pulled from a parking queue and put back in its task queue (a Redis broker:
    :meth:`.ParkingLot._reroute`) still says it was delivered from its parking queue: its
    retries go where it was first routed (``semaphore_route``), as a pulled one's do."""
    lane = lane_or_none(headers.get(PARKED_HEADER))
    route: Any = headers.get(ROUTE_HEADER)
    if lane is None or not _route_ok(route) or not route[1]:
        return
    exchange, routing_key = str(route[0]), str(route[1])
    delivery = getattr(request, "delivery_info", None)
    if isinstance(delivery, dict) and str(delivery.get("routing_key") or "").endswith(
            parking_queue_name("", lane)):
        delivery.update(exchange=exchange, routing_key=routing_key)


def check_gate_headers(request: Any, guarded: bool, consumer: Any) -> None:
    """Check (guarded requests) and clean (every request) the gate's headers of a request
    entering the gate; see the module docstring for what each bad value does. Raises
    :class:`.InvalidHeader` naming the header for a request that must fail; changes nothing
    on a request it fails. Call it on the loop thread before anything else reads them."""
    request_dict = request.request_dict
    headers = getattr(request.message, "headers", None)
    if not isinstance(headers, dict):
        headers = {}
    drop = [LEASE_KEY] if LEASE_KEY in request_dict or LEASE_KEY in headers else []
    if guarded:
        requeues_of(request_dict, request)
        first_wait_of(request_dict, request)
        if from_consumer(request, consumer):
            _route_back(request, headers)
            drop += [key for key in PULLED_MARKS if key in headers or key in request_dict]
        elif PARKED_HEADER in headers:
            if lane_or_none(headers[PARKED_HEADER]) is None:
                raise _bad(request, PARKED_HEADER, headers[PARKED_HEADER],
                           "the parking lane it was pulled from (a semaphore name)")
            route = headers.get(ROUTE_HEADER)
            if route is not None and not _route_ok(route):
                raise _bad(request, ROUTE_HEADER, route, "[exchange, routing key] (strings)")
    for key in drop:
        request_dict.pop(key, None)
        headers.pop(key, None)
