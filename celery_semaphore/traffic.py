"""Beyond a count: costs, rates, quotas, units, priorities and fair-share weights (validation
and meta).

The rules themselves live in the backends (:mod:`.backends.base`, "Costs", "Rate",
"Priorities", "Weights", and the quota, units and adaptive keys); a caller's options travel in
the ``meta`` of its acquire, under the keys defined there. This module checks the options where
they are written and builds that meta. Every check raises :class:`ConfigurationError` naming
the option and the bad value.

Counts per period (``semaphore_rate``, ``semaphore_quota``): ``"<count>/<period>"``, several
separated by ``;`` (``"10/s; 500/m"``), a period being a unit with an optional whole number
before it: ``s``, ``m``, ``h``, ``d``, ``w`` (``/5s``, ``/10m``, ``/2d``), and for a quota
``mo`` or ``month`` (one calendar month).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, overload

from .backends.base import (
    ADAPTIVE_KEY,
    COST_KEY,
    FRONT_KEY,
    MAX_PRIORITY,
    PRIORITY_KEY,
    QUOTA_KEY,
    RATE_KEY,
    UNITS_KEY,
    WEIGHT_KEY,
    Meta,
)
from .backoff import Adaptive
from .exceptions import ConfigurationError, InvalidLimit
from .names import MAX_LIMIT, validate_limit

#: Seconds in each period unit a rate or a quota may be written per; 0: a calendar month
#: (quotas only).
PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "mo": 0, "month": 0}
#: Longest period of a rate or quota window (a window of a year at most).
MAX_PERIOD = 366 * 86400
#: Most rates, and most quotas, one semaphore may have.
MAX_WINDOWS = 8
#: Most starts one burst may allow.
MAX_BURST = 100_000
#: Largest count of a quota, and largest units one start may spend.
MAX_UNITS = 10**12
#: Largest fair-share weight.
MAX_WEIGHT = 1000
_COUNT_PER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+)?\s*([a-z]+)\s*$", re.ASCII)
_PERIODS_TEXT = "s, m, h, d or w, with an optional number before it (/5s, /10m)"
#: Seconds from the Unix epoch (a Thursday) to the first Monday: weeks start on Mondays.
_MONDAY = 4 * 86400


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{what} must be an integer, not {value!r}")
    if not low <= value <= high:
        raise ConfigurationError(f"{what} must be from {low} to {high}, not {value}")
    return value


def is_template(value: Any) -> bool:
    return isinstance(value, str) and "{" in value


def check_template(value: str, what: str, example: str = "{gigabytes}") -> str:
    """``value`` if it is a template naming at least one of the task's parameters (a constant
    would give every call the same value), else ConfigurationError."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        raise ConfigurationError(f"{what} {value!r} is not a valid template: {exc}") from None
    if not names or any(not f or f[0].isdigit() for f in names):
        raise ConfigurationError(f"{what} {value!r} must name the task's parameters, "
                                 f"e.g. '{example}'")
    return value


@overload
def validate_cost(value: int, what: str = ..., limit: Optional[int] = ...) -> int: ...
@overload
def validate_cost(value: Any, what: str = ..., limit: Optional[int] = ...) -> Any: ...
def validate_cost(value: Any, what: str = "semaphore_cost",
                  limit: Optional[int] = None) -> Any:
    """An int from 1 to the limit (``limit``, when known; else the largest limit), or a
    template over the task's parameters (``"{gigabytes}"``) that must fill in to one."""
    if isinstance(value, str):
        if not is_template(value):
            raise ConfigurationError(f"{what} must be an integer or a template such as "
                                     f"'{{gigabytes}}', not {value!r}")
        return check_template(value, what)
    cost = _int(value, what, 1, MAX_LIMIT)
    if limit is not None and cost > limit:
        raise ConfigurationError(f"{what} {cost} is above the limit ({limit}): the task "
                                 "could never be admitted")
    return cost


