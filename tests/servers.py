"""Find the Redis, RabbitMQ and PostgreSQL servers the tests need, or start private ones.

Order: the URL in ``REDIS_URL`` / ``AMQP_URL`` / ``POSTGRES_URL``; else the machine's default
port; else a server started here (``redis-server`` on a free port, ``rabbitmq-server
-detached``, a throwaway PostgreSQL cluster made by ``initdb`` on a free port). When none can
be had, the test run fails saying how to get one: tests that need a server are never skipped.

Every name a test puts on a server starts with :func:`unique_tag` (``cst`` + hex), so that
:func:`sweep_amqp`, :func:`sweep_redis` and :func:`sweep_postgres` can remove what the tests
and benchmarks left behind.
Durable queues left on RabbitMQ pile up run after run, and a broker recovering thousands of
them at boot takes minutes to start.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional, Set
from urllib.parse import urlsplit

import pytest

DEFAULT_REDIS = "redis://127.0.0.1:6379/15"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
#: The schema the postgres backend uses unless told otherwise (the contract suite's).
POSTGRES_SCHEMA = "celery_semaphore"
TEST_NAME = re.compile(r"^(?:_kombu\.binding(?:_permanent)?\.)?(cst[0-9a-f]{8})")
BROKER_DB = 14  # the Redis database the worker tests use as their broker
_issued: Set[str] = set()  # the tags this process handed out


def unique_tag() -> str:
    """A fresh tag to start every key, queue or exchange name a test creates on a server."""
    tag = f"cst{uuid.uuid4().hex[:8]}"
    _issued.add(tag)
    return tag


def _ours(name: str, everything: bool) -> bool:
    match = TEST_NAME.match(name)
    return match is not None and (everything or match.group(1) in _issued)


def reachable(url: str, default_port: int, timeout: float = 1.0) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def redis_db(url: str, db: int) -> str:
    """``url`` with its database number replaced by ``db``."""
    return f"{url.rsplit('/', 1)[0]}/{db}"


def redis_broker(url: str) -> str:
    """The Redis database the worker tests use as their broker, on ``url``'s server."""
    return redis_db(url, BROKER_DB)


def slots_url(amqp_url: str) -> str:
    """The slot-queue backend's URL on the broker at ``amqp_url`` (``amqp+slots://...``)."""
    scheme, rest = amqp_url.split("://", 1)
    return f"{scheme}+slots://{rest}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if reachable(url, port, timeout=0.5):
            return True
        time.sleep(0.2)
    return False


def redis_url() -> str:
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS)
    if reachable(url, 6379):
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"no Redis at {url} and no redis-server to start: install the Debian package "
                    "redis-server (make test does) or set REDIS_URL", pytrace=False)
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="celery-semaphore-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    atexit.register(proc.terminate)
    url = f"redis://127.0.0.1:{port}/15"
    if not wait_for(url, port, 10):
        pytest.fail(f"started redis-server on port {port}, but it does not answer", pytrace=False)
    os.environ["REDIS_URL"] = url  # worker subprocesses use the same server
    return url


