"""A partner API on loopback for W10 (``../shared/workloads.md``): every call takes ``SERVICE``
seconds and is answered 200, or 429 with ``Retry-After`` when a limit of the API's own is
passed. One of three limits, chosen when the server starts:

* ``window`` (W10a): at most ``quota`` calls per fixed window of ``period`` seconds, aligned
  to the UTC epoch; a call over it is answered 429 with ``Retry-After`` = the seconds left in
  the window, rounded up;
* ``concurrency`` (W10b): at most ``capacity`` calls at once, 429 with ``Retry-After: 1``
  beyond; ``capacity`` halves ``halve_after`` seconds after the first call;
* ``tokens`` (W10c): at most ``budget`` tokens per window of ``period`` seconds; each call
  spends between 5 and 50 tokens (seeded), told in its answer (``{"tokens": n}``); a call whose
  tokens would pass the budget is answered 429 with ``Retry-After`` = the seconds left in the
  window (its tokens are not spent).

The server logs every call (arrival time, status, the end of the ``Retry-After`` it was
given): ``GET /log`` returns it as JSON, with the concurrency the API saw at its peak. Run it in
a thread of the benchmark (:func:`serve`); tasks call ``POST /call`` (:func:`call`).
"""

from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

SERVICE = 0.02


class PartnerAPI:
    """The API's limits and its log (thread-safe: the server's threads call it)."""

    def __init__(self, mode: str, *, quota: int = 0, period: float = 1.0, capacity: int = 0,
                 halve_after: Optional[float] = None, budget: int = 0, seed: int = 10,
                 service: float = SERVICE) -> None:
        self.mode = mode
        self.quota, self.period = quota, period
        self.capacity, self.halve_after = capacity, halve_after
        self.budget = budget
        self.service = service
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.log: List[Dict[str, Any]] = []
        self.windows: Dict[float, int] = {}  # window start -> calls (or tokens) in it
        self.running = self.peak = 0
        self.first: Optional[float] = None

    def _window(self, now: float) -> Tuple[float, float]:
        start = math.floor(now / self.period) * self.period
        return start, start + self.period

    def admit(self, key: str = "") -> Tuple[int, Optional[float], int]:
        """A call (of the task called with ``key``) arrives: ``(status, retry_after_seconds or
        None, tokens)``."""
        now = time.time()
        with self.lock:
            if self.first is None:
                self.first = now
            status, retry, tokens = 200, None, 0
            if self.mode == "window":
                start, end = self._window(now)
                if self.windows.get(start, 0) >= self.quota:
                    status, retry = 429, float(math.ceil(end - now))
                else:
                    self.windows[start] = self.windows.get(start, 0) + 1
            elif self.mode == "concurrency":
                capacity = self.capacity
                if self.halve_after is not None and now - self.first >= self.halve_after:
                    capacity = max(1, capacity // 2)
                if self.running >= capacity:
                    status, retry = 429, 1.0
            elif self.mode == "tokens":
                tokens = self.random.randint(5, 50)
                start, end = self._window(now)
                if self.windows.get(start, 0) + tokens > self.budget:
                    status, retry, tokens = 429, float(math.ceil(end - now)), 0
                else:
                    self.windows[start] = self.windows.get(start, 0) + tokens
            if status == 200:
                self.running += 1
                self.peak = max(self.peak, self.running)
            self.log.append({"t": now, "key": key, "status": status, "tokens": tokens,
                             "retry_until": None if retry is None else now + retry})
            return status, retry, tokens

    def done(self) -> None:
        with self.lock:
            self.running -= 1

    def report(self) -> Dict[str, Any]:
        with self.lock:
            return {"calls": list(self.log), "peak": self.peak,
                    "windows": {str(k): v for k, v in self.windows.items()}}


def serve(api: PartnerAPI) -> Tuple[ThreadingHTTPServer, str]:
    """Start the API on a free loopback port, in daemon threads; ``(server, base URL)``."""

    class Handler(BaseHTTPRequestHandler):
        # keep-alive (every answer has a Content-Length): one connection per pool process, not
        # a connect per call; the headers and the body are two writes: no Nagle delay
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            key = self.rfile.read(length).decode() if length else ""
            status, retry, tokens = api.admit(key)
            if status == 200:
                time.sleep(api.service)
                api.done()
            body = json.dumps({"tokens": tokens}).encode()
            self.send_response(status)
            if retry is not None:
                self.send_header("Retry-After", str(int(retry)))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            body = json.dumps(api.report()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        # a burst of connects must not overflow the listen backlog (socketserver's 5): a
        # dropped SYN is retried a second later, and the call would reach the API that late
        request_queue_size = 128

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class Answer:
    """What a call came back with: ``status``, ``headers`` (for :meth:`.Backoff.from_response`),
    ``tokens``."""

    def __init__(self, status: int, headers: Any, tokens: int) -> None:
        self.status, self.headers, self.tokens = status, headers, tokens


_local = threading.local()


def call(base: str, key: str = "") -> Answer:
    """One call to the API at ``base`` (a keep-alive connection per thread and process), on
    behalf of the task called with ``key`` (the API's log names it)."""
    host, port = base.rsplit("//", 1)[1].split(":")
    connection = getattr(_local, "connection", None)
    for attempt in range(2):
        if connection is None:
            connection = _local.connection = http.client.HTTPConnection(host, int(port),
                                                                        timeout=30)
        try:
            connection.request("POST", "/call", body=key.encode())
            response = connection.getresponse()
            body = json.loads(response.read() or b"{}")
            return Answer(response.status, response.headers, int(body.get("tokens", 0)))
        except (ConnectionError, http.client.HTTPException):
            connection.close()
            connection = _local.connection = None
            if attempt:
                raise
    raise AssertionError("unreachable")


def fetch_log(base: str) -> Dict[str, Any]:
    host, port = base.rsplit("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", "/log")
        return dict(json.loads(connection.getresponse().read()))
    finally:
        connection.close()
