"""A real gateway over HTTP (uvicorn in a thread) on a real Redis, without workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from broker.processes import free_port, wait_for_port


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve `app` on a free loopback port; yields its base URL and stops it afterwards."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for_port("127.0.0.1", port, 15)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
