"""What every process that imports celery_semaphore needs of the worker side, and no more:
the hooks that install the gate into an app that declares guarded tasks but never called
:func:`celery_semaphore.install`, so that no guarded task runs unguarded in silence:

* task definition: when a task class with a ``semaphore`` option is made for an app that is
  not installed (``@app.task``, ``@shared_task`` as each app is finalized, a class-based
  task), the app is installed right there, before any of its tasks can be sent or called,
  and the new task's options are checked (a hook on Celery's ``Task.__init_subclass__``);
* ``worker_init``: a worker installs it before its consumer's steps are built (for an app
  whose guarded tasks were defined before this package was imported);
* ``task_prerun`` of an eager call of a guarded task defined before this package was
  imported: installs it and acquires for this call. There, unlike in ``before_start``,
  Celery only logs an exception: a failed acquire of that first call is logged and its body
  runs without a slot.

Each logs one WARNING per app naming the fix (call ``install(app)`` in the app module). A
process that never imports celery_semaphore cannot be helped: the ``celery`` command imports
it (its entry point), and so do ``install``, ``@celery_semaphore.task`` and the Django app
``celery_semaphore.contrib.django``.

The worker machinery itself (the gate, Celery's pool internals) loads only on install.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List

from celery import signals

from .guards import INSTALLED, guarded_tasks

logger = logging.getLogger(__name__)

def auto_install(app: Any, where: str) -> bool:
    """Install into ``app`` if it declares guarded tasks and is not installed yet, with one
    WARNING (``where`` says which process); True when it installed now."""
    if app is None or getattr(app, INSTALLED, False) or not guarded_tasks(app):
        return False
    return _install(app, where)


def _install(app: Any, where: str) -> bool:
    if getattr(app, INSTALLED, False):  # installed meanwhile (finalizing the app can)
        return False
    from .worker import install

    install(app)
    logger.warning("celery-semaphore: the app %r declares guarded tasks but did not call "
                   "celery_semaphore.install(app); installed it for this %s (call it in "
                   "your app module, right after creating the app)", app.main, where)
    return True


def install_for_worker(sender: Any = None, **kwargs: Any) -> None:
    """``worker_init``: a worker whose app declares guarded tasks but never called
    :func:`install` installs the gate now, before the consumer's steps are built, so that a
    task with ``semaphore=`` never runs unguarded. Connected when this package is imported,
    which every ``celery`` command does through the ``celery.commands`` entry point."""
    auto_install(getattr(sender, "app", None), "worker")


def install_for_eager_call(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """``task_prerun``: an eager call of a guarded task whose app is not installed: install,
    and hold the slot for this call (its tracer was built before the guard existed)."""
    request = getattr(task, "request", None)
    if (request is None or not getattr(request, "is_eager", False)
            or getattr(task, "semaphore", None) is None):
        return
    if auto_install(task.app, "process (an eager call)"):
        from .eager import acquire_for_eager

        acquire_for_eager(task)


#: Called with each task class made from now on (:class:`.testing.ConcurrencyRecorder`
#: watches the bodies of guarded tasks defined during a test through it).
TASK_CLASS_CALLBACKS: List[Callable[[Any], None]] = []


def _task_class_made(cls: Any) -> None:
    """A task class was made: if it declares a semaphore for an app that is not installed,
    install the app now and check the class's options (ConfigurationError out of the
    definition, as with an installed app)."""
    for callback in list(TASK_CLASS_CALLBACKS):
        callback(cls)
    if cls.__dict__.get("semaphore") is None:
        return
    app = cls.__dict__.get("app") or getattr(cls, "_app", None)
    if app is None or getattr(app, INSTALLED, False) or not hasattr(app, "steps"):
        return
    from .guards import check_task_definition

    check_task_definition(cls, cls.__dict__.get("name") or cls.__name__)
    _install(app, "process")


def _hook_task_classes() -> None:
    """Call :func:`_task_class_made` for every task class made from now on (idempotent)."""
    from celery.app.task import Task

    if Task.__dict__.get("_celery_semaphore_hooked"):
        return
    previous = Task.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(Task, cls).__init_subclass__(**kwargs)
        _task_class_made(cls)

    Task.__init_subclass__ = classmethod(__init_subclass__)
    Task._celery_semaphore_hooked = True


signals.worker_init.connect(install_for_worker, weak=False,
                            dispatch_uid="celery_semaphore_auto_install")
signals.task_prerun.connect(install_for_eager_call, weak=False,
                            dispatch_uid="celery_semaphore_auto_install_eager")
_hook_task_classes()
