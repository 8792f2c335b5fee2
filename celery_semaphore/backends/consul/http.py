"""Consul's HTTP API through py-consul, over a lean keep-alive transport, and the URL that
says where Consul is."""

from __future__ import annotations

import http.client
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union
from urllib.parse import parse_qsl, urlsplit

import consul
import consul.base
import requests
from consul.std import parse_duration

from ...exceptions import ConfigurationError
from ...urls import mask_url

#: Keep-alive connections to Consul kept open while unused, per backend instance and process.
MAX_IDLE_CONNECTIONS = 4
#: What a failed call to Consul raises.
UNAVAILABLE = (consul.ConsulException, requests.RequestException, OSError,
               http.client.HTTPException)


class _HTTPClient(consul.base.HTTPClient):
    """py-consul's transport over keep-alive ``http.client`` connections, shared by threads:
    each request takes an idle connection (or opens one) and puts it back, at most
    ``MAX_IDLE_CONNECTIONS`` stay open idle. A third of the CPU time of py-consul's
    ``requests`` transport per request, which matters because every operation is a few
    requests."""

    def __init__(self, host: str, port: int, scheme: str, verify: Union[bool, str],
                 timeout: float) -> None:
        super().__init__(host, port, scheme, verify)
        self.timeout = timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    def _connection(self) -> http.client.HTTPConnection:
        with self._idle_lock:
            if self._idle:
                return self._idle.pop()
        if self.scheme == "https":
            context = ssl.create_default_context(
                cafile=self.verify if isinstance(self.verify, str) else None)
            if self.verify is False:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            return http.client.HTTPSConnection(self.host, self.port, context=context)
        return http.client.HTTPConnection(self.host, self.port)

    def _put_back(self, conn: http.client.HTTPConnection) -> None:
        with self._idle_lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _request(self, method: str, callback: Any, path: str, params: Any = None,
                 data: Union[str, bytes] = "", headers: Optional[Dict[str, str]] = None) -> Any:
        query = dict(params or ())
        timeout = self.timeout
        if "index" in query:  # a blocking query answers after its wait, plus up to wait/16
            wait = parse_duration(query["wait"]) if "wait" in query else 300.0
            timeout += wait * 17 / 16
        body = data.encode() if isinstance(data, str) else data
        for attempt in (1, 2):  # a kept-alive connection the server closed: reconnect once
            conn = self._connection()
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, self.uri(path, params), body=body or None,
                             headers=headers or {})
                response = conn.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt == 2 or method != "GET":
                    raise
                continue
            self._put_back(conn)
            break
        return callback(consul.base.Response(response.status, response.headers,
                                             payload.decode("utf-8")))

    def get(self, callback: Any, path: str, params: Any = None,
            headers: Optional[Dict[str, str]] = None, raw: bool = False) -> Any:
        return self._request("GET", callback, path, params, headers=headers)

    def put(self, callback: Any, path: str, params: Any = None, data: Union[str, bytes] = "",
            headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("PUT", callback, path, params, data, headers)

    def delete(self, callback: Any, path: str, params: Any = None,
               data: Union[str, bytes] = "", headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("DELETE", callback, path, params, data, headers)

    def post(self, callback: Any, path: str, params: Any = None, data: str = "",
             headers: Optional[Dict[str, str]] = None) -> Any:
        return self._request("POST", callback, path, params, data, headers)

    def close(self) -> None:
        """Close the idle connections; those in use close as their requests end."""
        with self._idle_lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.close()


class _Consul(consul.Consul):
    """py-consul's client with the lean transport above."""

    def __init__(self, *args: Any, timeout: float, **kwargs: Any) -> None:
        self._timeout = timeout
        super().__init__(*args, **kwargs)

    def http_connect(self, host: str, port: int, scheme: str, verify: Union[bool, str] = True,
                     cert: Any = None) -> _HTTPClient:
        return _HTTPClient(host, port, scheme, verify, self._timeout)


@dataclass(frozen=True)
class ConsulConfig:
    """Where and how to reach Consul, parsed from the URL and keyword options."""

    host: str
    port: int
    scheme: str
    token: Optional[str]
    dc: Optional[str]
    verify: Union[bool, str]
    timeout: float

    @classmethod
    def parse(cls, url: str, *, token: Optional[str] = None, dc: Optional[str] = None,
              verify: Union[bool, str, None] = None, timeout: Optional[float] = None,
              ) -> "ConsulConfig":
        """``consul[s]://host[:port][?token=&dc=&verify=&timeout=]``; keywords win over the
        query. ``verify`` (TLS only): ``true`` (default), ``false`` or a CA bundle path."""
        parts = urlsplit(url)
        if parts.scheme not in ("consul", "consuls"):
            raise ConfigurationError(f"not a consul:// or consuls:// URL: {parts.scheme}://")
        query = dict(parse_qsl(parts.query))
        unknown = set(query) - {"token", "dc", "verify", "timeout"}
        if unknown:
            raise ConfigurationError(f"unknown consul URL parameters: {', '.join(sorted(unknown))}")
        tls = parts.scheme == "consuls"
        if verify is None:
            raw = query.get("verify", "true")
            verify = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower(), raw)
        try:
            port = parts.port or (8501 if tls else 8500)
            timeout = float(timeout if timeout is not None else query.get("timeout", 10.0))
        except ValueError as exc:
            raise ConfigurationError(f"bad consul URL {mask_url(url)!r}: {exc}") from exc
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=port,
            scheme="https" if tls else "http",
            token=token if token is not None else query.get("token") or None,
            dc=dc if dc is not None else query.get("dc") or None,
            verify=verify,
            timeout=timeout,
        )

    def client(self) -> consul.Consul:
        client = _Consul(host=self.host, port=self.port, scheme=self.scheme, token=self.token,
                         dc=self.dc, verify=self.verify, timeout=self.timeout)
        if self.token is not None:
            client.token = self.token  # py-consul lets CONSUL_HTTP_TOKEN override an explicit one
        return client
