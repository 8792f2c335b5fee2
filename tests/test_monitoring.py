"""Monitoring: the Prometheus exporter scraped over real HTTP, its counts against an external
probe on real workers, cardinality of template keys, ``semaphore top`` piped and in a real
terminal (tmux), and the Grafana dashboard's queries."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from celery_semaphore.backends import get_backend
from celery_semaphore.cli import worker_requests
from celery_semaphore.metrics import METRICS, Collector, Templates, serve
from celery_semaphore.waiting_room import parked_counts
from tests import servers
from tests.test_cli import make_cli
from tests.test_worker import Cluster
from tests.util import wait_until
from tests.workers import ROOT, Worker

MONITORING = os.path.join(ROOT, "monitoring")


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        return reply.read().decode()


def samples(text):
    """{(metric, frozenset(labels)): value} of an exposition text."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        out[(match.group(1), labels)] = float(match.group(3))
    return out


def value(parsed, metric, **labels):
    return parsed.get((metric, frozenset(labels.items())))


def families(text):
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


# -- the dashboard and the alert: every query names exported metrics ----------------------


def exported_name(name):
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[:-len(suffix)]
        if name.endswith(suffix) and METRICS.get(base, ("",))[0] == "histogram":
            return base
    return name


def test_every_dashboard_and_alert_query_names_an_exported_metric():
    with open(os.path.join(MONITORING, "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    with open(os.path.join(MONITORING, "alerts.yml")) as f:
        alerts = f.read()
    queries += [alerts]  # its exprs: every celery_semaphore_* name in the file
    assert len(queries) > 10
    for query in queries:
        names = re.findall(r"celery_semaphore_\w+", query)
        assert names, query
        for name in names:
            assert exported_name(name) in METRICS, (name, query)
    used = {exported_name(n) for q in queries for n in re.findall(r"celery_semaphore_\w+", q)}
    assert "celery_semaphore_wait_seconds" in used and "celery_semaphore_up" in used


# -- W1 on real workers: the exporter's counts against the probe's -------------------------


def test_exporter_counts_equal_the_probe_on_real_workers_and_survive_a_restart(
        redis_url, tmp_path):
    cluster = Cluster(str(tmp_path), redis_url, servers.redis_broker(redis_url), redis_url,
                      names="metrics",
                      CS_SETTINGS=json.dumps({"semaphore_limits": {"images": 4}}))
    server = None
    try:
        prefix = cluster.env["CS_KEY_PREFIX"]
        collector = Collector(cluster.backend, Templates.of_app(cluster.app),
                              lambda names: parked_counts(cluster.app, prefix, names))
        server = serve(collector, 0, "127.0.0.1")
        guarded = cluster.task("guarded")
        results = [guarded.delay(f"w{i}", 0.05) for i in range(60)]
        for result in results:
            result.get(timeout=60)
        probe = cluster.probe.spans("guarded:w")
        bodies = [end - start for spans in probe.values() for start, end in spans]
        assert len(bodies) == 60 and cluster.probe.max_concurrent("guarded:w") == 4

        def counts():
            parsed = samples(scrape(server.server_port))
            ids = {"semaphore": "images", "template": ""}
            return parsed, {
                "acquired": value(parsed, "celery_semaphore_acquired_total", **ids),
                "parked_send": value(parsed, "celery_semaphore_parked_total", by="send", **ids),
                "holds": value(parsed, "celery_semaphore_hold_seconds_count", **ids),
                "held": value(parsed, "celery_semaphore_held", **ids)}

        # each worker's own count of what it pulled from the waiting room, since it started
        # (this test's workers only: other clusters on the same broker answer too)
        def pulled():
            return sum(sum(r.get("pulled", {}).values()) for name, r in worker_requests(
                cluster.app).items() if name.startswith("metrics"))

        def parked(parsed):
            return sum(value(parsed, "celery_semaphore_parked_total", by=by, **ids)
                       for by in ("send", "worker"))

        # releases and the workers' batched counts land within a second of the last result;
        # the sends that found the semaphore busy were parked (on send, or by a worker that
        # got one the plain way), and every parked task was pulled once
        # (acquired counts the slots granted: a grant that found every process of its worker
        # busy is given back and granted again later, counted each time, as is its hold)
        ids = {"semaphore": "images", "template": ""}

        def settled(tasks):
            now = counts()[1]
            return now["acquired"] == now["holds"] >= tasks and now["held"] == 0

        assert wait_until(lambda: settled(60), timeout=10), counts()
        assert wait_until(lambda: parked(counts()[0]) == pulled() > 0, timeout=10), counts()
        parsed, _ = counts()
        for counter in ("expired", "lost", "requeued"):
            assert value(parsed, f"celery_semaphore_{counter}_total", **ids) == 0
        assert value(parsed, "celery_semaphore_wait_seconds_count", **ids) == value(
            parsed, "celery_semaphore_acquired_total", **ids)  # one wait per grant
        assert value(parsed, "celery_semaphore_limit", **ids) == 4
        assert value(parsed, "celery_semaphore_waiting", where="parked", **ids) == 0
        # hold time: each body's time plus the handoff around it (the probe's own clock)
        hold_sum = value(parsed, "celery_semaphore_hold_seconds_sum", **ids)
        assert sum(bodies) / 1e9 <= hold_sum <= sum(bodies) / 1e9 + 60 * 0.5
        assert value(parsed, "celery_semaphore_up") == 1
        assert value(parsed, "celery_semaphore_broker_up") == 1

        # the counters live in the backend: a worker restart changes nothing
        old = cluster.workers[0]
        old.stop()
        cluster.workers[0] = Worker(cluster.env, "metrics-again")
        cluster.workers[0].wait_ready()
        before = counts()[1]["acquired"]
        assert before >= 60
        for result in [guarded.delay(f"x{i}", 0.01) for i in range(10)]:
            result.get(timeout=60)
        assert wait_until(lambda: settled(before + 10), timeout=10), counts()
        assert cluster.probe.completed("guarded:x") == {f"guarded:x{i}": 1 for i in range(10)}
    finally:
        if server is not None:
            server.shutdown()
        cluster.stop()


# -- cardinality ---------------------------------------------------------------------------


def test_template_keys_are_summed_per_template_and_only_the_top_ones_exported(redis_url):
    prefix = f"{servers.unique_tag()}:"
    from celery_semaphore.backends import get_backend

    backend = get_backend(redis_url, key_prefix=prefix)
    keys = 2000
    pipe_backend = backend.client.pipeline(transaction=False)
    for i in range(keys):  # a config per key, as a resize makes it: 2,000 semaphores at once
        name = f"api:{i}"
        pipe_backend.hset(backend.key_names(name)["config"], "limit", 1)
        pipe_backend.pexpire(backend.key_names(name)["config"], 600_000)
    pipe_backend.execute()
    busy = {"api:7": 3, "api:1500": 2, "api:42": 1, "api:999": 1}  # key -> waiters
    for name, waiters in busy.items():
        assert backend.acquire(name, "holder", limit=1, ttl=60, meta={}, wait=True).grant
        for w in range(waiters):
            backend.acquire(name, f"w{w}", limit=1, ttl=60, meta={}, wait=True)
    backend.resize("images", 3)
    collector = Collector(backend, Templates(["api:{customer_id}", "other:{x}"]), top=3)
    server = serve(collector, 0, "127.0.0.1")
    try:
        started = time.monotonic()
        text = scrape(server.server_port)
        seconds = time.monotonic() - started
    finally:
        server.shutdown()
    parsed = samples(text)
    template = {"semaphore": "api:{customer_id}", "template": "api:{customer_id}"}
    assert value(parsed, "celery_semaphore_keys", template="api:{customer_id}") == keys
    assert value(parsed, "celery_semaphore_limit", **template) == keys
    assert value(parsed, "celery_semaphore_held", **template) == 4
    assert value(parsed, "celery_semaphore_waiting", where="worker", **template) == 7
    assert value(parsed, "celery_semaphore_acquired_total", **template) == 4
    assert value(parsed, "celery_semaphore_held", semaphore="images", template="") == 0
    # one series per template and family; per key only the top 3 by waiting
    series = [key for key in parsed if key[0] == "celery_semaphore_held"]
    assert len(series) == 2
    top = {dict(labels)["semaphore"] for metric, labels in parsed
           if metric == "celery_semaphore_key_waiting"}
    assert top == {"api:7", "api:1500", "api:42"} or top == {"api:7", "api:1500", "api:999"}
    assert len(parsed) < 120, len(parsed)  # 2,000 keys, a bounded number of series
    print(f"scrape of {keys} keys: {seconds:.2f}s")


# -- the command line: exporter, top --once / --json, top in a terminal, usage -------------


SEMAPHORE_COMMAND = [sys.executable, "-m", "celery", "-A", "tests.celery_app", "semaphore"]


#: Runs its arguments with SIGINT's default action, as a terminal starts a command, whatever
#: the test run ignores (started as a background job, it ignores SIGINT).
WITH_DEFAULT_SIGINT = [sys.executable, "-c", "import os, signal, sys; "
                       "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.argv[1], sys.argv[1:])"]


class Command:
    """A long-running ``celery semaphore`` command started as a shell's background job
    (``cmd &`` in ``sh -c``: SIGINT ignored, as under ``make test &`` or a CI wrapper), or
    as from a terminal (SIGINT's default action)."""

    def __init__(self, cli, *args, background=False):
        command = SEMAPHORE_COMMAND + list(args)
        if background:  # the shell prints the job's pid, then waits for it
            command = ["sh", "-c", '"$@" & echo $!; wait $!', "sh", *command]
        else:
            command = WITH_DEFAULT_SIGINT + command
        self.proc = subprocess.Popen(command, cwd=ROOT, env=cli.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = int(self.proc.stdout.readline()) if background else self.proc.pid

    def ignores_sigint(self):
        """Whether the command's process ignores SIGINT (its signal mask, from /proc)."""
        with open(f"/proc/{self.pid}/status") as f:
            ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", f.read(), re.M).group(1), 16)
        return bool(ignored & (1 << (signal.SIGINT - 1)))

    def stop(self, sig=signal.SIGTERM, timeout=10):
        """Send ``sig``; the seconds until the command exited, and its exit status."""
        sent = time.monotonic()
        os.kill(self.pid, sig)
        try:
            status = self.proc.wait(timeout)
        finally:
            self.kill()
        return time.monotonic() - sent, status

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


def start_exporter(cli, *args, background=False):
    """An exporter on a free port: (the command, its port)."""
    exporter = Command(cli, "exporter", "--port", "0", *args, background=background)
    try:
        line = exporter.proc.stderr.readline()
        return exporter, int(re.search(r":(\d+)/metrics", line).group(1))
    except Exception:
        exporter.kill()
        raise


def test_exporter_command_serves_every_metric_and_wrong_use_exits_2(redis_url):
    cli = make_cli(redis_url)
    cli.backend.acquire("images", "h", limit=2, ttl=60, meta={}, wait=True)
    exporter, port = start_exporter(cli)
    try:
        text = scrape(port)
    finally:
        seconds, status = exporter.stop(signal.SIGTERM)
    assert status == 0 and seconds < 1.0, (status, seconds)
    assert families(text) == set(METRICS)  # every metric of the table, and no other
    parsed = samples(text)
    assert value(parsed, "celery_semaphore_held", semaphore="images", template="") == 1
    usage = [cli("exporter", "--port", "70000"), cli("top", "--sort", "bogus"),
             cli("top", "--interval", "0"), cli("exporter", "--top", "-1")]
    for done in usage:
        assert done.returncode == 2, done.stderr
        assert "Usage:" in done.stderr and "Traceback" not in done.stderr


def many_keys(cli, keys=2000):
    """``keys`` semaphores of the template ``api:{customer_id}`` (a config each, as a resize
    makes it), a few of them held and waited for: each scrape or refresh reads them all."""
    backend = cli.backend
    pipe = backend.client.pipeline(transaction=False)
    for i in range(keys):
        config = backend.key_names(f"api:{i}")["config"]
        pipe.hset(config, "limit", 1)
        pipe.pexpire(config, 600_000)
    pipe.execute()
    for i in range(0, keys, keys // 4):
        backend.acquire(f"api:{i}", "holder", limit=1, ttl=600, meta={}, wait=True)
        backend.acquire(f"api:{i}", "waiter", limit=1, ttl=600, meta={}, wait=True)


STOP_TRIES = int(os.environ.get("CS_STOP_TRIES", "2"))  # 20 for the figure in the docs


def test_the_exporter_stops_within_a_second_of_sigint_or_sigterm_however_started(redis_url):
    """Started plainly, SIGINT stops it; started as a background job (SIGINT ignored, as
    ``make test &`` would start it), SIGTERM does. Exit status 0 both ways."""
    cli = make_cli(redis_url)
    exporter, port = start_exporter(cli)
    assert "celery_semaphore_up 1.0" in scrape(port)
    assert not exporter.ignores_sigint()
    seconds, status = exporter.stop(signal.SIGINT)
    assert status == 0 and seconds < 1.0, (status, seconds)
    exporter, port = start_exporter(cli, background=True)
    assert "celery_semaphore_up 1.0" in scrape(port)
    assert exporter.ignores_sigint()  # what made the old SIGINT of this test never land
    seconds, status = exporter.stop(signal.SIGTERM)
    assert status == 0 and seconds < 1.0, (status, seconds)


def test_the_exporter_stops_within_a_second_of_sigterm_under_load(redis_url):
    """2,000 keys, four clients scraping without a pause (each scrape reads every key): the
    SIGTERM lands with scrapes in flight. STOP_TRIES tries; the worst is printed."""
    cli = make_cli(redis_url)
    many_keys(cli)
    times = []
    for _ in range(STOP_TRIES):
        exporter, port = start_exporter(cli, background=True)
        done, scrapes = threading.Event(), []

        def scraping():
            while not done.is_set():
                try:
                    scrapes.append(len(scrape(port)))
                except OSError:
                    return  # the exporter is gone

        clients = [threading.Thread(target=scraping) for _ in range(4)]
        try:
            for client in clients:
                client.start()
            assert wait_until(lambda: len(scrapes) >= 4, timeout=60)
            seconds, status = exporter.stop(signal.SIGTERM)
        finally:
            done.set()
            for client in clients:
                client.join(60)
        assert status == 0, (status, exporter.proc.stderr)
        times.append(seconds)
    print(f"exporter under load: exit {max(times):.3f} s after SIGTERM at worst "
          f"({len(times)} tries; {', '.join(f'{t:.3f}' for t in times)})")
    assert max(times) < 1.0, times


def test_top_stops_within_a_second_of_sigterm_under_load_as_a_background_job(redis_url):
    """Piped, refreshing every 0.1 s over 2,000 keys, started with SIGINT ignored: SIGTERM
    stops it mid-refresh or mid-pause, exit status 0. STOP_TRIES tries; the worst printed."""
    cli = make_cli(redis_url)
    many_keys(cli)
    times = []
    for _ in range(STOP_TRIES):
        top = Command(cli, "top", "--interval", "0.1", background=True)
        try:
            frames = 0
            for line in top.proc.stdout:  # two frames: the command is refreshing
                frames += line.startswith("celery semaphore top")
                if frames == 2:
                    break
            assert frames == 2, top.proc.stderr.read()
            assert top.ignores_sigint()
            seconds, status = top.stop(signal.SIGTERM)
        finally:
            top.kill()
        assert status == 0, status
        times.append(seconds)
    print(f"top under load: exit {max(times):.3f} s after SIGTERM at worst "
          f"({len(times)} tries; {', '.join(f'{t:.3f}' for t in times)})")
    assert max(times) < 1.0, times


def test_top_once_and_json_piped(redis_url):
    cli = make_cli(redis_url)
    # The waiter must outlive three command-line starts on a loaded machine (5 s by default).
    backend = get_backend(cli.url, key_prefix=cli.prefix, waiter_ttl=600)
    backend.acquire("images", "h1", limit=1, ttl=60, meta={}, wait=True)
    backend.acquire("images", "h2", limit=1, ttl=60, meta={}, wait=True)  # waits
    backend.acquire("api:5", "h1", limit=2, ttl=60, meta={}, wait=True)
    done = cli("top", "--json", "--interval", "0")
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)["semaphores"]}
    assert rows["images"]["held"] == 1 and rows["images"]["waiting"] == 1
    assert rows["images"]["parked"] == 0 and rows["api:5"]["template"] == "api:{customer_id}"
    grouped = json.loads(cli("top", "--json", "--interval", "0", "--by-template").stdout)
    assert [r["name"] for r in grouped["semaphores"]] == ["images", "api:{customer_id}"]
    text = cli("top", "--once", "--interval", "0.2", "--filter", "api:*", "--sort", "name")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "\x1b" not in text.stdout  # piped: no terminal control sequences
    assert lines[0].startswith("celery semaphore top")
    table = lines[lines.index(next(line for line in lines if line.startswith("NAME"))):]
    assert [line.split()[0] for line in table[1:]] == ["api:5"]
    assert table[1].split()[5] == "-"  # no grant in the interval: no wait percentile


def test_top_refreshes_in_place_in_a_real_terminal(redis_url, tmp_path):
    cli = make_cli(redis_url)
    backend = cli.backend
    backend.acquire("images", "h1", limit=3, ttl=60, meta={}, wait=True)
    backend.acquire("zeta", "h1", limit=5, ttl=60, meta={}, wait=True)
    backend.acquire("zeta", "h2", limit=5, ttl=60, meta={}, wait=True)
    socket_name = servers.unique_tag()
    script = tmp_path / "top.sh"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in cli.env.items()
                      if k.startswith(("CS_", "PYTHON", "PATH")))
    script.write_text(f"{exports}cd {shlex.quote(ROOT)}\nexec {shlex.quote(sys.executable)} -m "
                      "celery -A tests.celery_app semaphore top --interval 0.3 --sort held\n")

    def tmux(*args):
        return subprocess.run(["tmux", "-L", socket_name, *args], capture_output=True,
                              text=True, timeout=10)

    def screen():
        return tmux("capture-pane", "-p", "-t", "top").stdout

    def held_of(name):
        for line in screen().splitlines():
            if line.split()[:1] == [name]:
                return int(line.split()[2])
        return None

    assert tmux("new-session", "-d", "-s", "top", "-x", "150", "-y", "30",
                f"sh {shlex.quote(str(script))}").returncode == 0
    tmux("set-option", "-t", "top", "remain-on-exit", "on")
    try:
        assert wait_until(lambda: held_of("images") == 1, timeout=20), screen()
        lines = screen().splitlines()
        names = [line.split()[0] for line in lines if line.split()[:1] in (["images"],
                                                                            ["zeta"])]
        assert names == ["zeta", "images"]  # sorted by held
        backend.acquire("images", "h2", limit=3, ttl=60, meta={}, wait=True)
        backend.acquire("images", "h3", limit=3, ttl=60, meta={}, wait=True)
        assert wait_until(lambda: held_of("images") == 3, timeout=10), screen()
        text = screen()
        assert text.count("celery semaphore top") == 1  # redrawn in place, never scrolled
        assert text.count("images") == 1
        tmux("send-keys", "-t", "top", "s")  # held -> parked -> ... : the next sort column
        assert wait_until(lambda: "sorted by parked" in screen(), timeout=10), screen()
        tmux("send-keys", "-t", "top", "q")
        assert wait_until(lambda: tmux("display-message", "-p", "-t", "top",
                                       "#{pane_dead}").stdout.strip() == "1", timeout=10)
        assert "celery semaphore top" not in screen()  # the alternate screen is gone
    finally:
        tmux("kill-server")


def test_semaphore_metrics_top_is_validated_like_the_other_settings():
    from celery import Celery

    from celery_semaphore.exceptions import ConfigurationError
    from celery_semaphore.settings import Settings

    app = Celery(set_as_current=False)
    assert Settings.from_app(app).metrics_top == 10
    app.conf.semaphore_metrics_top = 0
    assert Settings.from_app(app).metrics_top == 0
    for bad in (-1, 100_001, "5", True, 2.5):
        app.conf.semaphore_metrics_top = bad
        try:
            Settings.from_app(app)
        except ConfigurationError as exc:
            assert "semaphore_metrics_top" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")
