"""``redis://``, ``rediss://``, ``redis+socket://``: the fair semaphore of "Redis in Action",
done atomically.

Every operation is one Lua script (``redis_*.lua`` beside this file, each prefixed with
``redis_prelude.lua``), so no client can steal a slot between two steps; time comes from the
server's ``TIME``, never a client clock; holders' and waiters' scores are absolute expiries.
The eight keys of a semaphore share the hash tag ``{name}`` (``<prefix>{name}:holders`` ...),
so one script touches one Redis Cluster slot, and all expire after ``idle_ttl`` without use.

Wake-ups: a script that makes waiters admissible publishes ``name\\nholder`` on the channel
``<prefix>wake:<client id>`` of each waiter's process; one thread per process listens.

Replication is asynchronous: after a failover the new primary may not have seen the latest
grants, so a slot can be granted twice. Fencing tokens are the defence (see the README).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional

import redis
from kombu.utils.url import maybe_sanitize_url

from ..exceptions import BackendUnavailable
from .base import Attempt, Backend, Grant, HolderInfo, Meta, SemaphoreStatus, WaiterInfo

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SUFFIXES = ("cfg", "holders", "hinfo", "queue", "wexp", "winfo", "epochs", "declared")
_SCRIPTS = ("acquire", "release", "renew", "cancel", "resize", "status", "reset")


def _source(name: str) -> str:
    with open(os.path.join(_HERE, f"redis_{name}.lua")) as f:
        return f.read()


def _redis_url(url: str) -> str:
    """kombu's ``redis+socket:///path`` is redis-py's ``unix:///path``."""
    if url.startswith("redis+socket://"):
        return "unix://" + url[len("redis+socket://"):]
    return url


