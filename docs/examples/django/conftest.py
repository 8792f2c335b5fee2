import os

import django
import pytest

from celery_semaphore.testing import use_backend

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()  # pytest-django does this for you

from proj.celery import app  # noqa: E402 (after django.setup())


# [fixture-start]
@pytest.fixture(autouse=True)
def semaphores(semaphore_backend):
    with use_backend(app, semaphore_backend):
        yield
# [fixture-end]
