"""``celery -A proj semaphore ...``: inspect and change semaphores from the command line.

Registered through the ``celery.commands`` entry point group; ``python manage.py semaphore``
(:mod:`celery_semaphore.contrib.django`) runs the same click group. Every subcommand takes
``--json``. Exit codes: 0 ok, 1 operational failure (unknown semaphore, holder not holding,
backend or broker unreachable), 2 usage error. Errors are one line on stderr and change nothing.

The operations themselves are the small functions below the exceptions: each takes a backend
(``workers``: an app) and returns JSON-ready data, so code can call them without click.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import sys
import time
from types import FrameType
from typing import (
    IO,
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    cast,
)
from urllib.parse import urlsplit

import click

from .backends import get_backend
from .backends.base import Backend, SemaphoreStatus, cost_of, priority_of
from .backoff import check_reason, parse_http_date, parse_iso_datetime
from .exceptions import (
    BrokerUnavailable,
    ConfigurationError,
    InvalidLimit,
    InvalidName,
    NotHeld,
    SemaphoreError,
    UnknownSemaphore,
)
from .metrics import learned_of, pause_of, rate_text, rates_of, windows_of
from .names import validate_limit, validate_name
from .settings import Settings
from .urls import mask_url

# -- operations: a backend in, JSON-ready data out -----------------------------------------


def list_semaphores(backend: Backend) -> List[Dict[str, Any]]:
    """Every semaphore the backend knows: ``name``, ``limit``, ``pinned`` (by ``resize``),
    ``declared`` (the limits callers declared lately, sorted), ``held``, ``units``,
    ``waiting``, ``paused_until`` (backend epoch seconds, None when not paused) and
    ``pause_reason``, ``quotas`` (each window now: :func:`quota_rows`) and ``adaptive`` (the
    learned limit: :func:`adaptive_row`; None when the limit is not learned)."""
    rows = []
    for name in backend.names():
        status = backend.status(name)
        if status is not None:  # reset or expired since names() listed it
            paused_until, reason = pause_of(status)
            rows.append({"name": name, "limit": status.limit, "pinned": status.pinned,
                         "declared": sorted(status.declared), "held": status.held,
                         "units": status.units, "waiting": status.waiting,
                         "paused_until": paused_until, "pause_reason": reason,
                         "quotas": quota_rows(status), "adaptive": adaptive_row(status)})
    return rows


def quota_rows(status: SemaphoreStatus) -> List[Dict[str, Any]]:
    """Each quota window of ``status`` now: ``window`` (as written per: ``h``, ``d``,
    ``5s``, ``mo``), ``count``, ``used`` (above ``count``: a debt), ``window_start`` and
    ``window_end`` (backend epoch seconds)."""
    return [{"window": w.label, "count": w.count, "used": w.used, "window_start": w.start,
             "window_end": w.end} for w in windows_of(status)]


def adaptive_row(status: SemaphoreStatus) -> Optional[Dict[str, Any]]:
    """The learned limit of ``status``: ``min``, ``max``, ``current`` (the limit in force is
    its floor), ``pinned``; None when the limit is not learned."""
    learned = learned_of(status)
    if learned is None:
        return None
    return {"min": learned.min, "max": learned.max, "current": learned.current,
            "pinned": learned.pinned}


def semaphore_status(backend: Backend, name: str) -> SemaphoreStatus:
    """The snapshot of ``name``; raise UnknownSemaphore when the backend does not know it."""
    status = backend.status(validate_name(name))
    if status is None:
        raise UnknownSemaphore(f"unknown semaphore {name!r} in {where(backend)}")
    return status


def resize_semaphore(backend: Backend, name: str, limit: int) -> Dict[str, Any]:
    """Set the limit of ``name`` and pin it (declared limits no longer change it), creating
    it. ``previous`` is None when it was created."""
    validate_name(name)
    validate_limit(limit)
    before = backend.status(name)
    created = backend.resize(name, limit)
    previous = None if before is None or created else before.limit
    return {"name": name, "limit": limit, "previous": previous, "created": created,
            "pinned": True}


def unpin_semaphore(backend: Backend, name: str) -> Dict[str, Any]:
    """Release the pin of ``name``: the newest declared limit is in force again. ``limit``
    is the limit in force after it, ``was_pinned`` whether there was a pin to release."""
    before = semaphore_status(backend, name)
    limit = backend.unpin(name)
    if limit is None:  # reset or expired meanwhile
        raise UnknownSemaphore(f"unknown semaphore {name!r} in {where(backend)}")
    return {"name": name, "limit": limit, "previous": before.limit,
            "was_pinned": before.pinned, "pinned": False}


def release_holder(backend: Backend, name: str, holder: str) -> Dict[str, Any]:
    """Force-release a holder of ``name``, named by its holder id or by its task id."""
    status = semaphore_status(backend, name)
    ids = {h.holder for h in status.holders}
    if holder not in ids:
        by_task = [h.holder for h in status.holders if h.meta.get("task_id") == holder]
        if len(by_task) == 1:
            (holder,) = by_task
        elif by_task:
            raise NotHeld(f"task id {holder} matches {len(by_task)} holders of semaphore "
                          f"{name!r}: pass a holder id ({', '.join(sorted(by_task))})")
    entry = next((h for h in status.holders if h.holder == holder), None)
    if entry is None or not backend.release(name, holder):
        raise NotHeld(f"{holder} holds no slot of semaphore {name!r}")
    return {"name": name, "holder": holder, "task_id": entry.meta.get("task_id"),
            "token": str(entry.token), "released": True}


def pause_semaphore(backend: Backend, name: str, seconds: float,
                    reason: str = "") -> Dict[str, Any]:
    """Close ``name`` for ``seconds`` from the backend's now (no acquire admitted; holders
    keep their slots), creating its state if it has none. A pause in force that ends later is
    kept: ``kept`` is then True. ``paused_until``: the end in force (backend epoch
    seconds)."""
    validate_name(name)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 <= seconds < math.inf):
        raise ConfigurationError(f"a pause must last a finite number of seconds >= 0, "
                                 f"not {seconds!r}")
    reason = check_reason(reason)
    before = backend.status(name)
    earlier_end = None if before is None else pause_of(before)[0]
    end = float(backend.pause(name, float(seconds), reason))
    kept = earlier_end is not None and end == earlier_end and seconds > 0
    return {"name": name, "paused_until": end, "seconds": float(seconds), "reason": reason,
            "kept": kept}


def resume_semaphore(backend: Backend, name: str) -> Dict[str, Any]:
    """Lift the pause of ``name``. ``resumed`` is False when none was in force."""
    validate_name(name)
    return {"name": name, "resumed": bool(backend.resume(name))}


def reset_semaphore(backend: Backend, name: str) -> Dict[str, Any]:
    """Delete all state of ``name``. ``reset`` is False when it was unknown."""
    return {"name": name, "reset": backend.reset(validate_name(name))}


def compare_limits(backend: Backend, limits: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The names of ``limits`` (``semaphore_limits``) whose limit in force is not the
    configured one, each with ``configured``, ``limit`` (None: the backend does not know the
    name yet; the first acquire creates it with the declared limit) and ``pinned``. Changes
    nothing: declared limits take effect on their own (the newest declaration is in force),
    except where ``resize`` pinned one. Templates (``"api:{customer_id}"``) and learned limits
    (:class:`.Adaptive`) are skipped."""
    differences = []
    for name, limit in sorted(limits.items()):
        if "{" in name or not isinstance(limit, int):  # a template, or a learned limit
            continue
        current = backend.status(name)
        if current is not None and current.limit == limit:
            continue
        differences.append({"name": name, "configured": limit,
                            "limit": None if current is None else current.limit,
                            "pinned": current is not None and current.pinned})
    return differences


