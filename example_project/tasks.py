"""Thumbnails whose uploads to a slow remote store run at most 4 at once across the cluster,
calls to a partner API that allows each customer 2 calls at once, and orders sent to a
partner's HTTP API whose capacity is learned from its 429 answers."""

import json
import os
import random
import time
import urllib.error
import urllib.request

from celery_semaphore import Adaptive, Backoff, current_lease

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


#: The partner's order API (partner_api.py; the demo starts one and sets this).
PARTNER_URL = os.environ.get("EXAMPLE_PARTNER_URL", "http://127.0.0.1:8642")
# It runs on this host: no HTTP proxy from the environment in the way.
partner_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# The partner does not say how many calls it serves at once: the limit is learned. It starts
# at 1, grows while calls succeed and halves on each 429 (at most once per round trip).
@app.task(bind=True, semaphore="partner", limit=Adaptive(min=1, max=8, decrease=0.5))
def sync_order(self, order_id):
    """POST the order to the partner's API. A 429 raises Backoff: "partner" is paused on every
    worker until its Retry-After is over, and this call waits again, ahead of later ones, and
    then runs again (no Celery retry: ``self.request.retries`` stays 0)."""
    request = urllib.request.Request(
        f"{PARTNER_URL}/orders/{order_id}", data=b"{}", method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": self.request.id})
    try:
        with partner_http.open(request, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        error.close()
        if error.code == 429:
            raise Backoff.from_response(error, default=1) from None
        raise
