"""An external probe of task concurrency: task bodies log start/end to a file.

Each running body appends ``start <key> <monotonic_ns> <pid>`` when it begins and
``end <key> <monotonic_ns> <pid>`` when it ends, with O_APPEND (atomic for short lines).
CLOCK_MONOTONIC is system-wide on Linux, so lines from every process are comparable. Nothing
here asks the semaphore library anything.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple


class Probe:
    def __init__(self, path: str) -> None:
        self.path = path

    def ended(self) -> int:
        """Bodies that ended so far, every key (cheap: no parsing)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0
        return data.count(b"\nend ") + data.startswith(b"end ")

    def mark(self, kind: str, key: str) -> None:
        line = f"{kind} {key} {time.monotonic_ns()} {os.getpid()}\n".encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def events(self) -> List[Tuple[str, str, int, int]]:
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                kind, key, ns, pid = line.split()
                out.append((kind, key, int(ns), int(pid)))
        return out

    def intervals(self) -> Dict[str, List[Tuple[int, Optional[int]]]]:
        """key -> [(start_ns, end_ns or None)], one entry per execution."""
        runs: Dict[str, List[Tuple[int, Optional[int]]]] = defaultdict(list)
        for kind, key, ns, _ in sorted(self.events(), key=lambda e: e[2]):
            if kind == "start":
                runs[key].append((ns, None))
            else:
                start, _ = runs[key].pop()
                runs[key].append((start, ns))
        return runs

    def spans(self, prefix: str = "", killed_at: Optional[int] = None
              ) -> Dict[str, List[Tuple[int, int]]]:
        """key -> [(start_ns, end_ns)] of the keys starting with ``prefix``, sorted. A body that
        never ended ran until ``killed_at`` (monotonic ns: its process was killed) if it
        started before that, else until now (forever, here)."""
        out: Dict[str, List[Tuple[int, int]]] = {}
        for key, runs in self.intervals().items():
            if key.startswith(prefix):
                out[key] = sorted(
                    (start, end if end is not None else
                     killed_at if killed_at is not None and start < killed_at else 2**63)
                    for start, end in runs)
        return out

    def max_concurrent(self, prefix: str = "", killed_at: Optional[int] = None) -> int:
        """Most bodies whose keys start with ``prefix`` that ran at once (ends as in
        :meth:`spans`)."""
        points = sorted(point for spans in self.spans(prefix, killed_at).values()
                        for start, end in spans for point in ((start, 1), (end, -1)))
        current = best = 0
        for _, delta in points:
            current += delta
            best = max(best, current)
        return best

    def turnarounds(self, prefix: str = "", since_ns: int = 0) -> List[float]:
        """Milliseconds each process sat between the end of a body whose key starts with
        ``prefix`` and the start of its next body (any key), for ends at or after
        ``since_ns``: how long a freed pool process waited for its next task, by the
        bodies' own marks (a process's last body counts nothing)."""
        by_pid: Dict[int, List[Tuple[int, str, str]]] = defaultdict(list)
        for kind, key, ns, pid in self.events():
            by_pid[pid].append((ns, kind, key))
        gaps = []
        for marks in by_pid.values():
            marks.sort()
            for (ended, kind, key), (began, next_kind, _) in zip(marks, marks[1:]):
                if (kind == "end" and next_kind == "start" and key.startswith(prefix)
                        and ended >= since_ns):
                    gaps.append((began - ended) / 1e6)
        return gaps

    def run_twice_at_once(self, prefix: str = "", killed_at: Optional[int] = None) -> List[str]:
        """Keys starting with ``prefix`` whose bodies ever overlapped (ends as in
        :meth:`spans`)."""
        return [key for key, spans in self.spans(prefix, killed_at).items()
                if any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))]

    def running(self, prefix: str = "") -> List[str]:
        return [k for k, runs in self.intervals().items()
                if k.startswith(prefix) and any(end is None for _, end in runs)]

    def completed(self, prefix: str = "") -> Dict[str, int]:
        """key -> number of finished executions."""
        return {k: sum(1 for _, end in runs if end is not None)
                for k, runs in self.intervals().items() if k.startswith(prefix)}


class RedisProbe(Probe):
    """The same record kept in a Redis list, with the load of the probe the issues' figures
    come from (../shared/workloads.md): about five commands per body on the server the
    broker and the backend use (a counter of live bodies, its peak, a hash of running pids,
    and the start/end marks). ``target``: ``redis://host:port/db#key``."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        url, _, self.key = target.partition("#")
        self.url = url
        self._client: Any = None

    @property
    def client(self) -> Any:
        import redis

        if self._client is None or self._pid != os.getpid():
            self._client, self._pid = redis.Redis.from_url(self.url), os.getpid()
        return self._client

    def mark(self, kind: str, key: str) -> None:
        line = f"{kind} {key} {time.monotonic_ns()} {os.getpid()}"
        client = self.client
        if kind == "start":
            live = client.incr(f"{self.key}:live")
            client.eval("if tonumber(redis.call('GET', KEYS[1]) or 0) < tonumber(ARGV[1]) "
                        "then redis.call('SET', KEYS[1], ARGV[1]) end", 1,
                        f"{self.key}:peak", live)
            client.hset(f"{self.key}:pids", os.getpid(), key)
        else:
            client.decr(f"{self.key}:live")
            client.hdel(f"{self.key}:pids", os.getpid())
            client.incr(f"{self.key}:ended")
        client.rpush(self.key, line)

    def events(self) -> List[Tuple[str, str, int, int]]:
        out = []
        for raw in self.client.lrange(self.key, 0, -1):
            kind, key, ns, pid = raw.decode().split()
            out.append((kind, key, int(ns), int(pid)))
        return out

    def ended(self) -> int:
        return int(self.client.get(f"{self.key}:ended") or 0)

    def clear(self) -> None:
        self.client.delete(self.key, f"{self.key}:live", f"{self.key}:peak",
                          f"{self.key}:pids", f"{self.key}:ended")


def probe_for(target: str) -> Probe:
    """A :class:`RedisProbe` for ``redis://...#key``, else a file :class:`Probe`."""
    return RedisProbe(target) if target.startswith("redis") else Probe(target)
