"""``celery -A proj semaphore ...``: inspect and change semaphores from the command line.

Registered through the ``celery.commands`` entry point group. Every subcommand takes ``--json``.
Exit codes: 0 ok, 1 operational failure (unknown semaphore, backend unreachable), 2 usage error.
Errors are one line on stderr and change nothing.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List, Optional

import click

from .backends import get_backend
from .backends.base import Backend, SemaphoreStatus
from .exceptions import BackendUnavailable, ConfigurationError, InvalidName
from .names import validate_name
from .settings import Settings

LIMIT = click.IntRange(min=1)


class Context:
    def __init__(self, app: Any, backend_url: Optional[str]) -> None:
        self.app = app
        self.backend_url = backend_url
        self._backend: Optional[Backend] = None

    @property
    def settings(self) -> Settings:
        if self.app is None:
            return Settings()
        try:
            return Settings.from_app(self.app)
        except ConfigurationError as exc:
            raise click.ClickException(str(exc)) from None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            settings = self.settings
            if self.backend_url is None and self.app is None:
                raise click.UsageError("no app: pass -A/--app or --backend URL")
            try:
                url = self.backend_url or settings.backend_url(self.app)
                self._backend = get_backend(url, key_prefix=settings.key_prefix)
            except ConfigurationError as exc:
                raise click.UsageError(str(exc)) from None
        return self._backend


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_name(value)
    except InvalidName as exc:
        raise click.BadParameter(str(exc)) from None


def _operational(fn):
    """Turn backend failures into one line and exit status 1."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BackendUnavailable as exc:
            raise click.ClickException(str(exc)) from None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _emit(as_json: bool, data: Any, human: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else human)


def _ago(t: float, now: float) -> str:
    delta = t - now
    text = f"{abs(delta):.0f}s" if abs(delta) < 120 else f"{abs(delta) / 60:.0f}m"
    return f"in {text}" if delta > 0 else f"{text} ago"


def render_status(status: SemaphoreStatus) -> str:
    now = time.time()
    declared = ", ".join(str(k) for k in sorted(status.declared)) or "-"
    lines = [f"semaphore {status.name}: limit {status.limit} (declared: {declared}), "
             f"{status.held} held, {status.waiting} waiting"]
    if status.holders:
        lines.append(f"  {'HOLDER':<34} {'TOKEN':<20} {'TASK':<38} {'WORKER':<24} SINCE / EXPIRES")
        for h in status.holders:
            lines.append(f"  {h.holder:<34} {str(h.token):<20} {h.meta.get('task_id', '-'):<38} "
                         f"{h.meta.get('worker', '-'):<24} {_ago(h.since, now)} / "
                         f"{_ago(h.expires_at, now)}")
    for position, w in enumerate(status.waiters):
        lines.append(f"  waiting #{position}: {w.holder} task {w.meta.get('task_id', '-')} "
                     f"since {_ago(w.since, now)}")
    return "\n".join(lines)


@click.group(name="semaphore")
@click.option("--backend", "backend_url", metavar="URL",
              help="Semaphore backend URL (default: the app's semaphore_backend).")
@click.pass_context
def semaphore(ctx: click.Context, backend_url: Optional[str]) -> None:
    """Inspect, resize and reset celery-semaphore semaphores."""
    obj = ctx.obj
    app = getattr(obj, "app", None) if obj is not None else None
    if app is not None and getattr(app, "main", None) == "default":
        app = None  # no -A/--app: Celery's placeholder app has no settings to read
    ctx.obj = Context(app, backend_url)


@semaphore.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def list_(obj: Context, as_json: bool) -> None:
    """Every known semaphore: name, limit, held, waiting."""
    rows: List[Dict[str, Any]] = []
    for name in obj.backend.names():
        status = obj.backend.status(name)
        if status is not None:
            rows.append({"name": name, "limit": status.limit, "held": status.held,
                         "waiting": status.waiting})
    human = "\n".join([f"{'NAME':<40} {'LIMIT':>5} {'HELD':>5} {'WAITING':>7}"] + [
        f"{r['name']:<40} {r['limit']:>5} {r['held']:>5} {r['waiting']:>7}" for r in rows])
    _emit(as_json, rows, human if rows else "no semaphores")


