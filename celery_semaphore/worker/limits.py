"""Telling the operator when the limit in force is not the one this worker declares.

Limits follow the code (:mod:`celery_semaphore.backends.base`, "Limits"): the newest
declaration is in force unless an operator pinned the limit with ``resize``. A worker whose
declared limit differs from a pinned one logs one WARNING naming both: for the plain names of
its tasks when it starts, for the keys of a template the first time an attempt shows the
difference; and one WARNING at start for a name two of its tasks declare different limits
for. A difference that is not a pin (a process started later declares another limit:
this worker runs old code, or tasks disagree) is logged once at INFO. Each name is looked at
once per process (at most :data:`MAX_NAMES` of them).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Set, Union

from ..backends.base import Attempt, Backend, MultiAttempt
from ..guards import Guard, Guards, guarded_tasks
from ..settings import Settings

logger = logging.getLogger(__name__)

#: Names a worker remembers having looked at; past it, no more looks (a template with
#: millions of keys must not grow the worker's memory).
MAX_NAMES = 10_000


class LimitWatch:
    """Looks at the limit in force of each name once, and logs a difference (module docs).
    :meth:`saw` runs on the gate's loop thread and costs nothing unless an attempt shows a
    difference; the look itself (a status read) goes to ``run_io``, and an unknown name is
    given back to the loop (``post``) to be looked at again later."""

    def __init__(self, backend: Backend,
                 run_io: Callable[..., Any] = lambda fn, *args: fn(*args),
                 post: Callable[..., Any] = lambda fn, *args: fn(*args)) -> None:
        self.backend = backend
        self.run_io = run_io
        self.post = post
        #: names looked at, or being looked at (the loop thread's)
        self._asked: Set[str] = set()

    def at_start(self, app: Any) -> None:
        """Look at the plain names (no template) of every guarded task of ``app``; warn when
        two of its tasks declare different limits for one name (both are this process's
        declarations, of one date: whichever ran last would be in force)."""
        settings = Settings.from_app(app)
        declared: Dict[str, Dict[int, List[str]]] = {}
        for task_name, task in sorted(guarded_tasks(app).items()):
            for name, limit in Guards.declared_limits(task.semaphore,
                                                      getattr(task, "limit", None), settings):
                # (an adaptive limit is learned, one from a function varies: nothing to see)
                if "{" not in name and isinstance(limit, int):
                    declared.setdefault(name, {}).setdefault(limit, []).append(task_name)
        for name, by_limit in declared.items():
            if len(by_limit) > 1:
                which = "; ".join(f"{limit}: {', '.join(tasks)}"
                                  for limit, tasks in sorted(by_limit.items()))
                logger.warning(
                    "celery-semaphore: semaphore %r: tasks declare different limits (%s): the "
                    "one that runs last sets the limit in force; declare one limit (e.g. in "
                    "semaphore_limits)", name, which)
            if name not in self._asked:
                self._asked.add(name)
                self._look(name, max(by_limit))

    def saw(self, guard: Guard, attempt: Union[Attempt, MultiAttempt]) -> None:
        """After an acquire attempt of ``guard`` (loop thread): look, on the I/O thread, at
        each name whose limit in force (as the attempt reports it) is not the declared one.
        Never raises: only a log line is at stake."""
        try:
            self._saw(guard, attempt)
        except Exception:
            logger.debug("celery-semaphore: comparing limits failed", exc_info=True)

    def _saw(self, guard: Guard, attempt: Union[Attempt, MultiAttempt]) -> None:
        if guard.adaptive is not None:  # its limit in force is learned
            return
        for name, declared in guard.pairs:
            if isinstance(attempt, MultiAttempt):
                in_force = attempt.limits.get(name) if attempt.grants is not None else (
                    attempt.limit if attempt.blocking == name else None)
            else:
                in_force = attempt.limit
            if (in_force is not None and in_force != declared and name not in self._asked
                    and len(self._asked) < MAX_NAMES):
                self._asked.add(name)
                self.run_io(self._look, name, declared)

    def _look(self, name: str, declared: int) -> None:
        """Read ``name``'s status and log a difference from ``declared``. An unknown name
        (or one whose status cannot be read now) is looked at again later."""
        try:
            status = self.backend.status(name)
        except Exception as exc:  # only a log line is at stake
            logger.debug("celery-semaphore: no status of %r to compare limits: %s", name, exc)
            status = None
        if status is None:
            self.post(self._asked.discard, name)
            return
        if status.limit == declared:
            return
        if status.pinned:
            logger.warning(
                "celery-semaphore: semaphore %r: limit %d is pinned (celery semaphore resize); "
                "this worker declares %d, which is not in force until `celery semaphore resize "
                "%s --unpin`", name, status.limit, declared, name)
        else:
            logger.info(
                "celery-semaphore: semaphore %r: limit %d is in force, declared by a process "
                "started after this one; this worker declares %d", name, status.limit,
                declared)
