"""The process's malloc keeps freed blocks once the engine opens a model: tensors made at each step reuse them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qinfer.runtime.engine.heap import GLIBC_SETTINGS, VARIABLE, keep_freed_memory

# In a process of its own (a fresh heap): where glibc puts a tensor of 30 MiB, and what the heap keeps once it is freed,
# from glibc's own account (mallinfo2: hblkhd, bytes mapped apart from the heap; fordblks, bytes free in it).
PROBE = """
import ctypes, torch
from qinfer.runtime.engine.heap import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
if mallinfo2 is None:
    raise SystemExit(3)
mallinfo2.restype = Info
keep_freed_memory()
block = torch.empty(30 << 18)
block.fill_(1.0)
held = mallinfo2()
del block
print(held.hblkhd >> 20, mallinfo2().fordblks >> 20)
"""


def probe(**env: str) -> tuple[int, int]:
    """MiB mapped apart from the heap while the tensor is held, and MiB free in the heap after it is freed."""
    mine = {k: v for k, v in os.environ.items() if k not in (*GLIBC_SETTINGS, "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**mine, **env})
    if done.returncode == 3 or not sys.platform.startswith("linux"):
        pytest.skip("a malloc without glibc's mallinfo2")
    assert done.returncode == 0, done.stderr
    mapped, free = map(int, done.stdout.split())
    return mapped, free


def test_a_freed_block_stays_in_the_heap_for_the_next_step() -> None:
    mapped, free = probe(**{VARIABLE: "1"})
    assert mapped < 30 and free >= 30
    # glibc's own way, which the setting replaces: the block mapped apart, and handed back when freed.
    mapped, free = probe(**{VARIABLE: "0"})
    assert mapped >= 30 and free < 30


@pytest.mark.parametrize(
    "setting", [(VARIABLE, "0"), (GLIBC_SETTINGS[0], "1048576"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")]
)
def test_the_users_choice_stands(monkeypatch: pytest.MonkeyPatch, setting: tuple[str, str]) -> None:
    monkeypatch.setenv(*setting)
    assert not keep_freed_memory()
