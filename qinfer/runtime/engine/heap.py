"""The C heap of a process that runs models: freed blocks stay in it for the next step's tensors.

glibc's malloc maps a large block afresh for each allocation and unmaps it when freed (and returns a freed heap top
to the kernel), so a tensor of a few megabytes made at every step, such as a prompt's activations or a batch's
logits over a large vocabulary, is faulted in page by page each time. A prompt of 514 tokens on the 7B slice took
42,000 such faults (about 3% of its time, AVX2 build, AMD EPYC Zen 5), and a draw over 128,256 probabilities 0.65 ms
instead of 0.07. Blocks up to glibc's largest mapping threshold come from the heap instead, and the heap keeps what
is freed: the process holds on to its peak, as llama.cpp's buffers, sized once, do.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest threshold glibc accepts on 64-bit machines (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top that stays in the process.
TRIM_THRESHOLD = 1 << 30
# Set to 0, the process's malloc is left as it is.
VARIABLE = "QINFER_KEEP_FREED_MEMORY"
# glibc's own settings: where a user made them, they stand.
GLIBC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Set the process's malloc to keep freed blocks: glibc on Linux, unless VARIABLE is 0 or the user set glibc's
    malloc settings (GLIBC_SETTINGS, GLIBC_TUNABLES); elsewhere nothing changes. Whether both settings took."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    chosen = any(name in os.environ for name in GLIBC_SETTINGS) or "glibc.malloc" in tunables
    if not sys.platform.startswith("linux") or os.environ.get(VARIABLE, "1") == "0" or chosen:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    taken = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    return all(taken)
