from proj.celery import app
from reports.tasks import build_report, export_all

from celery_semaphore import Semaphore, SemaphoreFull
from celery_semaphore.testing import use_backend


# [tests-start]
def test_a_report_runs_holding_its_slot(semaphore_recorder):
    assert build_report.apply(args=(7,)).get() == "report 7"
    assert export_all.apply().get() == "exported"
    semaphore_recorder.assert_max_concurrent("reports:7", 1)


def test_a_full_semaphore_fails_the_call(semaphore_backend):
    with use_backend(app, semaphore_backend, semaphore_on_full="fail"):
        with Semaphore("reports:7", 1, semaphore_backend).acquire():
            assert isinstance(build_report.apply(args=(7,)).result, SemaphoreFull)
        assert build_report.apply(args=(7,)).get() == "report 7"
# [tests-end]
