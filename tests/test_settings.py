"""Settings validation, task options and name templates (no server needed)."""

import os

import pytest
from celery import Celery

from celery_semaphore import ConfigurationError, InvalidName, Semaphore, install, task
from celery_semaphore.backends import get_backend
from celery_semaphore.guards import Guards
from celery_semaphore.settings import Settings
from celery_semaphore.urls import mask_url

MALFORMED_URLS = [
    ("redis://:S3cretPW@127.0.0.1:99999/0", "Port out of range"),
    ("redis://:S3cretPW@127.0.0.1:-1/0", "Port could not be cast"),
    ("redis://:S3cretPW@127.0.0.1:port/0", "Port could not be cast"),
    ("redis://:S3cretPW@[::1/0", "Invalid IPv6 URL"),
    ("amqp://guest:S3cretPW@127.0.0.1:99999//", "Port out of range"),
    ("sqlite://:S3cretPW@/x.db", "names no file"),
    ("redis://:S3cretPW@127.0.0.1:6379/abc", "must be a database number, not 'abc'"),
    ("", "must be a non-empty string"),
]


def make_app(**conf):
    app = Celery("settings_test", set_as_current=False)
    app.conf.update({"broker_url": "memory://", **conf})
    return app


@pytest.mark.parametrize("key,value", [
    ("semaphore_lease_ttl", -1), ("semaphore_lease_ttl", "60"), ("semaphore_lease_ttl", True),
    ("semaphore_poll_interval", 0), ("semaphore_retry_backoff", float("inf")),
    ("semaphore_max_wait", -3), ("semaphore_default_limit", 0),
    ("semaphore_default_limit", 2.5), ("semaphore_limits", {"a": 0}),
    ("semaphore_limits", {"bad name": 2}), ("semaphore_limits", [("a", 1)]),
    ("semaphore_on_lost_lease", "explode"), ("semaphore_retry_jitter", "yes"),
    ("semaphore_backend", "nosuch://x"), ("semaphore_key_prefix", ""),
    ("semaphore_worker_max_waiting", -1), ("semaphore_worker_max_hold", 0),
    ("semaphore_worker_lookahead", -1), ("semaphore_worker_lookahead", True),
    ("semaphore_worker_lookahead", "2"), ("semaphore_worker_lookahead", 1001),
    ("semaphore_on_full", "drop"), ("semaphore_on_full", 3),
    ("semaphore_fair_by", "tenant"), ("semaphore_fair_by", "{0}"), ("semaphore_fair_by", 7),
])
def test_each_bad_setting_is_named(key, value):
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(make_app(**{key: value}))
    assert key in str(err.value)


def test_backoff_max_below_backoff_is_refused():
    with pytest.raises(ConfigurationError, match="semaphore_retry_backoff_max"):
        Settings.from_app(make_app(semaphore_retry_backoff=5, semaphore_retry_backoff_max=1))


def test_django_namespace_names_the_setting_as_written():
    app = Celery("ns", set_as_current=False)
    app.config_from_object({"CELERY_BROKER_URL": "memory://", "CELERY_SEMAPHORE_LEASE_TTL": 5,
                            "CELERY_SEMAPHORE_MAX_WAIT": "soon"}, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="CELERY_SEMAPHORE_MAX_WAIT"):
        Settings.from_app(app)


def test_django_namespace_reads_values():
    app = Celery("ns2", set_as_current=False)
    app.config_from_object({"CELERY_BROKER_URL": "memory://",
                            "CELERY_SEMAPHORE_LEASE_TTL": 5}, namespace="CELERY")
    assert Settings.from_app(app).lease_ttl == 5.0


def test_default_backend_follows_the_broker():
    assert Settings().backend_url(make_app(broker_url="redis://h:1/2")) == "redis://h:1/2"
    assert Settings().backend_url(make_app(broker_url="amqp://u:p@h//")) == "amqp://u:p@h//"
    assert Settings().backend_url(
        make_app(broker_url="pyamqp://a//;pyamqp://b//")) == "pyamqp://a//"
    assert Settings().backend_url(make_app(broker_url="filesystem://")).startswith("sqlite://")
    assert Settings(backend="memory://x").backend_url(make_app()) == "memory://x"
    assert Settings().backend_url(make_app(broker_url="sqla+sqlite:///b.db")).startswith(
        "sqlite://")


