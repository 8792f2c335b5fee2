"""Deleting an empty RabbitMQ parking queue never drops a message someone holds
(``celery_semaphore.worker.lane_guards``), against the real broker: a holder that pulled a
message keeps the queue alive; once the holder's connection dies the message is back and the
queue stays while it holds it; an empty queue nobody holds is deleted."""


import pytest
from kombu import Connection, Producer

from celery_semaphore.waiting_room import lane_of, parking_queue
from celery_semaphore.worker.lane_guards import LaneBusy, LaneGuards, holders_queue_name
from tests import servers
from tests.util import wait_until


@pytest.fixture
def lane(amqp_url):
    tag = servers.unique_tag()
    prefix = f"{tag}:"
    lane = lane_of("images", None, f"{tag}.q")
    queue = parking_queue(prefix, lane, "amqp")
    yield amqp_url, prefix, lane, queue
    with Connection(amqp_url) as connection:
        channel = connection.channel()
        for name in (queue.name, holders_queue_name(prefix, lane)):
            try:
                channel.queue_delete(name)
            except Exception:
                channel = connection.channel()


def exists(url, name):
    """(ready messages, consumers) of queue ``name``, or None when it does not exist."""
    with Connection(url) as connection:
        channel = connection.channel()
        try:
            _, ready, consumers = channel.queue_declare(queue=name, passive=True)
        except Exception:
            return None
        return ready, consumers


def park_one(url, queue):
    with Connection(url) as connection:
        channel = connection.channel()
        queue(channel).declare()
        Producer(channel).publish({"n": 1}, exchange="", routing_key=queue.name,
                                  delivery_mode=2, serializer="json")


def test_a_held_lane_is_not_deleted_and_its_message_comes_back(lane):
    url, prefix, name, queue = lane
    park_one(url, queue)
    holder_connection = Connection(url)
    holder = LaneGuards(prefix)
    channel = holder.channel(holder_connection, name, queue)
    message = queue(channel).get(no_ack=False)
    assert message is not None and exists(url, queue.name) == (0, 0)

    deleter_connection = Connection(url)
    deleter = LaneGuards(prefix)
    try:
        # the holder consumes the lane's holders queue: the lock is refused, nothing deleted
        assert deleter.lock(deleter_connection, name) is None
        assert exists(url, queue.name) == (0, 0)
        assert LaneGuards(prefix).lock(Connection(url), name) is None  # nor for anyone else
        holder_connection.close()  # the holder dies with the message unacknowledged
        assert wait_until(lambda: exists(url, queue.name) == (1, 0), timeout=10)
        locked = deleter.lock(deleter_connection, name)
        assert locked is not None
        other = LaneGuards(prefix)
        with pytest.raises(LaneBusy):  # a deletion holds the lane now
            other.channel(Connection(url), name, queue)
        assert deleter.delete(locked, queue) is False  # not empty: it stays, with the message
        assert exists(url, queue.name) == (1, 0)
    finally:
        deleter_connection.close()


def test_an_empty_lane_nobody_holds_is_deleted_and_comes_back_on_the_next_pull(lane):
    url, prefix, name, queue = lane
    park_one(url, queue)
    connection = Connection(url)
    guards = LaneGuards(prefix)
    try:
        channel = guards.channel(connection, name, queue)
        queue(channel).get(no_ack=False).ack()
        guards.release(name)  # nothing unsettled: it stops holding the lane
        locked = guards.lock(connection, name)
        assert locked is not None
        assert guards.delete(locked, queue) is True
        assert exists(url, queue.name) is None
        assert wait_until(lambda: exists(url, holders_queue_name(prefix, name)) is None,
                          timeout=10)  # the holders queue went with its last consumer
        # the next pull declares the parking queue again
        channel = guards.channel(connection, name, queue)
        assert queue(channel).get(no_ack=False) is None
        assert exists(url, queue.name) == (0, 0)
    finally:
        connection.close()
