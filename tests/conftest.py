import uuid

import pytest

from celery_semaphore.backends import close_all
from tests import servers

BACKENDS = ["memory", "sqlite", "redis"]


@pytest.fixture(scope="session")
def redis_url():
    return servers.redis_url()


@pytest.fixture(scope="session")
def amqp_url():
    return servers.amqp_url()


class BackendSpec:
    """How a test reaches one backend: its URL and options (a key prefix unique to the test)."""

    def __init__(self, kind, url, options):
        self.kind = kind
        self.url = url
        self.options = options

    @property
    def multiprocess(self):
        return self.kind != "memory"

    def semaphore(self, name="sem", limit=4, **kwargs):
        from celery_semaphore import Semaphore

        return Semaphore(name, limit, self.url, **{**self.options, **kwargs})

    def backend(self):
        from celery_semaphore.backends import get_backend

        return get_backend(self.url, **self.options)


@pytest.fixture(params=BACKENDS)
def spec(request, tmp_path):
    kind = request.param
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    options = {"key_prefix": prefix}
    if kind == "memory":
        url = f"memory://{prefix}"
    elif kind == "sqlite":
        url = "sqlite:////" + str(tmp_path / "semaphores.db").lstrip("/")
    else:
        url = request.getfixturevalue("redis_url")
    yield BackendSpec(kind, url, options)
    close_all()
