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
from typing import List, Optional, Set
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
