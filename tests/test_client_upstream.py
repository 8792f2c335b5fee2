"""The client API of the upstream contract: ``Lease.settle``, ``LeaseGroup.settle`` and
``current_lease().settle`` (eager), releases that report an outcome for an adaptive
semaphore, a ``with`` block left by a Backoff, ``Semaphore.pause``/``resume``, and what a
Semaphore with quotas, several rates, units or an Adaptive limit declares. Against the memory
backend through :mod:`tests.upstream_double` (no server)."""

import time

import pytest
from celery import Celery

import celery_semaphore
from celery_semaphore import (
    Adaptive,
    Backoff,
    ConfigurationError,
    Semaphore,
    acquire_all,
    current_lease,
)
from celery_semaphore.backends import get_backend
from tests import servers
from tests.upstream_double import URL, ContractDouble


@pytest.fixture
def double():
    return ContractDouble(f"memory://{servers.unique_tag()}")


def ops(double, kind):
    return [call for call in double.calls if call[0] == kind]


def test_settle_tells_the_backend_what_the_holder_spent(double):
    sem = Semaphore("llm", 4, double)
    lease = sem.acquire(units=1)
    assert lease.settle(40) is True and lease.settle(0) is True  # absolute, again
    assert ops(double, "settle") == [("settle", "llm", lease.holder, 40),
                                     ("settle", "llm", lease.holder, 0)]
    for bad in (-1, 1.5, True, "40", None, 10**12 + 1):
        with pytest.raises(ConfigurationError, match="units must be"):
            lease.settle(bad)
    assert len(ops(double, "settle")) == 2  # nothing sent for a bad value
    lease.release()
    assert lease.settle(10) is False  # not held: nothing changed
    assert len(ops(double, "settle")) == 2


def test_settle_of_a_lost_lease_is_false(double):
    sem = Semaphore("llm-lost", 1, double)
    lease = sem.acquire()
    double.release("llm-lost", lease.holder)  # force-released behind the lease's back
    assert lease.settle(5) is False


def test_a_group_settles_every_semaphore(double):
    group = acquire_all([Semaphore("tok-a", 2, double), Semaphore("tok-b", 2, double)])
    assert group.settle(7) is True
    assert sorted(c[1] for c in ops(double, "settle")) == ["tok-a", "tok-b"]
    assert {c[2] for c in ops(double, "settle")} == {group.holder}
    group.release()
    assert group.settle(7) is False


def test_a_plain_lease_releases_as_before(double):
    with Semaphore("plain", 2, double).acquire():
        pass
    with pytest.raises(ValueError), Semaphore("plain", 2, double).acquire():
        raise ValueError("boom")
    assert [c[3:] for c in ops(double, "release")] == [(None, None), (None, None)]


def test_an_adaptive_lease_reports_the_outcome_of_its_block(double):
    sem = Semaphore("partner", Adaptive(min=1, max=8, decrease_on=(TimeoutError,)), double)
    assert sem.limit == 8 and sem.adaptive == Adaptive(1, 8, decrease_on=(TimeoutError,))
    with sem.acquire():
        time.sleep(0.01)
    for exc in (TimeoutError("slow"), ValueError("bug"), Backoff(reason="429")):
        with pytest.raises(type(exc)), sem.acquire():
            raise exc
    releases = ops(double, "release")
    assert [c[3] for c in releases] == ["ok", "overload", "error", "overload"]
    assert all(c[4] >= 0 for c in releases) and releases[0][4] >= 0.01  # latency
    assert not ops(double, "pause")  # a Backoff without a time closes nothing
    lease = sem.acquire()
    lease.release(outcome="overload")
    assert ops(double, "release")[-1][3] == "overload"
    with pytest.raises(ConfigurationError, match="outcome must be one of ok, overload, error"):
        sem.acquire().release(outcome="fine")


def test_a_backoff_with_a_time_pauses_the_semaphore_before_its_slot_frees(double):
    sem = Semaphore("api", 2, double)
    with pytest.raises(Backoff), sem.acquire():
        raise Backoff(retry_after=30, reason="HTTP 429")
    kinds = [c[0] for c in double.calls if c[0] in ("pause", "release")]
    assert kinds == ["pause", "release"]
    (_, name, seconds, reason), = ops(double, "pause")
    assert name == "api" and 29 <= seconds <= 30 and reason == "HTTP 429"
    status = double.status("api")
    assert status.paused_until >= time.time() + 29 and status.pause_reason == "HTTP 429"


def test_a_failed_pause_does_not_hide_the_backoff(double, caplog):
    class NoPause(ContractDouble):
        def pause(self, name, seconds, reason=""):
            raise ConfigurationError("pause: the NoPause backend cannot apply it")

    backend = NoPause(f"memory://{servers.unique_tag()}")
    with pytest.raises(Backoff), Semaphore("api", 2, backend).acquire():
        raise Backoff(5)
    assert "pausing semaphore 'api'" in caplog.text
    assert backend.status("api").held == 0  # released all the same


