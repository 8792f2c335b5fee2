"""scripts/find-pythons.py and the claims it checks: setup.cfg's Python range, the compat envs
of the Makefile and tox.ini on its oldest and newest Python, and a loud failure when an
interpreter is missing."""

import configparser
import importlib.util
import os
import re
import subprocess
import sys

from tests.workers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "find-pythons.py")
_spec = importlib.util.spec_from_file_location("find_pythons", SCRIPT)
finder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(finder)


def makefile_value(name):
    with open(os.path.join(ROOT, "Makefile")) as f:
        return re.search(rf"^{name} \?= (.*)$", f.read(), re.M).group(1).strip()


def test_the_compat_envs_run_the_oldest_and_the_newest_claimed_python():
    oldest, newest = finder.claimed()
    python_envs = makefile_value("COMPAT_PYTHON_ENVS").split(",")
    assert finder.versions_of(python_envs) == [oldest, newest]
    for name in ("COMPAT_ENVS", "COMPAT_CI_ENVS"):
        assert "$(COMPAT_PYTHON_ENVS)" in makefile_value(name)
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(os.path.join(ROOT, "tox.ini"))
    section = next(s for s in tox.sections() if s.startswith("testenv:") and "celery" in s)
    for version in (oldest, newest):
        factor = f"py{version.replace('.', '')}"
        assert f"{factor}-" in section  # e.g. testenv:{py310-,py313-,}celery{53,...}
        assert f"{factor}: {{env:CS_PYTHON_{version.replace('.', '')}:" in tox[section][
            "base_python"]
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"Python {oldest} to {newest}" in f.read()


def test_it_finds_this_interpreter_and_prints_exports(monkeypatch):
    version = "{}.{}".format(*sys.version_info[:2])
    monkeypatch.setenv(f"CS_PYTHON_{version.replace('.', '')}", sys.executable)
    path, _ = finder.find(version)
    assert path == os.path.abspath(sys.executable)
    factor = f"py{version.replace('.', '')}"
    done = subprocess.run([sys.executable, SCRIPT, f"celery53,{factor}-celery57"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"export CS_PYTHON_{version.replace('.', '')}={sys.executable}\n"
    # no Python factor: nothing to find
    done = subprocess.run([sys.executable, SCRIPT, "celery53,celery57"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == ""


def test_a_missing_interpreter_fails_loudly(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no python2.1, and no pyenv
    done = subprocess.run([sys.executable, SCRIPT, "py21-celery53"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "Python 2.1 not found" in done.stderr and "CS_PYTHON_21" in done.stderr
    # set to an interpreter of another version: refused, not used
    monkeypatch.setenv("CS_PYTHON_21", sys.executable)
    done = subprocess.run([sys.executable, SCRIPT, "py21-celery53"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and f"which is Python {sys.version_info[0]}." in done.stderr


def test_setup_cfg_claims_start_where_python_requires_does(tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[metadata]\nclassifiers =\n    Programming Language :: Python :: 3.10\n"
                   "    Programming Language :: Python :: 3.13\n"
                   "[options]\npython_requires = >=3.9\n")
    try:
        finder.claimed(str(cfg))
    except SystemExit as exc:
        assert "python_requires" in str(exc)
    else:
        raise AssertionError("a python_requires below the classifiers was accepted")