def filled_cost(text: str, what: str, limit: int) -> int:
    """The cost a filled-in template gives (a decimal integer), checked against ``limit``."""
    try:
        cost = int(text.strip())
    except ValueError:
        raise ConfigurationError(f"{what} filled in to {text!r}, not an integer") from None
    return validate_cost(cost, what, limit)


def validate_priority(value: Any, what: str = "semaphore_priority") -> int:
    """An int from ``-MAX_PRIORITY`` to ``MAX_PRIORITY`` (higher first)."""
    return _int(value, what, -MAX_PRIORITY, MAX_PRIORITY)


def _period(number: Optional[str], unit: str, text: str, what: str,
            months: bool) -> int:
    """Seconds of one period as written (``5s``, ``h``, ``mo``); 0 for a calendar month."""
    if unit not in PERIODS or (not months and PERIODS[unit] == 0):
        allowed = _PERIODS_TEXT + (", or mo (a calendar month)" if months else "")
        raise ConfigurationError(f"{what} {text!r}: unknown period {unit!r}; periods are "
                                 f"{allowed}")
    if PERIODS[unit] == 0:
        if number is not None and int(number) != 1:
            raise ConfigurationError(f"{what} {text!r}: a month window is one calendar "
                                     "month ('/mo'), not several")
        return 0
    seconds = (int(number) if number is not None else 1) * PERIODS[unit]
    if not 1 <= seconds <= MAX_PERIOD:
        raise ConfigurationError(f"{what} {text!r}: the period must be from 1 second to "
                                 f"{MAX_PERIOD // 86400} days")
    return seconds


def _counts_per_period(value: Any, what: str, example: str, months: bool
                       ) -> List[Tuple[str, int, str]]:
    """``(count as written, period seconds, item as written)`` of each ``;``-separated item
    of ``value``; ConfigurationError naming ``what`` for anything else."""
    items = [item.strip() for item in value.split(";")] if isinstance(value, str) else None
    if items is not None:
        items = [item for item in items if item]
    if not items:
        raise ConfigurationError(f"{what} must be a count per period such as {example}, "
                                 f"not {value!r}")
    if len(items) > MAX_WINDOWS:
        raise ConfigurationError(f"{what} {value!r}: at most {MAX_WINDOWS} periods")
    out: List[Tuple[str, int, str]] = []
    for item in items:
        match = _COUNT_PER.match(item)
        if match is None:
            raise ConfigurationError(f"{what} must be a count per period such as {example}, "
                                     f"not {value!r} ({item!r})")
        count, number, unit = match.groups()
        period = _period(number, unit, item, what, months)
        twin = next((seen for _, period_seen, seen in out if period_seen == period), None)
        if twin is not None:
            raise ConfigurationError(f"{what} {value!r} gives two counts for one period "
                                     f"({twin!r} and {item!r})")
        out.append((count, period, item))
    return out


def parse_rates(value: Any, what: str = "semaphore_rate") -> Optional[Tuple[float, ...]]:
    """``"100/s"``, ``"30/m"``, ``"1000/h"``, ``"20000/d"``, ``"5/10s"``, or several
    separated by ``;`` (``"10/s; 500/m"``): each a positive count (up to 1,000,000, a decimal
    fraction allowed) per period -> the seconds between starts of each, in the order written;
    None -> None."""
    if value is None:
        return None
    intervals = []
    for count_text, period, item in _counts_per_period(value, what, "'100/s' or "
                                                       "'10/s; 500/m'", months=False):
        count = float(count_text)
        if not 0 < count <= 1_000_000:
            raise ConfigurationError(f"{what} {item!r}: the count must be above 0 and at "
                                     "most 1000000")
        intervals.append(period / count)
    return tuple(intervals)


def parse_rate(value: Any, what: str = "semaphore_rate") -> Optional[float]:
    """One rate (:func:`parse_rates`) -> seconds between starts; None -> None. Several rates
    are refused: read them with :func:`parse_rates`."""
    intervals = parse_rates(value, what)
    if intervals is None:
        return None
    if len(intervals) > 1:
        raise ConfigurationError(f"{what} {value!r} gives several rates where one is "
                                 "expected")
    return intervals[0]


