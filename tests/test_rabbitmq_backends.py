"""The RabbitMQ backends against a real broker, beyond the contract suite: broker restart,
holders that die or freeze, resizes under load and from two administrators at once, and the
token count after many reject/requeue cycles. Token counts are read from the broker itself.
"""

import functools
import logging
import multiprocessing
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time

import amqp
import pytest
from kombu import Connection

from celery_semaphore import BackendUnavailable, Semaphore
from celery_semaphore.backends import backend_class, close_all, get_backend
from tests import servers
from tests.test_contract import Probe
from tests.util import retrying, wait_until

FORK = multiprocessing.get_context("fork")


@pytest.fixture(params=["amqp", "amqp+slots"])
def rabbit(request, amqp_url):
    url = amqp_url if request.param == "amqp" else servers.slots_url(amqp_url)
    prefix = f"{servers.unique_tag()}:"
    yield url, {"key_prefix": prefix}
    close_all()


@pytest.fixture
def tokens(amqp_url):
    """Reads a token queue straight from the broker (ready tokens and their numbers), on a
    connection of its own per read, so that it survives a broker restart."""

    def ready(queue):
        with Connection(amqp_url) as connection:
            return connection.channel().queue_declare(queue, passive=True).message_count

    def numbers(queue):
        with Connection(amqp_url) as connection:
            channel = connection.channel()
            taken = []
            while True:
                message = channel.basic_get(queue, no_ack=False)
                if message is None:
                    break
                taken.append(message)
            for message in taken:
                channel.basic_reject(message.delivery_tag, requeue=True)
            return sorted(message.headers["x-semaphore-token"] for message in taken)

    ready.numbers = numbers
    return ready


def token_queue(options, name):
    return f"{options['key_prefix']}{name}.tokens"


def slot_queues_present(amqp_url, options, name, upto):
    """Which A queues ``0 .. upto-1`` exist on the broker."""
    connection = Connection(amqp_url)
    present = []
    try:
        for slot in range(upto):
            channel = connection.channel()
            try:
                channel.queue_declare(f"{options['key_prefix']}{name}.slot.{slot}", passive=True)
                present.append(slot)
                channel.close()
            except amqp.exceptions.NotFound:
                pass
    finally:
        connection.close()
    return present


def assert_exactly_limit_slots(url, options, name, limit, tokens, amqp_url):
    """Nobody holding: the broker has exactly tokens 0..limit-1 ready (token backend), or
    exactly the A queues 0..limit-1, none above (slot backend, overshoot 8 included)."""
    if url.startswith("amqp://"):
        queue = token_queue(options, name)
        assert wait_until(lambda: tokens(queue) == limit)
        assert tokens.numbers(queue) == list(range(limit))
    else:
        assert slot_queues_present(amqp_url, options, name, 6 + 8) == list(range(limit))


# -- broker restart -----------------------------------------------------------------------


def restart_broker(amqp_url):
    ctl = servers.rabbitmqctl()
    if not os.path.exists(ctl):
        pytest.fail("restarting the broker needs rabbitmqctl on this machine (Debian package "
                    "rabbitmq-server)", pytrace=False)
    try:
        subprocess.run([ctl, "stop_app"], check=True, capture_output=True, timeout=120)
    finally:  # never leave the machine's broker stopped
        subprocess.run([ctl, "start_app"], check=True, capture_output=True, timeout=120)
    assert servers.wait_for(amqp_url, 5672, 60)


@pytest.mark.serial
def test_broker_restart_while_tokens_are_held(rabbit, amqp_url, tokens):
    url, options = rabbit
    sem = Semaphore("restart", 3, url, ttl=5, **options)
    held = [sem.acquire(timeout=10) for _ in range(2)]
    restart_broker(amqp_url)
    # The connection died with the broker: the holders' evidence is gone, and they say so.
    assert not retrying(lambda: held[0].renew())
    assert held[0].lost
    assert not retrying(lambda: held[1].verify())
    # The limit survived the restart, and holds.
    after = [retrying(lambda: sem.acquire(timeout=10)) for _ in range(3)]
    assert sem.try_acquire() is None
    assert sem.status().limit == 3
    for lease in after:
        lease.release()
    assert_exactly_limit_slots(url, options, "restart", 3, tokens, amqp_url)


# -- holders that die or freeze -----------------------------------------------------------


