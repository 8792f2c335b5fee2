"""Where the Redis backend's data lives, and the redis-py client that reaches it.

Three deployments, named by the URL scheme:

* **server** (``redis://``, ``rediss://``, ``redis+socket://``): one server, :class:`redis.Redis`.
* **sentinel** (``redis+sentinel://``, ``rediss+sentinel://``): the master of a Sentinel-managed
  group, ``redis+sentinel://[[user]:password@]host:26379[,host2:26379...]/<master name>[/<db>]``.
  redis-py asks the sentinels for the master's address at each new connection, so after a
  failover the next connection goes to the promoted replica; a connection still open to a
  demoted master is dropped at its first ``READONLY`` reply. The password (and user) are the
  data servers'; sentinels that require one of their own get ``?sentinel_password=``
  (``&sentinel_username=``) or the backend option ``sentinel_kwargs``. ``rediss+sentinel``
  speaks TLS to the master and to the sentinels alike.
* **cluster** (``redis+cluster://``, ``rediss+cluster://``): a Redis Cluster,
  ``redis+cluster://[[user]:password@]host:port[,host:port...]``, any few nodes to discover it
  from (:class:`redis.cluster.RedisCluster`, which follows ``MOVED``/``ASK`` and refreshes its
  slot map after a failover). There are no databases: the path is empty or ``/0``.

Query parameters of these URLs are redis-py's (``ssl_cert_reqs``, ``ssl_ca_certs``,
``socket_timeout`` ...), plus ``sentinel_password``, ``sentinel_username`` and
``min_other_sentinels`` for Sentinel.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection, parse_url
from redis.sentinel import Sentinel

from ...exceptions import ConfigurationError
from ...urls import mask_url

SERVER, SENTINEL, CLUSTER = "server", "sentinel", "cluster"
#: The deployment each URL scheme names.
KINDS = {"redis": SERVER, "rediss": SERVER, "redis+socket": SERVER,
         "redis+sentinel": SENTINEL, "rediss+sentinel": SENTINEL,
         "redis+cluster": CLUSTER, "rediss+cluster": CLUSTER}
DEFAULT_PORTS = {SENTINEL: 26379, CLUSTER: 6379}
_SENTINEL_QUERY = ("sentinel_password", "sentinel_username", "min_other_sentinels")


@dataclass(frozen=True)
class Deployment:
    """A parsed ``redis+sentinel://`` or ``redis+cluster://`` URL (``server`` URLs go to
    redis-py as they are). ``connection``: keywords for every data connection (user,
    password, database, TLS); ``sentinel``: keywords for the sentinel connections."""

    kind: str
    hosts: Tuple[Tuple[str, int], ...]
    master_name: Optional[str] = None
    connection: Dict[str, Any] = field(default_factory=dict)
    sentinel: Dict[str, Any] = field(default_factory=dict)
    min_other_sentinels: int = 0


def kind_of(url: str) -> str:
    return KINDS.get(urlsplit(url).scheme.lower(), SERVER)


def parse(url: str) -> Deployment:
    """Parse a Sentinel or Cluster URL; ConfigurationError names what is wrong (no host, no
    master name, a bad port or database), password masked."""
    parts = urlsplit(url)
    kind = kind_of(url)
    tls = parts.scheme.lower().startswith("rediss")
    shown = mask_url(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = []
    for item in filter(None, (h.strip() for h in hostlist.split(","))):
        try:
            host = urlsplit(f"//{item}")
            port = host.port or DEFAULT_PORTS[kind]
        except ValueError as exc:
            raise ConfigurationError(f"{parts.scheme} URL {shown!r}: bad host {item!r}: "
                                     f"{exc}") from None
        if not host.hostname:
            raise ConfigurationError(f"{parts.scheme} URL {shown!r}: bad host {item!r}")
        hosts.append((host.hostname, port))
    example = ("redis+sentinel://host:26379[,host2:26379]/<master name>/<db>" if kind == SENTINEL
               else "redis+cluster://host:6379[,host2:6379]")
    if not hosts:
        raise ConfigurationError(f"{parts.scheme} URL {shown!r} names no host: {example}")
    segments = [unquote(s) for s in parts.path.split("/") if s]
    master_name, database = None, "0"
    if kind == SENTINEL:
        if not segments:
            raise ConfigurationError(f"{parts.scheme} URL {shown!r} names no master: {example}")
        master_name = segments[0]
        if len(segments) > 2:
            raise ConfigurationError(f"{parts.scheme} URL {shown!r}: the path is "
                                     "/<master name>/<db>")
        database = segments[1] if len(segments) == 2 else "0"
    elif segments and segments != ["0"]:
        raise ConfigurationError(f"{parts.scheme} URL {shown!r}: a Redis Cluster has only "
                                 "database 0, the path must be empty")
    if not database.isdecimal():
        raise ConfigurationError(f"{parts.scheme} URL {shown!r}: the database must be a "
                                 f"number, not {database!r}")
    query = parse_qsl(parts.query)
    ours = {k: v for k, v in query if k in _SENTINEL_QUERY}
    if ours and kind != SENTINEL:
        raise ConfigurationError(f"{parts.scheme} URL {shown!r}: {', '.join(ours)} is for "
                                 "redis+sentinel:// only")
    theirs = urlencode([(k, v) for k, v in query if k not in _SENTINEL_QUERY])
    # redis-py parses the rest (user, password, database, TLS and socket options).
    single = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}" \
             f"localhost/{database}" + (f"?{theirs}" if theirs else "")
    try:
        connection = parse_url(single)
    except ValueError as exc:
        raise ConfigurationError(f"{parts.scheme} URL {shown!r}: {exc}") from None
    connection.pop("host", None)
    connection.pop("port", None)
    if connection.pop("connection_class", None) is SSLConnection:
        connection["ssl"] = True
    if kind == CLUSTER:
        connection.pop("db", None)
    sentinel: Dict[str, Any] = {}
    if "sentinel_password" in ours:
        sentinel["password"] = ours["sentinel_password"]
    if "sentinel_username" in ours:
        sentinel["username"] = ours["sentinel_username"]
    try:
        min_other = int(ours.get("min_other_sentinels", 0))
    except ValueError:
        raise ConfigurationError(f"{parts.scheme} URL {shown!r}: min_other_sentinels must be "
                                 "a number") from None
    return Deployment(kind, tuple(hosts), master_name, connection, sentinel, min_other)


class Connector:
    """Builds and owns the redis-py client of one backend instance (and the Sentinel
    manager), and gives the wake-up listener a connection to subscribe on.

    ``options`` are the backend's redis-py keywords. Nothing connects here: a
    :class:`RedisCluster` (which reads the slot map when it is made) is made on first use.
    """

    def __init__(self, url: str, redis_url: str, options: Dict[str, Any],
                 sentinel_kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.url = url
        self.kind = kind_of(url)
        self._options = options
        self._lock = threading.Lock()
        self._client: Any = None
        self._sentinel: Optional[Sentinel] = None
        self._rotation = itertools.count()
        if self.kind == SERVER:
            self._client = redis.Redis.from_url(redis_url, **options)
            return
        self.deployment = parse(url)
        if self.kind == SENTINEL:
            connection = {**self.deployment.connection, **options}
            if sentinel_kwargs is None:  # the socket and TLS options, and the sentinels' auth
                sentinel_kwargs = {k: v for k, v in connection.items()
                                   if k.startswith(("socket_", "ssl")) or k == "retry"}
                sentinel_kwargs.update(self.deployment.sentinel)
            self._sentinel = Sentinel(
                list(self.deployment.hosts), min_other_sentinels=self.deployment
                .min_other_sentinels, sentinel_kwargs=sentinel_kwargs)
            self._client = self._sentinel.master_for(self.deployment.master_name,
                                                     **connection)

    @property
    def client(self) -> Any:
        """The client: :class:`redis.Redis` (for Sentinel, bound to the current master) or
        :class:`RedisCluster`, made on first use."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    options = {**self.deployment.connection, **self._options}
                    retry = options.pop("retry", None)  # a cluster retries at its level
                    self._client = RedisCluster(
                        startup_nodes=[ClusterNode(h, p) for h, p in self.deployment.hosts],
                        retry=retry, **options)
                client = self._client
        return client

    def pubsub(self) -> Any:
        """A :class:`redis.client.PubSub` for the wake-up channel. On a cluster, a plain one
        on one master, a different one at each call (in turn): ``PUBLISH`` reaches every node
        of a Redis Cluster, so any node will do, and the next try after a node failed goes to
        another one. Masters, because they are the nodes the client's slot map always knows."""
        client = self.client
        if self.kind != CLUSTER:
            return client.pubsub()
        nodes: List[ClusterNode] = client.get_primaries()
        if not nodes:
            raise redis.ConnectionError("no known Redis Cluster master")
        node = nodes[next(self._rotation) % len(nodes)]
        if node.redis_connection is None:
            raise redis.ConnectionError(f"Redis Cluster node {node.name} not connected")
        return node.redis_connection.pubsub()

    def forked(self) -> None:
        """In a forked child: a fresh lock (redis-py's pools notice the new pid themselves)."""
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._sentinel is not None:
            self._sentinel.close()
