"""The ``semaphore_*`` Celery settings, read and validated once, at worker start.

Each setting is a lowercase Celery setting; an app configured with a namespace (Django's
``config_from_object(..., namespace="CELERY")``) reads it as ``CELERY_SEMAPHORE_*``. A task
may override any of them with a task option of the same name:
``@app.task(semaphore="x", semaphore_lease_ttl=600)``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote, urlencode, urlsplit

from .exceptions import ConfigurationError, InvalidLimit, InvalidName
from .names import validate_limit, validate_ttl

LOST_LEASE_POLICIES = ("log", "terminate")
#: ``semaphore_on_full``: what a request does when its semaphore has no free slot for it.
ON_FULL_POLICIES = ("wait", "skip", "fail")


def _seconds(key: str, value: Any, *, allow_none: bool = False,
             allow_zero: bool = False) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigurationError(f"{key} must be a number of seconds, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or math.isinf(value):
        raise ConfigurationError(f"{key} must be a positive, finite number of seconds, "
                                 f"not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """Validated semaphore settings. Field names are the setting names without ``semaphore_``."""

    backend: Optional[str] = None
    #: name or template -> its limit: an int, or an :class:`.Adaptive` (a learned limit).
    limits: Dict[str, Any] = field(default_factory=dict)
    default_limit: int = 1
    lease_ttl: float = 60.0
    poll_interval: float = 1.0
    retry_backoff: float = 1.0
    retry_backoff_max: float = 60.0
    retry_jitter: bool = True
    max_wait: Optional[float] = None
    key_prefix: str = "semaphore:"
    on_lost_lease: str = "log"
    worker_max_waiting: int = 100
    worker_max_hold: float = 300.0
    #: Granted requests one worker may hand its pool beyond its free processes (each waits in
    #: the pool's queue with its slot): tried only for semaphores nobody queues for.
    worker_lookahead: int = 1
    park_on_send: bool = True
    on_full: str = "wait"
    fair_by: Optional[str] = None
    metrics_top: int = 10
    #: Units of the limit a task holds: an int, or a template over its parameters.
    cost: Any = 1
    #: Starts per period (``"100/s"``, several: ``"10/s; 500/m"``) allowed cluster-wide, per
    #: semaphore; None: no rate.
    rate: Optional[str] = None
    #: Starts a rate allows at once (each rate, when several).
    burst: int = 1
    #: Units started per calendar window (``"1000/h; 20000/d"``), per semaphore; None: none.
    quota: Optional[str] = None
    #: Seconds the limit a function of the task's arguments gives a key is used before the
    #: function is called again for that key (``limit=plan_limit``).
    limit_ttl: float = 60.0
    #: The IANA time zone whose midnight starts a quota's days, weeks and months (its UTC
    #: offset when the call is made).
    quota_tz: str = "UTC"
    #: Units of the rates and quotas a start spends, as estimated at admission: an int, or a
    #: template over the task's parameters (``"{max_tokens}"``).
    units: Any = 1
    #: Admission priority within a semaphore (higher first).
    priority: int = 0
    #: Fair-share weights: a dict from fair keys (``"*"``: the others) or a template.
    fair_weights: Any = None

    @classmethod
    def from_app(cls, app: Any) -> "Settings":
        """Read and validate every ``semaphore_*`` setting of ``app``; raise naming the bad one,
        and refuse a setting of that prefix that does not exist (:func:`check_unknown`)."""
        check_unknown(app)
        values = {}
        for f in fields(cls):
            found, key, value = lookup(app, f"semaphore_{f.name}")
            if found:
                values[f.name] = validate(key, f.name, value)
        settings = cls(**values)
        settings.check_together("")
        if settings.retry_backoff_max < settings.retry_backoff:
            raise ConfigurationError(
                "semaphore_retry_backoff_max must not be below semaphore_retry_backoff "
                f"({settings.retry_backoff_max} < {settings.retry_backoff})"
            )
        return settings

    def for_task(self, task: Any) -> "Settings":
        """These settings with the task's own ``semaphore_*`` options applied."""
        overrides = {}
        for f in fields(self):
            key = f"semaphore_{f.name}"
            value = getattr(task, key, None)
            if value is not None:
                overrides[f.name] = validate(f"{task.name}: task option {key}", f.name, value)
        if not overrides:
            return self
        own = replace(self, **overrides)
        own.check_together(f"{task.name}: ")
        return own

    def check_together(self, where: str = "") -> None:
        """Refuse values that are fine alone but not together: units (an int) above the
        count of a quota (no start could ever be admitted). ``where`` prefixes the message."""
        from . import traffic

        if isinstance(self.units, int) and self.quota is not None:
            try:
                traffic.check_units_fit(self.units, traffic.parse_quota(self.quota))
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}{exc}") from None

    def options_used(self, limit: Any = None) -> List[str]:
        """The traffic options (:func:`.traffic.options_used`) these settings use, with a
        task's ``limit`` option (an :class:`.Adaptive` limit, there or in
        ``semaphore_limits``, uses ``"adaptive"``), for :meth:`.Backend.check_traffic`."""
        from . import traffic

        limits = list(limit.values()) if isinstance(limit, dict) else [limit]
        return traffic.options_used(self.cost, self.rate, self.priority, self.fair_weights,
                                    quota=self.quota, units=self.units,
                                    limit=limits + list(self.limits.values()))

    def backend_url(self, app: Any) -> str:
        """``semaphore_backend``; else the broker itself when it is Redis (the Redis backend)
        or RabbitMQ (the token backend, on the first URL of a failover list); else, for a
        Redis Sentinel broker (``sentinel://``) with ``broker_transport_options["master_name"]``,
        the Redis backend on the master its sentinels name (:func:`sentinel_backend_url`);
        else the result backend when it is a Redis URL (or a ``sentinel://`` one with
        ``result_backend_transport_options["master_name"]``); else, for a broker that lives on one
        host (kombu's filesystem or memory transport, SQLAlchemy on SQLite), an SQLite file in
        the working directory. Any other broker is shared between hosts, where a file would
        give each host its own limit: ConfigurationError naming ``semaphore_backend``."""
        if self.backend:
            return self.backend
        from .backends import SCHEMES

        broker = _first_url(app.conf.broker_url)
        scheme = _scheme(broker)
        if scheme in SCHEMES and SCHEMES[scheme].broker:
            return broker
        transport_options = app.conf.broker_transport_options or {}
        if scheme == "sentinel" and transport_options.get("master_name"):
            return sentinel_backend_url(app.conf.broker_url, transport_options,
                                        app.conf.broker_use_ssl)
        result = _first_url(app.conf.result_backend)
        if _scheme(result) in SCHEMES and SCHEMES[_scheme(result)].result:
            return result
        result_options = app.conf.result_backend_transport_options or {}
        if _scheme(result) == "sentinel" and result_options.get("master_name"):
            return sentinel_backend_url(app.conf.result_backend, result_options,
                                        app.conf.redis_backend_use_ssl)
        if scheme in ONE_HOST_BROKERS or broker.startswith(("sqla+sqlite:", "sqlalchemy+sqlite:")):
            return "sqlite:///celery-semaphore.db"
        if scheme == "sentinel":
            raise ConfigurationError(
                "semaphore_backend is not set and the sentinel:// broker has no "
                'broker_transport_options["master_name"]: set it (kombu needs it too), or set '
                "semaphore_backend to redis+sentinel://host:26379/<master name>/<db>")
        raise ConfigurationError(
            f"semaphore_backend is not set and the broker ({scheme or broker!r}://) is neither "
            "Redis nor RabbitMQ: an SQLite file would give each host its own limit. Set "
            "semaphore_backend to a shared server (redis://, redis+sentinel://, "
            "redis+cluster://, amqp://, postgresql://, consul://)"
        )