def _hold(url, options, ready, heartbeat):
    Semaphore("dying", 1, url, ttl=30, heartbeat=heartbeat, **options).acquire()
    ready.set()
    time.sleep(600)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_holders_token_comes_back_within_the_heartbeat_bound(how, amqp_url, tokens):
    """SIGKILL: the kernel closes the socket, the broker requeues at once. SIGSTOP: the socket
    stays open and only missed heartbeats (2 s here) tell the broker the holder is gone."""
    options = {"key_prefix": f"{servers.unique_tag()}:"}
    heartbeat = 2
    ready = FORK.Event()
    child = FORK.Process(target=_hold, args=(amqp_url, options, ready, heartbeat))
    child.start()
    try:
        assert ready.wait(15)
        queue = token_queue(options, "dying")
        assert tokens(queue) == 0
        stopped_at = time.monotonic()
        os.kill(child.pid, getattr(signal, how))
        assert wait_until(lambda: tokens(queue) == 1, timeout=3 * heartbeat + 5)
        back_after = time.monotonic() - stopped_at
        if how == "SIGKILL":
            assert back_after < 2
        else:
            assert heartbeat <= back_after < 3 * heartbeat + 5
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()


def test_a_channel_closed_by_the_broker_is_a_lost_lease(amqp_url, tokens):
    """What consumer_timeout does: the broker closes the channel holding the token."""
    options = {"key_prefix": f"{servers.unique_tag()}:"}
    sem = Semaphore("closed", 1, amqp_url, ttl=30, **options)
    lease = sem.acquire(timeout=10)
    backend = sem.backend
    hand = backend.link.call(lambda: backend._hands[("closed", lease.holder)])
    # An ack of an unknown delivery tag: the broker closes the channel (406), as it does when
    # a delivery outlives consumer_timeout.
    backend.link.call(lambda: hand.channel.basic_ack(999999))
    assert wait_until(lambda: backend.link.call(lambda: hand.lost), timeout=5)
    assert lease.renew() is False and lease.lost  # renewal frees the registry entry too
    assert not lease.verify()
    assert wait_until(lambda: tokens(token_queue(options, "closed")) == 1)
    other = sem.acquire(timeout=5)  # the registry entry went with the token
    other.release()


# -- resizing -----------------------------------------------------------------------------


def test_a_registry_held_too_long_elsewhere_costs_only_that_call(rabbit, amqp_url):
    """A process frozen while it holds one semaphore's registry message: another process's
    call on that semaphore times out, and nothing else of that process is lost."""
    url, options = rabbit
    other = Semaphore("other", 1, url, ttl=30, registry_timeout=1, **options)
    lease = other.acquire(timeout=10)
    frozen = Semaphore("frozen", 1, url, registry_timeout=1, **options)
    frozen.resize(1)  # creates its registry queue
    with Connection(amqp_url) as holder:  # what a frozen process holding it looks like
        channel = holder.channel()
        message = channel.basic_get(f"{options['key_prefix']}frozen.registry", no_ack=False)
        assert message is not None
        with pytest.raises(BackendUnavailable):
            frozen.try_acquire()
        assert lease.verify() and lease.renew()  # same backend, same connection: unharmed
        channel.basic_reject(message.delivery_tag, requeue=True)
    assert frozen.try_acquire() is not None
    lease.release()


def test_a_registry_waited_for_is_used_without_waiting_for_the_cancel_ok(rabbit, amqp_url):
    """The registry message is taken by a consumer: at once when free, when it comes back
    when held elsewhere. Once it is delivered, the consumer is cancelled without a round
    trip (prefetch 1: nothing else can be delivered meanwhile). Each time the consumer is
    gone, the registry message is back in its queue, and nothing is left on the registry
    channel."""
    url, options = rabbit
    sem = Semaphore("busy", 1, url, ttl=30, registry_timeout=20, **options)
    sem.resize(1)
    backend = sem.backend
    registry = f"{options['key_prefix']}busy.registry"
    with Connection(amqp_url) as elsewhere:
        channel = elsewhere.channel()
        for _ in range(3):
            message = channel.basic_get(registry, no_ack=False)
            assert message is not None
            tx = backend.link.call(lambda: backend._channel("tx"))
            cancels = []
            real_cancel = tx.basic_cancel
            tx.basic_cancel = lambda *a, **k: cancels.append(a) or real_cancel(*a, **k)
            results = []
            caller = threading.Thread(target=lambda: results.append(sem.try_acquire()))
            caller.start()
            assert wait_until(lambda: channel.queue_declare(registry, passive=True)
                              .consumer_count == 1)  # the call waits for the message
            channel.basic_reject(message.delivery_tag, requeue=True)
            caller.join(15)
            del tx.basic_cancel
            assert results and results[0] is not None
            assert cancels == []
            results[0].release()
            declared = channel.queue_declare(registry, passive=True)
            assert (declared.message_count, declared.consumer_count) == (1, 0)
            assert backend.link.call(lambda: (dict(tx.callbacks), dict(tx.cancel_callbacks))) \
                == ({}, {})
    # A free registry is consumed as well (no basic.get first): one round trip, same state.
    tx = backend.link.call(lambda: backend._channel("tx"))
    tx.basic_get = lambda *args, **kwargs: pytest.fail("a basic.get of the registry")
    try:
        assert sem.status().limit == 1
        sem.try_acquire().release()
    finally:
        del tx.basic_get
    with Connection(amqp_url) as after:
        declared = after.channel().queue_declare(registry, passive=True)
        assert (declared.message_count, declared.consumer_count) == (1, 0)


