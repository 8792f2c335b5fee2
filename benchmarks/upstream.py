"""W10, an API behind the task (``../shared/workloads.md``): calls of 20 ms to a partner API on
loopback (:mod:`benchmarks.partner_api`) that answers 429 with ``Retry-After`` past a limit of
its own, on 2 workers x 4 prefork, each way beside Celery's own (``autoretry_for`` the 429 with
``retry_backoff``, no semaphore) and an oracle that knows the API's limits, in the same run:

* W10a, a window quota: ``Q`` calls per fixed window of ``P`` seconds; the tasks raise
  ``Backoff`` with the 429's ``Retry-After`` (no rate, no quota); oracle:
  ``semaphore_quota="Q/Ps"``. Also: calls that reached the API while a Retry-After it had given
  was still running (more than 0.1 s after that 429), from the API's own log; the most calls
  the API served in a window, and the least share of ``Q`` it served in a whole window while
  calls waited.
* W10b, an unknown concurrency: at most ``C`` calls at once (429, ``Retry-After: 1``), halved
  halfway; ``limit=Adaptive(min=1, max=64)`` and ``Backoff()`` on a 429; oracle: ``limit=C``,
  resized when ``C`` halves. Also: the share of 429s after the first 10 s, and after ``C``
  halves how long until it stays under 5 %.
* W10c, a token budget: ``T`` tokens per window of ``P`` seconds, 5 to 50 per call (told in
  the answer); ``semaphore_quota`` in tokens, 50 estimated at admission, the actual settled.
  Also: the most tokens any window spent (never above ``T`` plus one call's overdraft) and the
  least share of ``T`` a window used while calls waited.

Per way: goodput (successful calls per second, first send to last end), the share of calls
answered 429, Celery retries used (``Retry in`` lines of the workers' logs), makespan.
``python -m benchmarks.upstream [a b c]``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import partner_api
from benchmarks.workload import _start_worker, broker_url, new_run, wait_for_ends
from tests.probe import probe_for

# W10a: 20 calls a second at most, in windows of 2 s
QUOTA, PERIOD = 40, 2.0
# W10b: 6 at once, then 3 (the pool has 8 processes: the limit matters)
CAPACITY, HALVE_AFTER = 6, 20.0
# W10c: 600 tokens per 2 s window (about 22 calls of 5-50 tokens)
BUDGET = 600


def run_way(label: str, task: str, broker: str, backend: str, calls: int,
            api: partner_api.PartnerAPI, env_extra: Dict[str, str],
            during: Optional[Any] = None) -> Dict[str, Any]:
    """``calls`` of ``task`` against ``api``; the figures of the run."""
    server, base = partner_api.serve(api)
    os.environ.update(env_extra, BENCH_API=base)
    tmp, tag, env, bench_app = new_run(f"w10-{label}", broker, backend, 64)
    env = dict(env, **{"BENCH_LOGLEVEL": "info", **env_extra}, BENCH_API=base)
    logs = [os.path.join(tmp, f"w{i}.log") for i in (1, 2)]
    procs = [_start_worker(env, f"w10{label}{i}", 4, log) for i, log in zip((1, 2), logs)]
    probe = probe_for(env["BENCH_PROBE"])
    try:
        send = bench_app.app.tasks[f"benchmarks.bench_app.{task}"]
        began_wall, began = time.time(), time.monotonic_ns()
        for i in range(calls):
            send.delay(f"c{i}")
        if during is not None:
            during(bench_app, began_wall)
        # every call succeeded once (a 429 run is a body that ended too: count successes)
        deadline = time.monotonic() + 900
        while _successes(api) < calls:
            if time.monotonic() > deadline:
                raise RuntimeError(f"W10 {label}: {_successes(api)} of {calls} succeeded")
            time.sleep(0.2)
        wait_for_ends(probe, 0, calls, "c", 60, f"W10 {label}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
        bench_app.app.close()
        server.shutdown()
    report = api.report()
    ends = [e for runs in probe.intervals().values() for _, e in runs if e is not None]
    makespan = (max(ends) - began) / 1e9
    log = report["calls"]
    ok = sum(1 for c in log if c["status"] == 200)
    retries = sum(open(path, errors="replace").read().count(" Retry in ") for path in logs)
    return {"way": label, "task": task, "calls": calls, "makespan_s": round(makespan, 2),
            "goodput_per_s": round(ok / makespan, 2),
            "share_429": round(1 - ok / len(log), 3) if log else 0.0,
            "celery_retries": retries, "api_peak": report["peak"], "began": began_wall,
            "log": log, "windows": report["windows"]}


def _successes(api: partner_api.PartnerAPI) -> int:
    return sum(1 for c in api.report()["calls"] if c["status"] == 200)


def early_calls(log: Sequence[Dict[str, Any]], slack: float = 0.1) -> int:
    """Calls that reached the API more than ``slack`` seconds after it answered a 429 and
    before that answer's ``Retry-After`` ran out."""
    early, until = 0, -math.inf
    given_at = -math.inf
    for call in sorted(log, key=lambda c: c["t"]):
        if given_at + slack < call["t"] < until:
            early += 1
        if call["retry_until"] is not None and call["retry_until"] > until:
            until, given_at = call["retry_until"], call["t"]
    return early


