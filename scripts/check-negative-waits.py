"""Flag tests that sleep and then assert that nothing happened.

``time.sleep(...)`` followed within a few lines by a negative assertion (``assert not x``,
``x is None``, ``x == 0``, ``x not in y``, ``x != y``, ``.assert_not_called()``, ...) passes on a
slow machine whether or not the code is right: the thing that should not happen may simply not
have happened *yet*. Wait for an observable state instead (a counter, a log line, a message
count), or trigger the step deterministically.

Where the sleep is the point (a lease running out, a TTL passing), say so on the sleep's line
with ``# sleep-ok: <why>``; the checker then leaves it alone. An assertion that follows a wait
for an observable state (``wait_until(...)``, ``.wait(...)``, ``.join(...)``) between the sleep
and it is not flagged either.

Usage: ``python scripts/check-negative-waits.py [PATH ...]`` (files or folders; default
``tests``). Exit 1 with one line per finding, 0 when there is none. ``make test`` runs it.
"""

from __future__ import annotations

import ast
import io
import os
import re
import sys
import tokenize
from typing import Dict, Iterator, List, Optional, Tuple

#: Lines after a sleep (its last line) within which a negative assertion is flagged.
WINDOW = 5
#: The mark of a deliberate sleep, on its line, with the reason after the colon.
MARK = re.compile(r"#\s*sleep-ok:\s*(\S.*)?$")
#: Calls that wait for something observable: an assertion after one of them is not flagged.
WAITS = re.compile(r"^(wait\w*|retrying|join)$")
EMPTY = (0, "", b"", None)  # False and 0.0 equal 0


def _name(func: ast.expr) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def is_sleep(node: ast.AST) -> bool:
    """``time.sleep(...)`` or a bare ``sleep(...)`` (``from time import sleep``)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) \
            and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


def is_wait(node: ast.AST) -> bool:
    """``wait_until(...)``, ``event.wait(...)``, ``thread.join(...)``, ``result.get(timeout=...)``
    (not ``", ".join(...)`` nor ``dict.get(key)``)."""
    if not isinstance(node, ast.Call):
        return False
    name = _name(node.func) or ""
    if name == "get":
        return any(k.arg == "timeout" for k in node.keywords)
    if name == "join" and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Constant):
        return False
    return bool(WAITS.match(name))


def _empty(node: ast.expr) -> bool:
    """``0``, ``""``, ``None``, ``False``, ``[]``, ``{}``, ``set()``, ..."""
    if isinstance(node, ast.Constant):
        return node.value in EMPTY
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    return isinstance(node, ast.Call) and _name(node.func) in ("set", "list", "dict", "tuple") \
        and not node.args and not node.keywords


def is_negative(test: ast.expr) -> bool:
    """Whether an assertion's test says that something did not happen (in some part)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.BoolOp):
        return any(is_negative(value) for value in test.values)
    if isinstance(test, ast.Compare):
        sides = [test.left, *test.comparators]
        for op, left, right in zip(test.ops, sides, sides[1:]):
            if isinstance(op, (ast.NotIn, ast.NotEq)):
                return True
            if isinstance(op, (ast.Is, ast.Eq)) and (_empty(left) or _empty(right)):
                return True
    return False


def negative_calls(node: ast.AST) -> bool:
    """``mock.assert_not_called()`` and its kind."""
    return isinstance(node, ast.Call) and (_name(node.func) or "").startswith("assert_not_")


def _marks(source: str) -> Dict[int, Optional[str]]:
    """Line -> the reason of a ``# sleep-ok:`` comment on it (None: the reason is missing)."""
    marks: Dict[int, Optional[str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                match = MARK.search(token.string)
                if match:
                    reason = (match.group(1) or "").strip()
                    marks[token.start[0]] = reason if len(reason) >= 3 else None
    except (tokenize.TokenError, SyntaxError):
        pass
    return marks


def check_source(source: str, path: str = "<source>") -> List[str]:
    """The findings in one file's source, as ``path:line: message`` lines."""
    try:
        tree = ast.parse(source, path)
    except SyntaxError as exc:
        return [f"{path}:{exc.lineno}: cannot parse: {exc.msg}"]
    marks = _marks(source)
    sleeps: List[Tuple[int, int]] = []  # (first line, last line) of each sleep's statement
    negatives: List[Tuple[int, str]] = []
    waits: List[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For,
                       ast.While, ast.With, ast.Try)):
            if any(is_sleep(child) for child in ast.walk(node)):
                sleeps.append((node.lineno, node.end_lineno or node.lineno))
        if isinstance(node, ast.Assert) and is_negative(node.test):
            negatives.append((node.lineno, ast.unparse(node.test)))
        elif negative_calls(node):
            negatives.append((node.lineno, ast.unparse(node)))  # type: ignore[arg-type]
        if is_wait(node):
            waits.append(node.lineno)
    findings = []
    for first, last in sorted(sleeps):
        lines = range(first, last + 1)
        reasons = [marks[line] for line in lines if line in marks]
        if reasons:
            if all(reason is None for reason in reasons):
                findings.append(f"{path}:{first}: '# sleep-ok:' without a reason: say why the "
                                "sleep is the point")
            continue
        for line, text in sorted(negatives):
            if not first <= line <= last + WINDOW:
                continue
            if any(last < wait < line for wait in waits):
                continue  # waited for something observable since
            findings.append(
                f"{path}:{first}: a sleep, then at line {line} a negative assertion "
                f"({text[:60]}): wait for an observable state instead, or mark the sleep "
                "'# sleep-ok: <why>' where the sleep is the point")
            break
    return findings


def python_files(paths: List[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for folder, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for name in sorted(files):
                    if name.endswith(".py"):
                        yield os.path.join(folder, name)
        else:
            yield path


def main(argv: List[str]) -> int:
    findings = []
    for path in python_files(argv or ["tests"]):
        with open(path, encoding="utf-8") as f:
            findings += check_source(f.read(), path)
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
