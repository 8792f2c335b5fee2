"""The Celery app of the workload benchmarks (run by real ``celery worker`` subprocesses).

``BENCH_LIMIT`` is the limit of ``gated`` (and ``diy``); ``tenant`` is guarded by the template
``tenant:{tenant}``, limit 2, with ``tenant:hot`` at 1 (workload W3); ``fair`` by
``semaphore_fair_by="{tenant}"``, limit 4, and ``unfair``, the same in FIFO (W5); ``paced``
by ``semaphore_rate="50/s"`` and ``celery_paced`` by Celery's ``rate_limit="25/s"`` (W7);
``weighted`` by ``semaphore_cost="{cost}"``, limit 8 (W8).
"""

import os
import sys
import time

from celery import Celery, signals

import celery_semaphore
from tests.probe import probe_for

LIMIT = int(os.environ.get("BENCH_LIMIT", "4"))

app = Celery("benchmarks.bench_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/12"),
    semaphore_backend=os.environ.get("BENCH_SEMAPHORE_BACKEND") or None,
    semaphore_key_prefix=os.environ.get("BENCH_PREFIX", "bench:"),
    semaphore_limits={"tenant:hot": 1},
    # "0": guarded tasks go to the task queue and the worker parks what it cannot start soon
    semaphore_park_on_send=os.environ.get("BENCH_PARK_ON_SEND", "1") == "1",
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    semaphore_worker_lookahead=int(os.environ.get("BENCH_LOOKAHEAD", "1")),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
celery_semaphore.install(app)
probe = probe_for(os.environ.get("BENCH_PROBE", "/tmp/bench-probe.log"))


@signals.worker_ready.connect
def _say_ready(sender=None, **_):
    """The line the benchmarks wait for, at any log level (Celery logs its own "ready." at
    info only)."""
    print(f"bench worker {sender.hostname} ready.", file=sys.__stderr__, flush=True)


def body(key, hold):
    probe.mark("start", key)
    time.sleep(hold)
    probe.mark("end", key)


@app.task(semaphore="bench", limit=LIMIT, shared=False)
def gated(key, hold):
    body(key, hold)


@app.task(semaphore="tenant:{tenant}", limit=2, shared=False)
def tenant(tenant, key, hold):
    body(key, hold)


@app.task(semaphore="fair", limit=4, semaphore_fair_by="{tenant}", shared=False)
def fair(tenant, key, hold):
    """W5: one semaphore whose waiters are served round-robin across tenants."""
    body(key, hold)


@app.task(semaphore="unfair", limit=4, shared=False)
def unfair(tenant, key, hold):
    """W5's "today": the same semaphore without ``semaphore_fair_by`` (FIFO)."""
    body(key, hold)


@app.task(rate_limit="25/s", shared=False)
def celery_paced(key, hold):
    """W7's baseline: Celery's own rate limit, per worker (two workers: 2 x 25/s)."""
    body(key, hold)


# Rates and costs need a backend that applies them atomically: a worker on the RabbitMQ
# backends refuses to start with such a task (W1 runs on them too).
if not (os.environ.get("BENCH_SEMAPHORE_BACKEND") or "").startswith("amqp"):
    @app.task(semaphore="paced", limit=100, semaphore_rate="50/s", shared=False)
    def paced(key, hold):
        """W7: at most 50 starts a second, cluster-wide (limit 100: the rate binds)."""
        body(key, hold)

    @app.task(semaphore="paced2", limit=100, semaphore_rate="50/s", semaphore_burst=2,
              shared=False)
    def paced_burst(key, hold):
        """W7 with a burst of 2: one interval of slack absorbs the hand-off latency."""
        body(key, hold)

    @app.task(semaphore="weighted", limit=8, semaphore_cost="{cost}", shared=False)
    def weighted(cost, key, hold):
        """W8: holds ``cost`` units of a limit of 8."""
        body(key, hold)


@app.task(acks_late=True, shared=False)
def plain(key, hold):
    """The dedicated-queue baseline: a worker with concurrency = limit, prefetch 1, acks late."""
    body(key, hold)


