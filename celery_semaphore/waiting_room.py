"""What the client side knows of the waiting room (see ``celery_semaphore.worker.parking``):
the name of each semaphore's parking queue on the broker, and how many tasks wait there."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Iterable

#: Longest queue name brokers take (RabbitMQ: 255 bytes); longer names are shortened + hashed.
MAX_QUEUE_NAME = 200


def parking_queue_name(key_prefix: str, name: str) -> str:
    """``<key_prefix>park.<name>``, shortened with a hash of ``name`` past 200 bytes."""
    full = f"{key_prefix}park.{name}"
    if len(full.encode()) <= MAX_QUEUE_NAME:
        return full
    digest = hashlib.sha1(name.encode()).hexdigest()[:16]
    head = full.encode()[:MAX_QUEUE_NAME - 17].decode(errors="ignore")
    return f"{head}~{digest}"


def parked_counts(app: Any, key_prefix: str, names: Iterable[str]) -> Dict[str, int]:
    """Tasks parked per semaphore name, asked of ``app``'s broker (0 where no parking queue
    exists). Raises when the broker cannot be reached."""
    counts: Dict[str, int] = {}
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        channel = connection.channel()
        try:
            for name in names:
                try:
                    counts[name] = channel.queue_declare(
                        queue=parking_queue_name(key_prefix, name), passive=True)[1]
                except connection.channel_errors:  # no such queue
                    counts[name] = 0
                    if getattr(channel, "is_open", True) is False:  # AMQP closes the channel
                        channel = connection.channel()
        finally:
            try:
                channel.close()
            except Exception:
                pass
    return counts
