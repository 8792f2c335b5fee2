"""The documentation's code examples run, and every code example is one that runs.

The docs show code only through ``literalinclude`` of files under docs/examples/; each file
runs here in a fresh interpreter (eager mode, the memory:// or SQLite backend: no server), so
an example that stops working fails the suite. ``make docs`` builds the site itself with
warnings as errors (a missing include, a broken link or anchor).
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
    missing = [f for f in EXAMPLE_FILES if os.path.join(EXAMPLES, f) not in shown]
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