@pytest.fixture
def tagged():
    yield {"key_prefix": f"{servers.unique_tag()}:"}
    close_all()


def test_a_registry_queue_deleted_under_a_waiting_call_costs_nothing_else(rabbit, amqp_url):
    """An operator deletes a registry queue (``rabbitmqctl delete_queue``) while a call here
    waits for its message: the broker cancels that consumer, the call carries on as for a
    new semaphore, and the connection (with a lease on another semaphore) stays up."""
    url, options = rabbit
    kept = Semaphore("kept", 1, url, ttl=30, **options).acquire(timeout=10)
    doomed = Semaphore("doomed", 1, url, ttl=30, registry_timeout=20, **options)
    doomed.resize(1)
    registry = f"{options['key_prefix']}doomed.registry"
    results = []
    with Connection(amqp_url) as holder:
        channel = holder.channel()
        assert channel.basic_get(registry, no_ack=False) is not None  # a frozen holder
        caller = threading.Thread(target=lambda: results.append(doomed.try_acquire()))
        caller.start()
        time.sleep(0.5)  # the call now waits for the registry message
        holder.channel().queue_delete(registry)
        caller.join(15)
    assert results and results[0] is not None and results[0].verify()
    assert kept.verify() and kept.renew() and not kept.lost
    results[0].release()
    kept.release()


