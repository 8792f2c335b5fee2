"""The documentation's code examples run, and every code example is one that runs.

The docs show code only through ``literalinclude`` of files under docs/examples/; each file
runs here in a fresh interpreter (eager mode, the memory:// or SQLite backend: no server), so
an example that stops working fails the suite. The example projects in docs/examples/testing/
(the pytest plugin) and docs/examples/django/ (a Django project) run as their users would run
them: pytest in a subprocess in their folder, and ``manage.py check``. ``make docs`` builds the
site itself with warnings as errors (a missing include, a broken link or anchor).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
EXAMPLES = os.path.join(DOCS, "examples")
README = os.path.join(ROOT, "README.md")
EXAMPLE_FILES = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
#: Example projects: folders under docs/examples/ whose tests run with pytest.
PROJECTS = ("testing", "django")

#: A Python code block written inline (not included from an example file).
INLINE_PYTHON = re.compile(
    r"^\s*(```+|:::+)\s*(\{code-block\}|\{code\}|\{sourcecode\})?\s*(python|py|pycon|python3)\b"
    r"|^\s*\.\.\s+(code-block|code|sourcecode)::\s*(python|py|pycon)"
    r"|^\s*>>> ",
    re.MULTILINE,
)
INCLUDE = re.compile(r"literalinclude\}?`?:*\s+(\S+)")


def pages():
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = [d for d in dirs if d not in ("_build", "examples")]
        for name in files:
            if name.endswith((".md", ".rst")):
                yield os.path.join(folder, name)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_example_runs(example):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, example)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{example} failed:\n{done.stdout}\n{done.stderr}"


def run_in_project(project, *args):
    """Run ``python *args`` in an example project's folder, as its user would: its own modules
    importable, no bytecode or cache written into docs/, nothing of this session's pytest or
    CS_* settings inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "CS_"))}
    env.update(PYTHONPATH=os.path.join(EXAMPLES, project), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, *args], cwd=os.path.join(EXAMPLES, project),
                          env=env, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("project", PROJECTS)
def test_example_project_tests_pass(project):
    """The tests of the example project pass under pytest with the plugin loaded through its
    entry point (Celery's in-process worker with the threads pool; eager calls)."""
    done = run_in_project(project, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:randomly")
    assert done.returncode == 0, f"{project}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert re.search(r"\b[1-9]\d* passed", done.stdout) and "failed" not in done.stdout


def test_the_django_example_passes_manage_py_check():
    done = run_in_project("django", "-m", "django", "check", "--settings", "proj.settings")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


def test_no_python_block_is_written_inline():
    inline = [f"{os.path.relpath(path, ROOT)}: {match.group().strip()}"
              for path in pages() for match in INLINE_PYTHON.finditer(read(path))]
    assert not inline, "show code with literalinclude from docs/examples/ (so it runs):\n" + \
        "\n".join(inline)


def test_every_example_is_shown_somewhere():
    shown = set()
    for path in pages():
        for target in INCLUDE.findall(read(path)):
            shown.add(os.path.normpath(os.path.join(os.path.dirname(path), target)))
    every = [os.path.relpath(os.path.join(folder, name), EXAMPLES)
             for folder, dirs, files in os.walk(EXAMPLES) for name in files
             if name.endswith(".py") and os.path.getsize(os.path.join(folder, name))]
    missing = sorted(f for f in every if os.path.join(EXAMPLES, f) not in shown)
    assert not missing, f"example files no page includes: {missing}"


def test_readme_is_short_self_contained_and_its_code_runs():
    text = read(README)
    assert len(text.splitlines()) <= 300
    assert "../shared" not in text  # outside the repository
    for command in ("make demo", "make test", "make docs"):
        assert command in text
    examples = "\n".join(read(os.path.join(EXAMPLES, f)) for f in EXAMPLE_FILES)
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks, "the README shows a first task"
    for block in blocks:
        assert textwrap.dedent(block).strip() in examples, \
            f"README block not taken from docs/examples/:\n{block}"
