"""Task states and events celery-semaphore adds while a task waits for a slot.

``WAITING``: the worker holds the task in its main process until a slot frees. The worker
sends a ``task-waiting`` event (fields: ``semaphore``, ``limit``, ``position``, ``attempt``;
for a task under several semaphores ``semaphore`` is the one whose queue it waits in, and
``semaphores`` lists them all; ``waits_for``: ``"slots"``, ``"units"`` when costs are in play,
or ``"rate"`` when only the semaphore's rate holds it back; ``cost`` and ``priority`` when
not the defaults) that Flower shows as the state ``WAITING``, and stores ``WAITING`` in the
result backend (with the same fields as the result's meta) unless the task ignores results.
Once it runs, the task goes through ``STARTED``/``SUCCESS`` as usual.

``SKIPPED``: the task's semaphore was full and its ``semaphore_on_full`` is ``"skip"``, so it
did not run. The worker logs it (INFO), sends a ``task-skipped`` event (fields: ``semaphore``,
``limit``, ``reason``) that Flower shows as the state ``SKIPPED``, sends the
:data:`celery_semaphore.signals.task_skipped` signal in its main process, acks the message,
and stores ``REVOKED`` in the result backend with a ``TaskRevokedError`` whose message starts
with ``skipped:`` (a state Celery knows to be final: ``AsyncResult.get()`` raises at once
instead of waiting forever, and a chord the task belongs to fails as for a revoked task).
"""

WAITING = "WAITING"
WAITING_EVENT = "task-waiting"
SKIPPED = "SKIPPED"
SKIPPED_EVENT = "task-skipped"
#: How the result backend's reason of a skipped task begins.
SKIPPED_REASON = "skipped"

#: Where WAITING sits among Celery's states: after RECEIVED, before STARTED, so that a
#: ``task-started`` or ``task-succeeded`` event replaces it in Flower and ``celery events``.
PRECEDES = "STARTED"


#: The ``task-waiting`` event's fields that Celery's event state keeps for a task (Flower's
#: ``/api/task/info``, ``/api/tasks`` and task page show ``Task._fields`` only). They keep
#: their last values once the task runs (Celery's ``task-started`` event carries none of them).
EVENT_FIELDS = ("semaphore", "semaphores", "limit", "position", "waits_for", "waits_until",
                "parked")


def register_event_fields() -> None:
    """Add :data:`EVENT_FIELDS` to ``celery.events.state.Task._fields`` (default None), so
    that Flower shows what a WAITING task waits for (idempotent; in every process that
    installs celery-semaphore, Flower's included)."""
    from celery.events.state import Task

    missing = tuple(name for name in EVENT_FIELDS if name not in Task._fields)
    for name in missing:
        if hasattr(Task, name):  # a name Celery uses itself: leave it alone
            continue
        setattr(Task, name, None)
        Task._fields = Task._fields + (name,)


def register_precedence() -> None:
    """Rank WAITING just below STARTED in ``celery.states`` (idempotent).

    Celery ranks an unknown state above STARTED, so without this a ``task-started`` event would
    not replace WAITING in Flower. Runs in every process that installs celery-semaphore,
    Flower's included when it loads the app.
    """
    from celery import states

    if WAITING in states.PRECEDENCE:
        return
    states.PRECEDENCE.insert(states.PRECEDENCE.index(PRECEDES) + 1, WAITING)
    states.PRECEDENCE_LOOKUP.clear()
    states.PRECEDENCE_LOOKUP.update(zip(states.PRECEDENCE, range(len(states.PRECEDENCE))))
    states.NONE_PRECEDENCE = states.PRECEDENCE_LOOKUP[None]
