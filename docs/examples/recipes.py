"""Recipes: a fair pool of capacity, and a global cap plus a per-tenant limit."""
from celery import Celery

import celery_semaphore

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://recipes"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


# [fair-start]
@app.task(semaphore="exports", limit=8, semaphore_fair_by="{tenant_id}")
def export(tenant_id, export_id):
    ...
# [fair-end]


# [cap-start]
@app.task(semaphore=["api:{customer_id}", "api"], limit={"api:{customer_id}": 2, "api": 20})
def call_api(customer_id, payload):
    ...
# [cap-end]


if __name__ == "__main__":
    export.delay("acme", 1).get()
    call_api.delay(7, {}).get()
