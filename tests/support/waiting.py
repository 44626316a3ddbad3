"""Waiting on a condition instead of on the clock.

- `wait_for(condition, timeout, what)`: polls `condition()` until it returns something truthy and returns that
  value; TimeoutError naming `what` and the last value seen otherwise. `what` may be a function, called only on a
  timeout (for a message with a log tail as it is then).
- `wait_for_async(condition, timeout, what)`: the same in a coroutine; `condition` may be a plain function or an
  async one.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


What = str | Callable[[], str]


def _timed_out(what: What, timeout: float, last: Any) -> TimeoutError:
    text = what() if callable(what) else what
    return TimeoutError(f"timed out after {timeout:g}s waiting for {text} (last seen: {last!r})")


def wait_for(condition: Callable[[], Any], timeout: float, what: What, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)


async def wait_for_async(condition: Callable[[], Any], timeout: float, what: What, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(interval)
