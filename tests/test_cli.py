"""``celery -A tests.celery_app semaphore ...`` in subprocesses, against real Redis (and SQLite),
with real workers on Redis and RabbitMQ brokers; ``python -m django semaphore`` too."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from celery_semaphore import Semaphore
from celery_semaphore.backends import get_backend
from tests import servers
from tests.test_settings import MALFORMED_URLS
from tests.test_worker import Cluster
from tests.util import wait_until
from tests.workers import NAME_SUFFIX, ROOT, run_cli


def make_cli(url, **env_extra):
    prefix = f"{servers.unique_tag()}:"
    env = dict(os.environ, CS_SEMAPHORE_BACKEND=url, CS_KEY_PREFIX=prefix, PYTHONPATH=ROOT,
               **env_extra)

    def cli(*args, env_extra=None):
        return run_cli({**env, **(env_extra or {})}, *args)

    cli.url, cli.prefix, cli.env = url, prefix, env
    cli.backend = get_backend(url, key_prefix=prefix)  # to arrange and check state in-process
    return cli


@pytest.fixture
def cli(redis_url):
    return make_cli(redis_url)


def parallel(cli, *commands):
    """Run independent commands side by side (each is a ~1 s Python start-up)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: cli(*args), commands))


def one_error_line(done):
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_resize_status_list_release(cli):
    created = cli("resize", "thumbs", "3", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout) == {"name": "thumbs", "limit": 3, "previous": None,
                                          "created": True, "pinned": True}
    changed = cli("resize", "thumbs", "5")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.strip() == "resized semaphore 'thumbs': limit 3 -> 5 (pinned)"

    first = Semaphore("thumbs", 2, cli.url, key_prefix=cli.prefix).acquire(
        meta={"task_id": "t-42", "worker": "w1@host"})
    second = Semaphore("thumbs", 2, cli.url, key_prefix=cli.prefix).acquire(
        meta={"task_id": "t-43", "worker": "w2@host"})
    cli.backend.resize("thumbs", 2)  # full: the next caller waits
    patient = get_backend(cli.url, key_prefix=cli.prefix, waiter_ttl=120)  # a slow machine
    queued = patient.acquire("thumbs", "waiter-1", limit=2, ttl=30,
                             meta={"task_id": "t-44", "worker": "w1@host"}, wait=True)
    assert queued.grant is None and queued.position == 0

    status, human, listed = parallel(cli, ("status", "thumbs", "--json"), ("status", "thumbs"),
                                     ("list", "--json"))
    status = json.loads(status.stdout)
    assert status["name"] == "thumbs" and status["limit"] == 2
    assert status["held"] == 2 and status["waiting"] == 1
    assert list(status["declared"]) == ["2"]  # the limit the holders' callers declared
    holders = {h["meta"]["task_id"]: h for h in status["holders"]}
    assert holders["t-42"]["holder"] == first.holder
    assert holders["t-42"]["token"] == str(first.token)
    assert holders["t-42"]["meta"]["worker"] == "w1@host"
    assert holders["t-42"]["expires_at"] > holders["t-42"]["since"]
    assert [w["meta"]["task_id"] for w in status["waiters"]] == ["t-44"]

    human = human.stdout
    assert re.search(r"^  limit +2 \(pinned by resize\)$", human, re.M)
    assert re.search(r"^  waiting +1$", human, re.M)
    header = next(line for line in human.splitlines() if "TASK ID" in line and "TOKEN" in line)
    row = next(line for line in human.splitlines() if "t-42" in line)
    assert header.index("TASK ID") == row.index("t-42")  # an aligned table
    assert header.index("TOKEN") == row.index(str(first.token))
    assert re.search(r"\ds ago +in \d+s", row)  # since, expiry: relative times
    assert "t-44" in human

    assert json.loads(listed.stdout) == [
        {"name": "thumbs", "limit": 2, "pinned": True, "declared": [2], "held": 2,
         "units": 2, "waiting": 1, "parked": 0, "paused_until": None, "pause_reason": "",
         "quotas": [], "adaptive": None}]
    # release by holder id, and by task id; a holder that holds nothing is an error
    by_holder, by_task, nobody = parallel(cli, ("release", "thumbs", first.holder, "--json"),
                                          ("release", "thumbs", "t-43"),
                                          ("release", "thumbs", "waiter-1"))
    assert by_holder.returncode == 0, by_holder.stderr
    assert json.loads(by_holder.stdout)["task_id"] == "t-42" and not first.verify()
    assert by_task.returncode == 0 and second.holder in by_task.stdout and not second.verify()
    assert nobody.returncode == 1
    assert one_error_line(nobody) == "Error: waiter-1 holds no slot of semaphore 'thumbs'"
    assert cli.backend.status("thumbs").limit == 2
    # a task id that several holders share names none of them
    twins = [Semaphore("dups", 2, cli.url, key_prefix=cli.prefix).acquire(
        meta={"task_id": "t-dup"}) for _ in range(2)]
    ambiguous = cli("release", "dups", "t-dup")
    assert ambiguous.returncode == 1
    assert "task id t-dup matches 2 holders" in one_error_line(ambiguous)
    assert all(twin.verify() for twin in twins)


