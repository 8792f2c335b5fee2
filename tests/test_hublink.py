"""The Redis backend's event-loop link (:mod:`celery_semaphore.backends.redis.hublink`) on a
real kombu Hub and real Redis servers: one write per turn of the loop, replies in order,
pushed grants on the wake channel, and every failure a callback hears of (a server paused,
restarted, its scripts flushed, the loop reset)."""

import os
import signal
import time

import pytest
from kombu.asynchronous import Hub

from celery_semaphore.backends import get_backend
from celery_semaphore.backends.base import Acquire, Release
from celery_semaphore.backends.redis import hublink
from celery_semaphore.exceptions import BackendUnavailable, LinkClosed
from tests import servers
from tests.util import wait_until

META = {"task_id": "t", "task": "x"}


class Loop:
    """A hub with a link to ``url``, turned by the test; what the link reported."""

    def __init__(self, url, **options):
        self.backend = get_backend(url, key_prefix=f"{servers.unique_tag()}:", **options)
        self.hub = Hub()
        self.wakes = []
        self.listening = 0
        self.link = self.backend.event_loop_link(
            self.hub, lambda *wake: self.wakes.append(wake), self._listening)
        assert self.link is not None
        self.link.start()
        self.loop = self.hub.create_loop()

    def _listening(self):
        self.listening += 1

    def turn_until(self, predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            next(self.loop)
        return True

    def call(self, op, timeout=10.0):
        """Submit ``op`` and turn the loop until its outcome: (result, error)."""
        out = []
        self.link.submit(op, lambda result, error: out.append((result, error)))
        assert self.turn_until(lambda: out, timeout), f"no outcome for {op!r}"
        return out[0]

    def close(self):
        self.link.close()
        self.hub.close()


@pytest.fixture
def stoppable_redis(tmp_path):
    """A redis-server of this test alone, ``(port, process, client)``, that the test may
    SIGSTOP (conftest's ``private_redis`` gives a URL, and no process)."""
    port = servers.free_port()
    proc, client = servers.start_redis(port, str(tmp_path))
    yield port, proc, client
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


def test_everything_asked_in_one_turn_goes_in_one_write_and_answers_in_order(redis_url):
    loop = Loop(redis_url)
    try:
        assert loop.call(Acquire("one", "warm:1", 100, 30.0, META, True))[1] is None
        sends = []
        connection = loop.link.commands
        original = connection._send

        def counted():
            sends.append(len(connection.out))
            original()

        connection._send = counted
        out = []
        for i in range(50):
            loop.link.submit(Acquire("one", f"h{i}:1", 100, 30.0, META, True),
                             lambda result, error, i=i: out.append((i, result, error)))
        assert loop.turn_until(lambda: len(out) == 50)
        assert len(sends) == 1  # one pipeline
        assert [i for i, _, _ in out] == list(range(50))  # in order
        assert all(error is None and result.grant is not None for _, result, error in out)
        slots = {result.grant.slot for _, result, _ in out}
        assert len(slots) == 50  # each its own slot
    finally:
        loop.backend.reset("one")
        loop.close()


def test_the_scripts_are_loaded_as_the_link_starts_before_any_call(stoppable_redis):
    port, _, client = stoppable_redis
    loop = Loop(f"redis://127.0.0.1:{port}/0")
    try:
        sources = loop.backend.scripts()
        shas = [sources[name][1] for name in hublink.SCRIPTS]
        # no call made: the commands connection connects and loads them on its own
        assert loop.turn_until(lambda: loop.link.commands.ready
                               and not loop.link.commands.pending)
        assert all(client.script_exists(*shas))
    finally:
        loop.close()


def test_a_pushed_grant_reaches_the_waiters_loop_on_its_wake_channel(redis_url):
    loop = Loop(redis_url)
    try:
        assert loop.turn_until(lambda: loop.link._listening)
        loop.call(Acquire("push", "h:1", 1, 30.0, META, True))
        waited, error = loop.call(Acquire("push", "w:1", 1, 30.0, META, True, push=True))
        assert error is None and waited.grant is None and waited.position == 0
        assert loop.call(Release("push", "h:1")) == (True, None)
        assert loop.turn_until(lambda: loop.wakes)
        ((name, holder, pushed),) = loop.wakes
        assert (name, holder) == ("push", "w:1") and pushed.grant.ttl == pytest.approx(30.0)
        assert [h.holder for h in loop.backend.status("push").holders] == ["w:1"]
    finally:
        loop.backend.reset("push")
        loop.close()


def test_scripts_flushed_on_the_server_are_sent_again(stoppable_redis):
    port, _, client = stoppable_redis
    loop = Loop(f"redis://127.0.0.1:{port}/0")
    try:
        assert loop.call(Acquire("f", "a:1", 2, 30.0, META, True))[0].grant is not None
        client.script_flush()
        result, error = loop.call(Acquire("f", "b:1", 2, 30.0, META, True))
        assert error is None and result.grant is not None
        assert client.info("commandstats")["cmdstat_eval"]["calls"] >= 1
    finally:
        loop.close()


def test_a_server_that_does_not_answer_fails_the_calls_in_time_and_the_link_recovers(
        stoppable_redis):
    port, proc, _ = stoppable_redis
    loop = Loop(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5)
    try:
        assert loop.call(Acquire("p", "a:1", 2, 30.0, META, True))[1] is None
        os.kill(proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        result, error = loop.call(Release("p", "a:1"))
        assert isinstance(error, BackendUnavailable) and "no reply" in str(error)
        assert not isinstance(error, LinkClosed)
        assert str(error).count("semaphore backend") == 1, error
        assert time.monotonic() - began < 3
        os.kill(proc.pid, signal.SIGCONT)

        def answers():
            return loop.call(Acquire("p", "b:1", 2, 30.0, META, True))[1] is None

        assert wait_until(answers, timeout=10, interval=0.1)
    finally:
        loop.close()


def test_a_restarted_server_is_reached_again_and_the_wake_channel_comes_back(tmp_path):
    port = servers.free_port()
    proc, _ = servers.start_redis(port, str(tmp_path))
    loop = Loop(f"redis://127.0.0.1:{port}/0")
    try:
        assert loop.turn_until(lambda: loop.link._listening)
        assert loop.call(Acquire("r", "a:1", 2, 30.0, META, True))[1] is None
        proc.terminate()
        proc.wait(10)
        result, error = loop.call(Acquire("r", "b:1", 2, 30.0, META, True))
        assert isinstance(error, BackendUnavailable)
        proc, _ = servers.start_redis(port, str(tmp_path))
        assert loop.turn_until(lambda: loop.listening == 1, timeout=10)  # told once: resubscribed

        def answers():
            return loop.call(Acquire("r", "c:1", 2, 30.0, META, True))[1] is None

        assert wait_until(answers, timeout=10, interval=0.1)
    finally:
        loop.close()
        proc.terminate()
        proc.wait(10)


def test_a_reset_loop_fails_what_is_on_its_way_and_a_start_connects_again(redis_url):
    loop = Loop(redis_url)
    try:
        assert loop.call(Acquire("z", "a:1", 2, 30.0, META, True))[1] is None
        out = []
        loop.link.submit(Acquire("z", "b:1", 2, 30.0, META, True),
                         lambda result, error: out.append(error))
        assert loop.link.running
        loop.hub.reset()  # kombu's on a lost broker connection: every socket forgotten
        assert not loop.link.running  # (the gate's calls go through its thread meanwhile)
        # the link's own close: the caller may make the call again elsewhere at once
        assert len(out) == 1 and isinstance(out[0], LinkClosed), out
        assert str(out[0]).count("semaphore backend") == 1, out  # said once, not wrapped
        out.clear()
        loop.link.submit(Release("z", "a:1"), lambda result, error: out.append(error))
        # closed until started again: unavailable, not a close (a caller that made the call
        # again at once on every LinkClosed would go round until the link starts)
        assert isinstance(out[0], BackendUnavailable) and not isinstance(out[0], LinkClosed)
        loop.loop = loop.hub.create_loop()  # as Celery's loop does after a reset
        loop.link.start()
        assert loop.link.running
        assert loop.call(Release("z", "a:1")) == (True, None)
    finally:
        loop.backend.reset("z")
        loop.close()


def test_the_hubs_close_may_iterate_its_callbacks_as_kombu_5_3_does(redis_url):
    """kombu 5.3's ``Hub.close`` calls each ``on_close`` callback while iterating the set
    itself: the link's callback must leave the set alone there (it discarded itself, the
    close raised "Set changed size during iteration", and the rest of the close was skipped
    on every lost broker connection)."""
    loop = Loop(redis_url)
    try:
        assert loop.call(Acquire("y", "a:1", 2, 30.0, META, True))[1] is None
        out = []
        loop.link.submit(Release("y", "a:1"), lambda result, error: out.append(error))
        after = []
        loop.hub.on_close.add(lambda hub: after.append(hub))
        for callback in loop.hub.on_close:  # kombu 5.3's close, as it iterates
            callback(loop.hub)
        assert len(after) == 1  # every callback ran
        assert len(out) == 1 and isinstance(out[0], BackendUnavailable)
        loop.loop = loop.hub.create_loop()
        loop.link.start()
        assert loop.call(Release("y", "a:1")) == (True, None)
    finally:
        loop.backend.reset("y")
        loop.close()


def test_a_password_and_a_database_number_are_used(tmp_path):
    port = servers.free_port()
    proc, client = servers.start_redis(port, str(tmp_path), "--requirepass", "s3cret",
                                       client_url=f"redis://:s3cret@127.0.0.1:{port}/3")
    loop = Loop(f"redis://:s3cret@127.0.0.1:{port}/3")
    try:
        assert loop.call(Acquire("db", "a:1", 2, 30.0, META, True))[0].grant is not None
        assert any(client.scan_iter(match=f"{loop.backend.key_prefix}*"))  # in database 3
    finally:
        loop.close()
        proc.terminate()
        proc.wait(10)


def test_a_unix_socket_works_and_only_one_server_gets_a_link(redis_socket_url):
    loop = Loop(redis_socket_url)
    try:
        assert loop.call(Acquire("u", "a:1", 2, 30.0, META, True))[0].grant is not None
        assert loop.call(Release("u", "a:1")) == (True, None)
    finally:
        loop.close()
    hub = Hub()
    for url in ("redis+sentinel://127.0.0.1:26379/m", "redis+cluster://127.0.0.1:7000",
                "rediss://127.0.0.1:6379/0"):
        backend = get_backend(url)
        assert backend.event_loop_link(hub, lambda *a: None, lambda: None) is None, url
    hub.close()
