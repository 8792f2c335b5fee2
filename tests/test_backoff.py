"""Backoff (retry_after in every accepted form, and every refused one; Retry-After read from
responses) and Adaptive (validated at construction, a hashable value). No server needed."""

import pickle
import time
from datetime import datetime, timedelta, timezone

import pytest
import requests
from requests.structures import CaseInsensitiveDict

import celery_semaphore
from celery_semaphore import Adaptive, Backoff, ConfigurationError
from celery_semaphore.backoff import (
    MAX_REASON,
    outcome_of,
    parse_http_date,
    parse_iso_datetime,
    retry_after_seconds,
)

NOW = datetime(2026, 5, 9, 12, 0, 0, tzinfo=timezone.utc).timestamp()


def test_both_are_exported():
    assert celery_semaphore.Backoff is Backoff and celery_semaphore.Adaptive is Adaptive
    assert {"Backoff", "Adaptive"} <= set(celery_semaphore.__all__)


@pytest.mark.parametrize("value, seconds", [
    (None, None),
    (0, 0.0), (30, 30.0), (2.5, 2.5),
    (timedelta(minutes=2), 120.0), (timedelta(0), 0.0),
    # Retry-After delay-seconds
    ("120", 120.0), (" 7 ", 7.0), ("0", 0.0), ("1.5", 1.5),
    # HTTP-dates, the three forms RFC 9110 5.6.7 makes a recipient accept
    ("Sat, 09 May 2026 12:01:00 GMT", 60.0),
    ("Saturday, 09-May-26 12:00:30 GMT", 30.0),
    ("Sat May  9 12:00:10 2026", 10.0),
    ("sat, 09 may 2026 12:00:05 gmt", 5.0),  # names without regard to case
    ("Sat,  09 May 2026   12:00:05 GMT", 5.0),  # extra spaces
    ("Sat, 09 May 2026 12:00:00 GMT", 0.0),
    # past dates: 0
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),
    ("Sunday, 06-Nov-94 08:49:37 GMT", 0.0),
    ("Sun Nov  6 08:49:37 1994", 0.0),
    # datetimes: aware in any zone, naive meaning UTC; past: 0
    (datetime(2026, 5, 9, 14, 0, 40, tzinfo=timezone(timedelta(hours=2))), 40.0),
    (datetime(2026, 5, 9, 12, 0, 20), 20.0),
    (datetime(2020, 1, 1, tzinfo=timezone.utc), 0.0),
])
def test_retry_after_in_every_accepted_form(value, seconds):
    assert retry_after_seconds(value, NOW) == seconds


@pytest.mark.parametrize("value, problem", [
    (-1, "finite number of seconds >= 0"), (-0.001, ">= 0"), (float("nan"), "finite"),
    (float("inf"), "finite"), (True, "must be seconds"), (timedelta(seconds=-1), "negative"),
    ("", "neither delay-seconds"), ("soon", "neither delay-seconds"), ("-5", "neither"),
    ("+5", "neither"), ("5s", "neither"), ("1e3", "neither"), ("١٢", "neither"),
    ("120, 60", "neither"),
    ("Sat, 09 May 2026 12:01:00", "neither"),  # no GMT
    ("Sat, 09 May 2026 12:01:00 +0200", "neither"),
    ("Sat, 30 Feb 2026 12:01:00 GMT", "neither"),  # no such day
    ("Sat, 09 Foo 2026 12:01:00 GMT", "neither"),
    ("Sat, 09 May 2026 25:01:00 GMT", "neither"),
    ("2026-05-09T12:01:00Z", "neither"),  # ISO 8601 is no Retry-After value
    ([30], "must be seconds"), (b"30", "must be seconds"),
])
def test_bad_retry_after_is_refused_naming_the_value(value, problem):
    with pytest.raises(ConfigurationError, match=problem) as err:
        Backoff(retry_after=value)
    assert "retry_after" in str(err.value) and repr(value) in str(err.value)


def test_rfc850_two_digit_years_more_than_50_years_ahead_are_in_the_past_century():
    assert parse_http_date("Monday, 01-Jan-76 00:00:00 GMT", NOW).year == 2076
    assert parse_http_date("Friday, 01-Jan-77 00:00:00 GMT", NOW).year == 1977
    assert parse_http_date("Thursday, 01-Jan-70 00:00:00 GMT", NOW).year == 2070


