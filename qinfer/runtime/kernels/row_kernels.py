"""Native decode kernels over weight rows (row_kernels.c): the sparse FFN of a few tokens over F16, Q4_0 or Q8_0
rows picked by id, the weighted row sum (the FFN's down product), and matrix-vector products over F16 and
quantized matrices, all without a float copy of the rows; quantized rows multiply the input quantized to Q8_0
blocks, as ggml does. The whole-layer decode step (decode_layer.c, driven by decode_layer.py) is built into the
same library.

The C source is compiled on first use with the machine's C compiler (`$CC`, else `cc`) and OpenMP into the user
cache (`$XDG_CACHE_HOME/qinfer/kernels`) and loaded with ctypes. A library is named by the instruction set it was
built for, as the compiler resolves it, and by a hash of the source and the compiler: a home directory shared by
an AVX-512 machine and an AVX2 one holds a library for each, and neither loads the other's. The build targets the
CPU it runs on; `QINFER_KERNEL_TARGET=no-amx`, `avx2` or `scalar` builds it without AMX's tile unit, or the AVX2 or
the plain C path instead (the tests run each). Where it cannot be built the runtime keeps its torch path (gather,
or expand then matmul), so the kernels are an accelerator, never a requirement; QINFER_NATIVE=0 turns them off
(for side-by-side benchmarks and debugging).

Loading a library runs its code, and its name can be computed by anyone, so only a file this user made is loaded:
the cache's directories are made 0700, and a directory or library that is a link, belongs to another user or may
be written by others is never used; the kernels are then built in a private temporary directory for this process.
Stale builds are removed only where this user made them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from qinfer.core.architectures import FfnForm
from qinfer.core.errors import UserError
from qinfer.core.user_cache import user_cache
from qinfer.runtime.kernels.abi import F16_CODE, TOKEN_BLOCK, TYPE_CODES, disagreement, form_code
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix, Weight

# decode_layer.c includes row_kernels.c: one translation unit, so the layer step inlines the row products.
SOURCE = Path(__file__).with_name("decode_layer.c")
SOURCES = (SOURCE, Path(__file__).with_name("row_kernels.c"))
# The instruction sets a build may target. The native build falls back to portable flags for compilers that do not
# know -march=native; the others exist to run (and test) the paths a wider CPU would not take: its own without the
# tile unit (AMX), AVX2, and plain C.
TARGETS: dict[str, tuple[list[str], ...]] = {
    "native": (["-O3", "-march=native"], ["-O3"]),
    # A compiler that does not know -mno-amx-tile (GCC and clang before 11) knows no AMX to leave out.
    "no-amx": (["-O3", "-march=native", "-mno-amx-tile"], ["-O3", "-march=native"], ["-O3"]),
    "avx2": (["-O3", "-march=haswell"],),
    "scalar": (["-O3", "-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else ["-O3"],),
}


def cache_dir() -> Path:
    return user_cache("kernels")


def target() -> str:
    name = os.environ.get("QINFER_KERNEL_TARGET", "native")
    if name not in TARGETS:
        raise UserError(f"QINFER_KERNEL_TARGET={name!r} is not a kernel target; use one of {', '.join(TARGETS)}")
    return name


def instruction_set(compiler: str, flags: list[str]) -> str:
    """The machine options `flags` resolve to (-march=native becomes the CPU's model and every feature it has or
    lacks), as the compiler driver passes them on; empty where the compiler cannot say."""
    try:
        done = subprocess.run(
            [compiler, *flags, "-###", "-x", "c", "-c", "-o", os.devnull, os.devnull],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if done.returncode != 0:
        return ""
    found = []
    for line in done.stderr.splitlines():
        words = [w.strip('"') for w in line.split()]
        # gcc passes -m options to cc1; clang passes -target-cpu and -target-feature pairs to cc1.
        found += [w for w in words if w.startswith("-m")]
        found += [b for a, b in zip(words, words[1:], strict=False) if a in ("-target-cpu", "-target-feature")]
    return " ".join(sorted(set(found)))


def library_name(compiler: str, flags: list[str]) -> str:
    """row_kernels_<instruction set>_<source and compiler>.so: one library per CPU feature set and source."""
    isa = hashlib.sha256(f"{platform.machine()}|{instruction_set(compiler, flags)}".encode()).hexdigest()[:12]
    code = b"".join(path.read_bytes() for path in SOURCES)
    source = hashlib.sha256(code + f"{compiler}|{' '.join(flags)}".encode()).hexdigest()[:12]
    return f"row_kernels_{isa}_{source}.so"


def _private(path: Path, kind: int) -> bool:
    """Whether `path` is a `kind` (stat.S_IFDIR, stat.S_IFREG) of this user's, not a link, that no one else may
    write."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(found.st_mode) == kind and found.st_uid == os.geteuid() and not found.st_mode & 0o022


