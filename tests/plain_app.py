"""A Celery app that declares a guarded task but never imports celery_semaphore nor calls
``install(app)``: the worker must guard it all the same (``tests/test_guarantee.py``)."""

import os
import time

from celery import Celery

from tests.probe import Probe


def create_app(env):
    app = Celery("tests.plain_app", set_as_current=False)
    app.conf.update(
        broker_url=env.get("CS_BROKER_URL", "redis://127.0.0.1:6379/14"),
        result_backend=env.get("CS_RESULT_BACKEND") or None,
        semaphore_backend=env.get("CS_SEMAPHORE_BACKEND") or None,
        semaphore_key_prefix=env.get("CS_KEY_PREFIX", "semaphore:"),
        task_default_queue=env.get("CS_QUEUE", "celery"),
        # kombu's restore lock lapses after 5 s, not 300: a worker a test kills while it
        # holds the lock (in the broker database every test shares) would keep every other
        # worker from restoring a killed worker's messages for five minutes
        # (docs/limitations.md)
        broker_transport_options={"polling_interval": 0.05, "unacked_mutex_expire": 5},
        worker_hijack_root_logger=False,
    )
    probe = Probe(env.get("CS_PROBE", "/tmp/celery-semaphore-probe.log"))

    @app.task(name="tests.plain_app.solo", semaphore="solo", limit=1, shared=False)
    def solo(key, hold=0.2):
        probe.mark("start", f"solo:{key}")
        try:
            time.sleep(hold)
        finally:
            probe.mark("end", f"solo:{key}")
        return key

    return app


app = create_app(os.environ)