@pytest.mark.parametrize("broker", ["sqs://", "sentinel://h:26379", "kafka://h:9092",
                                    "sqla+postgresql://h/db"])
def test_a_shared_broker_the_backend_cannot_follow_is_refused_not_made_per_host(broker):
    with pytest.raises(ConfigurationError) as err:
        Settings().backend_url(make_app(broker_url=broker))
    assert "semaphore_backend" in str(err.value)
    # The result backend serves when it is a Redis URL.
    app = make_app(broker_url=broker, result_backend="redis://h:1/3")
    assert Settings().backend_url(app) == "redis://h:1/3"


class FakeRequest:
    def __init__(self, task, args=(), kwargs=None, headers=None):
        self.task, self.args, self.kwargs = task, args, kwargs or {}
        self.request_dict = headers or {}


def test_templates_fill_from_arguments_and_defaults():
    app = make_app(semaphore_limits={"api:7": 9})
    install(app)

    @app.task(semaphore="api:{customer_id}:{region}", limit=2, shared=False)
    def call(customer_id, region="eu"):
        pass

    guards = Guards(Settings.from_app(app))
    guard = guards.resolve(FakeRequest(call, (3,)))
    assert (guard.name, guard.limit) == ("api:3:eu", 2)
    assert guards.resolve(FakeRequest(call, (), {"customer_id": 4, "region": "us"})).name \
        == "api:4:us"
    with pytest.raises(ConfigurationError, match="customer_id"):
        guards.resolve(FakeRequest(call, ()))
    with pytest.raises(InvalidName):
        guards.resolve(FakeRequest(call, ("a b",)))
    # per-call header override, and semaphore_limits by resolved name
    assert guards.resolve(FakeRequest(call, (1,), headers={"semaphore": "other"})).name \
        == "other"
    assert guards.resolve(FakeRequest(call, (7,), headers={"semaphore": "api:7"})).limit == 9


def _slow_arguments(run, args, kwargs):
    """What a call binds to, the plain ``inspect`` way (``**kwargs`` spread), or the
    TypeError it raises."""
    import inspect

    signature = inspect.signature(run)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        return exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


def _plain(a, b=2):
    pass


def _spread(a, b=2, **kw):
    pass


def _star(a, *more, b=3):
    pass


def _keyword_only(a, *, b=3):
    pass


def _positional_only(a, /, b=2):
    pass