def rates_meta(intervals: Optional[Sequence[float]], burst: int) -> Optional[
        Tuple[Tuple[float, int], ...]]:
    """``((interval, burst), ...)`` for the rates :func:`parse_rates` read (each allows
    ``burst`` starts at once); None without rates."""
    if not intervals:
        return None
    return tuple((interval, burst) for interval in intervals)


@dataclass(frozen=True)
class Quota:
    """At most ``count`` units started per calendar window of ``period`` seconds (0: one
    calendar month), as written in ``text``."""

    count: int
    period: int
    text: str

    def offset(self, tz: Optional[str] = None, now: Optional[float] = None) -> int:
        """``offset_s`` of this quota's windows (:mod:`.backends.base`, ``QUOTA_KEY``): for a
        window of whole days or a month, the UTC offset of time zone ``tz`` at ``now`` (so the
        day starts at that zone's midnight); weeks start on Mondays; 0 for shorter windows
        (aligned to the UTC epoch)."""
        if self.period and self.period % 86400:
            return 0
        shift = _utc_offset(tz, now)
        if self.period == 0:
            return shift
        if self.period % (7 * 86400) == 0:
            shift -= _MONDAY  # a window starts at floor((t + offset) / period) * period - offset
        return shift % self.period

    def window(self, tz: Optional[str] = None, now: Optional[float] = None
               ) -> List[int]:
        """``[count, period_s, offset_s]``, as the meta carries it."""
        return [self.count, self.period, self.offset(tz, now)]


def parse_quota(value: Any, what: str = "semaphore_quota") -> Optional[Tuple[Quota, ...]]:
    """``"1000/h"``, ``"1000/h; 20000/d"``, ``"50/5s"``, ``"90000/m"``, ``"1000000/mo"``: each
    a whole count from 1 to 10**12 per period (``s``, ``m``, ``h``, ``d``, ``w`` with an
    optional number before it; ``mo`` or ``month``: one calendar month); None -> None."""
    if value is None:
        return None
    quotas = []
    for count_text, period, item in _counts_per_period(value, what, "'1000/h' or "
                                                       "'1000/h; 20000/d'", months=True):
        if not count_text.isdigit() or not 1 <= int(count_text) <= MAX_UNITS:
            raise ConfigurationError(f"{what} {item!r}: the count must be a whole number "
                                     f"from 1 to {MAX_UNITS}")
        quotas.append(Quota(int(count_text), period, item))
    return tuple(quotas)


