"""How ``transport/ucx.py`` waits on the UCX operations it posted: every
wait bounded by a deadline, none of them cancelled by the wait (a receive
ends only through UCX: data, error, or the cancellation an endpoint's abort
gives it). Plain asyncio; nothing here touches UCX."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable

__all__ = ["bounded", "settle", "wait_all"]

log = logging.getLogger("kvstore.transport.ucx")


async def bounded(aw: Awaitable[Any], end: float) -> Any:
    """``aw`` awaited until the monotonic time ``end``."""
    return await asyncio.wait_for(aw, max(0.0, end - time.monotonic()))


async def wait_all(futs: list[asyncio.Future[Any]], end: float) -> None:
    """Wait for every future until ``end`` without cancelling them; raise the
    first failure, or TimeoutError."""
    pending = [f for f in futs if not f.done()]
    while pending:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        done, still = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        pending = list(still)
    for f in futs:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


async def settle(futs: list[asyncio.Future[Any]], grace: float) -> int:
    """After the endpoint was aborted: wait (at most ``grace`` seconds) until
    UCX has completed every posted receive; return how many are still outstanding."""
    pending = [f for f in futs if not f.done()]
    if pending:
        _done, still = await asyncio.wait(pending, timeout=grace)
        pending = list(still)
    for f in futs:
        if f.done() and not f.cancelled():
            f.exception()  # retrieved: no "never retrieved" warnings
    if pending:
        log.error("%d UCX receives still outstanding after abort", len(pending))
    return len(pending)
