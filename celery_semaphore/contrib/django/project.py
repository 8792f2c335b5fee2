"""The project's Celery app, as the Django app finds it: the one the ``CELERY_SEMAPHORE_APP``
setting names (``"proj.celery:app"``), else Celery's current app."""

from typing import Any, Optional


def find_app(required: bool = False) -> Optional[Any]:
    """The project's Celery app (see the module); None when there is none and not
    ``required`` (then Celery's default app). ``ImportError``/``AttributeError`` naming
    ``CELERY_SEMAPHORE_APP`` when that setting names no app."""
    from importlib import import_module

    from django.conf import settings

    path = getattr(settings, "CELERY_SEMAPHORE_APP", None)
    if path:
        module, _, attr = str(path).partition(":")
        try:
            return getattr(import_module(module), attr or "app")
        except (ImportError, AttributeError) as exc:
            raise type(exc)(f"CELERY_SEMAPHORE_APP {path!r}: {exc}") from None
    from celery import _state, current_app

    app = _state._tls.current_app or _state.default_app
    if app is None and required:
        return current_app._get_current_object()
    return app
