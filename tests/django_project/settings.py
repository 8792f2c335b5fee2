SECRET_KEY = "test-only"
INSTALLED_APPS = ["celery_semaphore.contrib.django"]
CELERY_SEMAPHORE_APP = "tests.celery_app:app"
USE_TZ = True
