SECRET_KEY = "example-only"
USE_TZ = True

# [settings-start]
INSTALLED_APPS = [
    "celery_semaphore.contrib.django",
    "reports",
]

CELERY_BROKER_URL = "redis://localhost:6379/0"
CELERY_SEMAPHORE_BACKEND = "redis://localhost:6379/1"  # default: the broker's
CELERY_SEMAPHORE_LIMITS = {"exports": 2}
CELERY_SEMAPHORE_MAX_WAIT = 600
# CELERY_SEMAPHORE_APP = "proj.celery:app"  # only if the app is not Celery's current app
# [settings-end]