def test_backoff_holds_seconds_reason_and_the_moment():
    before = time.time()
    exc = Backoff(retry_after="30", reason="HTTP 429")
    assert exc.seconds == 30.0 and exc.reason == "HTTP 429" and exc.retry_after == "30"
    assert before + 30 <= exc.at <= time.time() + 30
    assert 29 <= exc.remaining() <= 30 and exc.remaining(exc.at + 5) == 0.0
    assert str(exc) == "retry after 30s: HTTP 429"
    plain = Backoff()
    assert plain.seconds is None and plain.at is None and plain.remaining() is None
    assert str(plain) == "no time given" and isinstance(plain, Exception)
    assert not isinstance(plain, celery_semaphore.SemaphoreError)  # raised by task code
    # Pickled (Celery sends a failed task's exception back) it stays a Backoff.
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, Backoff) and again.seconds == 30.0 and again.reason == "HTTP 429"


def test_the_reason_is_one_line_and_cut_and_must_be_text():
    assert Backoff(reason="too\nmany\t requests").reason == "too many requests"
    long = Backoff(reason="x" * 1000).reason
    assert len(long) == MAX_REASON and long.endswith("...")
    with pytest.raises(ConfigurationError, match="reason must be a string"):
        Backoff(5, reason=429)


def response(status, headers):
    made = requests.Response()
    made.status_code = status
    made.headers = CaseInsensitiveDict(headers)
    return made


class Plain:
    """Any object with ``.headers``: a plain dict in another case (an httpx-like double)."""

    def __init__(self, headers, status_code=None):
        self.headers, self.status_code = headers, status_code


