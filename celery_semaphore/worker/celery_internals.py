"""The touches of kombu's and Celery's internals the gate needs, kept in one place.

Each function names the version whose behaviour it relies on; a transport or pool without the
structure it expects is left alone (the function reports that it did nothing).
"""

from __future__ import annotations

from typing import Any, List


def detach_unacked(message: Any) -> bool:
    """Forget ``message`` in its channel's unacked set without touching the broker, if the
    channel is kombu's Redis transport (which keeps every unacked message in the broker's
    ``unacked`` hash until it is acked or restored). True if it was detached.

    kombu 5.x: ``redis.QoS._delivered`` maps delivery tags to messages; closing the channel
    restores each of them, which is what must not happen on a lost connection.
    """
    qos = getattr(getattr(message, "channel", None), "qos", None)
    delivered = getattr(qos, "_delivered", None)
    if delivered is None or not hasattr(qos, "restore_by_tag") or not hasattr(qos,
                                                                              "unacked_key"):
        return False
    return delivered.pop(message.delivery_tag, None) is not None


def restore_unacked(app: Any, tags: List[str]) -> None:
    """Move the messages with delivery ``tags`` from a Redis broker's unacked hash back to the
    head of their queues, through a connection of its own (kombu 5.x ``QoS.restore_by_tag``,
    one transaction per message: a tag already restored or acked is skipped). Raises when the
    broker cannot be reached."""
    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0)
        qos = connection.default_channel.qos
        for tag in tags:
            qos.restore_by_tag(tag, leftmost=True)


def child_is_up(pool: Any, pid: int) -> bool:
    """True when the prefork pool's child ``pid`` has started (sent its UP message), so it
    takes jobs. celery 5.x ``AsynPool._waiting_to_start`` holds the children that have not."""
    inner = getattr(pool, "_pool", None)
    if inner is None:
        return False
    waiting = {getattr(proc, "pid", None) for proc in getattr(inner, "_waiting_to_start", ())}
    return pid not in waiting and any(proc.pid == pid for proc in getattr(inner, "_pool", ()))

