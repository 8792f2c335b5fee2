"""``redis://``, ``rediss://``, ``redis+socket://``, ``redis+sentinel://``,
``rediss+sentinel://``, ``redis+cluster://``, ``rediss+cluster://``: the fair semaphore of
"Redis in Action", done atomically, on one server, a Sentinel-managed master or a Redis Cluster
(:mod:`.deployments`).

Guarantees:

* Every operation is one Lua script (``scripts/<op>.lua``, each prefixed with
  ``scripts/prelude.lua``) run with one EVALSHA: no client can steal a slot between two steps.
* Time comes from the server's ``TIME``, never a client clock; leases and waiter entries are
  stored as absolute expiries (microseconds), so client clock skew changes nothing.
* The nine keys of a semaphore share the hash tag ``{name}`` (``<prefix>{name}:holders`` ...),
  and no script touches any other key but ``acquire_all`` (several semaphores' keys at once,
  see :meth:`RedisBackend.acquire_all`, never sent to a Redis Cluster): on a Redis Cluster
  every script runs on the one node serving that slot. There is no index of names:
  :meth:`RedisBackend.names` scans for the ``config`` keys (on a cluster, on every master).
  Every key has a TTL: none expires while the semaphore is used, an empty one (nobody holds
  or waits, no pinned limit, no rate start due later) leaves nothing behind
  :data:`~celery_semaphore.backends.base.EMPTY_TTL` after it empties, and any other idle one
  after ``idle_ttl``.
* An acquire and a release make the same commands however many hold: the lowest free slot and
  a task's twin come from an index of the holders (``slots``, ``htask``: scripts/prelude.lua),
  never from reading every holder; an index that disagrees with the holders is built again
  from them before it is used. Fencing epochs increase for the whole semaphore (so for each
  slot): ``config`` keeps the last one issued, one field however many slots are used.
* Wake-ups: a script that makes waiters admissible publishes ``name\\nholder`` on the channel
  ``<prefix>wake:<client id>`` of each waiter's process; one daemon thread per backend instance
  listens, resubscribing after connection loss (with Sentinel, to the current master) within
  a quarter of a second of the server's return, then waking every local waiter once (what was
  published meanwhile is lost). On a
  Redis Cluster a classic ``PUBLISH`` reaches the subscribers of every node (the cluster bus
  broadcasts it), so the listener subscribes on any one node and moves to another when that
  node fails; sharded pub/sub would need one subscription per waiter's slot, kept on the
  slot's current master. A wake-up is a hint: waiters also poll.
* Failover (Sentinel and Cluster): an operation that meets a lost connection, a read-only
  replica, ``MASTERDOWN``, ``CLUSTERDOWN`` or ``TRYAGAIN`` tries again, with backoff (50 ms
  doubling to 1 s), for up to ``failover_timeout`` seconds (10 by default) before it raises
  :class:`BackendUnavailable`: long enough for a promotion, so callers ride through it.

Errors: a lost or refused connection, a timeout, a read-only replica, ``MASTERDOWN`` (a replica
cut off from its master), ``OOM``, ``BUSY`` (another client's script overran) and ``NOPERM``
raise :class:`BackendUnavailable`, and so do a cluster that is down or cannot be reached; a
Redis Cluster node behind a ``redis://`` URL, or a server that is not a cluster node behind a
``redis+cluster://`` one, raises :class:`ConfigurationError`; anything else is redis-py's own
exception.

Not guaranteed: replication is asynchronous, with Sentinel as in a Redis Cluster. A grant
acknowledged by a master that dies before its replica received it is lost with it, and the
promoted replica can grant that slot again: two holders at once. A release or a queue entry
can be lost the same way (a slot stays taken until the lease expires; a waiter re-queues at
its next try). ``WAIT`` would only narrow the window: a replica that acknowledged can still
lose the race for promotion. Fencing tokens are the defence: an epoch the lost grant used is
never reused by the new master's grants, since epochs never fall below the server's clock in
microseconds (and the clocks of the nodes are assumed to agree within the failover time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    NoReturn,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
)
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ... import stats
from ...exceptions import BackendUnavailable, ConfigurationError
from ...urls import check_url, mask_url
from ..base import (
    ADAPTIVE_KEY,
    ALL_TRAFFIC,
    COST_KEY,
    DEFAULT_IDLE_TTL,
    DEFAULT_WAITER_TTL,
    EMPTY_TTL,
    FRONT_KEY,
    LISTENER_RETRY_FIRST,
    PRIORITY_KEY,
    QUOTA_KEY,
    RATE_KEY,
    UNITS_KEY,
    WEIGHT_KEY,
    Abandon,
    Acquire,
    AcquireAll,
    AdaptiveState,
    Attempt,
    Backend,
    EventLoopLink,
    Grant,
    HolderInfo,
    Meta,
    MultiAttempt,
    Operation,
    Outcome,
    Pause,
    PushedGrant,
    QuotaUsage,
    Release,
    Renew,
    Requests,
    Resume,
    SemaphoreStatus,
    Settle,
    WaiterInfo,
    adaptive_of,
    check_outcome,
    check_pause,
    check_units,
    cost_of,
    fair_key_of,
    front_of,
    priority_of,
    quotas_of,
    rates_of,
    units_of,
    weight_of,
)
from . import deployments

logger = logging.getLogger(__name__)
#: What an operation run by :meth:`RedisBackend._riding` returns.
Result = TypeVar("Result")

_SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
#: The keys of one semaphore, in the order the scripts receive them (see scripts/prelude.lua).
KEY_SUFFIXES = ("config", "holders", "hinfo", "queue", "wexp", "winfo", "wfair", "slots",
                "htask")
_SCRIPTS = ("acquire", "release", "renew", "cancel", "resize", "status", "reset", "verify",
            "count", "acquire_all", "unpin", "pause", "resume", "settle")
#: Errors that mean "Redis cannot serve us now". ReadOnlyError: a failover left us on a replica;
#: OutOfMemoryError: maxmemory reached with a no-eviction policy; NoPermissionError: an ACL
#: that does not allow our commands. A ``BUSY`` reply (another client's script overran) too.
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
                redis.exceptions.OutOfMemoryError, redis.exceptions.NoPermissionError,
                redis.exceptions.MasterDownError)  # a replica cut off from its master
#: Replies only a Redis Cluster node gives (MOVED and ASK are AskErrors).
_CLUSTER = (redis.exceptions.AskError, redis.exceptions.ClusterDownError,
            redis.exceptions.TryAgainError, redis.exceptions.ClusterCrossSlotError)
#: On Sentinel and Cluster: what a failover or a node restart looks like while it lasts.
_FAILOVER = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
             redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
             redis.exceptions.AskError, redis.exceptions.RedisClusterException)


#: The meta keys of the traffic options (their absence: every default).
_TRAFFIC_KEYS = frozenset({COST_KEY, PRIORITY_KEY, WEIGHT_KEY, RATE_KEY, QUOTA_KEY, UNITS_KEY,
                           FRONT_KEY, ADAPTIVE_KEY})
#: The traffic ARGV of a call that uses none (scripts/acquire.lua's [12] to [21]).
_DEFAULT_TRAFFIC: Tuple[Any, ...] = (1, 0, 1, "", "", 1, "", "", "", "")


def _us(seconds: float) -> int:
    return int(round(seconds * 1e6))


def _busy(exc: Exception) -> bool:
    # A pipeline prefixes the reply: "Command # 1 (TIME) of pipeline caused error: BUSY ...".
    return isinstance(exc, redis.ResponseError) and str(exc).rpartition(
        "caused error: ")[2].startswith("BUSY ")


def _read_script(name: str) -> str:
    with open(os.path.join(_SCRIPTS_DIR, f"{name}.lua")) as f:
        return f.read()


def prelude_source() -> str:
    """The prelude every script starts with (``scripts/prelude.lua`` and its constants)."""
    buckets = ", ".join(str(int(bound * 1e6)) for bound in stats.BUCKETS)
    return (f"local STAT_BUCKETS = {{{buckets}}}\n"
            f"local EMPTY_MS = {int(EMPTY_TTL * 1000)}\n" + _read_script("prelude"))


@functools.cache
def _sources() -> Dict[str, Tuple[str, str]]:
    """Each operation's script, with the shared prelude in front, and its SHA1."""
    prelude = prelude_source()
    sources = {name: prelude + "\n" + _read_script(name) for name in _SCRIPTS}
    return {name: (source, hashlib.sha1(source.encode()).hexdigest())
            for name, source in sources.items()}


