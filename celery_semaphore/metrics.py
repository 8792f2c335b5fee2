"""The cluster's semaphores as metrics: one snapshot read from the backend (and the broker, for
parked tasks) at scrape time, for Prometheus (:class:`Collector`, ``celery semaphore
exporter``) and the live view (:mod:`celery_semaphore.top`).

Nothing is counted here: counters and histograms are the backend's
(:mod:`celery_semaphore.stats`), so any number of exporters (or none) and any worker restart
give the same figures.

Cardinality: a template (``"api:{customer_id}"``, known from the app's tasks and
``semaphore_limits``) is exported as one series per metric, labelled ``semaphore`` and
``template`` with the template itself, summing all its keys; the ``top`` keys with the most
waiting of each template also get ``celery_semaphore_key_*`` gauges. A name that fills no
template is its own series (``template=""``). So ``sum(celery_semaphore_held)`` counts every
holder once, whatever the number of keys.

Parked counts are asked of the broker (one passive declare per name) for every plain
semaphore and, for templates, only for keys that are full or have waiters: asking every idle
key of 100,000 would cost as many broker round trips per scrape.
"""

from __future__ import annotations

import re
import socket
import string
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from .backends.base import Backend, SemaphoreStatus
from .stats import SemaphoreStats, total

#: Default number of keys per template exported one by one (``semaphore_metrics_top``).
DEFAULT_TOP = 10


# -- what a status says of pauses, quotas, rates and learned limits --------------------------
# (:class:`.SemaphoreStatus` fields of the upstream contract: ``paused_until``,
# ``pause_reason``, ``quotas``, ``rates``, ``adaptive``; read with defaults so that a backend
# that keeps none of them shows none.)


@dataclass(frozen=True)
class Window:
    """One quota window of a semaphore, now: ``used`` of ``count`` units (``used`` above
    ``count``: a debt), in the window ``[start, end)`` (backend epoch seconds); ``period``
    in seconds, 0 for a calendar month; ``label`` as a quota is written per (``h``, ``5s``,
    ``d``, ``mo``)."""

    label: str
    period: int
    count: int
    used: int
    start: float
    end: float


@dataclass(frozen=True)
class Learned:
    """An adaptive limit: ``current`` (the limit in force is its floor), between ``min`` and
    ``max``; ``pinned``: an operator's ``resize`` stopped the learning."""

    min: int
    max: int
    current: float
    pinned: bool


def period_label(period: float) -> str:
    """How a quota or rate is written per this period: ``s``, ``5s``, ``m``, ``10m``, ``h``,
    ``d``, ``w``, ``mo`` (0: a calendar month)."""
    period = int(period)
    if period == 0:
        return "mo"
    for unit, seconds in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if period % seconds == 0:
            count = period // seconds
            return unit if count == 1 else f"{count}{unit}"
    return f"{period}s"  # pragma: no cover - periods are whole seconds


def rate_text(interval: float) -> str:
    """A rate's starts per period, in the first unit that gives a whole count (``50/s``,
    ``500/m``, ``30/h``), else the first that gives at least one (``2.5/s``)."""
    units = (("s", 1), ("m", 60), ("h", 3600), ("d", 86400), ("w", 604800))
    for unit, seconds in units:
        count = seconds / interval
        if count >= 1 and abs(count - round(count)) <= 1e-6 * count:
            return f"{round(count)}/{unit}"
    for unit, seconds in units:
        if seconds / interval >= 1 or unit == "w":
            return f"{seconds / interval:.4g}/{unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def pause_of(status: SemaphoreStatus) -> Tuple[Optional[float], str]:
    """``(paused until, in backend epoch seconds, or None; the reason, "" when none)``."""
    until = status.paused_until
    return (None if until is None else float(until)), status.pause_reason or ""


def windows_of(status: SemaphoreStatus) -> Tuple[Window, ...]:
    """The semaphore's quota windows as they stand (none without quotas)."""
    return tuple(Window(period_label(q.period), int(q.period), int(q.count), int(q.used),
                        float(q.window_start), float(q.window_end))
                 for q in status.quotas or ())


