"""W9, the gate's cost per task (``../shared/workloads.md``), and the breakdown behind it.

N tasks of ``hold`` seconds on one semaphore whose limit (1,000) never binds, against the same
tasks unguarded, on the same two workers (x 4 prefork, Redis broker), in rounds of alternating
order (unguarded first in odd rounds, guarded first in even ones). Per round and kind:

* makespan (first send to the last body's end, from the probe file the bodies write) and
  throughput; ``vs_unguarded`` = unguarded makespan / guarded makespan of the same round pair;
* CPU seconds per 1,000 tasks of the workers' main processes (every thread; ``/proc/<pid>/
  stat``), of their pool processes (``pool_cpu_s_per_1000``: the children alive at the end of
  the round), of the backend's and the broker's Redis servers (``INFO cpu``) and of the whole
  machine (``/proc/stat``: pool processes, sender and everything else included) and of the
  sending process (this one, ``time.process_time``), and how busy
  the machine's cores were during the round (``machine_busy``, 1.0: every core all the time);
* how long a freed pool process waited for its next body (``turnaround_*_ms``: from a body's
  end to the next start in the same process, by the probe's marks; mean, p50 and p99);
* the workers' main processes' context switches per task, voluntary and not, summed over
  their threads (``/proc/<pid>/task/*/status``), with the busiest threads by name;
* commands per task: on the backend (a Redis server of its own, so that ``INFO commandstats``
  counts only the semaphore's commands, those run inside scripts included) and on the broker
  (the shared Redis server's ``INFO commandstats``: other clients of that server count too).

``--shape w6`` measures W6's 1,000 x 1 instead (one task per key of the template ``t:{key}`` at
limit 1, 20 ms; the same task unguarded): a key with room, the other case where the gate has
nothing to decide.

``python -m benchmarks.pertask [--shape w9|w6] [--tasks N] [--hold S] [--rounds R]
[--workers W] [--concurrency C] [--profile]``; ``--workers 1 --concurrency 1`` measures the
handoff inside one pool process, on an idle machine (the turnaround then is what the gate adds
between two tasks, with no CPU contention); ``--profile``
records a py-spy profile of one worker's main process during each round, guarded and
unguarded (raw stacks next to the probe file, 250 samples a second or ``BENCH_PROFILE_RATE``;
``py-spy`` comes with the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import redis

from benchmarks.workload import _start_worker, broker_url, new_run, turnaround
from tests.probe import Probe, probe_for

HOLD = 0.001
TASKS = 3000

#: shape -> (workload label, unguarded task, guarded task, the arguments of call i)
SHAPES: Dict[str, Tuple[str, str, str, Callable[[str, int, float], Tuple[Any, ...]]]] = {
    "w9": ("W9", "unguarded", "wide", lambda prefix, i, hold: (f"{prefix}{i}", hold)),
    "w6": ("W6 1000 x 1", "keyed_plain", "keyed",
           lambda prefix, i, hold: (f"{prefix}{i}", 0, hold)),
}


def _stat(pid: int) -> Tuple[float, int]:
    """(CPU seconds, threads) of process ``pid``, every thread counted."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[17])


