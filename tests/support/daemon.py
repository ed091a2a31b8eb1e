"""The real daemon in-process on port 0, on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from kvstore.config import load_config
from kvstore.daemon import server

__all__ = ["DaemonThread"]


class DaemonThread:
    """The real daemon on its own loop in a thread."""

    def __init__(self, overrides: dict[str, Any], env: dict[str, str] | None = None) -> None:
        base = {"server.port": 0, "metrics.port": 0, "dram.capacity": "16MiB"}
        base.update(overrides)
        self.config = load_config(None, env or {}, base)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(server.start(self.config), self.loop).result(30)
        self.target = f"127.0.0.1:{self.running.port}" if self.running.port else self.running.address
        self.daemon = self.running.daemon
        self.store = self.daemon.store

    def call(self, fn: Callable[..., Any], *a: Any) -> Any:
        """Run ``fn(*a)`` on the daemon's loop (the store is single-threaded)."""
        async def run() -> Any:
            return fn(*a)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.running.stop(1.0), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.store.close()
