"""Thumbnails whose uploads to a slow remote store run at most 4 at once across the cluster,
and calls to a partner API that allows each customer 2 calls at once."""

import os
import random
import time

from celery_semaphore import current_lease

from .app import VAR, app
from .store import Store

store = Store(os.path.join(VAR, "store"))


@app.task
def make_thumbnail(image_id, size=192, scale=4):
    """CPU work needs no semaphore: it runs on every free pool process."""
    rng = random.Random(image_id)
    image = [rng.randrange(256) for _ in range(size * size)]  # stands in for a decoded image
    side = size // scale
    thumbnail = bytes(
        sum(image[(y * scale + dy) * size + x * scale + dx]
            for dy in range(scale) for dx in range(scale)) // scale ** 2
        for y in range(side) for x in range(side)
    )
    upload_thumbnail.delay(image_id, thumbnail)


@app.task(semaphore="uploads", limit=4)
def upload_thumbnail(image_id, thumbnail):
    # The lease's fencing token goes with the write: the store rejects a token older than one
    # it has already accepted for that slot, so a task whose lease lapsed (a long pause, a
    # partitioned worker) cannot overwrite the work of the task that got its slot after it.
    store.put(f"thumbs/{image_id}.raw", thumbnail, token=current_lease().token)


# Any semaphore_* setting can be set per task: a call that finds no slot within 60 s fails
# with SemaphoreTimeout rather than wait app.py's 120 s.
@app.task(semaphore="api:{customer_id}", limit=2, semaphore_max_wait=60)
def call_customer_api(customer_id, endpoint, page=1):
    """At most 2 calls at once per customer (customer 3's plan: 1, see app.py)."""
    time.sleep(0.25)  # the partner API answers slowly
    return {"customer": customer_id, "endpoint": endpoint, "page": page}
