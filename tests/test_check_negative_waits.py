"""scripts/check-negative-waits.py: a sleep followed by a negative assertion is flagged, a wait
for an observable state or a sleep marked as the point is not, and today's tests pass it."""

import importlib.util
import os
import subprocess
import sys
import textwrap

from tests.workers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "check-negative-waits.py")
_spec = importlib.util.spec_from_file_location("check_negative_waits", SCRIPT)
checker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checker)


def findings(source):
    return checker.check_source(textwrap.dedent(source), "t.py")


def test_each_kind_of_negative_assertion_after_a_sleep_is_flagged():
    negatives = ["not results", "x is None", "x is False", "x == 0", "len(x) == 0",
                 "x == []", "x == {}", "x == set()", "'answer' not in result", "x != y",
                 "0 == x", "ok and not lost.is_set()"]
    for negative in negatives:
        found = findings(f"""
            import time
            def test():
                time.sleep(0.3)
                assert {negative}
            """)
        assert len(found) == 1 and found[0].startswith("t.py:4: "), (negative, found)
    found = findings("""
        from time import sleep
        def test(mock):
            sleep(1)
            mock.assert_not_called()
        """)
    assert len(found) == 1 and "assert_not_called" in found[0]


def test_positive_assertions_distant_ones_and_ones_after_a_wait_pass():
    assert findings("""
        import time
        def test():
            time.sleep(0.3)
            assert x == 2 and y is not None and z in w
        """) == []
    assert findings("""
        import time
        def test():
            time.sleep(0.3)
            a()
            b()
            c()
            d()
            e()
            assert not x  # six lines on: out of the window
        """) == []
    for wait in ("wait_until(lambda: ready())", "event.wait(5)", "thread.join(5)",
                 "result.get(timeout=10)"):
        assert findings(f"""
            import time
            def test():
                time.sleep(0.3)
                assert {wait}
                assert not x
            """) == [], wait
    # not waits: a string's join, a dict's get
    assert len(findings("""
        import time
        def test():
            time.sleep(0.3)
            names = ", ".join(found.get(k) for k in keys)
            assert not names
        """)) == 1


def test_a_marked_sleep_passes_and_a_mark_needs_a_reason():
    assert findings("""
        import time
        def test():
            time.sleep(0.5)  # sleep-ok: the 0.3 s lease runs out
            assert not lease.valid
        """) == []
    found = findings("""
        import time
        def test():
            time.sleep(0.5)  # sleep-ok:
            assert not lease.valid
        """)
    assert len(found) == 1 and "without a reason" in found[0]
    # a mark on another line is no mark
    assert len(findings("""
        import time
        def test():
            # sleep-ok: not this line
            time.sleep(0.5)
            assert not lease.valid
        """)) == 1


def test_a_sleep_in_a_loop_and_the_same_line_count():
    assert len(findings("""
        import time
        def test():
            for _ in range(3):
                time.sleep(0.1)
            assert calls == []
        """)) == 1
    assert len(findings("""
        import time
        def test():
            time.sleep(0.1); assert not calls
        """)) == 1


def test_the_command_exits_1_on_findings_and_0_on_the_projects_tests(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import time\n\ndef test():\n    time.sleep(1)\n    assert not seen\n")
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and f"{bad}:4: a sleep, then at line 5" in done.stdout
    done = subprocess.run([sys.executable, SCRIPT, "tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout
