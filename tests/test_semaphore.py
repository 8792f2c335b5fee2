"""The client API's own guarantees when a backend call fails half-way (a reply lost, a
release that cannot reach the backend). The failures are injected into a real in-process
backend: a lost reply cannot be produced on demand with a server."""

import math

import pytest
from celery import Celery

from celery_semaphore import BackendUnavailable, ConfigurationError, InvalidName, Semaphore
from celery_semaphore.backends.memory import MemoryBackend
from celery_semaphore.names import MIN_LEASE_TTL, validate_name
from celery_semaphore.settings import Settings


def _app(**conf):
    app = Celery("semaphore_test", set_as_current=False)
    app.conf.update({"broker_url": "memory://", **conf})
    return app


class Flaky(MemoryBackend):
    """Applies each operation, then raises once for each name in ``fail_after``."""

    def __init__(self, url="memory://", **options):
        super().__init__(url, **options)
        self.fail_after = set()

    def _maybe_fail(self, operation):
        if operation in self.fail_after:
            self.fail_after.discard(operation)
            raise BackendUnavailable(f"{operation}: reply lost")

    def acquire(self, *args, **kwargs):
        attempt = super().acquire(*args, **kwargs)
        self._maybe_fail("acquire")
        return attempt

    def release(self, name, holder):
        if "release-before" in self.fail_after:
            self._maybe_fail("release-before")
        return super().release(name, holder)


@pytest.fixture
def flaky():
    return Flaky()


def test_try_acquire_whose_reply_is_lost_leaves_no_holder(flaky):
    sem = Semaphore("lost", 1, flaky)
    flaky.fail_after.add("acquire")
    with pytest.raises(BackendUnavailable):
        sem.try_acquire()
    assert sem.status().held == 0
    assert sem.try_acquire() is not None


def test_a_failed_release_can_be_retried(flaky):
    lease = Semaphore("retry", 1, flaky).acquire()
    flaky.fail_after.add("release-before")
    with pytest.raises(BackendUnavailable):
        lease.release()
    assert not lease.released and flaky.status("retry").held == 1
    assert lease.release() is True and lease.released
    assert flaky.status("retry").held == 0


def test_the_bodys_exception_wins_over_a_failed_release(flaky):
    sem = Semaphore("body", 1, flaky)
    with pytest.raises(ValueError, match="task failed"):
        with sem.acquire() as lease:
            flaky.fail_after.add("release-before")
            raise ValueError("task failed")
    assert lease.release() is True  # still held after the failed release: retried
    with pytest.raises(BackendUnavailable):  # no body exception: the release error shows
        with sem.acquire(timeout=0):
            flaky.fail_after.add("release-before")


@pytest.mark.parametrize("timeout", [math.nan, -1.0, True, "5", [1]])
def test_bad_timeouts_are_refused(flaky, timeout):
    with pytest.raises(ConfigurationError):
        Semaphore("t", 1, flaky).acquire(timeout=timeout)


def test_an_infinite_timeout_waits_like_none(flaky):
    lease = Semaphore("inf", 1, flaky).acquire(timeout=math.inf)
    assert lease.release()


def test_a_renewal_racing_a_release_does_not_report_the_lease_lost(flaky):
    lease = Semaphore("race", 1, flaky).acquire()
    lost = []
    lease.on_lost(lost.append)
    release = flaky.release

    def release_then_renewal_lands(name, holder):
        freed = release(name, holder)
        assert lease.renew() is False  # the keeper's renewal, landing after the release
        return freed

    flaky.release = release_then_renewal_lands
    assert lease.release() is True
    assert lost == [] and not lease.lost


@pytest.mark.parametrize("ttl", [1e-7, 0.05, 0, -1, float("nan"), float("inf"), "60", True])
def test_lease_ttls_below_the_floor_or_not_numbers_are_refused(ttl):
    with pytest.raises(ConfigurationError) as err:
        Semaphore("x", 1, "memory://floor", ttl=ttl)
    assert "ttl" in str(err.value)
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(_app(semaphore_lease_ttl=ttl))
    assert "semaphore_lease_ttl" in str(err.value)


def test_the_shortest_ttl_still_admits_one_holder_at_a_time():
    semaphore = Semaphore("floor", 1, "memory://floor2", ttl=MIN_LEASE_TTL)
    first = semaphore.try_acquire()
    assert first is not None and semaphore.try_acquire() is None
    first.release()


@pytest.mark.parametrize("name", ["a\u200bb", "\u2060x", "x\u00ad", "\ue000"])
def test_invisible_characters_are_refused_in_names(name):
    with pytest.raises(InvalidName) as err:
        validate_name(name)
    assert "invisible" in str(err.value)



def test_a_semaphore_needs_a_backend_and_declares_limit_1_by_default():
    with pytest.raises(ConfigurationError, match="needs a backend"):
        Semaphore("nowhere")
    assert Semaphore("default", backend="memory://default").limit == 1  # as the settings
