"""Garbage-collector settings for the long-running asyncio processes (the operator, the benchmark's kubelet).

Profiled at 100 TrainingJobs, a fifth of the operator's CPU went to CPython's cyclic garbage collector: every
watch event decodes into a few hundred dicts and lists, so the default threshold (a young collection every 700
net allocations) ran a collection every few events, and each older collection walked every object the process
holds, including the hundreds of thousands that importing kopf, pydantic and kubernetes_asyncio creates and
that are never garbage. Almost everything the operator allocates is freed by reference counting; the collector
is only needed for the rare cycle. So: import-time objects are moved out of the collector's sight
(`gc.freeze()`), and young collections run every YOUNG allocations instead of 700 (the garbage a cycle can hold
meanwhile is bounded by that count: a few MB).
"""

from __future__ import annotations

import gc

YOUNG = 50_000
"""Net container allocations between young collections (CPython's default: 700)."""
OLDER = (20, 10)
"""Young collections per middle one, middle ones per full one (CPython's default: 10, 10)."""


def tune() -> None:
    """Call once, after the imports and before the work starts."""
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
    gc.set_threshold(YOUNG, *OLDER)
