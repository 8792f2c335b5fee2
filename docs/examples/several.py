"""A task under several semaphores: a global cap plus a per-customer limit."""
from celery import Celery

import celery_semaphore

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://several"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


# [several-start]
@app.task(semaphore=["api:{customer_id}", "api"], limit={"api:{customer_id}": 2, "api": 20})
def call_api(customer_id, payload):
    leases = celery_semaphore.current_leases()  # {"api:7": <lease>, "api": <lease>}
    # each lease has its own fencing token, to pass to what the semaphore protects
    return {name: (lease.limit, lease.token.slot) for name, lease in leases.items()}
# [several-end]


if __name__ == "__main__":
    assert call_api.delay(7, {}).get() == {"api:7": (2, 0), "api": (20, 0)}