def _private_cache() -> Path | None:
    """The cache directory, made 0700 where missing and made private where this user owns it but others could
    write it (an older build's, under umask 002); None where it, or the qinfer directory above it, is a link or
    another user's, or cannot be made."""
    directory = cache_dir()
    try:
        directory.parent.parent.mkdir(parents=True, exist_ok=True)
        for private in (directory.parent, directory):
            private.mkdir(mode=0o700, exist_ok=True)
            found = os.lstat(private)
            if stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid() and found.st_mode & 0o022:
                os.chmod(private, 0o700)
    except OSError as exc:
        print(f"qinfer: cannot make the kernel cache {directory} ({exc.strerror or exc})", file=sys.stderr)
        return None
    if all(_private(d, stat.S_IFDIR) for d in (directory.parent, directory)):
        return directory
    print(
        f"qinfer: the kernel cache {directory} is not this user's alone (a link, or another user's directory); "
        "building the kernels in a private temporary directory",
        file=sys.stderr,
    )
    return None


def _build(compiler: str, flags: list[str], out: Path) -> str | None:
    """Compile SOURCE with `flags` into `out` (atomically, readable by this user alone); the compiler's last error
    line where it fails."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler, *flags, "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        Path(tmp).unlink(missing_ok=True)
        return str(exc)
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    # The compiler may write a new file with the umask's mode; the library is this user's alone either way.
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)
    # Builds of older sources for this instruction set are never loaded again, nor are those named before
    # libraries were keyed by instruction set (row_kernels_<16 hex>.so); other sets' builds stay, and so does any
    # file another user left.
    isa_prefix = out.name.rsplit("_", 1)[0] + "_"
    older = [*out.parent.glob(f"{isa_prefix}*.so"), *out.parent.glob("row_kernels_" + "[0-9a-f]" * 16 + ".so")]
    for stale in older:
        if stale != out and _private(stale, stat.S_IFREG):
            stale.unlink(missing_ok=True)
    return None


def _find_or_build(compiler: str, name: str, directory: Path) -> Path | str | None:
    """The library for target `name` in `directory`, built where missing: its path, the build error where no flag
    set works, or None where the file there is not this user's alone."""
    error = ""
    for flags in TARGETS[name]:
        path = directory / library_name(compiler, flags)
        if not os.path.lexists(path):
            failed = _build(compiler, flags, path)
            if failed is not None:
                error = failed
                continue
        return path if _private(path, stat.S_IFREG) else None
    return error


