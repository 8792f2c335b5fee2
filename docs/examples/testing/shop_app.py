"""The project's Celery app (``proj/celery.py`` in a real project)."""
from celery import Celery

import celery_semaphore

app = Celery("shop", broker="memory://")
celery_semaphore.install(app)
