"""Keep freed host memory for the next step (glibc only): a DP step on CPU allocates and frees the same tens of MB
of temporaries every step (activations, their gradients, the per-example gradients and patches of book-keeping).

glibc serves each allocation above its mmap threshold (128 KiB, raised dynamically to at most 32 MiB as such
blocks are freed) with a fresh ``mmap`` and gives it back on free, and trims the heap's free top beyond twice that
threshold: the next step's allocation of the same size then takes a page fault per 4 KiB again. Measured on the
2-core CPU (torch 2.14.1, 1 thread, gn_cnn book-keeping step at B 256, a trial's process): about 5,000 minor faults
per step. A fixed mmap threshold of 32 MiB (the most glibc accepts) and a trim threshold of 1 GiB keep freed blocks
in the heap for reuse: 0-205 faults per step (``tests/test_dpsgd.py``), and a whole gn_cnn trial on digits 1.19x
faster, 555k page faults down to 25k (``bench/results/trial_walltime.md``).

Process-wide and idempotent; a trial's worker process is dptune's own. The cost is that the process keeps its
peak heap until it exits (at most what one step needed at once). Elsewhere (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed blocks (module docstring); True when every setting took effect."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc's own symbol: absent on musl and macOS
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(option, value) == 1 for option, value in _SETTINGS])
