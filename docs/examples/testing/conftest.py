"""Celery's test fixtures, with an in-process worker that runs tasks at once."""
import pytest

pytest_plugins = ("celery.contrib.pytest",)  # not needed with pytest-celery installed


@pytest.fixture(scope="session")
def celery_worker_pool():
    return "threads"  # Celery's default, "solo", runs one task at a time


@pytest.fixture(scope="session")
def celery_worker_parameters():
    return {"concurrency": 8}
