"""The lease a running task holds: one record, written by the worker into the request's
headers when it grants the slot, read back inside the task by :func:`current_lease` (and, for a
task under several semaphores, :func:`current_leases`: one lease per semaphore, each with its
own fencing token, all under one holder id).

The record carries no credential: the task reads its request (and may log it), so it holds the
backend's URL only with its password and tokens masked, for display. The lease reaches the
backend through the configuration of the task's own app (``semaphore_backend``, or the
broker or result backend it defaults to), as the worker does.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Tuple, Union

from celery import current_app, current_task

from . import pause_board
from .backends import get_backend
from .backends.base import Backend, FencingToken, Grant
from .backoff import Backoff
from .exceptions import ConfigurationError, LeaseLost
from .semaphore import Lease, LeaseGroup
from .urls import mask_url

logger = logging.getLogger(__name__)

#: The request header that carries the :class:`LeaseRecord`.
LEASE_KEY = "semaphore_lease"

@dataclass(frozen=True)
class LeaseRecord:
    """What a task needs to know of its lease: the semaphore, the holder id the backend
    knows it by, the fencing token, the key prefix, and which backend granted it
    (``backend``: its URL with the password and any token masked, :func:`.urls.mask_url`;
    never a credential, since task code can read and log its request). ``waited``: the task
    had to wait, so WAITING was stored for it and it stores STARTED when it runs."""

    name: str
    limit: Optional[int]
    holder: str
    slot: int
    epoch: int
    ttl: float
    backend: str
    key_prefix: str
    waited: bool = False
    #: The task's further semaphores, each ``{"name", "limit", "slot", "epoch"}`` (a task
    #: under several semaphores: :func:`current_leases`).
    others: Tuple[Dict[str, Any], ...] = ()
    #: When the worker asked for the grant (``time.monotonic()``, before the backend made
    #: it): a pause written on its pause board later stops it from starting.
    granted: Optional[float] = None

    def records(self) -> List["LeaseRecord"]:
        """One record per semaphore, this one first."""
        return [self] + [replace(self, name=o["name"], limit=o.get("limit"), slot=o["slot"],
                                 epoch=o["epoch"], others=()) for o in self.others or ()]

    def to_header(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_header(cls, header: Dict[str, Any]) -> "LeaseRecord":
        return cls(**{key: header[key] for key in cls.__dataclass_fields__
                      if key in header})

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.slot, self.epoch)


def lease_record_of(lease: Union[Lease, LeaseGroup], backend_url: str, key_prefix: str,
                    waited: bool = False) -> LeaseRecord:
    """The :class:`.LeaseRecord` a task reads its lease(s) from (``current_lease(s)``);
    ``backend_url`` is kept masked (:func:`.urls.mask_url`)."""
    leases = list(lease.leases.values()) if isinstance(lease, LeaseGroup) else [lease]
    first = leases[0]
    return LeaseRecord(
        first.name, first.limit, first.holder, first.token.slot, first.token.epoch, first.ttl,
        mask_url(backend_url), key_prefix, waited=waited,
        others=tuple({"name": other.name, "limit": other.limit, "slot": other.token.slot,
                      "epoch": other.token.epoch} for other in leases[1:]))


def lease_record_of_grants(grants: "Dict[str, Grant]", limits: "Dict[str, Optional[int]]",
                           holder: str, masked_url: str, key_prefix: str,
                           waited: bool = False, granted: Optional[float] = None
                           ) -> Dict[str, Any]:
    """The header form of the :class:`.LeaseRecord` of a holder's grants (name -> grant, the
    first semaphore first), as the worker writes it; ``masked_url``: the backend's URL, masked
    (:func:`.urls.mask_url`)."""
    (name, first), *rest = grants.items()
    return {"name": name, "limit": limits.get(name), "holder": holder, "slot": first.slot,
            "epoch": first.epoch, "ttl": first.ttl, "backend": masked_url,
            "key_prefix": key_prefix, "waited": waited, "granted": granted,
            "others": tuple({"name": other, "limit": limits.get(other), "slot": grant.slot,
                             "epoch": grant.epoch} for other, grant in rest)}


def lease_record(request: Any) -> Optional[LeaseRecord]:
    """The lease record of a task request (or its context), None for an unguarded one."""
    header = getattr(request, LEASE_KEY, None) if request is not None else None
    return LeaseRecord.from_header(header) if header else None


#: app -> its semaphore backend URL (with its password), read from its configuration once.
_backend_urls: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_backend_urls_lock = threading.Lock()


def configured_backend_url(app: Any) -> str:
    """The semaphore backend URL ``app``'s configuration names (the worker's own setting, as
    :class:`.worker.step.SemaphoreStep` reads it), read once per app."""
    with _backend_urls_lock:
        url = _backend_urls.get(app)
    if url is None:
        from .settings import Settings

        url = Settings.from_app(app).backend_url(app)
        with _backend_urls_lock:
            _backend_urls[app] = url
    return url


class TaskLease:
    """The slot the running task holds, as seen from inside the task body: ``name``,
    ``limit``, ``holder``, ``token`` (the fencing token), ``ttl``. It reaches the backend
    through ``app``'s configuration (the task's app), never through anything in the request."""

    def __init__(self, record: LeaseRecord, app: Any = None) -> None:
        self.name = record.name
        self.limit = record.limit
        self.holder = record.holder
        self.token = record.token
        self.ttl = record.ttl
        self._record = record
        self._app = app

    def _backend(self) -> Backend:
        app = self._app if self._app is not None else current_app
        url = configured_backend_url(app)
        if self._record.backend and mask_url(url) != mask_url(self._record.backend):
            raise ConfigurationError(
                f"the lease of semaphore {self.name!r} was granted by backend "
                f"{self._record.backend}, but this process's app is configured for "
                f"{mask_url(url)}: the worker and its pool must share one configuration")
        return get_backend(url, key_prefix=self._record.key_prefix)

    def pause_for(self, backoff: Backoff) -> bool:
        """Close this lease's semaphore for what is left of ``backoff``'s time (one round
        trip), as the worker's gate would once it heard of it: where the Backoff was raised,
        the pause reaches the backend right after the API's answer. False when there is
        nothing to close (no time given, a backend that cannot pause)."""
        seconds = backoff.remaining()
        if seconds is None:
            return False
        backend = self._backend()
        if "pause" not in backend.traffic_options:
            return False
        backend.pause(self.name, seconds, backoff.reason)
        return True

    def verify(self) -> bool:
        """Ask the backend (one round trip) whether the slot is still held."""
        return self._backend().verify(self.name, self.holder)

    def ensure(self) -> None:
        """Raise LeaseLost unless the slot is still held: call before a protected action."""
        if not self.verify():
            raise LeaseLost(f"the slot of semaphore {self.name!r} (token {self.token}) is lost")

    def settle(self, units: int) -> bool:
        """Say how many units of the rates and quotas the task actually spent (``units`` >=
        0), instead of the estimate it was admitted with (``semaphore_units``): the windows
        still open and the rates are refunded or overdrawn by the difference
        (:meth:`.Lease.settle`). Absolute and idempotent. Settles every semaphore the task
        holds (one holder for all of them, whichever lease of :func:`current_leases` is
        used). False when a slot is no longer held (nothing changed there)."""
        from .traffic import validate_settle_units

        units = validate_settle_units(units)
        backend = self._backend()
        return all([bool(backend.settle(name, self.holder, units))
                    for name in self._holders_names()])

    def _holders_names(self) -> List[str]:
        """Every semaphore this lease's holder holds: the running task's, when this is its
        lease; else those of this lease's record."""
        running = lease_record(getattr(current_task, "request", None))
        record = running if running is not None and running.holder == self.holder \
            else self._record
        return [one.name for one in record.records()]

    def __repr__(self) -> str:
        return f"<TaskLease {self.name!r} token={self.token} limit={self.limit}>"


