"""Small helpers shared by the tests."""

import time


def wait_until(predicate, timeout=10.0, interval=0.01):
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