def worker_requests(app: Any, timeout: float = 2.0,
                    destination: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """worker name -> ``{"waiting": [...], "held": [...]}`` from the ``semaphore_requests``
    remote-control command; raise BrokerUnavailable when the broker does not answer."""
    conn = app.connection_for_write()
    try:
        conn.ensure_connection(max_retries=0)  # fail now rather than retry for minutes
        replies = app.control.broadcast("semaphore_requests", reply=True, timeout=timeout,
                                        connection=conn, destination=destination or None)
    except Exception as exc:
        raise BrokerUnavailable(f"cannot reach the broker {conn.as_uri()}: {exc}") from exc
    finally:
        conn.release()
    merged: Dict[str, Any] = {}
    for reply in replies or []:
        merged.update(reply)
    return dict(sorted(merged.items()))


# -- rendering ------------------------------------------------------------------------------


def relative(t: float, now: float) -> str:
    """``"12s ago"`` / ``"in 48s"``; minutes, hours and days for longer spans."""
    delta = t - now
    span = abs(delta)
    if span < 120:
        text = f"{span:.0f}s"
    elif span < 2 * 3600:
        text = f"{span / 60:.0f}m"
    elif span < 2 * 86400:
        text = f"{span / 3600:.0f}h"
    else:
        text = f"{span / 86400:.0f}d"
    return f"in {text}" if delta > 0 else f"{text} ago"


def utc_time(t: float) -> str:
    """``2026-05-09 14:00:00 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
          right: Iterable[int] = (), indent: str = "") -> List[str]:
    """Lines of an aligned table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in [list(headers)] + cells) for i in range(len(headers))]
    right = set(right)

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers)] + [line(r) for r in cells]


