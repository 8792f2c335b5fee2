"""Per-semaphore counters and histograms, kept by the backend beside the semaphore's state.

Every backend that keeps them (Redis, Sentinel, Cluster and every document backend: memory,
SQLite, PostgreSQL, RabbitMQ, Consul) updates them **in the same atomic step** as the operation
they count: a grant observes its wait in the script or transaction that grants (``acquired`` is
the wait histogram's count: every grant is one observation, so it is not stored apart), a
release observes the hold time in the one that releases, the pruning of expired leases counts
``expired`` where it prunes. So the counters of a semaphore are the cluster's, exact (no
sampling, no per-process endpoint) and survive any worker restart.

What the workers count (``requeued``, ``parked_worker``, ``parked_send``) reaches the backend
in one small batched call per semaphore (:meth:`.backends.base.Backend.count`), at most every
:data:`FLUSH_EVERY` seconds and at worker shutdown: a worker killed with SIGKILL loses at most
that much of these three counts.

The counters live and die with the semaphore's state: ``reset`` and the idle expiry
(``idle_ttl``, 7 days unused) restart them from zero, which Prometheus' ``rate()`` and
``increase()`` treat as a counter reset.

Storage: flat string -> integer fields (:data:`COUNTERS` but ``acquired``, which earlier
releases stored and which is now ignored; ``wait:<i>``/``hold:<i>`` for the
non-cumulative count of bucket ``i`` of :data:`BUCKETS` (``i == len(BUCKETS)``: above the
last bound), ``wait_sum``/``hold_sum`` in microseconds). Redis keeps them as ``s:<field>`` in
the semaphore's ``config`` hash; the document backends as ``State.stats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Tuple

#: Upper bounds (seconds) of the wait and hold histograms' buckets; one more bucket is +Inf.
BUCKETS: Tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                              30.0, 60.0, 300.0, 1800.0, 3600.0)
#: The plain counters.
COUNTERS = ("acquired", "expired", "lost", "requeued", "parked_worker", "parked_send")
#: Counters only workers can count (:meth:`.backends.base.Backend.count` takes these only).
WORKER_COUNTERS = ("requeued", "parked_worker", "parked_send")
#: Seconds between two flushes of a worker's counts to the backend.
FLUSH_EVERY = 0.5
#: Meta key of an acquire: Unix time the caller first waited for this slot (the gate's
#: first-wait time, across parking and requeues). Without it, a grant's wait is counted from
#: the holder's entry in the backend's queue (0 when granted at once).
FIRST_WAIT_META = "first_wait"


def bucket_of(seconds: float) -> int:
    """Index of the histogram bucket ``seconds`` falls in (the first bound >= it)."""
    for index, bound in enumerate(BUCKETS):
        if seconds <= bound:
            return index
    return len(BUCKETS)


def observe(fields: Dict[str, int], histogram: str, seconds: float) -> None:
    """Add one observation to ``fields`` (the storage form above)."""
    seconds = max(0.0, seconds)
    key = f"{histogram}:{bucket_of(seconds)}"
    fields[key] = fields.get(key, 0) + 1
    fields[f"{histogram}_sum"] = fields.get(f"{histogram}_sum", 0) + int(seconds * 1e6)


@dataclass(frozen=True)
class Histogram:
    """Non-cumulative bucket counts (``len(BUCKETS) + 1``) and the sum in seconds."""

    buckets: Tuple[int, ...] = (0,) * (len(BUCKETS) + 1)
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def cumulative(self) -> Tuple[Tuple[str, int], ...]:
        """``(le, cumulative count)`` pairs as Prometheus exposes them, ending with +Inf."""
        out, running = [], 0
        for bound, n in zip(BUCKETS + (float("inf"),), self.buckets):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return tuple(out)

    def __add__(self, other: "Histogram") -> "Histogram":
        return Histogram(tuple(a + b for a, b in zip(self.buckets, other.buckets)),
                         self.total + other.total)

    def __sub__(self, other: "Histogram") -> "Histogram":
        """What was observed between two readings (``other`` the earlier); a reading taken
        after a reset gives itself."""
        if any(a < b for a, b in zip(self.buckets, other.buckets)):
            return self
        return Histogram(tuple(a - b for a, b in zip(self.buckets, other.buckets)),
                         self.total - other.total)

    def quantile(self, q: float) -> Optional[float]:
        """The ``q`` quantile (0..1), interpolated linearly inside its bucket as Prometheus'
        ``histogram_quantile`` does; None without observations. Above the last bound: the
        last bound."""
        count = self.count
        if count == 0:
            return None
        rank, running, lower = q * count, 0, 0.0
        for bound, n in zip(BUCKETS, self.buckets):
            if n and running + n >= rank:
                return lower + (bound - lower) * (rank - running) / n
            running += n
            lower = bound
        return BUCKETS[-1]


@dataclass(frozen=True)
class SemaphoreStats:
    """The counters and histograms of one semaphore (or a sum of several)."""

    counters: Mapping[str, int] = field(default_factory=dict)
    wait: Histogram = Histogram()
    hold: Histogram = Histogram()

    def __getitem__(self, counter: str) -> int:
        return int(self.counters.get(counter, 0))

    @classmethod
    def from_fields(cls, fields: Mapping[str, object]) -> "SemaphoreStats":
        """From the storage form (values may be strings, as Redis returns them)."""
        values = {k: int(float(v)) for k, v in fields.items()}  # type: ignore[arg-type]

        def histogram(name: str) -> Histogram:
            return Histogram(tuple(values.get(f"{name}:{i}", 0) for i in range(len(BUCKETS) + 1)),
                             values.get(f"{name}_sum", 0) / 1e6)

        wait = histogram("wait")
        counters = {c: values.get(c, 0) for c in COUNTERS}
        counters["acquired"] = wait.count
        return cls(counters, wait, histogram("hold"))

    def __add__(self, other: "SemaphoreStats") -> "SemaphoreStats":
        return SemaphoreStats({c: self[c] + other[c] for c in COUNTERS},
                              self.wait + other.wait, self.hold + other.hold)

    def as_dict(self) -> Dict[str, object]:
        return {**{c: self[c] for c in COUNTERS},
                "wait": {"count": self.wait.count, "sum": round(self.wait.total, 6),
                         "buckets": list(self.wait.buckets)},
                "hold": {"count": self.hold.count, "sum": round(self.hold.total, 6),
                         "buckets": list(self.hold.buckets)}}


def total(stats: Iterable[SemaphoreStats]) -> SemaphoreStats:
    out = SemaphoreStats()
    for item in stats:
        out = out + item
    return out
