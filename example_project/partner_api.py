"""A partner's order API for the demo: a real HTTP server on 127.0.0.1.

It serves at most ``capacity`` calls at once (each takes ``service_time`` seconds); a call
that arrives while ``capacity`` are in progress is answered at once ``429 Too Many Requests``
with ``Retry-After: <retry_after>`` (whole seconds, as delay-seconds). It does not say its
capacity: a client has to learn it (``sync_order``'s adaptive limit, in tasks.py).

Every answer is appended to a log, one JSON object a line: ``t`` when the call arrived and
``end`` when it was answered (this host's ``time.time()``), ``status``, ``retry_after`` (the
seconds a 429 gave, else None), ``in_progress`` (the calls in progress when it arrived, not
counting it), ``path`` and ``id`` (the caller's ``X-Request-Id``: sync_order sends its task
id). A line is written whole, once the answer is sent.

``python -m example_project.partner_api [--port 8642] [--log partner_api.log]`` serves it
alone, for workers run by hand (tasks.py calls ``EXAMPLE_PARTNER_URL``, by default
``http://127.0.0.1:8642``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

HOST = "127.0.0.1"  # loopback only
PORT = 8642


class PartnerAPI:
    """The API: :meth:`start` serves it on a thread (``port=0``: any free port, see
    :attr:`url`), :meth:`stop` ends it. Never more than ``capacity`` calls are served at
    once: the check and the count are one step under a lock."""

    def __init__(self, log_path: str, capacity: int = 2, service_time: float = 0.25,
                 retry_after: int = 1, port: int = 0) -> None:
        self.log_path, self.capacity = log_path, capacity
        self.service_time, self.retry_after = service_time, retry_after
        self.in_progress = 0
        self._lock = threading.Lock()
        self._log_lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                arrived = time.time()
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                api.handle(self, arrived)

            do_GET = do_POST

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the API keeps its own log

        self.server = ThreadingHTTPServer((HOST, port), Handler)
        self.server.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.server.server_address[1]}"

    def start(self) -> "PartnerAPI":
        """Serve on a daemon thread; return self."""
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name="partner-api")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join()
            self._thread = None
        self.server.server_close()

    def handle(self, request: BaseHTTPRequestHandler, arrived: float) -> None:
        with self._lock:
            busy = self.in_progress
            admitted = busy < self.capacity
            if admitted:
                self.in_progress += 1
        if admitted:
            try:
                time.sleep(self.service_time)  # the work
                body = json.dumps({"ok": True, "path": request.path}).encode()
                self._answer(request, 200, body, {})
            finally:
                with self._lock:
                    self.in_progress -= 1
        else:
            body = json.dumps({"error": "too many requests"}).encode()
            self._answer(request, 429, body, {"Retry-After": str(self.retry_after)})
        self._log({"t": arrived, "end": time.time(), "status": 200 if admitted else 429,
                   "retry_after": None if admitted else self.retry_after,
                   "in_progress": busy, "path": request.path,
                   "id": request.headers.get("X-Request-Id")})

    def _answer(self, request: BaseHTTPRequestHandler, status: int, body: bytes,
                headers: Dict[str, str]) -> None:
        request.send_response(status)
        for name, value in {"Content-Type": "application/json",
                            "Content-Length": str(len(body)), **headers}.items():
            request.send_header(name, value)
        request.end_headers()
        request.wfile.write(body)

    def _log(self, entry: Dict[str, Any]) -> None:
        with self._log_lock, open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def read_log(path: str) -> List[Dict[str, Any]]:
    """Every answer logged so far, in the order they were answered ([] without a log)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--log", default="partner_api.log")
    args = parser.parse_args()
    api = PartnerAPI(args.log, port=args.port).start()
    print(f"partner API on {api.url} (at most {api.capacity} calls at once); log: {args.log}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        api.stop()


if __name__ == "__main__":
    main()
