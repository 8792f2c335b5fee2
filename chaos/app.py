"""The Celery app of the chaos soak, run by its ``celery worker`` subprocesses.

Configured from environment variables (``CHAOS_*``), so the workers reach the broker and the
semaphore backend through the run's TCP proxies while the run itself (the sender, the checker)
reaches them directly. Every task is at-least-once: ``task_acks_late`` and
``task_reject_on_worker_lost``, so a body killed with its pool process is delivered again.

Task bodies write the external history the checker reads (:func:`mark`): one line per start
and per end, appended with ``O_APPEND`` (atomic for lines this short), carrying the task id,
both clocks, the process and thread, the worker node, and every semaphore the body runs under,
named from the call's arguments here, not asked of the library.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Mapping, Optional

from celery import Celery

import celery_semaphore
from celery_semaphore import current_leases

#: name -> limit of the fixed semaphores; templates below.
PLAIN = "chaos-plain"
MULTI = "chaos-m"
FAIR = "chaos-f"
WEIGHTED = "chaos-w"  # semaphore_cost 1 or 2 of 4 units, some calls with a priority
RATED = "chaos-r"  # semaphore_rate and a limit
RATE = "4/s"
LIMITS: Dict[str, int] = {PLAIN: 2, MULTI: 2, FAIR: 2, WEIGHTED: 4, RATED: 2}
KEYED_LIMIT = 1  # "chaos-k:{k}"
TENANT_LIMIT = 1  # "chaos-m:{tenant}"
KEYS = 20  # keys of the keyed template
TENANTS = ("t0", "t1", "t2", "t3")
#: The semaphores a live resize may shrink and grow again.
RESIZABLE = (PLAIN, MULTI, FAIR)


def limit_of(name: str) -> int:
    """The declared limit of a concrete semaphore name of this app."""
    if name in LIMITS:
        return LIMITS[name]
    if name.startswith("chaos-k:"):
        return KEYED_LIMIT
    if name.startswith(f"{MULTI}:"):
        return TENANT_LIMIT
    raise KeyError(name)


def semaphores_of(task: str, args: List) -> List[str]:
    """The concrete semaphore names a call of ``task`` with ``args`` runs under."""
    if task == "plain":
        return [PLAIN]
    if task == "keyed":
        return [f"chaos-k:{args[0]}"]
    if task == "multi":
        return [MULTI, f"{MULTI}:{args[0]}"]
    if task == "fair":
        return [FAIR]
    if task == "weighted":
        return [f"{WEIGHTED}*{args[0]}"]
    if task == "rated":
        return [RATED]
    raise KeyError(task)



def all_names() -> List[str]:
    return ([PLAIN, MULTI, FAIR, WEIGHTED, RATED] + [f"chaos-k:{k}" for k in range(KEYS)]
            + [f"{MULTI}:{t}" for t in TENANTS])


def mark(path: str, kind: str, task_id: str, node: str, names: List[str],
         granted_us: Optional[int] = None) -> None:
    """Append ``kind task_id monotonic_ns wall_ns pid tid node name,name granted`` to
    ``path``; ``granted``: the earliest fencing epoch of the body's leases (microseconds, the
    backend's clock; ``-`` when not given)."""
    line = (f"{kind} {task_id} {time.monotonic_ns()} {time.time_ns()} {os.getpid()} "
            f"{threading.get_ident()} {node} {','.join(names)} "
            f"{'-' if granted_us is None else granted_us}\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def create_app(env: Mapping[str, str]) -> Celery:
    app = Celery("chaos.app", set_as_current=False)
    ttl = float(env.get("CHAOS_LEASE_TTL", "5"))
    app.conf.update(
        broker_url=env.get("CHAOS_BROKER_URL", "redis://127.0.0.1:1/0"),
        semaphore_backend=env.get("CHAOS_BACKEND_URL", "redis://127.0.0.1:1/0"),
        semaphore_key_prefix="chaos:",
        semaphore_lease_ttl=ttl,
        semaphore_poll_interval=0.5,
        semaphore_retry_backoff=0.2,
        semaphore_retry_backoff_max=1.0,
        # under the broker's visibility timeout, with room for a freeze past the lease TTL
        semaphore_worker_max_hold=10.0,
        task_default_queue=env.get("CHAOS_QUEUE", "chaos"),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=2,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # A killed worker's unacknowledged messages come back after 30 s (kombu's default is an
        # hour), looked for every second.
        broker_transport_options={"polling_interval": 0.05, "visibility_timeout": 30,
                                  "unacked_restore_interval": 1,
                                  "unacked_restore_throttle": 1},
    )
    celery_semaphore.install(app)
    probe = env.get("CHAOS_PROBE", "/tmp/chaos-probe.log")

    def body(task, names: List[str], hold: float) -> None:
        node = task.request.hostname or "?"
        epochs = [lease.token.epoch for lease in current_leases().values()]
        mark(probe, "start", task.request.id, node, names, min(epochs) if epochs else None)
        time.sleep(hold)
        mark(probe, "end", task.request.id, node, names)

    @app.task(name="chaos.plain", bind=True, shared=False, semaphore=PLAIN, limit=LIMITS[PLAIN])
    def plain(self, hold: float) -> None:
        body(self, [PLAIN], hold)

    @app.task(name="chaos.keyed", bind=True, shared=False, semaphore="chaos-k:{k}",
              limit=KEYED_LIMIT)
    def keyed(self, k: int, hold: float) -> None:
        body(self, [f"chaos-k:{k}"], hold)

    @app.task(name="chaos.multi", bind=True, shared=False, semaphore=[MULTI, f"{MULTI}:{{tenant}}"],
              limit={MULTI: LIMITS[MULTI], f"{MULTI}:{{tenant}}": TENANT_LIMIT})
    def multi(self, tenant: str, hold: float) -> None:
        body(self, [MULTI, f"{MULTI}:{tenant}"], hold)

    @app.task(name="chaos.fair", bind=True, shared=False, semaphore=FAIR, limit=LIMITS[FAIR],
              semaphore_fair_by="{tenant}")
    def fair(self, tenant: str, hold: float) -> None:
        body(self, [FAIR], hold)

    @app.task(name="chaos.weighted", bind=True, shared=False, semaphore=WEIGHTED,
              limit=LIMITS[WEIGHTED], semaphore_cost="{cost}")
    def weighted(self, cost: int, hold: float) -> None:
        body(self, [f"{WEIGHTED}*{cost}"], hold)

    @app.task(name="chaos.rated", bind=True, shared=False, semaphore=RATED,
              limit=LIMITS[RATED], semaphore_rate=RATE)
    def rated(self, hold: float) -> None:
        body(self, [RATED], hold)

    return app


app = create_app(os.environ)
