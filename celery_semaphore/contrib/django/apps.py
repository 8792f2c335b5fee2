from django.apps import AppConfig


class CelerySemaphoreConfig(AppConfig):
    name = "celery_semaphore.contrib.django"
    label = "celery_semaphore"
    verbose_name = "celery-semaphore"