def test_resize_up_and_down_under_load(rabbit, amqp_url, tokens):
    url, options = rabbit
    sem = Semaphore("load", 2, url, ttl=30, poll_interval=0.2, **options)
    probe = Probe()
    stop = threading.Event()
    errors = []
    entered = []  # one item per hold (list.append is atomic)

    def worker():
        try:
            while not stop.is_set():
                with sem.acquire(timeout=30):
                    probe.enter()
                    entered.append(1)
                    time.sleep(0.01)
                    probe.leave()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def holds_seen(more):
        """Wait until ``more`` holds begin after this call (a window of observed holds, not
        of time: a loaded machine makes fewer of them in a second)."""
        seen = len(entered)
        assert wait_until(lambda: len(entered) >= seen + more, timeout=30)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        # both slots get used at once (waited for: a loaded CI machine saw 20 holds of 10 ms
        # go by one at a time, each acquire slower than a hold), never more than both
        assert wait_until(lambda: probe.highest.value == 2, timeout=60), probe.highest.value
        holds_seen(20)
        assert probe.highest.value == 2
        sem.resize(4)
        assert wait_until(lambda: probe.highest.value == 4, timeout=60)
        sem.resize(1)
        assert wait_until(lambda: sem.status().held <= 1, timeout=60)
        probe.highest.value = 0
        holds_seen(20)
        assert probe.highest.value == 1
        sem.resize(3)
        assert wait_until(lambda: probe.highest.value == 3, timeout=60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors
    assert wait_until(lambda: sem.status().held == 0)
    assert_exactly_limit_slots(url, options, "load", 3, tokens, amqp_url)


def _resize_many(url, options, seed, rounds):
    import random

    rng = random.Random(seed)
    backend = get_backend(url, **options)
    for _ in range(rounds):
        backend.resize("admins", rng.randint(1, 6))


def test_two_admins_resizing_at_once_end_consistent(rabbit, amqp_url, tokens):
    url, options = rabbit
    sem = Semaphore("admins", 2, url, **options)
    held = sem.acquire()  # a holder across all of it
    admins = [FORK.Process(target=_resize_many, args=(url, options, seed, 15)) for seed in (1, 2)]
    for admin in admins:
        admin.start()
    for admin in admins:
        admin.join(120)
        assert admin.exitcode == 0
    held.release()
    limit = sem.status().limit
    assert_exactly_limit_slots(url, options, "admins", limit, tokens, amqp_url)
    leases = [sem.acquire(timeout=5) for _ in range(limit)]
    assert sem.try_acquire() is None
    for lease in leases:
        lease.release()


def test_25_reject_requeue_cycles_leave_exactly_limit_tokens(amqp_url, tokens):
    options = {"key_prefix": f"{servers.unique_tag()}:"}
    sem = Semaphore("cycles", 2, amqp_url, **options)
    other = sem.acquire()
    for _ in range(25):
        sem.acquire(timeout=5).release()
    other.release()
    queue = token_queue(options, "cycles")
    assert wait_until(lambda: tokens(queue) == 2)
    assert tokens.numbers(queue) == [0, 1]


def _delivery_arrived(sock, channel_id):
    """The next frame on ``channel_id`` waiting unread on ``sock`` is a basic.deliver:
    peeked, left for the client to read. Frames of other channels (the registry's, whose
    consume is in flight beside the get) and heartbeats are passed over."""
    if not select.select([sock], [], [], 0.01)[0]:
        return False
    data = sock.recv(65536, socket.MSG_PEEK)
    while len(data) >= 7:
        kind, channel, size = struct.unpack(">BHI", data[:7])
        if kind != 8 and channel == channel_id:  # the frame we wait for
            if len(data) < 11:
                return False
            method = struct.unpack(">HH", data[7:11])
            assert (kind, method) == (1, (60, 60)), data  # basic.deliver
            return True
        data = data[7 + size + 1:]
    return False


@pytest.mark.parametrize("get_answers", ["empty", "another token"])
def test_amqp_a_delivery_crossing_the_waiters_own_get_keeps_its_token(amqp_url, tagged,
                                                                      tokens, get_answers):
    """A waiter next in line consumes the token queue; its next try also takes a token with
    basic.get, and the token freed meanwhile is delivered to its consumer while that get is
    in flight (py-amqp dispatches the delivery before it returns the get's answer). The
    waiter must use that token, not drop it on the floor: overwritten by the get's answer, it
    stayed unacked on the waiter's channel for good, one slot fewer (the rolling-deploy
    contract test saw at most 3 holders of 4 for minutes)."""
    name, limit = "crossed", 1 if get_answers == "empty" else 2
    queue = token_queue(tagged, name)
    backend = get_backend(amqp_url, **tagged)
    first = backend.acquire(name, "creator", limit=limit, ttl=30, meta={}, wait=False)
    assert first.grant is not None and backend.release(name, "creator")
    assert wait_until(lambda: tokens(queue) == limit)
    with Connection(amqp_url) as elsewhere:  # holds every token, unknown to the registry
        channel = elsewhere.channel()
        taken = [channel.basic_get(queue, no_ack=False) for _ in range(limit)]
        assert None not in taken
        delivered = taken[0].headers["x-semaphore-token"]  # the token freed during the get
        waiting = backend.acquire(name, "waiter", limit=limit, ttl=30, meta={}, wait=True)
        assert waiting.grant is None and waiting.position == 0
        hand = backend.link.call(lambda: backend._hands[(name, "waiter")])
        assert hand.consumer_tag is not None  # next in line: it consumes the token queue
        sock = backend.link.conn.transport.sock
        real_get = hand.channel.basic_get

        def get_crossed_by_a_delivery(*args, **kwargs):  # the waiter's next try, I/O thread
            del hand.channel.basic_get  # once
            channel.basic_reject(taken[0].delivery_tag, requeue=True)
            assert wait_until(lambda: _delivery_arrived(sock, hand.channel.channel_id))
            if get_answers == "another token":
                channel.basic_reject(taken[1].delivery_tag, requeue=True)
                assert wait_until(lambda: channel.queue_declare(queue, passive=True)
                                  .message_count == 1)
            return real_get(*args, **kwargs)

        hand.channel.basic_get = get_crossed_by_a_delivery
        again = backend.acquire(name, "waiter", limit=limit, ttl=30, meta={}, wait=True)
        assert again.grant is not None and again.grant.slot == delivered, again
        assert backend.release(name, "waiter")
    # Every token is back in the queue: none was left unacked on the waiter's channel.
    assert wait_until(lambda: tokens(queue) == limit)
    assert tokens.numbers(queue) == list(range(limit))


def test_amqp_a_released_token_is_back_before_the_release_wakes_anyone(amqp_url, tagged,
                                                                      tokens):
    """The releaser gives its token back while it still holds the registry message, so the
    token is in its queue by the time the wake-up goes out, and the woken waiter (another
    process) takes it with its basic.get. Given back after the wake-up, it was often still on
    its way: the waiter's try missed it, consumed, and needed a third registry write."""
    name = "handoff"
    queue = token_queue(tagged, name)
    releaser = get_backend(amqp_url, **tagged)
    waiter = backend_class(amqp_url)(amqp_url, **tagged)  # a connection and client of its own
    try:
        assert releaser.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
        woken = threading.Event()
        waiter.watch(name, "waiter", woken.set)
        assert waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True).grant is None
        seen = []
        real_send_wakeup = releaser._send_wakeup

        def send_wakeup(client, *args):  # the releaser's I/O thread, after the commit
            seen.append(wait_until(lambda: tokens(queue) == 1, timeout=3))
            real_send_wakeup(client, *args)

        releaser._send_wakeup = send_wakeup
        assert releaser.release(name, "holder")
        assert seen and seen[0] is True  # the first: the engine's after the commit is skipped
        assert woken.wait(10)
        again = waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True)
        assert again.grant is not None and again.grant.slot == 0
        assert waiter.link.call(lambda: waiter._hands[(name, "waiter")].consumer_tag) is None
        assert waiter.release(name, "waiter")
    finally:
        waiter.close()
    assert wait_until(lambda: tokens(queue) == 1)


