"""Costs, rates, priorities and weighted fair shares (task options and the client API)."""
import threading
import time

from celery import Celery

import celery_semaphore
from celery_semaphore import ConfigurationError, Semaphore

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://traffic"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


# [tasks-start]
@app.task(semaphore="gpu", limit=16, semaphore_cost="{gigabytes}")  # 16 GB of GPU memory
def train(gigabytes, dataset):
    return celery_semaphore.current_lease().name


@app.task(semaphore="partner-api", semaphore_rate="20/s")  # starts only, cluster-wide
def call_partner(payload):
    return time.monotonic()


@app.task(semaphore="api:{customer_id}", limit=4, semaphore_rate="30/m", semaphore_burst=5)
def sync_customer(customer_id):  # a rate per customer: at most 30 starts a minute each
    return celery_semaphore.current_lease().name


@app.task(semaphore="reports", limit=2, semaphore_fair_by="{tenant}",
          semaphore_fair_weights={"gold": 3, "*": 1})  # three gold per other tenant's one
def report(tenant, month):
    return tenant
# [tasks-end]


def per_call():
    # [per-call-start]
    report.apply_async(("acme", "2026-10"), headers={"semaphore_priority": 9})  # goes first
    train.apply_async((4, "small"), headers={"semaphore_cost": 2})  # overrides the template
    # [per-call-end]


def rate_spaces_starts():
    """Five starts at 20/s with burst 1 are spaced by at least 50 ms each."""
    # [rate-start]
    starts = [call_partner.delay({"n": n}).get() for n in range(5)]
    assert starts[-1] - starts[0] >= 4 * 0.05 * 0.9, starts  # 4 intervals of 50 ms
    # [rate-end]
    return starts


def cost_above_the_limit_is_refused():
    # [refused-start]
    result = train.delay(32, "huge")  # 32 units of a limit of 16: this call fails alone
    assert result.failed() and isinstance(result.result, ConfigurationError), result.result
    print("refused:", result.result)
    # [refused-end]


def units_and_priorities():
    """Units held, and the admission order of queued waiters with priorities (client API)."""
    # [client-start]
    gpu = Semaphore("gpu", 16, backend="memory://traffic-client", poll_interval=0.05)
    big = gpu.acquire(cost=12)
    assert gpu.try_acquire(cost=8) is None  # 12 + 8 > 16
    small = gpu.try_acquire(cost=4)         # 12 + 4 <= 16
    assert gpu.status().units == 16
    small.release()

    order = []

    def wait(label, cost, priority):
        with gpu.acquire(timeout=10, cost=cost, priority=priority):
            order.append(label)

    threads = []
    for label, cost, priority in [("low", 12, 0), ("high", 12, 9)]:  # arrival order
        threads.append(threading.Thread(target=wait, args=(label, cost, priority)))
        threads[-1].start()
        while len(gpu.status().waiters) < len(threads):  # queued, in this order
            time.sleep(0.01)
    big.release()
    for thread in threads:
        thread.join()
    assert order == ["high", "low"], order  # the later, higher-priority waiter went first
    # [client-end]
    return order


if __name__ == "__main__":
    print(train.delay(4, "small").get())
    print(sync_customer.delay(7).get())
    print(report.delay("gold", "2026-10").get())
    per_call()
    print(rate_spaces_starts())
    cost_above_the_limit_is_refused()
    print(units_and_priorities())
