"""The Django app of celery-semaphore: ``"celery_semaphore.contrib.django"`` in
``INSTALLED_APPS`` gives

* ``python manage.py semaphore ...`` (the same subcommands as ``celery semaphore``);
* celery-semaphore installed into the project's Celery app when Django starts (``ready``),
  so that the web process's sends are checked and parked and the test suite's eager calls
  (``CELERY_TASK_ALWAYS_EAGER``) hold their slots, even where ``proj/celery.py`` does not
  call ``celery_semaphore.install(app)``;
* system checks (``manage.py check``, and before ``runserver`` and ``migrate``): the
  ``CELERY_SEMAPHORE_*`` settings (misspelt names included) and each guarded task's options.

The Celery app is the one the ``CELERY_SEMAPHORE_APP`` setting names (``"proj.celery:app"``),
else Celery's current app: the one ``proj/__init__.py`` imports, as Celery's "First steps
with Django" sets it up.
"""

from django.apps import AppConfig

from .project import find_app


class CelerySemaphoreConfig(AppConfig):
    name = "celery_semaphore.contrib.django"
    label = "celery_semaphore"
    verbose_name = "celery-semaphore"

    def ready(self) -> None:
        from . import checks  # noqa: F401 -- registers the system checks

        try:
            app = find_app()
        except (ImportError, AttributeError):
            return  # the system check reports it
        if app is not None:
            from celery_semaphore import install

            install(app)
