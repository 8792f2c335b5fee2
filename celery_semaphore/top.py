"""``celery semaphore top``: a live view of every semaphore, refreshed in place like ``top``.

Each refresh reads one :func:`celery_semaphore.metrics.read_snapshot` (the backend's state and
counters, the broker's parked counts). Rates and wait percentiles are those of the interval
between two refreshes (grants per second from ``acquired``; p50/p99 from the wait histogram's
buckets, interpolated as Prometheus' ``histogram_quantile`` does); a semaphore first seen has
none yet (``-``). ``--once`` reads two snapshots ``--interval`` apart and prints one frame.

In a terminal: the alternate screen, redrawn in place; keys ``s`` (next sort column), ``r``
(reverse), ``q`` (quit). Piped: one frame after another, separated by a blank line (batch mode,
as ``top -b``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import select
import sys
import time
from typing import IO, Any, Callable, Dict, List, Optional, Tuple

from .metrics import Row, Snapshot

#: Longest time the refresh loop blocks at once: Python runs signal handlers (SIGTERM,
#: SIGINT) in the main thread, but the kernel may hand a process's signal to another of its
#: threads, which interrupts no wait of the main thread.
WAKE_EVERY = 0.1

#: Sort columns: key -> (header, descending by default).
SORTS = {"waiting": "WAITING", "held": "HELD", "parked": "PARKED", "grants": "GRANTS/S",
         "p99": "WAIT P99", "name": "NAME"}


def rows_of(before: Optional[Snapshot], after: Snapshot, by_template: bool = False,
            pattern: Optional[str] = None) -> List[Dict[str, Any]]:
    """JSON-ready rows of ``after``, with rates and percentiles since ``before``."""
    def index(snap: Optional[Snapshot]) -> Dict[str, Row]:
        if snap is None:
            return {}
        return {r.name: r for r in (snap.grouped() if by_template else snap.rows)}

    old, new = index(before), index(after)
    elapsed = after.taken_at - before.taken_at if before is not None else 0.0
    rows = []
    for name, row in sorted(new.items()):
        if pattern and not (fnmatch.fnmatchcase(name, pattern)
                            or (row.template and fnmatch.fnmatchcase(row.template, pattern))):
            continue
        previous = old.get(name)
        grants = p50 = p99 = None
        if previous is not None and elapsed > 0:
            acquired = row.stats["acquired"] - previous.stats["acquired"]
            grants = round(max(acquired, 0) / elapsed, 2) if acquired >= 0 else None
            waited = row.stats.wait - previous.stats.wait
            p50, p99 = waited.quantile(0.5), waited.quantile(0.99)
        now = time.time()
        rows.append({
            "name": name, "template": row.template or None, "keys": row.keys,
            "limit": row.limit, "held": row.held,
            "paused": row.paused,
            "paused_until_in_s": None if row.paused_until is None else
            round(max(0.0, row.paused_until - now), 3),
            "pause_reason": row.pause_reason,
            "quotas": [{"window": w.label, "count": w.count, "used": w.used,
                        "ends_in_s": round(max(0.0, w.end - now), 3)} for w in row.quotas],
            "adaptive": None if row.adaptive is None else {
                "min": row.adaptive.min, "max": row.adaptive.max,
                "current": round(row.adaptive.current, 3), "pinned": row.adaptive.pinned},
            "units": row.held if row.units is None else row.units,
            "next_start_in_s": None if row.next_start is None else
            round(max(0.0, row.next_start - time.time()), 3),
            "waiting": row.waiting,
            "parked": row.parked, "grants_per_s": grants,
            "wait_p50_s": None if p50 is None else round(p50, 4),
            "wait_p99_s": None if p99 is None else round(p99, 4),
            "acquired": row.stats["acquired"], "expired": row.stats["expired"],
            "lost": row.stats["lost"],
        })
    return rows


def sort_rows(rows: List[Dict[str, Any]], key: str, reverse: bool = False
              ) -> List[Dict[str, Any]]:
    """By ``key`` (:data:`SORTS`), largest first (``name``: A to Z), unknowns last."""
    field = {"grants": "grants_per_s", "p99": "wait_p99_s"}.get(key, key)
    if key == "name":
        out = sorted(rows, key=lambda r: r["name"])
    else:
        out = sorted(rows, key=lambda r: (r[field] is None, -(r[field] or 0), r["name"]))
    return out[::-1] if reverse else out


def _cell(value: Any, seconds: bool = False) -> str:
    if value is None:
        return "-"
    if seconds:
        return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
    return str(value)


def _limit_cell(row: Dict[str, Any]) -> str:
    """The limit in force, marked ``~`` when learned (``=`` when learned but pinned)."""
    adaptive = row.get("adaptive")
    if not adaptive:
        return str(row["limit"])
    return f"{row['limit']}{'=' if adaptive['pinned'] else '~'}"


def _paused_cell(row: Dict[str, Any]) -> str:
    """Time left of the pause (a template: of its latest key, and how many keys)."""
    if not row.get("paused"):
        return "-"
    left = _cell(row["paused_until_in_s"], True)
    return f"{left} ({row['paused']} keys)" if row["keys"] > 1 else left


def _quota_cell(row: Dict[str, Any]) -> str:
    """The quota window nearest its count: ``812 of 1000/h``."""
    quotas = row.get("quotas") or []
    if not quotas:
        return "-"
    tightest = max(quotas, key=lambda q: q["used"] / q["count"])
    return f"{tightest['used']} of {tightest['count']}/{tightest['window']}"


def render(rows: List[Dict[str, Any]], snap: Snapshot, where: str, sort: str,
           reverse: bool = False, interval: Optional[float] = None,
           height: Optional[int] = None, width: Optional[int] = None) -> List[str]:
    """The lines of one frame: a summary, a table, at most ``height`` lines in all."""
    stamp = time.strftime("%H:%M:%S")
    lines = [f"celery semaphore top - {stamp} - {where}"
             + (f" - every {interval:g}s" if interval else "")]
    if snap.backend_error:
        lines.append(f"BACKEND UNAVAILABLE: {snap.backend_error}")
    if snap.broker_error:
        lines.append(f"broker unavailable (parked counts unknown): {snap.broker_error}")
    held = sum(r["held"] for r in rows)
    waiting = sum(r["waiting"] for r in rows)
    parked = sum(r["parked"] or 0 for r in rows)
    grants = sum(r["grants_per_s"] or 0 for r in rows)
    lines.append(f"{len(rows)} semaphores: {held} held, {waiting} waiting in workers, "
                 f"{parked} parked, {grants:.1f} grants/s; "
                 f"sorted by {sort}{' (reversed)' if reverse else ''}; "
                 "keys: s sort, r reverse, q quit")
    lines.append("")
    headers: Tuple[str, ...] = (
        "NAME", "LIMIT", "HELD", "UNITS", "WAITING", "PARKED", "WAIT P50", "WAIT P99",
        "GRANTS/S", "NEXT START", "EXPIRED", "LOST")
    # Pauses and quotas get columns only when a semaphore shown has one.
    show_paused = any(r.get("paused") for r in rows)
    show_quota = any(r.get("quotas") for r in rows)
    headers += ("PAUSED",) * show_paused + ("QUOTA",) * show_quota
    table = [[r["name"] + (f" ({r['keys']} keys)" if r["keys"] > 1 else ""), _limit_cell(r),
              r["held"], r["units"], r["waiting"], _cell(r["parked"]), _cell(r["wait_p50_s"], True),
              _cell(r["wait_p99_s"], True), _cell(r["grants_per_s"]),
              _cell(r["next_start_in_s"], True), r["expired"], r["lost"]]
             + [_paused_cell(r)] * show_paused + [_quota_cell(r)] * show_quota
             for r in sort_rows(rows, sort, reverse)]
    if height is not None:
        table = table[:max(0, height - len(lines) - 1)]
    cells = [[str(c) for c in row] for row in table]
    widths = [max(len(x[i]) for x in [list(headers)] + cells) for i in range(len(headers))]
    for row in [list(headers)] + cells:
        line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))
        lines.append(line.rstrip())
    if not rows and not snap.backend_error:
        lines.append("no semaphores")
    if any(r.get("adaptive") for r in rows):
        lines.append("~: a learned (adaptive) limit; =: learned, pinned by resize")
    if width is not None:
        lines = [line[:width] for line in lines]
    return lines


def as_json(rows: List[Dict[str, Any]], snap: Snapshot, where: str,
            interval: float) -> Dict[str, Any]:
    return {"taken_at": time.time(), "interval_s": interval, "backend": where,
            "backend_error": snap.backend_error, "broker_error": snap.broker_error,
            "semaphores": rows}


class Live:
    """The refresh loop. ``read`` takes one snapshot; ``out`` is where frames go."""

    def __init__(self, read: Callable[[], Snapshot], where: str, interval: float, sort: str,
                 pattern: Optional[str], by_template: bool, out: IO[str] = sys.stdout,
                 keys: Optional[IO[str]] = None) -> None:
        self.read, self.where, self.interval = read, where, interval
        self.sort, self.reverse = sort, False
        self.pattern, self.by_template = pattern, by_template
        self.out, self.keys = out, keys

    def frame(self, before: Optional[Snapshot], after: Snapshot,
              terminal: bool) -> List[str]:
        size = os.get_terminal_size(self.out.fileno()) if terminal else None
        rows = rows_of(before, after, self.by_template, self.pattern)
        return render(rows, after, self.where, self.sort, self.reverse, self.interval,
                      height=size.lines if size else None, width=size.columns if size else None)

    def run(self, terminal: bool, count: Optional[int] = None) -> None:
        """Refresh until ``q`` (or ``count`` frames): in place on a terminal, else in
        batch."""
        before = self.read()
        frames = 0
        if terminal:
            self.out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hidden cursor
        try:
            while count is None or frames < count:
                if self._wait_keys():
                    break
                after = self.read()
                lines = self.frame(before, after, terminal)
                if terminal:
                    self.out.write("\x1b[H" + "".join(line + "\x1b[K\r\n" for line in lines)
                                   + "\x1b[J")
                else:
                    self.out.write("\n".join(lines) + "\n\n")
                self.out.flush()
                before, frames = after, frames + 1
        finally:
            if terminal:
                self.out.write("\x1b[?25h\x1b[?1049l")
                self.out.flush()

    def _wait_keys(self) -> bool:
        """Sleep one interval, handling keys meanwhile; True on ``q``. Never blocks longer
        than :data:`WAKE_EVERY` at once (a signal handler waits for the main thread)."""
        deadline = time.monotonic() + self.interval
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            step = min(left, WAKE_EVERY)
            if self.keys is None:
                time.sleep(step)
                continue
            ready, _, _ = select.select([self.keys], [], [], step)
            if not ready:
                continue
            key = os.read(self.keys.fileno(), 1).decode(errors="ignore")
            if key in ("q", "Q", "\x03") or key == "":
                return True
            if key == "s":
                names = list(SORTS)
                self.sort = names[(names.index(self.sort) + 1) % len(names)]
                return False  # redraw now
            if key == "r":
                self.reverse = not self.reverse
                return False


def once(read: Callable[[], Snapshot], interval: float, by_template: bool,
         pattern: Optional[str]) -> Tuple[List[Dict[str, Any]], Snapshot]:
    """Two snapshots ``interval`` apart (one when 0): (rows, last snapshot)."""
    before = read() if interval > 0 else None
    if before is not None:
        time.sleep(interval)
    after = read()
    return rows_of(before, after, by_template, pattern), after


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True)
