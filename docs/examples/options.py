"""Task options: limits from configuration, templates, ``task``, a per-call override."""
from celery import Celery

import celery_semaphore
from celery_semaphore import ConfigurationError, task

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://options"
app.conf.task_always_eager = True  # so that this file runs in one process
# [options-start]
app.conf.semaphore_limits = {"uploads": 4}  # optional: limits from configuration
celery_semaphore.install(app)


@app.task(semaphore="uploads")  # limit from semaphore_limits
def upload(image_id):
    return celery_semaphore.current_lease().limit


@app.task(semaphore="api:{customer_id}", limit=2)  # one semaphore per customer
def call_api(customer_id, payload):
    return celery_semaphore.current_lease().name


@task(semaphore="reports", limit=1)  # shared_task with the same options
def build_report():
    return celery_semaphore.current_lease().name
# [options-end]


if __name__ == "__main__":
    assert upload.delay("cat.png").get() == 4
    assert call_api.delay(7, {"q": 1}).get() == "api:7"
    assert call_api.delay(customer_id=8, payload={}).get() == "api:8"
    assert build_report.delay().get() == "reports"
    # [override-start]
    # One call under another semaphore and limit (checked in the caller):
    result = call_api.apply_async((7, {}), headers={"semaphore": "api:vip", "semaphore_limit": 3})
    assert result.get() == "api:vip"
    # [override-end]
    # [checked-start]
    # Options are checked where they are written: a bad limit is refused at once.
    try:
        @app.task(semaphore="uploads", limit=0)
        def broken():
            pass
    except ConfigurationError as exc:
        print("refused:", exc)
    else:
        raise AssertionError("limit=0 was accepted")
    # [checked-end]
