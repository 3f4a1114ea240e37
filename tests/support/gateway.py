"""Serving an app over real HTTP (uvicorn in a thread), and what the gateway tests check."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import redis
import uvicorn
from fastapi import FastAPI

from tests.support.wait import wait_until

GOOD_TASK = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve `app` on a free loopback port; yields its base URL. The server and its thread are
    stopped before this returns."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:

        def started() -> bool:
            if not thread.is_alive():
                raise RuntimeError("test server did not start")
            return bool(server.started)

        wait_until(started, 15, "the test server to start", interval=0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        # Open requests get `timeout_graceful_shutdown`, then are cancelled (each logged): on
        # a loaded machine, a hundred of them take a while.
        thread.join(timeout=60)
        sock.close()
        assert not thread.is_alive(), "test server did not stop"


def snapshot(r: redis.Redis) -> dict[Any, Any]:
    """Every key with its value."""
    state: dict[Any, Any] = {}
    for key in sorted(r.keys("*")):
        kind = r.type(key)
        if kind == "hash":
            state[key] = r.hgetall(key)
        elif kind == "list":
            state[key] = r.lrange(key, 0, -1)
        elif kind == "zset":
            state[key] = r.zrange(key, 0, -1, withscores=True)
        elif kind == "string":
            state[key] = r.get(key)
        else:
            state[key] = kind
    return state


def field_locs(answer: httpx.Response) -> list[str]:
    return [".".join(str(p) for p in item["loc"]) for item in answer.json()["detail"]]
