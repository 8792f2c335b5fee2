"""The Celery app the worker tests run in real ``celery worker`` subprocesses.

Configured from environment variables (``CS_*``) so that each test cluster points its workers at
its own broker, queue, semaphore backend, key prefix and probe file; the test process builds
the same app from the same variables to send tasks.
"""

import json
import os
import time

from celery import Celery, signals
from celery.exceptions import Reject, SoftTimeLimitExceeded

import celery_semaphore
from tests.probe import Probe


def create_app(env):
    app = Celery("tests.celery_app", set_as_current=False)
    app.conf.update(
        broker_url=env.get("CS_BROKER_URL", "redis://127.0.0.1:6379/14"),
        result_backend=env.get("CS_RESULT_BACKEND") or None,
        semaphore_backend=env.get("CS_SEMAPHORE_BACKEND") or None,
        semaphore_key_prefix=env.get("CS_KEY_PREFIX", "semaphore:"),
        semaphore_lease_ttl=float(env.get("CS_LEASE_TTL", "60")),
        semaphore_retry_backoff=0.2,
        semaphore_retry_backoff_max=1.0,
        task_default_queue=env.get("CS_QUEUE", "celery"),
        worker_prefetch_multiplier=int(env.get("CS_PREFETCH", "4")),
        # kombu's restore lock lapses after 5 s, not 300: a worker a test kills while it
        # holds the lock (in the broker database every test shares) would keep every other
        # worker from restoring a killed worker's messages for five minutes
        # (docs/limitations.md)
        broker_transport_options={"polling_interval": 0.05, "unacked_mutex_expire": 5},
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    if env.get("CS_SETTINGS"):
        app.conf.update(json.loads(env["CS_SETTINGS"]))
    celery_semaphore.install(app)
    if env.get("CS_CHILD_START_DELAY"):  # pool children that take this long to come up
        delay = float(env["CS_CHILD_START_DELAY"])
        signals.worker_process_init.connect(lambda **kwargs: time.sleep(delay), weak=False)
    probe = Probe(env.get("CS_PROBE", "/tmp/celery-semaphore-probe.log"))

    def body(key, hold):
        """Mark the start and end of `key` around a hold: seconds, or a path (str) to wait
        for, at most two minutes, so a test decides when the task ends."""
        probe.mark("start", key)
        try:
            if isinstance(hold, str):
                deadline = time.monotonic() + 120
                while not os.path.exists(hold) and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                time.sleep(hold)
        finally:
            probe.mark("end", key)

    def task(**options):
        def register(fun):
            return app.task(name=f"tests.celery_app.{fun.__name__}", shared=False,
                            **options)(fun)
        return register

    @task(semaphore="images", limit=2)
    def guarded(key, hold=0.05):
        body(f"guarded:{key}", hold)
        return key

    @task(semaphore="api:{customer_id}", limit=1)
    def per_customer(customer_id, key, hold=0.05):
        body(f"customer-{customer_id}:{key}", hold)
        return key

    @task()
    def unguarded(key, hold=0.01):
        body(f"free:{key}", hold)
        return key

    @task(semaphore="slow", limit=1)
    def slow(key, hold=30.0):
        body(f"slow:{key}", hold)
        return key

    @task(semaphore="slow", limit=1, acks_late=True)
    def slow_late(key, hold=30.0):
        """``slow``, acknowledged when it ends: its message is unacknowledged while it runs."""
        body(f"slow:{key}", hold)
        return key

    @task(semaphore="limited", limit=1, soft_time_limit=0.5, time_limit=1.0)
    def time_limited(key, hold=5.0, obey_soft_limit=True):
        probe.mark("start", f"limited:{key}")
        try:
            time.sleep(hold)
        except SoftTimeLimitExceeded:
            if obey_soft_limit:
                raise
            time.sleep(hold)  # ignore it: the hard limit kills the process
        finally:
            probe.mark("end", f"limited:{key}")

    @task(semaphore="fails", limit=1)
    def fails(key):
        body(f"fails:{key}", 0.01)
        raise ValueError(key)

    @task(semaphore="retrying", limit=1, bind=True, max_retries=2)
    def retrying(self, key):
        body(f"retrying:{key}:{self.request.retries}", 0.01)
        if self.request.retries < 2:
            raise self.retry(countdown=0.1)
        return self.request.retries

    @task(semaphore="sub:{p[c]}", limit=1)
    def subscript(p, key):
        body(f"subscript:{key}", 0.01)
        return key

    @task(semaphore="num:{n:d}", limit=1)
    def numbered(n, key):
        body(f"numbered:{key}", 0.01)
        return key

    @task(semaphore="routed", limit=1, bind=True)
    def routed(self, key, hold=0.02):
        """Returns the worker that ran it (routing: a task runs only where it was routed)."""
        body(f"routed:{key}", hold)
        return self.request.hostname

    @task(semaphore="rejecting", limit=1, acks_late=True)
    def rejects_once(key):
        """Rejected with requeue on its first run (``Reject(requeue=True)``), then runs."""
        marker = os.path.join(env.get("CS_DIR", "/tmp"), f"rejected-{key}")
        first = not os.path.exists(marker)
        body(f"rejecting:{key}", 0.6 if first else 0.01)  # the first outlasts the doorbell's
        if first:  # second look at its parking queue
            open(marker, "w").close()
            raise Reject("once", requeue=True)
        return key

    @task(semaphore="lease", limit=3)
    def lease_info():
        lease = celery_semaphore.current_lease()
        return {"name": lease.name, "limit": lease.limit, "slot": lease.token.slot,
                "epoch": lease.token.epoch, "holder": lease.holder, "verified": lease.verify()}

    def request_and_lease(request):
        """The whole request as the task sees it (repr'd), and what its lease says."""
        lease = celery_semaphore.current_lease()
        seen = {"request": repr(vars(request)), "headers": repr(request.headers), "lease": None}
        if lease is not None:
            lease.ensure()  # raises LeaseLost unless the backend says it is held
            seen["lease"] = {"name": lease.name, "verified": lease.verify(),
                             "leases": sorted(celery_semaphore.current_leases())}
        return seen

    @task(semaphore="lease", limit=3, bind=True)
    def guarded_request(self):
        return request_and_lease(self.request)

    @task(bind=True)
    def unguarded_request(self):
        return request_and_lease(self.request)

    @task(semaphore="once:{key}", limit=1, semaphore_on_full="skip")
    def run_once(key, run, hold=0.05):
        body(f"once:{key}:{run}", hold)
        return run

    @task(semaphore="strict", limit=1, semaphore_on_full="fail")
    def strict(key, hold=0.05):
        body(f"strict:{key}", hold)
        return key

    @task(semaphore="shared", limit=1, semaphore_fair_by="{tenant}")
    def fair_tenant(tenant, key, hold=0.05):
        body(f"fair:{tenant}:{key}", hold)
        return key

    @task(semaphore=["saas", "saas:{customer_id}"], limit={"saas": 3, "saas:{customer_id}": 1})
    def tenant_call(customer_id, key, hold=0.05):
        """A global cap (3) plus a per-tenant limit (1): both held together."""
        body(f"tenant:{customer_id}:{key}", hold)
        leases = celery_semaphore.current_leases()
        return {name: {"limit": lease.limit, "token": str(lease.token), "holder": lease.holder,
                       "verified": lease.verify()} for name, lease in leases.items()}

    # A limit that comes from the environment, as a deploy changes it (tests/test_limits.py).
    deploy_limit = int(env.get("CS_DEPLOY_LIMIT", "4"))

    @task(semaphore="deploy", limit=deploy_limit)
    def deployed(key, hold=0.3):
        body(f"deploy:{key}", hold)
        return key

    @task(semaphore="deployk:{part}", limit=deploy_limit)
    def deployed_key(part, key, hold=0.3):
        body(f"deployk:{part}:{key}", hold)
        return key

    # Costs and rates need a backend that applies them atomically: a worker on the RabbitMQ
    # backends refuses to start with such a task, so they exist only on the others.
    backend_url = env.get("CS_SEMAPHORE_BACKEND") or env.get("CS_BROKER_URL", "redis://")
    if not backend_url.startswith("amqp"):
        @task(semaphore="gpu", limit=8, semaphore_cost="{gb}")
        def gpu(gb, key, hold=0.05):
            """Holds ``gb`` units of the limit of 8 (its probe key ends with its cost)."""
            body(f"gpu:{key}:{gb}", hold)
            return key

        @task(semaphore="paced", semaphore_rate="20/s")
        def paced(key, hold=0.01):
            """At most 20 starts a second, cluster-wide; no limit on how many run."""
            body(f"paced:{key}", hold)
            return key

    @task(semaphore="ranked", limit=1)
    def ranked(key, hold=0.05):
        """Sent with headers={"semaphore_priority": n} to go first."""
        body(f"ranked:{key}", hold)
        return key

    # -- issue #36: an API behind the task (tests/test_upstream_worker.py) --------------
    # The backends that pause, count quotas and learn limits (not RabbitMQ nor Consul).
    if not (env.get("CS_SEMAPHORE_BACKEND") or env.get("CS_BROKER_URL", "")).startswith(
            ("amqp", "consul")):
        def backs_off_once(key, seconds, hold):
            """Raise Backoff(retry_after=seconds) at the first run of ``key`` (a marker file
            says it ran), then run: the probe sees the first run and the one after the
            pause."""
            marker = os.path.join(os.path.dirname(probe.path), f"backed-off-{key}")
            body(f"api:{key}", hold)
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise celery_semaphore.Backoff(retry_after=seconds, reason="429 from the API")
            return key

        @task(semaphore="partner", limit=2, bind=True)
        def partner(self, key, seconds=2.0, hold=0.05):
            """A call to a partner API that answers 429 with Retry-After once per key."""
            result = backs_off_once(key, seconds, hold)
            return [result, self.request.retries]

        @task(semaphore="ahead", limit=4)
        def ahead_call(key, hold, seconds=None):
            """Holds until ``hold`` (a path or seconds); with ``seconds``, backs off once."""
            if seconds is None:
                body(f"ahead:{key}", hold)
                return key
            return backs_off_once(key, seconds, hold)

        @task(semaphore="partner", limit=2, semaphore_max_wait=2.0, bind=True)
        def partner_short(self, key, seconds=30.0, hold=0.05):
            """The same call, which may wait 2 s in all."""
            return [backs_off_once(key, seconds, hold), self.request.retries]

        @task(semaphore="quota:{tenant}", semaphore_quota="3/2s")
        def quota_call(tenant, key, hold=0.01):
            """At most 3 starts per 2-second window (UTC-aligned) per tenant."""
            body(f"quota-{tenant}:{key}", hold)
            return key

        @task(semaphore="tokens", semaphore_quota="100/2s", semaphore_units="{estimate}")
        def token_call(key, estimate, actual, hold=0.01):
            """Admitted on its estimate; settles what it really spent."""
            body(f"tokens:{key}", hold)
            celery_semaphore.current_lease().settle(actual)
            return key

        @task(semaphore="learned", limit=celery_semaphore.Adaptive(min=1, max=8, increase=4.0))
        def learned(key, overload=False, hold=0.02):
            """An adaptive limit: a Backoff() with no time reports overload."""
            body(f"learned:{key}", hold)
            if overload and not os.path.exists(os.path.join(os.path.dirname(probe.path),
                                                            f"backed-off-{key}")):
                open(os.path.join(os.path.dirname(probe.path), f"backed-off-{key}"),
                     "w").close()
                raise celery_semaphore.Backoff()
            return key

    app.probe = probe
    return app


def kill_the_broker_at(point, armed):
    """Fault injection for the broker outage tests (``CS_BROKER_KILL_AT``): in the worker, the
    first time the waiting room reaches ``point`` once the file ``armed`` exists, SIGKILL the
    broker (``CS_BROKER_PID``) and wait until its port refuses connections, then go on (the
    call in progress meets a dead broker). Points: ``park-before-publish`` (a parked copy about
    to be published), ``park-after-publish`` (published, the original not acked yet),
    ``mid-pull`` (messages taken from a lane, not yet routed back to their task queue),
    ``consumer-record`` (the consumer's record of a doorbell it received applied by the
    broker, whose reply never reaches the worker), ``take-record`` (a take from a lane run by
    the broker, whose reply never reaches the worker). For the two park points, ``armed`` may
    hold a string the parked copy's body must contain (the test's own request, ``"k6"``)."""
    import signal
    import socket
    from urllib.parse import urlparse

    from celery_semaphore.worker import celery_internals, parking

    pid, port = int(os.environ["CS_BROKER_PID"]), urlparse(os.environ["CS_BROKER_URL"]).port
    done = []

    def kill():
        if done or not os.path.exists(armed):
            return
        done.append(True)
        _kill_and_wait()

    def kill_parking(request):
        # the armed file may name what the parked copy must carry ("k6"): only the park of
        # the request the test sent after arming meets the kill, not one the worker parks
        # again on its own (a request pulled back and parked once more) while the test's
        # publish is on its way (a compat CI run on Celery 5.3 saw that publish cut off)
        if done or not os.path.exists(armed):
            return
        with open(armed) as named:
            wanted = named.read().strip()
        body = request.message.body
        if wanted and wanted.encode() not in (body if isinstance(body, bytes) else
                                              str(body).encode()):
            return
        done.append(True)
        _kill_and_wait()

    def _kill_and_wait():
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            except OSError:
                return
            time.sleep(0.01)

    if point in ("park-before-publish", "park-after-publish"):
        publish = parking.publish_copy

        def publish_copy(*args, **kwargs):
            if point == "park-before-publish":
                kill_parking(args[1])
            publish(*args, **kwargs)
            if point == "park-after-publish":
                kill_parking(args[1])

        parking.publish_copy = publish_copy
    elif point == "consumer-record":
        from kombu.transport import redis as kombu_redis
        from kombu.utils.json import dumps
        from redis.exceptions import ConnectionError as RedisConnectionError

        append = kombu_redis.QoS.append

        def append_then_die(self, message, delivery_tag):
            if done or not os.path.exists(armed) or (
                    (message.headers or {}).get("task") != "celery_semaphore.doorbell"):
                return append(self, message, delivery_tag)
            # the broker applies kombu's record of the delivery (QoS.append's transaction, as
            # kombu 5.x writes it) and dies before its reply reaches the worker
            info = message.delivery_info
            with self.pipe_or_acquire() as pipe:
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
                    self.unacked_key, delivery_tag,
                    dumps([message._raw, info["exchange"], info["routing_key"]])).execute()
            kill()
            raise RedisConnectionError("Connection closed by server.")

        kombu_redis.QoS.append = append_then_die
    elif point == "take-record":
        import redis as redis_py

        eval_ = redis_py.Redis.eval

        def eval_then_die(self, script, *args, **kwargs):
            if done or not os.path.exists(armed) or script != celery_internals._TAKE_SCRIPT:
                return eval_(self, script, *args, **kwargs)
            # the broker runs the take (the message leaves its lane, recorded unacked for this
            # worker) and dies before its reply reaches the worker
            eval_(self, script, *args, **kwargs)
            kill()
            raise redis_py.exceptions.ConnectionError("Connection closed by server.")

        redis_py.Redis.eval = eval_then_die
    elif point == "mid-pull":
        reroute = celery_internals.reroute_unacked

        def reroute_unacked(channel, reroutes):
            if reroutes:
                kill()
            return reroute(channel, reroutes)

        celery_internals.reroute_unacked = reroute_unacked
    else:
        raise ValueError(f"CS_BROKER_KILL_AT: no such point {point!r}")