def render_status(status: SemaphoreStatus, now: Optional[float] = None,
                  parked: Optional[int] = None) -> str:
    now = time.time() if now is None else now
    declared = ", ".join(
        f"{k} ({'newest, ' if k == status.newest_declared else ''}{relative(seen, now)})"
        for k, seen in sorted(status.declared.items())) or "none seen"
    pinned = " (pinned by resize)" if status.pinned else ""
    learned = learned_of(status)
    if learned is not None:
        pinned = (f" (learned {learned.current:.4g} within {learned.min}..{learned.max}"
                  + ("; pinned by resize: learning stopped)" if learned.pinned else ")"))
    lines = [
        f"semaphore {status.name}",
        f"  limit     {status.limit}{pinned}",
        f"  declared  {declared}",
        f"  held      {status.held}",
        f"  waiting   {status.waiting}",
    ]
    if status.units != status.held:
        lines.insert(5, f"  units     {status.units} of {status.limit} (holders' costs)")
    paused_until, reason = pause_of(status)
    if paused_until is not None:
        left = "ending now" if paused_until <= now else relative(paused_until, now)
        lines.insert(1, f"  PAUSED    until {utc_time(paused_until)} ({left})"
                        + (f": {reason}" if reason else "")
                        + "; `resume` lifts it")
    rates = rates_of(status)
    if rates:
        due = status.next_start
        lines.append(f"  {'rate ' if len(rates) == 1 else 'rates'}     "
                     + "; ".join(f"{rate_text(interval)}, burst {burst}"
                                 for interval, burst in rates)
                     + "; next start " + ("now" if due is None or due <= now
                                          else relative(due, now)))
    for i, window in enumerate(windows_of(status)):
        over = (f" (over by {window.used - window.count}: later starts wait for the next "
                "window)" if window.used > window.count else "")
        lines.append(f"  {'quota' if i == 0 else '':<9} {window.used} of {window.count} per "
                     f"{window.label}{over}, window ends {relative(window.end, now)} "
                     f"({utc_time(window.end)})")
    if parked is not None:
        lines.append(f"  parked    {parked}")
    lines += [f"  note: {note}" for note in limit_notes(status)]
    if status.holders:
        lines += ["", "  holders:"] + table(
            ("HOLDER", "TOKEN", "COST", "TASK ID", "WORKER", "SINCE", "EXPIRES"),
            [(h.holder, str(h.token), cost_of(h.meta), h.meta.get("task_id", "-"),
              h.meta.get("worker", "-"), relative(h.since, now), relative(h.expires_at, now))
             for h in status.holders],
            right=(2,), indent="    ")
    if status.waiters:
        lines += ["", "  waiters, in admission order:"] + table(
            ("#", "HOLDER", "PRIORITY", "COST", "TASK ID", "WORKER", "SINCE"),
            [(i, w.holder, priority_of(w.meta), cost_of(w.meta), w.meta.get("task_id", "-"),
              w.meta.get("worker", "-"), relative(w.since, now))
             for i, w in enumerate(status.waiters)],
            right=(0, 2, 3), indent="    ")
    return "\n".join(lines)


def list_table(rows: Sequence[Mapping[str, Any]], now: Optional[float] = None) -> List[str]:
    """The lines of ``list``: PAUSED and QUOTA columns only when a semaphore has a pause or
    a quota; a learned limit is marked ``~`` (``=``: pinned by resize)."""
    now = time.time() if now is None else now
    paused = any(r["paused_until"] is not None for r in rows)
    quotas = any(r["quotas"] for r in rows)

    def limit(row: Mapping[str, Any]) -> str:
        learned = row["adaptive"]
        return f"{row['limit']}{('=' if learned['pinned'] else '~') if learned else ''}"

    def paused_cell(row: Mapping[str, Any]) -> str:
        until = row["paused_until"]
        if until is None:
            return "-"
        return ("ending now" if until <= now else relative(until, now)) + (
            f" ({row['pause_reason']})" if row["pause_reason"] else "")

    def quota_cell(row: Mapping[str, Any]) -> str:
        return " ".join(f"{q['used']}/{q['count']}/{q['window']}" for q in row["quotas"]) or "-"

    headers = ("NAME", "LIMIT", "PINNED", "DECLARED", "HELD", "UNITS", "WAITING", "PARKED")
    lines = table(headers + ("PAUSED",) * paused + ("QUOTA",) * quotas,
                  [(r["name"], limit(r), "pinned" if r["pinned"] else "-",
                    ",".join(map(str, r["declared"])) or "-", r["held"], r["units"],
                    r["waiting"], "-" if r["parked"] is None else r["parked"])
                   + (paused_cell(r),) * paused + (quota_cell(r),) * quotas for r in rows],
                  right=(1, 4, 5, 6, 7))
    if any(r["adaptive"] for r in rows):
        lines.append("~: a learned (adaptive) limit; =: learned, pinned by resize")
    return lines


def limit_notes(status: SemaphoreStatus) -> List[str]:
    """Why the limit in force is not what some caller declares (none when all agree)."""
    if status.pinned and status.newest_declared not in (None, status.limit):
        return [f"pinned by `resize`: declared limits do not change it; `resize "
                f"{status.name} --unpin` puts the newest declared limit "
                f"({status.newest_declared}) in force"]
    if any(k != status.limit for k in status.declared):
        return ["the newest declaration is in force; the others come from processes "
                "started earlier (old code still running: a deploy under way?)"]
    return []


def _where_waiting(request: Mapping[str, Any]) -> str:
    if not request.get("queued"):
        return "in the worker's line (no free pool process yet)"
    if request.get("position") is None:
        return "entering the backend's queue"
    why = {"units": ", waiting for units", "rate": ", waiting for the rate",
           "quota": ", waiting for the quota's next window",
           "pause": ", paused"}.get(request.get("waits_for") or "", "")
    return f"position {request['position']} at its last try{why}"


