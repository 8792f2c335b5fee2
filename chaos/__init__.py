"""A nemesis soak of celery-semaphore with an external checker (``make chaos``).

What runs, all on loopback, all started and stopped by the run: a private redis-server as the
broker and another as the semaphore backend (both with ``appendfsync always``, so a restart
loses nothing they acknowledged; ``CHAOS_BACKEND=sentinel``: the backend is a private Sentinel
group instead); a TCP proxy in front of the broker and the plain Redis backend, through which
the workers (and only they) reach them; three real ``celery worker`` processes (two prefork
``-c 3``, one ``threads -c 3``) running :mod:`chaos.app` with ``task_acks_late`` and
``task_reject_on_worker_lost`` (at-least-once) and a 5 s lease TTL; a sender publishing a
steady mix of guarded tasks (a plain semaphore, a template over 20 keys, a task under two
semaphores, a fair semaphore, a semaphore of 4 units taken by ``semaphore_cost`` 1 or 2 with a
``semaphore_priority`` header on one call in four, one with a ``semaphore_rate`` of 4/s, a
template over 2 keys of limit 2 whose calls stand for an API answering 429: one call in four,
drawn from the seed, raises ``Backoff(retry_after=0.5-2.5 s)`` at its first run, which pauses
that key cluster-wide; and one under ``Adaptive(min=1, max=3)`` whose first run of one call
in four raises ``Backoff()``, no time: overload only) at ``CHAOS_RATE`` (8) a second; and a
nemesis that, after a
random pause of 1.5-5 s, injects one fault at a time, drawn from ``CHAOS_FAULTS`` (default:
every fault the backend allows):

``child_kill``      SIGKILL of a pool process of a prefork worker (one running a body if any)
``worker_kill``     SIGKILL of a worker's main process and its pool, restarted 0.5-3 s later
``worker_freeze``   SIGSTOP of a worker and its pool for lease TTL + 1-4 s, then SIGCONT
``broker_restart``  SIGKILL of the broker, restarted (with its AOF) 1-3 s later
``broker_cut``      the broker's proxy resets every connection and refuses new ones for 1-4 s
``backend_restart`` SIGKILL of the backend, restarted with its AOF 1-3 s later
``backend_wipe``    SIGKILL of the backend, its files deleted, restarted empty 1-3 s later
``backend_freeze``  SIGSTOP of the backend for 1 s to lease TTL + 3 s, then SIGCONT
``backend_cut``     the backend's proxy resets every connection and refuses new ones 1-4 s
``failover``        (sentinel) SIGKILL of the master; once a replica is promoted, the old
                    master comes back as a replica
``resize``          a live resize of a semaphore down to 1, and 2-5 s later back up

``CHAOS_SECONDS`` (default 300) later the sender and the nemesis stop, a worker that is down
is started again, and the run drains: it waits until every sent task has completed a run, or
no task has completed for 45 s (longer than the broker's 30 s visibility timeout, after which a
killed worker's unacknowledged messages are back), or ``CHAOS_DRAIN`` (600 s) passed; then
(at most 3 lease TTLs + 5 s) until the backend says no slot is held. The checker then prints
one JSON line. ``CHAOS_SEED`` (printed at the start; random when unset) fixes the nemesis's
choices and the sender's mix, so a failure can be replayed with the same faults in the same
order (the timing of processes is not replayed). Also: ``CHAOS_RATE`` (tasks a second),
``CHAOS_LEASE_TTL`` (5 s), ``CHAOS_DIR`` (where the run keeps its files; a new temporary
directory by default), ``CHAOS_LOGLEVEL`` (the workers', ``info``).

The checker reads only what the run wrote outside the library: the sender's log (a task is
*sent* when ``apply_async`` returned; a send that raised is not counted), the probe (each body
appends ``start``/``end`` lines with both clocks, its task id, process, thread, worker node,
every semaphore it runs under, named from its arguments, and at its start the fencing epoch of
its leases: when the backend granted them, on its clock), the backoff log (a body that raises
``Backoff`` writes no end mark: just before it raises, it appends a line with both clocks, its
task id, process, thread, node, semaphore, and the end of the pause it asks for, its
``Backoff.at``), the nemesis's log (each fault's start and end, the processes it killed or
froze, each resize with the times its call was made and returned), and at the very end the
backend's ``status`` of every semaphore. The backend runs on this host: its clock is the
wall clock the marks carry. Definitions:

``seconds``   the length of the soak (faults and load), without the drain.
``faults``    faults injected.
``tasks_sent`` / ``tasks_run``  tasks sent; sent tasks with at least one completed run (a
              start and an end mark in the same process and thread). A run that raised
              ``Backoff`` (its line in the backoff log, after its start in the same process
              and thread) did not complete: it stopped at that line.
``lost``      tasks sent that never completed a run by the end of the drain, but for one
              that never started and was sent within 0.5 s before (or 0.1 s after) a
              ``broker_restart`` SIGKILL: kombu's Redis transport pops a message before it
              records it as unacknowledged, and the kill may lose it (details:
              ``lost_in_broker_kill_window``); nor one that the broker's AOF shows taken
              off its queue by such a pop with no record of the delivery before the broker
              restarted (:mod:`chaos.aof`; also ``lost_popped_as_broker_died``).
``duplicates`` task ids whose body ran to its end more than once for a reason other than a
              documented at-least-once redelivery. A body killed mid-run and run again is
              at-least-once (it completed once); so is a run that raised ``Backoff`` and the
              run after it (the library gives the call back to wait and run again, issue #36:
              the run that raised did not complete). Two completed runs are a duplicate, unless
              the process that ran the earlier one (its pool process, or its worker's main
              process) was SIGKILLed by the nemesis while it ran or within 2 s after that
              run's end mark, or,
              for a run that ended during a broker outage, within 10 s after the broker came
              back (a reconnecting consumer acknowledges nothing): then its result or its
              acknowledgement may never have left, which is Celery's documented
              at-least-once delivery with ``acks_late``.
``over_limit`` moments when the probe saw the bodies of one semaphore running at once hold
              more units than its limit in force (a body with a cost holds that many,
              others one): each body start that took the count above it. The limit in
              force is the declared one, changed by each resize from its call on; while the resize
              call is on its way and for 2 s after it returned, the larger of the old and new
              limit (a body starting then may have been granted before the shrink). The
              adaptive semaphore's limit in force is learned in the backend, between its min
              and max: the checker holds it to its max. A body that raised ``Backoff`` ran
              until its backoff line; another body with no end mark ran until its process was
              killed, else until the next start in its process and thread, else until the end
              of the run.
``over_limit_outside_documented_windows`` those moments outside the windows the README's
              guarantees leave open: from a backend restarted empty (``backend_wipe``: the
              README's "state survives a restart only if Redis persists it") until one lease TTL
              after it is back; an asynchronous-replica failover (``failover``: from the kill
              of the master until one lease TTL after the promotion); and a moment one of whose
              bodies ran in a process paused (``worker_freeze``) past the lease TTL (the README:
              no backend can stop a holder "paused by GC, or swapped out" from running on after
              its lease expired; fencing tokens are the defence).
``stuck_slots_at_end`` slots the backend's ``status`` says are held after the drain, minus the
              bodies the probe shows still running.
``max_recovery_s`` the longest time from a fault's end to the next body start (anywhere),
              over the faults at whose end a sent task had not started yet.
``backoffs``  runs that raised ``Backoff`` (with a time or without).
``backed_off_not_rerun`` sent tasks that raised ``Backoff`` and have no completed run that
              started after their last ``Backoff``: a call given back and never run again
              (it is also ``lost``, unless an earlier run completed).
``started_in_pause`` body starts granted while a pause of their semaphore was in force, as
              far as the checker can tell: a ``Backoff`` with a time, raised at ``t`` (its
              backoff line) asking for a pause until ``u`` (its ``Backoff.at``), has the pause
              made within 0.25 s of ``t`` (the worker hands the exception to its gate, which
              makes the pause in its next write to the backend: 7-102 ms measured) until ``u``
              or later (the gate asks for the time left until ``u``, on the backend's clock); a
              body of that semaphore counts when its grant (the fencing epoch in its start
              mark; with none, its start) falls from ``t`` + 0.25 s to ``u`` - 0.05 s (the
              clock slack: each mark's wall time goes to the monotonic clock through its own
              readings). Bodies granted sooner after ``t`` are not judged. A pause that an
              extension (a later Backoff) lengthens is judged by each Backoff's own ``u``.
``started_in_pause_outside_documented_windows`` those starts but for the pauses that may
              never have been in force as asked: a pause whose making (from ``t`` to
              ``t`` + 0.25 s) met a backend outage (``backend_restart``, ``backend_wipe``,
              ``backend_freeze``, ``backend_cut``, ``failover`` in progress: the gate makes a
              pause once and only logs a failure), a broker outage or the 10 s after it (a
              reconnecting consumer stops handling the pool's results, the exception among
              them, and the loop's backend link: a pause in flight fails), a SIGKILL of the
              process that raised it or of its worker's main process (from 0.1 s before
              ``t``: the exception may never have reached the gate), or a ``worker_freeze``
              of that process (the pause is made after the SIGCONT, with what is left of its
              time); and a grant made after a ``backend_wipe`` or a
              ``failover`` that began after ``t``: the pause may be forgotten (the README:
              state survives a restart only if Redis persists it; an asynchronous replica may
              not have it yet).

The run exits 0 only if ``lost``, ``duplicates``, ``over_limit_outside_documented_windows``,
``stuck_slots_at_end``, ``backed_off_not_rerun`` and
``started_in_pause_outside_documented_windows`` are all 0; before the JSON line it prints the
details (the lost task ids, each duplicate's runs, each moment over a limit, each start in a
pause, recovery per fault, the pauses asked for and excused, how long after its pause's end
each backed-off call's next run was granted, worker log lines at ERROR or worse), and it
leaves its directory (logs, probe, backoff log, sends, faults, report.json) for study.
"""
