from celery import shared_task


@shared_task(semaphore="reports:{customer_id}", limit=1)
def build_report(customer_id):
    return f"report {customer_id}"


@shared_task(semaphore="exports")  # its limit: CELERY_SEMAPHORE_LIMITS
def export_all():
    return "exported"
