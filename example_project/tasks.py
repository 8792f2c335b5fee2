"""Thumbnails whose uploads to a slow remote store are limited to 4 at once, and calls to a
partner API limited to 2 at once per customer."""

import json
import os
import time

from celery_semaphore import current_lease

from .app import VAR, app
from .store import Store

TIMELINE = os.path.join(VAR, "timeline.log")
store = Store(os.path.join(VAR, "store"))


def record(kind, semaphore, key, **extra):
    """Append one event to the timeline the demo display and plot read."""
    line = json.dumps({"t": time.time(), "kind": kind, "semaphore": semaphore, "key": key,
                       **extra}) + "\n"
    with open(TIMELINE, "a") as f:
        f.write(line)


@app.task
def make_thumbnail(image_id):
    """CPU work needs no semaphore: it runs on every free pool process."""
    thumbnail = f"thumbnail of image {image_id}".encode() * 1000
    time.sleep(0.05)
    upload_thumbnail.delay(image_id, len(thumbnail))


@app.task(semaphore="uploads", limit=8)  # semaphore_limits["uploads"] = 4 wins
def upload_thumbnail(image_id, size):
    lease = current_lease()
    record("start", "uploads", image_id, slot=lease.token.slot)
    try:
        time.sleep(0.4)  # the slow remote store
        # The store rejects a write carrying an older fencing token for this slot than one it
        # has already accepted: a holder whose lease lapsed cannot overwrite its successor.
        store.write(f"thumbs/{image_id}", size, lease.token)
    finally:
        record("end", "uploads", image_id, slot=lease.token.slot)


@app.task(semaphore="api:{customer_id}", limit=2)
def call_customer_api(customer_id, request_no):
    lease = current_lease()
    semaphore = f"api:{customer_id}"
    record("start", semaphore, request_no, slot=lease.token.slot)
    try:
        time.sleep(0.25)
    finally:
        record("end", semaphore, request_no, slot=lease.token.slot)