def _names(request: Mapping[str, Any]) -> str:
    """The request's semaphore, or all of them (a task under several), the one it waits for
    first: ``api:7 (+api)``."""
    first = request["semaphore"]
    others = [n for n in request.get("semaphores") or () if n != first]
    return f"{first} (+{', '.join(others)})" if others else first


def _tokens(held: Mapping[str, Any]) -> str:
    tokens = held.get("tokens") or {}
    if len(tokens) > 1:
        return "tokens " + " ".join(f"{name}={token}" for name, token in tokens.items())
    return f"token {held['token']}"


def render_workers(replies: Mapping[str, Any],
                   parked_now: Optional[Mapping[str, int]] = None) -> str:
    """``parked_now``: name -> tasks in its parking queue on the broker now."""
    if not replies:
        return "no worker answered"
    lines = []
    rows = []
    for worker, info in replies.items():
        if "error" in info:  # a worker without celery_semaphore.install()
            lines.append(f"{worker}: {info['error']}")
            continue
        held, waiting = info.get("held", []), info.get("waiting", [])
        queued = sum(1 for w in waiting if w.get("queued"))
        parked, pulled = info.get("parked", {}), info.get("pulled", {})
        lines.append(f"{worker}: {len(held)} held, {len(waiting)} waiting "
                     f"({queued} in the backend's queue, {len(waiting) - queued} in the "
                     f"worker's own line); since it started: {sum(parked.values())} parked, "
                     f"{sum(pulled.values())} pulled back")
        rows += [(worker, "held", _names(h), h["id"], h.get("task", "-"),
                  _tokens(h)) for h in held]
        rows += [(worker, "waiting", _names(w), w["id"], w.get("task", "-"),
                  f"{_where_waiting(w)}, waited {w.get('waited', 0):.1f}s") for w in waiting]
    if rows:
        lines += [""] + table(("WORKER", "STATE", "SEMAPHORE", "TASK ID", "TASK", "DETAIL"),
                              rows)
    if parked_now:
        lines += [""] + table(("SEMAPHORE", "PARKED NOW"), sorted(parked_now.items()),
                              right=(1,))
    return "\n".join(lines)


def semaphores_of(replies: Mapping[str, Any]) -> List[str]:
    """The semaphores the workers' replies name (requests, parked and pulled counts)."""
    names = set()
    for info in replies.values():
        for request in info.get("held", []) + info.get("waiting", []):
            names.add(request["semaphore"])
            names.update(request.get("semaphores") or ())
        names.update(info.get("parked", {}))
        names.update(info.get("pulled", {}))
    return sorted(names)


# -- the click group ----------------------------------------------------------------------


def masked(url: str) -> str:
    return mask_url(url)


def _password(url: str) -> Optional[str]:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def where(backend: Backend) -> str:
    """The backend's URL without its password; an SQLite file's absolute path too (a relative
    URL names a different file in each working directory)."""
    path = getattr(backend, "path", None)
    return f"{masked(backend.url)} (file {path})" if path else masked(backend.url)


class Context:
    """What the subcommands share: the app (None without -A) and the backend, opened once."""

    def __init__(self, app: Any, backend_url: Optional[str]) -> None:
        self.app = app
        self.backend_url = backend_url
        self.url: Optional[str] = None
        self._backend: Optional[Backend] = None

    @property
    def settings(self) -> Settings:
        if self.app is None:
            return Settings()
        try:
            return Settings.from_app(self.app)
        except ConfigurationError as exc:
            raise click.ClickException(str(exc)) from None

    def parked(self, names: List[str]) -> Optional[Dict[str, int]]:
        """Tasks parked per name on the app's broker; None without an app or a broker that
        answers (the column shows ``-``)."""
        if self.app is None:
            return None
        if not names:
            return {}
        from .waiting_room import parked_counts

        try:
            return parked_counts(self.app, self.settings.key_prefix, names)
        except Exception as exc:
            click.echo(f"warning: parked counts unavailable: broker: {exc}", err=True)
            return None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            if self.backend_url is None and self.app is None:
                raise click.UsageError("no app: pass -A/--app or --backend URL")
            settings = self.settings
            try:
                self.url = (self.backend_url if self.backend_url is not None
                            else settings.backend_url(self.app))
                self._backend = get_backend(self.url, key_prefix=settings.key_prefix)
            except ConfigurationError as exc:
                raise click.UsageError(str(exc)) from None
        return self._backend


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_name(value)
    except InvalidName as exc:
        raise click.BadParameter(str(exc)) from None


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):  # FloatRange lets NaN through
        raise click.BadParameter(f"must be a finite number of seconds, not {value}", ctx, param)
    return value


if TYPE_CHECKING:
    # Newer click makes ParamType generic over the value it converts to; older releases
    # (Celery 5.3 allows click 8.1) cannot be subscripted at run time.
    _IntParamType = click.ParamType[int]
else:
    _IntParamType = click.ParamType


