"""Limits per customer (issue #36, item 5): a task's ``limit=`` as a function of its
arguments, cached per key; ``semaphore_limits`` patterns over a template's keys; Adaptive
limits; each checked where it is written."""

import pytest
from celery import Celery

import celery_semaphore
from celery_semaphore import Adaptive, ConfigurationError
from celery_semaphore.guards import Guards
from celery_semaphore.limit_sources import LimitFunctions
from celery_semaphore.settings import Settings


def make_app(**conf):
    app = Celery("limits-test", broker="memory://")
    app.conf.semaphore_backend = "memory://limits-test"
    app.conf.update(conf)
    celery_semaphore.install(app)
    app.finalize()  # tasks made from now on are made (and checked) at once
    return app


def guard_of(app, task, *args, **kwargs):
    return Guards(Settings.from_app(app)).resolve_call(task, args, kwargs, {})


def test_a_limit_from_a_function_of_the_arguments_per_key_and_cached():
    calls = []

    def plan_limit(customer_id, plan="free", **_):
        calls.append(customer_id)
        return {"free": 1, "pro": 5}[plan] if customer_id != "vip" else Adaptive(min=2, max=20)

    app = make_app()

    @app.task(semaphore="api:{customer_id}", limit=plan_limit, shared=False)
    def call_api(customer_id, plan="free", payload=None):
        pass

    guards = Guards(Settings.from_app(app))
    assert guards.resolve_call(call_api, ("c1",), {}, {}).limit == 1
    assert guards.resolve_call(call_api, ("c2", "pro"), {}, {}).limit == 5
    assert guards.resolve_call(call_api, ("c1",), {"payload": 3}, {}).limit == 1
    assert calls == ["c1", "c2"]  # c1's limit was remembered
    vip = guards.resolve_call(call_api, ("vip",), {}, {})
    assert vip.limit == 20 and vip.adaptive == Adaptive(min=2, max=20)
    assert vip.traffic_meta()["adaptive"]["min"] == 2


def test_a_limit_function_that_fails_fails_that_call_alone_naming_it():
    def bad(customer_id):
        if customer_id == "boom":
            raise KeyError("no plan")
        return 0 if customer_id == "zero" else 2

    app = make_app()

    @app.task(semaphore="api:{customer_id}", limit=bad, shared=False)
    def call_api(customer_id):
        pass

    guards = Guards(Settings.from_app(app))
    with pytest.raises(ConfigurationError, match=r"limit function .*bad failed for semaphore "
                                                 r"'api:boom': KeyError"):
        guards.resolve_call(call_api, ("boom",), {}, {})
    with pytest.raises(ConfigurationError, match=r"'api:zero'.*bad returned"):
        guards.resolve_call(call_api, ("zero",), {}, {})
    assert guards.resolve_call(call_api, ("fine",), {}, {}).limit == 2


def test_the_function_is_called_again_once_its_ttl_passed():
    now = [0.0]
    functions = LimitFunctions(clock=lambda: now[0])
    answers = iter([3, 7])
    value = functions.value(lambda customer_id: next(answers), "t", "api:1",
                            {"customer_id": 1, "other": 2}, ttl=60)
    assert value == 3
    now[0] = 59.0
    assert functions.value(lambda customer_id: 99, "t", "api:1", {"customer_id": 1}, 60) == 3
    now[0] = 61.0
    assert functions.value(lambda customer_id: next(answers), "t", "api:1",
                           {"customer_id": 1}, 60) == 7


def test_patterns_in_semaphore_limits_match_a_templates_keys_in_order():
    app = make_app(semaphore_limits={"api:vip": 50, "api:premium-*": 10, "api:*-trial": 1,
                                     "api:{customer_id}": 3})

    @app.task(semaphore="api:{customer_id}", limit=2, shared=False)
    def call_api(customer_id):
        pass

    assert guard_of(app, call_api, "vip").limit == 50  # the key itself first
    assert guard_of(app, call_api, "premium-acme").limit == 10
    assert guard_of(app, call_api, "premium-trial").limit == 10  # the first pattern decides
    assert guard_of(app, call_api, "x-trial").limit == 1
    assert guard_of(app, call_api, "other").limit == 3  # then the template's entry


def test_limits_are_checked_where_they_are_written():
    app = make_app()
    with pytest.raises(ConfigurationError, match="limit"):
        app.task(semaphore="s", limit="5", shared=False)(guard_of)
    with pytest.raises(ConfigurationError, match="min"):
        Adaptive(min=10, max=5)
    with pytest.raises(ConfigurationError, match="pattern 'api:pre mium-\\*'"):
        Settings.from_app(make_app(semaphore_limits={"api:pre mium-*": 3}))
    with pytest.raises(ConfigurationError, match="api:\\*"):
        Settings.from_app(make_app(semaphore_limits={"api:*": 0}))
    adaptive = make_app(semaphore_limits={"api:*": Adaptive(min=1, max=8)})

    @adaptive.task(semaphore="api:{c}", shared=False)
    def learned(c):
        pass

    assert guard_of(adaptive, learned, "x").adaptive == Adaptive(min=1, max=8)


def test_an_adaptive_limit_is_for_the_first_semaphore_only():
    app = make_app()

    @app.task(semaphore=["global", "api:{c}"], limit={"api:{c}": Adaptive(min=1, max=4)},
              shared=False)
    def two(c):
        pass

    with pytest.raises(ConfigurationError, match="first semaphore"):
        guard_of(app, two, "x")
