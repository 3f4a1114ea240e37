"""The one stub HTTP server: a thread serving answers a test chooses (a fake `/v1/models`, a
`/health` that can fail, a listener that counts what reaches it)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from contextlib import suppress

Answer = tuple[int, dict[str, str], bytes]
"""Status, headers and body of a reply."""

Responder = Callable[[str, str], Answer]
"""`responder(method, path)` → the reply."""


class StubServer:
    """Answers every GET and POST on 127.0.0.1 (`port` 0: a free one) with `responder`."""

    def __init__(self, responder: Responder, port: int = 0) -> None:
        self.responder = responder
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status, headers, body = owner.responder(self.command, self.path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # The client may stop reading early: what a bounded read does.
                with suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
