"""semaphore_quota, semaphore_quota_tz, several rates and semaphore_units: every accepted and
refused form, the meta they build (nothing new when unused), and where a bad value is refused
(the decorator, the settings at worker start). No server needed."""

from datetime import datetime, timezone

import pytest
from celery import Celery

from celery_semaphore import Adaptive, ConfigurationError, task
from celery_semaphore import traffic as t
from celery_semaphore.settings import Settings

JAN = datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc).timestamp()  # winter in Europe
JUL = datetime(2026, 7, 15, 12, 0, tzinfo=timezone.utc).timestamp()  # summer
SATURDAY = datetime(2026, 5, 9, 12, 0, tzinfo=timezone.utc).timestamp()


def make_app(**conf):
    app = Celery("quota_test", set_as_current=False)
    app.conf.update({"broker_url": "memory://", **conf})
    return app


def window_start(t_now, period, offset):
    """The backend's rule (backends/base.py, QUOTA_KEY), for a fixed period."""
    return (t_now + offset) // period * period - offset


@pytest.mark.parametrize("text, quotas", [
    ("1000/h", [(1000, 3600)]),
    ("1000/h; 20000/d", [(1000, 3600), (20000, 86400)]),
    (" 50 / 5s ;", [(50, 5)]),
    ("5/10m", [(5, 600)]),
    ("7/2d", [(7, 172800)]),
    ("3/w", [(3, 604800)]),
    ("90000/m; 1000000/mo", [(90000, 60), (1000000, 0)]),
    ("1/month", [(1, 0)]),
    ("1/1mo", [(1, 0)]),
    ("10/s", [(10, 1)]),
    ("1000000000000/d", [(10**12, 86400)]),
    ("1/366d", [(1, 366 * 86400)]),
])
def test_quotas_in_every_accepted_form(text, quotas):
    parsed = t.parse_quota(text)
    assert [(q.count, q.period) for q in parsed] == quotas
    assert t.parse_quota(None) is None


@pytest.mark.parametrize("value, problem", [
    ("", "count per period"), ("1000", "count per period"), (1000, "count per period"),
    ("1000/x", "unknown period 'x'"), ("1000/H", "count per period"),
    ("1000/M", "count per period"), ("1000/hour", "unknown period 'hour'"),
    ("1.5/h", "whole number"), ("0/h", "whole number from 1"), ("-5/h", "count per period"),
    ("1000000000001/d", "whole number from 1 to"), ("5/0s", "from 1 second"),
    ("5/367d", "from 1 second to 366 days"), ("5/2mo", "one calendar month"),
    ("1/h; 2/h", "two counts for one period"), ("1/h; 2/60m", r"\('1/h' and '2/60m'\)"),
    (";".join(["1/s"] * 9), "at most 8"),
    ("1/h;; x", "count per period"), (["1/h"], "count per period"),
])
def test_bad_quotas_are_refused_naming_the_option_and_value(value, problem):
    with pytest.raises(ConfigurationError, match=problem) as err:
        t.parse_quota(value)
    message = str(err.value)
    items = value.split(";") if isinstance(value, str) else []
    assert "semaphore_quota" in message
    assert repr(value) in message or any(repr(i.strip()) in message for i in items), message


@pytest.mark.parametrize("text, intervals", [
    ("10/s", (0.1,)), ("10/s; 500/m", (0.1, 0.12)), ("5/10s", (2.0,)), ("0.5/s", (2.0,)),
    ("20000/d", (4.32,)), ("1/w", (604800.0,)), ("30/m; 1000/h; 10000/d", (2.0, 3.6, 8.64)),
])
def test_several_rates_and_longer_periods(text, intervals):
    assert t.parse_rates(text) == pytest.approx(intervals)


@pytest.mark.parametrize("value, problem", [
    ("1/mo", "unknown period 'mo'"), ("0/s", "above 0"), ("2000000/s", "at most 1000000"),
    ("10/s; 5/s", "two counts for one period"), ("fast", "count per period"),
])
def test_bad_rates_are_refused(value, problem):
    with pytest.raises(ConfigurationError, match=problem):
        t.parse_rates(value)


def test_parse_rate_keeps_one_rate_and_refuses_several():
    assert t.parse_rate("20/s") == 0.05 and t.parse_rate(None) is None
    with pytest.raises(ConfigurationError, match="several rates where one is expected"):
        t.parse_rate("10/s; 500/m")


