"""PostgreSQL-specific behaviour: URLs and options, the table made on first write (also by
processes starting together), idle rows deleted, NOTIFY wake-ups and the poll fallback when the
listener is killed, replaced connections, and the errors an unreachable or read-only server
gives. The backend contract itself runs in test_contract.py."""

import logging
import multiprocessing
import sys
import threading
import time

import psycopg
import pytest
from psycopg import sql

from celery_semaphore import BackendUnavailable, ConfigurationError, Semaphore
from celery_semaphore.backends import backend_class, get_backend
from celery_semaphore.backends.postgres import DEFAULT_SCHEMA, PostgresBackend, parse_url
from celery_semaphore.exceptions import UnknownBackend
from tests import servers
from tests.util import forked_child_waits, hand_over, wait_until

FORK = multiprocessing.get_context("fork")


def with_query(url, query):
    return f"{url}{'&' if '?' in url else '?'}{query}"


@pytest.fixture
def schema(postgres_url):
    """A schema name of this test's own (dropped by the session's sweep)."""
    return f"{servers.unique_tag()}_sem"


@pytest.fixture
def admin(postgres_url):
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        yield conn


def table_exists(admin, schema):
    return admin.execute("SELECT to_regclass(%s)",
                         (f"{schema}.semaphores",)).fetchone()[0] is not None


def schema_exists(admin, schema):
    return admin.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s",
                         (schema,)).fetchone()[0] == 1


def rows(admin, schema):
    return [row[0] for row in admin.execute(
        sql.SQL("SELECT name FROM {} ORDER BY name").format(
            sql.Identifier(schema, "semaphores")))]


def test_url_options_go_to_the_backend_the_rest_to_libpq():
    parsed = parse_url("postgres://app:pw@db:6432/app?schema=sems&timeout=2.5&sslmode=require"
                       "&options=-c%20search_path%3Dx&connect_timeout=3")
    assert parsed["schema"] == "sems" and parsed["timeout"] == "2.5"
    info = psycopg.conninfo.conninfo_to_dict(parsed["conninfo"])
    assert info["sslmode"] == "require" and info["options"] == "-c search_path=x"
    assert info["connect_timeout"] == "3"  # the URL's own wins over the default
    assert info["keepalives_idle"] == "30" and info["application_name"] == "celery-semaphore"
    assert "schema" not in info and "timeout" not in info
    backend = PostgresBackend("postgresql://u@h/db")
    assert (backend.schema, backend.timeout) == (DEFAULT_SCHEMA, 10.0)
    several = get_backend("postgresql://u:pw@db1:5432,db2:5433/app?target_session_attrs=read-write")
    assert psycopg.conninfo.conninfo_to_dict(several.conninfo)["port"] == "5432,5433"


def test_without_psycopg_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg now fails
    monkeypatch.delitem(sys.modules, "celery_semaphore.backends.postgres")
    with pytest.raises(UnknownBackend) as err:
        backend_class("postgres://u@h/db")
    assert "pip install 'celery-semaphore[postgres]'" in str(err.value)


@pytest.mark.parametrize("url, problem", [
    ("postgresql://u:secret@h/db?foo=1", 'invalid URI query parameter: "foo"'),
    ("postgresql://u:secret@h/db?schema=1bad", "plain identifier"),
    ("postgresql://u:secret@h/db?schema=a-b", "plain identifier"),
    ("postgresql://u:secret@h/db?schema=", "plain identifier"),
    ("postgresql://u:secret@h/db?timeout=0", "timeout must be"),
    ("postgresql://u:secret@h/db?timeout=soon", "timeout must be"),
    ("postgresql://u:secret@h:99999/db", "Port out of range"),
    ("postgresql://u:secret@h1:5432,h2:99999/db", "Port out of range"),
    ("postgresql://u:secret@[::1/db", "malformed"),
])
def test_a_bad_url_or_option_is_one_configuration_error(url, problem):
    with pytest.raises(ConfigurationError) as err:
        get_backend(url)
    assert problem in str(err.value)
    assert "secret" not in str(err.value)


def test_the_table_is_made_on_first_write_under_its_schema(postgres_url, schema, admin):
    url = with_query(postgres_url, f"schema={schema}")
    backend = get_backend(url, key_prefix="p:")
    # reads on a database without the table answer "nothing here" and create nothing
    assert backend.status("jobs") is None and backend.names() == []
    assert backend.verify("jobs", "h") is False
    assert not schema_exists(admin, schema)
    lease = Semaphore("jobs", 2, url, key_prefix="p:").acquire()
    assert table_exists(admin, schema)
    assert rows(admin, schema) == ["p:jobs"]
    assert not table_exists(admin, DEFAULT_SCHEMA) or "p:jobs" not in rows(admin, DEFAULT_SCHEMA)
    assert lease.release()


