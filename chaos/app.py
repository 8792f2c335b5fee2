"""The Celery app of the chaos soak, run by its ``celery worker`` subprocesses.

Configured from environment variables (``CHAOS_*``), so the workers reach the broker and the
semaphore backend through the run's TCP proxies while the run itself (the sender, the checker)
reaches them directly. Every task is at-least-once: ``task_acks_late`` and
``task_reject_on_worker_lost``, so a body killed with its pool process is delivered again.

Task bodies write the external history the checker reads (:func:`mark`): one line per start
and per end, appended with ``O_APPEND`` (atomic for lines this short), carrying the task id,
both clocks, the process and thread, the worker node, and every semaphore the body runs under,
named from the call's arguments here, not asked of the library. A body that raises
:class:`celery_semaphore.Backoff` writes no end mark: it appends a line to the backoff log
instead (:func:`backoff_mark`), with both clocks and the end of the pause it asks for, just
before it raises.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from celery import Celery

import celery_semaphore
from celery_semaphore import Adaptive, Backoff, current_leases

#: name -> limit of the fixed semaphores; templates below.
PLAIN = "chaos-plain"
MULTI = "chaos-m"
FAIR = "chaos-f"
WEIGHTED = "chaos-w"  # semaphore_cost 1 or 2 of 4 units, some calls with a priority
RATED = "chaos-r"  # semaphore_rate and a limit
RATE = "4/s"
#: An adaptive limit (issue #36): some calls raise ``Backoff()`` (no time: overload only).
LEARNED = "chaos-a"
LEARNED_LIMIT = Adaptive(min=1, max=3)
LIMITS: Dict[str, int] = {PLAIN: 2, MULTI: 2, FAIR: 2, WEIGHTED: 4, RATED: 2,
                          # the limit in force moves from min to max: the checker holds
                          # the bodies to max (the learned value is the library's book)
                          LEARNED: LEARNED_LIMIT.max}
KEYED_LIMIT = 1  # "chaos-k:{k}"
TENANT_LIMIT = 1  # "chaos-m:{tenant}"
KEYS = 20  # keys of the keyed template
#: A template over an API that answers 429 (issue #36): some calls' first run raises
#: ``Backoff(retry_after=...)``, pausing that key cluster-wide.
UPSTREAM = "chaos-u"  # "chaos-u:{k}"
UPSTREAM_LIMIT = 2
UPSTREAM_KEYS = 2
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
    if name.startswith(f"{UPSTREAM}:"):
        return UPSTREAM_LIMIT
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
    if task == "upstream":
        return [f"{UPSTREAM}:{args[0]}"]
    if task == "learned":
        return [LEARNED]
    raise KeyError(task)


def all_names() -> List[str]:
    """Every concrete semaphore name the app's tasks can run under."""
    return ([PLAIN, MULTI, FAIR, WEIGHTED, RATED, LEARNED]
            + [f"chaos-k:{k}" for k in range(KEYS)] + [f"{MULTI}:{t}" for t in TENANTS]
            + [f"{UPSTREAM}:{k}" for k in range(UPSTREAM_KEYS)])


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


def backoff_mark(path: str, task_id: str, node: str, names: List[str],
                 exc: Backoff) -> None:
    """Append ``backoff task_id monotonic_ns wall_ns pid tid node name,name seconds until_us``
    to ``path``: the body is about to raise ``exc``; ``seconds`` the time it asks for and
    ``until_us`` the end of that pause (``exc.at``, wall clock microseconds), both ``-`` for
    a Backoff with no time."""
    now_mono, now_wall = time.monotonic_ns(), time.time_ns()
    seconds = "-" if exc.seconds is None else f"{exc.seconds:.6f}"
    until = "-" if exc.at is None else str(int(exc.at * 1_000_000))
    line = (f"backoff {task_id} {now_mono} {now_wall} {os.getpid()} {threading.get_ident()} "
            f"{node} {','.join(names)} {seconds} {until}\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def first_backoff(directory: str, task_id: str) -> bool:
    """True the first time it is asked for ``task_id`` (a marker file made with ``O_EXCL``
    in ``directory``): the first run of a call that backs off raises, its later runs do not."""
    os.makedirs(directory, exist_ok=True)
    try:
        os.close(os.open(os.path.join(directory, task_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644))
    except FileExistsError:
        return False
    return True


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
        # hour), looked for every second. The lock kombu takes to look for them lapses after
        # 10 s, not 300: a broker cut between its taking and its release left it held, and no
        # worker restored anything for five minutes (seed 4242028: three tasks of a killed
        # worker never came back; docs/operations/reliability.md).
        broker_transport_options={"polling_interval": 0.05, "visibility_timeout": 30,
                                  "unacked_restore_interval": 1,
                                  "unacked_restore_throttle": 1,
                                  "unacked_mutex_expire": 10},
    )
    celery_semaphore.install(app)
    probe = env.get("CHAOS_PROBE", "/tmp/chaos-probe.log")
    backoff_log = env.get("CHAOS_BACKOFF_LOG") or os.path.join(os.path.dirname(probe),
                                                               "backoff.log")
    markers = os.path.join(os.path.dirname(backoff_log), "backed-off")

    def body(task: Any, names: List[str], hold: float,
             backoff: Optional[Callable[[], Backoff]] = None) -> None:
        """Mark the start, hold, mark the end; with ``backoff``, the first run of this task id
        raises what it makes instead of ending (after a line in the backoff log)."""
        node = task.request.hostname or "?"
        epochs = [lease.token.epoch for lease in current_leases().values()]
        mark(probe, "start", task.request.id, node, names, min(epochs) if epochs else None)
        time.sleep(hold)
        if backoff is not None and first_backoff(markers, task.request.id):
            exc = backoff()
            backoff_mark(backoff_log, task.request.id, node, names, exc)
            raise exc
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

    @app.task(name="chaos.upstream", bind=True, shared=False, semaphore=f"{UPSTREAM}:{{k}}",
              limit=UPSTREAM_LIMIT)
    def upstream(self: Any, k: int, backoff: float, hold: float) -> None:
        """A call to an API: with ``backoff`` > 0, its first run is answered "429, retry after
        ``backoff`` s" and raises Backoff(retry_after=backoff), pausing key ``k``."""
        body(self, [f"{UPSTREAM}:{k}"], hold,
             (lambda: Backoff(retry_after=backoff, reason="429 (chaos)")) if backoff > 0
             else None)

    @app.task(name="chaos.learned", bind=True, shared=False, semaphore=LEARNED,
              limit=LEARNED_LIMIT)
    def learned(self: Any, overload: bool, hold: float) -> None:
        """Under an adaptive limit: with ``overload``, its first run raises Backoff() (no
        time: the limit goes down, nothing is paused)."""
        body(self, [LEARNED], hold, Backoff if overload else None)

    return app


app = create_app(os.environ)
