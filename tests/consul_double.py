"""A test double of the Consul agent's HTTP API: the session and KV endpoints, nothing else.

Written from Consul's API documentation (``/v1/kv``, ``/v1/session``, blocking queries), not from
this project's code, so the Consul backend is tested against Consul's protocol:

* one Raft-like index: every write request takes the next index; an entry's ``CreateIndex`` /
  ``ModifyIndex`` are the indexes of the writes that created / last changed it, and deletes
  leave a tombstone index so that a listing's ``X-Consul-Index`` rises when a key goes away;
* ``GET /v1/kv/<key>`` (``?recurse``, ``?keys``, ``?separator``, ``?index=&wait=`` blocking,
  ``?consistent``/``?stale`` accepted; a single key answers with the KV table's index, a
  listing with the highest index under its prefix, tombstones included), ``PUT`` (``?cas``,
  ``?acquire``, ``?release``, ``?flags``; values over 512 KiB refused with 413; a write equal
  to the entry leaves its ``ModifyIndex``) answering ``true``/``false``, ``DELETE``
  (``?recurse``, ``?cas``; a cas delete of a missing key succeeds); values are base64 in JSON,
  ``LockIndex`` counts successful acquisitions, an acquire of a key locked by another session
  answers ``false``, an unknown session is an error (500);
* sessions with ``TTL`` (a Go duration string; Consul refuses less than 10 s, here
  ``min_ttl``), ``Behavior`` ``release``/``delete``, ``LockDelay``; a session is invalidated by
  ``/v1/session/destroy`` or when its TTL passes unrenewed (Consul waits up to twice the TTL:
  ``ttl_multiplier``); its locks are then released or deleted and lock-delayed;
* ``?dc=`` other than the double's datacenter fails like a datacenter with no route (500);
  with ``acl_token`` set, a request without that token is refused with 403.

Only 127.0.0.1. Start with :meth:`ConsulDouble.start`, stop with :meth:`ConsulDouble.stop`.
"""

from __future__ import annotations

import base64
import json
import random
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
MAX_WAIT = 600.0
MAX_VALUE_SIZE = 512 * 1024  # Consul's default kv_max_value_size
DEFAULT_WAIT = 300.0


