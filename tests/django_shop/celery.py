import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_shop.settings")

app = Celery("django_shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
