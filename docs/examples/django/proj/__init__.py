# As in Celery's "First steps with Django": makes the app Celery's current app.
from .celery import app as celery_app

__all__ = ("celery_app",)