def amqp_url() -> str:
    url = os.environ.get("AMQP_URL", DEFAULT_AMQP)
    if reachable(url, 5672):
        return url
    binary = shutil.which("rabbitmq-server") or (
        "/usr/sbin/rabbitmq-server" if os.path.exists("/usr/sbin/rabbitmq-server") else None)
    if binary is None:
        pytest.fail(f"no RabbitMQ at {url} and no rabbitmq-server to start: install the Debian "
                    "package rabbitmq-server (make test does) or set AMQP_URL", pytrace=False)
    subprocess.run([binary, "-detached"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for(url, 5672, 60):
        pytest.fail("started rabbitmq-server -detached, but it does not answer on 5672",
                    pytrace=False)
    return url


def rabbitmqctl() -> str:
    return shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"


def _broker_names(kind: str) -> List[str]:
    """Names of the local node's queues or exchanges (``rabbitmqctl list_<kind>``)."""
    done = subprocess.run([rabbitmqctl(), f"list_{kind}", "-q", "--no-table-headers", "name"],
                          capture_output=True, text=True, timeout=120, check=True)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def sweep_amqp(url: str, everything: bool = False) -> int:
    """Delete the queues and exchanges named with this process's tags (``everything``: with any
    test tag, left by earlier runs too) from the local RabbitMQ node; return how many.

    AMQP cannot list queues, so this needs ``rabbitmqctl`` on a node at a loopback address;
    with a remote ``AMQP_URL`` it does nothing.
    """
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return 0
    from kombu import Connection

    try:
        queues = [q for q in _broker_names("queues") if _ours(q, everything)]
        exchanges = [e for e in _broker_names("exchanges") if _ours(e, everything)]
    except (OSError, subprocess.SubprocessError):
        return 0  # no rabbitmqctl here (or no right to use it)
    with Connection(url, connect_timeout=10) as connection:
        channel = connection.default_channel
        for queue in queues:
            channel.queue_delete(queue)
        for exchange in exchanges:
            channel.exchange_delete(exchange)
    return len(queues) + len(exchanges)


def sweep_redis(url: str, everything: bool = False) -> int:
    """Delete the keys named with this process's tags (``everything``: any test tag) from the
    Redis database at ``url``; return how many."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = [key for key in client.scan_iter(match="*cst*", count=1000)
                if _ours(key.decode(errors="replace"), everything)]
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
        return len(keys)
    finally:
        client.close()


def command_calls(client: Any) -> Dict[str, int]:
    """Calls per command of the Redis server ``client`` talks to (``INFO commandstats``, the
    commands run inside scripts included)."""
    return {k[len("cmdstat_"):]: v["calls"] for k, v in client.info("commandstats").items()}


def start_redis(port: int, workdir: str, *options: str, client_url: str = ""):
    """A private ``redis-server`` on 127.0.0.1:``port`` (0: no TCP port; then ``client_url``
    says how to reach it) keeping its files in ``workdir`` (nothing persisted unless
    ``options`` say so); returns (process, client) once it answers."""
    import redis

    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir), *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(client_url) if client_url else redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while not answers(client):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"private redis-server on port {port} did not start", pytrace=False)
        time.sleep(0.02)
    return proc, client


def answers(client) -> bool:
    import redis

    try:
        return client.ping()
    except redis.ConnectionError:
        return False
    except redis.ResponseError:  # up, but refusing (MASTERDOWN)
        return True



def postgres_url() -> str:
    """``POSTGRES_URL``, else the machine's server on 5432, else a throwaway cluster started
    here (``initdb`` + ``pg_ctl``, trust auth, on a free loopback port, removed at exit)."""
    url = os.environ.get("POSTGRES_URL", DEFAULT_POSTGRES)
    if reachable(url, 5432):
        return url
    url = start_postgres(urlsplit(url).path.lstrip("/") or "test")
    os.environ["POSTGRES_URL"] = url  # worker subprocesses use the same server
    return url


def _postgres_bin(program: str) -> Optional[str]:
    """A PostgreSQL server program: on PATH, else the newest Debian one."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{program}"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return shutil.which(program) or (found[-1] if found else None)


def start_postgres(database: str) -> str:
    """A private PostgreSQL cluster on a free port with ``database`` in it; returns its URL.
    As root, the server runs as the ``postgres`` user (initdb refuses root)."""
    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.fail("no PostgreSQL at $POSTGRES_URL or 127.0.0.1:5432 and no initdb to start "
                    "one: install the Debian package postgresql (make test does) or set "
                    "POSTGRES_URL", pytrace=False)
    as_user: List[str] = []
    workdir = tempfile.mkdtemp(prefix="celery-semaphore-postgres-")
    if os.geteuid() == 0:
        import pwd

        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail("running as root and there is no postgres user to run a private "
                        "PostgreSQL server as; set POSTGRES_URL", pytrace=False)
        os.chown(workdir, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(workdir, "data"), free_port()

    def run(*cmd: str) -> None:
        done = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}", pytrace=False)

    run(initdb, "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
    run(pg_ctl, "-D", data, "-l", os.path.join(workdir, "server.log"), "-w", "-t", "60", "-o",
        f"-p {port} -c listen_addresses=127.0.0.1 -k {workdir} -c fsync=off", "start")

    def stop() -> None:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(stop)
    import psycopg

    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres",
                         autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    return f"postgresql://postgres@127.0.0.1:{port}/{database}"


def sweep_postgres(url: str, everything: bool = False) -> int:
    """Delete the semaphore rows named with this process's tags (``everything``: any test tag)
    from the default schema, and drop the schemas so named; return how many."""
    import psycopg
    from psycopg import sql

    swept = 0
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        schemas = [row[0] for row in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname ~ '^cst[0-9a-f]{8}'")]
        for schema in schemas:
            if _ours(schema, everything):
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
                swept += 1
        table = sql.Identifier(POSTGRES_SCHEMA, "semaphores")
        if conn.execute("SELECT to_regclass(%s)", (table.as_string(conn),)).fetchone()[0]:
            names = [row[0] for row in conn.execute(
                sql.SQL("SELECT name FROM {} WHERE name ~ '^cst[0-9a-f]{{8}}'").format(table))]
            ours = [name for name in names if _ours(name, everything)]
            if ours:
                conn.execute(sql.SQL("DELETE FROM {} WHERE name = ANY(%s)").format(table),
                             (ours,))
            swept += len(ours)
    return swept


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535 and _port_free(port + 10000):
            return port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _info(client, section: str) -> dict:
    import redis

    try:
        return client.info(section)
    except redis.RedisError:
        return {}


class ServerGroup:
    """Private server processes (``procs``) and a client of each (``clients``), by port."""

    what = "private servers"

    def __init__(self) -> None:
        self.procs: dict = {}
        self.clients: dict = {}

    def healthy(self) -> bool:
        raise NotImplementedError

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                pytest.fail(f"{self.what} not healthy in time", pytrace=False)
            time.sleep(0.1)

    def restore(self) -> None:
        """Restart every server of the group that is not running, and wait until the group
        is whole: what a test that killed one leaves behind, passed or failed."""
        for port, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.restart(port)
        self.wait_healthy()

    def restart(self, port: int) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for client in self.clients.values():
            client.close()


class SentinelGroup(ServerGroup):
    """A private Sentinel deployment on loopback ports: one master, one replica and three
    sentinels (quorum 2) watching ``master_name``, quick to fail over
    (``down-after-milliseconds`` 500). Servers keep their files in ``workdir``.
    :meth:`fail_over` kills the master's process and brings it back as a replica."""

    what = "private Redis Sentinel group"

    def __init__(self, workdir: str, master_name: str = "csmaster") -> None:
        self.workdir = workdir
        self.master_name = master_name
        super().__init__()
        self.data_ports = [free_port(), free_port()]
        master = self.data_ports[0]
        self._start_data(master)
        self._start_data(self.data_ports[1], "--replicaof", "127.0.0.1", str(master))
        self.sentinel_ports = [free_port() for _ in range(3)]
        for port in self.sentinel_ports:
            self._start_sentinel(port, master)
        self.wait_healthy()

    def _start_data(self, port: int, *options: str) -> None:
        self.procs[port], self.clients[port] = start_redis(port, self.workdir, *options)

    def _start_sentinel(self, port: int, master: int) -> None:
        import redis

        conf = os.path.join(self.workdir, f"sentinel-{port}.conf")
        with open(conf, "w") as f:
            f.write(f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                    f"sentinel monitor {self.master_name} 127.0.0.1 {master} 2\n"
                    f"sentinel down-after-milliseconds {self.master_name} 500\n"
                    f"sentinel failover-timeout {self.master_name} 2000\n")
        self.procs[port] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", conf, "--sentinel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.clients[port] = redis.Redis(port=port, decode_responses=True)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    @property
    def broker_url(self) -> str:
        """The same sentinels as Celery's ``sentinel://`` broker URL (kombu's form)."""
        return ";".join(f"sentinel://127.0.0.1:{port}/0" for port in self.sentinel_ports)

    def master_port(self) -> Optional[int]:
        """The master's port as every sentinel reports it, or None while they disagree."""
        import redis

        seen = set()
        for port in self.sentinel_ports:
            try:
                _, master = self.clients[port].sentinel_get_master_addr_by_name(self.master_name)
            except (redis.RedisError, TypeError):
                return None
            seen.add(int(master))
        return seen.pop() if len(seen) == 1 else None

    def healthy(self) -> bool:
        """Every sentinel agrees on the master, knows the other two and a live replica, and
        that replica's link to the master is up (as the replica says: sentinels refresh a
        replica's INFO only every 10 s)."""
        import redis

        master = self.master_port()
        if master is None or self.procs[master].poll() is not None:
            return False
        for port in self.sentinel_ports:
            try:
                state = self.clients[port].sentinel_master(self.master_name)
            except redis.RedisError:
                return False
            if state.get("num-other-sentinels") != 2 or state.get("num-slaves") < 1:
                return False
            replicas = self.clients[port].sentinel_slaves(self.master_name)
            if not any(not r["is_sdown"] for r in replicas):
                return False
        replica = next(p for p in self.data_ports if p != master)
        return _info(self.clients[replica], "replication").get("master_link_status") == "up"

    def kill_master(self) -> int:
        """SIGKILL the master's process; return its port."""
        master = self.master_port()
        assert master is not None
        self.procs[master].kill()
        self.procs[master].wait(10)
        return master

    def wait_promoted(self, old_master: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels agree on a master other than ``old_master``; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            master = self.master_port()
            if master is not None and master != old_master:
                return master
            time.sleep(0.05)
        pytest.fail("the sentinels promoted no replica in time", pytrace=False)

    def restart(self, port: int) -> None:
        """Bring a killed data server back as a replica of the current master (as an operator
        would; the sentinels would demote it anyway)."""
        deadline = time.monotonic() + 30
        while (master := self.master_port()) in (None, port):
            if time.monotonic() > deadline:
                pytest.fail("no master to restart a server under", pytrace=False)
            time.sleep(0.05)
        self._start_data(port, "--replicaof", "127.0.0.1", str(master))



class RedisClusterGroup(ServerGroup):
    """A private Redis Cluster on loopback ports: three masters with one replica each
    (``cluster-node-timeout`` 1000 ms, so a dead master's replica takes over within about two
    seconds), created with ``redis-cli --cluster create``. Servers keep their files (nodes
    config) in ``workdir``, so a restarted node rejoins as it left."""

    what = "private Redis Cluster"

    def __init__(self, workdir: str, masters: int = 3) -> None:
        self.workdir = workdir
        super().__init__()
        self.ports = [self._start_fresh_node() for _ in range(masters * 2)]
        done = subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
             *[f"127.0.0.1:{port}" for port in self.ports], "--cluster-replicas", "1",
             "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.stop()
            pytest.fail(f"redis-cli --cluster create failed: {done.stdout} {done.stderr}",
                        pytrace=False)
        self.wait_healthy()

    def start_node(self, port: int, wait: bool = True) -> None:
        import redis

        self.procs[port] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.workdir,
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-node-timeout", "1000", "--logfile", f"node-{port}.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.clients[port] = redis.Redis(port=port, decode_responses=True)
        if wait:
            self._wait_answers(port)

    def _start_fresh_node(self) -> int:
        """A node on a free port, answering. Its port or its bus port (+10000) can be taken
        between the check and the node's bind (an ephemeral port of another connection): then
        the node exits, and another port is tried (a fresh-clone CI run saw a node not start)."""
        for _ in range(5):
            port = free_cluster_port()
            self.start_node(port, wait=False)
            if self._answers_within(port, 20):
                return port
            proc = self.procs.pop(port)
            proc.kill()
            proc.wait(10)
            self.clients.pop(port).close()
        pytest.fail("no cluster node started on any of 5 free ports (their logs: "
                    f"{self.workdir}/node-*.log)", pytrace=False)

    def _answers_within(self, port: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not answers(self.clients[port]):
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _wait_answers(self, port: int) -> None:
        if not self._answers_within(port, 20):
            pytest.fail(f"cluster node on port {port} did not start (its log: "
                        f"{self.workdir}/node-{port}.log)", pytrace=False)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:3])

    def live(self) -> List[int]:
        return [port for port in self.ports if self.procs[port].poll() is None]

    def masters(self) -> List[int]:
        return [port for port in self.live()
                if _info(self.clients[port], "replication").get("role") == "master"]

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot, as the live nodes see it."""
        client = self.clients[self.live()[0]]
        slot = client.execute_command("CLUSTER", "KEYSLOT", key)
        for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(master[1])
        raise AssertionError(f"slot {slot} not served")

    def healthy(self) -> bool:
        """Every node is up and sees the cluster ``ok``; three masters each with an up
        replica."""
        if len(self.live()) != len(self.ports):
            return False
        for port in self.ports:
            if _info(self.clients[port], "cluster").get("cluster_enabled") != 1:
                return False
            if "cluster_state:ok" not in self._cluster_info(port):
                return False
            replication = _info(self.clients[port], "replication")
            if replication.get("role") == "slave" and replication.get(
                    "master_link_status") != "up":
                return False
        return len(self.masters()) == len(self.ports) // 2

    def _cluster_info(self, port: int) -> str:
        import redis

        try:
            return self.clients[port].execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return ""

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait(10)

    def restart(self, port: int) -> None:
        """Start a killed node again with its nodes config: it rejoins the cluster (as a
        replica, when its replica took over meanwhile)."""
        self.start_node(port)

