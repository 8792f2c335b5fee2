"""Which semaphore guards a task: the ``task`` decorator, option checks, guard resolution.

Task options (extra ``@app.task`` options become task class attributes):

* ``semaphore``: a name, or a template filled from the call's arguments by parameter name
  (``"api:{customer_id}"``); defaults of the task's signature count.
* ``limit``: the limit the semaphore is created with.
* any ``semaphore_*`` setting, to override it for this task.

Per call, ``apply_async(headers={"semaphore": "name", "semaphore_limit": 3})`` overrides both.

The limit a name is *declared* with is the first of: the ``semaphore_limit`` header,
``semaphore_limits[name]``, ``semaphore_limits[template]``, the task's ``limit``,
``semaphore_default_limit``. A declared limit only creates the semaphore; once it exists its
stored limit rules, and only ``resize`` changes it.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from celery import shared_task

from .exceptions import ConfigurationError
from .names import validate_limit, validate_name, validate_template
from .settings import Settings
from .settings import validate as validate_setting


@dataclass(frozen=True)
class Guard:
    """The semaphore one request must hold: resolved name, declared limit, task settings."""

    name: str
    limit: int
    settings: Settings
    #: The fair-share key (``semaphore_fair_by`` filled from the call), or None.
    fair: Optional[str] = None


def task(*args: Any, **options: Any) -> Any:
    """``shared_task`` that also accepts ``semaphore=``, ``limit=`` and ``semaphore_*`` options.

    ``@task(semaphore="images", limit=4)`` works in any app that called
    :func:`celery_semaphore.install`; the options are checked here, at decoration time.
    """
    check_options(options)
    return shared_task(*args, **options)


def check_options(options: Dict[str, Any], task_name: str = "") -> None:
    """Refuse wrong semaphore task options: a bad ``semaphore`` template, a ``limit`` that is
    not an int from 1 to 100,000, an unknown (misspelt) ``semaphore_*`` option or a bad value
    of a known one. Raises ConfigurationError naming the task and the option."""
    where = f"task {task_name}: " if task_name else ""
    try:
        if options.get("semaphore") is not None:
            validate_template(options["semaphore"], "semaphore")
        if options.get("limit") is not None:
            validate_limit(options["limit"])
        known = {f"semaphore_{f.name}": f.name for f in fields(Settings)}
        for key, value in options.items():
            if not key.startswith("semaphore_") or value is None:
                continue
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigurationError(f"unknown task option {key}{hint}")
            validate_setting(f"task option {key}", known[key], value)
    except ConfigurationError as exc:
        raise type(exc)(f"{where}{exc}") from None


def check_call_headers(headers: Optional[Dict[str, Any]]) -> None:
    """Refuse a per-call ``semaphore`` or ``semaphore_limit`` header that could not work."""
    if not headers:
        return
    if headers.get("semaphore") is not None:
        validate_template(headers["semaphore"], "header 'semaphore'")
    if headers.get("semaphore_limit") is not None:
        validate_limit(headers["semaphore_limit"], "header 'semaphore_limit'")


_CHECKED = "_celery_semaphore_checks_options"


def check_definitions_and_sends(app: Any) -> None:
    """Check semaphore options where they are written (idempotent): each task class the
    app's ``Task`` base makes from now on, each task the app has already, and the headers
    of every ``apply_async`` (a bad one raises in the caller, before anything is sent)."""
    base = app.Task
    if base.__dict__.get(_CHECKED):
        return
    original_apply_async = base.apply_async

    def __init_subclass__(cls: Any, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        check_options({k: v for k, v in vars(cls).items()
                       if k in ("semaphore", "limit") or k.startswith("semaphore_")},
                      getattr(cls, "name", None) or cls.__name__)

    def apply_async(self: Any, *args: Any, **options: Any) -> Any:
        check_call_headers(options.get("headers"))
        return original_apply_async(self, *args, **options)

    base.__init_subclass__ = classmethod(__init_subclass__)
    base.apply_async = apply_async
    setattr(base, _CHECKED, True)
    for name, existing in list(app._tasks.items()):
        check_options({k: getattr(existing, k) for k in dir(type(existing))
                       if k in ("semaphore", "limit") or k.startswith("semaphore_")}, name)


class Guards:
    """Resolves the guard of each request; caches per-task settings and signatures."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._settings: Dict[str, Settings] = {}
        self._signatures: Dict[str, inspect.Signature] = {}

    def task_settings(self, task: Any) -> Settings:
        cached = self._settings.get(task.name)
        if cached is None:
            cached = self._settings[task.name] = self.settings.for_task(task)
        return cached

    def resolve(self, request: Any) -> Optional[Guard]:
        """The guard of a worker request, None when unguarded."""
        return self.resolve_call(request.task, request.args, request.kwargs, request.request_dict)

    def resolve_call(
        self, task: Any, args: Any, kwargs: Any, headers: Optional[Dict[str, Any]]
    ) -> Optional[Guard]:
        """The guard of one call, None when unguarded; ConfigurationError when it cannot be
        built (the template names an argument the call lacks, or fills in a bad name)."""
        headers = headers or {}
        check_call_headers(headers)
        template = headers.get("semaphore")
        if template is None:
            template = getattr(task, "semaphore", None)
        if not template:
            return None
        name = validate_name(self.fill(template, task, args, kwargs))
        settings = self.task_settings(task)
        limit = headers.get("semaphore_limit")
        fair = None
        if settings.fair_by is not None:
            fair = self.fill(settings.fair_by, task, args, kwargs, "semaphore_fair_by")
        if limit is not None:
            return Guard(name, validate_limit(limit, "header 'semaphore_limit'"), settings, fair)
        limit = (
            settings.limits.get(name)
            or settings.limits.get(template)
            or getattr(task, "limit", None)
            or settings.default_limit
        )
        return Guard(name, validate_limit(limit, f"limit of semaphore {name!r}"), settings, fair)

    def fill(self, template: str, task: Any, args: Any, kwargs: Any,
             what: str = "semaphore template") -> str:
        if "{" not in template:
            return template
        signature = self._signatures.get(task.name)
        if signature is None:
            signature = self._signatures[task.name] = inspect.signature(task.run)
        try:
            bound = signature.bind_partial(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise ConfigurationError(f"task {task.name}: cannot fill {what} "
                                     f"{template!r}: {exc}") from None
        bound.apply_defaults()
        try:
            return template.format_map(bound.arguments)
        except KeyError as exc:
            raise ConfigurationError(
                f"task {task.name}: {what} {template!r} needs argument {exc}, "
                "which the call does not provide"
            ) from None
        except Exception as exc:  # a field that indexes None, a format spec for another type...
            raise ConfigurationError(
                f"task {task.name}: cannot fill {what} {template!r} from the "
                f"call's arguments: {type(exc).__name__}: {exc}"
            ) from None
