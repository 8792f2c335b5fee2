"""The interpreters of the tox envs given (``py310-celery53``, ...), for ``make compat``.

Usage: ``python scripts/find-pythons.py ENV[,ENV...] ...``. For each env named with a Python
factor (``pyXY``), prints ``export CS_PYTHON_XY=/path/to/pythonX.Y`` (the Makefile evals it;
tox.ini's ``base_python`` reads it); envs without one run on tox's own Python and need nothing.
Exits 1, saying where it looked, when an interpreter is missing: a claimed Python must never
go untested in silence.

Where it looks, in order: ``$CS_PYTHON_XY`` when set; every ``pythonX.Y`` on PATH; pyenv's
versions (``pyenv versions --bare``, the newest patch release ``X.Y.*``, through ``pyenv
which`` with ``PYENV_VERSION`` set to it, so no ``pyenv global`` is needed; ``pyenv`` from
PATH, else ``$PYENV_ROOT/bin``, ``~/.pyenv`` by default, for a shell that never ran pyenv's
init). A candidate counts only once it has run and said it is X.Y (a pyenv shim of a version
not selected fails, and is skipped).

``--claimed`` prints the oldest and the newest Python of setup.cfg's classifiers
(``3.10 3.13``) after checking that ``python_requires`` names the oldest.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Iterable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTOR = re.compile(r"^py(\d)(\d+)$")


def claimed(setup_cfg: str = os.path.join(ROOT, "setup.cfg")) -> Tuple[str, str]:
    """(oldest, newest) of the ``Programming Language :: Python :: 3.N`` classifiers; exits if
    ``python_requires`` does not start at the oldest."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    versions = sorted(
        tuple(int(p) for p in m.group(1).split(".")) for m in re.finditer(
            r"Programming Language :: Python :: (3\.\d+)\s*$",
            parser.get("metadata", "classifiers"), re.M))
    if not versions:
        sys.exit(f"{setup_cfg}: no 'Programming Language :: Python :: 3.N' classifier")
    oldest, newest = (".".join(map(str, v)) for v in (versions[0], versions[-1]))
    requires = parser.get("options", "python_requires").strip()
    if requires != f">={oldest}":
        sys.exit(f"{setup_cfg}: python_requires is {requires!r}, the oldest classifier {oldest}")
    return oldest, newest


def version_of(executable: str) -> Optional[str]:
    """``X.Y`` of the interpreter at ``executable``, or None when it does not run."""
    try:
        done = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def on_path(name: str) -> List[str]:
    found = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and candidate not in found:
            found.append(candidate)
    return found


def pyenv_candidates(version: str, pyenv: Optional[str]) -> List[str]:
    if pyenv is None:
        return []
    try:
        listed = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True,
                                timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    patch = re.compile(rf"^{re.escape(version)}\.(\d+)$")
    releases = sorted((int(m.group(1)), v) for v in listed for m in [patch.match(v)] if m)
    found = []
    for _, release in reversed(releases):  # the newest patch release first
        done = subprocess.run([pyenv, "which", f"python{version}"], capture_output=True,
                              text=True, timeout=30, env=dict(os.environ, PYENV_VERSION=release))
        if done.returncode == 0 and done.stdout.strip():
            found.append(done.stdout.strip())
    return found


def pyenv_command() -> Optional[str]:
    """``pyenv`` on PATH, else in ``$PYENV_ROOT/bin`` (pyenv's default root: ``~/.pyenv``)."""
    found = shutil.which("pyenv")
    if found:
        return found
    root = os.environ.get("PYENV_ROOT") or os.path.join(os.path.expanduser("~"), ".pyenv")
    candidate = os.path.join(root, "bin", "pyenv")
    return candidate if os.access(candidate, os.X_OK) else None


def find(version: str, pyenv: Optional[str] = None) -> Tuple[Optional[str], List[str]]:
    """(the interpreter of Python ``version``, or None; where it looked)."""
    looked = []
    variable = f"CS_PYTHON_{version.replace('.', '')}"
    explicit = os.environ.get(variable)
    if explicit:
        found = version_of(explicit)
        looked.append(f"${variable}={explicit}, which is "
                      + (f"Python {found}" if found else "no interpreter that runs"))
        if found == version:
            return os.path.abspath(explicit), looked
        return None, looked  # set but wrong: never fall back past what the caller asked for
    looked.append(f"python{version} on PATH")
    pyenv = pyenv or pyenv_command()
    looked.append("pyenv's versions" if pyenv else "pyenv (not installed)")
    for candidate in on_path(f"python{version}") + pyenv_candidates(version, pyenv):
        if version_of(candidate) == version:
            return candidate, looked
    return None, looked


def versions_of(envs: Iterable[str]) -> List[str]:
    """``X.Y`` of each Python factor among the envs, in order, once each."""
    out: List[str] = []
    for env in envs:
        for factor in env.split("-"):
            match = FACTOR.match(factor)
            if match and f"{match.group(1)}.{match.group(2)}" not in out:
                out.append(f"{match.group(1)}.{match.group(2)}")
    return out


def main(argv: List[str]) -> int:
    if argv == ["--claimed"]:
        print(" ".join(claimed()))
        return 0
    envs = [env for arg in argv for env in arg.split(",") if env]
    missing = []
    for version in versions_of(envs):
        path, looked = find(version)
        if path is None:
            missing.append(f"Python {version} not found (looked at: {', '.join(looked)}); "
                           f"install it (e.g. pyenv install {version}) or set "
                           f"CS_PYTHON_{version.replace('.', '')} to its interpreter")
        else:
            print(f"export CS_PYTHON_{version.replace('.', '')}={shlex.quote(path)}")
    for line in missing:
        print(f"find-pythons: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
