"""Following the API behind a task: :class:`Backoff` (an API said "too many requests") and
:class:`Adaptive` (a limit learned from the calls' outcomes).

``raise Backoff(retry_after=30)`` in a guarded task closes its semaphore (that key, for a
template) on every worker until the time given, on the backend's clock, and gives the call
back to wait without using a Celery retry; ``Backoff()`` with no time only reports overload.
``retry_after`` takes what an API answers with: seconds, a :class:`~datetime.datetime`, a
:class:`~datetime.timedelta`, or the value of a ``Retry-After`` header (delay-seconds or an
HTTP-date, RFC 9110 10.2.3); :meth:`Backoff.from_response` reads the header from a
``requests`` or ``httpx`` response.

``limit=Adaptive(min=1, max=64)`` makes the limit in force move between ``min`` and ``max``
from the outcomes of the calls (up while they succeed, down on a Backoff or an exception
listed in ``decrease_on``): :mod:`.backends.base`, "adaptive".

Every value is checked at construction: :class:`ConfigurationError` names the bad one.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Optional, Tuple, Type, Union

from celery.exceptions import Ignore

from .exceptions import ConfigurationError
from .names import MAX_LIMIT

#: What ``retry_after`` may be (module docs).
RetryAfter = Union[None, int, float, str, datetime, timedelta]
#: Longest ``reason`` kept (a longer one is cut, ending with "..."): it is stored with the
#: semaphore and shown by ``status``, ``top`` and the exporter.
MAX_REASON = 200

_DELAY_SECONDS = re.compile(r"^\d+(?:\.\d+)?$", re.ASCII)
_MONTHS = {name: number for number, name in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1)}
_DAY = r"(?:mon|tue|wed|thu|fri|sat|sun)"
_DAY_LONG = r"(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday)"
_TIME = r"(\d{2}):(\d{2}):(\d{2})"
#: RFC 9110 5.6.7: IMF-fixdate (``Sun, 06 Nov 1994 08:49:37 GMT``), the obsolete RFC 850
#: form (``Sunday, 06-Nov-94 08:49:37 GMT``) and asctime (``Sun Nov  6 08:49:37 1994``),
#: which a recipient must all accept. Names are matched without regard to case.
_IMF = re.compile(rf"^{_DAY},\s+(\d{{1,2}})\s+([a-z]{{3}})\s+(\d{{4}})\s+{_TIME}\s+GMT$",
                  re.I | re.ASCII)
_RFC850 = re.compile(rf"^{_DAY_LONG},\s+(\d{{1,2}})-([a-z]{{3}})-(\d{{2}})\s+{_TIME}\s+GMT$",
                     re.I | re.ASCII)
_ASCTIME = re.compile(rf"^{_DAY}\s+([a-z]{{3}})\s+(\d{{1,2}})\s+{_TIME}\s+(\d{{4}})$",
                      re.I | re.ASCII)


def _date(year: int, month_name: str, day: int, hour: int, minute: int,
          second: int) -> datetime:
    month = _MONTHS.get(month_name.lower())
    if month is None:
        raise ValueError(f"{month_name!r} is not a month")
    # A leap second (:60) is the last second of its minute here.
    return datetime(year, month, day, hour, minute, min(second, 59), tzinfo=timezone.utc)


def parse_http_date(text: str, now: Optional[float] = None) -> datetime:
    """An HTTP-date (RFC 9110 5.6.7, any of its three forms) as an aware UTC datetime;
    ValueError when ``text`` is none. A two-digit year (RFC 850) more than 50 years ahead of
    ``now`` is in the past century, as the RFC says."""
    text = " ".join(text.split())
    match = _IMF.match(text)
    if match:
        day, month, year, hh, mm, ss = match.groups()
        return _date(int(year), month, int(day), int(hh), int(mm), int(ss))
    match = _RFC850.match(text)
    if match:
        day, month, yy, hh, mm, ss = match.groups()
        this_year = datetime.fromtimestamp(time.time() if now is None else now,
                                           timezone.utc).year
        year = this_year - this_year % 100 + int(yy)
        if year > this_year + 50:
            year -= 100
        return _date(year, month, int(day), int(hh), int(mm), int(ss))
    match = _ASCTIME.match(text)
    if match:
        month, day, hh, mm, ss, year = match.groups()
        return _date(int(year), month, int(day), int(hh), int(mm), int(ss))
    raise ValueError(f"{text!r} is not an HTTP-date")


def parse_iso_datetime(text: str) -> datetime:
    """An ISO 8601 date and time (``2026-05-09T14:00:00Z``, ``...+02:00``; naive: UTC) as an
    aware datetime; ValueError when ``text`` is none."""
    text = text.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    if not re.match(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
        raise ValueError(f"{text!r} is not an ISO 8601 date")
    value = datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _seconds_until(moment: datetime, now: float) -> float:
    if moment.tzinfo is None or moment.utcoffset() is None:
        moment = moment.replace(tzinfo=timezone.utc)  # naive: UTC
    return max(0.0, moment.timestamp() - now)


def retry_after_seconds(value: RetryAfter, now: Optional[float] = None,
                        what: str = "retry_after") -> Optional[float]:
    """Seconds from ``now`` (``time.time()`` by default) that ``value`` says to wait, or None
    (no time given):

    * None: None;
    * a number (int or float) >= 0, finite: that many seconds;
    * a :class:`~datetime.timedelta` >= 0: its seconds;
    * a :class:`~datetime.datetime` (aware, or naive meaning UTC): the seconds until then
      (0 when it has passed);
    * a string, the value of a ``Retry-After`` header: delay-seconds (ASCII digits; a decimal
      fraction is tolerated) or an HTTP-date in any of its three forms (0 when it has
      passed).

    Anything else (a negative number, a bool, NaN, an unreadable string): ConfigurationError
    naming ``what`` and the value."""
    now = time.time() if now is None else now
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be seconds, a datetime, a timedelta or a "
                                 f"Retry-After header value, not {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ConfigurationError(f"{what} must be a finite number of seconds >= 0, "
                                     f"not {value!r}")
        return float(value)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        if seconds < 0:
            raise ConfigurationError(f"{what} must not be a negative timedelta, not {value!r}")
        return seconds
    if isinstance(value, datetime):
        return _seconds_until(value, now)
    if isinstance(value, str):
        text = value.strip()
        if _DELAY_SECONDS.match(text):
            return float(text)
        try:
            return _seconds_until(parse_http_date(text, now), now)
        except ValueError:
            pass
        raise ConfigurationError(f"{what} {value!r} is neither delay-seconds ('120') nor an "
                                 "HTTP-date ('Wed, 21 Oct 2015 07:28:00 GMT'), as a "
                                 "Retry-After header holds (RFC 9110 10.2.3)")
    raise ConfigurationError(f"{what} must be seconds, a datetime, a timedelta or a "
                             f"Retry-After header value, not {type(value).__name__} {value!r}")


def check_reason(reason: Any, what: str = "reason") -> str:
    """``reason`` as stored: a string, cut to :data:`MAX_REASON` characters."""
    if not isinstance(reason, str):
        raise ConfigurationError(f"{what} must be a string, not {reason!r}")
    text = " ".join(reason.split())  # one line in status, top and metric labels
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


class Backoff(Ignore):  # type: ignore[misc]
    """Raised by a guarded task whose API asked it to slow down (an HTTP 429, a 503 with
    ``Retry-After``): closes the semaphore (that key) everywhere for ``seconds`` and gives
    the call back to wait, ahead of later arrivals, without a Celery retry; with no time
    (``Backoff()``), gives the call back and reports overload (an :class:`Adaptive` limit
    goes down) without closing anything.

    It is a Celery ``Ignore``: the pool child that ran the task stores no FAILURE and counts
    no retry; the worker's gate gives the call back.

    :param retry_after: seconds, a datetime, a timedelta, or a ``Retry-After`` header's
        value (:func:`retry_after_seconds`); None: no time.
    :param reason: why, shown to operators (``status``, ``top``, the exporter).
    :raises ConfigurationError: for a value that says no time, naming it.

    ``seconds`` is what ``retry_after`` came to, relative to when the Backoff was made;
    ``at`` the same moment as a Unix time (this host's clock), None without a time.
    ``paused``: the pool process that ran the task closed the semaphore already, as the
    Backoff ended the run (the worker's gate then does not). ``unstarted``: raised by the
    worker itself before the body started (its semaphore had closed after the grant:
    :mod:`.pause_board`): no overload to report.
    """

    def __init__(self, retry_after: RetryAfter = None, reason: str = "") -> None:
        now = time.time()
        self.retry_after = retry_after
        self.seconds: Optional[float] = retry_after_seconds(retry_after, now)
        self.reason = check_reason(reason)
        self.at: Optional[float] = None if self.seconds is None else now + self.seconds
        self.paused = False
        self.unstarted = False
        # args rebuild the same Backoff (pickling, Celery's exception serialization).
        super().__init__(self.seconds, self.reason)

    def remaining(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds still to wait from ``now`` (``time.time()``), at least 0; None without a
        time."""
        if self.at is None:
            return None
        return max(0.0, self.at - (time.time() if now is None else now))

    @classmethod
    def from_response(cls, response: Any, default: RetryAfter = None,
                      reason: Optional[str] = None) -> "Backoff":
        """A Backoff from an HTTP response (``requests``, ``httpx``, ``urllib``, or any
        object with ``.headers``): its ``Retry-After`` header (found whatever its case), else
        ``default``. A header that holds no time the RFC allows (a server's mistake) counts
        as absent: the call still backs off, by ``default``. ``reason`` defaults to
        ``"HTTP <status>"``. ``default`` is checked like ``retry_after``."""
        fallback = retry_after_seconds(default, what="default")
        headers = getattr(response, "headers", None)
        if headers is None:
            raise ConfigurationError(f"Backoff.from_response needs a response with headers, "
                                     f"not {type(response).__name__}")
        header = _header(headers, "retry-after")
        seconds = fallback
        if header is not None:
            try:
                seconds = retry_after_seconds(str(header))
            except ConfigurationError:
                seconds = fallback
        if reason is None:
            status = getattr(response, "status_code", None) or getattr(response, "status", None)
            reason = f"HTTP {status}" if status is not None else ""
        return cls(seconds, reason)

    def __str__(self) -> str:
        when = "no time given" if self.seconds is None else f"retry after {self.seconds:g}s"
        return f"{when}: {self.reason}" if self.reason else when

    def __repr__(self) -> str:
        return f"Backoff(retry_after={self.seconds!r}, reason={self.reason!r})"


def _header(headers: Any, name: str) -> Any:
    """The value of header ``name`` in ``headers`` (a case-insensitive mapping, a plain dict
    or an ``email.message.Message``), whatever its case; None when absent."""
    try:
        found = headers.get(name)
        if found is None:
            found = headers.get(name.title())
    except Exception:
        found = None
    if found is not None:
        return found
    items = getattr(headers, "items", None)
    if items is None:
        return None
    for key, found in items():
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if isinstance(key, str) and key.lower() == name:
            return found.decode("latin-1") if isinstance(found, bytes) else found
    return None


def _exception_classes(value: Any) -> Tuple[Type[BaseException], ...]:
    classes = (value,) if isinstance(value, type) else value
    try:
        classes = tuple(classes)
    except TypeError:
        raise ConfigurationError(f"Adaptive decrease_on must be exception classes, "
                                 f"not {value!r}") from None
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise ConfigurationError(f"Adaptive decrease_on must be exception classes, "
                                     f"not {cls!r}")
    return classes


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise ConfigurationError(f"Adaptive {what} must be a finite number, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Adaptive:
    """A limit learned from the calls' outcomes, between ``min`` and ``max``: pass it as a
    task's ``limit=`` (or in ``semaphore_limits``, or as :class:`.Semaphore`'s ``limit``).

    The limit in force starts at ``min`` and, cluster-wide, in the backend: grows by about 1
    per limit's worth of successful calls while the limit is in use (``increase / current``
    per success, ``increase`` 1 by default), and is multiplied by ``decrease`` (0.9) on an
    overload (a :class:`Backoff`, or an exception of ``decrease_on``), at most once per
    round trip of work. After an overload it climbs back at that pace to just below the
    limit that overloaded, then probes that level 32 times slower, until it passes it without
    an overload. ``celery semaphore resize`` pins it (adaptation stops until ``--unpin``).
    A frozen, hashable value; every field is checked here (:class:`ConfigurationError`).
    """

    min: int = 1
    max: int = 64
    decrease: float = 0.9
    increase: float = 1.0
    #: Exception classes that count as overload (besides :class:`Backoff`).
    decrease_on: Tuple[Type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        for what in ("min", "max"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    1 <= value <= MAX_LIMIT):
                raise ConfigurationError(f"Adaptive {what} must be an integer from 1 to "
                                         f"{MAX_LIMIT}, not {value!r}")
        if self.min > self.max:
            raise ConfigurationError(f"Adaptive min ({self.min}) must not be above max "
                                     f"({self.max})")
        decrease = _number(self.decrease, "decrease")
        if not 0 < decrease < 1:
            raise ConfigurationError(f"Adaptive decrease must be above 0 and below 1, "
                                     f"not {self.decrease!r}")
        increase = _number(self.increase, "increase")
        if not 0 < increase <= MAX_LIMIT:
            raise ConfigurationError(f"Adaptive increase must be above 0 (and at most "
                                     f"{MAX_LIMIT}), not {self.increase!r}")
        object.__setattr__(self, "decrease", decrease)
        object.__setattr__(self, "increase", increase)
        object.__setattr__(self, "decrease_on", _exception_classes(self.decrease_on))

    @property
    def limit(self) -> int:
        """The limit an acquire declares for an adaptive semaphore: ``max``."""
        return self.max

    def meta(self) -> Dict[str, Any]:
        """What an acquire's ``meta`` carries under ``ADAPTIVE_KEY``."""
        return {"min": self.min, "max": self.max, "decrease": self.decrease,
                "increase": self.increase}

    def is_overload(self, exc: Optional[BaseException]) -> bool:
        """``exc`` signals overload: a :class:`Backoff` or one of ``decrease_on``."""
        return exc is not None and (isinstance(exc, Backoff)
                                    or isinstance(exc, self.decrease_on))


#: The outcomes a release reports for an adaptive semaphore (:func:`outcome_of`).
OUTCOMES = ("ok", "overload", "error")


def outcome_of(exc: Optional[BaseException], adaptive: Optional[Adaptive] = None) -> str:
    """What a call that ended with ``exc`` (None: it returned) reports on release:
    ``"ok"``, ``"overload"`` (a :class:`Backoff`, or an exception of
    ``adaptive.decrease_on``) or ``"error"``."""
    if exc is None:
        return "ok"
    if isinstance(exc, Backoff) or (adaptive is not None and adaptive.is_overload(exc)):
        return "overload"
    return "error"
