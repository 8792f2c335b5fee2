"""Fencing tokens: a protected resource that refuses writes from a stale holder."""
from celery_semaphore import Semaphore


# [store-start]
class FencedStore:
    """Remembers the highest epoch accepted per slot and refuses lower ones."""

    def __init__(self):
        self.data = {}
        self.highest = {}  # slot -> highest epoch accepted

    def write(self, key, value, token):
        if token.epoch < self.highest.get(token.slot, -1):
            raise PermissionError(f"stale fencing token {token}")
        self.highest[token.slot] = token.epoch
        self.data[key] = value
# [store-end]


if __name__ == "__main__":
    store = FencedStore()
    sem = Semaphore("store", limit=1, backend="memory://fencing", ttl=0.2)
    # [usage-start]
    old = sem.acquire()  # a holder that will stall past its lease
    old_token = old.token
    import time

    time.sleep(0.3)  # the lease expires (a GC pause, a partition...)
    assert not old.valid  # the local deadline passed
    new = sem.acquire(timeout=5)  # the slot goes to someone else, with a higher epoch
    store.write("report", "new", new.token)
    try:
        store.write("report", "old", old_token)  # the stale holder wakes up and writes
    except PermissionError as exc:
        print(exc)
    else:
        raise AssertionError("a stale write was accepted")
    assert store.data["report"] == "new"
    # [usage-end]
    new.release()
