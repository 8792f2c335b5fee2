"""Signals celery-semaphore sends (Celery's own signal class: ``connect`` as for Celery's).

``task_skipped``: sent in the worker's main process (or, for an eager call, the calling
process) when a task with ``semaphore_on_full = "skip"`` found its semaphore full and was not
run. ``sender`` is the task; keyword arguments ``task_id``, ``semaphore`` (the resolved name),
``limit`` (the semaphore's stored limit, when known) and ``request`` (the worker's request, None
for an eager call).
"""

from celery.utils.dispatch import Signal

task_skipped = Signal(name="task_skipped")
