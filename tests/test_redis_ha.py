"""Redis Sentinel and Redis Cluster: failovers, node restarts, names across nodes, URLs and the
settings path, against private servers (tests/servers.py). The backend contract suite runs on
both too (``redis+sentinel`` and ``redis+cluster`` in conftest's BACKENDS).

Every failover here waits for the replica to have the state first (``WAIT`` from the test, not
the library): what asynchronous replication can lose is documented, not tested by chance.
"""

import itertools
import multiprocessing
import threading
import time

import pytest
import redis
from celery import Celery

from celery_semaphore import ConfigurationError, Semaphore
from celery_semaphore.backends import get_backend
from celery_semaphore.settings import Settings, sentinel_backend_url
from tests import servers
from tests.probe import Probe as FileProbe
from tests.test_contract import Probe
from tests.util import wait_until

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def prefix():
    return f"{servers.unique_tag()}:"


@pytest.fixture
def sentinels(sentinel_group):
    """The session's Sentinel group, for a test that kills its master: whole again after."""
    yield sentinel_group
    sentinel_group.restore()


@pytest.fixture
def cluster(redis_cluster):
    """The session's Redis Cluster, for a test that kills a node: whole again after."""
    yield redis_cluster
    redis_cluster.restore()


def subscribed(client, prefix):
    """Whether a process subscribes to its wake-up channel of ``prefix`` on this server (the
    sentinels hold pub/sub connections of their own)."""
    return bool(client.pubsub_channels(f"{prefix}wake:*"))


def replicated(client):
    """Wait until the master behind ``client`` has its writes on one replica."""
    assert client.execute_command("WAIT", 1, 5000) >= 1


def in_thread(call):
    """Run ``call`` in a thread; a list that gets ``("ok", result)`` or ``("error", exc)``."""
    out = []

    def run():
        try:
            out.append(("ok", call()))
        except Exception as exc:  # reported to the test
            out.append(("error", exc))

    threading.Thread(target=run, daemon=True).start()
    return out


# -- Sentinel -------------------------------------------------------------------------------


def test_sentinel_failover_the_backend_follows_and_a_blocked_waiter_resumes(sentinels, prefix):
    """Polls are 30 s apart: the waiter resumes on a wake-up from the new master."""
    group = sentinels
    sem = Semaphore("ha", 1, group.url, key_prefix=prefix, poll_interval=30, waiter_ttl=90)
    holder = sem.acquire()
    waiter = in_thread(lambda: sem.acquire(timeout=60))
    assert wait_until(lambda: sem.status().waiting == 1)
    old = group.master_port()
    replicated(group.clients[old])

    group.kill_master()
    during = in_thread(sem.try_acquire)  # sent while no master answers: rides through
    new = group.wait_promoted(old)
    assert wait_until(lambda: during, timeout=15)
    assert during == [("ok", None)]  # the slot is still held: the state survived
    assert sem.backend.client.connection_pool.get_master_address()[1] == new
    assert wait_until(lambda: subscribed(group.clients[new], prefix), timeout=15)
    assert holder.verify()
    released_at = time.monotonic()
    assert holder.release() is True
    assert wait_until(lambda: waiter, timeout=10), "the waiter did not resume"
    assert time.monotonic() - released_at < 5  # woken, not polled
    kind, lease = waiter[0]
    assert kind == "ok" and lease.verify()
    assert lease.token.epoch > holder.token.epoch
    assert lease.release() is True


def _storm(url, prefix, probe, stop, rounds, errors):
    sem = Semaphore("storm-ha", 3, url, key_prefix=prefix, ttl=30, poll_interval=0.5)
    try:
        while not stop.is_set():
            with sem.acquire(timeout=60):
                probe.enter()
                time.sleep(0.01)
                probe.leave()
            with rounds.get_lock():
                rounds.value += 1
    except Exception:
        with errors.get_lock():
            errors.value += 1
        raise


def test_sentinel_the_storm_goes_on_across_a_failover(sentinels, prefix):
    """12 processes contend for 3 slots while the master is killed: none fails, they go on
    after the promotion, and the external probe never sees more than 3 holders."""
    group = sentinels
    probe, stop = Probe(), FORK.Event()
    rounds, errors = FORK.Value("i", 0), FORK.Value("i", 0)
    runners = [FORK.Process(target=_storm, args=(group.url, prefix, probe, stop, rounds, errors))
               for _ in range(12)]
    for runner in runners:
        runner.start()
    try:
        assert wait_until(lambda: rounds.value >= 100, timeout=30)
        old = group.master_port()
        group.clients[old].execute_command("WAIT", 1, 1000)
        group.kill_master()
        killed_at = rounds.value
        group.wait_promoted(old)
        assert wait_until(lambda: rounds.value >= killed_at + 200, timeout=30), \
            "the storm did not go on after the failover"
    finally:
        stop.set()
        for runner in runners:
            runner.join(60)
    assert [r.exitcode for r in runners] == [0] * len(runners)
    assert errors.value == 0
    assert probe.highest.value == 3 and probe.current.value == 0
    status = Semaphore("storm-ha", 3, group.url, key_prefix=prefix).status()
    assert status.held == 0


