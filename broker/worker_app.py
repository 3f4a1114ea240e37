"""The module `celery -A broker.worker_app worker` loads: the app on ROLLSERVE_REDIS_URL."""

from broker.celery_app import get_celery

app = get_celery()
