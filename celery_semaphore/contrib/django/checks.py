"""Django system checks of celery-semaphore (``manage.py check``): the Celery app can be
found, its ``semaphore_*`` settings are valid and known (``CELERY_SEMAPHORE_BACKENDS`` is
reported with "did you mean CELERY_SEMAPHORE_BACKEND?"), a backend can be chosen, and each
guarded task's options and templates are valid. The task modules are imported as a worker
imports them (``imports``, ``include``, and ``autodiscover_tasks`` of the installed apps).

Ids: ``celery_semaphore.E001`` no app at ``CELERY_SEMAPHORE_APP``; ``E002`` a setting;
``E003`` a task (or a task module that refused a task as it was defined);
``W001`` no Celery app found.
"""

from typing import Any, List

from django.core import checks

from celery_semaphore.exceptions import ConfigurationError, InvalidLimit, InvalidName

#: What a bad option raises.
OPTION_ERRORS = (ConfigurationError, InvalidLimit, InvalidName)


@checks.register()
def check_celery_semaphore(app_configs: Any = None, **kwargs: Any) -> List[checks.CheckMessage]:
    from celery_semaphore.guards import check_options, check_task_class, guarded_tasks
    from celery_semaphore.settings import Settings

    from .project import find_app

    try:
        app = find_app()
    except (ImportError, AttributeError) as exc:
        return [checks.Error(str(exc), hint="Set it to 'module:attribute' of your Celery app, "
                             "e.g. 'proj.celery:app'.", id="celery_semaphore.E001")]
    if app is None:
        return [checks.Warning(
            "celery-semaphore found no Celery app to check",
            hint="Import your Celery app in proj/__init__.py as Celery's Django guide does, "
                 "or set CELERY_SEMAPHORE_APP = 'proj.celery:app'.",
            id="celery_semaphore.W001")]
    errors: List[checks.CheckMessage] = []
    try:
        Settings.from_app(app).backend_url(app)
    except ConfigurationError as exc:
        errors.append(checks.Error(str(exc), id="celery_semaphore.E002"))
    try:
        for module in tuple(app.conf.imports or ()) + tuple(app.conf.include or ()):
            app.loader.import_task_module(module)
        app.autodiscover_tasks(force=True)  # each installed app's tasks module
        tasks = guarded_tasks(app)
    except OPTION_ERRORS as exc:
        return errors + [checks.Error(str(exc), id="celery_semaphore.E003")]
    for name, task in tasks.items():
        try:
            check_options({key: getattr(task, key) for key in dir(type(task))
                           if key in ("semaphore", "limit") or key.startswith("semaphore_")},
                          name)
            check_task_class(type(task), name)
        except OPTION_ERRORS as exc:
            errors.append(checks.Error(str(exc), obj=name, id="celery_semaphore.E003"))
    return errors
