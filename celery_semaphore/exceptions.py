"""Errors raised by celery-semaphore. Every one derives from :class:`SemaphoreError`."""


class SemaphoreError(Exception):
    """Base class of every error this library raises."""


class ConfigurationError(SemaphoreError, ValueError):
    """A setting, option or argument is invalid. Nothing was changed."""


class InvalidName(ConfigurationError):
    """A semaphore name is empty, too long, or contains characters no backend can hold."""


class InvalidLimit(ConfigurationError):
    """A limit is not a positive integer."""


class InvalidHeader(ConfigurationError):
    """A header celery-semaphore writes itself (``semaphore_requeues``,
    ``semaphore_first_wait``, ``semaphore_parked``, ``semaphore_route``) has a value it never
    writes: the message was made by another producer. The task fails; nothing else changes."""


class UnknownBackend(ConfigurationError):
    """No backend is registered for a URL scheme."""


class BackendUnavailable(SemaphoreError, ConnectionError):
    """The backend server could not be reached. The message names the URL, password masked."""


class LinkClosed(BackendUnavailable):
    """A call on a backend's event-loop link
    (:class:`~celery_semaphore.backends.base.EventLoopLink`) that the link's close, or the
    event loop's reset, failed, written or not: the backend did not fail, and the call may or
    may not have been made. The caller may make it again elsewhere at once."""


class SemaphoreTimeout(SemaphoreError, TimeoutError):
    """No slot became free before the timeout passed."""


class SemaphoreFull(SemaphoreError):
    """The semaphore had no free slot (or others waited for one) and the task's
    ``semaphore_on_full`` is ``"fail"``: the task did not run."""


class LeaseLost(SemaphoreError):
    """A lease is no longer held: it expired, was force-released, or its connection dropped."""


class UnknownSemaphore(SemaphoreError, LookupError):
    """An administrative operation named a semaphore the backend has never seen."""


class NotHeld(SemaphoreError, LookupError):
    """A force-release named a holder (or task id) that holds no slot of the semaphore."""


class BrokerUnavailable(SemaphoreError, ConnectionError):
    """The broker could not be reached to ask the workers. The message masks the password."""