def test_a_schema_made_by_a_dba_is_used_as_it_is(postgres_url, schema, admin):
    """A role without CREATE on the database works once the schema exists."""
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    url = with_query(postgres_url, f"schema={schema}")
    Semaphore("dba", 1, url, key_prefix="p:").acquire().release()
    assert rows(admin, schema) == ["p:dba"]


def _first_use(url, start, name):
    start.wait(10)
    Semaphore(name, 1, url, key_prefix="p:").acquire(timeout=20).release()


def test_processes_starting_together_create_the_table_once(postgres_url, schema, admin):
    for attempt in range(3):  # a race lost without the DDL lock shows up in one of these
        url = with_query(postgres_url, f"schema={schema}{attempt}")
        start = FORK.Event()
        children = [FORK.Process(target=_first_use, args=(url, start, f"n{i % 2}"))
                    for i in range(6)]
        for child in children:
            child.start()
        start.set()
        for child in children:
            child.join(60)
        assert [child.exitcode for child in children] == [0] * 6
        assert rows(admin, f"{schema}{attempt}") == ["p:n0", "p:n1"]


def test_idle_semaphores_leave_no_row_behind(postgres_url, schema, admin):
    url = with_query(postgres_url, f"schema={schema}")
    options = {"key_prefix": "p:", "idle_ttl": 1.0}
    for name in ("a", "b", "c"):
        sem = Semaphore(name, 1, url, ttl=0.5, **options)
        sem.acquire().release()
        sem.try_acquire()  # a lease left to expire
    assert len(rows(admin, schema)) == 3
    other = get_backend(url, key_prefix="other:", idle_ttl=1.0)
    # any later operation of any client (here a read of an unrelated name) deletes them
    assert wait_until(lambda: other.status("unrelated") is None and not rows(admin, schema),
                      timeout=15, interval=0.1)
    assert get_backend(url, **options).names() == []



def test_status_and_verify_do_not_wait_for_a_writers_row_lock(postgres_url, schema, admin):
    """A reader (`top`, the exporter, a task's fencing check) reads the row as last committed
    while a writer holds it FOR UPDATE (it waited for that lock before)."""
    url = with_query(postgres_url, f"schema={schema}")
    backend = get_backend(url, key_prefix="r:")
    assert backend.acquire("s", "a:1", limit=2, ttl=30, meta={}, wait=False).grant
    got = {}

    def read():
        status = backend.status("s")
        got["holders"] = [h.holder for h in status.holders]
        got["verified"] = backend.verify("s", "a:1"), backend.verify("s", "b:1")

    with psycopg.connect(postgres_url) as writer:
        writer.execute(sql.SQL("SELECT state FROM {} WHERE name = %s FOR UPDATE").format(
            sql.Identifier(schema, "semaphores")), ("r:s",))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=20)
        alive = reader.is_alive()
        writer.rollback()  # (a reader still waiting ends now)
    reader.join(timeout=20)
    assert not alive, "status waited for the writer's row lock"
    assert got == {"holders": ["a:1"], "verified": (True, False)}
    assert backend.release("s", "a:1")

def test_notify_wakes_a_waiter_in_another_process(postgres_url):
    """A semaphore made and listened to before a fork, waited on in the child: the child
    listens on a connection of its own, and NOTIFY wakes it long before its poll."""
    sem = Semaphore("notify", 1, postgres_url, key_prefix=f"{servers.unique_tag()}:",
                    poll_interval=30, waiter_ttl=90)
    held = sem.acquire()
    got = []
    hand_over(sem, held, got, join_timeout=10)  # the parent listens before forking
    assert got and got[0].release()
    # polls are 30 s apart: only a wake-up is this fast
    assert 0 <= forked_child_waits(sem) < 5


def _terminate(admin, pid):
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_waiters_poll_while_the_listener_is_down_and_are_woken_once_it_is_back(
        postgres_url, admin, monkeypatch, caplog):
    prefix = f"{servers.unique_tag()}:"
    options = {"key_prefix": prefix, "waiter_ttl": 90}  # a waiter's pause is its poll interval
    backend = get_backend(postgres_url, **options)
    polling = Semaphore("fallback", 1, postgres_url, poll_interval=0.2, **options)
    got = []
    hand_over(polling, polling.acquire(), got, join_timeout=10)  # the listener is up
    got.pop().release()
    assert backend.listening
    refused = BackendUnavailable("the test refuses the listener's reconnection")
    monkeypatch.setattr(backend, "_connect_listener", lambda: (_ for _ in ()).throw(refused))
    with caplog.at_level(logging.WARNING, logger="celery_semaphore.backends.postgres"):
        _terminate(admin, backend.listener_pid)
        assert wait_until(lambda: not backend.listening)
        hand_over(polling, polling.acquire(), got, join_timeout=10)
    assert got and got.pop().release()  # admitted by its poll alone
    assert not backend.listening
    assert "wake-up listener" in caplog.text and "lost" in caplog.text
    monkeypatch.undo()
    assert wait_until(lambda: backend.listening, timeout=15)
    patient = Semaphore("fallback", 1, postgres_url, poll_interval=30, **options)
    released_at = hand_over(patient, patient.acquire(), got, join_timeout=10)
    assert got and got[0].release()
    assert time.monotonic() - released_at < 5  # woken: the next poll was 30 s away