@semaphore.command()
@click.argument("name", callback=_name)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def status(obj: Context, name: str, as_json: bool) -> None:
    """Limit, declared limits, holders and waiters of NAME."""
    found = obj.backend.status(name)
    if found is None:
        raise click.ClickException(f"unknown semaphore {name!r}")
    _emit(as_json, found.as_dict(), render_status(found))


@semaphore.command()
@click.argument("name", callback=_name)
@click.argument("limit", type=LIMIT)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def resize(obj: Context, name: str, limit: int, as_json: bool) -> None:
    """Set the limit of NAME (creating it) for every worker, at once."""
    before = obj.backend.status(name)
    created = obj.backend.resize(name, limit)
    old = None if before is None else before.limit
    human = (f"created semaphore {name!r} with limit {limit}" if created
             else f"resized semaphore {name!r}: limit {old} -> {limit}")
    _emit(as_json, {"name": name, "limit": limit, "previous": old, "created": created}, human)


@semaphore.command()
@click.argument("name", callback=_name)
@click.argument("holder")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def release(obj: Context, name: str, holder: str, as_json: bool) -> None:
    """Force-release HOLDER's slot of NAME (a stuck holder)."""
    if not obj.backend.release(name, holder):
        raise click.ClickException(f"{holder} holds no slot of semaphore {name!r}")
    _emit(as_json, {"name": name, "holder": holder, "released": True},
          f"released {holder} from semaphore {name!r}")


@semaphore.command()
@click.argument("name", callback=_name)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def reset(obj: Context, name: str, yes: bool, as_json: bool) -> None:
    """Delete all state of NAME; current holders lose their slots."""
    if not yes:
        if not sys.stdin.isatty():
            raise click.ClickException("refusing to reset without confirmation: pass --yes")
        click.confirm(f"Delete all state of semaphore {name!r}?", abort=True, err=True)
    existed = obj.backend.reset(name)
    _emit(as_json, {"name": name, "reset": existed},
          f"reset semaphore {name!r}" if existed else f"semaphore {name!r} was unknown")


@semaphore.command()
@click.option("--dry-run", is_flag=True, help="Show what would change.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@_operational
def sync(obj: Context, dry_run: bool, as_json: bool) -> None:
    """Resize every semaphore named in semaphore_limits to its configured limit.

    Declared limits only create a semaphore; after a deploy that changes semaphore_limits, run
    this to make the new limits take effect.
    """
    changes = []
    for name, limit in sorted(obj.settings.limits.items()):
        if "{" in name:
            continue  # a template: each filled-in name is created with it
        current = obj.backend.status(name)
        if current is None or current.limit != limit:
            if not dry_run:
                obj.backend.resize(name, limit)
            changes.append({"name": name, "limit": limit,
                            "previous": None if current is None else current.limit})
    human = "\n".join(f"{'would set' if dry_run else 'set'} {c['name']}: {c['previous']} -> "
                      f"{c['limit']}" for c in changes) or "nothing to change"
    _emit(as_json, changes, human)


@semaphore.command()
@click.option("--timeout", default=2.0, show_default=True, help="Seconds to wait for replies.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def workers(obj: Context, timeout: float, as_json: bool) -> None:
    """Each worker's requests waiting for a slot and running with one."""
    if obj.app is None:
        raise click.UsageError("no app: pass -A/--app")
    try:
        replies = obj.app.control.broadcast("semaphore_requests", reply=True, timeout=timeout)
    except Exception as exc:
        raise click.ClickException(f"cannot reach the workers: {exc}") from None
    merged: Dict[str, Any] = {}
    for reply in replies or []:
        merged.update(reply)
    lines = []
    for worker, info in sorted(merged.items()):
        waiting, held = info.get("waiting", []), info.get("held", [])
        lines.append(f"{worker}: {len(held)} held, {len(waiting)} waiting")
        lines += [f"  held    {h['semaphore']:<24} {h['id']} token {h['token']}" for h in held]
        lines += [f"  waiting {w['semaphore']:<24} {w['id']} position {w['position']}"
                  for w in waiting]
    _emit(as_json, merged, "\n".join(lines) or "no worker answered")
