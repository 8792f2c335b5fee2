"""Mistakes of a first hour refused early (issue #29 item 7): an unknown ``semaphore_*``
setting, a template naming a parameter the task does not have, guarded tasks of an app that
never called ``install(app)`` run eagerly. In-process, no server needed, but for the worker
and the CLI started as a user starts them."""

import json
import logging

import pytest
from celery import Celery, _state, shared_task

from celery_semaphore import ConfigurationError, Semaphore, SemaphoreFull, task
from celery_semaphore.guards import INSTALLED, Guards
from celery_semaphore.settings import Settings, unknown_settings
from tests import servers
from tests.workers import Worker, cluster_env, run_cli


def make_app(name="first_hour", **conf):
    app = Celery(name, set_as_current=False)
    app.conf.update({"broker_url": "memory://", **conf})
    return app


# -- unknown settings -------------------------------------------------------------------


@pytest.mark.parametrize("key, hint", [
    ("semaphore_backends", "semaphore_backend"), ("semaphore_limit", "semaphore_limits"),
    ("semaphore_max_waiting", "semaphore_max_wait"), ("semaphore_leasettl", "semaphore_lease_ttl"),
])
def test_an_unknown_setting_is_refused_with_the_closest_name(key, hint):
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(make_app(**{key: "x"}))
    assert str(err.value) == f"unknown setting: {key} (did you mean {hint}?)"


def test_django_namespace_names_an_unknown_setting_as_written():
    app = Celery("ns", set_as_current=False)
    app.config_from_object({"CELERY_BROKER_URL": "memory://",
                            "CELERY_SEMAPHORE_BACKENDS": "redis://h/1",
                            "CELERY_SEMAPHORE_APP": "proj.celery:app",  # the Django app's
                            "CELERY_SEMAPHORE_LEASE_TTL": 5}, namespace="CELERY")
    assert unknown_settings(app) == [("CELERY_SEMAPHORE_BACKENDS", "CELERY_SEMAPHORE_BACKEND")]
    with pytest.raises(ConfigurationError, match=r"^unknown setting: CELERY_SEMAPHORE_BACKENDS "
                                                 r"\(did you mean CELERY_SEMAPHORE_BACKEND\?\)$"):
        Settings.from_app(app)


def test_an_unknown_name_far_from_any_lists_the_known_ones():
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(make_app(semaphore_zzz=1, semaphore_backends="x"))
    message = str(err.value)
    assert message.startswith("unknown settings: semaphore_backends (did you mean "
                              "semaphore_backend?); semaphore_zzz (the known ones: ")
    assert "semaphore_lease_ttl" in message and "semaphore_fair_by" in message


def test_the_worker_and_the_cli_refuse_an_unknown_setting(tmp_path, redis_url):
    env = cluster_env(str(tmp_path), servers.redis_broker(redis_url), redis_url, "")
    env["CS_SETTINGS"] = json.dumps({"semaphore_lease_ttls": 30})
    worker = Worker(env, "misspelt", 1)
    try:
        listed = run_cli(env, "list")
        assert worker.proc.wait(60) != 0
    finally:
        worker.stop()
    assert "did you mean semaphore_lease_ttl?" in worker.output()
    assert listed.returncode == 1
    assert listed.stderr.strip() == ("Error: unknown setting: semaphore_lease_ttls (did you "
                                     "mean semaphore_lease_ttl?)")


# -- templates checked against the signature --------------------------------------------


def finalized_app():
    """(Tasks defined below are ``shared=False``: Celery would make a shared task, refused
    or not, again in every app finalized later in this process.)"""
    app = make_app()
    app.finalize()
    return app


def test_a_template_naming_a_missing_parameter_is_refused_where_the_task_is_defined():
    app = finalized_app()

    def build_report(customer_id):
        pass

    with pytest.raises(ConfigurationError) as err:
        app.task(semaphore="reports:{customer}", name="build_report", shared=False)(build_report)
    assert str(err.value) == (
        "task build_report: semaphore template 'reports:{customer}' names {customer}, which "
        "is not a parameter of the task (customer_id); did you mean {customer_id}?")
    assert "build_report" not in app.tasks  # nothing registered


