"""Reading the chaos broker's append-only file (fsynced on every write): which lost tasks
kombu's Redis transport took off a queue as the broker was killed.

kombu's Redis transport takes a message off its queue (``BRPOP``, written to the AOF as
``RPOP``) and only then records the delivery in the ``unacked`` hash (``HSET``), in a second
command. A broker SIGKILLed between the two loses the message: Celery's own window on a Redis
broker, whatever the gate does. The file shows it: the pop is there, the record is not, and
the next command is the first one after the restart (Redis writes ``SELECT`` first). The
checker counts such a task apart from ``lost`` (``lost_in_broker_kill_window``), with this
evidence; a task that left the queue any other way stays lost.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Deque, Dict, Iterable, Iterator, List, Set, Tuple


def commands(data: bytes) -> Iterator[List[bytes]]:
    """The commands of an AOF's RESP text (annotation lines such as ``#TS:`` skipped)."""
    i, end = 0, len(data)
    while i < end:
        if data[i:i + 1] != b"*":
            newline = data.find(b"\n", i)
            if newline < 0:
                return
            i = newline + 1
            continue
        line_end = data.find(b"\r\n", i)
        if line_end < 0:
            return
        count = int(data[i + 1:line_end])
        i = line_end + 2
        args = []
        for _ in range(count):
            line_end = data.find(b"\r\n", i)
            if line_end < 0:
                return
            length = int(data[i + 1:line_end])
            i = line_end + 2
            args.append(data[i:i + length])
            i += length + 2
        if len(args) < count:  # a command cut short by the kill
            return
        yield args


def incr_files(aof_dir: str) -> List[str]:
    """The AOF's increment files in order, or [] when the first base is not the only one (a
    rewrite put list contents in a base file this reader does not parse)."""
    try:
        with open(os.path.join(aof_dir, "appendonly.aof.manifest"), "rb") as f:
            manifest = [line.split() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return []
    entries = [dict(zip(fields[0::2], fields[1::2])) for fields in manifest]
    bases = [e for e in entries if e.get(b"type") == b"b"]
    if len(bases) != 1 or bases[0].get(b"seq") != b"1":
        return []
    incrs = sorted((int(e[b"seq"]), e[b"file"].decode()) for e in entries
                   if e.get(b"type") == b"i" and b"seq" in e and b"file" in e)
    return [os.path.join(aof_dir, name) for _, name in incrs]


def popped_as_broker_died(aof_dir: str, task_ids: Iterable[str]) -> Set[str]:
    """Those of ``task_ids`` whose message a pop took off its list last, with no record of the
    delivery before the broker restarted (module docstring). Empty when the file cannot say
    (no AOF, or a rewrite's base holds list contents)."""
    return _popped_unrecorded(aof_dir, task_ids)[0]


def popped_never_recorded(aof_dir: str, task_ids: Iterable[str]) -> Set[str]:
    """Those of ``task_ids`` whose message a pop took off its list last and whose delivery
    was never recorded, the broker restarted since or not: with a connection reset as the
    broker served a worker's ``BRPOP``, the pop is written and its reply lost (kombu's window
    again, for a cut instead of a kill). Empty when the file cannot say."""
    died, popped = _popped_unrecorded(aof_dir, task_ids)
    return died | popped


def _popped_unrecorded(aof_dir: str, task_ids: Iterable[str]) -> Tuple[Set[str], Set[str]]:
    """(popped before a restart and not recorded, popped since the last restart and not
    recorded) among ``task_ids``."""
    wanted = {task_id.encode(): task_id for task_id in task_ids}
    files = incr_files(aof_dir)
    if not wanted or not files:
        return set(), set()
    lists: Dict[bytes, Deque[bytes]] = {}
    popped: Set[bytes] = set()  # taken off a list; its delivery not recorded yet
    died: Set[bytes] = set()

    def mentioned(value: bytes) -> List[bytes]:
        return [tid for tid in wanted if tid in value]

    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        for command in commands(data):
            name = command[0].upper()
            if name == b"SELECT":  # the first write after a (re)start
                died |= popped
                popped.clear()
            elif name in (b"LPUSH", b"RPUSH") and len(command) > 2:
                items = lists.setdefault(command[1], deque())
                for value in command[2:]:
                    (items.appendleft if name == b"LPUSH" else items.append)(value)
                    for tid in mentioned(value):  # back in a queue: not lost there
                        died.discard(tid)
                        popped.discard(tid)
            elif name in (b"RPOP", b"LPOP") and len(command) > 1:
                items = lists.get(command[1])
                count = int(command[2]) if len(command) > 2 else 1
                for _ in range(count):
                    if not items:
                        break
                    value = items.pop() if name == b"RPOP" else items.popleft()
                    popped.update(mentioned(value))
            elif name == b"HSET" and len(command) > 3:
                for value in command[3::2]:
                    for tid in mentioned(value):  # its delivery recorded
                        popped.discard(tid)
            elif name == b"DEL":
                for key in command[1:]:
                    lists.pop(key, None)
            elif name == b"LREM" and len(command) > 3:
                items = lists.get(command[1])
                if items:
                    lists[command[1]] = deque(v for v in items if v != command[3])
    return {wanted[tid] for tid in died}, {wanted[tid] for tid in popped}
