"""For ``make demo``: every task appends its start and end to ``var/timeline.log``.

Pool processes write the events from Celery's task_prerun/task_postrun signals, which fire
inside the task's lease: the slot is taken before the task starts and freed after it ends.
"""

import json
import os
import time

from celery import signals

from celery_semaphore import current_lease

from .app import VAR

PATH = os.path.join(VAR, "timeline.log")


def record(kind, task, **fields):
    lease = current_lease()
    event = {"t": time.time(), "kind": kind, "task": task.name.rsplit(".", 1)[-1],
             "id": task.request.id, "retries": task.request.retries,
             "worker": task.request.hostname, "pid": os.getpid(),
             "semaphore": lease.name if lease else None,
             "slot": lease.token.slot if lease else None,
             "token": str(lease.token) if lease else None, **fields}
    with open(PATH, "a") as f:  # one short append per line: lines never interleave
        f.write(json.dumps(event) + "\n")


@signals.task_prerun.connect
def task_started(task=None, **kwargs):
    record("start", task)


@signals.task_postrun.connect
def task_ended(task=None, state=None, retval=None, **kwargs):
    # unstarted: the run was given back before its body (its semaphore was paused after its
    # grant): it ends IGNORED, having called nothing, and runs again
    record("end", task, state=state, unstarted=bool(getattr(retval, "unstarted", False)))


def read(path=PATH):
    """Every event so far, in file order."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]