def fail_a_pull(armed, kind="AttributeError", times=1):
    """Fault injection (``CS_PULL_FAULT_ARMED``): in the worker, the first ``times`` takes of
    a parked message once the file ``armed`` exists raise ``kind`` (``CS_PULL_FAULT_KIND``,
    ``AttributeError`` or ``TypeError``; ``CS_PULL_FAULT_TIMES``), as a bug in the waiting
    room's pull would, with the broker answering (no entry taken)."""
    from celery_semaphore.worker import celery_internals

    take, done = celery_internals.take_unacked, []
    error = {"AttributeError": AttributeError, "TypeError": TypeError}[kind]

    def take_unacked(queue, *args):
        if len(done) < times and os.path.exists(armed):
            done.append(True)
            raise error("injected: a bug in the pull")
        return take(queue, *args)

    celery_internals.take_unacked = take_unacked


def hold_backend_calls(armed):
    """Fault injection (``CS_HOLD_CALLS_ARMED``): in the worker, once the file ``armed``
    exists, the calls asked on the event loop's link to the Redis backend are kept there,
    never written (as calls still on their way when the worker stops), and the worker says
    so once, on stderr: "test: backend calls held"."""
    import sys

    from celery_semaphore.backends.redis import hublink

    flush, said = hublink._Connection.flush, []

    def held_flush(self):
        if self.role == "commands" and os.path.exists(armed):
            if self.queued and not said:
                said.append(True)
                print("test: backend calls held", file=sys.__stderr__, flush=True)
            return
        flush(self)

    hublink._Connection.flush = held_flush