def test_semaphore_pause_and_resume(double):
    sem = Semaphore("ops", 2, double)
    end = sem.pause(60, reason="maintenance")
    assert time.time() + 59 <= end <= time.time() + 60
    assert sem.pause("Wed, 21 Oct 2015 07:28:00 GMT") == end  # 0 s: the later end is kept
    assert sem.resume() is True and sem.resume() is False
    for bad in (None, -1, "soon"):
        with pytest.raises(ConfigurationError):
            sem.pause(bad)
    assert [c[0] for c in double.calls].count("pause") == 2  # nothing sent for a bad value


def test_what_a_semaphore_declares(double):
    sem = Semaphore("llm", Adaptive(2, 16), double, rate="10/s; 500/m", burst=3,
                    quota="90000/m; 2000000/d", quota_tz="Europe/Paris")
    assert sem.rate == (0.1, 3) and sem.rates == ((0.1, 3), (0.12, 3))
    meta = sem._meta(None, None, units=50)
    assert meta["rate"] == [[0.1, 3], [0.12, 3]] and meta["units"] == 50
    assert meta["adaptive"] == {"min": 2, "max": 16, "decrease": 0.9, "increase": 1.0}
    assert [q[:2] for q in meta["quota"]] == [[90000, 60], [2000000, 86400]]
    assert meta["quota"][1][2] in (3600, 7200)  # Paris' offset today
    assert Semaphore("one", 2, double, rate="20/s")._meta(None, None) == {"rate": [0.05, 1]}
    assert Semaphore("none", 2, double)._meta(None, None) == {}
    with pytest.raises(ConfigurationError, match="units 100000 is above the quota '90000/m'"):
        sem._meta(None, None, units=100_000)
    with pytest.raises(ConfigurationError, match="units must be an integer"):
        sem._meta(None, None, units="{max_tokens}")


@pytest.mark.parametrize("kwargs, problem", [
    ({"limit": Adaptive}, "limit must be a positive integer or an Adaptive"),
    ({"limit": 0}, "limit must be a positive integer"),
    ({"quota": "1000/hour"}, "quota '1000/hour': unknown period"),
    ({"quota_tz": "Mars/Base"}, "quota_tz 'Mars/Base' is not a time zone"),
    ({"rate": "10/s; 10/s"}, "two counts for one period"),
])
def test_bad_client_arguments_are_refused(double, kwargs, problem):
    with pytest.raises(ConfigurationError, match=problem):
        Semaphore("x", **{"limit": 2, **kwargs}, backend=double)


def test_semaphores_acquired_together_declare_one_quota_and_adaptive_limit(double):
    plain, learned = Semaphore("a", 2, double), Semaphore("b", Adaptive(1, 4), double)
    with pytest.raises(ConfigurationError, match="the same quota and the same Adaptive"):
        acquire_all([plain, learned])
    with pytest.raises(ConfigurationError, match="the same quota"):
        acquire_all([plain, Semaphore("c", 2, double, quota="5/m")])
    group = acquire_all([Semaphore("d", Adaptive(1, 4), double),
                         Semaphore("e", Adaptive(1, 4), double)])
    with group:
        pass
    assert sorted((c[1], c[3]) for c in ops(double, "release")) == [("d", "ok"), ("e", "ok")]


def test_current_lease_settle_in_an_eager_task():
    tag = servers.unique_tag()
    app = Celery("settle_test", set_as_current=False)
    app.conf.update(broker_url="memory://", task_always_eager=True, semaphore_backend=URL,
                    semaphore_key_prefix=f"{tag}:")
    celery_semaphore.install(app)
    backend = get_backend(URL, key_prefix=f"{tag}:")
    seen = []

    @app.task(semaphore=["llm", "llm:{user}"], limit=4, shared=False)
    def complete(user, max_tokens):
        lease = current_lease()
        seen.append(lease.holder)
        assert lease.settle(max_tokens - 8) is True  # every semaphore of the task
        assert current_lease("llm:ann").settle(3) is True  # whichever lease: all of them
        return "done"

    assert complete.delay("ann", 50).get() == "done"
    settled = [c for c in backend.calls if c[0] == "settle" and c[2] == seen[0]]
    assert settled == [("settle", "llm", seen[0], 42), ("settle", "llm:ann", seen[0], 42),
                       ("settle", "llm", seen[0], 3), ("settle", "llm:ann", seen[0], 3)]
    assert backend.status("llm").held == 0


def test_a_backoff_whose_time_has_passed_pauses_nothing(double):
    with pytest.raises(Backoff), Semaphore("api-past", 2, double).acquire():
        raise Backoff(retry_after="Wed, 21 Oct 2015 07:28:00 GMT")
    assert not ops(double, "pause") and double.status("api-past").held == 0
