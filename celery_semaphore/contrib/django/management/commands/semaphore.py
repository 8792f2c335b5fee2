"""``python manage.py semaphore ...``: the ``celery semaphore`` command, same code path.

The Celery app is the one named by the ``CELERY_SEMAPHORE_APP`` setting (``"proj.celery:app"``),
else Celery's current app (the one a Django project imports in its ``__init__``). Click parses
the arguments, so the subcommands, their output and their exit codes are those of
``celery -A proj semaphore``. ``call_command("semaphore", "resize", "images", "4")`` works
too: it writes to the command's stdout/stderr and raises ``CommandError`` (with the same
``returncode``) instead of exiting.
"""

import argparse
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence

from django.core.management.base import BaseCommand, CommandError

#: Django's options that take a value and that ``manage.py`` has already applied.
DJANGO_OPTIONS = ("--settings", "--pythonpath")


def find_app() -> Any:
    from celery_semaphore.contrib.django.project import find_app as find

    try:
        return find(required=True)
    except (ImportError, AttributeError) as exc:
        raise CommandError(str(exc)) from None


def click_args(args: Sequence[str]) -> List[str]:
    """``args`` without Django's ``--settings``/``--pythonpath`` (already applied)."""
    out: List[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == "--":
            return out + list(args[i:])
        elif arg in DJANGO_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in DJANGO_OPTIONS)):
            out.append(arg)
    return out


def prog_name(argv0: str, subcommand: str) -> str:
    name = os.path.basename(argv0)
    return f"{'python -m django' if name == '__main__.py' else name} {subcommand}"


class Command(BaseCommand):
    help = "Inspect, resize and reset celery-semaphore semaphores (see `semaphore --help`)."

    def run_from_argv(self, argv: List[str]) -> None:
        from celery_semaphore.cli import semaphore

        try:
            app = find_app()
        except CommandError as exc:
            self.stderr.write(f"Error: {exc}")
            sys.exit(1)
        # standalone_mode: click prints errors with the usage line and exits 0, 1 or 2
        semaphore.main(args=click_args(argv[2:]), prog_name=prog_name(argv[0], argv[1]),
                       obj=SimpleNamespace(app=app), standalone_mode=True)
        sys.exit(0)

    def print_help(self, prog_name: str, subcommand: str) -> None:  # `manage.py help semaphore`
        from celery_semaphore.cli import semaphore

        semaphore.main(args=["--help"], prog_name=f"{prog_name} {subcommand}",
                       standalone_mode=False)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse_args = parser.parse_args

        def pass_through(args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> Any:
            # call_command(): Django's defaults, and every argument left to click
            options = parse_args([], namespace)
            options.args = list(args or [])
            return options

        parser.parse_args = pass_through
        return parser

    def handle(self, *args: str, **options: Any) -> None:  # call_command()
        import click

        from celery_semaphore.cli import semaphore

        # the wrapped streams: OutputWrapper would add a newline to click's empty probe writes
        out, err = (getattr(s, "_out", s) for s in (self.stdout, self.stderr))
        with redirect_stdout(out), redirect_stderr(err):
            try:
                semaphore.main(args=click_args(list(args)), prog_name="semaphore",
                               obj=SimpleNamespace(app=find_app()), standalone_mode=False)
            except click.ClickException as exc:
                raise CommandError(exc.format_message(), returncode=exc.exit_code) from None
            except click.Abort:
                raise CommandError("aborted", returncode=1) from None
