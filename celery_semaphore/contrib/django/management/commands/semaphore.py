"""``python manage.py semaphore ...``: the ``celery semaphore`` command, same code path.

The Celery app is the one named by the ``CELERY_SEMAPHORE_APP`` setting (``"proj.celery:app"``),
else Celery's current app (the one a Django project imports in its ``__init__``).
"""

import os
import sys
from importlib import import_module
from types import SimpleNamespace

from django.conf import settings
from django.core.management.base import BaseCommand


def find_app():
    path = getattr(settings, "CELERY_SEMAPHORE_APP", None)
    if path:
        module, _, attr = path.partition(":")
        return getattr(import_module(module), attr or "app")
    from celery import current_app

    return current_app._get_current_object()


class Command(BaseCommand):
    help = "Inspect, resize and reset celery-semaphore semaphores (see `semaphore --help`)."

    def run_from_argv(self, argv):
        # Click parses the arguments, so usage errors and exit codes match `celery semaphore`.
        from celery_semaphore.cli import semaphore

        semaphore.main(args=argv[2:], prog_name=f"{os.path.basename(argv[0])} {argv[1]}",
                       obj=SimpleNamespace(app=find_app()), standalone_mode=True)
        sys.exit(0)

    def handle(self, *args, **options):  # call_command() path
        self.run_from_argv(["manage.py", "semaphore", *args])
