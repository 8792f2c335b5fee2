import os

from celery import shared_task


@shared_task(semaphore="reports:{customer_id}", limit=1)
def build_report(customer_id):
    return f"report {customer_id}"


if os.environ.get("DX_BAD_TEMPLATE"):
    @shared_task(semaphore="exports:{customer}", limit=1)
    def export(customer_id):
        return customer_id
