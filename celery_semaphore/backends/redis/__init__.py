"""``redis://``, ``rediss://``, ``redis+socket://``: the fair semaphore of "Redis in Action",
one Lua script per operation (``scripts/``). See :mod:`.backend`."""

from .backend import KEY_SUFFIXES, RedisBackend

__all__ = ["KEY_SUFFIXES", "RedisBackend"]