def test_amqp_a_release_wakes_the_next_waiter_before_its_commit_and_once(amqp_url, tagged):
    """The waiter a release makes admissible is woken while the releaser still holds the
    registry (its attempt then waits at the broker for the commit, instead of starting
    after it), and only then: the wake-up the engine sends after the commit is skipped."""
    name = "early"
    releaser = get_backend(amqp_url, **tagged)
    waiter = backend_class(amqp_url)(amqp_url, **tagged)
    received = []
    real_on_wakeup = waiter._on_wakeup
    waiter._on_wakeup = lambda message: received.append(message) or real_on_wakeup(message)
    try:
        assert releaser.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
        woken = threading.Event()
        waiter.watch(name, "waiter", woken.set)
        assert waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True).grant is None
        tx = releaser.link.call(lambda: releaser._channel("tx"))
        before_commit = []
        real_commit = tx.tx_commit

        def commit():
            before_commit.append(woken.wait(5))
            return real_commit()

        tx.tx_commit = commit
        try:
            assert releaser.release(name, "holder")
        finally:
            del tx.tx_commit
        assert before_commit == [True]
        again = waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True)
        assert again.grant is not None
        time.sleep(0.2)  # a second wake-up would have come by now
        assert len(received) == 1
        assert waiter.release(name, "waiter")
    finally:
        waiter.close()


def test_amqp_a_release_whose_commit_fails_after_its_token_went_back_is_a_lost_lease(
        amqp_url, tagged, tokens):
    """The token goes back before the registry commits the release. Should that commit fail
    (the broker closes the registry's channel: the old state, lease included, stays), the
    hand holds nothing any more: renewal reports the lease lost and frees it, rather than
    renew a lease whose token someone else may take."""
    name = "failed-release"
    queue = token_queue(tagged, name)
    backend = get_backend(amqp_url, **tagged)
    assert backend.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
    real_put = backend._put

    def put_refused(message, queue_name, body, before_commit=()):
        del backend._put  # once
        bad_ack = lambda: backend._channel("tx").basic_ack(10 ** 6)  # noqa: E731
        real_put(message, queue_name, body, [*before_commit, bad_ack])  # PRECONDITION_FAILED

    backend._put = put_refused
    with pytest.raises(amqp.exceptions.PreconditionFailed):
        backend.release(name, "holder")
    assert wait_until(lambda: tokens(queue) == 1)  # the token went back
    assert [h.holder for h in backend.status(name).holders] == ["holder"]  # the old state
    assert backend.renew(name, "holder", 30) is None  # reported lost...
    assert backend.status(name).held == 0  # ... and freed
    assert backend.acquire(name, "next", limit=1, ttl=30, meta={}, wait=False).grant
    assert backend.release(name, "next")
    assert wait_until(lambda: tokens(queue) == 1)


def test_a_waiter_of_the_same_process_is_woken_without_the_broker(rabbit):
    """A release that makes a waiter of this very process admissible wakes it directly; a
    waiter of another process still gets its wake-up through the broker."""
    url, options = rabbit
    backend = get_backend(url, **options)
    other = backend_class(url)(url, **options)  # a client of its own
    received = {backend: [], other: []}
    for side in received:  # before the first watch: what its wake-up consumer calls
        side._on_wakeup = functools.partial(
            lambda side, real, message: received[side].append(message) or real(message),
            side, side._on_wakeup)
    try:
        for waiter_side in (backend, other):
            assert backend.acquire("wake", "holder", limit=1, ttl=30, meta={},
                                   wait=True).grant
            woken = threading.Event()
            waiter_side.watch("wake", "waiter", woken.set)
            assert waiter_side.acquire("wake", "waiter", limit=1, ttl=30, meta={},
                                       wait=True).grant is None
            assert backend.release("wake", "holder")
            assert woken.wait(10)
            assert waiter_side.acquire("wake", "waiter", limit=1, ttl=30, meta={},
                                       wait=True).grant is not None
            waiter_side.unwatch("wake", "waiter")
            assert waiter_side.release("wake", "waiter")
        time.sleep(0.2)  # a wake-up through the broker would have come by now
        assert (len(received[backend]), len(received[other])) == (0, 1)
    finally:
        other.close()


