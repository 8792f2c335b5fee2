"""The memory backend with the operations the upstream contract adds (``pause``, ``resume``,
``settle``, ``release`` with an outcome, and the new :class:`SemaphoreStatus` fields), for the
tests of the client API, the command line and the exporter, which call them.

Every call is recorded (``calls``). Where the memory backend implements an operation itself
(once the backends' work is merged), the call goes to it: the tests then exercise the real
rules. Until then a minimal model of the contract (upstream-spec.md) stands in: ``pause``
keeps the later end and returns it, ``resume`` says whether a pause was in force, ``settle``
is True exactly when the holder holds, ``status`` shows the pause (and the state a paused name
without any gets). ``extra[name]`` overlays other status fields (quotas, a learned limit) for
what only a real admission would make. Usable as a backend URL: ``tests.upstream_double:
ContractDouble`` (one shared store per URL, as ``memory://``).
"""

import dataclasses
import inspect
import time
from collections import namedtuple
from typing import Any, Optional, Tuple

from celery_semaphore.backends import base
from celery_semaphore.backends.memory import MemoryBackend

URL = "tests.upstream_double:ContractDouble"
#: The memory backend has the contract's operations itself (the backends' branch is merged).
REAL = all(hasattr(MemoryBackend, op) for op in ("pause", "resume", "settle"))
RELEASE_TAKES_OUTCOME = "outcome" in inspect.signature(MemoryBackend.release).parameters

QuotaUsage = getattr(base, "QuotaUsage", None) or namedtuple(
    "QuotaUsage", "count period offset window_start window_end used")
AdaptiveState = getattr(base, "AdaptiveState", None) or namedtuple(
    "AdaptiveState", "min max current pinned")
NEW_FIELDS = {"paused_until", "pause_reason", "quotas", "rates", "adaptive"}

if NEW_FIELDS <= {f.name for f in dataclasses.fields(base.SemaphoreStatus)}:
    Status = base.SemaphoreStatus
else:
    @dataclasses.dataclass(frozen=True)
    class Status(base.SemaphoreStatus):  # the fields the contract adds
        paused_until: Optional[float] = None
        pause_reason: str = ""
        quotas: Tuple[Any, ...] = ()
        rates: Tuple[Tuple[float, int], ...] = ()
        adaptive: Any = None

        def as_dict(self):
            out = super().as_dict()
            out.update(paused_until=self.paused_until, pause_reason=self.pause_reason,
                       quotas=[q._asdict() for q in self.quotas],
                       rates=[{"interval": i, "burst": b} for i, b in self.rates],
                       adaptive=None if self.adaptive is None else self.adaptive._asdict())
            return out


def make_status(name, limit=1, **fields):
    """A SemaphoreStatus with the contract's fields (for rendering tests)."""
    return Status(name, limit, fields.pop("declared", {}), fields.pop("holders", ()),
                  fields.pop("waiters", ()), **fields)


class ContractDouble(MemoryBackend):
    def __init__(self, url=URL, **options):
        super().__init__(url, **options)
        self.calls = []
        self.extra = {}
        self._pauses = {}  # name -> (end, reason), the stand-in's

    def settle(self, name, holder, units):
        self.calls.append(("settle", name, holder, units))
        if REAL:
            return super().settle(name, holder, units)
        return self.verify(name, holder)

    def pause(self, name, seconds, reason=""):
        self.calls.append(("pause", name, seconds, reason))
        if REAL:
            return super().pause(name, seconds, reason)
        end, kept_reason = self._pause_of(name) or (0.0, "")
        if time.time() + seconds > end:
            end, kept_reason = time.time() + seconds, reason
        self._pauses[name] = (end, kept_reason)
        return end

    def resume(self, name):
        self.calls.append(("resume", name))
        if REAL:
            return super().resume(name)
        in_force = self._pause_of(name) is not None
        self._pauses.pop(name, None)
        return in_force

    def _pause_of(self, name):
        pause = self._pauses.get(name)
        if pause is not None and pause[0] <= time.time():
            del self._pauses[name]
            return None
        return pause

    def release(self, name, holder, outcome=None, latency=None):
        self.calls.append(("release", name, holder, outcome, latency))
        if (outcome is not None or latency is not None) and RELEASE_TAKES_OUTCOME:
            return super().release(name, holder, outcome=outcome, latency=latency)
        return super().release(name, holder)

    def names(self):
        return sorted(set(super().names()) | {n for n in list(self._pauses)
                                              if self._pause_of(n)} | set(self.extra))

    def status(self, name):
        found = super().status(name)
        pause = None if REAL else self._pause_of(name)
        if found is None and pause is None and name not in self.extra:
            return None
        fields = {} if found is None else {f.name: getattr(found, f.name)
                                           for f in dataclasses.fields(found)}
        fields.setdefault("name", name)
        fields.setdefault("limit", 1)
        fields.setdefault("declared", {})
        fields.setdefault("holders", ())
        fields.setdefault("waiters", ())
        if pause is not None:
            fields.update(paused_until=pause[0], pause_reason=pause[1])
        fields.update(self.extra.get(name, {}))
        return Status(**fields)

    def statuses(self, names):
        return {name: status for name in names
                if (status := self.status(name)) is not None}
