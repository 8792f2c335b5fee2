"""A Django project set up as Celery's "First steps with Django" says, with
``celery_semaphore.contrib.django`` in ``INSTALLED_APPS`` and no ``install(app)`` in
``celery.py`` (tests/test_django.py). ``DX_*`` environment variables spoil it on purpose."""

from .celery import app as celery_app

__all__ = ("celery_app",)