def test_amqp_the_token_get_overlaps_the_registry_take(amqp_url, tagged, tokens):
    """An acquire that takes its token before the registry sends the registry's consume
    first (no ConsumeOk awaited), then the token's basic.get: the two round trips overlap.
    When the get is answered, the registry message is already on its way to us."""
    name = "overlap"
    registry = f"{tagged['key_prefix']}{name}.registry"
    backend = get_backend(amqp_url, **tagged)
    assert backend.acquire(name, "first", limit=2, ttl=30, meta={}, wait=True).grant
    seen = []
    real_take_token = backend._take_token

    def take_token(hand):
        with Connection(amqp_url) as elsewhere:
            channel = elsewhere.channel()
            # (another connection: the broker may see our consume a moment later)
            seen.append(wait_until(lambda: channel.queue_declare(registry, passive=True)
                                   .message_count == 0, timeout=5))
        return real_take_token(hand)

    backend._take_token = take_token
    second = backend.acquire(name, "second", limit=2, ttl=30, meta={}, wait=True)
    del backend._take_token
    assert second.grant is not None
    assert seen == [True]  # the registry message is ours, or on its way to us
    for holder in ("first", "second"):
        assert backend.release(name, holder)
    assert wait_until(lambda: tokens(token_queue(tagged, name)) == 2)


def test_amqp_a_registry_deleted_behind_the_backends_back_costs_no_wait(amqp_url, tagged):
    """The registry queue of a semaphore this process knows is deleted by hand: the
    consume sent beside the token's get fails (the broker closes the registry channel),
    and the acquire carries on as for a new semaphore at once, not after
    ``registry_timeout``."""
    name = "vanished"
    backend = get_backend(amqp_url, registry_timeout=20, **tagged)
    assert backend.acquire(name, "before", limit=1, ttl=30, meta={}, wait=True).grant
    assert backend.release(name, "before")
    with Connection(amqp_url) as elsewhere:
        elsewhere.channel().queue_delete(f"{tagged['key_prefix']}{name}.registry")
    started = time.monotonic()
    after = backend.acquire(name, "after", limit=1, ttl=30, meta={}, wait=True)
    assert time.monotonic() - started < 10
    assert after.grant is not None
    assert backend.release(name, "after")
    assert backend.acquire(name, "again", limit=1, ttl=30, meta={}, wait=False).grant
    assert backend.release(name, "again")


def test_amqp_a_release_is_handed_the_registry_before_a_read_that_waited_longer(
        amqp_url, tagged):
    """While the registry is held elsewhere, a release (priority 1) and a read (priority 0,
    waiting since before it) both wait for it: the release gets it first."""
    name = "priority"
    registry = f"{tagged['key_prefix']}{name}.registry"
    releaser = get_backend(amqp_url, **tagged)
    reader = backend_class(amqp_url)(amqp_url, **tagged)
    taken = []  # who got the registry message, in order (each on its own I/O thread)
    for who, backend in (("release", releaser), ("read", reader)):
        backend._take = functools.partial(
            lambda who, real, queue_name, *args: (
                lambda message: taken.append(who) or message)(real(queue_name, *args)),
            who, backend._take)
    try:
        assert releaser.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
        taken.clear()
        with Connection(amqp_url) as elsewhere:
            channel = elsewhere.channel()
            message = channel.basic_get(registry, no_ack=False)
            assert message is not None
            consumers = lambda: channel.queue_declare(registry, passive=True).consumer_count  # noqa: E731
            calls = [threading.Thread(target=reader.status, args=(name,)),
                     threading.Thread(target=releaser.release, args=(name, "holder"))]
            for count, call in enumerate(calls, 1):
                call.start()
                assert wait_until(lambda: consumers() == count)  # waits, in this order
            channel.basic_reject(message.delivery_tag, requeue=True)
            for call in calls:
                call.join(10)
        assert taken == ["release", "read"]
        assert reader.status(name).held == 0
    finally:
        reader.close()


