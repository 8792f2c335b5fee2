"""What a guarded send costs the sending process: ``python -m benchmarks.sends [ROUNDS]``.

Per round, 2,000 sends of the same task unguarded, 2,000 of W6's task (``t:{key}``, a new key
each), then 2,000 more of the same keys again (``guarded_again``), from this process to a Redis
broker (no worker runs: the time is the sender's): milliseconds per send of each, the guarded
first sends' extra, and how many times parking on send asked the backend whether a key had a
backlog (``Backend.waiting_count``: never for a key this process has not sent for
``waiting_room.UNKNOWN_AFTER``, once per send of a key sent again, when its last answer is
older than ``IDLE_FOR``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List

from benchmarks.workload import new_run

SENDS = 2000


def run(redis_url: str, broker: str, rounds: int = 3) -> List[Dict[str, Any]]:
    from celery_semaphore.waiting_room import ParkOnSend

    reads = [0]
    busy_read = ParkOnSend.backend

    def counting_backend(self: Any) -> Any:  # each backlog read goes through backend()
        backend = busy_read(self)
        if not getattr(backend, "_sends_counted", False):
            waiting_count = backend.waiting_count

            def counted(name: str) -> int:
                reads[0] += 1
                return waiting_count(name)

            backend.waiting_count = counted
            backend._sends_counted = True
        return backend

    ParkOnSend.backend = counting_backend  # type: ignore[method-assign]
    _, tag, _, bench_app = new_run("sends", broker, redis_url, 1)
    rows = []
    try:
        for r in range(rounds):
            row: Dict[str, Any] = {"benchmark": "guarded sends of new keys", "round": r}
            for kind, task, keys in (("unguarded", "keyed_plain", "u"), ("guarded", "keyed", "g"),
                                     ("guarded_again", "keyed", "g")):
                send = bench_app.app.tasks[f"benchmarks.bench_app.{task}"]
                before = reads[0]
                began = time.perf_counter()
                for k in range(SENDS):
                    send.delay(f"{tag}{keys}{r}:{k}", 0, 0.0)
                row[f"{kind}_ms_per_send"] = round(
                    (time.perf_counter() - began) * 1000 / SENDS, 3)
                row[f"{kind}_backlog_reads"] = reads[0] - before
            row["extra_ms_per_send"] = round(
                row["guarded_ms_per_send"] - row["unguarded_ms_per_send"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        ParkOnSend.backend = busy_read  # type: ignore[method-assign]
        with bench_app.app.connection_for_write() as connection:
            for queue in (f"{tag}.q",):
                connection.default_channel.queue_purge(queue)
        bench_app.app.close()
    return rows


if __name__ == "__main__":
    from benchmarks.workload import broker_url
    from tests.servers import redis_url

    url = redis_url()
    run(url, broker_url(url), int(sys.argv[1]) if len(sys.argv) > 1 else 3)
