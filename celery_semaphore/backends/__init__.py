"""Backend registry: a URL scheme names a backend class.

:data:`SCHEMES` is the one table of built-in schemes: the class serving each, the install
extra that brings its client library, and whether a Celery broker or result backend URL of
that scheme serves as the semaphore backend as it is (``semaphore_backend`` unset). Third
parties add schemes in the ``celery_semaphore.backends`` entry point group, or at run time
with :func:`register_backend`. A backend may also be named by a dotted
``"package.module:Class"`` path (it is then constructed with that string as its URL and its
options as keywords).
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Type

from ..exceptions import UnknownBackend
from ..urls import check_url, mask_url
from .base import Backend

ENTRY_POINT_GROUP = "celery_semaphore.backends"

@dataclass(frozen=True)
class Scheme:
    """A built-in URL scheme: ``target`` (``module:Class``) serves it, ``extra`` is the
    install extra its client library comes with (None: nothing to install); ``broker`` and
    ``result``: a Celery broker / result backend URL of this scheme is a semaphore backend
    URL as it is."""

    target: str
    extra: Optional[str] = None
    broker: bool = False
    result: bool = False


_REDIS = Scheme("celery_semaphore.backends.redis:RedisBackend", "redis", broker=True,
                result=True)
#: Sentinel and Cluster: no Celery broker or result URL has these schemes (a ``sentinel://``
#: broker becomes a ``redis+sentinel://`` URL in :meth:`Settings.backend_url`).
_REDIS_HA = Scheme("celery_semaphore.backends.redis:RedisBackend", "redis")
_TOKENS = Scheme("celery_semaphore.backends.rabbitmq:TokenBackend", "amqp", broker=True)
_SLOTS = Scheme("celery_semaphore.backends.rabbitmq:SlotQueueBackend", "amqp")
_CONSUL = Scheme("celery_semaphore.backends.consul:ConsulBackend", "consul")
_POSTGRES = Scheme("celery_semaphore.backends.postgres:PostgresBackend", "postgres")

#: Every built-in scheme.
SCHEMES: Dict[str, Scheme] = {
    "redis": _REDIS, "rediss": _REDIS, "redis+socket": _REDIS,
    "redis+sentinel": _REDIS_HA, "rediss+sentinel": _REDIS_HA,
    "redis+cluster": _REDIS_HA, "rediss+cluster": _REDIS_HA,
    "amqp": _TOKENS, "amqps": _TOKENS, "pyamqp": _TOKENS,
    "amqp+slots": _SLOTS, "amqps+slots": _SLOTS,
    "consul": _CONSUL, "consuls": _CONSUL,
    "postgresql": _POSTGRES, "postgres": _POSTGRES,
    "sqlite": Scheme("celery_semaphore.backends.sqlite:SQLiteBackend"),
    "memory": Scheme("celery_semaphore.backends.memory:MemoryBackend"),
}
_registered: Dict[str, Any] = {}
_instances: Dict[Tuple[int, str, Tuple[Tuple[str, Any], ...]], Backend] = {}
_lock = threading.Lock()


def register_backend(scheme: str, backend: "Type[Backend] | str") -> None:
    """Serve URLs with ``scheme`` by ``backend`` (a class or a ``module:Class`` path)."""
    _registered[scheme.lower()] = backend


def _entry_points() -> Dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name.lower(): ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> Dict[str, Any]:
    """Every scheme a URL may use, mapped to what serves it."""
    schemes: Dict[str, Any] = {name: scheme.target for name, scheme in SCHEMES.items()}
    schemes.update(_entry_points())
    schemes.update(_registered)
    return schemes


def _load(target: Any) -> Type[Backend]:
    cls: Type[Backend]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    elif hasattr(target, "load"):  # an entry point
        cls = target.load()
    else:
        cls = target
    return cls


def backend_class(url: str) -> Type[Backend]:
    """The class serving ``url``; ``url`` may also be a dotted ``module:Class`` path.
    A malformed URL raises ConfigurationError naming the problem, password masked."""
    if isinstance(url, str) and ":" in url and "://" not in url:
        try:
            return _load(url)
        except (ImportError, AttributeError) as exc:
            raise UnknownBackend(f"cannot import semaphore backend {url!r}: {exc}") from exc
    scheme = check_url(url).scheme.lower()
    schemes = known_schemes()
    if scheme not in schemes:
        raise UnknownBackend(
            f"no semaphore backend for URL {mask_url(url)!r}; "
            f"known schemes: {', '.join(sorted(schemes))}"
        )
    try:
        return _load(schemes[scheme])
    except ImportError as exc:
        raise UnknownBackend(
            f"the {scheme}:// semaphore backend cannot be loaded ({exc}); is its extra "
            f"installed? pip install 'celery-semaphore[{_extra(scheme)}]'"
        ) from exc


def _extra(scheme: str) -> str:
    builtin = SCHEMES.get(scheme)
    return builtin.extra if builtin is not None and builtin.extra else "all"


def get_backend(url: "str | Backend", **options: Any) -> Backend:
    """The process-wide backend instance for ``url`` and ``options`` (created on first use).

    Instances are per process: a forked child gets its own connections and listener.
    """
    if isinstance(url, Backend):
        return url
    key = (os.getpid(), url, tuple(sorted(options.items())))
    with _lock:
        backend = _instances.get(key)
        if backend is None:
            backend = backend_class(url)(url, **options)
            _instances[key] = backend
        return backend


def close_all() -> None:
    """Close every backend instance this process created."""
    with _lock:
        instances = [b for (pid, _, _), b in _instances.items() if pid == os.getpid()]
        _instances.clear()
    for backend in instances:
        backend.close()


__all__ = ["SCHEMES", "Backend", "Scheme", "backend_class", "close_all", "get_backend",
           "known_schemes", "register_backend"]
