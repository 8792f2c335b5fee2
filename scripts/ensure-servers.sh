#!/usr/bin/env bash
# Make sure the Redis and RabbitMQ servers the tests use answer on loopback; install (Debian
# packages) and start them when they are missing. REDIS_URL / AMQP_URL point elsewhere: then
# nothing is started here.
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