def test_reset_needs_confirmation_and_unknown_status_exits_1(cli):
    cli.backend.resize("gone", 2)
    refused = cli("reset", "gone")
    assert refused.returncode == 2 and "pass --yes" in refused.stderr
    assert "Usage:" in refused.stderr
    assert cli.backend.status("gone").limit == 2
    done = cli("reset", "gone", "--yes", "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == {"name": "gone", "reset": True}
    unknown = cli("status", "gone", "--json")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert one_error_line(unknown).startswith("Error: unknown semaphore 'gone' in ")


USAGE_ERRORS = [
    (("resize", "x", "0"), "must be a positive integer, not 0"),
    (("resize", "x", "-1"), "must be a positive integer, not -1"),
    (("resize", "x", "abc"), "must be a positive integer, not 'abc'"),
    (("resize", "bad name", "3"), "contains ' '"),
    (("status", "x{y}"), "contains '{'"),
    (("release", "a/b", "h"), "contains '/'"),
    (("reset", "x", "--yes", "--bogus"), "No such option"),
    (("resize", "x", "99999999999999999999999999"), "must be at most 100000"),
    (("reset", "x"), "pass --yes"),  # no terminal to confirm on
    (("workers", "--timeout", "nan"), "must be a finite number of seconds"),
    (("workers", "--timeout", "inf"), "not in the range"),
    (("resize", "x", "4_0"), "not '4_0' (ASCII digits only)"),
    (("resize", "x", "\u0663"), "(ASCII digits only)"),
    (("resize", "x\u200b", "3"), "invisible character U+200B"),
]


def test_usage_errors_exit_2_and_change_nothing(cli):
    cli.backend.resize("x", 3)
    runs = parallel(cli, *(args for args, _ in USAGE_ERRORS))
    for (args, message), done in zip(USAGE_ERRORS, runs):
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith("Usage: python -m celery semaphore "), done.stderr
        assert message in done.stderr.strip().splitlines()[-1], (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert cli.backend.names() == ["x"] and cli.backend.status("x").limit == 3


def test_unreachable_backend_and_broker_are_one_line(cli):
    with ThreadPoolExecutor(2) as pool:
        backend, broker = pool.map(lambda args: cli(*args[0], env_extra=args[1]), [
            (("--backend", "redis://:secret@127.0.0.1:1/0", "list"), None),
            (("workers",), {"CS_BROKER_URL": "amqp://guest:secret@127.0.0.1:1//"}),
        ])
    assert backend.returncode == 1
    line = one_error_line(backend)
    assert "redis://:**@127.0.0.1:1/0" in line and "secret" not in backend.stderr
    assert broker.returncode == 1
    line = one_error_line(broker)
    assert "cannot reach the broker amqp://guest:**@127.0.0.1:1//" in line
    assert "secret" not in broker.stderr


def test_malformed_backend_urls_are_one_line_usage_errors_without_the_password(cli):
    runs = parallel(cli, *(("--backend", url, "list") for url, _ in MALFORMED_URLS))
    for (url, message), done in zip(MALFORMED_URLS, runs):
        assert done.returncode == 2, (url, done.stderr)
        assert done.stderr.startswith("Usage: "), done.stderr
        assert message in done.stderr.strip().splitlines()[-1], (url, done.stderr)
        assert "Traceback" not in done.stderr and "S3cretPW" not in done.stderr + done.stdout
    # An unreachable server whose URL carries a password or a token: exit 1, one line.
    unreachable = parallel(cli, ("--backend", "consul://:S3cretPW@127.0.0.1:1", "list"),
                           ("--backend", "consul://127.0.0.1:1?token=S3cretPW", "list"))
    for done in unreachable:
        assert done.returncode == 1, done.stderr
        one_error_line(done)
        assert "S3cretPW" not in done.stderr + done.stdout


def test_global_options_work_on_either_side_of_the_subcommand(cli):
    after, before = parallel(cli, ("resize", "late", "2", "--backend", cli.url),
                             ("--backend", cli.url, "resize", "early", "3"))
    assert after.returncode == 0 and before.returncode == 0, (after.stderr, before.stderr)
    assert cli.backend.status("late").limit == 2 and cli.backend.status("early").limit == 3
    listed = cli("list", "--json", "--backend", "redis://127.0.0.1:1/0")
    assert listed.returncode == 1 and "127.0.0.1:1" in listed.stderr  # not the app's setting


def test_resize_pins_and_unpin_releases_it(cli):
    old = Semaphore("pin", 2, cli.url, key_prefix=cli.prefix, declared_at=1000.0)
    old.try_acquire().release()
    pinned = cli("resize", "pin", "5", "--json")
    assert json.loads(pinned.stdout) == {"name": "pin", "limit": 5, "previous": 2,
                                         "created": False, "pinned": True}
    new = Semaphore("pin", 3, cli.url, key_prefix=cli.prefix, declared_at=2000.0)
    new.try_acquire().release()  # a newer declaration: the pin keeps 5
    status, listed = parallel(cli, ("status", "pin"), ("list",))
    assert re.search(r"^  limit +5 \(pinned by resize\)$", status.stdout, re.M), status.stdout
    assert re.search(r"^  declared +2 \(\d+s ago\), 3 \(newest, \d+s ago\)$", status.stdout,
                     re.M), status.stdout
    assert "`resize pin --unpin` puts the newest declared limit (3) in force" in status.stdout
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "LIMIT", "PINNED", "DECLARED", "HELD", "UNITS",
                              "WAITING", "PARKED"]
    assert row.split() == ["pin", "5", "pinned", "2,3", "0", "0", "0", "0"]
    unpinned, both, neither, unknown = parallel(
        cli, ("resize", "pin", "--unpin", "--json"), ("resize", "pin", "4", "--unpin"),
        ("resize", "pin"), ("resize", "nothing-here", "--unpin"))
    assert json.loads(unpinned.stdout) == {"name": "pin", "limit": 3, "previous": 5,
                                           "was_pinned": True, "pinned": False}
    assert both.returncode == 2 and "--unpin takes no LIMIT" in both.stderr
    assert neither.returncode == 2 and "Missing argument 'LIMIT'" in neither.stderr
    assert unknown.returncode == 1
    assert one_error_line(unknown).startswith("Error: unknown semaphore 'nothing-here'")
    status = cli.backend.status("pin")
    assert (status.limit, status.pinned) == (3, False)
    assert "note:" in cli("status", "pin").stdout  # 2 is declared too (an older process)


def test_sync_changes_nothing_and_shows_what_differs(cli):
    settings = json.dumps({"semaphore_limits": {"reports": 3, "exports": 2, "same": 4,
                                                "newer": 5, "api:{customer_id}": 2}})
    extra = {"CS_SETTINGS": settings}
    cli.backend.resize("reports", 1)  # pinned
    Semaphore("same", 4, cli.url, key_prefix=cli.prefix).try_acquire().release()
    Semaphore("newer", 6, cli.url, key_prefix=cli.prefix).try_acquire().release()
    with ThreadPoolExecutor(2) as pool:
        human, done, dry = pool.map(lambda args: cli(*args, env_extra=extra),
                                    [("sync",), ("sync", "--json"), ("sync", "--dry-run")])
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines() == [
        "exports: not created yet (the first acquire creates it with 2)",
        "newer: limit 6, configured 5: declared otherwise by a process started later",
        "reports: limit 1, configured 3: pinned by resize (`resize reports --unpin` to "
        "follow the code)"]
    assert json.loads(done.stdout) == [
        {"name": "exports", "configured": 2, "limit": None, "pinned": False},
        {"name": "newer", "configured": 5, "limit": 6, "pinned": False},
        {"name": "reports", "configured": 3, "limit": 1, "pinned": True}]
    assert dry.stdout == human.stdout
    assert cli.backend.status("reports").limit == 1 and cli.backend.status("exports") is None
    assert sorted(cli.backend.names()) == ["newer", "reports", "same"]


def test_without_an_app_and_on_sqlite(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    url = f"sqlite:///{tmp_path}/s.db"
    lease = Semaphore("a", 2, url).acquire(meta={"task_id": "t-1"})
    with ThreadPoolExecutor(2) as pool:
        bare, with_backend = pool.map(lambda args: run_cli(env, *args, app=False, cwd=tmp_path),
                                      [("list",), ("--backend", url, "status", "a", "--json")])
    assert bare.returncode == 2 and "no app: pass -A/--app or --backend" in bare.stderr
    assert bare.stderr.startswith("Usage: ")
    assert with_backend.returncode == 0, with_backend.stderr
    status = json.loads(with_backend.stdout)
    assert status["limit"] == 2 and status["holders"][0]["holder"] == lease.holder


def test_django_manage_py_semaphore(redis_url):
    prefix = f"{servers.unique_tag()}:"
    env = dict(os.environ, CS_SEMAPHORE_BACKEND=redis_url, CS_KEY_PREFIX=prefix,
               PYTHONPATH=ROOT)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    settings_env = dict(env, DJANGO_SETTINGS_MODULE="tests.django_project.settings")

    def django(args, env=env):
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)

    call_command = """if True:
        import io, json, django
        django.setup()
        from django.core.management import CommandError, call_command
        out = io.StringIO()
        call_command("semaphore", "resize", "reports", "3", "--json", stdout=out)
        try:
            call_command("semaphore", "resize", "reports", "0", stderr=io.StringIO())
        except CommandError as exc:
            print(json.dumps([json.loads(out.getvalue()), exc.returncode, str(exc)]))
    """
    with ThreadPoolExecutor(2) as pool:
        listed = pool.submit(django, ["-m", "django", "semaphore", "list", "--json",
                                      "--settings=tests.django_project.settings"])
        called = pool.submit(django, ["-c", call_command], settings_env)
        listed, called = listed.result(), called.result()
    # `--settings` is Django's: manage.py applied it, click never sees it
    assert listed.returncode == 0, listed.stderr
    # (the list runs beside the resize: it sees the semaphore or not, never half of it)
    rows = json.loads(listed.stdout)
    assert rows == [] or rows == [{"name": "reports", "limit": 3, "pinned": True,
                                   "declared": [], "held": 0, "units": 0, "waiting": 0,
                                   "parked": 0, "paused_until": None, "pause_reason": "",
                                   "quotas": [], "adaptive": None}]
    # call_command(): output on its stdout, errors as CommandError with the CLI's exit code
    assert called.returncode == 0, called.stderr
    result, code, message = json.loads(called.stdout)
    assert result == {"name": "reports", "limit": 3, "previous": None, "created": True,
                      "pinned": True}
    assert code == 2 and "must be a positive integer, not 0" in message
    bad = django(["-m", "django", "semaphore", "--settings", "tests.django_project.settings",
                  "resize", "reports", "-1"])
    assert bad.returncode == 2 and bad.stderr.startswith("Usage: python -m django semaphore")
    assert get_backend(redis_url, key_prefix=prefix).status("reports").limit == 3


# -- a live resize while two workers are under load --------------------------------------

HOLD = 0.25  # seconds each guarded body runs


class Backlog:
    """Keeps ``depth`` guarded tasks sent but not started, so the workers stay under load."""

    def __init__(self, cluster, depth=6):
        self.task = cluster.task("guarded")  # semaphore "images", declared limit 2
        self.probe = cluster.probe
        self.depth = depth
        self.sent = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stopped.is_set():
            started = sum(1 for kind, key, _, _ in self.probe.events() if kind == "start")
            while self.sent - started < self.depth:
                self.task.delay(f"r{self.sent}", HOLD)
                self.sent += 1
            time.sleep(0.05)

    def stop(self):
        self.stopped.set()
        self.thread.join(10)


def runs(probe):
    return [(s, e) for key, ivs in probe.intervals().items() if key.startswith("guarded:")
            for s, e in ivs]


def levels(intervals):
    """[(t, bodies running from t on)], in time order."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals if e])
    out, level = [], 0
    for t, delta in points:
        level += delta
        out.append((t, level))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["amqp", "redis"])
def test_live_resize_under_load(broker, redis_url, amqp_url, tmp_path):
    broker_url = servers.redis_broker(redis_url) if broker == "redis" else amqp_url
    # A control exchange of its own: `workers` hears only this test's two workers.
    settings = json.dumps({"control_exchange": servers.unique_tag()})
    cluster = Cluster(str(tmp_path), redis_url, broker_url, redis_url, CS_SETTINGS=settings)
    backlog = None

    def cli(*args):
        return run_cli(cluster.env, *args)

    def now():
        return time.monotonic_ns()  # the probe's clock

    try:
        backlog = Backlog(cluster)
        assert wait_until(lambda: len(runs(cluster.probe)) >= 3, timeout=20)
        listing = cli("workers", "--json", "--timeout", "1")
        assert listing.returncode == 0, listing.stderr
        replies = json.loads(listing.stdout)
        assert sorted(name.split("@")[0] for name in replies) == [f"w0{NAME_SUFFIX}",
                                                                   f"w1{NAME_SUFFIX}"]
        held = [h for w in replies.values() for h in w["held"]]
        waiting = [r for w in replies.values() for r in w["waiting"]]
        assert len(held) <= 2 and waiting, replies
        assert {r["semaphore"] for r in held + waiting} == {"images"}
        human = cli("workers", "--timeout", "1").stdout
        assert "position -" not in human
        assert re.search(rf"w0{NAME_SUFFIX}@\S+: \d+ held, \d+ waiting \(\d+ in the "
                         r"backend's queue, \d+ in the worker's own line\)", human), human

        grow_start = now()
        assert cli("resize", "images", "4").returncode == 0
        grown = now()
        time.sleep(1.2)
        shrunk_cli = cli("resize", "images", "1", "--json")
        shrunk = now()
        assert json.loads(shrunk_cli.stdout)["previous"] == 4
        time.sleep(1.0)  # the backlog keeps coming at limit 1
        backlog.stop()
        assert wait_until(lambda: sum(cluster.probe.completed("guarded:").values())
                          == backlog.sent, timeout=30)
        completed = cluster.probe.completed("guarded:")
        assert len(completed) == backlog.sent and set(completed.values()) == {1}

        intervals = runs(cluster.probe)
        timeline = levels(intervals)
        # before the grow: never more than the declared limit 2
        assert max(level for t, level in timeline if t < grow_start) == 2
        # grow: 4 bodies run within 1 s of the resize
        reached = [t for t, level in timeline if level == 4 and t > grow_start]
        assert reached and reached[0] <= grown + 1_000_000_000, (reached[:1], grown)
        # never more than the limit of the moment
        assert max(level for _, level in timeline) == 4
        # shrink: the holders admitted before the resize drain within 1 s; every body that
        # starts after that runs alone
        margin = 100_000_000  # admission -> probe mark latency in the worker
        old = [iv for iv in intervals if iv[0] <= shrunk + margin]
        drained = max(e for _, e in old)
        assert drained <= shrunk + 1_000_000_000
        late = [iv for iv in intervals if iv[0] > drained]
        assert len(late) >= 3, "too little ran after the shrink"
        for start, _ in late:
            alone = sum(1 for s, e in intervals if s <= start < e)
            assert alone == 1, f"{alone} bodies ran at once after the shrink"
    finally:
        if backlog is not None:
            backlog.stop()
        cluster.stop()


def test_a_shared_broker_without_semaphore_backend_is_a_usage_error(redis_url):
    """The CLI resolves the default backend as the worker does: a Sentinel broker with no
    semaphore_backend must not quietly read a per-host SQLite file."""
    env = dict(os.environ, CS_BROKER_URL="sentinel://127.0.0.1:1", CS_SEMAPHORE_BACKEND="",
               PYTHONPATH=ROOT)
    done = run_cli(env, "list")
    assert done.returncode == 2, done.stderr
    assert "semaphore_backend is not set" in done.stderr and "Traceback" not in done.stderr
