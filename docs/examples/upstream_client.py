"""Pauses, quotas with settled units and a learned limit, through the client API on the memory
backend (no Celery)."""
from celery_semaphore import Adaptive, Backoff, Semaphore

BACKEND = "memory://upstream-client"


def pause_and_resume():
    # [pause-start]
    api = Semaphore("partner-api", 4, backend=BACKEND)
    api.pause(30, reason="partner maintenance")  # for everyone, on the backend's clock
    assert api.try_acquire() is None             # closed: nobody starts
    status = api.status()
    assert status.paused_until is not None and status.pause_reason == "partner maintenance"
    assert api.resume() is True                  # open again
    with api.acquire(timeout=5):
        pass
    # [pause-end]


def backoff_in_a_block():
    # [block-start]
    api = Semaphore("partner-api-2", 4, backend=BACKEND)
    try:
        with api.acquire(timeout=5):
            raise Backoff(retry_after="20", reason="HTTP 429")  # as the API answered
    except Backoff:
        pass
    assert api.try_acquire() is None  # closed for everyone for 20 s (the slot is free)
    # [block-end]
    api.resume()


def tokens():
    # [tokens-start]
    llm = Semaphore("llm", 10, backend=BACKEND, quota="1000/d")
    first = llm.acquire(timeout=5, units=800)    # admitted on its estimate: 800 tokens
    assert llm.try_acquire(units=800) is None    # 800 + 800 > 1000 today
    first.settle(120)                            # it spent 120: 680 come back at once
    second = llm.try_acquire(units=800)          # 120 + 800 <= 1000
    assert second is not None
    (window,) = llm.status().quotas
    assert (window.used, window.count) == (920, 1000)
    # [tokens-end]
    first.release()
    second.release()


def learned_limit():
    # [learned-start]
    partner = Semaphore("partner-learned", Adaptive(min=1, max=8), backend=BACKEND)
    for _ in range(3):
        with partner.acquire(timeout=5):  # succeeded: the limit grows while in use
            pass
    grown = partner.status().adaptive.current
    assert grown > 1
    try:
        with partner.acquire(timeout=5):
            raise Backoff()               # overload, no time: the limit goes down
    except Backoff:
        pass
    assert partner.status().adaptive.current < grown
    # [learned-end]
    return grown


if __name__ == "__main__":
    pause_and_resume()
    backoff_in_a_block()
    tokens()
    print(learned_limit())
