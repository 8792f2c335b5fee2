"""Acquire+release pairs per second and acquire latency, per backend, from 1 and 8 processes.

Each process loops ``Semaphore.acquire()`` / ``Lease.release()`` on a semaphore whose limit is
above the number of processes, so the figures measure the backend's round trips, not waiting.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from typing import Any, Dict, Iterator, List, Sequence

from tests.servers import RedisClusterGroup, SentinelGroup, slots_url, unique_tag

FORK = multiprocessing.get_context("fork")


def _loop(url: str, prefix: str, seconds: float, start: Any, out: Any) -> None:
    from celery_semaphore import Semaphore

    sem = Semaphore("bench", 64, url, key_prefix=prefix)
    for _ in range(50):  # warm up connections and scripts
        sem.acquire().release()
    latencies: List[float] = []
    start.wait()
    deadline = time.perf_counter() + seconds
    pairs = 0
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        lease = sem.acquire()
        latencies.append(time.perf_counter() - t0)
        lease.release()
        pairs += 1
    out.put((pairs, latencies))


def measure(url: str, processes: int, seconds: float = 3.0) -> Dict[str, Any]:
    prefix = f"{unique_tag()}:"
    start, out = FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=_loop, args=(url, prefix, seconds, start, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    start.set()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    pairs = sum(r[0] for r in results)
    latencies = sorted(x for r in results for x in r[1])
    return {
        "processes": processes,
        "pairs_per_s": round(pairs / seconds),
        "acquire_p50_ms": round(statistics.median(latencies) * 1000, 3),
        "acquire_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 3),
    }


def redis_server_cost(url: str) -> Dict[str, Any]:
    """Redis's own time per script call during an 8-process run (INFO commandstats).

    Tells whether a throughput figure is bound by the server or by the Python clients, which
    share this machine's cores with it.
    """
    import redis

    client = redis.Redis.from_url(url)
    client.config_resetstat()
    row = measure(url, 8)
    stats = client.info("commandstats")["cmdstat_evalsha"]
    usec = stats["usec_per_call"]
    return {"backend": "redis (server only)", "processes": 8,
            "pairs_per_s": round(1e6 / (2 * usec)),
            "acquire_p50_ms": "", "acquire_p99_ms": "",
            "note": f"{usec:.1f} us per script call in Redis; client-bound run: "
                    f"{row['pairs_per_s']} pairs/s"}


def redis_pair_cost(pairs: int = 5000) -> Dict[str, Any]:
    """Where a Redis server's CPU goes for one uncontended acquire and release (W9's case),
    one call per round trip, on a ``redis-server`` of its own: its CPU per pair (from /proc),
    the time inside the two scripts (``INFO commandstats``), what the shared prelude costs per
    call (a script of the prelude and ``return 1`` against one of ``TIME`` and ``return 1``),
    and two ``PING`` round trips: what the server spends on a round trip itself."""
    from celery_semaphore.backends.redis import backend as redis_backend
    from tests.servers import free_port, start_redis

    workdir = tempfile.mkdtemp(prefix="bench-pair-")
    proc, client = start_redis(free_port(), workdir)

    def server_cpu() -> float:
        fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def per_call(script: str, calls: int) -> float:
        sha = client.script_load(script)
        keys = [f"{{pair}}:{i}" for i in range(9)]
        client.config_resetstat()
        for _ in range(calls):
            client.evalsha(sha, 9, *keys, "604800000", "pair:", "pair")
        return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])

    try:
        port = client.connection_pool.connection_kwargs["port"]
        backend = redis_backend.RedisBackend(f"redis://127.0.0.1:{port}/0")
        for i in range(200):  # scripts loaded, keys made
            backend.acquire("pair", f"warm{i}", limit=1000, ttl=30, meta={}, wait=False)
            backend.release("pair", f"warm{i}")
        client.config_resetstat()
        before = server_cpu()
        for i in range(pairs):
            backend.acquire("pair", f"t{i}", limit=1000, ttl=30, meta={"task_id": f"t{i}"},
                            wait=False)
            backend.release("pair", f"t{i}")
        pair_us = (server_cpu() - before) * 1e6 / pairs
        script_us = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
        before = server_cpu()
        for _ in range(pairs):
            client.ping()
            client.ping()
        pings_us = (server_cpu() - before) * 1e6 / pairs
        prelude_us = (per_call(redis_backend.prelude_source() + "\nreturn 1", pairs)
                      - per_call("local t = redis.call('TIME') return 1", pairs))
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
    return {"backend": "redis (one pair's server CPU)", "processes": 1,
            "server_us_per_pair": round(pair_us), "in_scripts_us": round(2 * script_us),
            "prelude_us_per_call": round(prelude_us, 1), "two_pings_us": round(pings_us),
            "note": f"{pair_us:.0f} us of server CPU per pair: {2 * script_us:.0f} inside the "
                    f"two scripts (the shared prelude {prelude_us:.1f} per call), two PING "
                    f"round trips alone {pings_us:.0f}; {pairs} pairs, one call per round "
                    f"trip, on a redis-server of its own"}


def redis_holders_cost(sizes: Sequence[int] = (1, 16, 64, 256, 400, 1024),
                       pairs: int = 2000) -> Dict[str, Any]:
    """What an acquire costs a Redis server as holders grow (a limit that never binds, with
    many workers): ``pairs`` acquire and release pairs beside 1, 16, 64, 256, 400 and 1,024
    other holders, the ids and meta a worker gives them, on a ``redis-server`` of its own; the
    server's time per script call (``INFO commandstats``, the two scripts' mean). The lowest
    free slot and a twin come from the holders' index (``scripts/prelude.lua``), not from
    reading every holder: the cost should not grow with the holders."""
    from celery_semaphore.backends.base import new_holder_id
    from celery_semaphore.backends.redis import backend as redis_backend
    from tests.servers import free_port, start_redis

    workdir = tempfile.mkdtemp(prefix="bench-holders-")
    proc, client = start_redis(free_port(), workdir)
    meta = {"task_id": str(uuid.uuid4()), "task": "tasks.resize_image",
            "worker": "celery@worker-1", "first_wait": None}
    ids = [new_holder_id(str(uuid.uuid4())) for _ in range(pairs)]
    per_call = {}
    try:
        port = client.connection_pool.connection_kwargs["port"]
        backend = redis_backend.RedisBackend(f"redis://127.0.0.1:{port}/0")
        held = 0
        for size in sizes:
            for _ in range(held, size):
                backend.acquire("many", new_holder_id(str(uuid.uuid4())), limit=10_000,
                                ttl=600, meta=meta, wait=False)
            held = size
            client.config_resetstat()
            for holder in ids:
                backend.acquire("many", holder, limit=10_000, ttl=600, meta=meta, wait=False)
                backend.release("many", holder)
            per_call[size] = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
    figures = ", ".join(f"{size}: {us:.0f}" for size, us in per_call.items())
    return {"backend": "redis (cost as holders grow)", "processes": 1,
            "us_per_script_call": {size: round(us, 1) for size, us in per_call.items()},
            "note": f"us of server time per script call (acquire and release, their mean) "
                    f"beside N other holders: {figures}; {pairs} pairs each, on a "
                    f"redis-server of its own"}


def redis_handoff_cost(cycles: int = 3000, queued: int = 4) -> Dict[str, Any]:
    """What a handoff on a hot semaphore costs a Redis server (W2's and W11's case): on a
    semaphore of limit 1 with ``queued`` waiters that asked for pushed grants, ``cycles``
    times the holder's release, which grants the head of the queue and announces it, then a
    new waiter's queue entry, on a ``redis-server`` of its own. Per cycle: the server's CPU
    (from /proc), its time inside the two scripts and the commands they run (``INFO
    commandstats``, those inside the scripts included)."""
    from celery_semaphore.backends.redis import backend as redis_backend
    from tests.servers import command_calls, free_port, start_redis

    workdir = tempfile.mkdtemp(prefix="bench-handoff-")
    proc, client = start_redis(free_port(), workdir)
    meta = {"task_id": "t", "task": "tasks.resize_image", "worker": "celery@worker-1",
            "first_wait": None}

    def server_cpu() -> float:
        fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        port = client.connection_pool.connection_kwargs["port"]
        backend = redis_backend.RedisBackend(f"redis://127.0.0.1:{port}/0")
        line = [f"h{i}:1" for i in range(queued + 1)]
        for i, holder in enumerate(line):
            answer = backend.acquire("hot", holder, limit=1, ttl=600, meta=meta, wait=True,
                                     push=i > 0)
            assert (answer.grant is not None) == (i == 0), answer
        client.config_resetstat()
        commands_before, cpu_before = command_calls(client), server_cpu()
        for i in range(cycles):
            assert backend.release("hot", line.pop(0))
            holder = f"n{i}:1"
            backend.acquire("hot", holder, limit=1, ttl=600, meta=meta, wait=True, push=True)
            line.append(holder)
        cpu_us = (server_cpu() - cpu_before) * 1e6 / cycles
        stats = client.info("commandstats")
        commands = command_calls(client)
        status = backend.status("hot")
        assert [h.holder for h in status.holders] == line[:1], status.holders
        assert [w.holder for w in status.waiters] == line[1:], status.waiters
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
    script_us = stats["cmdstat_evalsha"]["usec"] / cycles
    per_cycle = (sum(commands.values()) - sum(commands_before.values())
                 - (commands.get("info", 0) - commands_before.get("info", 0))) / cycles
    return {"backend": "redis (one handoff's server CPU)", "processes": 1,
            "server_us_per_cycle": round(cpu_us), "in_scripts_us": round(script_us),
            "commands_per_cycle": round(per_cycle, 1),
            "note": f"{cpu_us:.0f} us of server CPU per handoff (a release that pushes the "
                    f"head's grant, then a queue entry): {script_us:.0f} inside the two "
                    f"scripts, {per_cycle:.1f} commands; {cycles} cycles beside {queued} "
                    f"waiters, on a redis-server of its own"}


CONSUL_NOTE = "measured against the test double (says nothing about a real Consul's speed)"


def consul_rows() -> List[Dict[str, Any]]:
    """The Consul backend against tests/consul_double.py: the backend's round trips and CPU,
    bound by a Python HTTP server sharing the cores, not by Consul."""
    from tests.consul_double import ConsulDouble

    double = ConsulDouble().start()
    try:
        rows = []
        for processes in (1, 8):
            row = {"backend": "consul", **measure(double.url, processes, seconds=2.0),
                   "note": CONSUL_NOTE}
            print(f"  {row}", flush=True)
            rows.append(row)
        return rows
    finally:
        double.stop()


@contextlib.contextmanager
def ha_redis() -> Iterator[Dict[str, str]]:
    """A private Redis Sentinel group (master, replica, 3 sentinels) and Redis Cluster (3
    masters, 3 replicas) on loopback for the run (tests/servers.py): their backend URLs by
    name, ``"redis sentinel"`` and ``"redis cluster"``."""
    workdir = tempfile.mkdtemp(prefix="bench-ha-")
    os.makedirs(os.path.join(workdir, "sentinel"))
    os.makedirs(os.path.join(workdir, "cluster"))
    sentinel = SentinelGroup(os.path.join(workdir, "sentinel"))
    try:
        cluster = RedisClusterGroup(os.path.join(workdir, "cluster"))
        try:
            yield {"redis sentinel": sentinel.url, "redis cluster": cluster.url}
        finally:
            cluster.stop()
    finally:
        sentinel.stop()


def run(redis_url: str, amqp_url: str, more: Dict[str, str]) -> List[Dict[str, Any]]:
    """Every backend's row; ``more``: backends beyond Redis, RabbitMQ, SQLite, memory and
    Consul, by name (PostgreSQL, Redis Sentinel, Redis Cluster)."""
    sqlite = f"sqlite:///{tempfile.mkdtemp(prefix='bench-')}/bench.db"
    slots = slots_url(amqp_url)
    rows = []
    for name, url, counts in (("memory", "memory://bench", (1,)),
                              ("sqlite", sqlite, (1, 8)),
                              ("redis", redis_url, (1, 8)),
                              *((name, url, (1, 8)) for name, url in more.items()),
                              ("amqp tokens", amqp_url, (1, 8)),
                              ("amqp slots", slots, (1, 8))):
        for processes in counts:
            row = {"backend": name, **measure(url, processes)}
            print(f"  {row}", flush=True)
            rows.append(row)
    for row in (redis_server_cost(redis_url), redis_pair_cost(), redis_holders_cost(),
                redis_handoff_cost()):
        print(f"  {row}", flush=True)
        rows.append(row)
    rows.extend(consul_rows())
    return rows
