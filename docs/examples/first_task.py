"""A first guarded task, runnable as it is: ``python docs/examples/first_task.py``.

It runs in one process (eager mode, an in-memory backend) so that it needs no server; the
"Getting started" page shows the same app on Redis with real workers.
"""
from celery import Celery

import celery_semaphore

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://first-task"  # in production: redis://..., postgresql://...
app.conf.task_always_eager = True  # only so that this file runs without a worker
celery_semaphore.install(app)  # the worker gate; idempotent


@app.task(semaphore="uploads", limit=4)  # at most 4 uploads at once, cluster-wide
def upload(image_id):
    lease = celery_semaphore.current_lease()  # the slot this call holds
    return f"{image_id}: slot {lease.token.slot} of {lease.name!r} (limit {lease.limit})"


if __name__ == "__main__":
    print(upload.delay("cat.png").get())  # cat.png: slot 0 of 'uploads' (limit 4)