@pytest.mark.parametrize("run", [_plain, _spread, _star, _keyword_only, _positional_only],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("args, kwargs", [
    ((1,), {}), ((1, 5), {}), ((), {"a": 1}), ((), {"b": 4}), ((1,), {"b": 4}),
    ((1, 2, 3), {}), ((1,), {"a": 9}), ((1,), {"c": 7}), ((), {"a": 1, "kw": 8}),
    ((), {}), ((1, 5), {"b": 6}),
])
def test_a_call_binds_as_its_signature_binds_it(run, args, kwargs):
    """Guards fill templates from a call's arguments with a binding of their own for a
    signature of positional-or-keyword parameters and ``**kwargs`` (bind_partial is most of
    a template's cost per call): every call binds as ``inspect`` binds it, and one that does
    not bind fails with the error ``inspect`` gives."""

    class FakeTask:
        name = f"fake.{run.__name__}"

    FakeTask.run = staticmethod(run)
    guards = Guards(Settings.from_app(make_app()))
    expected = _slow_arguments(run, args, kwargs)
    for _ in range(2):  # the binding is built at the first call, used at the second
        if isinstance(expected, TypeError):
            with pytest.raises(ConfigurationError) as caught:
                guards.arguments(FakeTask, args, kwargs)
            assert str(caught.value) == f"task {FakeTask.name}: cannot fill its semaphore: " \
                f"{expected}"
        else:
            assert guards.arguments(FakeTask, args, kwargs) == expected


def test_a_templated_guard_is_built_once_per_key_and_a_call_header_still_counts(monkeypatch):
    from celery_semaphore import guards as guards_module

    app = make_app(semaphore_limits={"api:7": 9})
    install(app)

    @app.task(semaphore="api:{customer_id}", limit=2, shared=False)
    def call(customer_id, payload=None):
        pass

    guards = Guards(Settings.from_app(app))
    first = guards.resolve(FakeRequest(call, (3,)))
    assert guards.resolve(FakeRequest(call, (), {"customer_id": 3, "payload": 1})) is first
    assert (first.name, first.limit) == ("api:3", 2)
    seven = guards.resolve(FakeRequest(call, (7,)))
    assert (seven.name, seven.limit) == ("api:7", 9) and seven is not first
    assert guards.resolve(FakeRequest(call, (3,), headers={"semaphore_limit": 5})).limit == 5
    assert guards.resolve(FakeRequest(call, (3,), headers={"semaphore_cost": 2})).cost == 2
    assert guards.resolve(FakeRequest(call, (3,))) is first  # the headers changed nothing kept
    with pytest.raises(InvalidName):  # a bad name is never kept: it fails every time
        guards.resolve(FakeRequest(call, ("a b",)))
    with pytest.raises(InvalidName):
        guards.resolve(FakeRequest(call, ("a b",)))
    monkeypatch.setattr(guards_module, "MAX_KEYED_GUARDS", 3)
    for customer in range(10):
        assert guards.resolve(FakeRequest(call, (customer,))).name == f"api:{customer}"
    assert len(guards._keyed) <= 3


def test_a_task_of_an_app_not_finalized_yet_keeps_its_declared_limit():
    """``@app.task`` before the app is finalized gives a PromiseProxy: its ``limit`` option is
    read from the task behind it (before: the proxy hid it and the default limit, 1, applied
    silently, depending on whether anything had finalized the app)."""
    from celery.local import PromiseProxy

    app = make_app()
    install(app)

    @app.task(semaphore="api:{customer_id}", limit=2, shared=False)
    def call(customer_id):
        pass

    assert isinstance(call, PromiseProxy) and not app.finalized
    guards = Guards(Settings.from_app(app))
    assert guards.resolve_call(call, (3,), {}, {}).limit == 2
    assert guards.resolve(FakeRequest(call, (4,))).limit == 2
    app.finalize()
    assert Guards(Settings.from_app(app)).resolve(FakeRequest(app.tasks[call.name], (5,))).limit \
        == 2


def test_the_fair_key_fills_from_the_call_and_a_missing_argument_is_named():
    app = make_app(semaphore_backend="memory://fair")
    install(app)

    @app.task(semaphore="api", limit=2, semaphore_fair_by="{customer.id}", shared=False)
    def call(customer, payload=None):
        pass

    class Customer:
        id = "c-42"

    guards = Guards(Settings.from_app(app))
    assert guards.resolve_call(call, (Customer(),), {}, {}).fair == "c-42"
    with pytest.raises(ConfigurationError, match="semaphore_fair_by '{customer.id}' needs"):
        guards.resolve_call(call, (), {"payload": 1}, {})


def test_several_semaphores_resolve_with_a_limit_each():
    """A list of names/templates; ``limit`` an int for all or a dict by template; the
    ``semaphore_limits`` setting first; templates filling in to one name count once."""
    app = make_app(semaphore_limits={"api:7": 9}, semaphore_default_limit=3)
    install(app)

    @app.task(semaphore=["api", "api:{customer_id}"], limit={"api": 10}, shared=False)
    def call(customer_id):
        pass

    @app.task(semaphore=["api", "api:{customer_id}"], limit=4, shared=False)
    def same(customer_id):
        pass

    @app.task(semaphore=["x:{a}", "x:{b}"], limit=2, shared=False)
    def twice(a, b):
        pass

    guards = Guards(Settings.from_app(app))
    guard = guards.resolve(FakeRequest(call, (3,)))
    assert guard.multi and guard.pairs == (("api", 10), ("api:3", 3))  # default for the rest
    assert guard.names == ("api", "api:3") and (guard.name, guard.limit) == ("api", 10)
    assert guards.resolve(FakeRequest(call, (7,))).pairs == (("api", 10), ("api:7", 9))
    assert guards.resolve(FakeRequest(same, (1,))).pairs == (("api", 4), ("api:1", 4))
    assert guards.resolve(FakeRequest(twice, (1, 2))).names == ("x:1", "x:2")
    one = guards.resolve(FakeRequest(twice, (1, 1)))
    assert not one.multi and one.pairs == (("x:1", 2),)
    with pytest.raises(ConfigurationError, match="customer_id"):
        guards.resolve(FakeRequest(call, ()))


def test_an_eager_call_under_several_semaphores_holds_them_all():
    app = make_app(semaphore_backend="memory://eager-multi", task_always_eager=True)
    install(app)
    from celery_semaphore import current_lease, current_leases

    seen = {}

    @app.task(semaphore=["all", "one:{n}"], limit={"all": 2, "one:{n}": 1}, shared=False)
    def body(n):
        leases = current_leases()
        seen.update({name: (lease.limit, lease.verify(), str(lease.token))
                     for name, lease in leases.items()})
        assert current_lease().name == "all" and current_lease("one:5").name == "one:5"
        assert current_lease("nope") is None
        return len({lease.holder for lease in leases.values()})

    assert body.delay(5).get() == 1  # one holder id in both
    assert {name: held for name, (_, held, _) in seen.items()} == {"all": True, "one:5": True}
    assert seen["all"][0] == 2 and seen["one:5"][0] == 1
    backend = get_backend("memory://eager-multi", key_prefix="semaphore:")
    assert backend.status("all").held == 0 and backend.status("one:5").held == 0


def test_unguarded_task_has_no_guard():
    app = make_app()

    @app.task(shared=False)
    def plain():
        pass

    assert Guards(Settings.from_app(app)).resolve(FakeRequest(plain)) is None


def test_task_decorator_checks_options():
    with pytest.raises(ConfigurationError):
        task(semaphore="has space", limit=1)(lambda: None)
    with pytest.raises(ConfigurationError):
        task(semaphore="x", limit=0)(lambda: None)
    with pytest.raises(ConfigurationError):
        task(semaphore="x:{unclosed", limit=1)(lambda: None)


BAD_OPTIONS = [
    ({"semaphore": "s", "limit": 0}, "limit must be a positive integer, not 0"),
    ({"semaphore": "s", "limit": "two"}, "not 'two'"),
    ({"semaphore": "bad name!"}, "contains ' '"),
    ({"semaphore": "s", "semaphore_lease_tl": 5}, "did you mean semaphore_lease_ttl?"),
    ({"semaphore": "s", "semaphore_max_wait": -1}, "semaphore_max_wait"),
    ({"semaphore": "s", "semaphore_on_full": "skipp"},
     "semaphore_on_full must be one of 'wait', 'skip', 'fail', not 'skipp'"),
    ({"semaphore": [], "limit": 1}, "semaphore must list at least one semaphore"),
    ({"semaphore": ["api", "api"]}, "lists a semaphore twice"),
    ({"semaphore": ["api", "bad name"]}, "contains ' '"),
    ({"semaphore": ["api", 7]}, "semaphore must be a string, not 7"),
    ({"semaphore": ["api", "api:{c}"], "limit": {"api:{x}": 2}},
     "limit names 'api:{x}', which semaphore does not list"),
    ({"semaphore": ["api", "api:{c}"], "limit": {"api": 0}}, "limit of 'api'"),
    ({"semaphore": "api", "limit": {"other": 2}}, "limit names 'other'"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_app_task_refuses_bad_options_where_they_are_written(options, message):
    """On an installed app, ``@app.task(...)`` itself refuses them (not only worker start)."""
    app = make_app()
    install(app)
    with pytest.raises(ConfigurationError) as err:
        @app.task(shared=False, **options)
        def bad():
            pass

        app.tasks  # noqa: B018 -- a lazy task is built when the app finalizes
    assert message in str(err.value) and "bad" in str(err.value)


def test_tasks_of_an_app_never_installed_are_checked_when_celery_makes_them():
    """The app never calls install: the task is refused when Celery makes its class (as the
    app finalizes), and nothing is registered (before: only ``install`` checked)."""
    app = make_app()

    @app.task(shared=False, semaphore="s", limit=0)
    def early():
        pass

    with pytest.raises(ConfigurationError, match="early: limit"):
        app.tasks  # noqa: B018
    assert not any(name.endswith(".early") for name in app._tasks)


@pytest.mark.parametrize("headers, message", [
    ({"semaphore_limit": 0}, "header 'semaphore_limit'"),
    ({"semaphore_limit": "3"}, "header 'semaphore_limit'"),
    ({"semaphore": 5}, "header 'semaphore'"),
    ({"semaphore": "{"}, "header 'semaphore'"),
    ({"semaphore": "{0}"}, "header 'semaphore'"),
])
def test_a_bad_per_call_header_raises_in_the_caller_and_sends_nothing(headers, message):
    app = make_app(task_default_queue="bad-headers")
    install(app)

    @app.task(shared=False, semaphore="s", limit=1)
    def guarded():
        pass

    with pytest.raises(ConfigurationError, match=message):
        guarded.apply_async(headers=headers)
    with app.connection() as connection:
        assert connection.SimpleQueue("bad-headers").qsize() == 0


def test_task_overrides_settings():
    app = make_app(semaphore_lease_ttl=30)

    @app.task(semaphore="x", semaphore_lease_ttl=300, shared=False)
    def long():
        pass

    assert Settings.from_app(app).for_task(long).lease_ttl == 300
    with pytest.raises(ConfigurationError, match="semaphore_lease_ttl"):
        Settings.from_app(app).for_task(type("T", (), {"name": "t", "semaphore_lease_ttl": -1}))


def test_eager_calls_hold_the_semaphore():
    app = make_app(semaphore_backend="memory://eager", task_always_eager=True)
    install(app)
    from celery_semaphore import current_lease

    seen = []

    @app.task(semaphore="eager", limit=1, shared=False)
    def body():
        lease = current_lease()
        seen.append((lease.name, lease.limit, lease.verify()))
        return lease.token.slot

    assert body.delay().get() == 0
    assert seen == [("eager", 1, True)]
    from celery_semaphore.backends import get_backend

    assert get_backend("memory://eager", key_prefix="semaphore:").status("eager").held == 0


def test_an_eager_call_that_gets_no_slot_fails_without_running_the_body():
    """Celery only logs an exception raised in a task_prerun receiver: the acquire must happen
    where its exception fails the call (before_start), or the body runs without a slot."""
    from celery_semaphore import Semaphore, SemaphoreTimeout, current_lease
    from celery_semaphore.backends import get_backend

    app = make_app(semaphore_backend="memory://eager-full", semaphore_max_wait=0.2)
    install(app)
    ran, started = [], []

    @app.task(semaphore="full", limit=1, shared=False)
    def plain():
        ran.append("plain")

    class Audited(app.Task):
        def before_start(self, task_id, args, kwargs):
            started.append(task_id)
            super().before_start(task_id, args, kwargs)

    @app.task(base=Audited, semaphore="full", limit=1, shared=False)
    def audited():
        ran.append("audited")

    class NoSuper(app.Task):  # overrides before_start without calling super()
        def before_start(self, task_id, args, kwargs):
            started.append("no-super")

    @app.task(base=NoSuper, semaphore="full", limit=1, shared=False)
    def no_super():
        lease = current_lease()
        ran.append(("no-super", lease.name if lease else None))

    assert no_super.apply().state == "SUCCESS"  # acquired in task_prerun instead
    assert ran.pop() == ("no-super", "full") and started.pop() == "no-super"

    holder = Semaphore("full", 1, "memory://eager-full").acquire()
    for guarded in (plain, audited):
        result = guarded.apply()
        assert result.state == "FAILURE" and isinstance(result.result, SemaphoreTimeout)
        with pytest.raises(SemaphoreTimeout):
            guarded.apply(throw=True)
    assert ran == [] and len(started) == 2  # the subclass's own before_start still runs
    holder.release()
    assert plain.apply().state == "SUCCESS" and audited.apply().state == "SUCCESS"
    assert ran == ["plain", "audited"]
    backend = get_backend("memory://eager-full", key_prefix="semaphore:")
    assert backend.status("full").held == 0


def test_an_eager_call_on_a_full_semaphore_skips_or_fails_at_once():
    from celery_semaphore import SemaphoreFull
    from celery_semaphore.signals import task_skipped

    app = make_app(semaphore_backend="memory://eager-on-full")
    install(app)
    ran, skipped = [], []

    @app.task(semaphore="busy", limit=1, semaphore_on_full="skip", shared=False)
    def skipper():
        ran.append("skip")

    @app.task(semaphore="busy", limit=1, semaphore_on_full="fail", shared=False)
    def failer():
        ran.append("fail")

    def on_skipped(sender, task_id, semaphore, **kwargs):
        skipped.append((sender.name, semaphore))

    task_skipped.connect(on_skipped, weak=False)
    try:
        holder = Semaphore("busy", 1, "memory://eager-on-full").acquire()
        assert skipper.apply().state == "IGNORED"
        result = failer.apply()
        assert result.state == "FAILURE" and isinstance(result.result, SemaphoreFull)
        assert ran == [] and skipped == [(skipper.name, "busy")]
        holder.release()
        assert skipper.apply().state == "SUCCESS" and failer.apply().state == "SUCCESS"
        assert ran == ["skip", "fail"]
    finally:
        task_skipped.disconnect(on_skipped)


def test_a_retry_does_not_carry_the_gates_headers():
    """self.retry() copies the request's custom headers into the new message: the lease (with
    the backend URL and its password) and the requeue bookkeeping must stay out of it."""
    from celery_semaphore.task_lease import LEASE_KEY
    from celery_semaphore.worker.claim import FIRST_WAIT_HEADER, REQUEUES_HEADER

    app = make_app(task_default_queue="retry-headers")
    install(app)

    @app.task(bind=True, semaphore="r", limit=1, shared=False)
    def flaky(self):
        pass

    flaky.push_request(
        id="t1", task=flaky.name, args=[], kwargs={}, retries=0, is_eager=False,
        called_directly=False, delivery_info={"exchange": "", "routing_key": "retry-headers"},
        **{REQUEUES_HEADER: 3, FIRST_WAIT_HEADER: 1.0, "semaphore": "r",
           LEASE_KEY: {"name": "r", "holder": "h", "backend": "redis://:s3cret@h:6379/0"}})
    try:
        flaky.retry(countdown=5, throw=False)
    finally:
        flaky.pop_request()
    with app.connection() as connection:
        message = connection.SimpleQueue("retry-headers").get(timeout=5)
        headers = message.headers
        message.ack()
    assert headers["id"] == "t1" and headers["retries"] == 1
    assert headers["semaphore"] == "r"  # a per-call override belongs to the call: it stays
    assert not {REQUEUES_HEADER, FIRST_WAIT_HEADER, LEASE_KEY} & set(headers)
    assert "s3cret" not in repr(headers)


@pytest.mark.parametrize("url", [url for url, _ in MALFORMED_URLS])
def test_a_malformed_backend_url_is_refused_wherever_it_enters(url):
    with pytest.raises(ConfigurationError) as err:
        Semaphore("x", 1, url)
    assert "S3cretPW" not in str(err.value)
    app = make_app(semaphore_backend=url)
    with pytest.raises(ConfigurationError) as err:  # what the worker does at start
        get_backend(Settings.from_app(app).backend_url(app))
    assert "S3cretPW" not in str(err.value)


@pytest.mark.parametrize("url, masked", [
    ("redis://:pw@h:99999/0", "redis://:**@h:99999/0"),
    ("amqp://user:p@ss:w@rd@h//", "amqp://user:**@h//"),
    ("consul://h:8500?dc=a&token=abc", "consul://h:8500?dc=a&token=**"),
    ("redis://h/0", "redis://h/0"),
    ("not a url", "not a url"),
])
def test_mask_url_never_raises(url, masked):
    assert mask_url(url) == masked



def test_every_install_hint_names_an_extra_that_exists():
    import configparser
    import os

    from celery_semaphore.backends import SCHEMES

    config = configparser.ConfigParser()
    config.read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.cfg"))
    extras = set(config["options.extras_require"])
    named = {scheme.extra for scheme in SCHEMES.values() if scheme.extra}
    assert named == {"redis", "amqp", "consul", "postgres"} and named <= extras, extras


def test_the_client_api_loads_no_worker_machinery():
    import subprocess
    import sys

    code = ("import sys; from celery_semaphore import Semaphore, current_lease, task; "
            "print([m for m in ('celery.concurrency.prefork', 'billiard.pool', "
            "'celery_semaphore.worker', 'celery_semaphore.keeper') "
            "if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("name", ["", "x" * 201, "has space", "a{b}", "tab\t", "a/b", "ü" * 101, 7,
                                  "a\u200bb"])
def test_bad_names_are_refused(name):
    with pytest.raises(InvalidName):
        Semaphore(name, 1, "memory://names")


@pytest.mark.parametrize("option", [{"ttl": 0}, {"ttl": -1}, {"poll_interval": "1"}])
def test_bad_semaphore_options_are_refused(option):
    with pytest.raises(ConfigurationError):
        Semaphore("opts", 1, "memory://opts", **option)