class HTTPError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_duration(text: str) -> float:
    """A Go duration ("10s", "1m30s", "150ms") in seconds; a bare number is seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d*)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise HTTPError(400, f"Request decode failed: time: invalid duration {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


class ConsulDouble:
    """An in-process Consul agent double on 127.0.0.1 (random port)."""

    def __init__(
        self,
        *,
        datacenter: str = "dc1",
        min_ttl: float = 10.0,
        ttl_multiplier: float = 2.0,
        acl_token: Optional[str] = None,
    ) -> None:
        self.datacenter = datacenter
        self.min_ttl = min_ttl
        self.ttl_multiplier = ttl_multiplier
        self.acl_token = acl_token
        self.tokens_seen: List[Optional[str]] = []
        self.cond = threading.Condition()
        self.index = 1
        self.kv: Dict[str, Dict[str, Any]] = {}
        self.tombstones: Dict[str, int] = {}
        self.kv_index = 1
        self.sessions: Dict[str, Dict[str, Any]] = {}
        self.session_index = 1
        self.deadlines: Dict[str, float] = {}
        self.lock_delays: Dict[str, float] = {}
        self._server: Optional[ThreadingHTTPServer] = None
        # Answers of KV reads at the current index, encoded once: a write wakes every blocking
        # query on the prefix at once, and they would otherwise each render the same answer.
        self._answers: Dict[Tuple[int, str, str], Tuple[int, Optional["Encoded"]]] = {}
        self._stopped = threading.Event()
        #: Blocking queries waiting for a change now, and wake-ups after which one found
        #: nothing new under its key or prefix and went on waiting (read with ``cond``).
        self.blocked = 0
        self.woken_unchanged = 0

    # -- life cycle --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"consul://{self.address}"

    def start(self) -> "ConsulDouble":
        double = self

        class Handler(_Handler):
            store = double

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="consul-double-http").start()
        threading.Thread(target=self._reap, daemon=True, name="consul-double-ttl").start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self.cond:
            self.cond.notify_all()

    # -- state changes (called with self.cond held) -------------------------------------------

    def _next_index(self) -> int:
        self.index += 1
        return self.index

    def _changed(self) -> None:
        self.cond.notify_all()

    def _put_entry(self, key: str, value: Optional[bytes], flags: int, index: int,
                   session: Optional[str] = None, lock_index: Optional[int] = None) -> None:
        old = self.kv.get(key)
        entry = {
            "LockIndex": old["LockIndex"] if old else 0,
            "Key": key,
            "Flags": flags,
            "Value": value,
            "Session": old["Session"] if old else "",
            "CreateIndex": old["CreateIndex"] if old else index,
            "ModifyIndex": index,
        }
        if session is not None:
            entry["Session"] = session
        if lock_index is not None:
            entry["LockIndex"] = lock_index
        if old is not None and all(old[k] == entry[k] for k in
                                   ("Value", "Flags", "Session", "LockIndex")):
            return  # Consul skips a write equal to the entry: ModifyIndex stays
        self.kv[key] = entry
        self.tombstones.pop(key, None)
        self.kv_index = index

    def _delete_entry(self, key: str, index: int) -> None:
        del self.kv[key]
        self.tombstones[key] = index
        self.kv_index = index

    def _invalidate(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        self.deadlines.pop(session_id, None)
        if session is None:
            return
        index = self._next_index()
        self.session_index = index
        delay = session["LockDelay"] / 1e9
        for key in [k for k, e in self.kv.items() if e["Session"] == session_id]:
            if delay > 0:
                self.lock_delays[key] = time.monotonic() + delay
            if session["Behavior"] == "delete":
                self._delete_entry(key, index)
            else:
                self._put_entry(key, self.kv[key]["Value"], self.kv[key]["Flags"], index,
                                session="")
        self._changed()

    def _reap(self) -> None:
        while not self._stopped.wait(0.02):
            now = time.monotonic()
            with self.cond:
                for session_id in [s for s, d in self.deadlines.items() if d <= now]:
                    self._invalidate(session_id)

    def destroy_session(self, session_id: str) -> None:
        """What ``consul session destroy``, or Consul's failure detector, does."""
        with self.cond:
            self._invalidate(session_id)

    # -- reads ---------------------------------------------------------------------------------

    def _kv_answer(self, key: str, query: Dict[str, str]) -> Tuple[int, Optional["Encoded"]]:
        """``_kv_read``'s answer, JSON-encoded, cached until the next write."""
        form = json.dumps([query.get(k) for k in ("recurse", "keys", "separator")])
        cached = self._answers.get((self.index, key, form))
        if cached is None:
            if len(self._answers) > 1000 or any(i != self.index for i, _, _ in self._answers):
                self._answers.clear()
            index, body = self._kv_read(key, query)
            cached = (index, None if body is None else Encoded(json.dumps(body).encode()))
            self._answers[(self.index, key, form)] = cached
        return cached

    def _kv_read(self, key: str, query: Dict[str, str]) -> Tuple[int, Any]:
        if "recurse" in query or "keys" in query:
            entries = sorted((e for k, e in self.kv.items() if k.startswith(key)),
                             key=lambda e: e["Key"])
            index = max([e["ModifyIndex"] for e in entries]
                        + [i for k, i in self.tombstones.items() if k.startswith(key)] + [0])
            if key == "":
                index = self.kv_index
            index = index or self.kv_index
            if "keys" in query:
                separator = query.get("separator", "")
                keys: List[str] = []
                for e in entries:
                    rest = e["Key"][len(key):]
                    cut = rest.find(separator) if separator else -1
                    name = e["Key"] if cut < 0 else key + rest[: cut + len(separator)]
                    if not keys or keys[-1] != name:
                        keys.append(name)
                return max(index, 1), keys or None
            return max(index, 1), [_render(e) for e in entries] or None
        entry = self.kv.get(key)  # a single key answers with the KV table's index
        return max(self.kv_index, 1), None if entry is None else [_render(entry)]

    def blocking(self, query: Dict[str, str], read: Any) -> Tuple[int, Any]:
        """Run ``read`` (returns index, body) as Consul's blocking queries do."""
        wanted = int(query.get("index", "0") or 0)
        with self.cond:
            index, body = read()
            if wanted <= 0:
                return index, body
            wait = min(parse_duration(query["wait"]) if "wait" in query else DEFAULT_WAIT,
                       MAX_WAIT)
            deadline = time.monotonic() + wait + random.uniform(0, wait / 16)
            while index <= wanted and not self._stopped.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.blocked += 1
                try:
                    woken = self.cond.wait(left)
                finally:
                    self.blocked -= 1
                index, body = read()
                if woken and index <= wanted:
                    self.woken_unchanged += 1
            return index, body

    # -- requests ------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: Dict[str, str], body: bytes,
               token: Optional[str]) -> Tuple[int, Any, Optional[int]]:
        """One request: (status, JSON-able body or error text, X-Consul-Index or None)."""
        self.tokens_seen.append(token)
        if self.acl_token is not None and token != self.acl_token:
            raise HTTPError(403, "Permission denied")
        if query.get("dc", self.datacenter) != self.datacenter:
            raise HTTPError(500, "No path to datacenter")
        if path.startswith("/v1/kv/"):
            return self._kv(method, unquote(path[len("/v1/kv/"):]), query, body)
        if path.startswith("/v1/session/"):
            return self._session(method, path[len("/v1/session/"):], query, body)
        if path == "/v1/status/leader" and method == "GET":
            return 200, "127.0.0.1:8300", None
        raise HTTPError(404, "Not found")

    def _kv(self, method: str, key: str, query: Dict[str, str], body: bytes):
        if method == "GET":
            index, result = self.blocking(query, lambda: self._kv_answer(key, query))
            return (200 if result is not None else 404), result, index
        if method == "PUT":
            if len(body) > MAX_VALUE_SIZE:
                raise HTTPError(413, f"Request body({len(body)} bytes) too large, max size: "
                                     f"{MAX_VALUE_SIZE} bytes")
            with self.cond:
                return 200, self._kv_put(key, query, body or None), None
        if method == "DELETE":
            with self.cond:
                return 200, self._kv_delete(key, query), None
        raise HTTPError(405, "method not allowed")

    def _kv_put(self, key: str, query: Dict[str, str], value: Optional[bytes]) -> bool:
        old = self.kv.get(key)
        flags = int(query.get("flags") or 0)  # Consul: a write without ?flags stores 0
        if "release" in query:
            session = query["release"]
            if old is None or old["Session"] != session:
                return False
            self._put_entry(key, value, flags, self._next_index(), session="")
        elif "acquire" in query:
            session = query["acquire"]
            if session not in self.sessions:
                raise HTTPError(500, f'invalid session "{session}"')
            if self.lock_delays.get(key, 0) > time.monotonic():
                return False
            if old is not None and old["Session"] not in ("", session):
                return False
            if old is not None and old["Session"] == session:
                self._put_entry(key, value, flags, self._next_index())
            else:
                lock_index = (old["LockIndex"] if old else 0) + 1
                self._put_entry(key, value, flags, self._next_index(), session=session,
                                lock_index=lock_index)
        elif "cas" in query:
            cas = int(query["cas"])
            if (cas == 0 and old is not None) or (
                cas != 0 and (old is None or old["ModifyIndex"] != cas)
            ):
                return False
            self._put_entry(key, value, flags, self._next_index())
        else:
            self._put_entry(key, value, flags, self._next_index())
        self._changed()
        return True

    def _kv_delete(self, key: str, query: Dict[str, str]) -> bool:
        if "recurse" in query:
            keys = [k for k in self.kv if k.startswith(key)]
        elif "cas" in query:
            old = self.kv.get(key)
            if old is None:
                return True  # Consul: nothing to delete is a success, whatever the index
            if old["ModifyIndex"] != int(query["cas"]):
                return False
            keys = [key]
        else:
            keys = [key] if key in self.kv else []
        index = self._next_index()
        for k in keys:
            self._delete_entry(k, index)
        if keys:
            self._changed()
        return True

    def _session(self, method: str, rest: str, query: Dict[str, str], body: bytes):
        op, _, session_id = rest.partition("/")
        with self.cond:
            if op == "create" and method == "PUT":
                return 200, self._session_create(body), None
            if op == "destroy" and method == "PUT":
                self._invalidate(session_id)
                return 200, True, None
            if op == "renew" and method == "PUT":
                session = self.sessions.get(session_id)
                if session is None:
                    raise HTTPError(404, f"Session id '{session_id}' not found")
                self._arm(session)
                return 200, [dict(session)], None
        if op == "info" and method == "GET":
            return (200, *self._session_read(query, lambda: [
                dict(s) for s in self.sessions.values() if s["ID"] == session_id]))
        if op == "list" and method == "GET":
            return (200, *self._session_read(query, lambda: [
                dict(s) for s in self.sessions.values()]))
        raise HTTPError(405, "method not allowed")

    def _session_read(self, query: Dict[str, str], read: Any) -> Tuple[Any, int]:
        index, body = self.blocking(query, lambda: (self.session_index, read()))
        return body, index

    def _session_create(self, body: bytes) -> Dict[str, str]:
        try:
            raw = json.loads(body) if body.strip() else {}
        except ValueError as exc:
            raise HTTPError(400, f"Request decode failed: {exc}") from exc
        fields = {k.lower(): v for k, v in (raw or {}).items()}
        behavior = fields.get("behavior") or "release"
        if behavior not in ("release", "delete"):
            raise HTTPError(400, f"Invalid Behavior setting '{behavior}'")
        ttl = fields.get("ttl") or ""
        if ttl:
            seconds = parse_duration(ttl)
            if seconds != 0 and not self.min_ttl <= seconds <= 86400:
                raise HTTPError(400, f"Invalid Session TTL '{ttl}', must be between "
                                     f"[{self.min_ttl:g}s=24h0m0s]")
        delay = fields.get("lockdelay", "15s")
        delay_s = delay / 1e9 if isinstance(delay, (int, float)) else parse_duration(delay)
        index = self._next_index()
        self.session_index = index
        session = {
            "ID": str(uuid.uuid4()),
            "Name": fields.get("name", ""),
            "Node": fields.get("node") or "consul-double",
            "LockDelay": int(delay_s * 1e9),
            "Behavior": behavior,
            "TTL": ttl,
            "NodeChecks": fields.get("nodechecks", fields.get("checks", ["serfHealth"])),
            "ServiceChecks": fields.get("servicechecks"),
            "CreateIndex": index,
            "ModifyIndex": index,
        }
        self.sessions[session["ID"]] = session
        self._arm(session)
        self._changed()
        return {"ID": session["ID"]}

    def _arm(self, session: Dict[str, Any]) -> None:
        if session["TTL"]:
            seconds = parse_duration(session["TTL"])
            if seconds:
                self.deadlines[session["ID"]] = time.monotonic() + seconds * self.ttl_multiplier