# -- Cluster --------------------------------------------------------------------------------


def test_cluster_names_span_every_master(redis_cluster, prefix):
    backend = get_backend(redis_cluster.url, key_prefix=prefix)
    names = [f"n{i}" for i in range(12)]
    for name in names:
        assert backend.resize(name, 2) is True
    owners = {redis_cluster.master_of(backend.key_names(name)["config"]) for name in names}
    assert len(owners) == 3  # the names really live on different masters
    assert backend.names() == sorted(names)
    for name in names:
        assert backend.reset(name) is True
    assert backend.names() == []


def test_cluster_a_master_dies_calls_ride_through_wake_ups_go_on_and_it_rejoins(cluster,
                                                                              prefix):
    """The master killed serves the semaphore's slot and holds the process's wake-up
    subscription. Calls made while it is down finish once its replica takes over, the lease
    survives, the listener moves to another node (polls are 30 s apart: the waiter is woken),
    and after the node restarts (as a replica now) operations go on."""
    backend = get_backend(cluster.url, key_prefix=prefix, waiter_ttl=90)
    backend.watch("-", "-", lambda: None)  # the listener subscribes before this returns
    listening = next(port for port in cluster.live()
                     if subscribed(cluster.clients[port], prefix))
    name = next(f"n{i}" for i in itertools.count()
                if cluster.master_of(backend.key_names(f"n{i}")["config"]) == listening)
    sem = Semaphore(name, 1, backend, poll_interval=30)
    lease = sem.acquire()
    waiter = in_thread(lambda: sem.acquire(timeout=60))
    assert wait_until(lambda: sem.status().waiting == 1)
    replicated(cluster.clients[listening])

    cluster.kill(listening)
    during = in_thread(lambda: (lease.renew(), sem.try_acquire()))  # rides through
    assert wait_until(lambda: during, timeout=20)
    assert during == [("ok", (True, None))]  # the replica took over, with the lease
    # the other nodes learn of the failover by gossip, a moment after the calls rode through
    assert wait_until(lambda: cluster.master_of(backend.key_names(name)["config"]) != listening,
                      timeout=10)
    assert wait_until(lambda: any(subscribed(cluster.clients[port], prefix)
                                  for port in cluster.live()), timeout=15)
    released_at = time.monotonic()
    assert lease.verify() and lease.release() is True
    assert wait_until(lambda: waiter, timeout=10)
    assert time.monotonic() - released_at < 5  # woken, not polled
    assert waiter[0][0] == "ok" and waiter[0][1].release() is True

    cluster.restart(listening)
    cluster.wait_healthy()
    with sem.acquire(timeout=5) as again:
        assert again.verify()
    assert name in backend.names()
    backend.unwatch("-", "-")


# -- URLs and settings ----------------------------------------------------------------------


@pytest.mark.parametrize("url, problem", [
    ("redis+sentinel://127.0.0.1:26379", "names no master"),
    ("redis+sentinel://127.0.0.1:26379/", "names no master"),
    ("redis+sentinel:///mymaster/0", "names no host"),
    ("redis+sentinel://:s3cret@/mymaster/0", "names no host"),
    ("redis+sentinel://127.0.0.1:26379/mymaster/x", "database must be a number"),
    ("redis+sentinel://127.0.0.1:26379/mymaster/0/1", "/<master name>/<db>"),
    ("redis+sentinel://:s3cret@h1:26379,h2:99999/mymaster/0", "malformed"),
    ("redis+cluster://", "names no host"),
    ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
    ("redis+cluster://h:7000?sentinel_password=x", "redis+sentinel:// only"),
])
def test_a_wrong_url_is_one_clear_configuration_error(url, problem):
    with pytest.raises(ConfigurationError) as err:
        Semaphore("x", 1, url)
    message = str(err.value)
    assert problem in message and "\n" not in message
    assert "s3cret" not in message


def test_a_url_naming_the_wrong_kind_of_server_is_a_configuration_error(sentinel_group,
                                                                        redis_cluster):
    plain = sentinel_group.master_port()  # a data server, neither a sentinel nor a cluster
    node = redis_cluster.ports[0]
    as_cluster = get_backend(f"redis+cluster://127.0.0.1:{plain}")
    with pytest.raises(ConfigurationError, match="not a Redis Cluster node"):
        as_cluster.status("x")
    as_sentinel = get_backend(f"redis+sentinel://127.0.0.1:{node}/mymaster/0")
    with pytest.raises(ConfigurationError, match="not a Redis Sentinel"):
        as_sentinel.status("x")


