"""Tests of the shop's limits with the fixtures of celery-semaphore's pytest plugin."""
import threading

import pytest
from shop_app import app
from shop_tasks import build_report, export

from celery_semaphore import Semaphore, SemaphoreFull
from celery_semaphore.testing import use_backend


# [worker-start]
def test_the_worker_keeps_the_limits(celery_app, celery_worker, semaphore_recorder):
    results = [export.delay(n) for n in range(6)]
    results += [build_report.delay(1) for _ in range(3)] + [build_report.delay(2)]
    assert [r.get(timeout=30) for r in results] == list(range(6)) + [1, 1, 1, 2]
    semaphore_recorder.assert_max_concurrent("exports", 2)
    semaphore_recorder.assert_max_concurrent("reports:1", 1)
# [worker-end]


# [eager-start]
@pytest.fixture
def eager_app(semaphore_backend):
    app.conf.task_always_eager = True
    with use_backend(app, semaphore_backend):
        yield app
    app.conf.task_always_eager = False


def test_eager_calls_take_turns(eager_app, semaphore_recorder):
    def call():
        eager_app.set_current()  # a new thread has no current app of its own
        build_report.delay(7)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    semaphore_recorder.assert_max_concurrent("reports:7", 1)
# [eager-end]


# [full-start]
def test_a_full_semaphore_fails_an_eager_call(semaphore_backend):
    with use_backend(app, semaphore_backend, semaphore_on_full="fail"):
        with Semaphore("reports:7", 1, semaphore_backend).acquire():
            assert isinstance(build_report.apply(args=(7,)).result, SemaphoreFull)
        assert build_report.apply(args=(7,)).result == 7
# [full-end]
