"""``celery semaphore pause`` and ``resume`` (output, JSON, exit codes, bad durations and
dates), and what ``status``, ``list``, ``top`` and the exporter show of pauses, quota windows
and learned limits. In-process (click's runner) against the memory backend through
:mod:`tests.upstream_double`, which stands in for the contract's new operations and status
fields where the backend lacks them."""

import json
import re
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from celery_semaphore.backends import get_backend
from celery_semaphore.cli import parse_duration, parse_moment, render_status, semaphore
from celery_semaphore.exceptions import ConfigurationError
from celery_semaphore.metrics import METRICS, Collector, Templates
from tests import servers
from tests.test_monitoring import families, samples, value
from tests.upstream_double import URL, AdaptiveState, ContractDouble, QuotaUsage, make_status

HOUR = 3600


@pytest.fixture
def backend():
    return get_backend(URL, key_prefix="semaphore:")


@pytest.fixture
def name():
    return f"api-{servers.unique_tag()}"


def run(*args, url=URL):
    result = CliRunner().invoke(semaphore, ["--backend", url, *args], catch_exceptions=False)
    return result


def one_line(result):
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 1 and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.mark.parametrize("text, seconds", [
    ("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400), ("2d", 172800),
    ("1w", 604800), ("500ms", 0.5), ("30", 30), ("2.5", 2.5), (" 1h 5m ", 3900),
])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10x", "m", "-5m", "0", "0s", "1e3", "ten minutes",
                                  "10m-", "١٠m", "inf", "nan"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_moments():
    noon = datetime(2026, 5, 9, 12, tzinfo=timezone.utc).timestamp()
    assert parse_moment("2026-05-09T12:00:00Z") == noon
    assert parse_moment("2026-05-09T14:00:00+02:00") == noon
    assert parse_moment("2026-05-09T12:00") == noon  # naive: UTC
    assert parse_moment("Sat, 09 May 2026 12:00:00 GMT") == noon
    assert parse_moment("Sat May  9 12:00:00 2026") == noon
    for bad in ("tomorrow", "12:00", "2026-02-30T00:00:00Z", "Sat, 09 May 2026 12:00:00"):
        with pytest.raises(ValueError):
            parse_moment(bad)


def test_pause_for_then_a_shorter_pause_is_kept_then_resume(backend, name):
    done = run("pause", name, "--for", "10m", "--reason", "HTTP 429 from partner")
    assert done.exit_code == 0, done.output
    assert re.fullmatch(rf"paused semaphore '{name}' until \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d "
                        r"UTC \(in 10m\): HTTP 429 from partner\n", done.stdout), done.stdout
    status = backend.status(name)
    assert 590 < status.paused_until - time.time() <= 600
    assert status.pause_reason == "HTTP 429 from partner"
    pause = [c for c in backend.calls if c[:2] == ("pause", name)]
    assert len(pause) == 1 and 599 < pause[0][2] <= 600

    shorter = run("pause", name, "--for", "1m", "--json")
    assert shorter.exit_code == 0, shorter.output
    data = json.loads(shorter.stdout)
    assert data["kept"] is True and data["paused_until"] == status.paused_until
    assert data["name"] == name and data["seconds"] == 60.0
    human = run("pause", name, "--for", "30s")
    assert "stays paused until" in human.stdout and "a pause ending later was in force" in \
        human.stdout

    resumed = run("resume", name)
    assert resumed.exit_code == 0 and resumed.stdout == f"resumed semaphore '{name}'\n"
    again = run("resume", name, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout) == {"name": name,
                                                                 "resumed": False}
    assert run("resume", name).stdout == f"semaphore '{name}' was not paused\n"
    assert getattr(backend.status(name), "paused_until", None) is None


def test_pause_until_an_iso_time_or_an_http_date(backend, name):
    soon = datetime.now(timezone.utc) + timedelta(minutes=5)
    done = run("pause", name, "--until", soon.strftime("%Y-%m-%dT%H:%M:%SZ"), "--json")
    assert done.exit_code == 0, done.output
    assert 280 < json.loads(done.stdout)["seconds"] <= 300
    later = soon + timedelta(hours=1)
    done = run("pause", name, "--until", format_datetime(later, usegmt=True), "--json")
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["kept"] is False and abs(data["paused_until"] - later.timestamp()) < 2
    naive = (soon + timedelta(hours=2)).replace(tzinfo=None).isoformat(timespec="seconds")
    done = run("pause", name, "--until", naive, "--json")  # no offset: UTC
    assert abs(json.loads(done.stdout)["paused_until"] - (soon.timestamp() + 7200)) < 2
    run("resume", name)


@pytest.mark.parametrize("args, problem", [
    ((), "pass one of --for DURATION or --until TIME"),
    (("--for", "10m", "--until", "2999-01-01T00:00:00Z"), "pass one of --for"),
    (("--for", "10x"), "'10x' is not a duration"),
    (("--for", "0"), "must be above 0"),
    (("--for", "-5m"), "is not a duration"),
    (("--until", "yesterday"), "'yesterday' is neither an ISO 8601 time"),
    (("--until", "2020-01-01T00:00:00Z"), "is in the past"),
    (("--until", "Wed, 21 Oct 2015 07:28:00 GMT"), "is in the past"),
])
def test_bad_pause_arguments_are_usage_errors_that_change_nothing(backend, name, args,
                                                                  problem):
    done = run("pause", name, *args)
    assert done.exit_code == 2, done.output
    assert problem in done.stderr and "Usage:" in done.stderr
    assert not [c for c in backend.calls if c[:2] == ("pause", name)]


def test_bad_names_are_usage_errors():
    for command in (("pause", "bad name", "--for", "1m"), ("resume", "a/b")):
        done = run(*command)
        assert done.exit_code == 2 and "Invalid value for 'NAME'" in done.stderr


class Refusing(ContractDouble):
    """A backend that lacks "pause" in its traffic options (as RabbitMQ and Consul)."""

    def pause(self, name, seconds, reason=""):
        raise ConfigurationError(f"pause: the Refusing backend ({self.url}) cannot apply it")

    def resume(self, name):
        raise ConfigurationError(f"resume: the Refusing backend ({self.url}) cannot apply it")


def test_a_backend_that_cannot_pause_is_one_error_line_exit_1(name):
    url = "tests.test_cli_upstream:Refusing"
    for command in (("pause", name, "--for", "1m"), ("resume", name)):
        done = run(*command, url=url)
        assert done.exit_code == 1, done.output
        assert one_line(done).startswith("Error: ") and "Refusing backend" in done.stderr


def fill(backend, name, limit=4, holders=1):
    for i in range(holders):
        backend.acquire(name, f"h{i}", limit=limit, ttl=60, meta={}, wait=False)


def test_status_and_list_show_the_pause_quota_windows_and_the_learned_limit(backend, name):
    now = time.time()
    fill(backend, name, holders=2)
    run("pause", name, "--for", "45s", "--reason", "HTTP 429")
    start = now // HOUR * HOUR
    backend.extra[name] = {
        "quotas": (QuotaUsage(count=1000, period=HOUR, offset=0, window_start=start,
                              window_end=start + HOUR, used=812),
                   QuotaUsage(count=20000, period=0, offset=3600, window_start=now - 10,
                              window_end=now + 86400 * 3, used=20040)),
        "adaptive": AdaptiveState(min=1, max=64, current=3.7, pinned=False),
        "rates": ((0.1, 1), (0.12, 5)), "rate": (0.1, 1)}
    shown = run("status", name)
    assert shown.exit_code == 0, shown.output
    text = shown.stdout
    assert re.search(r"^  PAUSED    until \d{4}-.* UTC \(in 4[45]s\): HTTP 429; `resume` lifts "
                     r"it$", text, re.M), text
    assert re.search(r"^  limit     4 \(learned 3\.7 within 1\.\.64\)$", text, re.M), text
    assert re.search(r"^  rates     10/s, burst 1; 500/m, burst 5; next start now$", text,
                     re.M), text
    assert re.search(r"^  quota     812 of 1000 per h, window ends in \d+[sm] \(.* UTC\)$", text,
                     re.M), text
    assert re.search(r"^            20040 of 20000 per mo \(over by 40: later starts wait for "
                     r"the next window\), window ends in 3d", text, re.M), text
    data = json.loads(run("status", name, "--json").stdout)
    assert data["pause_reason"] == "HTTP 429" and data["paused_until"] > now + 40
    assert [q["used"] for q in data["quotas"]] == [812, 20040]

    listed = run("list")
    header = listed.stdout.splitlines()[0].split()
    assert header[-2:] == ["PAUSED", "QUOTA"], listed.stdout
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert re.search(r" 4~ .*in 4[45]s \(HTTP 429\) +812/1000/h 20040/20000/mo$", row), row
    assert "~: a learned (adaptive) limit" in listed.stdout
    rows = {r["name"]: r for r in json.loads(run("list", "--json").stdout)}
    assert rows[name]["pause_reason"] == "HTTP 429"
    assert rows[name]["adaptive"] == {"min": 1, "max": 64, "current": 3.7, "pinned": False}
    assert rows[name]["quotas"][0] == {"window": "h", "count": 1000, "used": 812,
                                       "window_start": start, "window_end": start + HOUR}
    run("resume", name)


@pytest.mark.parametrize("interval, text", [
    (0.1, "10/s"), (0.12, "500/m"), (0.05, "20/s"), (2.0, "30/m"), (120.0, "30/h"),
    (4.32, "20000/d"), (0.4, "150/m"), (604800.0, "1/w"), (1 / 3, "3/s"),
])
def test_rates_are_shown_as_written(interval, text):
    from celery_semaphore.metrics import rate_text

    assert rate_text(interval) == text


def test_render_status_of_a_pinned_learned_limit_and_a_semaphore_without_any_of_it():
    now = time.time()
    pinned = make_status("x", 5, adaptive=AdaptiveState(min=2, max=8, current=5.0,
                                                        pinned=True), pinned=True)
    assert "limit     5 (learned 5 within 2..8; pinned by resize: learning stopped)" in \
        render_status(pinned, now)
    plain = render_status(make_status("y", 3), now)
    assert "PAUSED" not in plain and "quota" not in plain and "learned" not in plain
    ending = render_status(make_status("z", 1, paused_until=now - 1), now)
    assert "(ending now)" in ending


def test_list_without_pauses_or_quotas_keeps_its_columns(backend, name):
    fill(backend, name)
    header = run("list").stdout.splitlines()[0].split()
    others = [r for r in json.loads(run("list", "--json").stdout)
              if r["paused_until"] or r["quotas"]]
    if not others:  # another test's semaphore in the shared store may show them
        assert header == ["NAME", "LIMIT", "PINNED", "DECLARED", "HELD", "UNITS", "WAITING",
                          "PARKED"]


def test_top_shows_paused_quota_and_learned_columns(backend, name):
    now = time.time()
    fill(backend, name)
    run("pause", name, "--for", "2m", "--reason", "maintenance")
    backend.extra[name] = {
        "quotas": (QuotaUsage(count=100, period=60, offset=0, window_start=now // 60 * 60,
                              window_end=now // 60 * 60 + 60, used=90),),
        "adaptive": AdaptiveState(min=1, max=64, current=6.2, pinned=False)}
    done = run("top", "--once", "--interval", "0", "--filter", name)
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("NAME"))
    assert header.split()[-2:] == ["PAUSED", "QUOTA"]
    row = next(line for line in lines if line.startswith(name))
    assert re.search(r"^\S+ +4~ .* 1[012]\d\.\ds +90 of 100/m$", row), row
    assert "~: a learned (adaptive) limit" in done.stdout
    data = json.loads(run("top", "--json", "--interval", "0", "--filter", name).stdout)
    (row,) = data["semaphores"]
    assert row["paused"] == 1 and row["pause_reason"] == "maintenance"
    assert 100 < row["paused_until_in_s"] <= 120
    assert row["quotas"][0]["window"] == "m" and row["quotas"][0]["used"] == 90
    assert row["adaptive"] == {"min": 1, "max": 64, "current": 6.2, "pinned": False}
    run("resume", name)


def scrape(collector):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_the_exporter_serves_pauses_quota_windows_and_learned_limits():
    backend = ContractDouble(f"memory://{servers.unique_tag()}")
    now = time.time()
    for key in ("api:1", "api:2", "api:3"):
        fill(backend, key)
    fill(backend, "plain")
    backend.pause("api:1", 30, "HTTP 429")
    backend.pause("api:2", 90, "HTTP 503")
    backend.pause("plain", 10, "")
    start = now // HOUR * HOUR
    for key, used in (("api:1", 10), ("api:2", 30)):
        backend.extra[key] = {"quotas": (QuotaUsage(count=100, period=HOUR, offset=0,
                                                    window_start=start,
                                                    window_end=start + HOUR, used=used),),
                              "adaptive": AdaptiveState(min=1, max=8, current=2.5,
                                                        pinned=key == "api:2")}
    backend.extra["plain"] = {"quotas": (QuotaUsage(count=5, period=5, offset=0,
                                                    window_start=now // 5 * 5,
                                                    window_end=now // 5 * 5 + 5, used=7),)}
    text = scrape(Collector(backend, Templates(["api:{customer_id}"])))
    assert families(text) == set(METRICS) - {"celery_semaphore_broker_up"}  # no broker
    parsed = samples(text)
    api = {"semaphore": "api:{customer_id}", "template": "api:{customer_id}"}
    plain = {"semaphore": "plain", "template": ""}
    assert value(parsed, "celery_semaphore_paused", **api) == 2
    assert value(parsed, "celery_semaphore_paused", **plain) == 1
    assert 80 < value(parsed, "celery_semaphore_paused_until_seconds", reason="HTTP 503",
                      **api) <= 90  # the latest key's
    assert 0 < value(parsed, "celery_semaphore_paused_until_seconds", reason="", **plain) <= 10
    assert value(parsed, "celery_semaphore_quota_used", window="h", **api) == 40  # summed
    assert value(parsed, "celery_semaphore_quota_limit", window="h", **api) == 200
    assert 0 <= value(parsed, "celery_semaphore_quota_window_end_seconds", window="h",
                      **api) <= HOUR
    assert value(parsed, "celery_semaphore_quota_used", window="5s", **plain) == 7  # a debt
    assert value(parsed, "celery_semaphore_quota_limit", window="5s", **plain) == 5
    assert value(parsed, "celery_semaphore_adaptive_limit", **api) == 5.0
    assert value(parsed, "celery_semaphore_adaptive_pinned", **api) == 1
    assert value(parsed, "celery_semaphore_adaptive_limit", **plain) is None  # not learned
    backend.resume("plain")
    parsed = samples(scrape(Collector(backend, Templates(["api:{customer_id}"]))))
    assert value(parsed, "celery_semaphore_paused", **plain) == 0
    assert not [k for k in parsed if k[0] == "celery_semaphore_paused_until_seconds"
                and ("semaphore", "plain") in k[1]]


def test_workers_say_a_request_waits_for_the_quota_or_a_pause():
    from celery_semaphore.cli import render_workers

    waiting = [{"semaphore": "llm", "id": "t1", "queued": True, "position": 0,
                "waits_for": "quota", "waited": 2.0},
               {"semaphore": "api", "id": "t2", "queued": True, "position": 3,
                "waits_for": "pause", "waited": 1.0}]
    text = render_workers({"w1@host": {"held": [], "waiting": waiting}})
    assert "position 0 at its last try, waiting for the quota's next window" in text
    assert "position 3 at its last try, paused" in text