def _children(pid: int) -> List[int]:
    """The live child processes of ``pid`` (a prefork worker's pool processes)."""
    out: List[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return out


def _children_cpu(pids: Sequence[int]) -> float:
    """CPU seconds the pool processes of the workers ``pids`` have used (those alive now)."""
    total = 0.0
    for pid in pids:
        for child in _children(pid):
            try:
                total += _stat(child)[0]
            except OSError:  # ended since it was listed
                pass
    return total


def _switches(pid: int) -> Dict[str, int]:
    """Context switches per thread name (voluntary + involuntary) of process ``pid``."""
    out: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        name = fields["Name"].strip()
        out[name] += (int(fields["voluntary_ctxt_switches"])
                      + int(fields["nonvoluntary_ctxt_switches"]))
    return out


def _commands(client: "redis.Redis[Any]") -> Counter:
    stats = client.info("commandstats")
    return Counter({key[len("cmdstat_"):]: value["calls"] for key, value in stats.items()})


def _machine_busy() -> float:
    """CPU seconds the whole machine spent not idle (every core, every process: /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _server_cpu(client: Any) -> float:
    """CPU seconds a Redis server has used (``INFO cpu``: its main thread and the rest)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _snapshot(pids: Sequence[int], backend: Any, broker: Any) -> Dict[str, Any]:
    switches: Counter[str] = Counter()
    for pid in pids:
        switches.update(_switches(pid))
    return {"cpu": sum(_stat(pid)[0] for pid in pids), "switches": switches,
            "pool_cpu": _children_cpu(pids),
            "threads": sum(_stat(pid)[1] for pid in pids),
            "backend": _commands(backend), "broker": _commands(broker),
            "backend_cpu": _server_cpu(backend), "broker_cpu": _server_cpu(broker),
            "machine": _machine_busy()}


def _private_redis() -> Tuple[Any, str, str]:
    from tests.servers import free_port, start_redis

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bench-w9-backend-")
    proc, _ = start_redis(port, workdir)
    return proc, f"redis://127.0.0.1:{port}/0", workdir


def run(broker: str, tasks: int = TASKS, hold: float = HOLD, rounds: int = 2,
        profile: bool = False, backend: Optional[str] = None, shape: str = "w9",
        workers: int = 2, concurrency: int = 4) -> List[Dict[str, Any]]:
    """Rows of ``shape`` (W9 by default): one per round and kind, with the ratios per round;
    on ``workers`` workers of ``concurrency`` prefork processes (W9's 2 x 4 by default)."""
    label, plain, guarded, call_args = SHAPES[shape]
    server, own_backend, workdir = (None, backend, None) if backend else _private_redis()
    assert own_backend is not None
    tmp, tag, env, bench_app = new_run("w9", broker, own_backend, 1000)
    logs = [os.path.join(tmp, f"w{i}.log") for i in range(1, workers + 1)]
    env = dict(env, BENCH_LOGLEVEL="warning")
    procs = [_start_worker(env, f"w9-{i}", concurrency, log)
             for i, log in enumerate(logs, start=1)]
    probe = probe_for(env["BENCH_PROBE"])
    backend_client = redis.Redis.from_url(own_backend)
    broker_client = redis.Redis.from_url(broker)
    pids = [p.pid for p in procs]
    rows: List[Dict[str, Any]] = []
    try:
        # warm up both paths (imports, connections, scripts loaded)
        for kind, task in (("warm-u", plain), ("warm-g", guarded)):
            _send_and_wait(bench_app, probe, task, f"{kind}:", 50, hold, call_args)
        for r in range(rounds):
            order = (("unguarded", plain), ("guarded", guarded))
            if r % 2:
                order = order[::-1]
            pair: Dict[str, Dict[str, Any]] = {}
            for kind, task in order:
                prefix = f"r{r}{kind[0]}:"
                before = _snapshot(pids, backend_client, broker_client)
                spy = _start_profile(pids[0], tmp, f"{kind}-{r}") if profile else None
                makespan, sender_cpu = _send_and_wait(bench_app, probe, task, prefix, tasks,
                                                      hold, call_args)
                if spy is not None:
                    _stop_profile(spy)
                after = _snapshot(pids, backend_client, broker_client)
                switches = after["switches"] - before["switches"]
                backend_cmds = after["backend"] - before["backend"]
                broker_cmds = after["broker"] - before["broker"]
                row = {"workload": label, "round": r, "kind": kind,
                       "tasks": f"{tasks} x {hold * 1000:g} ms", "makespan_s": round(makespan, 3),
                       "tasks_per_s": round(tasks / makespan, 1),
                       "cpu_s_per_1000": round((after["cpu"] - before["cpu"]) * 1000 / tasks, 3),
                       "pool_cpu_s_per_1000": round(
                           (after["pool_cpu"] - before["pool_cpu"]) * 1000 / tasks, 3),
                       "backend_server_cpu_s_per_1000": round(
                           (after["backend_cpu"] - before["backend_cpu"]) * 1000 / tasks, 3),
                       "broker_server_cpu_s_per_1000": round(
                           (after["broker_cpu"] - before["broker_cpu"]) * 1000 / tasks, 3),
                       "machine_cpu_s_per_1000": round(
                           (after["machine"] - before["machine"]) * 1000 / tasks, 3),
                       "sender_cpu_s_per_1000": round(sender_cpu * 1000 / tasks, 3),
                       "machine_busy": round((after["machine"] - before["machine"])
                                             / (makespan * os.cpu_count()), 3),
                       "switches_per_task": round(sum(switches.values()) / tasks, 2),
                       "switches_by_thread": {k: round(v / tasks, 2)
                                              for k, v in switches.most_common(6)},
                       "threads": after["threads"],
                       "backend_cmds_per_task": round(sum(backend_cmds.values()) / tasks, 2),
                       "backend_cmds": {k: round(v / tasks, 2)
                                        for k, v in backend_cmds.most_common(8)},
                       "broker_cmds_per_task": round(sum(broker_cmds.values()) / tasks, 2),
                       "broker_cmds": {k: round(v / tasks, 2)
                                       for k, v in broker_cmds.most_common(8)}}
                row.update(turnaround(probe, prefix, 0))
                pair[kind] = row
                print(json.dumps(row), flush=True)
                rows.append(row)
            ratio = pair["unguarded"]["makespan_s"] / pair["guarded"]["makespan_s"]
            pair["guarded"]["vs_unguarded"] = round(ratio, 3)
            pair["guarded"]["cpu_vs_unguarded"] = round(
                pair["guarded"]["cpu_s_per_1000"] / pair["unguarded"]["cpu_s_per_1000"], 3)
            pair["guarded"]["machine_cpu_vs_unguarded"] = round(
                pair["guarded"]["machine_cpu_s_per_1000"]
                / pair["unguarded"]["machine_cpu_s_per_1000"], 3)
            print(json.dumps({"round": r, **{k: pair["guarded"][k] for k in (
                "vs_unguarded", "cpu_vs_unguarded", "machine_cpu_vs_unguarded")}}), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        bench_app.app.close()
        backend_client.close()
        broker_client.close()
        if server is not None:
            server.terminate()
            server.wait(10)
            shutil.rmtree(workdir or "", ignore_errors=True)
    return rows


def _send_and_wait(bench_app: Any, probe: Probe, task: str, prefix: str, n: int,
                   hold: float, call_args: Callable[[str, int, float], Tuple[Any, ...]]
                   ) -> Tuple[float, float]:
    """(makespan, CPU seconds this process spent sending)."""
    send = bench_app.app.tasks[f"benchmarks.bench_app.{task}"]
    base = probe.ended()
    began, cpu = time.monotonic_ns(), time.process_time()
    for i in range(n):
        send.delay(*call_args(prefix, i, hold))
    cpu = time.process_time() - cpu
    deadline = time.monotonic() + 600
    while True:  # a cheap count (the record is parsed once, at the end)
        done = probe.ended() - base
        if done >= n:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{task}: {done} of {n} ran")
        time.sleep(0.1)
    ends = [e for key, runs in probe.intervals().items() if key.startswith(prefix)
            for _, e in runs if e is not None]
    return (max(ends) - began) / 1e9, cpu


def _start_profile(pid: int, tmp: str, label: str) -> Any:
    out = os.path.join(tmp, f"profile-{label}.txt")
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # the venv's (bench)
    spy = beside if os.path.exists(beside) else "py-spy"
    rate = os.environ.get("BENCH_PROFILE_RATE", "250")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", rate,
                             "--format", "raw", "--output", out, "--nonblocking", "--gil"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out


def _stop_profile(spy: Any) -> None:
    proc, out = spy
    proc.send_signal(2)
    proc.wait(30)
    print(f"  profile: {out}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pertask")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="w9")
    parser.add_argument("--tasks", type=int)
    parser.add_argument("--hold", type=float)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.concurrency < 1:
        parser.error("--workers and --concurrency must be at least 1")
    from tests.servers import redis_url

    tasks, hold = (TASKS, HOLD) if args.shape == "w9" else (1000, 0.02)
    run(broker_url(redis_url()), args.tasks or tasks, args.hold if args.hold is not None else hold,
        args.rounds, args.profile, shape=args.shape, workers=args.workers,
        concurrency=args.concurrency)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