@pytest.mark.parametrize("text, tz, now, offset", [
    ("1/d", None, JAN, 0), ("1/d", "UTC", JUL, 0),
    ("1/d", "Europe/Paris", JAN, 3600), ("1/d", "Europe/Paris", JUL, 7200),
    ("1/d", "America/New_York", JAN, 86400 - 5 * 3600),  # -5 h, within [0, period)
    ("1/d", "Asia/Kolkata", JAN, 5 * 3600 + 1800),
    ("1/2d", "Europe/Paris", JAN, 3600),
    ("1/mo", "Europe/Paris", JUL, 7200), ("1/mo", "America/New_York", JAN, -5 * 3600),
    ("1/h", "Asia/Kolkata", JAN, 0), ("1/5s", "Europe/Paris", JAN, 0),
    ("1/25h", "Europe/Paris", JAN, 0),  # not whole days: UTC epoch-aligned
])
def test_offsets_follow_the_zone_at_declaration_for_days_weeks_and_months(text, tz, now,
                                                                          offset):
    (quota,) = t.parse_quota(text)
    assert quota.offset(tz, now) == offset


def test_windows_start_at_the_zones_midnight_and_weeks_on_monday():
    (day,) = t.parse_quota("1/d")
    start = window_start(JUL, 86400, day.offset("Europe/Paris", JUL))
    assert datetime.fromtimestamp(start, timezone.utc) == datetime(2026, 7, 14, 22, 0,
                                                                   tzinfo=timezone.utc)
    (week,) = t.parse_quota("1/w")
    start = window_start(SATURDAY, 604800, week.offset(None, SATURDAY))
    assert datetime.fromtimestamp(start, timezone.utc) == datetime(2026, 5, 4,
                                                                   tzinfo=timezone.utc)  # Monday
    start = window_start(SATURDAY, 604800, week.offset("Europe/Paris", SATURDAY))
    assert datetime.fromtimestamp(start, timezone.utc) == datetime(2026, 5, 3, 22, 0,
                                                                   tzinfo=timezone.utc)
    (five,) = t.parse_quota("1/5s")
    assert window_start(1_000_000_003, 5, five.offset("Europe/Paris")) % 5 == 0


def test_traffic_meta_is_unchanged_for_a_call_that_uses_none_of_the_new_options():
    assert t.traffic_meta() == {}
    assert t.traffic_meta(2, 3, (0.1, 1), 4) == {"cost": 2, "priority": 3, "rate": [0.1, 1],
                                                 "fair_weight": 4}
    assert t.traffic_meta(rates=[(0.1, 1)]) == {"rate": [0.1, 1]}  # one rate: as before
    assert t.traffic_meta(units=1, quota=None, quota_tz="Europe/Paris", adaptive=None) == {}


def test_traffic_meta_builds_the_new_keys():
    quotas = t.parse_quota("1000/h; 20000/d")
    meta = t.traffic_meta(rates=[(0.1, 1), (0.12, 5)], quota=quotas, quota_tz="Europe/Paris",
                          units=50, adaptive=Adaptive(2, 8), front=True, now=JUL)
    assert meta == {"rate": [[0.1, 1], [0.12, 5]], "quota": [[1000, 3600, 0], [20000, 86400, 7200]],
                    "units": 50, "adaptive": {"min": 2, "max": 8, "decrease": 0.9,
                                              "increase": 1.0}, "front": True}
    assert t.traffic_meta(rate=(1.0, 1), rates=[(2.0, 1)])["rate"] == [[1.0, 1], [2.0, 1]]
    assert (t.QUOTA_KEY, t.UNITS_KEY, t.FRONT_KEY, t.ADAPTIVE_KEY) == (
        "quota", "units", "front", "adaptive")


def test_options_used_names_what_backends_must_apply():
    assert t.options_used() == []
    assert t.options_used(quota="1/h", units=5, limit=Adaptive()) == ["quota", "units",
                                                                        "adaptive"]
    assert t.options_used(limit={"a": 3, "b": Adaptive()}) == ["adaptive"]
    assert t.options_used(rate="10/s; 500/m", units="{tokens}") == ["rate", "units"]
    settings = Settings(quota="1/h", units="{n}", limits={"x": Adaptive()})
    assert settings.options_used() == ["quota", "units", "adaptive"]
    assert Settings().options_used(limit=Adaptive()) == ["adaptive"]
    assert Settings().options_used(limit=4) == []


