"""Fair shares between tenants: waiters are admitted round-robin across fair keys."""
import time

from celery import Celery

import celery_semaphore
from celery_semaphore import Semaphore

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://fair"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


# [task-start]
@app.task(semaphore="reports", limit=4, semaphore_fair_by="{customer_id}")
def build_report(customer_id, report_id):
    ...
# [task-end]


# [recipe-start]
@app.task(semaphore="exports", limit=8, semaphore_fair_by="{tenant_id}")
def export(tenant_id, export_id):
    ...
# [recipe-end]


def admission_order():
    """The order in which the backend admits queued waiters of two keys (client API)."""
    # [order-start]
    sem = Semaphore("exports", limit=1, backend="memory://fair-order", poll_interval=0.05)
    holder = sem.acquire()  # the only slot is taken: everyone below queues
    import threading

    order = []

    def wait(key, n):
        with sem.acquire(timeout=10, fair_key=key):
            order.append(f"{key}{n}")

    threads = []
    for key, n in [("big", 1), ("big", 2), ("big", 3), ("small", 1)]:  # arrival order
        threads.append(threading.Thread(target=wait, args=(key, n)))
        threads[-1].start()
        while len(sem.status().waiters) < len(threads):  # queued, in this order
            time.sleep(0.01)
    holder.release()
    for thread in threads:
        thread.join()
    # round-robin across keys, FIFO within one: "small" does not wait for big's backlog
    assert order == ["big1", "small1", "big2", "big3"], order
    # [order-end]
    return order


if __name__ == "__main__":
    build_report.delay(7, 1).get()
    export.delay("acme", 1).get()
    print(admission_order())
