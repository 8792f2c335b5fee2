"""Tasks that follow the API behind them: a Backoff on 429, a learned limit, calendar quotas,
and tokens estimated at admission then settled (eager mode, memory backend)."""
from types import SimpleNamespace

import requests
from celery import Celery
from requests.structures import CaseInsensitiveDict

import celery_semaphore
from celery_semaphore import Adaptive, Backoff, current_lease

app = Celery("proj", broker="memory://")
app.conf.semaphore_backend = "memory://upstream-tasks"
app.conf.task_always_eager = True  # so that this file runs in one process
celery_semaphore.install(app)


class Partner:
    """Stands in for an HTTP API that answers 429 (Retry-After: 1) to its first call."""

    calls = 0

    def post(self, url):
        self.calls += 1
        response = requests.Response()
        response.status_code = 429 if self.calls == 1 else 200
        response.headers = CaseInsensitiveDict({"Retry-After": "1"} if self.calls == 1 else {})
        response._content = b'{"ok": true}'
        return response


class LLM:
    """Stands in for an LLM client: an answer spends some of the tokens it may."""

    def complete(self, prompt, max_tokens):
        return SimpleNamespace(text=prompt.upper(), usage=SimpleNamespace(total_tokens=42))


partner, llm = Partner(), LLM()


# [partner-start]
@app.task(semaphore="partner-api", limit=Adaptive(min=1, max=16))
def sync_order(order_id):
    response = partner.post(f"https://partner.example/orders/{order_id}")
    if response.status_code == 429:  # closes partner-api everywhere, gives the call back
        raise Backoff.from_response(response, default=5)
    response.raise_for_status()
    return response.json()
# [partner-end]


# [quota-start]
@app.task(semaphore="shop:{shop_id}", semaphore_rate="2/s",
          semaphore_quota="1000/h; 20000/d", semaphore_quota_tz="America/New_York")
def sync_shop(shop_id):  # each shop: 2 starts/s, 1000 an hour, 20,000 a New York day
    return shop_id
# [quota-end]


# [tokens-start]
@app.task(semaphore="llm", limit=8, semaphore_quota="90000/m; 2000000/d",
          semaphore_units="{max_tokens}")  # admitted on its estimate: max_tokens
def complete(prompt, max_tokens=1000):
    answer = llm.complete(prompt, max_tokens=max_tokens)
    current_lease().settle(answer.usage.total_tokens)  # what it spent: the rest comes back
    return answer.text
# [tokens-end]


if __name__ == "__main__":
    assert sync_order.delay(7).get(timeout=30) == {"ok": True}  # ran again once reopened
    assert partner.calls == 2
    print(sync_shop.delay("acme").get())
    print(complete.delay("hello", max_tokens=500).get())
