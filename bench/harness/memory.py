"""A process's peak memory, for the benches that report it (``step_overhead``, ``cifar10``)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["peak_rss_gib"]


def peak_rss_gib() -> float:
    """This process's peak resident set (Linux's VmHWM), in GiB. Not ``ru_maxrss``: Linux carries that across
    exec, so a child started by a larger parent reports the parent's peak (the ResNet-9 row of
    ``step_overhead.py`` read 2.77 GiB for a 1.46 GiB step that way)."""
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    if found is None:
        raise RuntimeError("/proc/self/status has no VmHWM line: peak memory is measured on Linux only")
    return int(found.group(1)) / 2**20
