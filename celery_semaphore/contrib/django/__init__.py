"""Django integration: add ``"celery_semaphore.contrib.django"`` to ``INSTALLED_APPS`` for
``python manage.py semaphore ...`` (the same subcommands as ``celery semaphore``)."""
