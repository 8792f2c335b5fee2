"""Backoff and Adaptive values, and the options of quotas and units, checked where they are
written (no backend needed)."""
from datetime import datetime, timedelta, timezone

import requests
from requests.structures import CaseInsensitiveDict

import celery_semaphore
from celery_semaphore import Adaptive, Backoff, ConfigurationError


def retry_after_forms():
    # [forms-start]
    assert Backoff(retry_after=30).seconds == 30.0                      # seconds
    assert Backoff(retry_after=timedelta(minutes=2)).seconds == 120.0   # a timedelta
    assert Backoff(retry_after="120").seconds == 120.0                  # a Retry-After value
    soon = datetime.now(timezone.utc) + timedelta(seconds=60)
    assert 58 <= Backoff(retry_after=soon).seconds <= 60               # a datetime (naive: UTC)
    past = Backoff(retry_after="Wed, 21 Oct 2015 07:28:00 GMT")        # an HTTP-date
    assert past.seconds == 0.0                                          # in the past: 0
    assert Backoff().seconds is None                                    # no time: overload only
    for bad in (-1, "soon", "5s", float("nan")):
        try:
            Backoff(retry_after=bad)
        except ConfigurationError as exc:
            print("refused:", exc)
    # [forms-end]


def from_a_response():
    response = requests.Response()  # what requests.get(...) returns; httpx's works the same
    response.status_code = 429
    response.headers = CaseInsensitiveDict({"retry-after": "17"})
    # [response-start]
    exc = Backoff.from_response(response, default=10)  # Retry-After, whatever its case
    assert (exc.seconds, exc.reason) == (17.0, "HTTP 429")
    response.headers = CaseInsensitiveDict()  # no header (or one no RFC allows): the default
    assert Backoff.from_response(response, default=10).seconds == 10.0
    # [response-end]


def adaptive_values():
    # [adaptive-start]
    learned = Adaptive(min=1, max=64, decrease_on=(TimeoutError,))
    assert learned.limit == 64                     # what an acquire declares: max
    assert {learned: "frozen and hashable"}        # usable in semaphore_limits
    for bad in ({"min": 10, "max": 5}, {"max": 200_000}, {"decrease": 1.0}, {"min": 0}):
        try:
            Adaptive(**bad)
        except ConfigurationError as exc:
            print("refused:", exc)
    # [adaptive-end]


def options_refused_where_written():
    # [refused-start]
    for options in ({"semaphore_quota": "1000/hour"},           # periods: s m h d w mo
                    {"semaphore_quota_tz": "Europe/Pariss"},     # not an IANA zone
                    {"semaphore_rate": "10/s; 20/s"}):           # one period twice
        try:
            celery_semaphore.task(semaphore="api", **options)
        except ConfigurationError as exc:
            print("refused:", exc)
    # [refused-end]


if __name__ == "__main__":
    retry_after_forms()
    from_a_response()
    adaptive_values()
    options_refused_where_written()
