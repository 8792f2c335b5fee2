"""``consul://``, ``consuls://``: semaphores in Consul KV with sessions and check-and-set, as
Consul's own semaphore recipe. See :mod:`.backend`."""

from .backend import ConsulBackend, ConsulConfig

__all__ = ["ConsulBackend", "ConsulConfig"]
