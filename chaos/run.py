"""The chaos run: private servers, real workers, a steady sender, a nemesis, the checker.

See the package docstring (:mod:`chaos`) for what it does and what its figures mean; ``python
-m chaos`` (``make chaos``) runs it with the settings in :class:`Settings`.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

from chaos import aof
from chaos import app as chaos_app
from chaos.checker import (
    BROKER_KILL_WINDOW_NS,
    NS,
    Fault,
    Report,
    attach_backoffs,
    check,
    close_unended,
    parse_backoffs,
    parse_probe,
)
from chaos.proxy import Proxy
from tests.util import retrying

#: Every fault the nemesis knows, in the order the docs list them.
FAULTS = ("child_kill", "worker_kill", "worker_freeze", "broker_restart", "broker_cut",
          "backend_restart", "backend_wipe", "backend_freeze", "backend_cut", "failover",
          "resize")
#: The faults that need one kind of semaphore backend (``CHAOS_BACKEND``).
ONLY_ON = {"backend_restart": "redis", "backend_wipe": "redis", "backend_freeze": "redis",
           "backend_cut": "redis", "failover": "sentinel"}
BACKENDS = ("redis", "sentinel")


class SettingsError(ValueError):
    """A ``CHAOS_*`` variable that cannot work; the run exits 2 before starting anything."""


@dataclass
class Settings:
    seconds: float = 300.0
    seed: int = 0
    backend: str = "redis"
    faults: tuple = tuple(f for f in FAULTS if ONLY_ON.get(f, "redis") == "redis")
    rate: float = 8.0  # tasks sent per second
    lease_ttl: float = 5.0
    drain: float = 600.0  # the longest wait for the last tasks after the faults stop
    #: the drain also ends when no task has completed for this long: longer than the broker's
    #: visibility timeout (30 s), after which a killed worker's messages are back
    stall: float = 45.0
    pause: tuple = (1.5, 5.0)  # seconds between two faults, drawn uniformly
    directory: str = ""

    @classmethod
    def from_env(cls, env: Dict[str, str]) -> "Settings":
        def number(var: str, default: float, low: float) -> float:
            raw = env.get(var, "")
            if raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise SettingsError(f"{var}={raw!r}: not a number") from None
            if not value >= low:
                raise SettingsError(f"{var}={raw!r}: must be at least {low}")
            return value

        seed_raw = env.get("CHAOS_SEED", "")
        if seed_raw == "":
            seed = random.SystemRandom().randrange(1, 10**9)
        elif seed_raw.isdigit():
            seed = int(seed_raw)
        else:
            raise SettingsError(f"CHAOS_SEED={seed_raw!r}: not a non-negative integer")
        backend = env.get("CHAOS_BACKEND", "") or "redis"
        if backend not in BACKENDS:
            raise SettingsError(f"CHAOS_BACKEND={backend!r}: one of {', '.join(BACKENDS)}")
        faults = tuple(f for f in FAULTS if ONLY_ON.get(f, backend) == backend)
        if env.get("CHAOS_FAULTS", "").strip():
            chosen = tuple(f.strip() for f in env["CHAOS_FAULTS"].split(",") if f.strip())
            unknown = [f for f in chosen if f not in FAULTS]
            if unknown:
                raise SettingsError(f"CHAOS_FAULTS: unknown fault {', '.join(unknown)} "
                                    f"(known: {', '.join(FAULTS)})")
            elsewhere = [f for f in chosen if f not in faults]
            if elsewhere:
                raise SettingsError(f"CHAOS_FAULTS: {', '.join(elsewhere)} needs "
                                    f"CHAOS_BACKEND={ONLY_ON[elsewhere[0]]}")
            faults = chosen
        return cls(seconds=number("CHAOS_SECONDS", 300.0, 1.0), seed=seed, backend=backend,
                   faults=faults,
                   rate=number("CHAOS_RATE", 8.0, 0.1),
                   lease_ttl=number("CHAOS_LEASE_TTL", 5.0, 1.0),
                   drain=number("CHAOS_DRAIN", 600.0, 1.0),
                   directory=env.get("CHAOS_DIR", ""))


def say(message: str) -> None:
    print(f"chaos: {message}", flush=True)


class RedisServer:
    """A private redis-server on a free loopback port with an fsynced AOF (``appendfsync
    always``: a restart loses nothing it acknowledged), to kill, wipe, freeze and restart."""

    def __init__(self, workdir: str) -> None:
        from tests import servers

        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = servers.free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        from tests import servers

        self.proc, client = servers.start_redis(self.port, self.workdir, "--appendonly", "yes",
                                                "--appendfsync", "always")
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def wipe(self) -> None:
        """Delete what it persisted: the next start is empty (a restart without persistence)."""
        for entry in os.listdir(self.workdir):
            path = os.path.join(self.workdir, entry)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class WorkerSlot:
    """One of the run's workers across its incarnations (a killed one is started again under
    a new node name, ``<base>-<n>``, with its own log)."""

    def __init__(self, env: Dict[str, str], base: str, pool: str, concurrency: int) -> None:
        self.env, self.base, self.pool, self.concurrency = env, base, pool, concurrency
        self.incarnation = 0
        self.worker = None
        self.nodes: List[str] = []

    def start(self) -> None:
        from tests.workers import NAME_SUFFIX, Worker

        self.incarnation += 1
        name = f"{self.base}-{self.incarnation}"
        self.worker = Worker(self.env, name, self.concurrency, self.pool, app="chaos.app")
        self.nodes.append(f"{name}{NAME_SUFFIX}@{socket.gethostname()}")

    @property
    def node(self) -> str:
        return self.nodes[-1]

    def wait_ready(self, timeout: float = 90.0) -> None:
        self.worker.wait_ready(timeout)

    def alive(self) -> bool:
        return self.worker.proc.poll() is None

    def pids(self) -> List[int]:
        """The main process and its pool processes."""
        return [self.worker.proc.pid] + self.worker.pool_pids()

    def logs(self) -> List[str]:
        return [os.path.join(self.env["CS_DIR"], f"{self.base}-{n}.log")
                for n in range(1, self.incarnation + 1)]


class Chaos:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: the order of the faults and the pauses between them: replayed exactly by a seed
        self.plan = random.Random(settings.seed)
        #: each fault's victim and length (a victim is drawn among the processes running a
        #: body at that moment, so this sequence is replayed only as far as timing allows)
        self.rng = random.Random(settings.seed + 2)
        self.send_rng = random.Random(settings.seed + 1)
        self.dir = settings.directory or tempfile.mkdtemp(prefix="chaos-")
        os.makedirs(self.dir, exist_ok=True)
        self.probe_path = os.path.join(self.dir, "probe.log")
        self.backoff_path = os.path.join(self.dir, "backoff.log")
        self.faults: List[Fault] = []
        self.sends: Dict[str, int] = {}
        self.send_failures = 0
        self.unexpected_exits: List[str] = []
        self.stop_sending = threading.Event()
        self._send_log = open(os.path.join(self.dir, "sent.log"), "a")
        self._fault_log = open(os.path.join(self.dir, "faults.jsonl"), "a")
        self.broker: Optional[RedisServer] = None
        self.backend_server: Optional[RedisServer] = None
        self.sentinel = None
        self.proxies: List[Proxy] = []
        self.slots: List[WorkerSlot] = []

    # -- set up and tear down ------------------------------------------------------------

    def start(self) -> None:
        from celery_semaphore.backends import get_backend

        self.broker = RedisServer(os.path.join(self.dir, "broker"))
        self.broker_proxy = Proxy(self.broker.port)
        self.proxies = [self.broker_proxy]
        direct = {"CHAOS_BROKER_URL": f"redis://127.0.0.1:{self.broker.port}/0"}
        if self.settings.backend == "sentinel":
            from tests.servers import SentinelGroup

            # the workers find the master through the sentinels: no proxy for the backend
            os.makedirs(os.path.join(self.dir, "sentinel"), exist_ok=True)
            self.sentinel = SentinelGroup(os.path.join(self.dir, "sentinel"))
            direct["CHAOS_BACKEND_URL"] = backend_url = self.sentinel.url
        else:
            self.backend_server = RedisServer(os.path.join(self.dir, "backend"))
            self.backend_proxy = Proxy(self.backend_server.port)
            self.proxies.append(self.backend_proxy)
            direct["CHAOS_BACKEND_URL"] = f"redis://127.0.0.1:{self.backend_server.port}/0"
            backend_url = f"redis://127.0.0.1:{self.backend_proxy.port}/0"
        common = {"CHAOS_LEASE_TTL": str(self.settings.lease_ttl), "CHAOS_PROBE": self.probe_path,
                  "CHAOS_BACKOFF_LOG": self.backoff_path, "CHAOS_QUEUE": "chaos"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        worker_env = dict(os.environ)
        worker_env.update(common, CHAOS_BROKER_URL=f"redis://127.0.0.1:{self.broker_proxy.port}/0",
                          CHAOS_BACKEND_URL=backend_url,
                          CS_DIR=self.dir, CS_QUEUE="chaos",
                          CS_LOGLEVEL=os.environ.get("CHAOS_LOGLEVEL", "info"),
                          PYTHONPATH=root)
        self.app = chaos_app.create_app({**common, **direct})
        self.backend = get_backend(direct["CHAOS_BACKEND_URL"], key_prefix="chaos:")
        self.slots = [WorkerSlot(worker_env, "w0", "prefork", 3),
                      WorkerSlot(worker_env, "w1", "prefork", 3),
                      WorkerSlot(worker_env, "w2", "threads", 3)]
        for slot in self.slots:
            slot.start()
        for slot in self.slots:
            slot.wait_ready()

    def stop(self) -> None:
        for slot in self.slots:
            if slot.worker is not None:
                for pid in slot.pids():
                    _signal(pid, signal.SIGCONT)
                slot.worker.stop(timeout=20)
                slot.worker.kill()
        for proxy in self.proxies:
            proxy.close()
        for server in (self.broker, self.backend_server):
            if server is not None:
                server.stop()
        if self.sentinel is not None:
            self.sentinel.stop()
        self._send_log.close()
        self._fault_log.close()

    # -- the sender ----------------------------------------------------------------------

    def send_one(self) -> None:
        rng = self.send_rng
        kind = rng.choices(("plain", "keyed", "multi", "fair", "weighted", "rated", "upstream",
                            "learned"), (17, 22, 17, 13, 10, 7, 9, 5))[0]
        hold = round(rng.uniform(0.05, 0.75), 3)
        options: Dict[str, object] = {}
        if kind in ("plain", "rated"):
            args: list = [hold]
        elif kind == "weighted":  # a cost of 1 or 2 units; one call in four with a priority
            args = [rng.choice((1, 2)), hold]
            if rng.random() < 0.25:
                options["headers"] = {"semaphore_priority": 5}
        elif kind == "keyed":
            args = [rng.randrange(chaos_app.KEYS), hold]
        elif kind == "upstream":  # one call in four backs off once, asking for 0.5-2.5 s
            backoff = round(rng.uniform(0.5, 2.5), 3) if rng.random() < 0.25 else 0.0
            args = [rng.randrange(chaos_app.UPSTREAM_KEYS), backoff, hold]
        elif kind == "learned":  # one call in four reports overload once (Backoff())
            args = [rng.random() < 0.25, hold]
        elif kind == "multi":
            args = [rng.choice(chaos_app.TENANTS), hold]
        else:  # a skewed mix of tenants, so fair shares have something to do
            args = [rng.choices(("t0", "t1", "t2"), (6, 3, 1))[0], hold]
        task_id = str(uuid.uuid4())
        try:
            self.app.tasks[f"chaos.{kind}"].apply_async(args, task_id=task_id, **options)
        except Exception as exc:  # the caller was told: not sent, not counted
            self.send_failures += 1
            self._send_log.write(f"failed {task_id} {time.monotonic_ns()} {kind} "
                                 f"{type(exc).__name__}\n")
            return
        self.sends[task_id] = time.monotonic_ns()
        self._send_log.write(f"sent {task_id} {self.sends[task_id]} {kind} "
                             f"{','.join(chaos_app.semaphores_of(kind, args))}\n")

    def send_loop(self) -> None:
        interval = 1.0 / self.settings.rate
        due = time.monotonic()
        while not self.stop_sending.is_set():
            self.send_one()
            due += interval
            self.stop_sending.wait(max(0.0, due - time.monotonic()))
        self._send_log.flush()

    # -- the nemesis ---------------------------------------------------------------------

    def record(self, fault: Fault) -> None:
        self.faults.append(fault)
        self._fault_log.write(json.dumps(fault.as_dict()) + "\n")
        self._fault_log.flush()
        took = (fault.end - fault.start) / NS
        say(f"fault {len(self.faults)}: {fault.kind} {fault.node or ''} {fault.note} "
            f"({took:.1f} s)")

    def nemesis_loop(self, until: float) -> None:
        low, high = self.settings.pause
        while True:
            self.check_workers()
            pause = self.plan.uniform(low, high)
            if time.monotonic() + pause >= until:
                break
            time.sleep(pause)
            kind = self.plan.choice(self.settings.faults)
            self.record(getattr(self, f"fault_{kind}")())
        self.check_workers()

    def check_workers(self) -> None:
        """A worker that exited without being killed is a finding; it is started again."""
        for slot in self.slots:
            if not slot.alive():
                self.unexpected_exits.append(f"{slot.node} exited with "
                                             f"{slot.worker.proc.returncode}")
                say(f"worker {slot.node} exited by itself ({slot.worker.proc.returncode}); "
                    "starting it again")
                slot.start()
                slot.wait_ready()

    def _sleep(self, low: float, high: float) -> float:
        seconds = self.rng.uniform(low, high)
        time.sleep(seconds)
        return seconds

    def running_pids(self) -> set:
        """Processes running a body now, by the probe (and the backoff log: a body that
        raised Backoff has stopped), as the checker reads them."""
        try:
            with open(self.probe_path) as f:
                runs = parse_probe(f)
        except FileNotFoundError:
            return set()
        try:
            with open(self.backoff_path) as f:
                attach_backoffs(runs, parse_backoffs(f))
        except FileNotFoundError:
            pass
        horizon = time.monotonic_ns()
        close_unended(runs, self.faults, horizon)
        return {run.pid for run in runs if run.end is None and run.cut_at == horizon}

    def fault_child_kill(self) -> Fault:
        prefork = [s for s in self.slots if s.pool == "prefork" and s.alive()]
        slot = self.rng.choice(prefork)
        children = slot.worker.pool_pids()
        busy = sorted(self.running_pids() & set(children))
        at = time.monotonic_ns()
        if not children:  # its pool is being replaced: nothing to kill this time
            return Fault("child_kill", at, at, node=slot.node, note="no pool process")
        victim = self.rng.choice(busy or children)
        _signal(victim, signal.SIGKILL)
        return Fault("child_kill", at, at, node=slot.node, killed=[victim],
                     note=f"pid {victim} {'in a body' if busy else 'idle'}")

    def fault_worker_kill(self) -> Fault:
        slot = self.rng.choice(self.slots)
        pids, node = slot.pids(), slot.node
        at = time.monotonic_ns()
        slot.worker.kill()
        self._sleep(0.5, 3.0)
        slot.start()
        end = time.monotonic_ns()
        slot.wait_ready()
        return Fault("worker_kill", at, end, node=node, killed=pids,
                     note=f"restarted as {slot.node}")

    def fault_worker_freeze(self) -> Fault:
        slot = self.rng.choice(self.slots)
        pids = slot.pids()
        at = time.monotonic_ns()
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        try:
            seconds = self._sleep(self.settings.lease_ttl + 1, self.settings.lease_ttl + 4)
        finally:
            for pid in pids:
                _signal(pid, signal.SIGCONT)
        return Fault("worker_freeze", at, time.monotonic_ns(), node=slot.node, frozen=pids,
                     note=f"SIGSTOP {seconds:.1f} s")

    def _restart(self, kind: str, server: RedisServer, wipe: bool = False,
                 window_ns: int = 0) -> Fault:
        at = time.monotonic_ns()
        server.kill()
        if wipe:
            server.wipe()
        seconds = self._sleep(1.0, 3.0)
        server.start()
        return Fault(kind, at, time.monotonic_ns(), window_ns=window_ns,
                     note=f"down {seconds:.1f} s")

    def fault_broker_restart(self) -> Fault:
        return self._restart("broker_restart", self.broker)

    def fault_backend_restart(self) -> Fault:
        return self._restart("backend_restart", self.backend_server)

    def fault_backend_wipe(self) -> Fault:
        """Restarted empty: the README's documented window (grants made before it are
        forgotten) lasts until a lease TTL after it is back."""
        return self._restart("backend_wipe", self.backend_server, wipe=True,
                             window_ns=int(self.settings.lease_ttl * NS))

    def fault_backend_freeze(self) -> Fault:
        at = time.monotonic_ns()
        self.backend_server.signal(signal.SIGSTOP)
        try:
            seconds = self._sleep(1.0, self.settings.lease_ttl + 3)
        finally:
            self.backend_server.signal(signal.SIGCONT)
        return Fault("backend_freeze", at, time.monotonic_ns(), note=f"SIGSTOP {seconds:.1f} s")

    def fault_resize(self) -> Fault:
        """Shrink a semaphore to 1 live, wait, grow it back to its declared limit."""
        name = self.rng.choice(chaos_app.RESIZABLE)
        declared = chaos_app.LIMITS[name]
        changes = []
        for old, new in ((declared, 1), (1, declared)):
            if changes:
                self._sleep(2.0, 5.0)
            t0 = time.monotonic_ns()
            retrying(lambda new=new: self.backend.resize(name, new))
            changes.append((name, old, new, t0, time.monotonic_ns()))
        return Fault("resize", changes[0][3], changes[-1][4], resizes=changes,
                     note=f"{name} {declared} -> 1 -> {declared}")

    def fault_failover(self) -> Fault:
        """Kill the Sentinel group's master; once a replica is promoted, bring the old one
        back as a replica. Replication is asynchronous: the README's documented window lasts
        from the kill until a lease TTL after the promotion."""
        group = self.sentinel
        at = time.monotonic_ns()
        old = group.kill_master()
        new = group.wait_promoted(old)
        promoted = time.monotonic_ns()
        group.restart(old)
        group.wait_healthy()
        return Fault("failover", at, promoted, window_ns=int(self.settings.lease_ttl * NS),
                     note=f"master {old} -> {new}, promoted in {(promoted - at) / NS:.1f} s")

    def _cut(self, kind: str, proxy: Proxy) -> Fault:
        seconds = self.rng.uniform(1.0, 4.0)
        at = time.monotonic_ns()
        proxy.cut(seconds)
        time.sleep(seconds)
        return Fault(kind, at, time.monotonic_ns(), note=f"{seconds:.1f} s")

    def fault_broker_cut(self) -> Fault:
        """Every worker's broker connections reset, and new ones refused for 1-4 s."""
        return self._cut("broker_cut", self.broker_proxy)

    def fault_backend_cut(self) -> Fault:
        """Every worker's backend connections reset, and new ones refused for 1-4 s."""
        return self._cut("backend_cut", self.backend_proxy)

    # -- the run -------------------------------------------------------------------------

    def completed(self) -> set:
        done = set()
        try:
            with open(self.probe_path) as f:
                for line in f:
                    if line.startswith("end "):
                        done.add(line.split()[1])
        except FileNotFoundError:
            pass
        return done

    def held(self) -> Dict[str, int]:
        statuses = retrying(lambda: self.backend.statuses(chaos_app.all_names()))
        return {name: status.held for name, status in statuses.items()}

    def run(self) -> Report:
        s = self.settings
        say(f"seed {s.seed} (replay: CHAOS_SEED={s.seed} CHAOS_SECONDS={s.seconds:g}"
            f"{' CHAOS_BACKEND=' + s.backend if s.backend != 'redis' else ''}"
            f" CHAOS_FAULTS={','.join(s.faults)} make chaos)")
        say(f"directory {self.dir}; faults: {', '.join(s.faults)}")
        self.start()
        began = time.monotonic()
        sender = threading.Thread(target=self.send_loop, name="sender", daemon=True)
        sender.start()
        try:
            self.nemesis_loop(until=began + s.seconds)
            time.sleep(max(0.0, began + s.seconds - time.monotonic()))
        finally:
            self.stop_sending.set()
            sender.join(30)
        soak = time.monotonic() - began
        say(f"{soak:.0f} s of faults and load: {len(self.faults)} faults, {len(self.sends)} "
            f"tasks sent ({self.send_failures} sends refused); draining")
        deadline = time.monotonic() + s.drain
        progress, done = time.monotonic(), 0
        while time.monotonic() < min(deadline, progress + s.stall):
            completed = self.completed()
            if not set(self.sends) - completed:
                break
            if len(completed) > done:
                progress, done = time.monotonic(), len(completed)
            self.check_workers()
            time.sleep(0.5)
        deadline = time.monotonic() + 3 * s.lease_ttl + 5
        while time.monotonic() < deadline and any(self.held().values()):
            time.sleep(0.5)
        held = self.held()
        horizon = time.monotonic_ns()
        say(f"drained in {time.monotonic() - began - soak:.0f} s")
        if not os.path.exists(self.backoff_path):
            open(self.backoff_path, "a").close()
        with open(self.probe_path) as probe, open(self.backoff_path) as backoffs:
            report = check(seconds=soak, sends=self.sends, probe_lines=probe,
                           faults=self.faults, ttl=s.lease_ttl, declared=chaos_app.limit_of,
                           held_at_end=held, horizon=horizon, backoff_lines=backoffs)
        report.details["send_failures"] = self.send_failures
        with open(self.probe_path) as probe:
            starts = sorted(r.start for r in parse_probe(probe) if chaos_app.RATED in r.names)
        # semaphore_rate: the most starts of the rated semaphore in any second (information:
        # a backend wiped empty forgets when the next start is due)
        report.details["rated_max_starts_in_1s"] = max(
            (bisect.bisect_left(starts, t + NS) - i for i, t in enumerate(starts)), default=0)
        self.excuse_broker_kill_pops(report)
        self.excuse_broker_cut_pops(report)
        report.details["lost_where"] = self.where(report.details.get("lost_tasks") or [])
        report.details["unexpected_worker_exits"] = self.unexpected_exits
        report.details["worker_log_errors"] = self.log_errors()
        return report

    def excuse_broker_kill_pops(self, report: Report) -> None:
        """Count apart from ``lost`` the lost tasks that the broker's AOF shows taken off a
        queue by a worker as the broker was SIGKILLed (:mod:`chaos.aof`: kombu's window)."""
        lost = list(report.details.get("lost_tasks") or [])
        if not lost or self.broker is None:
            return
        died = aof.popped_as_broker_died(os.path.join(self.broker.workdir, "appendonlydir"),
                                         lost)
        _count_in_kombus_window(report, died, "lost_popped_as_broker_died")

    def excuse_broker_cut_pops(self, report: Report) -> None:
        """Count apart from ``lost`` the lost tasks sent just as a ``broker_cut`` began (within
        the window of a broker kill) that the broker's AOF shows taken off their queue by a
        pop whose delivery was never recorded: the proxy reset the worker's connection as
        the broker served its ``BRPOP``, and the reply was lost (kombu's window, for a cut).
        A worker that did receive such a message puts it back from its own copy
        (``celery_internals.record_deliveries_first``): then it is not lost."""
        lost = list(report.details.get("lost_tasks") or [])
        cuts = [f.start for f in self.faults if f.kind == "broker_cut"]
        near = [t for t in lost if t in self.sends and any(
            -NS // 10 <= k - self.sends[t] <= BROKER_KILL_WINDOW_NS for k in cuts)]
        if not near or self.broker is None:
            return
        reset = aof.popped_never_recorded(
            os.path.join(self.broker.workdir, "appendonlydir"), near)
        _count_in_kombus_window(report, reset, "lost_popped_as_connection_reset")

    def where(self, task_ids: List[str]) -> Dict[str, List[str]]:
        """Where the broker holds each of ``task_ids`` at the end of the drain (a list: a task
        queue or a parking queue; ``unacked``: delivered to a worker, not acknowledged, with
        the seconds since), so that a lost task says where it stranded."""
        import redis

        if not task_ids or self.broker is None:
            return {}
        found: Dict[str, List[str]] = {task_id: [] for task_id in task_ids}
        client = redis.Redis(port=self.broker.port, socket_timeout=10)
        try:
            for key in client.scan_iter(count=1000):
                kind = client.type(key)
                if kind == b"list":
                    entries = client.lrange(key, 0, -1)
                elif kind == b"hash":
                    entries = list(client.hgetall(key).values())
                else:
                    continue
                for entry in entries:
                    for task_id in task_ids:
                        if task_id.encode() in entry:
                            found[task_id].append(key.decode(errors="replace"))
            for tag, score in client.zrange("unacked_index", 0, -1, withscores=True):
                raw = client.hget("unacked", tag) or b""
                for task_id in task_ids:
                    if task_id.encode() in raw:
                        found[task_id].append(f"unacked for {time.time() - score:.0f} s")
        except Exception as exc:  # a diagnosis only
            return {"error": [repr(exc)]}
        finally:
            client.close()
        return {task_id: places or ["nowhere"] for task_id, places in found.items()}

    def log_errors(self) -> List[str]:
        """The workers' CRITICAL lines, and each traceback as the line that logged it and the
        exception it ended with."""
        found: List[str] = []
        for slot in self.slots:
            for path in slot.logs():
                try:
                    with open(path, errors="replace") as f:
                        lines = f.read().splitlines()
                except FileNotFoundError:
                    continue
                name = os.path.basename(path)
                for i, line in enumerate(lines):
                    if "CRITICAL" in line:
                        found.append(f"{name}: {line[:300]}")
                    elif line.startswith("Traceback"):
                        end = next((j for j in range(i + 1, len(lines))
                                    if lines[j] and not lines[j].startswith(" ")), i)
                        found.append(f"{name}: {lines[i - 1][:200] if i else ''} ... "
                                     f"{lines[end][:200]}")
        return found[:40]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(env: Optional[Dict[str, str]] = None) -> int:
    try:
        settings = Settings.from_env(dict(os.environ if env is None else env))
    except SettingsError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    def interrupted(signum: int, frame: object) -> None:
        raise SystemExit(f"chaos: interrupted by signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # stop what the run started, then exit
    chaos = Chaos(settings)
    try:
        report = chaos.run()
    finally:
        chaos.stop()
    details = report.details
    for key, value in details.items():
        if value:
            say(f"{key}: {json.dumps(value)}")
    with open(os.path.join(chaos.dir, "report.json"), "w") as f:
        json.dump({**report.summary(), "details": details, "seed": settings.seed}, f, indent=1)
    say("PASS" if report.ok else f"FAIL (replay with CHAOS_SEED={settings.seed})")
    print(report.json_line(), flush=True)
    return 0 if report.ok else 1


__all__ = ["FAULTS", "Chaos", "Settings", "main"]


def _count_in_kombus_window(report: Report, tasks: Set[str], why: str) -> None:
    """Move ``tasks`` from ``report``'s lost tasks to kombu's window, listed under ``why``
    too (nothing when there are none)."""
    if not tasks:
        return
    report.lost -= len(tasks)
    report.details["lost_tasks"] = [t for t in report.details["lost_tasks"] if t not in tasks]
    window = list(report.details.get("lost_in_broker_kill_window") or [])
    report.details["lost_in_broker_kill_window"] = window + sorted(tasks)
    report.details[why] = sorted(tasks)
