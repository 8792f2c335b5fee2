import os

import pytest

from celery_semaphore.backends import close_all
from tests import servers


def _no_result_finalizer():
    """In the test process only: ``AsyncResult.__del__`` does nothing. Celery's finalizer
    unsubscribes the result from the Redis result backend's pub/sub; run by the garbage
    collector while the same thread is inside that pub/sub's ``unsubscribe`` (a result's
    ``get``), it waits on the pub/sub's own lock for ever (seen twice on Celery 5.3 with
    redis-py 8: a compat run hung in ``test_time_limits_free_the_slot`` with
    ``__del__`` over ``PubSub.unsubscribe`` twice in one stack, past pytest-timeout). That
    is the client's, not the worker's; the tests wait on every result they keep."""
    from celery.result import AsyncResult

    AsyncResult.__del__ = lambda self: None


_no_result_finalizer()

BACKENDS = ["memory", "sqlite", "redis", "redis+socket", "redis+sentinel", "redis+cluster", "amqp",
            "amqp+slots", "consul", "postgres"]
#: Sweep every test name at the session's start and end, or (``CS_SWEEP=own``, for test runs
#: made side by side against the same servers) only the names this run created. The
#: processes of a parallel run (pytest-xdist) sweep their own names; the run's controller
#: sweeps what earlier runs left before they start (:func:`pytest_sessionstart`).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
SWEEP_ALL = os.environ.get("CS_SWEEP", "all") != "own" and XDIST_WORKER is None


def pytest_sessionstart(session):
    """The controller of a parallel run sweeps every test name once, before any test process
    starts (what an interrupted run left: durable queues pile up and slow a broker's boot)."""
    parallel = getattr(session.config.option, "numprocesses", None)
    if not parallel or XDIST_WORKER is not None or os.environ.get("CS_SWEEP") == "own":
        return
    url = servers.redis_url()
    for database in (url, servers.redis_broker(url)):
        servers.sweep_redis(database, everything=True)
    servers.sweep_amqp(servers.amqp_url(), everything=True)
    servers.sweep_postgres(servers.postgres_url(), everything=True)


@pytest.fixture(scope="session")
def redis_url():
    url = servers.redis_url()
    databases = (url, servers.redis_broker(url))
    for database in databases:
        servers.sweep_redis(database, everything=SWEEP_ALL)  # what an interrupted run left
    yield url
    for database in databases:
        servers.sweep_redis(database, everything=SWEEP_ALL)


@pytest.fixture(scope="session")
def redis_socket_url(tmp_path_factory):
    """A private redis-server listening on a Unix socket only (``redis+socket://``)."""
    workdir = tmp_path_factory.mktemp("redis-socket")
    socket_path = workdir / "redis.sock"
    proc, _ = servers.start_redis(0, str(workdir), "--unixsocket", str(socket_path),
                                  client_url=f"unix://{socket_path}")
    yield f"redis+socket://{socket_path}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def sentinel_group(tmp_path_factory):
    """A private Redis Sentinel group (master, replica, three sentinels) for the session. Tests
    that fail it over leave it whole again (:meth:`servers.ServerGroup.restore`)."""
    group = servers.SentinelGroup(str(tmp_path_factory.mktemp("redis-sentinel")))
    yield group
    group.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A private Redis Cluster (three masters, one replica each) for the session. Tests that
    kill a node bring it back and wait for the cluster to be whole."""
    cluster = servers.RedisClusterGroup(str(tmp_path_factory.mktemp("redis-cluster")))
    yield cluster
    cluster.stop()


@pytest.fixture
def own_broker(tmp_path):
    """A Redis server of the test's own as its broker (``redis://...``): for a test that cuts
    every connection to its broker, which on the shared server would cut other tests' too, or
    whose workers restore unacked messages by age (kombu keeps one record of them, and one
    restore lock, per database)."""
    workdir = tmp_path / "own-broker"
    workdir.mkdir()
    port = servers.free_port()
    proc, client = servers.start_redis(port, str(workdir))
    client.close()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test alone (``(url, client)``): its command counts are ours."""
    port = servers.free_port()
    proc, client = servers.start_redis(port, str(tmp_path))
    yield f"redis://127.0.0.1:{port}/0", client
    client.close()
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def amqp_url():
    url = servers.amqp_url()
    # durable queues left behind would slow every broker boot
    servers.sweep_amqp(url, everything=SWEEP_ALL)
    yield url
    servers.sweep_amqp(url, everything=SWEEP_ALL)


@pytest.fixture(scope="session")
def postgres_url():
    url = servers.postgres_url()
    servers.sweep_postgres(url, everything=SWEEP_ALL)  # what an interrupted run left
    yield url
    close_all()  # no connection of this process may hold a row the sweep deletes
    servers.sweep_postgres(url, everything=SWEEP_ALL)


@pytest.fixture(scope="session")
def consul_url():
    """``CONSUL_HTTP_ADDR`` (a real agent, e.g. ``consul agent -dev``) when set, else the test
    double of Consul's HTTP API (tests/consul_double.py) on 127.0.0.1."""
    address = os.environ.get("CONSUL_HTTP_ADDR")
    if address:
        scheme, _, hostport = address.rpartition("://")
        yield f"{'consuls' if scheme == 'https' else 'consul'}://{hostport}"
        return
    from tests.consul_double import ConsulDouble

    double = ConsulDouble().start()
    yield double.url
    double.stop()


class BackendSpec:
    """How a test reaches one backend: its URL and options (a key prefix unique to the test)."""

    def __init__(self, kind, url, options):
        self.kind = kind
        self.url = url
        self.options = options

    @property
    def multiprocess(self):
        return self.kind != "memory"

    def semaphore(self, name="sem", limit=4, **kwargs):
        from celery_semaphore import Semaphore

        return Semaphore(name, limit, self.url, **{**self.options, **kwargs})

    def backend(self):
        from celery_semaphore.backends import get_backend

        return get_backend(self.url, **self.options)


@pytest.fixture(params=BACKENDS)
def spec(request, tmp_path):
    kind = request.param
    prefix = f"{servers.unique_tag()}:"
    options = {"key_prefix": prefix}
    if kind == "memory":
        url = f"memory://{prefix}"
    elif kind == "sqlite":
        url = "sqlite:////" + str(tmp_path / "semaphores.db").lstrip("/")
    elif kind == "consul":
        url = request.getfixturevalue("consul_url")
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
    elif kind == "redis+socket":
        url = request.getfixturevalue("redis_socket_url")
    elif kind == "redis+sentinel":
        url = request.getfixturevalue("sentinel_group").url
    elif kind == "redis+cluster":
        url = request.getfixturevalue("redis_cluster").url
    elif kind == "amqp":
        url = request.getfixturevalue("amqp_url")
    elif kind == "postgres":
        url = request.getfixturevalue("postgres_url")
    else:
        url = servers.slots_url(request.getfixturevalue("amqp_url"))
    yield BackendSpec(kind, url, options)
    close_all()


@pytest.fixture(scope="session", autouse=True)
def _no_worker_left_running():
    """A worker a test left running (it failed before its cleanup) is killed at the end, and
    the run says so: a leftover keeps consuming the shared broker and the CPU."""
    yield
    from tests.workers import kill_leftovers

    left = kill_leftovers()
    if left:
        print(f"\nkilled {left} celery worker(s) a test left running")
