#!/usr/bin/env bash
# Make sure the Redis, RabbitMQ and PostgreSQL servers the tests use answer on loopback; install
# (Debian packages) and start them when they are missing. REDIS_URL / AMQP_URL / POSTGRES_URL
# point elsewhere: then nothing is started here.
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "need root to run: $*" >&2; return 1; fi; }

apt_install() {
  if ! command -v apt-get >/dev/null; then
    echo "cannot install $*: no apt-get; install it yourself or set REDIS_URL/AMQP_URL" >&2
    return 1
  fi
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

wait_port() { # host port seconds
  for _ in $(seq 1 $(( $3 * 5 ))); do port_open "$1" "$2" && return 0; sleep 0.2; done
  return 1
}

# tmux: tests/test_monitoring.py runs `celery semaphore top` in a real terminal.
command -v tmux >/dev/null || apt_install tmux

if [ -z "${REDIS_URL:-}" ] && ! port_open 127.0.0.1 6379; then
  command -v redis-server >/dev/null || apt_install redis-server
  echo "starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/celery-semaphore-redis.log
  wait_port 127.0.0.1 6379 10 || { echo "redis-server did not start" >&2; exit 1; }
fi

if [ -z "${AMQP_URL:-}" ] && ! port_open 127.0.0.1 5672; then
  command -v rabbitmq-server >/dev/null || [ -x /usr/sbin/rabbitmq-server ] \
    || apt_install rabbitmq-server
  export PATH="$PATH:/usr/sbin"
  # A node can be up with its application stopped (an interrupted `rabbitmqctl stop_app`):
  # starting a second node would fail, so restart the application instead; a node that does
  # not come back that way is stopped and started afresh.
  if as_root rabbitmqctl ping >/dev/null 2>&1; then
    echo "rabbitmq node is up with its application stopped: rabbitmqctl start_app"
    if ! as_root timeout 300 rabbitmqctl start_app || ! wait_port 127.0.0.1 5672 120; then
      echo "the application did not start: restarting the rabbitmq node" >&2
      as_root timeout 120 rabbitmqctl stop || as_root pkill -KILL -f 'beam.*rabbit' || true
      sleep 2
      as_root rabbitmq-server -detached
    fi
  else
    echo "starting rabbitmq-server"
    as_root rabbitmq-server -detached
  fi
  wait_port 127.0.0.1 5672 180 || { echo "rabbitmq-server did not start" >&2; exit 1; }
fi

# PostgreSQL: the machine's Debian cluster when there is one (started as its images do), else
# a cluster of our own under /var/tmp with trust auth on loopback; either way a database
# "test". POSTGRES_URL set: nothing is started here.
if [ -z "${POSTGRES_URL:-}" ] && ! port_open 127.0.0.1 5432; then
  if ls /etc/postgresql/*/main >/dev/null 2>&1 && command -v pg_ctlcluster >/dev/null; then
    version=$(ls /etc/postgresql | sort -V | tail -1)
    echo "starting the PostgreSQL $version cluster"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  else
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || apt_install postgresql
    bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
    data=/var/tmp/celery-semaphore-postgres
    as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
    if [ ! -f "$data/PG_VERSION" ]; then
      mkdir -p "$data"
      [ "$(id -u)" = 0 ] && chown postgres: "$data"
      as_postgres "$bindir/initdb" -D "$data" -A trust -U postgres -E UTF8 >/dev/null
    fi
    echo "starting a PostgreSQL cluster in $data on 127.0.0.1:5432"
    as_postgres "$bindir/pg_ctl" -D "$data" -l "$data/server.log" -w -o \
      "-p 5432 -c listen_addresses=127.0.0.1 -k $data" start
  fi
  wait_port 127.0.0.1 5432 60 || { echo "PostgreSQL did not start" >&2; exit 1; }
fi
if [ -z "${POSTGRES_URL:-}" ] && command -v psql >/dev/null \
    && ! psql -h 127.0.0.1 -U postgres -d test -c "" >/dev/null 2>&1; then
  echo "creating the PostgreSQL database test"
  psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE test" \
    || echo "could not create database test: set POSTGRES_URL" >&2
fi