def kernel() -> ctypes.CDLL | None:
    """The loaded kernels for the target in force, or None where no compiler with OpenMP builds them (one line on
    stderr says so)."""
    return load(target())


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernels built for target `name` (a key of TARGETS), or None where they cannot be built or loaded."""
    compiler = os.environ.get("CC", "cc")
    try:
        directory = _private_cache()
        with tempfile.TemporaryDirectory(prefix="qinfer-kernels-") as spare:
            found = None if directory is None else _find_or_build(compiler, name, directory)
            if directory is not None and found is None:
                print(
                    f"qinfer: a kernel library in {directory} is not this user's alone (a link, another owner, or "
                    "writable by others); building the kernels in a private temporary directory",
                    file=sys.stderr,
                )
            if found is None:
                found = _find_or_build(compiler, name, Path(spare))
            if not isinstance(found, Path):
                print(
                    f"qinfer: native row kernels not built ({compiler}: {found}); using torch's slower path",
                    file=sys.stderr,
                )
                return None
            # Mapped once loaded: the temporary directory may go.
            lib = ctypes.CDLL(str(found))
    except OSError as exc:
        print(f"qinfer: native row kernels not loaded ({exc}); using torch's slower path", file=sys.stderr)
        return None
    try:
        _declare(lib)
    except AttributeError as exc:  # a library built from other sources (bench/decode.py --before-kernels)
        print(f"qinfer: native row kernels not loaded ({exc}); using torch's slower path", file=sys.stderr)
        return None
    if (problem := disagreement(lib)) is not None:
        print(f"qinfer: native row kernels not loaded (C and Python disagree on {problem}); using torch's slower path",
              file=sys.stderr)  # fmt: skip
        return None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The entry points' argument and result types."""
    p, i64, i32, s = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, Shape
    lib.qinfer_sparse_ffn.argtypes = [
        p, i64, i32, s, p, i64, i32, s, p, i64, i32, s, p, i64, i64, p, i64, p, i32, p, p, i32
    ]  # fmt: skip
    lib.qinfer_weighted_rows.argtypes = [p, i64, i32, s, p, i64, p, i64, i64, p, i32]
    lib.qinfer_moe_ffn.argtypes = [p, i32, p, i32, p, i32, p, p, p, i64, p, p, i64, p, p, i32]
    lib.qinfer_matvec.argtypes = [p, i64, i32, s, p, i64, i64, p, i32]
    lib.qinfer_decode_step.argtypes = [p, i64, p, p, p, p, i64, p, p, i64, i32]
    lib.qinfer_decode_step.restype = i64
    lib.qinfer_scratch_sizes.argtypes = [p, p]
    lib.qinfer_scratch_sizes.restype = None
    lib.qinfer_f16_blocked.argtypes = []
    lib.qinfer_f16_blocked.restype = ctypes.c_int32
    lib.qinfer_abi.argtypes = [p]
    lib.qinfer_abi.restype = i64
    if (tile_unit := getattr(lib, "qinfer_tile_unit", None)) is not None:
        tile_unit.argtypes = []
        tile_unit.restype = ctypes.c_int32
    if (release := getattr(lib, "qinfer_release_threads", None)) is not None:
        release.argtypes = []
        release.restype = None
    if (given := getattr(lib, "qinfer_sparse_ffn_given", None)) is not None:
        given.argtypes = [p, i64, i32, s, p, i64, i32, s, p, i64, i32, s, p, i64, i64, p, i64, i32, p, p, i32]
        given.restype = i32
    if (selected := getattr(lib, "qinfer_selected_ffn", None)) is not None:
        selected.argtypes = [
            p, i64, i32, s, p, i64, i32, s, p, i64, i32, s, p, i64, i64, p, p, i64, i32, p, p, i32
        ]  # fmt: skip
        selected.restype = i32
    for entry in (lib.qinfer_sparse_ffn, lib.qinfer_weighted_rows, lib.qinfer_matvec, lib.qinfer_moe_ffn):
        entry.restype = i32


def enabled() -> bool:
    return os.environ.get("QINFER_NATIVE", "1") != "0" and kernel() is not None


def release_threads() -> None:
    """End the calling thread's idle OpenMP team, for a thread that hands the kernels to another for good (the
    server's, after loading the model): where two threads' teams together outnumber the cores, OpenMP's barriers
    sleep instead of spinning, a wake each (qinfer_release_threads says what it cost). Torch's parallel ops share the
    team where torch's OpenMP is the kernels' (libgomp under one name, as in PyPI's wheels); a torch with a runtime of
    its own keeps its team. A library built from other sources (bench/decode.py --before-kernels) may lack the
    entry point; its team then stays."""
    release = getattr(kernel(), "qinfer_release_threads", None) if enabled() else None
    if release is not None:
        release()


def _takes(x: torch.Tensor, max_tokens: int | None = None) -> bool:
    """Whether the kernels take these inputs at all: CPU tokens (few enough, where a limit is given), and the
    kernels on and built."""
    return (max_tokens is None or x.shape[0] <= max_tokens) and x.device.type == "cpu" and enabled()


Shape = ctypes.c_int64 * 2  # a weight's rows and columns, which bound what a kernel may read of it


def layout(t: object) -> tuple[int, int, int, ctypes.Array[ctypes.c_int64]] | None:
    """(address, row stride in bytes, type code, [rows, columns]) of CPU rows the kernels read, or None where they
    cannot."""
    if isinstance(t, QuantizedMatrix):
        b = t.blocks
        if b.device.type != "cpu" or b.stride(1) != 1 or t.qtype not in TYPE_CODES:
            return None
        return b.data_ptr(), b.stride(0), TYPE_CODES[t.qtype], Shape(*t.shape)
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.float16 or t.stride(1) != 1:
        return None
    return t.data_ptr(), t.stride(0) * 2, F16_CODE, Shape(*t.shape)


def check(status: int) -> None:
    """Raise what a kernel's non-zero status means: no memory (-2), or rows that do not fit their shapes."""
    if status == -2:
        raise MemoryError("the row kernels could not allocate their scratch (quantized inputs, lists of neurons)")
    if status != 0:
        raise UserError(
            "a weight tensor is smaller than the model's shape says (its file is corrupt); re-convert the model"
        )


