"""Beyond a count: costs, rates, priorities and fair-share weights (validation and meta).

The rules themselves live in the backends (:mod:`.backends.base`, "Costs", "Rate",
"Priorities", "Weights"); a caller's options travel in the ``meta`` of its acquire, under the
keys defined there. This module checks the options where they are written and builds that
meta. Every check raises :class:`ConfigurationError` naming the option and the bad value.
"""

from __future__ import annotations

import re
import string
from typing import Any, Dict, List, Optional, Tuple, overload

from .backends.base import COST_KEY, MAX_PRIORITY, PRIORITY_KEY, RATE_KEY, WEIGHT_KEY, Meta
from .exceptions import ConfigurationError
from .names import MAX_LIMIT

#: Seconds in each period a rate may be written per.
PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: Most starts one burst may allow.
MAX_BURST = 100_000
#: Largest fair-share weight.
MAX_WEIGHT = 1000
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([smh])\s*$")


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


def parse_rate(value: Any, what: str = "semaphore_rate") -> Optional[float]:
    """``"100/s"``, ``"30/m"``, ``"1000/h"`` (a positive count per second, minute or hour)
    -> seconds between starts; None -> None."""
    if value is None:
        return None
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigurationError(f"{what} must be a count per period such as '100/s', "
                                 f"'30/m' or '1000/h', not {value!r}")
    count = float(match.group(1))
    if not 0 < count <= 1_000_000:
        raise ConfigurationError(f"{what} {value!r}: the count must be above 0 and at most "
                                 "1000000")
    return PERIODS[match.group(2)] / count


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
                 weight: int = 1) -> Meta:
    """The ``meta`` entries that carry these options (none for the defaults, so a caller
    that uses none sends exactly what it sent before)."""
    meta: Dict[str, Any] = {}
    if cost != 1:
        meta[COST_KEY] = cost
    if priority:
        meta[PRIORITY_KEY] = priority
    if rate is not None:
        meta[RATE_KEY] = [rate[0], rate[1]]
    if weight != 1:
        meta[WEIGHT_KEY] = weight
    return meta


def options_used(cost: Any = 1, rate: Any = None, priority: Any = 0,
                 weights: Any = None) -> List[str]:
    """Names (``"cost"``, ...) of the options these values use, for
    :meth:`.backends.base.Backend.check_traffic`."""
    used: List[str] = []
    if cost not in (None, 1):
        used.append("cost")
    if rate is not None:
        used.append("rate")
    if priority:
        used.append("priority")
    if weights is not None:
        used.append("fair_weight")
    return used