class PositiveInt(_IntParamType):
    """A limit: a positive integer, else a usage error (exit 2, with the usage line)."""

    name = "limit"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            digits = text[1:] if text.startswith("-") else text
            if not (digits.isascii() and digits.isdigit()):  # int() takes "4_0" and "٣" too
                self.fail(f"must be a positive integer, not {value!r} (ASCII digits only)",
                          param, ctx)
            number = int(text)
        try:
            return validate_limit(number)
        except InvalidLimit as exc:
            self.fail(str(exc).replace("limit ", "", 1), param, ctx)


#: Seconds in each unit a ``--for`` duration may use.
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> float:
    """``"90s"``, ``"10m"``, ``"1h30m"``, ``"1.5h"``, ``"2d"``, ``"1w"``, ``"500ms"``, or a
    bare number of seconds -> seconds (above 0, finite); ValueError otherwise."""
    compact = "".join(str(text).split())
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", compact):
        seconds = float(compact)
    elif compact and re.fullmatch(f"(?:{_DURATION_PART.pattern})+", compact):
        seconds = sum(float(number) * DURATION_UNITS[unit]
                      for number, unit in _DURATION_PART.findall(compact))
    else:
        raise ValueError(f"{text!r} is not a duration such as 90s, 10m, 1h30m or 2d")
    if not 0 < seconds < math.inf:
        raise ValueError(f"{text!r}: a duration must be above 0")
    return seconds


def parse_moment(text: str) -> float:
    """An ISO 8601 date and time (without an offset: UTC) or an HTTP-date -> Unix time;
    ValueError otherwise."""
    for parse in (parse_iso_datetime, parse_http_date):
        try:
            return parse(text).timestamp()
        except ValueError:
            continue
    raise ValueError(f"{text!r} is neither an ISO 8601 time (2026-05-09T14:00:00Z) nor an "
                     "HTTP-date (Sat, 09 May 2026 14:00:00 GMT)")


if TYPE_CHECKING:
    _FloatParamType = click.ParamType[float]
else:
    _FloatParamType = click.ParamType


