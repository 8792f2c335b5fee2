import os

from celery import Celery

import celery_semaphore

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_semaphore.install(app)  # the gate, checked options, guarded eager calls
app.autodiscover_tasks()
