"""The first hour in Django: a project set up as Celery's "First steps with Django" says
(tests/django_shop: ``proj/celery.py`` without ``install(app)``, ``@shared_task`` tasks,
``CELERY_``-prefixed settings, ``celery_semaphore.contrib.django`` installed). Each test runs
Django in a subprocess, as ``manage.py`` would."""

import os
import subprocess
import sys
import textwrap

from celery_semaphore import Semaphore
from tests.workers import ROOT


def django(*args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("DX_", "CS_"))}
    environ.update(DJANGO_SETTINGS_MODULE="tests.django_shop.settings", PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_manage_py_check_reports_misspelt_settings_and_bad_templates():
    clean = django("-m", "django", "check")
    assert clean.returncode == 0, clean.stderr
    assert "System check identified no issues" in clean.stdout
    spoilt = django("-m", "django", "check", DX_MISSPELT_SETTING="1", DX_BAD_TEMPLATE="1")
    assert spoilt.returncode == 1, spoilt.stdout + spoilt.stderr
    assert ("(celery_semaphore.E002) unknown setting: CELERY_SEMAPHORE_LEASE_TTLS (did you "
            "mean CELERY_SEMAPHORE_LEASE_TTL?)") in spoilt.stderr
    assert ("(celery_semaphore.E003) task tests.django_shop.reports.tasks.export: semaphore "
            "template 'exports:{customer}' names {customer}, which is not a parameter of the "
            "task (customer_id); did you mean {customer_id}?") in spoilt.stderr


def test_the_semaphore_command_refuses_a_misspelt_setting():
    done = django("-m", "django", "semaphore", "list", DX_MISSPELT_SETTING="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did you mean CELERY_SEMAPHORE_LEASE_TTL?" in done.stderr


EAGER_CALL = textwrap.dedent("""
    import django

    django.setup()
    from tests.django_shop.reports.tasks import build_report

    result = build_report.delay(7)
    print("STATE", result.state, type(result.result).__name__)
""")


def test_eager_calls_hold_their_slot_without_install_in_celery_py(tmp_path):
    """``CELERY_TASK_ALWAYS_EAGER``: the Django app installed celery-semaphore, so the eager
    call needs a slot; the one slot held here makes it fail (``semaphore_on_full="fail"``);
    once released, it runs (before: it ran unguarded, with no warning)."""
    backend = "sqlite:///" + str(tmp_path / "semaphores.db")
    env = {"DX_EAGER": "1", "DX_ON_FULL": "fail", "DX_SEMAPHORE_BACKEND": backend}
    held = Semaphore("reports:7", 1, backend).acquire()
    try:
        refused = django("-c", EAGER_CALL, **env)
    finally:
        held.release()
    assert "STATE FAILURE SemaphoreFull" in refused.stdout, refused.stdout + refused.stderr
    ran = django("-c", EAGER_CALL, **env)
    assert "STATE SUCCESS str" in ran.stdout, ran.stdout + ran.stderr
