"""Backend URLs: checked once where they enter, and shown with their secrets masked."""

from __future__ import annotations

import re
from typing import List
from urllib.parse import SplitResult, urlsplit

from .exceptions import ConfigurationError

_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/]*:)[^/]*@")
_TOKEN = re.compile(r"([?&](?:token|\w*password)=)[^&#]*", re.IGNORECASE)


def mask_url(url: object) -> str:
    """``url`` with the password of its user info and any ``token=``/``password=`` query
    value replaced by ``**``. Never raises, whatever ``url`` holds."""
    text = str(url)
    return _TOKEN.sub(r"\1**", _PASSWORD.sub(r"\1**@", text))


#: Schemes whose URL may list several hosts (libpq: ``postgresql://h1:5432,h2:5433/db``).
MULTI_HOST_SCHEMES = ("postgresql", "postgres")
#: Schemes with these endings name several hosts: ``redis+sentinel://h1:26379,h2:26379/...``.
MULTI_HOST_SUFFIXES = ("+sentinel", "+cluster")


def _hosts(parts: SplitResult) -> List[str]:
    """The ``host:port`` parts of a URL's network location."""
    hostlist = parts.netloc.rpartition("@")[2]
    scheme = parts.scheme.lower()
    if scheme in MULTI_HOST_SCHEMES or scheme.endswith(MULTI_HOST_SUFFIXES):
        return [host.strip() for host in hostlist.split(",")]
    return [hostlist]


def check_url(url: object, what: str = "semaphore backend URL") -> SplitResult:
    """Parse ``url`` or raise ConfigurationError naming what is wrong (password masked):
    empty, not a string, no scheme, a malformed host or a port that is not 0-65535. PostgreSQL
    URLs and schemes ending in ``+sentinel`` or ``+cluster`` take a comma-separated list of
    hosts, each checked (the result's ``port`` is then meaningless)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"{what} must be a non-empty string, not {url!r}")
    try:
        parts = urlsplit(url)
        for host in _hosts(parts):
            urlsplit(f"//{host}").port  # noqa: B018 -- ValueError: port out of range or not a number
    except ValueError as exc:
        raise ConfigurationError(f"{what} {mask_url(url)!r} is malformed: {exc}") from None
    if not parts.scheme or "://" not in url:
        raise ConfigurationError(f"{what} {mask_url(url)!r} has no scheme (like redis://)")
    return parts