class RedisBackend(Backend):
    """Semaphores in Redis (>= 6.2). Thread-safe; one connection pool per process."""

    schemes = ("redis", "rediss", "redis+socket")

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 5.0,
        socket_connect_timeout: float = 5.0,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        self.client = redis.Redis.from_url(
            _redis_url(url), socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout, health_check_interval=30,
            decode_responses=True,
        )
        prelude = _source("prelude")
        self._scripts = {
            name: self.client.register_script(prelude + "\n" + _source(name))
            for name in _SCRIPTS
        }
        self._channel_prefix = f"{self.key_prefix}wake:"
        self._listener: Optional[threading.Thread] = None
        self._pubsub: Any = None
        self._closed = threading.Event()
        self._listen_lock = threading.Lock()

    # -- plumbing ----------------------------------------------------------------------------

    def _keys(self, name: str) -> List[str]:
        return [f"{self.key_prefix}{{{name}}}:{suffix}" for suffix in _SUFFIXES]

    def _unavailable(self, exc: Exception) -> BackendUnavailable:
        return BackendUnavailable(
            f"semaphore backend {maybe_sanitize_url(self.url)} unreachable: {exc}"
        )

    def _call(self, script: str, name: str, *args: Any) -> Any:
        argv = [int(self.idle_ttl * 1000), self._channel_prefix, name, *args]
        try:
            return self._scripts[script](keys=self._keys(name), args=argv)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc

    # -- operations --------------------------------------------------------------------------

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool
    ) -> Attempt:
        reply = self._call(
            "acquire", name, holder, limit, int(ttl * 1e6), json.dumps(meta or {}),
            1 if wait else 0, self.client_id, int(self.waiter_ttl * 1e6),
        )
        if reply[0] == 1:
            _, slot, epoch, expires, now, current_limit = reply
            return Attempt(
                Grant(slot, epoch, expires / 1e6, (expires - now) / 1e6), limit=current_limit
            )
        _, position, retry_after, _, current_limit = reply
        return Attempt(
            None,
            None if position < 0 else position,
            None if retry_after < 0 else retry_after / 1e6,
            current_limit,
        )

    def release(self, name: str, holder: str) -> bool:
        return self._call("release", name, holder) == 1

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        expires = self._call("renew", name, holder, int(ttl * 1e6))
        return None if expires < 0 else expires / 1e6

    def verify(self, name: str, holder: str) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.time()
            pipe.zscore(self._keys(name)[1], holder)
            (seconds, micros), expires = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        return expires is not None and expires > seconds * 1e6 + micros

    def cancel(self, name: str, holder: str) -> None:
        self._call("cancel", name, holder)

    def resize(self, name: str, limit: int) -> bool:
        return self._call("resize", name, limit) == 1

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        reply = self._call("status", name)
        if not reply:
            return None
        _, limit, declared, holders, waiters = reply
        holder_infos = []
        for i in range(0, len(holders), 3):
            slot, epoch, since, meta = holders[i + 2].split("\n", 3)
            holder_infos.append(HolderInfo(
                holders[i], int(slot), int(epoch), int(since) / 1e6,
                float(holders[i + 1]) / 1e6, json.loads(meta),
            ))
        waiter_infos = []
        for i in range(0, len(waiters), 3):
            _, since, meta = waiters[i + 2].split("\n", 2)
            waiter_infos.append(WaiterInfo(
                waiters[i], int(float(waiters[i + 1])), int(since) / 1e6, json.loads(meta)
            ))
        return SemaphoreStatus(
            name=name,
            limit=int(limit),
            declared={int(declared[i]): int(declared[i + 1]) / 1e6
                      for i in range(0, len(declared), 2)},
            holders=tuple(sorted(holder_infos, key=lambda h: h.slot)),
            waiters=tuple(waiter_infos),
        )

    def names(self) -> List[str]:
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.key_prefix)
        start, end = len(self.key_prefix) + 1, -len("}:cfg")
        try:
            keys = self.client.scan_iter(match=f"{escaped}{{*}}:cfg", count=1000)
            return sorted({key[start:end] for key in keys})
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc

    def reset(self, name: str) -> bool:
        return self._call("reset", name) == 1

    def ping(self) -> None:
        try:
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._unavailable(exc) from exc

    # -- wake-ups ----------------------------------------------------------------------------

    def _start_listening(self) -> None:
        with self._listen_lock:
            if self._listener is not None and self._listener.is_alive():
                return
            try:
                self._pubsub = self._subscribe()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Waiters poll meanwhile; the listener keeps trying to subscribe.
                logger.warning("celery-semaphore: cannot subscribe to wake-ups: %s", exc)
                self._pubsub = None
            self._listener = threading.Thread(
                target=self._listen, name="celery-semaphore-redis-wake", daemon=True
            )
            self._listener.start()

    def _subscribe(self) -> Any:
        """Subscribe and wait for the confirmation, so no wake-up sent after this is missed."""
        pubsub = self.client.pubsub()
        pubsub.subscribe(self._channel_prefix + self.client_id)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
            if message and message["type"] == "subscribe":
                return pubsub
        pubsub.close()
        raise redis.TimeoutError("no subscribe confirmation")

    def _listen(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                if self._pubsub is None:
                    self._pubsub = self._subscribe()
                message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                backoff = 0.1
            except Exception as exc:  # connection dropped: resubscribe, waiters poll meanwhile
                if self._closed.is_set():
                    return
                logger.warning("celery-semaphore: wake-up channel lost (%s); resubscribing", exc)
                self._drop_pubsub()
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if message and message["type"] == "message":
                name, _, holder = message["data"].partition("\n")
                self._notify(name, holder)

    def _drop_pubsub(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except Exception:
                pass
            self._pubsub = None

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.join(2)
        self._drop_pubsub()
        self.client.close()


def holder_keys(backend: RedisBackend, name: str) -> Dict[str, str]:
    """The key of each structure of one semaphore (for operators and tests)."""
    return dict(zip(_SUFFIXES, backend._keys(name)))
