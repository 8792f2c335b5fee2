"""Which semaphore guards a task: the ``task`` decorator, option checks, guard resolution.

Task options (extra ``@app.task`` options become task class attributes):

* ``semaphore``: a name, or a template filled from the call's arguments by parameter name
  (``"api:{customer_id}"``); defaults of the task's signature count. Or a list of them
  (``["api", "api:{customer_id}"]``): the task runs holding a slot of every one, granted
  together (:meth:`.backends.base.Backend.acquire_all`). Templates that fill in to the same
  name count once.
* ``limit``: the limit the task declares (in force once the workers that declare it run,
  unless an operator pinned another: :mod:`.backends.base`, "Limits"); with several, an int
  for all of them or
  a dict from the listed names/templates to their limits (a listed one it leaves out gets the
  next of the sources below).
* any ``semaphore_*`` setting, to override it for this task.

Per call, ``apply_async(headers={"semaphore": "name", "semaphore_limit": 3})`` overrides both,
and the headers ``semaphore_cost`` (an int) and ``semaphore_priority`` override those options.

Traffic options (:mod:`.traffic`): ``semaphore_cost`` (units of the limit held, an int or a
template), ``semaphore_rate`` with ``semaphore_burst`` (starts per period, per semaphore),
``semaphore_priority``, ``semaphore_fair_weights``. A task with a rate and no limit from any
source but ``semaphore_default_limit`` is limited in starts only (its semaphore is created
with the largest limit).

The limit a name is *declared* with is the first of: the ``semaphore_limit`` header,
``semaphore_limits[name]``, ``semaphore_limits[template]``, the task's ``limit`` (its entry for
the template, when a dict), ``semaphore_default_limit``. The newest declaration (from the
most recently started process) is in force unless ``resize`` pinned the limit; a header's is
a declaration of the worker that runs the call.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

from celery import shared_task
from celery.local import Proxy

from . import traffic
from .backends.base import Meta
from .backoff import Adaptive
from .exceptions import ConfigurationError
from .limit_sources import LimitFunctions, limit_source, matching, patterns_of
from .names import MAX_LIMIT, validate_limit, validate_name, validate_template
from .settings import Settings
from .settings import validate as validate_setting


@dataclass(frozen=True)
class Guard:
    """The semaphores one request must hold: the first one's resolved name and declared limit
    (``name``, ``limit``: what a single-semaphore task has), the others' (``also``), the task's
    settings. Parking, the worker's line and the reports that name one semaphore use the
    first one."""

    name: str
    limit: int
    settings: Settings
    #: The fair-share key (``semaphore_fair_by`` filled from the call), or None.
    fair: Optional[str] = None
    #: ``(name, limit)`` of every further semaphore, in the order listed.
    also: Tuple[Tuple[str, int], ...] = ()
    #: Units of each semaphore's limit the request holds.
    cost: int = 1
    #: Its admission priority (higher first).
    priority: int = 0
    #: ``(interval seconds, burst)`` of the rate it declares, or None.
    rate: Optional[Tuple[float, int]] = None
    #: Its fair-share weight.
    weight: int = 1
    #: Further rates (``semaphore_rate="10/s; 500/m"``: each must allow the start).
    rates: Tuple[Tuple[float, int], ...] = ()
    #: Its quotas in calendar windows (``semaphore_quota``), and the time zone of their days.
    quota: Optional[Tuple[traffic.Quota, ...]] = None
    quota_tz: Optional[str] = None
    #: Units of the rates and quotas its start spends, as estimated at admission.
    units: int = 1
    #: Its (first) semaphore's limit is learned (``limit=Adaptive(...)``).
    adaptive: Optional[Adaptive] = None

    def traffic_meta(self, front: bool = False) -> Meta:
        """The acquire ``meta`` entries for these options (empty when it uses none);
        ``front``: it queues ahead of every waiter of its priority (a call a Backoff gave
        back)."""
        return traffic.traffic_meta(self.cost, self.priority, self.rate, self.weight,
                                    rates=self.rates, quota=self.quota,
                                    quota_tz=self.quota_tz, units=self.units,
                                    adaptive=self.adaptive, front=front)

    @property
    def multi(self) -> bool:
        """The request needs several semaphores (granted together)."""
        return bool(self.also)

    @property
    def pairs(self) -> Tuple[Tuple[str, int], ...]:
        """``(name, declared limit)`` of every semaphore, first one first."""
        return ((self.name, self.limit),) + self.also

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.name,) + tuple(name for name, _ in self.also)


def templates_of(option: Any) -> List[str]:
    """The templates of a ``semaphore`` option: one string, or a list or tuple of them."""
    if isinstance(option, (list, tuple)):
        return list(option)
    return [option]


def check_semaphore_option(option: Any, limit: Any = None, what: str = "semaphore") -> None:
    """Refuse a ``semaphore`` option that is not a template or a non-empty list of distinct
    templates, and a ``limit`` that is not an int from 1 to 100,000 or a dict from templates
    the option lists to such ints."""
    if isinstance(option, (list, tuple)):
        if not option:
            raise ConfigurationError(f"{what} must list at least one semaphore")
        if len(set(map(str, option))) != len(option):
            raise ConfigurationError(f"{what} lists a semaphore twice: {list(option)!r}")
    templates = [validate_template(t, what) for t in templates_of(option)]
    if isinstance(limit, dict):
        for key, value in limit.items():
            if key not in templates:
                raise ConfigurationError(
                    f"limit names {key!r}, which {what} does not list ({templates!r})")
            limit_source(value, f"limit of {key!r}")
    elif limit is not None:
        limit_source(limit)


def task(*args: Any, **options: Any) -> Any:
    """``shared_task`` that also accepts ``semaphore=``, ``limit=`` and ``semaphore_*`` options.

    ``@task(semaphore="images", limit=4)`` works in any app that called
    :func:`celery_semaphore.install`; the options are checked here, at decoration time.
    """
    check_options(options)

    def check(fun: Any) -> None:
        check_template_arguments(getattr(fun, "__name__", repr(fun)), options, fun,
                                 skip_first=bool(options.get("bind")))

    if len(args) == 1 and callable(args[0]):  # @task without parentheses, or task(fun, ...)
        check(args[0])
        return shared_task(*args, **options)
    decorate = shared_task(*args, **options)

    def checked(fun: Any) -> Any:
        check(fun)
        return decorate(fun)

    return checked


def check_options(options: Dict[str, Any], task_name: str = "") -> None:
    """Refuse wrong semaphore task options: a bad ``semaphore`` template, a ``limit`` that is
    not an int from 1 to 100,000, an unknown (misspelt) ``semaphore_*`` option or a bad value
    of a known one. Raises ConfigurationError naming the task and the option."""
    where = f"task {task_name}: " if task_name else ""
    try:
        if options.get("semaphore") is not None:
            check_semaphore_option(options["semaphore"], options.get("limit"))
        elif isinstance(options.get("limit"), dict):
            raise ConfigurationError("a dict limit needs the semaphore option that lists "
                                     "its semaphores")
        elif options.get("limit") is not None:
            limit_source(options["limit"])
        cost, limit = options.get("semaphore_cost"), options.get("limit")
        if isinstance(cost, int) and not isinstance(cost, bool):
            limits = list(limit.values()) if isinstance(limit, dict) else [limit]
            for one in limits:
                if isinstance(one, int):
                    traffic.validate_cost(cost, "semaphore_cost", one)
        known = {f"semaphore_{f.name}": f.name for f in fields(Settings)}
        for key, value in options.items():
            if not key.startswith("semaphore_") or value is None:
                continue
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigurationError(f"unknown task option {key}{hint}")
            validate_setting(f"task option {key}", known[key], value)
    except ConfigurationError as exc:
        raise type(exc)(f"{where}{exc}") from None


def check_call_headers(headers: Optional[Dict[str, Any]]) -> None:
    """Refuse a per-call ``semaphore`` or ``semaphore_limit`` header that could not work."""
    if not headers:
        return
    if headers.get("semaphore") is not None:
        validate_template(headers["semaphore"], "header 'semaphore'")
    if headers.get("semaphore_limit") is not None:
        validate_limit(headers["semaphore_limit"], "header 'semaphore_limit'")
    if headers.get("semaphore_cost") is not None:
        limit = headers.get("semaphore_limit")
        cost = traffic.validate_cost(headers["semaphore_cost"], "header 'semaphore_cost'",
                                     limit if isinstance(limit, int) else None)
        if not isinstance(cost, int):
            raise ConfigurationError(f"header 'semaphore_cost' must be an integer, not {cost!r}")
    if headers.get("semaphore_priority") is not None:
        traffic.validate_priority(headers["semaphore_priority"], "header 'semaphore_priority'")


_CHECKED = "_celery_semaphore_checks_options"


def check_definitions_and_sends(app: Any) -> None:
    """Check semaphore options where they are written (idempotent): each task class the
    app's ``Task`` base makes from now on, each task the app has already, and the headers
    of every ``apply_async`` (a bad one raises in the caller, before anything is sent)."""
    base = app.Task
    if base.__dict__.get(_CHECKED):
        return
    original_apply_async = base.apply_async

    def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        check_task_definition(cls)

    def apply_async(self: Any, *args: Any, **options: Any) -> Any:
        check_call_headers(options.get("headers"))
        return original_apply_async(self, *args, **options)

    base.__init_subclass__ = classmethod(__init_subclass__)
    base.apply_async = apply_async
    setattr(base, _CHECKED, True)
    for name, existing in list(app._tasks.items()):
        check_options({k: getattr(existing, k) for k in dir(type(existing))
                       if k in ("semaphore", "limit") or k.startswith("semaphore_")}, name)
        check_task_class(type(existing), name)


def template_parameters(template: str) -> List[str]:
    """The parameter each field of a template names: ``{customer_id}``, and the base of a
    subscript or attribute (``{p[c]}`` and ``{p.c}`` name ``p``)."""
    import re
    import string

    return [re.split(r"[.\[]", field, maxsplit=1)[0]
            for _, field, _, _ in string.Formatter().parse(template) if field]


def check_template_arguments(task_name: str, options: Dict[str, Any], run: Any,
                             skip_first: bool = False) -> None:
    """Refuse, where a task is defined, a ``semaphore`` template (or ``semaphore_fair_by``
    option) that names a parameter ``run`` cannot take: every call would fail at its first
    run. A ``**kwargs`` parameter can take any name, and ``*args`` is reachable by its own
    name (``{args[0]}``). ``skip_first``: ``run`` is the plain function of a bound task
    (``bind=True``, or a class's ``run``), whose first parameter is the task itself.
    ConfigurationError naming the task, the template and the parameters it has."""
    templates = [("semaphore template", t) for t in templates_of(options.get("semaphore"))
                 if isinstance(t, str) and "{" in t]
    if isinstance(options.get("semaphore_fair_by"), str):
        templates.append(("semaphore_fair_by", options["semaphore_fair_by"]))
    if not templates:
        return
    try:
        parameters = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):  # a callable whose signature Python cannot tell
        return
    if skip_first and parameters and parameters[0].kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = [p.name for p in parameters]
    shown = ", ".join(("*" if p.kind is inspect.Parameter.VAR_POSITIONAL else "") + p.name
                      for p in parameters) or "it takes none"
    for what, template in templates:
        for wanted in template_parameters(template):
            if wanted not in names:
                close = difflib.get_close_matches(wanted, names, n=1)
                hint = f"; did you mean {{{close[0]}}}?" if close else ""
                raise ConfigurationError(
                    f"task {task_name}: {what} {template!r} names {{{wanted}}}, which is "
                    f"not a parameter of the task ({shown}){hint}")


def check_task_definition(cls: Any, name: str = "") -> None:
    """:func:`check_options` on the options a task class being made declares, and
    :func:`check_task_class`."""
    name = name or getattr(cls, "name", None) or cls.__name__
    check_options({k: v for k, v in vars(cls).items()
                   if k in ("semaphore", "limit") or k.startswith("semaphore_")}, name)
    check_task_class(cls, name)


def check_task_class(cls: Any, name: str = "") -> None:
    """:func:`check_template_arguments` for a task class: Celery's ``app.task`` stores the
    function as a ``staticmethod`` ``run``, or as a plain function (taking the task first)
    for ``bind=True``, as a class-based task's ``run`` does."""
    if not getattr(cls, "semaphore", None) and not getattr(cls, "semaphore_fair_by", None):
        return
    raw = inspect.getattr_static(cls, "run", None)
    if raw is None:
        return
    if isinstance(raw, staticmethod):
        run, bound = raw.__func__, False
    elif inspect.isfunction(raw):
        run, bound = raw, True
    else:
        run, bound = cls.run, False
    options = {"semaphore": getattr(cls, "semaphore", None),
               "semaphore_fair_by": getattr(cls, "semaphore_fair_by", None)}
    check_template_arguments(name or getattr(cls, "name", None) or cls.__name__, options,
                             run, skip_first=bound)


#: The per-call headers that change a call's guard (:func:`check_call_headers`).
_CALL_HEADERS = frozenset({"semaphore", "semaphore_limit", "semaphore_cost",
                           "semaphore_priority"})


class _Binding:
    """How a task's signature binds a call, without :meth:`inspect.Signature.bind_partial`
    for the common shape: parameters that take a position or a keyword, then at most a
    ``**kwargs``. :meth:`arguments` gives what ``bind_partial`` and ``apply_defaults`` give
    (``**kwargs`` spread), or None for any call it does not bind cleanly (too many positions,
    an argument given twice, an unknown keyword): the caller binds those the slow way, which
    raises the error the user sees."""

    __slots__ = ("names", "defaults", "spread")

    def __init__(self, names: Tuple[str, ...], defaults: Dict[str, Any], spread: bool) -> None:
        self.names, self.defaults, self.spread = names, defaults, spread

    @classmethod
    def of(cls, signature: inspect.Signature) -> Optional["_Binding"]:
        """The fast binding of ``signature``, None when it has another kind of parameter."""
        names: List[str] = []
        defaults: Dict[str, Any] = {}
        spread = False
        for parameter in signature.parameters.values():
            if spread:  # (nothing can follow **kwargs)
                return None
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                spread = True
            elif parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                names.append(parameter.name)
                if parameter.default is not inspect.Parameter.empty:
                    defaults[parameter.name] = parameter.default
            else:
                return None
        return cls(tuple(names), defaults, spread)

    def arguments(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        names = self.names
        if len(args) > len(names):
            return None
        arguments = dict(zip(names, args))
        for key in kwargs:
            if key in arguments or (not self.spread and key not in self.defaults
                                    and key not in names):
                return None
        arguments.update(kwargs)
        for name, default in self.defaults.items():
            if name not in arguments:
                arguments[name] = default
        return arguments


#: Guards of templated calls a :class:`Guards` keeps (the newest keys; it starts again when
#: full), so that a key it met recently costs a dictionary look-up.
MAX_KEYED_GUARDS = 10_000


class Guards:
    """Resolves the guard of each request; caches per-task settings and signatures, the
    guard of a task that no call can change, and the guards of a templated task's recent
    keys when nothing but the names it fills depends on the call."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._settings: Dict[str, Settings] = {}
        self._signatures: Dict[str, inspect.Signature] = {}
        self._bindings: Dict[str, Optional[_Binding]] = {}
        #: task name -> (the task, its ``limit`` attribute as the class holds it)
        self._task_limits: Dict[str, Tuple[Any, Any]] = {}
        #: (task name, the names its templates filled in) -> the guard, for a task whose
        #: guard depends on nothing else of the call (:meth:`_keyed`)
        self._keyed: Dict[Tuple[str, Tuple[str, ...]], Guard] = {}
        #: task name -> its guard, for a task whose guard no call can change (one plain name,
        #: nothing filled from the arguments)
        self._fixed: Dict[str, Optional[Guard]] = {}
        self._functions = LimitFunctions()
        self._patterns: Dict[str, Any] = {}  # task name -> its settings' pattern entries

    def task_settings(self, task: Any) -> Settings:
        cached = self._settings.get(task.name)
        if cached is None:
            cached = self._settings[task.name] = self.settings.for_task(task)
        return cached

    def resolve(self, request: Any) -> Optional[Guard]:
        """The guard of a worker request, None when unguarded."""
        return self.resolve_call(request.task, request.args, request.kwargs, request.request_dict)

    def resolve_call(
        self, task: Any, args: Any, kwargs: Any, headers: Optional[Dict[str, Any]]
    ) -> Optional[Guard]:
        """The guard of one call, None when unguarded; ConfigurationError when it cannot be
        built (the template names an argument the call lacks, or fills in a bad name)."""
        headers = headers or {}
        if not _CALL_HEADERS.intersection(headers):
            fixed = self._fixed.get(task.name, self)
            if fixed is not self:
                return fixed  # type: ignore[return-value]
        else:
            check_call_headers(headers)
        option = headers.get("semaphore")
        if option is None:
            option = getattr(task, "semaphore", None)
        if not option:
            if not _CALL_HEADERS.intersection(headers):
                self._fixed[task.name] = None
            return None
        if isinstance(task, Proxy):  # a task of an app not finalized yet (``@app.task``)
            task = task._get_current_object()
        settings = self.task_settings(task)
        fair = None
        if settings.fair_by is not None:
            fair = self.fill(settings.fair_by, task, args, kwargs, "semaphore_fair_by")
        header_limit = headers.get("semaphore_limit")
        if header_limit is not None:
            header_limit = validate_limit(header_limit, "header 'semaphore_limit'")
        keyed = self._keyed_by_names(task, option, settings, headers)
        filled: Tuple[str, ...] = ()
        if keyed:
            filled = tuple(self.fill(template, task, args, kwargs)
                           for template in templates_of(option))
            known = self._keyed.get((task.name, filled))
            if known is not None:
                return known
        task_limit = self._task_limit(task)
        # a rate or a quota with no limit of its own limits starts only
        unlimited = (MAX_LIMIT if settings.rate is not None or settings.quota is not None
                     else settings.default_limit)
        pairs: Dict[str, int] = {}  # name -> limit, in the order listed
        adaptive: Optional[Adaptive] = None
        called = False  # a limit came from a function of the call's arguments
        for index, template in enumerate(templates_of(option)):
            name = validate_name(filled[index] if keyed
                                 else self.fill(template, task, args, kwargs))
            if name in pairs:  # two templates filled in to one name: one semaphore
                continue
            source = header_limit or self._limit_source(task, settings, name, template,
                                                        task_limit) or unlimited
            if callable(source) and not isinstance(source, Adaptive):
                called = True
                source = self._functions.value(
                    source, task.name, name,
                    self.arguments(task, args, kwargs, f"the limit of {name!r}"),
                    settings.limit_ttl)
            if isinstance(source, Adaptive):
                if pairs:
                    raise ConfigurationError(
                        f"task {task.name}: semaphore {name!r}: an Adaptive limit is for the "
                        "first semaphore a task lists only")
                adaptive = source
            pairs[name] = validate_limit(traffic.limit_number(source),
                                         f"limit of semaphore {name!r}")
        (name, limit), *also = pairs.items()
        guard = Guard(name, limit, settings, fair, tuple(also), adaptive=adaptive,
                      **self.traffic(task, args, kwargs, headers, settings, fair, pairs))
        if keyed and not called:  # the same for every call that fills in these names
            if len(self._keyed) >= MAX_KEYED_GUARDS:
                self._keyed.clear()
            self._keyed[(task.name, filled)] = guard
        elif (not _CALL_HEADERS.intersection(headers) and "{" not in str(option)
                and not called and settings.fair_by is None
                and not isinstance(settings.cost, str) and not isinstance(settings.units, str)
                and not isinstance(settings.fair_weights, str)):
            self._fixed[task.name] = guard  # the same for every call of this task
        return guard

    @staticmethod
    def _keyed_by_names(task: Any, option: Any, settings: Settings,
                        headers: Dict[str, Any]) -> bool:
        """A templated task's guard depends on nothing of a call but the names its templates
        fill in (a limit from a function of the arguments is found out when it is built)."""
        return (not _CALL_HEADERS.intersection(headers) and "{" in str(option)
                and settings.fair_by is None and not isinstance(settings.cost, str)
                and not isinstance(settings.units, str)
                and not isinstance(settings.fair_weights, str))

    def _task_limit(self, task: Any) -> Any:
        """The task's ``limit`` as its class holds it (a function given as ``limit=`` is a
        class attribute: not the bound method), looked up once per task."""
        known = self._task_limits.get(task.name)
        if known is None or known[0] is not task:
            known = self._task_limits[task.name] = (
                task, inspect.getattr_static(task, "limit", None))
        return known[1]

    def _limit_source(self, task: Any, settings: Settings, name: str, template: str,
                      task_limit: Any) -> Any:
        """The limit of semaphore ``name`` (filled from ``template``) as configured: in
        ``semaphore_limits`` the name, else the first pattern it matches, else the template;
        else the task's ``limit`` (its entry for the template, when a dict); None when
        nothing says (the default limit then)."""
        limits = settings.limits
        found = limits.get(name)
        if found is None and limits:
            patterns = self._patterns.get(task.name)
            if patterns is None:
                patterns = self._patterns[task.name] = patterns_of(limits)
            found = matching(patterns, name) if patterns else None
        if found is None:
            found = limits.get(template)
        if found is None:
            found = task_limit.get(template) if isinstance(task_limit, dict) else task_limit
        return found

    def arguments(self, task: Any, args: Any, kwargs: Any,
                  what: str = "its semaphore") -> Dict[str, Any]:
        """The call's arguments by parameter name, defaults applied (``**kwargs`` spread);
        ConfigurationError saying it cannot fill ``what`` when they do not bind."""
        signature = self._signatures.get(task.name)
        if signature is None:
            signature = self._signatures[task.name] = inspect.signature(task.run)
            self._bindings[task.name] = _Binding.of(signature)
        binding = self._bindings.get(task.name)
        if binding is not None:
            arguments = binding.arguments(args or (), kwargs or {})
            if arguments is not None:
                return arguments
        try:
            bound = signature.bind_partial(*(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise ConfigurationError(f"task {task.name}: cannot fill {what}: {exc}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:  # the names **kwargs took
                arguments.update(arguments.pop(parameter.name, {}))
        return arguments

    def traffic(self, task: Any, args: Any, kwargs: Any, headers: Dict[str, Any],
                settings: Settings, fair: Optional[str], pairs: Dict[str, int]
                ) -> Dict[str, Any]:
        """The traffic fields of a call's :class:`Guard` (only those that differ from the
        defaults); ConfigurationError when a template fills in to a bad value (a cost that
        is not an int from 1 to the limit of each semaphore, say)."""
        out: Dict[str, Any] = {}
        cost = headers.get("semaphore_cost")
        if cost is None:
            cost = settings.cost
        if isinstance(cost, str):
            text = self.fill(cost, task, args, kwargs, "semaphore_cost")
            cost = traffic.filled_cost(text, f"task {task.name}: semaphore_cost {settings.cost!r}",
                                       min(pairs.values()))
        elif cost != 1:
            cost = traffic.validate_cost(cost, f"task {task.name}: semaphore_cost",
                                         min(pairs.values()))
        if cost != 1:
            out["cost"] = cost
        priority = headers.get("semaphore_priority")
        priority = settings.priority if priority is None else priority
        if priority:
            out["priority"] = priority
        if settings.rate is not None:
            first, *more = traffic.parse_rates(settings.rate) or ()
            out["rate"] = (first, settings.burst)
            if more:
                out["rates"] = tuple((interval, settings.burst) for interval in more)
        if settings.quota is not None:
            out["quota"] = traffic.parse_quota(settings.quota)
            if settings.quota_tz != "UTC":
                out["quota_tz"] = settings.quota_tz
        units = settings.units
        if isinstance(units, str):
            units = traffic.filled_units(
                self.fill(units, task, args, kwargs, "semaphore_units"),
                f"task {task.name}: semaphore_units {settings.units!r}", out.get("quota"))
        if units != 1:
            out["units"] = units
        weights = settings.fair_weights
        if weights is not None and fair is not None:
            filled = (self.fill(weights, task, args, kwargs, "semaphore_fair_weights")
                      if isinstance(weights, str) else None)
            weight = traffic.weight_for(weights, fair, filled)
            if weight != 1:
                out["weight"] = weight
        return out

    @staticmethod
    def declared_limits(option: Any, task_limit: Any, settings: Settings
                        ) -> Sequence[Tuple[str, Any]]:
        """``(template, limit)`` of each template a task's ``semaphore`` option lists, the
        limit as far as the templates alone tell (for the worker's start-up line)."""
        unlimited = (MAX_LIMIT if settings.rate is not None or settings.quota is not None
                     else settings.default_limit)
        return [(template, settings.limits.get(template)
                 or (task_limit.get(template) if isinstance(task_limit, dict) else task_limit)
                 or unlimited) for template in templates_of(option)]

    def fill(self, template: str, task: Any, args: Any, kwargs: Any,
             what: str = "semaphore template") -> str:
        if "{" not in template:
            return template
        arguments = self.arguments(task, args, kwargs, f"{what} {template!r}")
        try:
            return template.format_map(arguments)
        except KeyError as exc:
            raise ConfigurationError(
                f"task {task.name}: {what} {template!r} needs argument {exc}, "
                "which the call does not provide"
            ) from None
        except Exception as exc:  # a field that indexes None, a format spec for another type...
            raise ConfigurationError(
                f"task {task.name}: cannot fill {what} {template!r} from the "
                f"call's arguments: {type(exc).__name__}: {exc}"
            ) from None


#: The app attribute that marks it installed.
INSTALLED = "_celery_semaphore_installed"


def guarded_tasks(app: Any) -> Dict[str, Any]:
    """Task name -> its task class, for every task that declares a semaphore."""
    return {name: task for name, task in sorted(app.tasks.items())
            if getattr(task, "semaphore", None) is not None}
