"""The Celery app (what a project keeps in ``proj/celery.py``).

With no environment set it needs no server: kombu's filesystem transport is the broker and an
SQLite file holds the semaphores, both under ``var/`` (``EXAMPLE_VAR_DIR`` moves it).
``EXAMPLE_BROKER_URL=redis://localhost:6379/0`` runs it on Redis, semaphores included.
"""

import os

from celery import Celery

import celery_semaphore

VAR = os.path.abspath(os.environ.get("EXAMPLE_VAR_DIR")
                      or os.path.join(os.path.dirname(__file__), "var"))
BROKER_URL = os.environ.get("EXAMPLE_BROKER_URL")
os.makedirs(VAR, exist_ok=True)

# example_project.timeline records every task's start and end for `make demo`.
app = Celery("example_project", include=["example_project.tasks", "example_project.timeline"])

if BROKER_URL:
    app.conf.broker_url = BROKER_URL  # the semaphore backend defaults to a Redis broker
else:
    folders = {key: os.path.join(VAR, name) for key, name in (
        ("data_folder_in", "broker"), ("data_folder_out", "broker"),
        ("processed_folder", "processed"), ("control_folder", "control"))}
    for folder in folders.values():
        os.makedirs(folder, exist_ok=True)
    app.conf.update(
        broker_url="filesystem://",
        # kombu's filesystem transport, writing message files atomically (see fs_transport).
        broker_transport="example_project.fs_transport:Transport",
        broker_transport_options={**folders, "store_processed": True, "polling_interval": 0.05},
        # Where the semaphores live: one SQLite file shared by every worker on this host.
        semaphore_backend=f"sqlite:///{VAR}/semaphores.db",
    )

app.conf.update(
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    # -- celery-semaphore -------------------------------------------------------------------
    # Limits from configuration win over a task's own `limit`: customer 3's plan allows one
    # call at a time (a key may also be a template, "api:{customer_id}", for every customer).
    semaphore_limits={"api:3": 1},
    semaphore_lease_ttl=30,        # a crashed worker's slots free themselves after 30 s
    semaphore_max_wait=120,        # a task waiting longer than this fails with SemaphoreTimeout
    semaphore_poll_interval=0.5,   # waiters are woken at once; this is the fallback poll
    # A worker holds the tasks that wait for a slot in its main process (no pool process),
    # taking more from the broker meanwhile. Past 16 it hands the excess back to the broker,
    # for any worker, after a short backoff: no worker hoards a backlog that it can run only
    # as wide as its own pool while another worker idles.
    semaphore_worker_max_waiting=16,
    semaphore_retry_backoff=0.2,
    semaphore_retry_backoff_max=1.0,
)
celery_semaphore.install(app)