#: Brokers that live on one host, where an SQLite file is the natural backend.
ONE_HOST_BROKERS = ("filesystem", "memory", "")
#: kombu's TLS options (``broker_use_ssl``) that a ``rediss+sentinel://`` URL carries.
_SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def sentinel_backend_url(broker_url: Any, transport_options: Dict[str, Any],
                         use_ssl: Any = None) -> str:
    """The ``redis+sentinel://`` URL of the master a Celery ``sentinel://`` broker uses, as
    kombu finds it: every sentinel of the ``;``-separated list (or list of URLs), the user and
    password of the first URL (the data servers'), its virtual host as the database, and
    ``master_name``, ``sentinel_kwargs`` (user and password) and ``min_other_sentinels`` from
    the transport options. ``broker_use_ssl`` makes it ``rediss+sentinel://`` with its
    certificate options. (Celery's ``sentinel://`` result backend has the same form.)"""
    urls = broker_url if isinstance(broker_url, (list, tuple)) else str(broker_url).split(";")
    parts = [urlsplit(url.strip()) for url in urls if url.strip()]
    master = transport_options["master_name"]
    hosts = ",".join(p.netloc.rpartition("@")[2] for p in parts)
    userinfo = parts[0].netloc.rpartition("@")[0]
    database = parts[0].path.strip("/") or "0"
    query: Dict[str, Any] = {}
    sentinel_kwargs = transport_options.get("sentinel_kwargs") or {}
    for key in ("password", "username"):
        if sentinel_kwargs.get(key):
            query[f"sentinel_{key}"] = sentinel_kwargs[key]
    if transport_options.get("min_other_sentinels"):
        query["min_other_sentinels"] = transport_options["min_other_sentinels"]
    if use_ssl:
        options = use_ssl if isinstance(use_ssl, dict) else {}
        for key in _SSL_OPTIONS:
            value = options.get(key)
            if value is not None:  # kombu takes ssl.CERT_* constants too
                query[key] = {0: "none", 1: "optional", 2: "required"}.get(value, value)
    return (f"{'rediss' if use_ssl else 'redis'}+sentinel://"
            f"{userinfo + '@' if userinfo else ''}{hosts}/{quote(str(master), safe='')}/"
            f"{database}" + (f"?{urlencode(query)}" if query else ""))