def rates_of(status: SemaphoreStatus) -> Tuple[Tuple[float, int], ...]:
    """Every rate ``(interval, burst)`` of the semaphore (``status.rate`` is the first)."""
    rates = status.rates
    if rates:
        return tuple((float(i), int(b)) for i, b in rates)
    return () if status.rate is None else (status.rate,)


def learned_of(status: SemaphoreStatus) -> Optional[Learned]:
    """The adaptive limit's state, None for a limit that is not learned."""
    state = status.adaptive
    if state is None:
        return None
    return Learned(int(state.min), int(state.max), float(state.current), bool(state.pinned))


def _sum_windows(rows: Sequence["Row"]) -> Tuple[Window, ...]:
    """Each period's windows of several keys, summed (the earliest end)."""
    by_period: Dict[int, List[Window]] = {}
    for row in rows:
        for window in row.quotas:
            by_period.setdefault(window.period, []).append(window)
    return tuple(Window(ws[0].label, period, sum(w.count for w in ws), sum(w.used for w in ws),
                        min(w.start for w in ws), min(w.end for w in ws))
                 for period, ws in sorted(by_period.items()))


def _sum_learned(rows: Sequence["Row"]) -> Optional[Learned]:
    found = [row.adaptive for row in rows if row.adaptive is not None]
    if not found:
        return None
    return Learned(sum(a.min for a in found), sum(a.max for a in found),
                   sum(a.current for a in found), any(a.pinned for a in found))


@dataclass
class Row:
    """One semaphore (or, in :meth:`Snapshot.grouped`, one template's keys summed)."""

    name: str
    template: str  # "" for a name that fills no template
    limit: int
    held: int
    waiting: int  # in the backend's queue (each such request is held by a worker)
    parked: Optional[int]  # in the broker's waiting room; None: not asked or unknown
    stats: SemaphoreStats
    keys: int = 1
    #: Units of the limit held (the holders' costs; ``held`` without costs). None: unknown.
    units: Optional[int] = None
    #: With a rate: the backend time from which the next start is allowed.
    next_start: Optional[float] = None
    #: Paused: until when (backend epoch seconds; a template: its latest key's), and why.
    paused_until: Optional[float] = None
    pause_reason: str = ""
    #: Keys paused now (a plain semaphore: 0 or 1).
    paused: int = 0
    #: The quota windows (a template: each period summed over its keys).
    quotas: Tuple[Window, ...] = field(default_factory=tuple)
    #: The learned limit, for an adaptive semaphore (a template: summed over its keys).
    adaptive: Optional[Learned] = None

    @property
    def waiting_total(self) -> int:
        return self.waiting + (self.parked or 0)


@dataclass
class Snapshot:
    taken_at: float  # time.monotonic()
    rows: List[Row]
    backend_error: Optional[str] = None
    broker_error: Optional[str] = None
    seconds: float = 0.0  # how long reading it took

    def grouped(self) -> List[Row]:
        """Plain semaphores as they are, each template's keys summed into one row."""
        plain = [r for r in self.rows if not r.template]
        by_template: Dict[str, List[Row]] = {}
        for row in self.rows:
            if row.template:
                by_template.setdefault(row.template, []).append(row)
        for template, rows in sorted(by_template.items()):
            parked = [r.parked for r in rows if r.parked is not None]
            paused = [r for r in rows if r.paused_until is not None]
            latest = max(paused, key=lambda r: r.paused_until or 0.0) if paused else None
            plain.append(Row(template, template, sum(r.limit for r in rows),
                             sum(r.held for r in rows), sum(r.waiting for r in rows),
                             sum(parked) if parked else None, total(r.stats for r in rows),
                             keys=len(rows),
                             units=sum(r.held if r.units is None else r.units for r in rows),
                             paused_until=None if latest is None else latest.paused_until,
                             pause_reason="" if latest is None else latest.pause_reason,
                             paused=len(paused), quotas=_sum_windows(rows),
                             adaptive=_sum_learned(rows)))
        return plain

    def top_keys(self, n: int) -> List[Row]:
        """The ``n`` keys of each template with the most waiting (then held), per template."""
        by_template: Dict[str, List[Row]] = {}
        for row in self.rows:
            if row.template:
                by_template.setdefault(row.template, []).append(row)
        out: List[Row] = []
        for rows in by_template.values():
            rows.sort(key=lambda r: (-r.waiting_total, -r.held, r.name))
            out += [r for r in rows[:n] if r.waiting_total or r.held]
        return out