def test_the_listener_is_back_promptly_after_an_outage_and_wakes_every_waiter(
        postgres_url, admin, monkeypatch):
    """The listener's connection is killed and its reconnection refused for 3.5 s (its pause
    between tries reaches its longest): once the server takes it again, it is back within a
    fraction of a second (before: its backoff grew to 5 s) and wakes every watcher once."""
    backend = PostgresBackend(postgres_url, key_prefix=f"{servers.unique_tag()}:")
    try:
        backend.watch("outage", "first", lambda: None)
        assert wait_until(lambda: backend.listening)
        refused = BackendUnavailable("the test refuses the listener's reconnection")
        connect = backend._connect_listener
        monkeypatch.setattr(backend, "_connect_listener", lambda: (_ for _ in ()).throw(refused))
        _terminate(admin, backend.listener_pid)
        assert wait_until(lambda: not backend.listening)
        woken = {holder: threading.Event() for holder in ("a", "b")}
        for holder, event in woken.items():
            backend.watch("outage", holder, event.set)
        time.sleep(3.5)  # the outage: the listener keeps trying meanwhile
        monkeypatch.setattr(backend, "_connect_listener", connect)
        back_at = time.monotonic()
        assert all(event.wait(5) for event in woken.values()), "not every waiter was woken"
        woken_after = time.monotonic() - back_at
        assert backend.listening and woken_after < 0.6, woken_after
    finally:
        backend.close()


def test_a_killed_connection_is_replaced_by_the_next_operation(postgres_url, admin):
    prefix = f"{servers.unique_tag()}:"
    sem = Semaphore("killed", 1, postgres_url, key_prefix=prefix)
    lease = sem.acquire()
    conn = sem.backend._connection()[0]
    _terminate(admin, conn.info.backend_pid)
    assert lease.renew() and lease.release()  # not BackendUnavailable: a new connection
    assert sem.backend._connection()[0].info.backend_pid != conn.info.backend_pid


def test_an_unreachable_server_is_backend_unavailable():
    url = f"postgresql://postgres:secret@127.0.0.1:{servers.free_port()}/test?connect_timeout=2"
    sem = Semaphore("down", 1, url)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as err:
        sem.try_acquire()
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "postgresql://postgres:**@127.0.0.1" in message and "secret" not in message
    assert "refused" in message
    with pytest.raises(BackendUnavailable):
        sem.backend.ping()


def test_a_read_only_server_is_backend_unavailable(postgres_url):
    """What a client left on a demoted primary (or pointed at a standby) gets."""
    prefix = f"{servers.unique_tag()}:"
    Semaphore("ro", 1, postgres_url, key_prefix=prefix).acquire().release()
    url = with_query(postgres_url, "options=-c%20default_transaction_read_only%3Don")
    with pytest.raises(BackendUnavailable) as err:
        Semaphore("ro", 1, url, key_prefix=prefix).try_acquire()
    assert "read-only" in str(err.value)


def test_a_session_left_on_a_read_only_server_is_replaced(postgres_url):
    """After a failover the old primary's sessions are read-only: the next operation drops its
    connection and reconnects (to the new primary, with a multi-host URL)."""
    sem = Semaphore("ro", 1, postgres_url, key_prefix=f"{servers.unique_tag()}:")
    sem.acquire().release()
    conn = sem.backend._connection()[0]
    conn.execute("SET default_transaction_read_only = on")
    lease = sem.try_acquire()
    assert lease is not None and lease.release()
    assert conn.closed


def test_a_row_locked_too_long_fails_the_operation_after_the_timeout(postgres_url, admin):
    prefix = f"{servers.unique_tag()}:"
    url = with_query(postgres_url, "timeout=0.5")
    sem = Semaphore("stuck", 1, url, key_prefix=prefix)
    sem.acquire().release()
    with psycopg.connect(postgres_url) as other:  # a client frozen inside its transaction
        other.execute(sql.SQL("SELECT 1 FROM {} WHERE name = %s FOR UPDATE").format(
            sql.Identifier(DEFAULT_SCHEMA, "semaphores")), (f"{prefix}stuck",))
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as err:
            sem.try_acquire()
    assert time.monotonic() - started < 5
    assert "lock" in str(err.value)
    lease = sem.try_acquire()  # the row is free again
    assert lease is not None and lease.release()
