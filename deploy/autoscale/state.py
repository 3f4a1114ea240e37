"""What each queue holds, read from Redis: the messages waiting and the stages in flight.

Waiting messages are the lengths of the Redis lists kombu's transport keeps per queue: the
queue's own, its priority lists (`<queue>\\x06\\x16<priority>`), and for RUN and EVAL the
per-node queues (`run.<node>`) of every node that ever beat. In-flight stages are the
messages workers fetched and have not acknowledged (late acknowledgement holds each until
its stage ends), as `broker.celery_app.unacked_stages` reads them.
"""

from __future__ import annotations

import time

import redis

from broker.celery_app import PRIORITY_SEP, PRIORITY_STEPS, QUEUES, node_queue
from broker.jobstore import JobStore
from deploy.autoscale.policy import QueueLoad


def queue_lists(queue: str, nodes: list[str]) -> list[str]:
    """The Redis lists that hold `queue`'s waiting messages."""
    names = [queue] if queue == "init" else [queue, *(node_queue(queue, n) for n in nodes)]
    suffixes = ["", *(f"{PRIORITY_SEP}{p}" for p in PRIORITY_STEPS)]
    return [name + suffix for name in names for suffix in suffixes]


def read_loads(store: JobStore) -> dict[str, QueueLoad]:
    """Every queue's waiting messages and in-flight stages, in one pipeline plus one read of
    the unacknowledged messages."""
    from broker.celery_app import unacked_stages

    client: redis.Redis = store.r
    nodes = store.nodes()
    pipe = client.pipeline(transaction=False)
    lists = {queue: queue_lists(queue, nodes) for queue in QUEUES}
    for names in lists.values():
        for name in names:
            pipe.llen(name)
    lengths = iter(pipe.execute())
    waiting = {queue: sum(int(next(lengths)) for _ in names) for queue, names in lists.items()}
    in_flight = dict.fromkeys(QUEUES, 0)
    for _job, stage, _attempt in unacked_stages(client, time.time() + 60):
        if stage in in_flight:
            in_flight[stage] += 1
    return {queue: QueueLoad(waiting[queue], in_flight[queue]) for queue in QUEUES}