def _first_url(url: Any) -> str:
    """The first URL of a setting that may be a list or a ``;``-separated failover list."""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    return str(url or "").split(";")[0].strip()


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


#: ``semaphore_*`` settings that are not fields of :class:`Settings` but are read elsewhere:
#: ``CELERY_SEMAPHORE_APP``, the Django management command's app.
EXTRA_SETTINGS = ("app",)


def known_settings() -> Tuple[str, ...]:
    """Every setting name this package reads, lowercase (``semaphore_backend``, ...)."""
    return tuple(f"semaphore_{name}" for name in
                 [f.name for f in fields(Settings)] + list(EXTRA_SETTINGS))


def unknown_settings(app: Any) -> List[Tuple[str, Optional[str]]]:
    """``(key as written, the known key it is closest to or None)`` for every setting of
    ``app`` that starts with ``semaphore_`` (or ``CELERY_SEMAPHORE_``, ``CELERY`` being the
    app's namespace) but names no setting of this package: a misspelling Celery ignores."""
    upper = f"{getattr(app, 'namespace', None) or 'CELERY'}_SEMAPHORE_"
    known = [name[len("semaphore_"):] for name in known_settings()]
    out = []
    for key in list(app.conf.keys()):
        if not isinstance(key, str):
            continue
        if key.startswith("semaphore_"):
            prefix, rest, spell = "semaphore_", key[len("semaphore_"):], str.lower
        elif key.startswith(upper):
            prefix, rest, spell = upper, key[len(upper):].lower(), str.upper
        else:
            continue
        if rest not in known:
            close = difflib.get_close_matches(rest, known, n=1)
            out.append((key, prefix + spell(close[0]) if close else None))
    return sorted(out)


def check_unknown(app: Any) -> None:
    """Refuse a ``semaphore_*`` setting this package does not know (``semaphore_backends``,
    Django's ``CELERY_SEMAPHORE_BACKENDS``): ConfigurationError naming each, with the closest
    known setting ("did you mean ..."). Celery ignores unknown settings, so a misspelt one
    would otherwise leave its default in force in silence."""
    unknown = unknown_settings(app)
    if unknown:
        problems = [f"{key} (did you mean {hint}?)" if hint else
                    f"{key} (the known ones: {', '.join(known_settings())})"
                    for key, hint in unknown]
        raise ConfigurationError(
            f"unknown setting{'s' if len(problems) > 1 else ''}: {'; '.join(problems)}")


