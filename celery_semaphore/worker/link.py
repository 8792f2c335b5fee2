"""How the gate's backend calls go out: on the loop itself where the backend has an event-loop
link (:meth:`.Backend.event_loop_link`: Redis on one server), else batched on the I/O thread.

Either way the caller hands an operation (:data:`.base.Operation`) and a callback, and the
callback runs on the loop thread with the outcome. On the loop, everything asked during one
turn goes out in one write (a pipeline). On the I/O thread, everything asked before the thread
gets to it goes in one :meth:`.Backend.perform_all` (one round trip where the backend can), and
the outcomes come back to the loop in one post: one thread crossing each way per batch, not per
request.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

from ..backends.base import Acquire, EventLoopLink, Operation, Outcome, PushedGrant
from .context import GateContext

logger = logging.getLogger(__name__)

Done = Callable[[Any, Optional[BaseException]], None]


class BackendLink:
    """The gate's way to its backend (module docs). Loop thread, but :meth:`_perform`."""

    def __init__(self, ctx: GateContext,
                 on_wake: Callable[[str, str, Optional[PushedGrant]], None],
                 on_listening: Callable[[], None]) -> None:
        self.ctx = ctx
        self.on_wake = on_wake
        self.on_listening = on_listening
        self.loop_link: Optional[EventLoopLink] = None
        self._made = False
        self._batch: Deque[Tuple[Operation, Done]] = deque()
        self._scheduled = False

    def start(self, hub: Any) -> None:
        """The consumer starts on ``hub`` (None: no event loop): (re)connect the loop's link."""
        if hub is None:
            return
        if not self._made:
            self._made = True
            try:
                self.loop_link = self.ctx.backend.event_loop_link(hub, self.on_wake,
                                                                   self.on_listening)
            except Exception as exc:  # the thread does it all then
                logger.warning("celery-semaphore: no event-loop link to %r (%s); backend "
                               "calls go through a thread", self.ctx.backend, exc)
        if self.loop_link is not None:
            self.loop_link.start()

    def stop(self) -> None:
        """The consumer stops (its loop will not turn until it starts again): calls on the
        loop's link fail; from now on they go through the thread."""
        if self.loop_link is not None:
            self.loop_link.close()

    @property
    def on_loop(self) -> bool:
        """Calls go out on the loop (the consumer runs, with a link that runs: after the hub
        was closed or reset, until the link starts again, they go through the thread)."""
        return (self.loop_link is not None and self.loop_link.running and self.ctx.open
                and self.ctx.loop.on_loop())

    @property
    def pushes(self) -> bool:
        """An acquire made now may ask for pushed grants: they reach it on the loop's link."""
        return self.on_loop and self.ctx.backend.pushes_grants

    def submit(self, op: Operation, done: Done) -> None:
        """Make ``op``; ``done(result, None)`` or ``done(None, exc)`` on the loop thread."""
        if self.on_loop:
            assert self.loop_link is not None
            self.loop_link.submit(op, done)
            return
        if isinstance(op, Acquire) and op.push:  # no wake-up would carry the grant
            op = Acquire(op.name, op.holder, op.limit, op.ttl, op.meta, op.wait)
        self._batch.append((op, done))
        if not self._scheduled:
            self._scheduled = True
            self.ctx.io.call(self._perform)

    def _perform(self) -> None:  # I/O thread
        self._scheduled = False  # first: what is asked from now on schedules another batch
        batch: List[Tuple[Operation, Done]] = []
        while self._batch:
            try:
                batch.append(self._batch.popleft())
            except IndexError:
                break
        if not batch:
            return
        outcomes = self.ctx.backend.perform_all([op for op, _ in batch])
        self.ctx.loop.post(self._deliver, [(done, outcome) for (_, done), outcome
                                           in zip(batch, outcomes)])

    @staticmethod
    def _deliver(results: List[Tuple[Done, Outcome]]) -> None:
        for done, (result, error) in results:
            try:
                done(result, error)
            except Exception:
                logger.exception("celery-semaphore: handling %r failed", result)