def _redis_url(url: str) -> str:
    """kombu's ``redis+socket:///path?virtual_host=1`` is redis-py's ``unix:///path?db=1``."""
    parts = urlsplit(url)
    if parts.scheme != "redis+socket":
        return url
    query = urlencode([("db" if k == "virtual_host" else k, v) for k, v in parse_qsl(parts.query)])
    return f"unix://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")


class RedisBackend(Backend):
    """Semaphores in Redis (>= 6.2; Redis Cluster >= 7), on one server, a Sentinel-managed
    master or a Redis Cluster (the URL scheme says which: :mod:`.deployments`). Thread-safe;
    connects lazily, one pool per instance (per node on a cluster).

    ``socket_timeout``, ``socket_connect_timeout`` and ``health_check_interval`` (seconds) and
    any other keyword (``ssl_ca_certs``, ``max_connections``, ``retry`` ...) go to redis-py's
    client (:meth:`redis.Redis.from_url`, :meth:`redis.sentinel.Sentinel.master_for`,
    :class:`redis.cluster.RedisCluster`). By default a command is retried once on a connection
    error, which covers a pooled connection that went stale. ``failover_timeout`` (Sentinel and
    Cluster only; 0 turns it off): how long an operation keeps trying through a failover
    before it raises :class:`BackendUnavailable`. ``sentinel_kwargs``: redis-py's keywords for
    the connections to the sentinels (by default the socket and TLS options, and the URL's
    ``sentinel_password``). Repeating a script whose reply was lost leaves the same state: a
    holder re-acquiring gets its grant back (a repeated release returns False, though).
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "semaphore:",
        waiter_ttl: float = DEFAULT_WAITER_TTL,
        idle_ttl: float = DEFAULT_IDLE_TTL,
        socket_timeout: float = 5.0,
        socket_connect_timeout: float = 5.0,
        health_check_interval: float = 30.0,
        failover_timeout: float = 10.0,
        sentinel_kwargs: Optional[Dict[str, Any]] = None,
        declared_at: Optional[float] = None,
        **redis_options: Any,
    ) -> None:
        super().__init__(url, key_prefix=key_prefix, waiter_ttl=waiter_ttl, idle_ttl=idle_ttl,
                         declared_at=declared_at)
        redis_options.setdefault("retry", Retry(NoBackoff(), 1, (redis.ConnectionError,)))
        parts = check_url(url)
        kind = deployments.kind_of(url)
        database = parts.path.strip("/")
        if kind == deployments.SERVER and parts.scheme != "redis+socket" and database \
                and not database.isdecimal():
            raise ConfigurationError(f"redis URL {mask_url(url)!r}: the path must be a database "
                                     f"number, not {database!r}")
        if parts.scheme != "redis+socket":  # a Unix socket has no TCP keepalive
            redis_options.setdefault("socket_keepalive", True)
        self.kind = kind
        self.failover_timeout = 0.0 if kind == deployments.SERVER else float(failover_timeout)
        self._connector = deployments.Connector(
            url, _redis_url(url),
            dict(socket_timeout=socket_timeout, socket_connect_timeout=socket_connect_timeout,
                 health_check_interval=health_check_interval, decode_responses=True,
                 **redis_options),
            sentinel_kwargs=sentinel_kwargs,
        )
        self._idle_ms = max(1, int(self.idle_ttl * 1000))
        self._channel_prefix = f"{self.key_prefix}wake:"
        self._key_cache: Dict[str, List[str]] = {}
        #: Scripts loaded on the server (SCRIPT LOAD) before a pipeline used them: a pipeline
        #: cannot fall back to EVAL in order (:meth:`perform_all`).
        self._loaded: Set[str] = set()
        self._listen_lock = threading.Lock()
        self._closed = threading.Event()
        self._listener: Optional[threading.Thread] = None
        self._pubsub: Any = None

    # -- plumbing ----------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """redis-py's client: :class:`redis.Redis` (with Sentinel, bound to the current
        master) or :class:`redis.cluster.RedisCluster` (made on first use)."""
        return self._connector.client

    def key_names(self, name: str) -> Dict[str, str]:
        """The Redis key of each structure of semaphore ``name`` (for operators and tests)."""
        return dict(zip(KEY_SUFFIXES, self._keys(name)))

    def _keys(self, name: str) -> List[str]:
        keys = self._key_cache.get(name)
        if keys is None:
            if len(self._key_cache) >= 10_000:  # a template's keys: keep the recent ones
                self._key_cache.clear()
            keys = self._key_cache[name] = [f"{self.key_prefix}{{{name}}}:{suffix}"
                                            for suffix in KEY_SUFFIXES]
        return keys

    def _unavailable(self, exc: Exception) -> NoReturn:
        """Raise BackendUnavailable when ``exc`` means Redis cannot serve us now,
        ConfigurationError when the URL names the wrong kind of server; re-raise anything
        else."""
        url = mask_url(self.url)
        if self.kind == deployments.CLUSTER:
            if "cluster mode is not enabled" in str(exc).lower():
                raise ConfigurationError(
                    f"semaphore backend {url}: the server is not a Redis Cluster node ({exc}); "
                    "use a redis:// URL for a standalone server") from exc
            if isinstance(exc, _FAILOVER) and not isinstance(
                    exc, redis.exceptions.ClusterCrossSlotError):
                raise BackendUnavailable(f"semaphore backend {url} unavailable: {exc}") from exc
        elif isinstance(exc, _CLUSTER) and not isinstance(exc, _UNAVAILABLE):
            raise ConfigurationError(
                f"semaphore backend {url} is a Redis Cluster node ({exc}); use a "
                "redis+cluster:// URL for a Redis Cluster") from exc
        if self.kind == deployments.SENTINEL and isinstance(exc, redis.ResponseError) \
                and "unknown command" in str(exc).lower() and "sentinel" in str(exc).lower():
            raise ConfigurationError(
                f"semaphore backend {url}: a host of this URL is not a Redis Sentinel ({exc})"
            ) from exc
        if isinstance(exc, redis.ResponseError) and str(exc).startswith("COST "):
            cost, limit = str(exc).split()[1:3]  # scripts/acquire.lua refused the cost
            raise ConfigurationError(f"cost {cost} is above the semaphore's limit ({limit}): "
                                     "it could never be admitted") from None
        if isinstance(exc, redis.ResponseError) and str(exc).startswith("UNITS "):
            units, count, period = str(exc).split()[1:4]  # prelude's traffic() refused them
            per = "month" if int(period) == 0 else f"{int(period) / 1e6:g} s"
            raise ConfigurationError(f"units {units} are above the semaphore's quota of {count} "
                                     f"per {per}: it could never be admitted") from None
        if not (isinstance(exc, _UNAVAILABLE) or _busy(exc)):
            raise exc
        raise BackendUnavailable(f"semaphore backend {url} unavailable: {exc}") from exc

    def _riding(self, operation: Callable[[], Result]) -> Result:
        """Run ``operation``; with Sentinel or Cluster, again with backoff for up to
        ``failover_timeout`` while it fails as a failover does. Errors go through
        :meth:`_unavailable`."""
        deadline = time.monotonic() + self.failover_timeout
        pause = 0.05
        while True:
            try:
                result = operation()
            except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
                if not (self.failover_timeout and isinstance(exc, _FAILOVER)
                        and not isinstance(exc, redis.exceptions.ClusterCrossSlotError)
                        and "cluster mode is not enabled" not in str(exc).lower()
                        and time.monotonic() + pause < deadline and not self._closed.is_set()):
                    self._unavailable(exc)
                logger.debug("celery-semaphore: %s: %s; trying again in %.2fs",
                             mask_url(self.url), exc, pause)
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            self._server_answered()
            return result

    def _script(self, script: str, keys: List[str], argv: List[Any]) -> Any:
        """EVALSHA, or EVAL when the server does not have the script (yet: a new connection,
        a restarted node, a promoted replica), which also caches it there."""
        source, sha = _sources()[script]
        client = self.client
        try:
            return client.evalsha(sha, len(keys), *keys, *argv)
        except redis.exceptions.NoScriptError:
            return client.eval(source, len(keys), *keys, *argv)

    @staticmethod
    def _traffic_argv(meta: Optional[Meta]) -> Tuple[str, List[Any]]:
        """The meta JSON (a cost above 1 first, then units above 1: the scripts read them
        there) and the traffic ARGV of the acquire scripts (scripts/acquire.lua's [12] to
        [21]). ConfigurationError for a malformed option, before anything is sent."""
        if not meta or not _TRAFFIC_KEYS.intersection(meta):  # (most calls: the defaults)
            return json.dumps(meta or {}, separators=(",", ":")), list(_DEFAULT_TRAFFIC)
        meta = dict(meta)
        cost, units = cost_of(meta), units_of(meta)
        meta.pop(COST_KEY, None)
        meta.pop(UNITS_KEY, None)
        first: Dict[str, Any] = {}
        if cost > 1:
            first[COST_KEY] = cost
        if units > 1:
            first[UNITS_KEY] = units
        meta = {**first, **meta}
        rates, quotas, adaptive = rates_of(meta), quotas_of(meta), adaptive_of(meta)
        argv: List[Any] = [
            cost, priority_of(meta), weight_of(meta),
            "" if rates is None else max(1, _us(rates[0][0])) if rates else "-",
            rates[0][1] if rates else "",
            units,
            ";".join(f"{max(1, _us(i))} {b}" for i, b in (rates or [])[1:]),
            "" if quotas is None else ";".join(f"{c} {_us(p)} {_us(o)}" for c, p, o in quotas)
            or "-",
            "1" if front_of(meta) else "",
            "" if adaptive is None else " ".join(repr(v) for v in adaptive),
        ]
        return json.dumps(meta, separators=(",", ":")), argv

    #: What a refused caller waits for, by the scripts' code.
    _WAITS = ("slots", "units", "rate", "pause", "quota")

    @classmethod
    def _refused(cls, position: int, retry_after: int, rest: Sequence[Any]) -> Dict[str, Any]:
        """Attempt fields of a refusal: position, retry_after, what the caller waits for and
        when time alone can admit it (scripts/acquire.lua's reply)."""
        waits, due = (rest[0], rest[1]) if len(rest) >= 2 else (0, -1)
        return dict(position=None if position < 0 else position,
                    retry_after=None if retry_after < 0 else retry_after / 1e6,
                    rate_due=None if due < 0 or waits != 2 else due / 1e6,
                    waits_for=cls._WAITS[waits],
                    due=None if due < 0 else due / 1e6)

    def _call(self, script: str, name: str, *args: Any) -> Any:
        argv = [self._idle_ms, self._channel_prefix, name, *args]
        return self._riding(lambda: self._script(script, self._keys(name), argv))

    # -- operations --------------------------------------------------------------------------

    def acquire(
        self, name: str, holder: str, *, limit: int, ttl: float, meta: Meta, wait: bool,
        push: bool = False,
    ) -> Attempt:
        """:meth:`.Backend.acquire`; ``push``: see :attr:`.Acquire.push`."""
        result: Attempt = self._run(Acquire(name, holder, limit, ttl, meta, wait, push))
        return result

    @property
    def atomic_acquire_all(self) -> bool:  # type: ignore[override]
        """One script over every semaphore's keys, except on a Redis Cluster (their keys hash
        to different slots): the generic protocol there."""
        return self.kind != deployments.CLUSTER

    def acquire_all(self, requests: Requests, holder: str, *, ttl: float, meta: Meta,
                    wait: bool) -> MultiAttempt:
        """``scripts/acquire_all.lua`` over the keys of every semaphore (one EVALSHA)."""
        if not self.atomic_acquire_all:
            return super().acquire_all(requests, holder, ttl=ttl, meta=meta, wait=wait)
        result: MultiAttempt = self._run(AcquireAll(tuple(requests), holder, ttl, meta, wait))
        return result

    def release(self, name: str, holder: str, outcome: Optional[str] = None,
                latency: Optional[float] = None) -> bool:
        done: bool = self._run(Release(name, holder, outcome, latency))
        return done

    traffic_options = ALL_TRAFFIC

    def pause(self, name: str, seconds: float, reason: str = "") -> float:
        until: float = self._run(Pause(name, seconds, reason))
        return until

    def resume(self, name: str) -> bool:
        done: bool = self._run(Resume(name))
        return done

    def settle(self, name: str, holder: str, units: int) -> bool:
        done: bool = self._run(Settle(name, holder, units))
        return done

    def renew(self, name: str, holder: str, ttl: float) -> Optional[float]:
        expires: Optional[float] = self._run(Renew(name, holder, ttl))
        return expires

    def abandon_all(self, names: Sequence[str], holder: str) -> None:
        self._run(Abandon(tuple(names), holder))

    # -- operations as script calls: one place for the sync path, pipelines and the link -----

    #: One script call: (script, keys, argv).
    Call = Tuple[str, List[str], List[Any]]

    def calls_of(self, op: Operation) -> Tuple[List["RedisBackend.Call"],
                                               Callable[[List[Any]], Any]]:
        """The script calls that make ``op``, and the function that turns their replies (in
        order) into the operation's result. :class:`.AcquireAll` only where
        :attr:`atomic_acquire_all`."""
        head = [self._idle_ms, self._channel_prefix]
        if isinstance(op, Acquire):
            meta_json, traffic = self._traffic_argv(op.meta)
            client = self.client_id
            if op.push and op.wait:  # pushed grants: the lease TTL to grant it (scripts/prelude)
                client = f"{client} {int(op.ttl * 1e6)}"
            argv = [*head, op.name, op.holder, int(op.limit), int(op.ttl * 1e6), meta_json,
                    1 if op.wait else 0, client, int(self.waiter_ttl * 1e6),
                    fair_key_of(op.meta) or "", *traffic,
                    int(self.declared_at * 1e6)]  # always the last argument
            return [("acquire", self._keys(op.name), argv)], lambda r: self._attempt(r[0])
        if isinstance(op, AcquireAll):
            if not self.atomic_acquire_all:
                raise NotImplementedError("acquire_all is not one script on a Redis Cluster")
            requests = list(op.requests)
            keys = [key for name, _ in requests for key in self._keys(name)]
            meta_json, traffic = self._traffic_argv(op.meta)
            argv = [*head, requests[0][0], op.holder, int(op.ttl * 1e6), meta_json,
                    1 if op.wait else 0, self.client_id, int(self.waiter_ttl * 1e6),
                    fair_key_of(op.meta) or "", len(requests)]
            argv += [x for name, limit in requests for x in (name, int(limit))]
            argv += traffic
            argv.append(int(self.declared_at * 1e6))  # always the last argument
            return ([("acquire_all", keys, argv)],
                    lambda r: self._multi_attempt(requests, r[0]))
        if isinstance(op, Release):
            argv = [*head, op.name, op.holder]
            if op.outcome is not None or op.latency is not None:  # (the fast path: neither)
                check_outcome(op.outcome)
                argv += [op.outcome or "", "" if op.latency is None else _us(op.latency)]
            return [("release", self._keys(op.name), argv)], lambda r: r[0] == 1
        if isinstance(op, Pause):
            argv = [*head, op.name, _us(check_pause(op.seconds)), str(op.reason or "")]
            return [("pause", self._keys(op.name), argv)], lambda r: r[0] / 1e6
        if isinstance(op, Resume):
            return ([("resume", self._keys(op.name), [*head, op.name])],
                    lambda r: r[0] == 1)
        if isinstance(op, Settle):
            argv = [*head, op.name, op.holder, check_units(op.units)]
            return [("settle", self._keys(op.name), argv)], lambda r: r[0] == 1
        if isinstance(op, Renew):
            return ([("renew", self._keys(op.name),
                      [*head, op.name, op.holder, int(op.ttl * 1e6)])],
                    lambda r: None if r[0] < 0 else r[0] / 1e6)
        if isinstance(op, Abandon):  # leave each queue, and release a grant whose reply was lost
            calls: List[RedisBackend.Call] = []
            for name in op.names:
                calls.append(("cancel", self._keys(name), [*head, name, op.holder]))
                calls.append(("release", self._keys(name), [*head, name, op.holder]))
            return calls, lambda r: None
        raise TypeError(f"not a backend operation: {op!r}")

    def _run(self, op: Operation) -> Any:
        calls, parse = self.calls_of(op)
        replies = []
        for script, keys, argv in calls:
            replies.append(self._riding(functools.partial(self._script, script, keys, argv)))
        return parse(replies)

    def perform(self, op: Operation) -> Any:
        if isinstance(op, AcquireAll) and not self.atomic_acquire_all:
            return super().perform(op)
        return self._run(op)

    def perform_all(self, ops: Sequence[Operation]) -> List[Outcome]:
        """Every operation's script calls in one pipeline (one round trip; a Redis Cluster
        runs them one by one)."""
        if self.kind == deployments.CLUSTER or len(ops) < 2:
            return super().perform_all(ops)
        plans: List[Any] = []
        for op in ops:  # an operation that cannot be made (its meta, say) fails alone
            try:
                plans.append(self.calls_of(op))
            except Exception as exc:
                plans.append(exc)
        calls = [call for plan in plans if not isinstance(plan, Exception) for call in plan[0]]
        sources = _sources()

        def run() -> List[Any]:
            # A script the server does not have would be run after the pipeline, out of order:
            # each is loaded before the first pipeline that uses it (once per process, and
            # again after a reply said the server lost it).
            for script in {call[0] for call in calls} - self._loaded:
                self.client.script_load(sources[script][0])
                self._loaded.add(script)
            pipe = self.client.pipeline(transaction=False)
            for script, keys, argv in calls:
                pipe.evalsha(sources[script][1], len(keys), *keys, *argv)
            replies: List[Any] = pipe.execute(raise_on_error=False)
            for i, reply in enumerate(replies):  # a server without the script: run it once
                if isinstance(reply, redis.exceptions.NoScriptError):
                    self._loaded.clear()  # flushed, or restarted: load them again next time
                    try:
                        replies[i] = self._script(*calls[i])
                    except redis.RedisError as exc:
                        replies[i] = exc
            return replies

        try:
            replies = self._riding(run)
        except Exception as exc:  # the round trip itself failed: every operation with it
            return [(None, plan if isinstance(plan, Exception) else exc) for plan in plans]
        out: List[Outcome] = []
        at = 0
        for planned in plans:
            if isinstance(planned, Exception):
                out.append((None, planned))
                continue
            plan, parse = planned
            mine = replies[at:at + len(plan)]
            at += len(plan)
            error = next((r for r in mine if isinstance(r, Exception)), None)
            if error is not None:
                try:
                    self._unavailable(error)
                except Exception as mapped:
                    out.append((None, mapped))
                continue
            try:
                out.append((parse(mine), None))
            except Exception as exc:
                out.append((None, exc))
        return out

    def _attempt(self, reply: Any) -> Attempt:
        """An acquire's result from scripts/acquire.lua's reply."""
        if reply[0] == 1:
            _, slot, epoch, expires, now, current_limit, *free = reply
            return Attempt(
                Grant(slot, epoch, expires / 1e6, (expires - now) / 1e6), limit=current_limit,
                free=free[0] if free else None)
        _, position, retry_after, _, current_limit, *rest = reply
        return Attempt(None, limit=current_limit, **self._refused(position, retry_after, rest))

    def _multi_attempt(self, requests: Requests, reply: Any) -> MultiAttempt:
        """An acquire_all's result from scripts/acquire_all.lua's reply."""
        if reply[0] == 1:
            now = reply[1]
            grants, limits = {}, {}
            for (name, _), (slot, epoch, expires, limit) in zip(requests, reply[2:]):
                grants[name] = Grant(slot, epoch, expires / 1e6, (expires - now) / 1e6)
                limits[name] = limit
            return MultiAttempt(grants, limits=limits)
        _, index, position, retry_after, limit, *rest = reply
        return MultiAttempt(None, requests[index - 1][0], limit=limit,
                            **self._refused(position, retry_after, rest))

    # -- on the worker's event loop -------------------------------------------------------

    pushes_grants = True

    @staticmethod
    def scripts() -> Dict[str, Tuple[str, str]]:
        """Each operation's script (the prelude in front) and its SHA1, by name."""
        return _sources()

    def event_loop_link(self, hub: Any,
                        on_wake: Callable[[str, str, Optional[PushedGrant]], None],
                        on_listening: Callable[[], None]) -> Optional[EventLoopLink]:
        """A :class:`.hublink.HubLink` on one server (TCP or a Unix socket, no TLS) when
        hiredis is installed; None for Sentinel, Cluster and TLS (the caller runs the
        operations on a thread)."""
        from . import hublink

        return hublink.link_for(self, hub, on_wake, on_listening)

    @staticmethod
    def pushed_grant(data: str) -> Tuple[str, str, Optional[PushedGrant]]:
        """``(name, holder, pushed grant or None)`` of a wake-up's payload
        (``name\nholder``, or with a pushed grant ``...\nslot\nepoch\nexpires\nnow\nlimit``,
        times in us: scripts/prelude.lua)."""
        parts = data.split("\n")
        name, holder = parts[0], parts[1] if len(parts) > 1 else ""
        if len(parts) < 7:
            return name, holder, None
        slot, epoch, expires, now, limit = (int(p) for p in parts[2:7])
        return name, holder, PushedGrant(name, holder, Grant(slot, epoch, expires / 1e6,
                                                             (expires - now) / 1e6),
                                         limit, now / 1e6)

    def verify(self, name: str, holder: str) -> bool:
        # A script, though read-only: on a cluster, the clock of the node holding the lease.
        done: int = self._call("verify", name, holder)  # 1 or 0
        return done == 1

    def cancel(self, name: str, holder: str) -> None:
        self._call("cancel", name, holder)

    def resize(self, name: str, limit: int) -> bool:
        done: int = self._call("resize", name, int(limit))  # 1 or 0
        return done == 1

    def unpin(self, name: str) -> Optional[int]:
        limit = self._call("unpin", name)
        return None if limit < 0 else limit

    def count(self, name: str, counts: Mapping[str, int]) -> None:
        pairs = [x for counter, n in counts.items() if n > 0 for x in (counter, int(n))]
        if pairs:
            self._call("count", name, *pairs)

    def statuses(self, names: Sequence[str]) -> Dict[str, SemaphoreStatus]:
        """One pipeline per 500 names; on a Redis Cluster (redis-py refuses EVALSHA in a
        cluster pipeline) one script call per name."""
        if self.kind == deployments.CLUSTER:
            return super().statuses(names)
        found: Dict[str, SemaphoreStatus] = {}
        source, sha = _sources()["status"]
        if names:  # a pipeline cannot fall back to EVAL: load the script (on every master)
            self._riding(lambda: self.client.script_load(source))
        for start in range(0, len(names), 500):
            chunk = list(names[start:start + 500])

            def run(chunk: List[str] = chunk) -> List[Any]:
                pipe = self.client.pipeline(transaction=False)
                for name in chunk:
                    pipe.evalsha(sha, len(KEY_SUFFIXES), *self._keys(name),
                                 self._idle_ms, self._channel_prefix, name)
                replies: List[Any] = pipe.execute()
                return replies

            for name, reply in zip(chunk, self._riding(run)):
                status = self._status_of(name, reply)
                if status is not None:
                    found[name] = status
        return found

    def status(self, name: str) -> Optional[SemaphoreStatus]:
        return self._status_of(name, self._call("status", name))

    def waiting_count(self, name: str) -> int:
        """One ZCARD of the semaphore's queue (waiters past their expiry included until a
        script prunes them)."""
        queue = self._keys(name)[KEY_SUFFIXES.index("queue")]
        return int(self._riding(lambda: self.client.zcard(queue)))

    def _status_of(self, name: str, reply: Any) -> Optional[SemaphoreStatus]:
        if not reply:
            return None
        now, limit, declared, holders, waiters, counters, pinned, wanted, *more = reply
        holder_infos = []
        for holder, expires, info in zip(holders[0::3], holders[1::3], holders[2::3]):
            slot, epoch, since, meta = info.split("\n", 3)
            if meta.startswith("@"):  # what its admission counted (scripts/prelude.lua)
                meta = meta.split("\n", 1)[1]
            holder_infos.append(HolderInfo(
                holder, int(slot), int(epoch), int(since) / 1e6, int(expires) / 1e6,
                json.loads(meta),
            ))
        waiter_infos = []
        for holder, ticket, info in zip(waiters[0::3], waiters[1::3], waiters[2::3]):
            _, since, meta = info.split("\n", 2)
            # the queue's score is ticket - priority * 2**36, less 2**35 at the front
            # (scripts/prelude.lua)
            waiter_infos.append(WaiterInfo(holder, int(float(ticket)) % 2 ** 35,
                                           int(since) / 1e6, json.loads(meta)))
        rate, next_start = None, None
        if more and more[0][0]:
            interval, burst, tat = int(more[0][0]), int(more[0][1]), int(more[0][2] or 0)
            rate = (interval / 1e6, burst)
            next_start = (max(tat, int(now)) - (burst - 1) * interval) / 1e6
        paused, reason, rates, quotas, adaptive = (
            more[1] if len(more) > 1 else ("", "", [], [], []))
        every = [(int(i), int(b), int(t)) for i, b, t in zip(rates[0::3], rates[1::3],
                                                             rates[2::3])]
        if every:
            next_start = max(max(t, int(now)) - (b - 1) * i for i, b, t in every) / 1e6
        return SemaphoreStatus(
            name=name,
            limit=int(limit),
            declared={int(k): int(v) / 1e6 for k, v in zip(declared[0::2], declared[1::2])},
            holders=tuple(sorted(holder_infos, key=lambda h: h.slot)),
            waiters=tuple(waiter_infos),  # the script returns them in admission order
            stats=stats.SemaphoreStats.from_fields(dict(zip(counters[0::2], counters[1::2]))),
            pinned=pinned == 1,
            newest_declared=None if wanted < 0 else wanted,
            rate=rate,
            next_start=next_start,
            paused_until=int(paused) / 1e6 if paused else None,
            pause_reason=reason if paused else "",
            quotas=tuple(QuotaUsage(int(q[0]), int(q[1]) / 1e6, int(q[2]) / 1e6,
                                    int(q[3]) / 1e6, int(q[4]) / 1e6, int(q[5]))
                         for q in zip(*[iter(quotas)] * 6)),
            rates=tuple((i / 1e6, b) for i, b, _ in every),
            adaptive=None if not adaptive else AdaptiveState(
                int(adaptive[0]), int(adaptive[1]), float(adaptive[2]), pinned == 1),
        )

    def names(self) -> List[str]:
        # SCAN walks the whole database (on a cluster, every master's), but only operators
        # call this. Names cannot hold glob characters or braces, so only the prefix needs
        # escaping and "}:config" ends a name.
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.key_prefix)
        start, end = len(self.key_prefix) + 1, -len("}:config")

        def scan() -> List[str]:
            keys = self.client.scan_iter(match=f"{escaped}{{*}}:config", count=1000)
            return sorted({key[start:end] for key in keys})

        return self._riding(scan)

    def reset(self, name: str) -> bool:
        done: int = self._call("reset", name)  # 1 or 0
        return done == 1

    def ping(self) -> None:
        """One try, no riding through a failover: says whether Redis answers now."""
        try:
            self.client.ping()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            self._unavailable(exc)

    def close(self) -> None:
        self._closed.set()
        self._listener_kick.set()  # end a pause between reconnection tries
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            self._interrupt_listener()
            listener.join(3)
        self._drop_pubsub()
        self._connector.close()

    def _interrupt_listener(self) -> None:
        """Shut down (not close: the listener owns it) the socket the listener reads, so that
        it ends now rather than when its read times out (1 s): closing a process's backends
        no longer takes a second each. redis-py has no public handle on the socket; without
        one the listener simply ends at its timeout."""
        sock = getattr(getattr(self._pubsub, "connection", None), "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- wake-ups ----------------------------------------------------------------------------

    def _start_listening(self) -> None:
        """Start this instance's listener thread, unless it runs (a forked child starts anew).

        The first subscription happens here, in the caller's thread, so a waiter that starts
        watching is subscribed before its first acquire: no wake-up sent after it is missed.
        """
        with self._listen_lock:
            if self._closed.is_set() or (self._listener and self._listener.is_alive()):
                return
            try:
                self._pubsub = self._subscribe()
            except Exception as exc:  # waiters poll meanwhile; the thread keeps trying
                logger.warning("celery-semaphore: cannot subscribe to wake-ups yet: %s", exc)
                self._pubsub = None
                self._listener_went()
            self._listener = threading.Thread(
                target=self._listen, name="celery-semaphore-redis-wake", daemon=True
            )
            self._listener.start()

    def _subscribe(self) -> Any:
        """A pubsub on this process's channel, returned once Redis confirmed the subscription."""
        pubsub = self._connector.pubsub()
        try:
            pubsub.subscribe(self._channel_prefix + self.client_id)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=1.0)
                if message and message["type"] == "subscribe":
                    return pubsub
            raise redis.TimeoutError("no subscribe confirmation within 5 s")
        except BaseException:
            pubsub.close()
            raise

    def _listen(self) -> None:
        """Deliver wake-ups until close(). Connection lost: resubscribe, forever, within
        :data:`.LISTENER_RETRY_MAX` of the server's return (at once when an operation of
        this process reaches it first), then wake every watcher once: wake-ups published
        while the channel was down are lost."""
        backoff, lost = LISTENER_RETRY_FIRST, self._pubsub is None
        while not self._closed.is_set():
            try:
                if self._pubsub is None:
                    self._pubsub = self._subscribe()
                    if lost:
                        logger.info("celery-semaphore: wake-up channel restored")
                        self._listener_back()
                    backoff, lost = LISTENER_RETRY_FIRST, False
                message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except Exception as exc:
                if self._closed.is_set():
                    break
                if not lost:
                    logger.warning(
                        "celery-semaphore: wake-up channel of %s lost (%s); resubscribing, "
                        "waiters poll meanwhile", mask_url(self.url), exc,
                    )
                lost = True
                self._listener_went()
                self._drop_pubsub()
                backoff = self._listener_pause(backoff)
                continue
            if message and message["type"] == "message":
                name, holder, _ = self.pushed_grant(message["data"])
                try:
                    self._notify(name, holder)
                except Exception:  # a broken callback must not stop everyone's wake-ups
                    logger.exception("celery-semaphore: wake-up callback failed")
        self._drop_pubsub()

    def _forked(self) -> None:
        """The parent's thread and pubsub connection are not this process's (redis-py's pool
        resets its own connections)."""
        super()._forked()
        self._connector.forked()
        self._listen_lock = threading.Lock()
        self._listener = None
        self._pubsub = None  # the parent's connection: redis-py never shuts it down from here

    def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:
                pass