def test_from_response_reads_retry_after_whatever_its_case():
    exc = Backoff.from_response(response(429, {"retry-after": "12"}))
    assert exc.seconds == 12.0 and exc.reason == "HTTP 429"
    assert Backoff.from_response(Plain({"RETRY-AFTER": "3"}, 503)).seconds == 3.0
    assert Backoff.from_response(Plain({"Retry-After": "4"})).reason == ""
    assert Backoff.from_response(Plain([("Retry-After", "4")])).seconds is None  # no mapping
    assert Backoff.from_response(Plain({b"retry-after": b"6"})).seconds == 6.0
    date = Backoff.from_response(response(429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    assert date.seconds == 0.0  # an HTTP-date in the past
    assert Backoff.from_response(response(429, {}), reason="quota").reason == "quota"


def test_from_response_falls_back_to_the_default_on_no_header_or_a_bad_one():
    assert Backoff.from_response(response(429, {})).seconds is None
    assert Backoff.from_response(response(429, {}), default=10).seconds == 10.0
    assert Backoff.from_response(response(429, {"Retry-After": "soon"}),
                                 default=timedelta(seconds=5)).seconds == 5.0
    with pytest.raises(ConfigurationError, match="default must be a finite number"):
        Backoff.from_response(response(429, {}), default=-1)
    with pytest.raises(ConfigurationError, match="needs a response with headers"):
        Backoff.from_response(object())


def test_iso_datetimes_parse_with_z_an_offset_or_none():
    assert parse_iso_datetime("2026-05-09T12:00:00Z").timestamp() == NOW
    assert parse_iso_datetime("2026-05-09T14:00:00+02:00").timestamp() == NOW
    assert parse_iso_datetime("2026-05-09 12:00").timestamp() == NOW  # naive: UTC
    for bad in ("tomorrow", "12:00", "2026-13-01T00:00:00"):
        with pytest.raises(ValueError):
            parse_iso_datetime(bad)


def test_adaptive_defaults_meta_and_hashing():
    adaptive = Adaptive()
    assert (adaptive.min, adaptive.max, adaptive.decrease, adaptive.increase) == (1, 64, 0.9, 1.0)
    assert adaptive.limit == 64
    assert adaptive.meta() == {"min": 1, "max": 64, "decrease": 0.9, "increase": 1.0}
    assert Adaptive(2, 8) == Adaptive(min=2, max=8) and hash(Adaptive(2, 8)) == hash(
        Adaptive(min=2, max=8))
    assert {Adaptive(2, 8): "x"}[Adaptive(2, 8)] == "x"
    with pytest.raises(AttributeError):
        adaptive.max = 3  # frozen
    one = Adaptive(decrease_on=TimeoutError)
    assert one.decrease_on == (TimeoutError,) and hash(one)
    assert Adaptive(decrease_on=[TimeoutError, ConnectionError]).decrease_on == (
        TimeoutError, ConnectionError)
    assert Adaptive(increase=3).increase == 3.0 and isinstance(Adaptive(increase=3).increase,
                                                                 float)


@pytest.mark.parametrize("kwargs, problem", [
    ({"min": 0}, "min must be an integer from 1"),
    ({"min": 1.5}, "min must be an integer"),
    ({"min": True}, "min must be an integer"),
    ({"max": 100_001}, "max must be an integer from 1 to 100000"),
    ({"max": "64"}, "max must be an integer"),
    ({"min": 10, "max": 5}, r"min \(10\) must not be above max \(5\)"),
    ({"decrease": 1}, "decrease must be above 0 and below 1"),
    ({"decrease": 0}, "decrease must be above 0"),
    ({"decrease": 1.5}, "decrease must be above 0"),
    ({"decrease": float("nan")}, "decrease must be a finite number"),
    ({"decrease": "0.5"}, "decrease must be a finite number"),
    ({"increase": 0}, "increase must be above 0"),
    ({"increase": -1}, "increase must be above 0"),
    ({"increase": float("inf")}, "increase must be a finite number"),
    ({"decrease_on": ValueError("x")}, "decrease_on must be exception classes"),
    ({"decrease_on": [int]}, "decrease_on must be exception classes"),
])
def test_bad_adaptive_values_are_refused_at_construction(kwargs, problem):
    with pytest.raises(ConfigurationError, match=problem):
        Adaptive(**kwargs)


def test_outcomes():
    adaptive = Adaptive(decrease_on=(TimeoutError,))
    assert outcome_of(None, adaptive) == "ok"
    assert outcome_of(Backoff(), adaptive) == "overload"
    assert outcome_of(TimeoutError(), adaptive) == "overload"
    assert outcome_of(ValueError(), adaptive) == "error"
    assert outcome_of(TimeoutError()) == "error"  # no Adaptive: only a Backoff is overload
    assert adaptive.is_overload(Backoff(3)) and not adaptive.is_overload(None)


def test_the_pool_process_that_raised_it_closes_the_semaphore_and_the_gate_learns_so():
    """Where the task runs (a worker's pool process), a Backoff with a time closes the
    semaphore as the run ends, before its result travels to the gate; the mark survives the
    trip back (pickled, as billiard sends a task's exception) so the gate does not pause
    again. Without a time, or in an eager call, nothing is closed there."""
    from types import SimpleNamespace

    from billiard.einfo import ExceptionInfo
    from celery import Celery

    from celery_semaphore.backends import get_backend
    from celery_semaphore.task_lease import LEASE_KEY, pause_where_raised

    app = Celery("pool", set_as_current=False)
    app.conf.semaphore_backend = "memory://raised-here"
    backend = get_backend("memory://raised-here", key_prefix="bk:")
    header = {"name": "api:7", "limit": 2, "holder": "h1", "slot": 0, "epoch": 1, "ttl": 30.0,
              "backend": "memory://raised-here", "key_prefix": "bk:"}
    task = SimpleNamespace(app=app, request=SimpleNamespace(is_eager=False,
                                                            **{LEASE_KEY: header}))
    exc = Backoff(retry_after=20, reason="HTTP 429")
    pause_where_raised(task, exc)
    status = backend.status("api:7")
    assert exc.paused and status.pause_reason == "HTTP 429"
    assert time.time() + 19 < status.paused_until <= time.time() + 20
    try:
        raise exc
    except Backoff:
        info = ExceptionInfo()
    back = pickle.loads(pickle.dumps(info))
    assert isinstance(back.exception, Backoff) and back.exception.paused
    assert back.exception.at == exc.at  # the moment, not the time it was unpickled
    backend.resume("api:7")
    for not_here in (Backoff(), Backoff(retry_after=5)):
        eager = SimpleNamespace(app=app, request=SimpleNamespace(is_eager=True,
                                                                 **{LEASE_KEY: header}))
        pause_where_raised(eager if not_here.seconds else task, not_here)
        assert not not_here.paused and backend.status("api:7").paused_until is None