def test_urgent_calls_go_before_the_calls_waiting_on_the_io_thread(amqp_url, tagged):
    """The I/O thread runs the attempt of a woken waiter before the calls queued ahead of it
    (a newcomer getting in line): the freed slot waits for it. A release is not urgent: with
    the I/O thread saturated, releases overtaking the attempts of waiters not woken yet kept
    fewer slots held than the limit (test_resize_up_and_down_under_load[amqp+slots])."""
    from celery_semaphore.backends.rabbitmq.link import AMQPLink

    link = AMQPLink(amqp_url, heartbeat=10, connect_timeout=5, on_connection_lost=lambda: None)
    try:
        running, go, order = threading.Event(), threading.Event(), []
        first = threading.Thread(target=link.call, args=(lambda: running.set() or go.wait(5),))
        first.start()
        assert running.wait(5)  # the I/O thread is busy: what follows waits in line
        calls = [threading.Thread(target=link.call, args=(order.append, label),
                                  kwargs={"urgent": label.startswith("urgent")})
                 for label in ("normal 1", "normal 2", "urgent")]
        for queued, call in enumerate(calls, 1):
            call.start()
            assert wait_until(  # queued in this order
                lambda: link._commands.qsize() + link._urgent.qsize() == queued)
        go.set()
        for call in [first, *calls]:
            call.join(5)
        assert order == ["urgent", "normal 1", "normal 2"]
    finally:
        link.stop()
    # The backend marks as urgent the attempt of a woken waiter, nothing else.
    backend = get_backend(amqp_url, **tagged)
    flags = []
    real_call = backend.link.call

    def call(fn, *args, urgent=False, **kwargs):
        flags.append((getattr(fn, "__name__", ""), urgent))
        return real_call(fn, *args, urgent=urgent, **kwargs)

    assert backend.acquire("urgent", "holder", limit=1, ttl=30, meta={}, wait=True).grant
    woken = threading.Event()
    backend.watch("urgent", "waiter", woken.set)
    assert backend.acquire("urgent", "waiter", limit=1, ttl=30, meta={}, wait=True).grant is None
    backend.link.call = call
    try:
        assert backend.release("urgent", "holder")
        assert woken.wait(5)
        assert backend.acquire("urgent", "waiter", limit=1, ttl=30, meta={}, wait=True).grant
        assert backend.acquire("urgent", "newcomer", limit=1, ttl=30, meta={},
                               wait=True).grant is None
    finally:
        del backend.link.call
    assert [f for f in flags if f[0] in ("_release_here", "_acquire_here")] == [
        ("_release_here", False), ("_acquire_here", True), ("_acquire_here", False)]
    backend.cancel("urgent", "newcomer")
    assert backend.release("urgent", "waiter")


def test_amqp_abandon_is_one_registry_write(amqp_url, tagged, tokens):
    """abandon (leave the queue, release a grant whose reply was lost) takes the registry
    once, for a waiter and for a holder alike, and leaves neither behind."""
    name = "abandoned"
    queue = token_queue(tagged, name)
    backend = get_backend(amqp_url, **tagged)
    assert backend.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
    assert backend.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True).grant is None
    takes = []
    real_take = backend._take
    backend._take = lambda queue_name, *args: takes.append(queue_name) or real_take(queue_name,
                                                                                   *args)
    backend.abandon(name, "waiter")
    assert len(takes) == 1
    assert backend.status(name).waiting == 0
    takes.clear()
    backend.abandon(name, "holder")  # a grant the caller never saw
    assert len(takes) == 1
    assert backend.status(name).held == 0
    assert wait_until(lambda: tokens(queue) == 1)
    assert backend.acquire(name, "next", limit=1, ttl=30, meta={}, wait=False).grant
    assert backend.release(name, "next")


def test_amqp_a_newcomer_behind_a_queue_leaves_the_tokens_to_the_waiters(amqp_url, tagged,
                                                                         tokens):
    """Where this process last saw a queue (or no free slot), a new caller takes no token
    before the registry: behind the queue it would only take the token a woken waiter is
    about to look for, and give it back a registry write later. The woken waiter then finds
    the token with its get, and is admitted by one registry write."""
    name = "newcomer"
    queue = token_queue(tagged, name)
    here = get_backend(amqp_url, **tagged)
    waiter = backend_class(amqp_url)(amqp_url, **tagged)
    try:
        assert here.acquire(name, "holder", limit=1, ttl=30, meta={}, wait=True).grant
        woken = threading.Event()
        waiter.watch(name, "waiter", woken.set)
        assert waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True).grant is None
        assert here.release(name, "holder")  # seen here: a waiter, a free slot
        assert woken.wait(10) and wait_until(lambda: tokens(queue) == 1)
        taken = []
        real_take_token = here._take_token
        here._take_token = lambda hand: taken.append(hand.holder) or real_take_token(hand)
        late = here.acquire(name, "newcomer", limit=1, ttl=30, meta={}, wait=True)
        assert late.grant is None and late.position == 1
        assert taken == []
        assert tokens(queue) == 1
        again = waiter.acquire(name, "waiter", limit=1, ttl=30, meta={}, wait=True)
        assert again.grant is not None
        assert waiter.link.call(lambda: waiter._hands[(name, "waiter")].consumer_tag) is None
        assert waiter.release(name, "waiter")
        here.cancel(name, "newcomer")
    finally:
        waiter.close()


