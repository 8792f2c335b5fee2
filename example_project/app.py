"""The Celery app: kombu's filesystem transport and the SQLite semaphore backend, so the example
needs no server. With Redis you would only change ``broker_url`` (the semaphore backend then
defaults to the same Redis)."""

import os

from celery import Celery

import celery_semaphore

VAR = os.path.abspath(os.environ.get("EXAMPLE_VAR_DIR",
                                     os.path.join(os.path.dirname(__file__), "var")))
for folder in ("broker", "processed", "control"):
    os.makedirs(os.path.join(VAR, folder), exist_ok=True)

app = Celery("example_project", include=["example_project.tasks"])
app.conf.update(
    # EXAMPLE_BROKER_URL=redis://localhost:6379/0 runs the same app on Redis (and with Flower).
    broker_url=os.environ.get("EXAMPLE_BROKER_URL", "filesystem://"),
    broker_transport_options={
        "data_folder_in": os.path.join(VAR, "broker"),
        "data_folder_out": os.path.join(VAR, "broker"),
        "processed_folder": os.path.join(VAR, "processed"),
        "control_folder": os.path.join(VAR, "control"),
        "store_processed": False,
        "polling_interval": 0.02,
    },
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    # celery-semaphore settings
    semaphore_backend=f"sqlite:///{VAR}/semaphores.db",
    semaphore_limits={"uploads": 4},   # configuration wins over a task's own `limit`
    semaphore_lease_ttl=30,            # renewed every 10 s while a task runs
    semaphore_poll_interval=0.5,
    semaphore_max_wait=300,            # a task waiting longer fails with SemaphoreTimeout
)
celery_semaphore.install(app)