def validate_quota_tz(value: Any, what: str = "semaphore_quota_tz") -> str:
    """An IANA time zone name (``"UTC"``, ``"Europe/Paris"``, ``"America/New_York"``) that
    :mod:`zoneinfo` knows."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be an IANA time zone name such as "
                                 f"'Europe/Paris', not {value!r}")
    if value != "UTC":
        _zone(value, what)
    return value


def _zone(name: str, what: str = "semaphore_quota_tz") -> Any:
    from zoneinfo import ZoneInfo

    try:
        return ZoneInfo(name)
    except (ValueError, LookupError, OSError) as exc:  # ZoneInfoNotFoundError is a KeyError
        raise ConfigurationError(f"{what} {name!r} is not a time zone zoneinfo knows "
                                 f"(an IANA name such as 'Europe/Paris'): {exc}") from None


def _utc_offset(tz: Optional[str], now: Optional[float]) -> int:
    """Seconds east of UTC of zone ``tz`` at Unix time ``now`` (the current time by
    default); 0 for None and UTC."""
    if tz is None or tz == "UTC":
        return 0
    moment = (datetime.now(timezone.utc) if now is None
              else datetime.fromtimestamp(now, timezone.utc))
    offset = moment.astimezone(_zone(tz)).utcoffset()
    return 0 if offset is None else int(offset.total_seconds())


@overload
def validate_units(value: int, what: str = ...,
                   quotas: Optional[Sequence[Quota]] = ...) -> int: ...
@overload
def validate_units(value: Any, what: str = ...,
                   quotas: Optional[Sequence[Quota]] = ...) -> Any: ...
def validate_units(value: Any, what: str = "semaphore_units",
                   quotas: Optional[Sequence[Quota]] = None) -> Any:
    """The units of the rates and quotas a start spends, as estimated at admission: an int
    from 1 to 10**12 (and to the smallest quota's count, when ``quotas`` are known), or a
    template over the task's parameters (``"{max_tokens}"``) that must fill in to one."""
    if isinstance(value, str):
        if not is_template(value):
            raise ConfigurationError(f"{what} must be an integer or a template such as "
                                     f"'{{max_tokens}}', not {value!r}")
        return check_template(value, what, "{max_tokens}")
    units = _int(value, what, 1, MAX_UNITS)
    check_units_fit(units, quotas, what)
    return units


def check_units_fit(units: Any, quotas: Optional[Sequence[Quota]],
                    what: str = "semaphore_units") -> None:
    """Refuse ``units`` (an int) above the count of one of ``quotas``: such a start could
    never be admitted. Templates are checked when filled in (:func:`filled_units`)."""
    if not isinstance(units, int) or not quotas:
        return
    smallest = min(quotas, key=lambda q: q.count)
    if units > smallest.count:
        raise ConfigurationError(f"{what} {units} is above the quota {smallest.text!r}: "
                                 "the task could never be admitted")


def filled_units(text: str, what: str, quotas: Optional[Sequence[Quota]] = None) -> int:
    """The units a filled-in template gives (a decimal integer), checked like an int."""
    try:
        units = int(text.strip())
    except ValueError:
        raise ConfigurationError(f"{what} filled in to {text!r}, not an integer") from None
    return validate_units(units, what, quotas)


def validate_settle_units(value: Any, what: str = "units") -> int:
    """The units a holder actually spent (``Lease.settle``): an int from 0 to 10**12."""
    return _int(value, what, 0, MAX_UNITS)


LimitValue = Union[int, Adaptive]


def validate_limit_value(value: Any, what: str = "limit") -> LimitValue:
    """A limit as a task's ``limit=``, ``semaphore_limits`` or :class:`.Semaphore` take it:
    an int from 1 to 100,000, or an :class:`.Adaptive` (checked when it was made)."""
    if isinstance(value, Adaptive):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLimit(f"{what} must be a positive integer or an Adaptive(min=..., "
                           f"max=...), not {value!r}")
    return validate_limit(value, what)


def limit_number(value: LimitValue) -> int:
    """The limit an acquire declares for ``value``: the int, or an Adaptive's ``max``."""
    return value.max if isinstance(value, Adaptive) else value


def adaptive_of(value: Any) -> Optional[Adaptive]:
    """``value`` if it is an :class:`.Adaptive` limit, else None."""
    return value if isinstance(value, Adaptive) else None


def validate_burst(value: Any, what: str = "semaphore_burst") -> int:
    """Starts allowed at once by a rate: an int from 1 to ``MAX_BURST``."""
    return _int(value, what, 1, MAX_BURST)


def validate_fair_weights(value: Any, what: str = "semaphore_fair_weights") -> Any:
    """None; a dict from fair keys (``"*"``: every other key) to weights (ints from 1 to
    ``MAX_WEIGHT``); or a template over the task's parameters giving the weight."""
    if value is None:
        return None
    if isinstance(value, str):
        return check_template(value, what)
    if not isinstance(value, dict) or not value:
        raise ConfigurationError(f"{what} must be a dict such as {{'gold': 3, '*': 1}} or a "
                                 f"template, not {value!r}")
    for key, weight in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"{what}: keys must be non-empty strings, not {key!r}")
        validate_weight(weight, f"{what}[{key!r}]")
    return dict(value)


