import os

SECRET_KEY = "test-only"
USE_TZ = True
INSTALLED_APPS = ["celery_semaphore.contrib.django", "tests.django_shop.reports"]

CELERY_BROKER_URL = "memory://"
CELERY_SEMAPHORE_BACKEND = os.environ.get("DX_SEMAPHORE_BACKEND", "memory://django-shop")
CELERY_SEMAPHORE_ON_FULL = os.environ.get("DX_ON_FULL", "wait")
CELERY_TASK_ALWAYS_EAGER = bool(os.environ.get("DX_EAGER"))
if os.environ.get("DX_MISSPELT_SETTING"):
    CELERY_SEMAPHORE_LEASE_TTLS = 30