def test_amqp_a_newcomer_admitted_where_it_expected_a_queue_takes_its_token_in_the_rule(
        amqp_url, tagged, tokens):
    """The hint is only a hint: a new caller that skipped the token because the semaphore
    looked crowded, but whom the registry admits, takes a token while it holds the registry
    and is admitted by that same write."""
    name = "uncrowded"
    queue = token_queue(tagged, name)
    backend = get_backend(amqp_url, **tagged)
    assert backend.acquire(name, "brief", limit=1, ttl=0.5, meta={}, wait=True).grant
    assert name in backend._crowded  # full
    assert wait_until(lambda: tokens(queue) == 1)  # its local deadline gave the token back
    assert wait_until(lambda: backend.status(name).held == 0)  # expired in the registry too
    writes = []
    real_transact = backend._transact
    backend._transact = lambda *args, **kwargs: writes.append(args[0]) or real_transact(
        *args, **kwargs)
    fresh = backend.acquire(name, "fresh", limit=1, ttl=30, meta={}, wait=True)
    assert fresh.grant is not None and fresh.grant.slot == 0
    assert writes == [name]
    del backend._transact
    assert name in backend._crowded  # full again
    assert backend.release(name, "fresh")
    assert name not in backend._crowded
    assert wait_until(lambda: tokens(queue) == 1)


def test_slot_backend_url_and_a_missing_broker(amqp_url):
    from celery_semaphore import BackendUnavailable
    from celery_semaphore.backends.rabbitmq import SlotQueueBackend

    backend = get_backend(servers.slots_url(amqp_url))
    assert isinstance(backend, SlotQueueBackend)
    assert backend.broker_url.startswith("amqp://")
    port = servers.free_port()
    dead = get_backend(f"amqp://guest:secret@127.0.0.1:{port}//", connect_timeout=1)
    with pytest.raises(BackendUnavailable) as err:
        dead.ping()
    assert str(port) in str(err.value) and "secret" not in str(err.value)
    close_all()


# -- slot queues: shrink, claims ------------------------------------------------------------


def test_a_holder_of_a_slot_removed_by_a_shrink_keeps_it(amqp_url, tagged):
    sem = Semaphore("shrunk", 3, servers.slots_url(amqp_url), ttl=30, **tagged)
    leases = [sem.acquire(timeout=10) for _ in range(3)]
    assert sorted(lease.token.slot for lease in leases) == [0, 1, 2]
    sem.resize(1)
    assert all(lease.verify() for lease in leases)  # counted against the new limit
    for lease in leases:
        lease.release()
    assert sem.try_acquire() is not None and sem.try_acquire() is None


def test_a_slot_still_claimed_elsewhere_keeps_the_waiter_first_in_line(amqp_url, tagged,
                                                                       caplog):
    """The registry grants slot 0, but a holder whose lease lapsed still has its B queue: the
    caller gives the slot back and stays first in line, ahead of a later waiter."""
    from celery_semaphore.backends.rabbitmq import slots

    caplog.set_level(logging.DEBUG, logger=slots.__name__)
    url = servers.slots_url(amqp_url)
    sem = Semaphore("claimed", 1, url, ttl=30, poll_interval=0.1, **tagged)
    sem.resize(1)
    with Connection(amqp_url) as stale:  # the lapsed holder's exclusive B queue
        stale.channel().queue_declare(f"{tagged['key_prefix']}claimed.held.0", exclusive=True)
        results = []
        first = threading.Thread(target=lambda: results.append(("first", sem.acquire(20))))
        first.start()
        assert wait_until(lambda: sem.status().waiting == 1)
        second = threading.Thread(target=lambda: results.append(("second", sem.acquire(20))))
        second.start()
        seen = []  # one status with both in line (the first is granted and gives back meanwhile)
        assert wait_until(lambda: seen.append(sem.status()) or seen[-1].waiting == 2)
        first_holder = seen[-1].waiters[0].holder

        def handed_back():
            return [r.args[2] for r in caplog.records if r.name == slots.__name__
                    and r.args[1] == "claimed" and "handed back" in r.msg]

        # the registry grants slot 0 to the head of the line again and again, the claim is
        # refused each time and the slot handed back: the first stays first (only the head is
        # granted), and nobody holds the slot
        assert wait_until(lambda: len(handed_back()) >= 3, timeout=10), handed_back()
        assert set(handed_back()) == {first_holder} and not results
    # The stale connection closed: its B queue is gone.
    first.join(20)
    assert results and results[0][0] == "first"
    results[0][1].release()
    second.join(20)
    assert [who for who, _ in results] == ["first", "second"]
    assert first_holder == results[0][1].holder
    results[1][1].release()