def validate_weight(value: Any, what: str = "fair_weight") -> int:
    """A fair-share weight: an int from 1 to ``MAX_WEIGHT``."""
    return _int(value, what, 1, MAX_WEIGHT)


def weight_for(weights: Any, key: Optional[str], filled: Optional[str] = None) -> int:
    """The weight of fair key ``key`` under ``weights`` (a dict, or ``filled``: the template
    filled in); 1 by default."""
    if weights is None or key is None:
        return 1
    if isinstance(weights, dict):
        table: Dict[str, int] = weights  # validate_fair_weights checked it
        return table.get(key, table.get("*", 1))
    try:
        weight = int(str(filled).strip())
    except ValueError:
        raise ConfigurationError(f"semaphore_fair_weights filled in to {filled!r}, "
                                 "not an integer") from None
    return validate_weight(weight, "semaphore_fair_weights")


def traffic_meta(cost: int = 1, priority: int = 0, rate: Optional[Tuple[float, int]] = None,
                 weight: int = 1, *, rates: Optional[Sequence[Tuple[float, int]]] = None,
                 quota: Optional[Sequence[Quota]] = None, quota_tz: Optional[str] = None,
                 units: int = 1, adaptive: Optional[Adaptive] = None, front: bool = False,
                 now: Optional[float] = None) -> Meta:
    """The ``meta`` entries that carry these options (none for the defaults, so a caller
    that uses none sends exactly what it sent before).

    ``rate``: one ``(interval, burst)``; ``rates``: several (after ``rate``, if both): one
    rate is sent as ``[interval, burst]``, several as ``[[interval, burst], ...]``.
    ``quota``: the quotas (:func:`parse_quota`), sent as ``[[count, period_s, offset_s],
    ...]`` with the offsets of time zone ``quota_tz`` at ``now`` (declaration time; the
    current time by default). ``units``: the units of the rates and quotas this start
    spends. ``adaptive``: the semaphore's limit is learned. ``front``: the waiter queues
    ahead of every waiter of its priority."""
    meta: Dict[str, Any] = {}
    if cost != 1:
        meta[COST_KEY] = cost
    if priority:
        meta[PRIORITY_KEY] = priority
    every = ([rate] if rate is not None else []) + list(rates or ())
    if len(every) == 1:
        meta[RATE_KEY] = [every[0][0], every[0][1]]
    elif every:
        meta[RATE_KEY] = [[interval, burst] for interval, burst in every]
    if weight != 1:
        meta[WEIGHT_KEY] = weight
    if quota:
        meta[QUOTA_KEY] = [q.window(quota_tz, now) for q in quota]
    if units != 1:
        meta[UNITS_KEY] = units
    if adaptive is not None:
        meta[ADAPTIVE_KEY] = adaptive.meta()
    if front:
        meta[FRONT_KEY] = True
    return meta


def options_used(cost: Any = 1, rate: Any = None, priority: Any = 0,
                 weights: Any = None, *, quota: Any = None, units: Any = 1,
                 limit: Any = None) -> List[str]:
    """Names (``"cost"``, ...) of the options these values use, for
    :meth:`.backends.base.Backend.check_traffic`: ``"quota"`` for a quota, ``"units"`` for
    units other than 1, ``"adaptive"`` for a ``limit`` that is (or, a dict or list of
    limits, holds) an :class:`.Adaptive`."""
    used: List[str] = []
    if cost not in (None, 1):
        used.append("cost")
    if rate is not None:
        used.append("rate")
    if priority:
        used.append("priority")
    if weights is not None:
        used.append("fair_weight")
    if quota is not None:
        used.append("quota")
    if units not in (None, 1):
        used.append("units")
    limits = (limit.values() if isinstance(limit, dict)
              else limit if isinstance(limit, (list, tuple)) else [limit])
    if any(isinstance(one, Adaptive) for one in limits):
        used.append("adaptive")
    return used
