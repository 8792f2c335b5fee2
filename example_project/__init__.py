"""A small realistic app using celery-semaphore: thumbnails, a slow remote store, a rate-limited
per-customer API. ``make demo`` runs it with no server at all."""
