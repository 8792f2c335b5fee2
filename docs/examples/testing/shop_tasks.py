"""The tasks under test: two guarded tasks, one under a template."""
import time

from celery import shared_task


@shared_task(semaphore="exports", limit=2)
def export(n):
    time.sleep(0.3)
    return n


@shared_task(semaphore="reports:{customer_id}", limit=1)
def build_report(customer_id):
    time.sleep(0.3)
    return customer_id