def record_acceptance(path):
    """Test instrument (``CS_ACCEPTED_PROBE``): the worker's main process marks
    ``accepted <task's short name>:<its first argument>`` in the file ``path`` (as ``guarded``'s
    body names its key) when its pool accepts a task, before Celery acknowledges the task's
    message (``acks_late`` off). A worker killed after that ack and before the body began lost
    the task by Celery's own at-most-once, not by the waiting room: a test tells them apart."""
    from celery.worker import request

    accepted, probe = request.task_accepted, Probe(path)

    def task_accepted(req, *args, **kwargs):
        probe.mark("accepted", f"{req.task_name.rsplit('.', 1)[-1]}:{req.args[0]}")
        return accepted(req, *args, **kwargs)

    request.task_accepted = task_accepted


app = create_app(os.environ)
if os.environ.get("CS_ACCEPTED_PROBE"):
    record_acceptance(os.environ["CS_ACCEPTED_PROBE"])
if os.environ.get("CS_HOLD_CALLS_ARMED"):
    hold_backend_calls(os.environ["CS_HOLD_CALLS_ARMED"])
if os.environ.get("CS_PULL_FAULT_ARMED"):
    fail_a_pull(os.environ["CS_PULL_FAULT_ARMED"],
                os.environ.get("CS_PULL_FAULT_KIND", "AttributeError"),
                int(os.environ.get("CS_PULL_FAULT_TIMES", "1")))
if os.environ.get("CS_BROKER_KILL_AT"):
    kill_the_broker_at(os.environ["CS_BROKER_KILL_AT"], os.environ["CS_BROKER_KILL_ARMED"])