def test_sentinel_urls_carry_passwords_tls_and_databases():
    url = sentinel_backend_url(
        "sentinel://:pw@s1:26379/3;sentinel://s2:26380/3",
        {"master_name": "my master", "sentinel_kwargs": {"password": "spw"}},
        {"ssl_cert_reqs": 2, "ssl_ca_certs": "/ca.pem"})
    assert url == ("rediss+sentinel://:pw@s1:26379,s2:26380/my%20master/3?sentinel_password=spw"
                   "&ssl_cert_reqs=required&ssl_ca_certs=%2Fca.pem")
    backend = get_backend(url)
    deployment = backend._connector.deployment
    assert deployment.hosts == (("s1", 26379), ("s2", 26380))
    assert deployment.master_name == "my master"
    assert deployment.connection["password"] == "pw" and deployment.connection["db"] == 3
    assert deployment.connection["ssl"] is True
    assert deployment.sentinel == {"password": "spw"}
    assert "pw" not in repr(backend) and "spw" not in repr(backend)
    # Celery's sentinel:// result backend serves too, behind a broker that cannot.
    app = Celery(set_as_current=False)
    app.conf.update(broker_url="sqs://", result_backend="sentinel://r1:26379/2",
                    result_backend_transport_options={"master_name": "m"})
    assert Settings().backend_url(app) == "redis+sentinel://r1:26379/m/2"


def test_a_sentinel_broker_without_semaphore_backend_gives_the_sentinel_backend(sentinel_group,
                                                                               prefix):
    group = sentinel_group
    app = Celery(set_as_current=False)
    app.conf.update(broker_url=group.broker_url,
                    broker_transport_options={"master_name": group.master_name})
    url = Settings.from_app(app).backend_url(app)
    hosts = ",".join(f"127.0.0.1:{port}" for port in group.sentinel_ports)
    assert url == f"redis+sentinel://{hosts}/{group.master_name}/0"
    sem = Semaphore("from-broker", 1, url, key_prefix=prefix)
    with sem.acquire(timeout=5) as lease:
        master = redis.Redis(port=group.master_port(), decode_responses=True)
        assert master.zscore(sem.backend.key_names("from-broker")["holders"],
                             lease.holder) is not None
        master.close()

    app.conf.broker_transport_options = {}
    with pytest.raises(ConfigurationError, match=r'broker_transport_options\["master_name"\]'):
        Settings.from_app(app).backend_url(app)


# -- a real worker run ----------------------------------------------------------------------


@pytest.mark.slow
def test_workers_on_the_sentinel_backend_go_on_when_the_master_dies(sentinels, redis_url,
                                                                    tmp_path):
    """2 prefork workers (4 processes each) run 40 guarded tasks (limit 2) on the Sentinel
    backend; the master is killed mid-run. Every task runs, never more than 2 at once and
    never one twice at once, by the probe file the task bodies write."""
    from tests.test_worker import Cluster

    group = sentinels
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), group.url)
    probe = FileProbe(cluster.env["CS_PROBE"])
    try:
        guarded = cluster.task("guarded")
        results = [guarded.delay(f"t{i}", 0.15) for i in range(40)]
        assert wait_until(lambda: sum(probe.completed("guarded:").values()) >= 8, timeout=30)
        old = group.master_port()
        group.clients[old].execute_command("WAIT", 1, 1000)
        group.kill_master()
        done_at_kill = sum(probe.completed("guarded:").values())
        group.wait_promoted(old)
        assert [r.get(timeout=90) for r in results] == [f"t{i}" for i in range(40)]
        assert done_at_kill < 40, "the run ended before the master died"
        assert set(probe.completed("guarded:")) == {f"guarded:t{i}" for i in range(40)}
        assert probe.max_concurrent("guarded:") <= 2
        assert probe.run_twice_at_once("guarded:") == []
        assert wait_until(lambda: cluster.held("images") == 0, timeout=10)
    finally:
        cluster.stop()


@pytest.mark.slow
def test_workers_on_the_cluster_backend_go_on_when_a_master_dies(cluster, redis_url, tmp_path):
    """2 prefork workers (4 processes each) on the Redis Cluster backend run guarded tasks of
    one semaphore (limit 2) and of a template over three customers (limit 1 each, on several
    masters); the master serving the first semaphore is killed mid-run. Every task runs,
    never over a limit and never one twice at once, by the probe file the task bodies write."""
    from tests.test_worker import Cluster

    workers = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), cluster.url)
    probe = FileProbe(workers.env["CS_PROBE"])
    try:
        guarded, per_customer = workers.task("guarded"), workers.task("per_customer")
        results = [guarded.delay(f"t{i}", 0.1) for i in range(30)]
        results += [per_customer.delay(c, f"c{i}", 0.05) for i in range(5) for c in (1, 2, 3)]
        assert wait_until(lambda: sum(probe.completed("guarded:").values()) >= 6, timeout=30)
        serving = cluster.master_of(workers.backend.key_names("images")["config"])
        cluster.kill(serving)
        done_at_kill = sum(probe.completed("guarded:").values())
        for result in results:
            result.get(timeout=90)
        assert done_at_kill < 30, "the run ended before the master died"
        assert set(probe.completed("guarded:")) == {f"guarded:t{i}" for i in range(30)}
        assert probe.max_concurrent("guarded:") <= 2
        for customer in (1, 2, 3):
            assert probe.max_concurrent(f"customer-{customer}:") == 1
        assert probe.run_twice_at_once("guarded:") == []
        assert wait_until(lambda: workers.held("images") == 0, timeout=10)
    finally:
        workers.stop()
