"""The Celery app the worker tests run in real ``celery worker`` subprocesses.

Configured by environment variables so that each test can point its workers at its own broker,
semaphore backend, key prefix and probe file.
"""

import os
import time

from celery import Celery

import celery_semaphore
from tests.probe import Probe

app = Celery("tests.celery_app")
app.conf.update(
    broker_url=os.environ.get("CS_BROKER_URL", "redis://127.0.0.1:6379/14"),
    result_backend=os.environ.get("CS_RESULT_BACKEND") or None,
    semaphore_backend=os.environ.get("CS_SEMAPHORE_BACKEND") or None,
    semaphore_key_prefix=os.environ.get("CS_KEY_PREFIX", "semaphore:"),
    semaphore_lease_ttl=float(os.environ.get("CS_LEASE_TTL", "60")),
    semaphore_retry_backoff=0.2,
    semaphore_retry_backoff_max=1.0,
    task_default_queue=os.environ.get("CS_QUEUE", "celery"),
    worker_prefetch_multiplier=int(os.environ.get("CS_PREFETCH", "4")),
    broker_transport_options={"polling_interval": 0.05},
    worker_hijack_root_logger=False,
)
if os.environ.get("CS_SETTINGS"):
    import json

    app.conf.update(json.loads(os.environ["CS_SETTINGS"]))
celery_semaphore.install(app)

probe = Probe(os.environ.get("CS_PROBE", "/tmp/celery-semaphore-probe.log"))


def body(key, hold):
    probe.mark("start", key)
    try:
        time.sleep(hold)
    finally:
        probe.mark("end", key)


@app.task(semaphore="images", limit=2)
def guarded(key, hold=0.05):
    body(f"guarded:{key}", hold)
    return key


@app.task(semaphore="api:{customer_id}", limit=1)
def per_customer(customer_id, key, hold=0.05):
    body(f"customer-{customer_id}:{key}", hold)
    return key


@app.task
def unguarded(key, hold=0.01):
    body(f"free:{key}", hold)
    return key


@app.task(semaphore="slow", limit=1, bind=True)
def slow(self, key, hold=30.0):
    body(f"slow:{key}", hold)
    return key


@app.task(semaphore="limited", limit=1, soft_time_limit=0.5, time_limit=1.0)
def time_limited(key, hold=5.0):
    body(f"limited:{key}", hold)
    return key


@app.task(semaphore="fails", limit=1)
def fails(key):
    body(f"fails:{key}", 0.01)
    raise ValueError(key)


@app.task(semaphore="retrying", limit=1, bind=True, max_retries=2)
def retrying(self, key):
    body(f"retrying:{key}:{self.request.retries}", 0.01)
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    return self.request.retries


@app.task(semaphore="lease", limit=3)
def lease_info():
    lease = celery_semaphore.current_lease()
    return {"name": lease.name, "limit": lease.limit, "slot": lease.token.slot,
            "epoch": lease.token.epoch, "holder": lease.holder, "verified": lease.verify()}
