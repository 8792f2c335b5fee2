"""Validation of semaphore names and limits, shared by the client, the gate and the CLI."""

from __future__ import annotations

import re

from .exceptions import ConfigurationError, InvalidLimit, InvalidName

#: Longest name, in UTF-8 bytes. Leaves room for key prefixes within RabbitMQ's 255-byte
#: queue names and Redis/Consul key conventions.
MAX_NAME_BYTES = 200
#: Largest limit. Backends keep per-slot state (fencing epochs; RabbitMQ a token message or a
#: queue per slot), and Redis stores numbers above 1e15 in a form it cannot read back as ints.
MAX_LIMIT = 100_000
#: Shortest lease, in seconds. A lease is renewed every third of its TTL and must outlive a
#: round trip to the backend; below this the backend could expire it before the holder knows
#: it has it (a TTL of 1e-7 s let two holders of a limit-1 semaphore in at once).
MIN_LEASE_TTL = 0.1

# Whitespace and control characters cannot be typed safely on a command line; braces would
# break Redis Cluster hash tags; glob characters would break key scans; "/" would nest Consul
# keys under another semaphore's prefix.
_FORBIDDEN = re.compile(r"[\s{}\[\]*?\\/\x00-\x1f\x7f]")


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a semaphore on every backend, else raise InvalidName."""
    if not isinstance(name, str):
        raise InvalidName(f"semaphore name must be a string, not {type(name).__name__}")
    if not name:
        raise InvalidName("semaphore name must not be empty")
    size = len(name.encode("utf-8"))
    if size > MAX_NAME_BYTES:
        raise InvalidName(
            f"semaphore name is {size} bytes long; the most is {MAX_NAME_BYTES}: {name[:40]!r}..."
        )
    bad = _FORBIDDEN.search(name)
    if bad:
        raise InvalidName(
            f"semaphore name {name!r} contains {bad.group()!r}; names may not contain "
            "whitespace, control characters or any of {}[]*?\\/"
        )
    invisible = next((ch for ch in name if not ch.isprintable()), None)
    if invisible is not None:  # zero-width and other format characters, private use, ...
        raise InvalidName(
            f"semaphore name {name!r} contains the invisible character "
            f"U+{ord(invisible):04X}; names must be printable"
        )
    return name


def validate_ttl(ttl: object, what: str = "ttl") -> float:
    """Return ``ttl`` as float seconds if it is a finite number from MIN_LEASE_TTL up, else
    raise ConfigurationError."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl == ttl:
        raise ConfigurationError(f"{what} must be a number of seconds, not {ttl!r}")
    if not MIN_LEASE_TTL <= ttl < float("inf"):
        raise ConfigurationError(
            f"{what} must be a positive, finite number of seconds, at least {MIN_LEASE_TTL:g}, "
            f"not {ttl!r}")
    return float(ttl)


def validate_limit(limit: object, what: str = "limit") -> int:
    """Return ``limit`` if it is an int from 1 to MAX_LIMIT (bools rejected), else raise
    InvalidLimit."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidLimit(f"{what} must be a positive integer, not {limit!r}")
    if limit < 1:
        raise InvalidLimit(f"{what} must be a positive integer, not {limit}")
    if limit > MAX_LIMIT:
        raise InvalidLimit(f"{what} must be at most {MAX_LIMIT}, not {limit}")
    return limit


def validate_template(template: object, what: str = "semaphore") -> str:
    """Return a name template (``"api:{customer_id}"``) whose filled-in names could be valid."""
    import string

    if not isinstance(template, str):
        raise InvalidName(f"{what} must be a string, not {template!r}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidName(f"{what} {template!r} is not a valid template: {exc}") from None
    sample = []
    for literal, field_name, _, _ in parts:
        sample.append(literal)
        if field_name is None:
            continue
        if not field_name or field_name[0].isdigit():
            raise InvalidName(f"{what} {template!r}: a template field needs a parameter name")
        sample.append("x")
    validate_name("".join(sample))
    return template
