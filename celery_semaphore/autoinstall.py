"""What every process that imports celery_semaphore needs of the worker side, and no more:
the ``worker_init`` receiver that installs the gate in a worker whose app declares guarded
tasks but never called :func:`celery_semaphore.install`. The worker machinery itself (the
gate, Celery's pool internals) loads only when a worker installs it."""

from __future__ import annotations

import logging
from typing import Any, Dict

from celery import signals

logger = logging.getLogger(__name__)

#: The app attribute that marks it installed.
INSTALLED = "_celery_semaphore_installed"


def guarded_tasks(app: Any) -> Dict[str, Any]:
    """Task name -> its task class, for every task that declares a semaphore."""
    return {name: task for name, task in sorted(app.tasks.items())
            if getattr(task, "semaphore", None) is not None}


def install_for_worker(sender: Any = None, **kwargs: Any) -> None:
    """``worker_init``: a worker whose app declares guarded tasks but never called
    :func:`install` installs the gate now, before the consumer's steps are built, so that a
    task with ``semaphore=`` never runs unguarded. Connected when this package is imported,
    which every ``celery`` command does through the ``celery.commands`` entry point."""
    app = getattr(sender, "app", None)
    if app is None or getattr(app, INSTALLED, False) or not guarded_tasks(app):
        return
    from .worker import install

    install(app)
    logger.warning("celery-semaphore: the app declares guarded tasks but did not call "
                   "celery_semaphore.install(app); installed it for this worker (call it "
                   "in your app module so that eager calls and sends are checked too)")


signals.worker_init.connect(install_for_worker, weak=False,
                            dispatch_uid="celery_semaphore_auto_install")
