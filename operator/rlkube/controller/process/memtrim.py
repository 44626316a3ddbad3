"""Gives the C heap's free pages back to the kernel every few seconds (glibc's malloc_trim).

Python allocates every object over 512 bytes (the dicts of decoded watch events, JSON bodies, status documents)
from the C library's heap. After a burst (1000 TrainingJobs created at once) that heap is full of free holes, and
glibc returns memory to the kernel only from the top of the heap: the operator's RSS kept climbing while nothing
new was held (263 MB 20 s into `rlkube bench operator -n 1000`, 296 MB at 90 s with the same 1000 jobs).
malloc_trim(0) releases the free pages anywhere in the heap (madvise), which kept it at 258-270 MB. Where the C
library has no malloc_trim (musl), nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

EVERY = 2.0
"""Seconds between trims. One trim of a 250 MB heap full of holes took ~20 ms here: 1% of a core."""


def malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


async def trim_forever(every: float = EVERY) -> None:
    trim = malloc_trim()
    if trim is None:
        log.info("no malloc_trim in this C library: freed heap memory stays with the process")
        return
    while True:
        await asyncio.sleep(every)
        trim(0)


def start() -> asyncio.Task:
    return asyncio.get_running_loop().create_task(trim_forever(), name="malloc_trim")