class Duration(_FloatParamType):
    """``--for``: :func:`parse_duration`, else a usage error (exit 2)."""

    name = "duration"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Moment(_FloatParamType):
    """``--until``: :func:`parse_moment` (a Unix time), not in the past, else a usage error
    (exit 2)."""

    name = "time"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        if isinstance(value, float):
            return value
        try:
            moment = parse_moment(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if moment <= time.time():
            self.fail(f"{value!r} is in the past", param, ctx)
        return moment


def _operational(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every failure of an operation into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(obj: Context, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(obj, *args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (InvalidName, InvalidLimit) as exc:  # caught by the parameters already
            raise click.UsageError(str(exc)) from None
        except SemaphoreError as exc:  # unknown semaphore, not held, unreachable, ...
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # e.g. a backend error the backend did not translate
            message = f"{type(exc).__name__}: {exc}"
            if obj.url is None:
                raise click.ClickException(message) from None
            password = _password(obj.url)
            if password:
                message = message.replace(password, "**")
            raise click.ClickException(
                f"semaphore backend {masked(obj.url)} failed: {message}") from None

    return wrapper


def _emit(as_json: bool, data: Any, human: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else human)


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Machine-readable output on stdout.")
BACKEND_HELP = "Semaphore backend URL (default: the app's semaphore_backend)."


def _late_backend(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    if value is not None:
        obj = ctx.find_object(Context)
        assert obj is not None  # the group's callback made it before any subcommand option
        obj.backend_url = value


def backend_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--backend`` after the subcommand too (``semaphore list --backend URL``)."""
    return click.option("--backend", metavar="URL", expose_value=False, is_eager=True,
                        callback=_late_backend, help=BACKEND_HELP)(command)


@click.group(name="semaphore")
@click.option("--backend", "backend_url", metavar="URL", help=BACKEND_HELP)
@click.pass_context
def semaphore(ctx: click.Context, backend_url: Optional[str]) -> None:
    """Inspect, resize and reset celery-semaphore semaphores.

    Limits follow the code: the limit a task declares (its `limit` option, semaphore_limits,
    a semaphore_limit header) is in force once the workers that declare it run (the most
    recently started process's declaration wins). `resize` pins a limit that no deploy
    changes until `resize NAME --unpin`.
    """
    obj = ctx.obj
    app = getattr(obj, "app", None) if obj is not None else None
    if app is not None and getattr(app, "main", None) == "default":
        app = None  # no -A/--app: Celery's placeholder app has no settings to read
    ctx.obj = Context(app, backend_url)  # backends are shared per process: not closed here


@semaphore.command(name="list")
@backend_option
@json_option
@click.pass_obj
@_operational
def list_(obj: Context, as_json: bool) -> None:
    """Every known semaphore: name, limit (with "pinned" when `resize` pinned it), the limits
    declared lately, held, waiting (in the backend's queue), parked (in the broker's waiting
    room; with -A only)."""
    rows = list_semaphores(obj.backend)
    parked = obj.parked([r["name"] for r in rows])
    for row in rows:
        row["parked"] = parked.get(row["name"]) if parked is not None else None
    _emit(as_json, rows, "\n".join(list_table(rows)) if rows else "no semaphores")


@semaphore.command()
@backend_option
@click.argument("name", callback=_name)
@json_option
@click.pass_obj
@_operational
def status(obj: Context, name: str, as_json: bool) -> None:
    """Limit (and whether `resize` pinned it), declared limits (the newest marked), holders
    and waiters of NAME (exit 1 if unknown)."""
    found = semaphore_status(obj.backend, name)
    parked = obj.parked([name])
    count = parked.get(name) if parked is not None else None
    _emit(as_json, {**found.as_dict(), "parked": count}, render_status(found, parked=count))


@semaphore.command(context_settings={"ignore_unknown_options": True})  # "-1" is a LIMIT
@backend_option
@click.argument("name", callback=_name)
@click.argument("limit", type=PositiveInt(), required=False)
@click.option("--unpin", is_flag=True,
              help="Release the pin instead (no LIMIT): the newest declared limit rules again.")
@json_option
@click.pass_obj
@_operational
def resize(obj: Context, name: str, limit: Optional[int], unpin: bool, as_json: bool) -> None:
    """Set the limit of NAME for every worker at once and pin it, creating NAME if it is new.

    A pinned limit stays whatever the workers declare (a deploy that changes a task's limit
    does not undo it) until `resize NAME --unpin`, which puts the newest declared limit in
    force again. Growing admits waiters at once; shrinking admits nobody until the holders
    drop below the new limit (running tasks are not interrupted).
    """
    if unpin:
        if limit is not None:
            raise click.UsageError("--unpin takes no LIMIT: the newest declared limit rules")
        done = unpin_semaphore(obj.backend, name)
        state = "unpinned" if done["was_pinned"] else "was not pinned"
        _emit(as_json, done, f"semaphore {name!r} {state}: limit {done['previous']} -> "
                             f"{done['limit']}" if done["previous"] != done["limit"]
              else f"semaphore {name!r} {state}: limit {done['limit']}")
        return
    if limit is None:
        raise click.UsageError("Missing argument 'LIMIT' (or pass --unpin).")
    done = resize_semaphore(obj.backend, name, limit)
    if done["created"]:
        human = f"created semaphore {name!r} with limit {limit} (pinned)"
    elif done["previous"] == limit:
        human = f"semaphore {name!r} already has limit {limit} (pinned now)"
    else:
        human = f"resized semaphore {name!r}: limit {done['previous']} -> {limit} (pinned)"
    _emit(as_json, done, human)


@semaphore.command()
@backend_option
@click.argument("name", callback=_name)
@click.argument("holder")
@json_option
@click.pass_obj
@_operational
def release(obj: Context, name: str, holder: str, as_json: bool) -> None:
    """Force-release a stuck HOLDER of NAME (its holder id or its task id).

    The task, if it still runs, loses its lease (semaphore_on_lost_lease decides what then).
    """
    done = release_holder(obj.backend, name, holder)
    task = f" (task {done['task_id']})" if done["task_id"] else ""
    _emit(as_json, done, f"released {done['holder']}{task} from semaphore {name!r}, "
                         f"token {done['token']}")


@semaphore.command()
@backend_option
@click.argument("name", callback=_name)
@click.option("--for", "for_", type=Duration(), metavar="DURATION",
              help="How long: 90s, 10m, 1h30m, 2d, 1w (a bare number: seconds).")
@click.option("--until", type=Moment(), metavar="TIME",
              help="Until when: ISO 8601 (2026-05-09T14:00:00Z; without an offset: UTC) or "
                   "an HTTP-date (Sat, 09 May 2026 14:00:00 GMT).")
@click.option("--reason", default="", help="Why: shown by status, list, top and the exporter.")
@json_option
@click.pass_obj
@_operational
def pause(obj: Context, name: str, for_: Optional[float], until: Optional[float], reason: str,
          as_json: bool) -> None:
    """Close NAME on every worker for a while, as a task's Backoff does: no task of it starts
    anywhere until then or `resume NAME` (running ones finish; waiting ones keep their place
    and hold no process). A pause in force that ends later is kept. NAME need not exist yet
    (a template's key). --until is turned into a duration with this host's clock; the pause
    ends by the backend's."""
    if (for_ is None) == (until is None):
        raise click.UsageError("pass one of --for DURATION or --until TIME")
    seconds = for_ if for_ is not None else (until or 0.0) - time.time()
    if seconds <= 0:
        raise click.BadParameter("is in the past", param_hint="'--until'")
    done = pause_semaphore(obj.backend, name, seconds, reason)
    now = time.time()
    end = done["paused_until"]
    when = f"until {utc_time(end)} ({relative(end, now)})"
    if done["kept"]:
        human = f"semaphore {name!r} stays paused {when}: a pause ending later was in force"
    else:
        human = f"paused semaphore {name!r} {when}" + (f": {done['reason']}"
                                                       if done["reason"] else "")
    _emit(as_json, done, human)


@semaphore.command()
@backend_option
@click.argument("name", callback=_name)
@json_option
@click.pass_obj
@_operational
def resume(obj: Context, name: str, as_json: bool) -> None:
    """Lift the pause of NAME (`pause`, or a task's Backoff): its waiting tasks start as slots
    allow, at once."""
    done = resume_semaphore(obj.backend, name)
    _emit(as_json, done, f"resumed semaphore {name!r}" if done["resumed"]
          else f"semaphore {name!r} was not paused")


@semaphore.command()
@backend_option
@click.argument("name", callback=_name)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
@_operational
def reset(obj: Context, name: str, yes: bool, as_json: bool) -> None:
    """Delete all state of NAME: limit, holders (they lose their slots) and waiters."""
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("refusing to reset without confirmation: pass --yes")
        click.confirm(f"Delete all state of semaphore {name!r}?", abort=True, err=True)
    done = reset_semaphore(obj.backend, name)
    _emit(as_json, done,
          f"reset semaphore {name!r}" if done["reset"] else f"semaphore {name!r} was unknown")


@semaphore.command()
@backend_option
@click.option("--dry-run", is_flag=True, hidden=True,
              help="Accepted for old scripts: sync changes nothing anyway.")
@json_option
@click.pass_obj
@_operational
def sync(obj: Context, dry_run: bool, as_json: bool) -> None:
    """Show the semaphores of semaphore_limits whose limit in force differs (changes nothing).

    Obsolete as a step of a deploy: declared limits now take effect on their own once the
    workers that declare them run. What it shows: names pinned by `resize` (`resize NAME
    --unpin` lets the configured limit rule), names not created yet, and names whose newest
    declaration is not this configuration's (workers with other settings started later).
    Templates ("api:{customer_id}") are skipped.
    """
    if obj.app is None:
        raise click.UsageError("no app: pass -A/--app (sync reads its semaphore_limits)")
    differences = compare_limits(obj.backend, obj.settings.limits)

    def line(d: Dict[str, Any]) -> str:
        if d["limit"] is None:
            return f"{d['name']}: not created yet (the first acquire creates it with " \
                   f"{d['configured']})"
        why = (f"pinned by resize (`resize {d['name']} --unpin` to follow the code)"
               if d["pinned"] else "declared otherwise by a process started later")
        return f"{d['name']}: limit {d['limit']}, configured {d['configured']}: {why}"

    _emit(as_json, differences, "\n".join(map(line, differences))
          or "every configured limit is in force")


@semaphore.command()
@backend_option
@click.option("--timeout", type=click.FloatRange(min=0, max=3600, min_open=True), default=2.0,
              callback=_finite,
              show_default=True, help="Seconds to wait for the workers' replies.")
@click.option("-d", "--destination", multiple=True, metavar="WORKER",
              help="Ask only this worker (repeatable).")
@json_option
@click.pass_obj
@_operational
def workers(obj: Context, timeout: float, destination: Sequence[str], as_json: bool) -> None:
    """Each worker's requests waiting for a slot and running with one, the requests it parked
    and pulled back since it started, and (not with --json) the tasks parked on the broker
    now for the semaphores they name.

    A worker keeps a request in its own line until a pool process is free for it, and only
    then enters it in the backend's queue: `status` counts the backend's queue alone, so its
    waiting count can be lower than the sum here. A position is the one the backend gave at
    the request's last try (0 is next); two requests can show the same position when one
    moved up since it last asked.
    """
    if obj.app is None:
        raise click.UsageError("no app: pass -A/--app")
    replies = worker_requests(obj.app, timeout=timeout, destination=list(destination))
    human = "" if as_json else render_workers(replies, obj.parked(semaphores_of(replies)))
    _emit(as_json, replies, human)


# -- monitoring ---------------------------------------------------------------------------


#: Longest time the main thread of ``exporter`` and live ``top`` blocks at once. Python runs
#: signal handlers in the main thread, but the kernel may hand a process's signal to any of
#: its threads (a scrape's, a backend's): then no wait of the main thread is interrupted, and
#: the handler runs only when the main thread next runs Python code.
SIGNAL_CHECK_EVERY = 0.1


class _Stopped(Exception):
    """SIGTERM or SIGINT reached a long-running command (``exporter``, live ``top``)."""


class _SignalStop:
    """SIGTERM, and SIGINT unless it is ignored, stop a long-running command promptly.

    ``with stopper:`` runs the block until one arrives, then leaves it (its ``finally``
    clauses run) as if it had returned. A signal ignored when the command starts stays
    ignored: a background job of a non-interactive shell (``make test &``, a CI wrapper)
    ignores SIGINT, and is stopped with SIGTERM. Later signals are ignored while the command
    cleans up; :meth:`finish`, after the cleanup, then ends the process at once with status
    0: a graceful interpreter shutdown with scrapes or reads still running in other threads
    took seconds on a loaded machine, and nothing is left to save. Without a signal,
    :meth:`finish` restores the handlers. The main thread only (signal handlers).
    """

    def __init__(self) -> None:
        self.signalled = False
        self._inside = False
        self._saved: Dict[int, Any] = {}

    def __enter__(self) -> "_SignalStop":
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous is not signal.SIG_IGN:
                self._saved[sig] = previous
                signal.signal(sig, self._handle)
        self._inside = True
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        self._inside = False
        return kind is _Stopped

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if not self.signalled:
            self.signalled = True
            if self._inside:
                raise _Stopped(signum)

    def finish(self) -> None:
        if self.signalled:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(0)
        for sig, previous in self._saved.items():
            signal.signal(sig, previous)


def _parked_reader(obj: Context) -> Optional[Callable[[List[str]], Dict[str, int]]]:
    """Parked counts per name from the app's broker; None without an app."""
    if obj.app is None:
        return None
    from .waiting_room import parked_counts

    app, key_prefix = obj.app, obj.settings.key_prefix
    return lambda names: parked_counts(app, key_prefix, names)


def _snapshot_reader(obj: Context) -> Callable[[], Any]:
    """A function taking one :func:`.metrics.read_snapshot` of the backend (and, with -A, the
    broker's parked counts)."""
    from .metrics import Templates, read_snapshot

    backend = obj.backend
    templates = Templates.of_app(obj.app, obj.settings.limits)
    parked = _parked_reader(obj)
    return lambda: read_snapshot(backend, templates, parked)


@semaphore.command()
@backend_option
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True,
              help="TCP port (0: any free port, printed at start).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--top", "top_n", type=click.IntRange(0, 100_000), default=None,
              help="Keys of each template exported one by one (default: semaphore_metrics_top).")
@click.pass_obj
@_operational
def exporter(obj: Context, port: int, address: str, top_n: Optional[int]) -> None:
    """Serve Prometheus metrics of every semaphore on http://ADDRESS:PORT/metrics.

    One exporter serves the whole cluster: each scrape reads the backend (state and the
    counters it keeps) and, with -A, the broker (parked tasks). Needs prometheus_client
    (extra [metrics]). Stops on SIGTERM or SIGINT (exit status 0), scrapes in flight or not.
    """
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise click.ClickException("the exporter needs prometheus_client: "
                                   "pip install 'celery-semaphore[metrics]'") from None
    from .metrics import Collector, Templates, serve, stop

    settings = obj.settings
    collector = Collector(obj.backend, Templates.of_app(obj.app, settings.limits),
                          _parked_reader(obj), settings.metrics_top if top_n is None else top_n)
    try:
        server = serve(collector, port, address)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {address}:{port}: {exc}") from None
    click.echo(f"serving http://{address}:{server.server_port}/metrics for "
               f"{where(obj.backend)}", err=True)
    stopper = _SignalStop()
    try:
        with stopper:
            while True:
                time.sleep(SIGNAL_CHECK_EVERY)
    finally:
        stop(server)
        stopper.finish()


@semaphore.command()
@backend_option
@click.option("--interval", type=click.FloatRange(min=0, max=3600), default=2.0,
              callback=_finite, show_default=True,
              help="Seconds between refreshes (rates and percentiles are over it).")
@click.option("--sort", type=click.Choice(["waiting", "held", "parked", "grants", "p99",
                                           "name"]),
              default="waiting", show_default=True, help="Sort column.")
@click.option("--filter", "pattern", metavar="GLOB",
              help="Only names (or templates) matching this glob, e.g. 'api:*'.")
@click.option("--by-template", is_flag=True, help="One row per template (keys summed).")
@click.option("--once", is_flag=True, help="Print one frame (rates over --interval) and exit.")
@json_option
@click.pass_obj
@_operational
def top(obj: Context, interval: float, sort: str, pattern: Optional[str], by_template: bool,
        once: bool, as_json: bool) -> None:
    """A live view of every semaphore: limit, held, waiting, parked, wait p50/p99 and grants
    per second, refreshed in place (keys: s sort, r reverse, q quit). Piped, it prints one
    frame per refresh; --once (or --json) prints one and exits. Stops on SIGTERM or SIGINT
    (exit status 0), restoring the terminal."""
    from . import top as view

    if not once and not as_json and interval <= 0:
        raise click.UsageError("--interval must be above 0 without --once")
    read = _snapshot_reader(obj)
    backend_where = where(obj.backend)
    if once or as_json:
        rows, snap = view.once(read, interval, by_template, pattern)
        rows = view.sort_rows(rows, sort)
        if snap.backend_error:
            raise click.ClickException(f"semaphore backend {backend_where} failed: "
                                       f"{snap.backend_error}")
        if as_json:
            click.echo(view.dump_json(view.as_json(rows, snap, backend_where, interval)))
        else:
            click.echo("\n".join(view.render(rows, snap, backend_where, sort,
                                             interval=interval or None)))
        return
    # click 8.5 deprecates get_text_stream and serves it from a module __getattr__ (typed
    # object); it is still the stream click itself writes to.
    stdout = cast(Callable[[str], IO[str]], click.get_text_stream)("stdout")
    terminal = stdout.isatty()
    keys = sys.stdin if terminal and sys.stdin.isatty() else None
    live = view.Live(read, backend_where, interval, sort, pattern, by_template, out=stdout,
                     keys=keys)
    stopper = _SignalStop()
    if keys is None:
        try:
            with stopper:
                live.run(terminal)
        finally:
            stopper.finish()
        return
    import termios
    import tty

    saved = termios.tcgetattr(keys.fileno())
    try:
        with stopper:
            tty.setcbreak(keys.fileno())
            live.run(terminal)
    finally:
        termios.tcsetattr(keys.fileno(), termios.TCSADRAIN, saved)
        stopper.finish()