def share_429_after(log: Sequence[Dict[str, Any]], start: float, end: float = math.inf
                    ) -> float:
    part = [c for c in log if start <= c["t"] < end]
    return round(sum(1 for c in part if c["status"] == 429) / len(part), 3) if part else 0.0


def w10a(broker: str, backend: str, calls: int = 300) -> List[Dict[str, Any]]:
    rows = []
    for label, task in (("celery", "api_celery"), ("backoff", "api_backoff"),
                        ("oracle", "api_quota")):
        api = partner_api.PartnerAPI("window", quota=QUOTA, period=PERIOD)
        row = run_way(label, task, broker, backend, calls, api,
                      {"BENCH_QUOTA": f"{QUOTA}/{int(PERIOD)}s"})
        row["early_calls"] = early_calls(row["log"])
        per_window = [count for _, count in sorted(row["windows"].items(),
                                                   key=lambda kv: float(kv[0]))]
        busy = per_window[1:-1]  # whole windows while calls waited
        row["max_calls_in_a_window"] = max(per_window) if per_window else 0
        row["least_share_used"] = round(min(busy) / QUOTA, 3) if busy else None
        rows.append(row)
    return _vs_oracle("W10a", rows)


def w10b(broker: str, backend: str, calls: int = 6000) -> List[Dict[str, Any]]:
    rows = []

    def halve(bench_app: Any, began: float) -> None:  # the oracle knows when C halves
        from celery_semaphore.backends import get_backend

        time.sleep(max(0.0, began + HALVE_AFTER - time.time()))
        backend_ = get_backend(os.environ["BENCH_SEMAPHORE_BACKEND"],
                               key_prefix=os.environ["BENCH_PREFIX"])
        backend_.resize("apic", CAPACITY // 2)

    for label, task, during in (("celery", "api_celery", None),
                                ("adaptive", "api_adaptive", None),
                                ("oracle", "api_capacity", halve)):
        api = partner_api.PartnerAPI("concurrency", capacity=CAPACITY,
                                     halve_after=HALVE_AFTER)
        row = run_way(label, task, broker, backend, calls, api,
                      {"BENCH_CAPACITY": str(CAPACITY)}, during)
        first = row["log"][0]["t"] if row["log"] else row["began"]
        row["share_429_after_10s"] = share_429_after(row["log"], first + 10,
                                                     first + HALVE_AFTER)
        row["recovered_s"] = _recovery(row["log"], first + HALVE_AFTER)
        rows.append(row)
    return _vs_oracle("W10b", rows)


def _recovery(log: Sequence[Dict[str, Any]], halved: float, window: float = 2.0
              ) -> Optional[float]:
    """Seconds after ``halved`` until every later window of ``window`` seconds has under 5 %
    of its calls answered 429 (None: never)."""
    calls = sorted((c for c in log if c["t"] >= halved), key=lambda c: c["t"])
    if not calls:
        return None
    end = calls[-1]["t"]
    starts = [halved + i * window for i in range(int((end - halved) / window) + 1)]
    bad = [s for s in starts if share_429_after(calls, s, s + window) >= 0.05]
    return round(bad[-1] + window - halved, 1) if bad else 0.0


def w10c(broker: str, backend: str, calls: int = 300) -> List[Dict[str, Any]]:
    rows = []
    for label, task in (("celery", "api_celery"), ("quota", "api_tokens")):
        api = partner_api.PartnerAPI("tokens", budget=BUDGET, period=PERIOD)
        row = run_way(label, task, broker, backend, calls, api,
                      {"BENCH_TOKENS": f"{BUDGET}/{int(PERIOD)}s"})
        spent = _tokens_per_window(row["log"])
        busy = list(spent.values())[1:-1]  # whole windows while calls waited
        row["max_tokens_in_a_window"] = max(spent.values()) if spent else 0
        row["least_share_used"] = round(min(busy) / BUDGET, 3) if busy else None
        row["workload"] = "W10c"
        rows.append(row)
    return rows


def _tokens_per_window(log: Sequence[Dict[str, Any]]) -> Dict[float, int]:
    out: Dict[float, int] = {}
    for call in log:
        start = math.floor(call["t"] / PERIOD) * PERIOD
        out[start] = out.get(start, 0) + call["tokens"]
    return dict(sorted(out.items()))


def _vs_oracle(workload: str, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    oracle = rows[-1]["goodput_per_s"]
    for row in rows:
        row["workload"] = workload
        row["vs_oracle"] = round(row["goodput_per_s"] / oracle, 3) if oracle else None
    return rows


def summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in ("log", "windows", "began")}
            for row in rows]


def run(redis_url: str, shapes: Sequence[str] = ("a", "b", "c")) -> List[Dict[str, Any]]:
    broker = broker_url(redis_url)
    rows: List[Dict[str, Any]] = []
    for shape in shapes:
        part = {"a": w10a, "b": w10b, "c": w10c}[shape](broker, redis_url)
        for row in summary(part):
            print(json.dumps(row), flush=True)
        rows += summary(part)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tests.servers import redis_url

    run(redis_url(), list(argv if argv is not None else sys.argv[1:]) or ["a", "b", "c"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__: Tuple[str, ...] = ("run", "early_calls", "share_429_after")
