"""``consul://``, ``consuls://``: semaphores in Consul KV with sessions and check-and-set, as
Consul's own semaphore recipe. See :mod:`.backend`."""

from .backend import ConsulBackend
from .http import ConsulConfig

__all__ = ["ConsulBackend", "ConsulConfig"]