class Templates:
    """Which template a concrete semaphore name fills (the most specific one wins)."""

    def __init__(self, templates: Iterable[str]) -> None:
        self.patterns = []
        for template in sorted(set(templates)):
            parts = list(string.Formatter().parse(template))
            if not any(field is not None for _, field, _, _ in parts):
                continue
            regex = "".join(re.escape(literal) + ("(.+?)" if field is not None else "")
                            for literal, field, _, _ in parts)
            literal_length = sum(len(literal) for literal, _, _, _ in parts)
            self.patterns.append((literal_length, template, re.compile(f"^{regex}$", re.S)))
        self.patterns.sort(key=lambda p: -p[0])

    def of(self, name: str) -> str:
        for _, template, pattern in self.patterns:
            if pattern.match(name):
                return template
        return ""

    @classmethod
    def of_app(cls, app: Any, limits: Optional[Dict[str, int]] = None) -> "Templates":
        """The templates of ``app``'s guarded tasks and of ``semaphore_limits``."""
        found = [k for k in (limits or {}) if "{" in k]
        if app is not None:
            for task in list(app.tasks.values()):
                template = getattr(task, "semaphore", None)
                if isinstance(template, str) and "{" in template:
                    found.append(template)
        return cls(found)


ParkedReader = Callable[[List[str]], Dict[str, int]]


def read_snapshot(backend: Backend, templates: Templates,
                  parked: Optional[ParkedReader] = None) -> Snapshot:
    """Every semaphore the backend knows, with its counters and (with ``parked``) the tasks
    parked for it. Never raises: a backend or broker that fails is named in the snapshot."""
    started = time.monotonic()
    try:
        statuses = backend.statuses(backend.names())
    except Exception as exc:
        return Snapshot(started, [], backend_error=f"{type(exc).__name__}: {exc}",
                        seconds=time.monotonic() - started)
    rows = [_row(status, templates.of(name)) for name, status in statuses.items()]
    broker_error = None
    if parked is not None:
        ask = [r.name for r in rows if not r.template or r.held >= r.limit or r.waiting]
        try:
            counts = parked(ask) if ask else {}
        except Exception as exc:
            broker_error = f"{type(exc).__name__}: {exc}"
            counts = {}
        asked = set(ask)
        for row in rows:  # None: not asked (an idle template key), or the broker failed
            row.parked = counts.get(row.name) if row.name in asked else None
    return Snapshot(started, rows, broker_error=broker_error,
                    seconds=time.monotonic() - started)


def _row(status: SemaphoreStatus, template: str) -> Row:
    paused_until, reason = pause_of(status)
    return Row(status.name, template, status.limit, status.held, status.waiting, None,
               status.stats or SemaphoreStats(), units=status.units,
               next_start=status.next_start, paused_until=paused_until, pause_reason=reason,
               paused=int(paused_until is not None), quotas=windows_of(status),
               adaptive=learned_of(status))


# -- Prometheus ------------------------------------------------------------------------------