@pytest.mark.parametrize("option, ok", [
    ("r:{customer_id}", True), ("r:{p[k]}", True), ("r:{p.k}", True), ("r:{x}", False),
    (["a", "r:{customer_id}"], True), (["a", "r:{nope}"], False), ("plain", True),
])
def test_each_template_field_names_a_parameter(option, ok):
    app = finalized_app()

    def fun(customer_id, p=None):
        pass

    define = app.task(semaphore=option, name=f"t-{option}", shared=False)
    if ok:
        define(fun)
    else:
        with pytest.raises(ConfigurationError, match="is not a parameter of the task"):
            define(fun)


def test_kwargs_args_bound_and_fair_by_signatures():
    app = finalized_app()

    def any_keyword(**kwargs):
        pass

    def positional(*args):
        pass

    def bound(self, customer):
        pass

    app.task(semaphore="r:{customer}", name="kw", shared=False)(any_keyword)
    app.task(semaphore="r:{args[0]}", name="args", shared=False)(positional)
    app.task(semaphore="r:{customer}", name="bound", bind=True, shared=False)(bound)
    with pytest.raises(ConfigurationError, match=r"names \{customer\}.*\(\*args\)"):
        app.task(semaphore="r:{customer}", name="args2", shared=False)(positional)
    with pytest.raises(ConfigurationError, match=r"names \{self\}"):
        app.task(semaphore="r:{self}", name="bound2", bind=True, shared=False)(bound)
    with pytest.raises(ConfigurationError, match=r"semaphore_fair_by '\{tenant\}'"):
        app.task(semaphore="r", semaphore_fair_by="{tenant}", name="fair", shared=False)(bound)
    # a template field fills from what **kwargs received
    guard = Guards(Settings()).resolve_call(app.tasks["kw"], (), {"customer": 7}, {})
    assert guard.name == "r:7"


def test_a_class_based_task_is_checked_too():
    app = finalized_app()
    with pytest.raises(ConfigurationError, match=r"names \{tenant\}"):
        class Export(app.Task):
            name = "export"
            semaphore = "exports:{tenant}"

            def run(self, customer_id):
                pass


def test_the_task_decorator_checks_as_it_decorates():
    def build_report(customer_id):
        pass

    with pytest.raises(ConfigurationError, match=r"names \{customer\}"):
        task(semaphore="reports:{customer}")(build_report)
    with pytest.raises(ConfigurationError, match=r"names \{customer\}"):
        task(build_report, semaphore="reports:{customer}")


# -- guarded tasks without install(app) --------------------------------------------------


def test_an_app_that_never_called_install_gets_it_where_its_guarded_task_is_made(caplog,
                                                                                     tmp_path):
    """Before: ``build_report.apply()`` ran with its one slot held elsewhere, in silence."""
    # (an in-process Celery worker of an earlier test may leave the root logger at ERROR)
    caplog.set_level(logging.WARNING, logger="celery_semaphore.autoinstall")
    backend = "sqlite:///" + str(tmp_path / "s.db")
    app = make_app("never_installed", semaphore_backend=backend, semaphore_on_full="fail")

    @app.task(semaphore="reports:{customer_id}", limit=1, shared=False)
    def build_report(customer_id):
        return customer_id

    def unguarded():
        pass

    plain = make_app("no_guarded_tasks")
    plain.task(shared=False)(unguarded)
    plain.finalize()
    with Semaphore("reports:7", 1, backend).acquire():
        refused = build_report.apply(args=(7,))
    assert isinstance(refused.result, SemaphoreFull)
    assert build_report.apply(args=(7,)).result == 7
    assert getattr(app, INSTALLED) and not getattr(plain, INSTALLED, False)
    warnings = [r for r in caplog.records if "did not call celery_semaphore.install" in
                r.getMessage()]
    assert len(warnings) == 1 and "'never_installed'" in warnings[0].getMessage()


def test_a_guarded_shared_task_installs_each_app_it_is_made_in(tmp_path):
    backend = "sqlite:///" + str(tmp_path / "s.db")
    app = make_app("shared_in", semaphore_backend=backend, semaphore_on_full="fail")
    app.finalize()
    before = set(_state._on_app_finalizers)
    try:
        @shared_task(semaphore="exports", limit=1, name="first_hour.export")
        def export():
            return "ran"

        assert getattr(app, INSTALLED)
        with Semaphore("exports", 1, backend).acquire():
            assert isinstance(app.tasks["first_hour.export"].apply().result, SemaphoreFull)
    finally:  # no app made later in this process gets the task
        _state._on_app_finalizers.difference_update(set(_state._on_app_finalizers) - before)
