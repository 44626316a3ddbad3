"""What one step of THIS process adds to its resident memory at the step's peak, for the memory benchmarks
(`rlkube bench loss-memory`, `rlkube bench weight-receive`).

The kernel's high-water mark (VmHWM) is reset to the current RSS just before the step (/proc/self/clear_refs: 5,
Linux 4.0+), then read after it. ru_maxrss cannot be reset: a process whose shared-library pages were loaded and
later reclaimed (a busy machine) reports a peak from import time, and the step's own peak hides under it.
"""

from __future__ import annotations

import gc


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, RssAnon...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Collect garbage, reset VmHWM to the current RSS and return that RSS (bytes): the step's baseline."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak() -> int:
    """VmHWM in bytes: the largest RSS since the last `reset_peak`."""
    return status_bytes("VmHWM")