def _task_app() -> Any:
    task = current_task
    return getattr(task, "app", None) if task is not None else None


def pause_where_raised(task: Any, backoff: Backoff) -> None:
    """``task``, run by a worker's pool, raised ``backoff`` (it ends its run): close the
    task's semaphore from here, at once, and mark ``backoff`` ``paused`` so that the gate,
    which hears of it a pool pipe and a loop turn later, does not pause again. Calls granted
    elsewhere in that gap would reach the API during the Retry-After it just gave. Any
    failure is logged and left to the gate (which pauses when the mark is missing)."""
    request = getattr(task, "request", None)
    record = lease_record(request)
    if (record is None or getattr(request, "is_eager", False) or backoff.seconds is None
            or backoff.paused):
        return
    try:
        backoff.paused = TaskLease(record, getattr(task, "app", None)).pause_for(backoff)
    except Exception as exc:
        logger.warning("celery-semaphore: pausing %r where the Backoff was raised failed "
                       "(the worker pauses it): %s", record.name, exc)
        return
    board = pause_board.board()
    left = backoff.remaining()
    if backoff.paused and board is not None and left:
        board.close(record.name, left)


def give_back_if_paused(task: Any) -> None:
    """Before a guarded request of a worker starts its body: raise a :class:`.Backoff`
    (``paused``, ``unstarted``: it closes nothing and reports no overload) when one of its
    semaphores was closed, on this worker's pause board, after its grant was asked for and
    is still closed. The gate gives the call back to wait, ahead of later arrivals."""
    request = getattr(task, "request", None)
    board = pause_board.board()
    if board is None or request is None or getattr(request, "is_eager", False):
        return
    record = lease_record(request)
    if record is None or record.granted is None:
        return
    for one in record.records():
        left = board.left(one.name, record.granted)
        if left is not None:
            exc = Backoff(left, reason=f"{one.name} was closed before this call started")
            exc.paused = exc.unstarted = True
            raise exc


def current_lease(name: Optional[str] = None) -> Optional[TaskLease]:
    """The lease of the task running in this process, or None outside a guarded task. A task
    under several semaphores: the lease of the first one listed, or of semaphore ``name``
    (None when the task does not hold that one)."""
    record = lease_record(getattr(current_task, "request", None))
    if record is None:
        return None
    if name is None:
        return TaskLease(record, _task_app())
    return current_leases().get(name)


def current_leases() -> Dict[str, TaskLease]:
    """Semaphore name -> lease, for every semaphore the running task holds (in the order its
    ``semaphore`` option lists them); empty outside a guarded task."""
    record = lease_record(getattr(current_task, "request", None))
    if record is None:
        return {}
    app = _task_app()
    return {r.name: TaskLease(r, app) for r in record.records()}