@pytest.mark.parametrize("value", [1, 50, 10**12, "{max_tokens}", "{req[max_tokens]}"])
def test_units_accepted(value):
    assert t.validate_units(value) == value


@pytest.mark.parametrize("value, problem", [
    (0, "from 1 to"), (-1, "from 1 to"), (10**12 + 1, "from 1 to"), (1.5, "an integer"),
    (True, "an integer"), ("max_tokens", "integer or a template"), ("{}", "must name"),
    ("{0}", "must name"), (None, "an integer"),
])
def test_bad_units_are_refused(value, problem):
    with pytest.raises(ConfigurationError, match=problem) as err:
        t.validate_units(value)
    assert "semaphore_units" in str(err.value)


def test_units_above_a_quota_could_never_start():
    quotas = t.parse_quota("100/m; 5000/d")
    assert t.validate_units(100, quotas=quotas) == 100
    with pytest.raises(ConfigurationError, match="semaphore_units 101 is above the quota "
                                                 "'100/m'"):
        t.validate_units(101, quotas=quotas)
    assert t.filled_units(" 42 ", "semaphore_units", quotas) == 42
    with pytest.raises(ConfigurationError, match="filled in to 'lots', not an integer"):
        t.filled_units("lots", "semaphore_units", quotas)
    with pytest.raises(ConfigurationError, match="above the quota"):
        t.filled_units("500", "semaphore_units", quotas)
    assert t.validate_settle_units(0) == 0
    with pytest.raises(ConfigurationError, match="units must be from 0"):
        t.validate_settle_units(-1)


@pytest.mark.parametrize("key, value", [
    ("semaphore_quota", "lots"), ("semaphore_quota", "5/2mo"), ("semaphore_quota", 5),
    ("semaphore_quota_tz", "Mars/Olympus_Mons"), ("semaphore_quota_tz", ""),
    ("semaphore_quota_tz", "../../etc/passwd"), ("semaphore_quota_tz", 1),
    ("semaphore_units", 0), ("semaphore_units", "tokens"), ("semaphore_rate", "10/s; 1/mo"),
    ("semaphore_limits", {"a": Adaptive, "b": 1}), ("semaphore_limits", {"a": "64"}),
])
def test_each_bad_setting_is_named_at_worker_start(key, value):
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(make_app(**{key: value}))
    assert key in str(err.value)


def test_units_and_quota_are_checked_together_in_settings_and_task_options():
    with pytest.raises(ConfigurationError, match="semaphore_units 200 is above the quota"):
        Settings.from_app(make_app(semaphore_quota="100/m", semaphore_units=200))
    settings = Settings.from_app(make_app(semaphore_quota="1000/m", semaphore_units=200,
                                          semaphore_quota_tz="Europe/Paris",
                                          semaphore_rate="10/s; 500/m",
                                          semaphore_limits={"api": Adaptive(1, 8), "db": 3}))
    assert (settings.quota, settings.units, settings.quota_tz) == ("1000/m", 200,
                                                                   "Europe/Paris")
    assert settings.limits == {"api": Adaptive(1, 8), "db": 3}

    class Task:
        name = "t"
        semaphore_quota = "150/m"

    with pytest.raises(ConfigurationError, match="t: semaphore_units 200 is above the quota"):
        settings.for_task(Task)


@pytest.mark.parametrize("options, problem", [
    ({"semaphore_quota": "1000/hour"}, "task option semaphore_quota"),
    ({"semaphore_quota": "0/h"}, "task option semaphore_quota"),
    ({"semaphore_quota_tz": "Nowhere/City"}, "task option semaphore_quota_tz"),
    ({"semaphore_units": -3}, "task option semaphore_units"),
    ({"semaphore_rate": "10/s; 20/s"}, "task option semaphore_rate"),
    ({"semaphore_quotas": "1/h"}, "did you mean semaphore_quota"),
])
def test_bad_task_options_are_refused_where_written(options, problem):
    with pytest.raises(ConfigurationError, match=problem):
        task(semaphore="x", **options)


def test_good_task_options_pass_the_decorator():
    @task(semaphore="llm", semaphore_quota="90000/m; 2000000/d", semaphore_units="{max_tokens}",
          semaphore_rate="10/s; 500/m", semaphore_quota_tz="America/New_York", shared=False)
    def call(prompt, max_tokens=50):
        return prompt

    assert call.semaphore_quota == "90000/m; 2000000/d"
