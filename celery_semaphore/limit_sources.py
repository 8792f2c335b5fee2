"""Where a semaphore's limit comes from: an int, an :class:`.Adaptive` limit (learned in the
backend from the calls' outcomes), or a function of the task's arguments (one limit per
customer, from their plan), given as a task's ``limit=`` or in ``semaphore_limits``, whose keys
may be names, templates, or glob patterns over the keys of a template (``"api:premium-*"``).

:class:`LimitFunctions` evaluates a function where the key is filled (the worker's gate, and a
process that parks on send), once per key for ``semaphore_limit_ttl`` seconds: a hot key does
not call it per task. Its error (it raises, or returns something that is not a limit) fails
that call alone, with a message naming the function and the key.
"""

from __future__ import annotations

import inspect
import time
from fnmatch import fnmatchcase
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

from .backoff import Adaptive
from .exceptions import ConfigurationError, InvalidLimit, InvalidName
from .names import validate_name
from .traffic import validate_limit_value

#: What a limit may be given as.
LimitSource = Union[int, Adaptive, Callable[..., Any]]
#: Keys a function's limits are remembered for at most (a template's keys: the recent ones).
MAX_CACHED = 10_000


def limit_source(value: Any, what: str = "limit") -> LimitSource:
    """``value`` if it can give a limit: an int from 1 to 100,000, an :class:`.Adaptive`, or a
    function (called with the task's arguments by name, returning one of those); else
    :class:`.InvalidLimit` naming ``what``."""
    if callable(value) and not isinstance(value, (type, Adaptive)):
        return value  # type: ignore[no-any-return]
    try:
        return validate_limit_value(value, what)
    except InvalidLimit as exc:
        raise InvalidLimit(f"{exc}; or a function of the task's arguments that returns "
                           "one") from None


def describe_limit(value: Any) -> str:
    """How a limit reads in the worker's start-up line."""
    if isinstance(value, Adaptive):
        return f"adaptive {value.min}..{value.max}"
    if callable(value):
        return f"from {_name_of(value)}()"
    return str(value)


def is_pattern(key: str) -> bool:
    """A ``semaphore_limits`` key with a glob character (``*``, ``?``): it matches keys."""
    return "*" in key or "?" in key


def validate_limits_key(key: Any) -> str:
    """A ``semaphore_limits`` key: a name, a template, or a glob pattern over names."""
    if isinstance(key, str) and is_pattern(key):
        try:
            validate_name(key.replace("*", "x").replace("?", "x"))
        except InvalidName as exc:
            raise InvalidName(f"pattern {key!r}: {exc}") from None
        return key
    from .names import validate_template

    return validate_template(key, "name")


def patterns_of(limits: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The pattern entries of ``semaphore_limits``, in the order written (the first that
    matches a key decides)."""
    return [(key, value) for key, value in limits.items() if is_pattern(key)]


def matching(patterns: List[Tuple[str, Any]], name: str) -> Any:
    for pattern, value in patterns:
        if fnmatchcase(name, pattern):
            return value
    return None


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


class LimitFunctions:
    """Calls limit functions, remembering each key's limit for a while (module docs). Not
    thread-safe: one per thread that resolves guards."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cache: Dict[Tuple[str, str], Tuple[float, Union[int, Adaptive]]] = {}
        self._accepts: Dict[Any, Optional[FrozenSet[str]]] = {}

    def value(self, fn: Callable[..., Any], task_name: str, key: str,
              arguments: Dict[str, Any], ttl: float) -> Union[int, Adaptive]:
        """The limit ``fn`` gives semaphore ``key`` of task ``task_name`` called with
        ``arguments`` (its parameters by name), from the cache when given less than ``ttl``
        seconds ago; ConfigurationError naming the function and the key when it fails."""
        now = self.clock()
        cached = self._cache.get((task_name, key))
        if cached is not None and now < cached[0]:
            return cached[1]
        accepts = self._accepted(fn)
        given = arguments if accepts is None else {k: v for k, v in arguments.items()
                                                    if k in accepts}
        try:
            result = fn(**given)
        except Exception as exc:
            raise ConfigurationError(
                f"task {task_name}: limit function {_name_of(fn)} failed for semaphore "
                f"{key!r}: {type(exc).__name__}: {exc}") from None
        try:
            limit = validate_limit_value(result, f"the limit {_name_of(fn)} returned")
        except (InvalidLimit, ConfigurationError) as exc:
            raise ConfigurationError(f"task {task_name}: semaphore {key!r}: {exc}") from None
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[(task_name, key)] = (now + ttl, limit)
        return limit

    def _accepted(self, fn: Callable[..., Any]) -> Optional[FrozenSet[str]]:
        """The parameter names ``fn`` takes by name (None: any, a ``**kwargs``)."""
        try:
            return self._accepts[fn]
        except (KeyError, TypeError):
            pass
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            accepts: Optional[FrozenSet[str]] = None
        else:
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
                accepts = None
            else:
                accepts = frozenset(p.name for p in parameters if p.kind in (
                    inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
        try:
            self._accepts[fn] = accepts
        except TypeError:  # not hashable: looked at every time
            pass
        return accepts