#: name -> (type, help) of every metric the exporter serves (the Grafana test checks against
#: this table, the README lists it).
METRICS = {
    "celery_semaphore_up": ("gauge", "1 when the semaphore backend answered this scrape"),
    "celery_semaphore_broker_up": ("gauge", "1 when the broker answered for parked counts"),
    "celery_semaphore_scrape_duration_seconds": ("gauge", "Seconds this scrape took"),
    "celery_semaphore_keys": ("gauge", "Semaphores (keys) the backend knows, per template"),
    "celery_semaphore_limit": ("gauge", "Stored limit (a template: summed over its keys)"),
    "celery_semaphore_held": ("gauge", "Leases held now"),
    "celery_semaphore_units": ("gauge", "Units of the limit held now (the holders' costs; "
                                        "equal to held where every cost is 1)"),
    "celery_semaphore_rate_next_start_seconds": ("gauge", "Seconds until the semaphore's rate "
                                                          "allows its next start (0: now); "
                                                          "semaphores with a rate only"),
    "celery_semaphore_paused": ("gauge", "Keys paused now (a Backoff or `celery semaphore "
                                         "pause`; a plain semaphore: 0 or 1)"),
    "celery_semaphore_paused_until_seconds": ("gauge", "Seconds until the pause ends (0: "
                                                       "ending now); paused semaphores only "
                                                       "(a template: its latest key's), "
                                                       "reason: why"),
    "celery_semaphore_quota_used": ("gauge", "Units started in the current window of each "
                                             "quota (above quota_limit: a debt), per window "
                                             "(h, d, 5s, mo...)"),
    "celery_semaphore_quota_limit": ("gauge", "Units a quota allows per window (its count)"),
    "celery_semaphore_quota_window_end_seconds": ("gauge", "Seconds until the current window "
                                                           "of the quota ends (a template: its "
                                                           "earliest key's)"),
    "celery_semaphore_adaptive_limit": ("gauge", "The learned limit of an adaptive semaphore "
                                                 "(its floor is in force); adaptive ones only"),
    "celery_semaphore_adaptive_pinned": ("gauge", "1 when resize pinned an adaptive "
                                                  "semaphore's limit (learning stopped)"),
    "celery_semaphore_waiting": ("gauge", "Requests waiting now: where=worker (in the "
                                          "backend's queue, held by a worker), where=parked "
                                          "(in the broker's waiting room)"),
    "celery_semaphore_acquired_total": ("counter", "Slots granted"),
    "celery_semaphore_expired_total": ("counter", "Leases reclaimed by their TTL"),
    "celery_semaphore_lost_total": ("counter", "Renewals that found their lease gone"),
    "celery_semaphore_requeued_total": ("counter", "Requests requeued with a backoff (the "
                                                   "waiting room refused them)"),
    "celery_semaphore_parked_total": ("counter", "Tasks parked in the waiting room: by=worker "
                                                 "(when parked), by=send (when first pulled)"),
    "celery_semaphore_wait_seconds": ("histogram", "From a task's first wait to its grant, "
                                                   "across parking and requeues"),
    "celery_semaphore_hold_seconds": ("histogram", "From grant to release (expired leases: "
                                                   "not observed, see expired_total)"),
    "celery_semaphore_key_limit": ("gauge", "Limit of one template key (the top keys)"),
    "celery_semaphore_key_held": ("gauge", "Leases held of one template key (the top keys)"),
    "celery_semaphore_key_waiting": ("gauge", "Waiting for one template key (the top keys)"),
}


