"""memtrim: freed heap memory below a live allocation goes back to the kernel once the trimmer runs, and not
before (glibc returns memory only from the top of its heap by itself). In a fresh process, for a clean heap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkube.controller.process import memtrim

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import asyncio, gc
from rlkube.controller.process import memtrim

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

chunks = [bytes(1000) + bytes([i % 256]) for i in range(60_000)]  # ~60 MB from malloc's heap (over 512 B each)
pin = bytes(1000) + b"pin"  # allocated above them: the heap's top stays in use
held = rss_mb()
del chunks
gc.collect()
freed = rss_mb()

async def main():
    task = asyncio.get_running_loop().create_task(memtrim.trim_forever(every=0.05))
    for _ in range(200):  # until the trimmer has given the memory back, 10 s at the most
        await asyncio.sleep(0.05)
        if rss_mb() < freed - 40:
            break
    task.cancel()

asyncio.run(main())
print(held, freed, rss_mb())
"""


@pytest.mark.skipif(memtrim.malloc_trim() is None, reason="no malloc_trim in this C library")
def test_the_trimmer_returns_freed_heap_memory_that_glibc_keeps_by_itself():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    held, freed, trimmed = map(float, out.stdout.split())
    assert freed > held - 20, f"glibc gave the memory back without a trim ({held:.0f} -> {freed:.0f} MB)"
    assert trimmed < freed - 40, f"the trimmer returned too little: {held:.0f} -> {freed:.0f} -> {trimmed:.0f} MB"
