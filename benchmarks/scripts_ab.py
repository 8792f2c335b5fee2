"""Two versions of the Redis scripts side by side: what the same calls cost each.

``python -m benchmarks.scripts_ab OTHER_TREE [--shape pairs|handoff] [--calls N]``: the
scripts of ``OTHER_TREE`` (a checkout of another commit, e.g. from ``git worktree add``) and
this tree's are loaded on two ``redis-server`` processes of their own, and every call goes to
both, one after the other in one loop, so that the machine's noise falls on both alike. Per
cycle and server: the time inside the scripts (``INFO commandstats``) and the commands they
ran (those inside the scripts included).

Shapes: ``pairs``, an uncontended acquire and release beside 8 other holders (W9's case);
``handoff``, on a semaphore of limit 1 with 4 waiters that asked for pushed grants, the
holder's release (which grants the head) and a new waiter's queue entry (W2's and W11's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from celery_semaphore.backends.base import Acquire, Operation, Release
from celery_semaphore.backends.redis import backend as redis_backend
from tests.servers import command_calls, free_port, start_redis

META = {"task_id": "t", "task": "tasks.resize_image", "worker": "celery@worker-1",
        "first_wait": None}


def _sources(tree: str) -> Dict[str, str]:
    """Each script of ``tree`` as its backend loads it (prelude in front)."""
    code = ("import json; from celery_semaphore.backends.redis import backend as b; "
            "print(json.dumps({k: v[0] for k, v in b._sources().items()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": tree})
    return dict(json.loads(out.stdout))


def run(other: str, shape: str = "handoff", calls: int = 5000) -> Dict[str, Any]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    servers: List[Tuple[Any, Any, Dict[str, str], str]] = []
    workdirs = []
    try:
        for tree in (other, here):
            workdir = tempfile.mkdtemp(prefix="bench-ab-")
            workdirs.append(workdir)
            proc, client = start_redis(free_port(), workdir)
            shas = {name: client.script_load(text) for name, text in _sources(tree).items()}
            servers.append((proc, client, shas, tree))
        port = servers[0][1].connection_pool.connection_kwargs["port"]
        backend = redis_backend.RedisBackend(f"redis://127.0.0.1:{port}/0")

        def call(op: Operation) -> None:
            ((script, keys, argv),), _ = backend.calls_of(op)
            for _, client, shas, _ in servers:
                client.evalsha(shas[script], len(keys), *keys, *argv)

        if shape == "pairs":
            for i in range(8):
                call(Acquire("p", f"other{i}:1", 1000, 600.0, META, False))
        else:
            line = [f"h{i}:1" for i in range(5)]
            for i, holder in enumerate(line):
                call(Acquire("hot", holder, 1, 600.0, META, True, push=i > 0))
        before = []
        for _, client, _, _ in servers:
            client.config_resetstat()
            before.append(command_calls(client))
        for i in range(calls):
            if shape == "pairs":
                call(Acquire("p", f"t{i}:1", 1000, 30.0, META, False))
                call(Release("p", f"t{i}:1"))
            else:
                call(Release("hot", line.pop(0)))
                line.append(f"n{i}:1")
                call(Acquire("hot", line[-1], 1, 600.0, META, True, push=True))
        rows = []
        for (_, client, _, tree), counts in zip(servers, before):
            usec = client.info("commandstats")["cmdstat_evalsha"]["usec"]
            after = command_calls(client)
            ran = sum(after.values()) - sum(counts.values()) - (
                after.get("info", 0) - counts.get("info", 0))
            rows.append({"tree": tree, "in_scripts_us_per_cycle": round(usec / calls, 1),
                         "commands_per_cycle": round(ran / calls, 1)})
    finally:
        for proc, client, _, _ in servers:
            client.close()
            proc.terminate()
            proc.wait(10)
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"shape": shape, "cycles": calls, "other": rows[0], "this": rows[1]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scripts_ab")
    parser.add_argument("other", help="a checkout of the scripts to compare with")
    parser.add_argument("--shape", choices=("pairs", "handoff"), default="handoff")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.other, args.shape, args.calls)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
