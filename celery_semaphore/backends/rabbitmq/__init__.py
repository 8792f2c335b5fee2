"""The RabbitMQ backends: ``amqp://`` (token queue, :mod:`.tokens`) and ``amqp+slots://``
(slot queues, :mod:`.slots`), over a registry message per semaphore (:mod:`.registry`)."""

from .slots import SlotQueueBackend
from .tokens import TokenBackend

__all__ = ["SlotQueueBackend", "TokenBackend"]
