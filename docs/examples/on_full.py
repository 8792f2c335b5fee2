"""semaphore_on_full: run once at a time (skip), or fail, instead of waiting."""
from celery import Celery

import celery_semaphore
from celery_semaphore import Semaphore, SemaphoreFull

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://on-full"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


# [skip-start]
@app.task(semaphore="sync:{account_id}", limit=1, semaphore_on_full="skip")
def sync_account(account_id):
    return "synced"
# [skip-end]


# [fail-start]
@app.task(semaphore="export:{account_id}", limit=1, semaphore_on_full="fail")
def export(account_id):
    return "exported"
# [fail-end]


if __name__ == "__main__":
    assert sync_account.delay(1).get() == "synced"  # nobody holds sync:1: it runs
    # Someone holds sync:1 (here another client of the same backend): the call is skipped.
    with Semaphore("sync:1", 1, backend="memory://on-full").acquire():
        skipped = sync_account.apply(args=(1,))
        assert skipped.state == "IGNORED", skipped.state  # eager calls: Celery's Ignore
        assert sync_account.apply(args=(2,)).get() == "synced"  # another account runs
    with Semaphore("export:1", 1, backend="memory://on-full").acquire():
        failed = export.apply(args=(1,))
        assert failed.state == "FAILURE" and isinstance(failed.result, SemaphoreFull)