def sparse_ffn(
    form: FfnForm,
    x: torch.Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """FFN output [T, E] float32 of neurons `ids` for the CPU tokens x [T, E], each using only the neurons its
    row of `mask` [T, len(ids)] keeps (None: all); None where the kernel does not apply (_ffn_rows, or `first` to a
    library without takes_first). `first` [T, len(ids)], instead of a mask: the first row's product (the gate's, or
    up's without a gate) for every token and neuron, which the kernel then does not compute."""
    rows = _ffn_rows(form, x, gate, up, down_t, TOKEN_BLOCK if first is None else GIVEN_TOKENS)
    if rows is None or (first is not None and not takes_first()):
        return None
    tokens = x.shape[0]
    xf = x.float().contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    if first is not None and (mask is not None or first.shape != (tokens, ids64.numel())):
        raise ValueError(f"first products {tuple(first.shape)} for {tokens} tokens and {ids64.numel()} neurons, mask "
                         f"{mask is not None}: they come as [tokens, neurons], without a mask")  # fmt: skip
    keep = None if mask is None else mask.to("cpu", torch.uint8).contiguous()
    # The kernel writes its activations over the products it is given.
    act = torch.empty(tokens, ids64.numel()) if first is None else first.to("cpu", torch.float32, copy=True)
    out = torch.empty(tokens, down_t.shape[1])
    if first is None:
        check(kernel().qinfer_sparse_ffn(  # type: ignore[union-attr]
            *rows, xf.data_ptr(), x.shape[1], tokens, ids64.data_ptr(), ids64.numel(),
            None if keep is None else keep.data_ptr(), form_code(form), act.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        ))  # fmt: skip
    else:
        check(kernel().qinfer_sparse_ffn_given(  # type: ignore[union-attr]
            *rows, xf.data_ptr(), x.shape[1], tokens, ids64.data_ptr(), ids64.numel(), form_code(form),
            act.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        ))  # fmt: skip
    return out


def takes_first() -> bool:
    """Whether sparse_ffn takes the first rows' products from its caller (a library built from older sources may
    lack the entry point)."""
    return enabled() and hasattr(kernel(), "qinfer_sparse_ffn_given")


def selected_ffn(
    form: FfnForm,
    x: torch.Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    selected: torch.Tensor,
    skip: torch.Tensor | None,
) -> tuple[torch.Tensor, int, int] | None:
    """sparse_ffn over the neurons some token selects (bool [T, F]) and `skip` (bool [F]; None: none) leaves out,
    each token using only its own, listed by the kernel; with how many neurons it computed and how many selected
    ones it skipped. None where the kernel does not apply (_ffn_rows, no tokens, or a library built from older
    sources: bench/decode.py --before-kernels)."""
    tokens, f = x.shape[0], selected.shape[-1]
    if selected.shape != (tokens, f) or (skip is not None and skip.shape != (f,)):
        raise ValueError(f"a selection {tuple(selected.shape)} and skip for {tokens} tokens of {f} neurons")
    rows = _ffn_rows(form, x, gate, up, down_t)
    entry = getattr(kernel(), "qinfer_selected_ffn", None)
    if rows is None or tokens == 0 or entry is None:
        return None
    xf = x.float().contiguous()
    picks = selected.to("cpu", torch.bool).contiguous()
    left = None if skip is None else skip.to("cpu", torch.bool).contiguous()
    out = torch.empty(tokens, down_t.shape[1])
    counts = (ctypes.c_int64 * 2)()
    check(entry(
        *rows, xf.data_ptr(), x.shape[1], tokens, picks.data_ptr(), None if left is None else left.data_ptr(), f,
        form_code(form), out.data_ptr(), counts, torch.get_num_threads(),
    ))  # fmt: skip
    return out, counts[0], counts[1]


# Tokens per sparse_ffn call where the caller gives the first products (a prompt's): a call reads its neurons' down
# rows once, and past 48 tokens a call is no faster (7B slice, f16 and Q4_0, two Zen 5 threads: 16 took 1.15x as
# long in f16).
GIVEN_TOKENS = 64


def takes_ffn(
    form: FfnForm, x: torch.Tensor, gate: Weight | None, up: Weight, down_t: Weight, given: bool = False
) -> bool:
    """Whether sparse_ffn takes these tokens and rows; `given`: with their first products."""
    return _ffn_rows(form, x, gate, up, down_t, GIVEN_TOKENS if given else TOKEN_BLOCK) is not None


def _ffn_rows(
    form: FfnForm, x: torch.Tensor, gate: Weight | None, up: Weight, down_t: Weight, max_tokens: int = TOKEN_BLOCK
) -> list[object] | None:
    """The first product's, up's and down's (address, stride, type, shape), in the FFN kernels' argument order, or
    None where those kernels do not take these inputs (off, more than `max_tokens` tokens, a device, float32 rows,
    a gated form without its gate, biases)."""
    if form.biased or (gate is None) == form.gated or not _takes(x, max_tokens):
        return None
    layouts = [layout(t) for t in (up if gate is None else gate, up, down_t)]
    if any(lay is None for lay in layouts):
        return None
    return [field for lay in layouts for field in lay]  # type: ignore[union-attr]


def stack_layout(t: Weight) -> tuple[int, int, int, int] | None:
    """(address, type code, expert stride and row stride in bytes) of a CPU stack of experts [N, rows, columns] the
    kernels read, or None where they cannot."""
    if isinstance(t, QuantizedMatrix):
        b = t.blocks
        if b.dim() != 3 or b.device.type != "cpu" or b.stride(2) != 1 or t.qtype not in TYPE_CODES:
            return None
        return b.data_ptr(), TYPE_CODES[t.qtype], b.stride(0), b.stride(1)
    if t.dim() != 3 or t.device.type != "cpu" or t.dtype != torch.float16 or t.stride(2) != 1:
        return None
    return t.data_ptr(), F16_CODE, 2 * t.stride(0), 2 * t.stride(1)


def moe_ffn(
    x: torch.Tensor, gate: Weight, up: Weight, down: Weight, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor | None:
    """sum_i weights[t, i] * SwiGLU of expert chosen[t, i] on x[t], as float32 [T, E], for CPU tokens over F16 or
    quantized stacks (gate and up [N, F, E], down [N, E, F]); None where the kernel does not apply (off, a device,
    float32 stacks)."""
    if not _takes(x, TOKEN_BLOCK):
        return None
    stacks = [stack_layout(t) for t in (gate, up, down)]
    if any(st is None for st in stacks):
        return None
    (g, gt, ge, gr), (u, ut, ue, ur), (d, dt, de, dr) = stacks  # type: ignore[misc]
    experts, f, n = gate.shape
    strides = (ctypes.c_int64 * 6)(ge, gr, ue, ur, de, dr)
    dims = (ctypes.c_int64 * 3)(experts, f, n)
    xf = x.float().contiguous()
    ids = chosen.to(torch.int64).contiguous()
    w = weights.float().contiguous()
    act = torch.empty(ids.numel(), f)
    out = torch.empty(x.shape[0], n)
    check(kernel().qinfer_moe_ffn(  # type: ignore[union-attr]
        g, gt, u, ut, d, dt, strides, dims, xf.data_ptr(), x.shape[0], ids.data_ptr(), w.data_ptr(), ids.shape[1],
        act.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    ))  # fmt: skip
    return out


def weighted_rows(act: torch.Tensor, weight: Weight, ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """sum_j act[t, j] * weight[ids[j]] (ids None: all rows) as float32 [T, E] for a few CPU tokens; rows whose act
    is 0 for every token are not read. None where the kernel does not apply."""
    if not _takes(act, TOKEN_BLOCK):
        return None
    tokens = act.shape[0]
    described = layout(weight)
    if described is None:
        return None
    address, stride, code, shape = described
    a = act.float().contiguous()
    picked = None if ids is None else ids.to(torch.int64).contiguous()
    out = torch.empty(tokens, weight.shape[1])
    check(kernel().qinfer_weighted_rows(  # type: ignore[union-attr]
        address, stride, code, shape, None if picked is None else picked.data_ptr(), a.shape[1], a.data_ptr(), tokens,
        weight.shape[1], out.data_ptr(), torch.get_num_threads(),
    ))  # fmt: skip
    return out


def matvec(x: torch.Tensor, weight: Weight) -> torch.Tensor | None:
    """x [T, E] @ weight.T as float32 [T, R] for CPU tokens over an F16 or quantized matrix, or None where the
    kernel does not apply (off, a device, or many tokens over F16 rows in a build without SIMD)."""
    if not _takes(x):
        return None
    if isinstance(weight, torch.Tensor) and x.shape[0] > TOKEN_BLOCK and not kernel().qinfer_f16_blocked():  # type: ignore[union-attr]
        return None
    described = layout(weight)
    if described is None:
        return None
    address, stride, code, shape = described
    xf = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    check(kernel().qinfer_matvec(  # type: ignore[union-attr]
        address, stride, code, shape, xf.data_ptr(), x.shape[1], x.shape[0], out.data_ptr(), torch.get_num_threads()
    ))  # fmt: skip
    return out
