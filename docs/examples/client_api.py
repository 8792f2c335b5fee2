"""The client API without Celery: Semaphore, Lease, acquire_all."""
import os
import tempfile

from celery_semaphore import Semaphore, SemaphoreTimeout, acquire_all

# SQLite serves the processes of one host; use redis://host:6379/0 (or another backend's URL)
# for a cluster.
backend = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "semaphores.db")

# [client-start]
sem = Semaphore("images", limit=2, backend=backend, ttl=60)

with sem.acquire(timeout=10) as lease:  # SemaphoreTimeout after 10 s without a slot
    print(lease.name, lease.token, lease.valid)  # images 0:<epoch> True (token = slot:epoch)
    assert lease.verify()  # one round trip: the backend still knows this lease

first = sem.acquire()
second = sem.try_acquire()  # a Lease, or None when no slot is free; never blocks
assert second is not None
assert sem.try_acquire() is None  # both slots are held
try:
    sem.acquire(timeout=0.2)
except SemaphoreTimeout as exc:
    print("timed out:", exc)
status = sem.status()  # limit, holders, waiters
assert status.limit == 2 and status.held == 2
first.release()
assert second.release() is True  # True for the call that freed the slot
assert second.release() is False  # idempotent: later calls touch nothing

sem.resize(3)  # the stored limit, for every process of this backend
assert sem.status().limit == 3
# [client-end]

# [all-start]
api = Semaphore("api", limit=20, backend=backend)
tenant = Semaphore("api:7", limit=2, backend=backend)
with acquire_all([api, tenant], timeout=10) as group:  # both together, or none while waiting
    assert set(group.leases) == {"api", "api:7"}
    print(group.tokens)  # one fencing token per semaphore
# [all-end]