class Encoded(bytes):
    """A response body already encoded as JSON."""


def _render(entry: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(entry)
    out["Value"] = base64.b64encode(entry["Value"]).decode() if entry["Value"] else None
    if not out["Session"]:
        del out["Session"]  # Consul omits an empty Session
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Consul (Go's net/http) listens with the kernel's somaxconn backlog; socketserver's
    # default of 5 drops the SYNs of a few dozen processes connecting at once, and each
    # dropped SYN costs its client a one-second retransmission.
    request_queue_size = socket.SOMAXCONN

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up (killed test processes): nothing to report


class _Handler(BaseHTTPRequestHandler):
    store: ConsulDouble
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms ACK stalls

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        token = self.headers.get("X-Consul-Token") or query.get("token")
        try:
            status, result, index = self.store.handle(self.command, parts.path, query, body,
                                                      token)
            if isinstance(result, Encoded):
                payload = bytes(result)
            else:
                payload = b"" if status == 404 and result is None else json.dumps(result).encode()
            content_type = "application/json"
        except HTTPError as exc:
            status, index = exc.code, None
            payload, content_type = exc.message.encode(), "text/plain; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if index is not None:
            self.send_header("X-Consul-Index", str(index))
            self.send_header("X-Consul-KnownLeader", "true")
            self.send_header("X-Consul-LastContact", "0")
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_DELETE = _dispatch
