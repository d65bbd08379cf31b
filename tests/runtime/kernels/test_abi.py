"""The facts C and Python share (kernels/abi.py against qinfer_abi in decode_layer.c): every build agrees, and a
change on either side alone stops the library from loading, naming the fact."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qinfer.runtime.kernels import abi, row_kernels

COMPILER = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None, reason="no C compiler to build the kernel")


def _lib() -> ctypes.CDLL:
    lib = row_kernels.kernel()
    assert lib is not None
    return lib


@pytest.mark.usefixtures("kernel_build")
def test_every_build_states_what_python_expects() -> None:
    assert abi.disagreement(_lib()) is None
    assert len(abi.stated(_lib())) > 60  # codes, layouts, and every field of six structures


def test_a_mirror_changed_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    swapped = [("threshold", ctypes.c_float) if name == "eps" else ("eps", ctypes.c_float) if name == "threshold"
               else (name, kind) for name, kind in abi.Dims._fields_]  # fmt: skip
    assert swapped != abi.Dims._fields_
    dims = type("Dims", (ctypes.Structure,), {"_fields_": swapped})
    monkeypatch.setattr(abi, "STRUCTS", tuple(dims if struct is abi.Dims else struct for struct in abi.STRUCTS))
    # Swapping two floats keeps the size and the other offsets; the offsets by name reveal it.
    assert abi.disagreement(_lib()) == "dims.eps: the library says 128, Python expects 132"
    monkeypatch.setattr(abi, "STRUCTS", tuple(struct for struct in abi.STRUCTS if struct.__name__ != "Dims"))
    assert abi.disagreement(_lib()) == "dims.ctx: the library says 40, Python does not mirror it"
    monkeypatch.undo()
    monkeypatch.setattr(abi, "TOKEN_BLOCK", 32)
    assert abi.disagreement(_lib()) == "TOKEN_BLOCK: the library says 16, Python expects 32"


def test_a_c_side_changed_alone_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of the sources with one field of `dims` moved: the loader refuses it with one line."""
    for source in row_kernels.SOURCES:
        shutil.copy(source, tmp_path / source.name)
    layer_c = tmp_path / "decode_layer.c"
    text = layer_c.read_text()
    moved = text.replace("    float eps, threshold;\n", "    float threshold, eps;\n")
    assert moved != text
    layer_c.write_text(moved)
    built = tmp_path / "moved.so"
    flags = ["-O1", "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([COMPILER, *flags, str(layer_c), "-o", str(built)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(built))
    lib.qinfer_abi.argtypes = [ctypes.c_void_p]
    lib.qinfer_abi.restype = ctypes.c_int64
    assert abi.disagreement(lib) == "dims.eps: the library says 132, Python expects 128"