class Collector:
    """A ``prometheus_client`` custom collector: each scrape reads one :func:`read_snapshot`.

    ``top``: keys of each template exported one by one (``celery_semaphore_key_*``).
    """

    def __init__(self, backend: Backend, templates: Templates,
                 parked: Optional[ParkedReader] = None, top: int = DEFAULT_TOP) -> None:
        self.backend = backend
        self.templates = templates
        self.parked = parked
        self.top = top

    def describe(self) -> Sequence[Any]:
        return []  # no fixed series: the registry must not collect at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snap = read_snapshot(self.backend, self.templates, self.parked)

        def family(name: str, labels: Sequence[str]) -> Any:
            kind, doc = METRICS[name]
            cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                   "histogram": HistogramMetricFamily}[kind]
            return cls(name, doc, labels=list(labels))

        up = family("celery_semaphore_up", [])
        up.add_metric([], 0 if snap.backend_error else 1)
        yield up
        if self.parked is not None:
            broker_up = family("celery_semaphore_broker_up", [])
            broker_up.add_metric([], 0 if snap.broker_error else 1)
            yield broker_up
        labels = ("semaphore", "template")
        keys = family("celery_semaphore_keys", ["template"])
        limit, held = family("celery_semaphore_limit", labels), family("celery_semaphore_held",
                                                                       labels)
        waiting = family("celery_semaphore_waiting", labels + ("where",))
        units = family("celery_semaphore_units", labels)
        next_start = family("celery_semaphore_rate_next_start_seconds", labels)
        paused = family("celery_semaphore_paused", labels)
        paused_until = family("celery_semaphore_paused_until_seconds", labels + ("reason",))
        quota_used = family("celery_semaphore_quota_used", labels + ("window",))
        quota_limit = family("celery_semaphore_quota_limit", labels + ("window",))
        window_end = family("celery_semaphore_quota_window_end_seconds", labels + ("window",))
        learned = family("celery_semaphore_adaptive_limit", labels)
        learned_pinned = family("celery_semaphore_adaptive_pinned", labels)
        wall = time.time()
        counters = {c: family(f"celery_semaphore_{c}_total", labels)
                    for c in ("acquired", "expired", "lost", "requeued")}
        parked_total = family("celery_semaphore_parked_total", labels + ("by",))
        wait = family("celery_semaphore_wait_seconds", labels)
        hold = family("celery_semaphore_hold_seconds", labels)
        per_template: Dict[str, int] = {}
        for row in snap.rows:
            per_template[row.template] = per_template.get(row.template, 0) + 1
        for template, count in sorted(per_template.items()):
            keys.add_metric([template], count)
        for row in snap.grouped():
            ids = [row.name, row.template]
            limit.add_metric(ids, row.limit)
            held.add_metric(ids, row.held)
            units.add_metric(ids, row.held if row.units is None else row.units)
            if row.next_start is not None:
                next_start.add_metric(ids, max(0.0, row.next_start - wall))
            paused.add_metric(ids, row.paused)
            if row.paused_until is not None:
                paused_until.add_metric(ids + [row.pause_reason],
                                        max(0.0, row.paused_until - wall))
            for window in row.quotas:
                quota_used.add_metric(ids + [window.label], window.used)
                quota_limit.add_metric(ids + [window.label], window.count)
                window_end.add_metric(ids + [window.label], max(0.0, window.end - wall))
            if row.adaptive is not None:
                learned.add_metric(ids, row.adaptive.current)
                learned_pinned.add_metric(ids, int(row.adaptive.pinned))
            waiting.add_metric(ids + ["worker"], row.waiting)
            if row.parked is not None:
                waiting.add_metric(ids + ["parked"], row.parked)
            for counter, metric in counters.items():
                metric.add_metric(ids, row.stats[counter])
            parked_total.add_metric(ids + ["worker"], row.stats["parked_worker"])
            parked_total.add_metric(ids + ["send"], row.stats["parked_send"])
            wait.add_metric(ids, list(row.stats.wait.cumulative()), row.stats.wait.total)
            hold.add_metric(ids, list(row.stats.hold.cumulative()), row.stats.hold.total)
        yield from (keys, limit, held, units, next_start, paused, paused_until, quota_used,
                    quota_limit, window_end, learned, learned_pinned, waiting,
                    *counters.values(), parked_total, wait, hold)
        key_limit = family("celery_semaphore_key_limit", labels)
        key_held = family("celery_semaphore_key_held", labels)
        key_waiting = family("celery_semaphore_key_waiting", labels + ("where",))
        for row in snap.top_keys(self.top):
            ids = [row.name, row.template]
            key_limit.add_metric(ids, row.limit)
            key_held.add_metric(ids, row.held)
            key_waiting.add_metric(ids + ["worker"], row.waiting)
            if row.parked is not None:
                key_waiting.add_metric(ids + ["parked"], row.parked)
        yield from (key_limit, key_held, key_waiting)
        duration = family("celery_semaphore_scrape_duration_seconds", [])
        duration.add_metric([], snap.seconds)
        yield duration


def serve(collector: Collector, port: int, address: str) -> Any:
    """Serve ``/metrics`` for ``collector`` on ``address:port`` (0: any free port) from a
    daemon thread; return the HTTP server (``server_port``; :func:`stop` it)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server


def stop(server: Any, timeout: float = 1.0) -> None:
    """Stop ``server`` from :func:`serve` and close its socket, within about ``timeout``
    seconds. Scrapes in flight go on in their daemon threads. ``shutdown()`` alone returns
    only once the accept loop next looks, up to half a second later: a connection of our own
    wakes it at once."""
    stopper = threading.Thread(target=server.shutdown, daemon=True,
                               name="celery-semaphore-exporter-stop")
    stopper.start()
    host, port = server.server_address[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + timeout
    while stopper.is_alive() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.1).close()
        except OSError:
            pass
        stopper.join(0.02)
    if not stopper.is_alive():
        server.server_close()
