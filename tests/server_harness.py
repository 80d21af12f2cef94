"""A live ``resin serve`` for tests: uvicorn in a background thread on a free local port.

``LiveServer(ctx)`` builds the app from a :class:`resin.server.context.ServerContext`, starts
uvicorn, waits until ``/health`` answers and stops it on exit; ``base_url`` is
``http://127.0.0.1:<port>``. The official SDKs talk to it over real HTTP, exactly as users'
clients do.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from resin.server.app import build_app
from resin.server.context import ServerContext

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    def __init__(self, ctx: ServerContext, **uvicorn_options: Any) -> None:
        self.ctx = ctx
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(ctx), host="127.0.0.1", port=self.port, log_level="warning", **uvicorn_options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the test server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in /metrics (all label sets)."""
        text = httpx.get(f"{self.base_url}/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total