def lookup(app: Any, name: str) -> Tuple[bool, str, Any]:
    """(found, key as the user wrote it, value) for a setting, honouring a namespace."""
    namespace = getattr(app, "namespace", None)
    written = f"{namespace}_{name.upper()}" if namespace else name
    missing = object()
    for key in (name, f"{namespace or 'CELERY'}_{name.upper()}"):
        value = app.conf.get(key, missing)
        if value is not missing:
            return True, written, value
    return False, written, None


def validate(key: str, field_name: str, value: Any) -> Any:
    """Check one setting's value; ``key`` is how the error names it."""
    if field_name in ("backend", "key_prefix"):
        if value is None and field_name == "backend":
            return None
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"{key} must be a non-empty string, not {value!r}")
        if field_name == "backend":
            from .backends import backend_class

            try:
                backend_class(value)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{key}: {exc}") from None
        return value
    if field_name == "limits":
        if not isinstance(value, dict):
            raise ConfigurationError(f"{key} must be a dict of name -> limit, not {value!r}")
        from .limit_sources import validate_limits_key
        from .traffic import validate_limit_value

        try:
            return {validate_limits_key(k): validate_limit_value(v, f"limit of {k!r}")
                    for k, v in value.items()}
        except (InvalidName, InvalidLimit) as exc:
            raise ConfigurationError(f"{key}: {exc}") from None
    if field_name in ("default_limit", "worker_max_waiting"):
        try:
            return validate_limit(value, key)
        except InvalidLimit as exc:
            raise ConfigurationError(str(exc)) from None
    if field_name == "worker_lookahead":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
            raise ConfigurationError(f"{key} must be an integer from 0 to 1000, not {value!r}")
        return value
    if field_name == "metrics_top":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100_000:
            raise ConfigurationError(f"{key} must be an integer from 0 to 100000, not {value!r}")
        return value
    if field_name in ("retry_jitter", "park_on_send"):
        if not isinstance(value, bool):
            raise ConfigurationError(f"{key} must be True or False, not {value!r}")
        return value
    if field_name == "on_lost_lease":
        if value not in LOST_LEASE_POLICIES:
            raise ConfigurationError(
                f"{key} must be one of {', '.join(LOST_LEASE_POLICIES)}, not {value!r}"
            )
        return value
    if field_name == "fair_by":
        return validate_fair_by(key, value)
    if field_name in ("cost", "rate", "burst", "priority", "fair_weights", "quota",
                      "quota_tz", "units"):
        from . import traffic

        if field_name == "cost":
            return traffic.validate_cost(value, key)
        if field_name == "rate":
            traffic.parse_rates(value, key)
            return value
        if field_name == "quota":
            traffic.parse_quota(value, key)
            return value
        if field_name == "quota_tz":
            return traffic.validate_quota_tz(value, key)
        if field_name == "units":
            return traffic.validate_units(value, key)
        if field_name == "burst":
            return traffic.validate_burst(value, key)
        if field_name == "priority":
            return traffic.validate_priority(value, key)
        return traffic.validate_fair_weights(value, key)
    if field_name == "on_full":
        if value not in ON_FULL_POLICIES:
            raise ConfigurationError(
                f"{key} must be one of {', '.join(map(repr, ON_FULL_POLICIES))}, not {value!r}"
            )
        return value
    if field_name == "max_wait":
        return _seconds(key, value, allow_none=True)
    if field_name == "lease_ttl":
        return validate_ttl(value, key)
    return _seconds(key, value)


def validate_fair_by(key: str, value: Any) -> Optional[str]:
    """``semaphore_fair_by``: None, or a template over the task's parameters with at least one
    field (``"{customer_id}"``): a constant would put every call under one key."""
    from .traffic import check_template

    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"{key} must be a template string such as "
                                 f"'{{customer_id}}', not {value!r}")
    return check_template(value, key, "{customer_id}")