@app.task(bind=True, max_retries=None, shared=False)
def diy(self, key, hold):
    """What users write today: a Redis semaphore taken in the body, retry in 1 s when full."""
    sem = celery_semaphore.Semaphore("diy", LIMIT, os.environ["BENCH_SEMAPHORE_BACKEND"],
                                     key_prefix=os.environ.get("BENCH_PREFIX", "bench:"))
    lease = sem.try_acquire()
    if lease is None:
        raise self.retry(countdown=1)
    with lease:
        body(key, hold)


@app.task(semaphore="t:{key}", limit=1, shared=False)
def keyed(key, task, hold):
    """W6: one limit per key of the template ``t:{key}``."""
    body(f"{key}/{task}", hold)


@app.task(shared=False)
def keyed_plain(key, task, hold):
    """W6's baseline: the same task with no semaphore, on the same workers."""
    body(f"{key}/{task}", hold)


@app.task(semaphore="wide", limit=1000, shared=False)
def wide(key, hold):
    """W9: one semaphore whose limit (1,000) never binds: the gate's cost per task."""
    body(key, hold)


@app.task(shared=False)
def unguarded(key, hold):
    """W9's baseline: the same task with no semaphore, on the same workers."""
    body(key, hold)


# -- W10: an API behind the task (benchmarks/upstream.py) -----------------------------------
API = os.environ.get("BENCH_API", "http://127.0.0.1:9")


class TooManyRequests(Exception):
    """The API answered 429 (Celery's own way retries on it)."""


def api_call(key, settle=False, too_many=None):
    """One call to the partner API, recorded by the probe; 429: ``too_many(answer)`` raised,
    by default :class:`.Backoff` from its ``Retry-After``."""
    from benchmarks.partner_api import call

    probe.mark("start", key)
    try:
        answer = call(API, key)
    finally:
        probe.mark("end", key)
    if answer.status == 429:
        if too_many is not None:
            raise too_many(answer)
        raise celery_semaphore.Backoff.from_response(answer, reason="429 from the partner API")
    if settle:
        celery_semaphore.current_lease().settle(answer.tokens)
    return answer.tokens


@app.task(semaphore="api", limit=64, shared=False)
def api_backoff(key):
    """W10a: Backoff(retry_after=...) from the 429's header; no rate, no quota."""
    return api_call(key)


@app.task(autoretry_for=(TooManyRequests,), retry_backoff=True, retry_backoff_max=30,
          max_retries=None, shared=False)
def api_celery(key):
    """W10, Celery's own way: no semaphore; a 429 is retried with exponential backoff."""
    return api_call(key, too_many=lambda answer: TooManyRequests())


# (quotas, adaptive limits and settled costs need such a backend too: the W1 run on the
# RabbitMQ backends would refuse to start with them)
if not (os.environ.get("BENCH_SEMAPHORE_BACKEND") or "").startswith("amqp"):
    @app.task(semaphore="apiq", limit=64, semaphore_quota=os.environ.get("BENCH_QUOTA") or None,
              shared=False)
    def api_quota(key):
        """W10a's oracle: the API's window quota as semaphore_quota."""
        return api_call(key)

    @app.task(semaphore="apia", limit=celery_semaphore.Adaptive(min=1, max=64), shared=False)
    def api_adaptive(key):
        """W10b: the limit learned; a 429 gives the call back and signals overload."""
        return api_call(key, too_many=lambda answer: celery_semaphore.Backoff(
            reason="429 from the partner API"))

    @app.task(semaphore="apic", limit=int(os.environ.get("BENCH_CAPACITY", "8")), shared=False)
    def api_capacity(key):
        """W10b's oracle: limit = the API's concurrency (resized when it halves)."""
        return api_call(key)

    @app.task(semaphore="apit", limit=64, semaphore_quota=os.environ.get("BENCH_TOKENS") or None,
              semaphore_units=50, shared=False)
    def api_tokens(key):
        """W10c: a quota in tokens, 50 estimated at admission, the actual tokens settled."""
        return api_call(key, settle=True)
