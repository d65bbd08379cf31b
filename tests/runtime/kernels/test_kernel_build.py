"""Building and loading the native kernels: a library per instruction set in the user cache, the targets the
suite runs, an unknown target refused, and the torch path where no compiler builds them."""

from __future__ import annotations

import os
import platform
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.errors import UserError
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.ffn.sparse import sparse_rows
from qinfer.runtime.kernels import row_kernels

COMPILER = os.environ.get("CC", "cc")
needs_compiler = pytest.mark.skipif(shutil.which(COMPILER) is None, reason="no C compiler to build the kernel")
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set variants")
UNOPTIMISED = "-O0"


@pytest.fixture
def fresh_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, so the kernel is built (or fails to build) inside the test, for the native target
    whatever the environment asks. Each target builds unoptimised: what is tested here is where a library goes and
    which one loads, and -O0 builds in a seventh of -O3's time (0.7 against 5.5 s), over a dozen builds. Every
    target must have had an -O3 to swap."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("QINFER_KERNEL_TARGET", raising=False)
    unoptimised = {
        target: tuple([UNOPTIMISED if flag == "-O3" else flag for flag in flags] for flags in choices)
        for target, choices in row_kernels.TARGETS.items()
    }
    assert all(UNOPTIMISED in flags for choices in unoptimised.values() for flags in choices)
    monkeypatch.setattr(row_kernels, "TARGETS", unoptimised)
    row_kernels.load.cache_clear()
    yield tmp_path / "qinfer" / "kernels"
    row_kernels.load.cache_clear()


@needs_compiler
def test_kernel_builds_into_an_empty_cache(fresh_kernel: Path) -> None:
    assert row_kernels.kernel() is not None
    built = sorted(p.name for p in fresh_kernel.iterdir())
    assert len(built) == 1 and built[0].startswith("row_kernels_") and built[0].endswith(".so")


@needs_compiler
@x86
def test_each_target_gets_its_own_library(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds for other instruction sets share the cache without replacing each other; a newer source replaces
    only the build of its own instruction set."""
    names = {}
    for target in ("avx2", "scalar"):
        monkeypatch.setenv("QINFER_KERNEL_TARGET", target)
        assert row_kernels.kernel() is not None
        names[target] = row_kernels.library_name(COMPILER, row_kernels.TARGETS[target][0])
    assert sorted(p.name for p in fresh_kernel.iterdir()) == sorted(names.values())
    stale = fresh_kernel / (names["avx2"].rsplit("_", 1)[0] + "_000000000000.so")
    stale.write_bytes(b"an older source's build")
    row_kernels.load.cache_clear()
    (fresh_kernel / names["avx2"]).unlink()
    monkeypatch.setenv("QINFER_KERNEL_TARGET", "avx2")
    assert row_kernels.kernel() is not None
    assert sorted(p.name for p in fresh_kernel.iterdir()) == sorted(names.values())


@needs_compiler
@x86
def test_two_cpu_feature_sets_get_two_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native is keyed by what the compiler resolves it to, so a cache shared by an AVX-512 machine and an
    AVX2 one never hands either the other's library."""
    native = row_kernels.TARGETS["native"][0]
    named = {cpu: row_kernels.instruction_set(COMPILER, [cpu]) for cpu in ("-march=haswell", "-march=x86-64")}
    assert all(named.values()) and len(set(named.values())) == 2
    # native resolves to the CPU's model and each of its features, not to the word "native".
    resolved = row_kernels.instruction_set(COMPILER, native)
    assert "native" not in resolved and len(resolved.split()) > 5
    real = row_kernels.library_name(COMPILER, native)
    machines = {}
    for cpu in ("-march=skylake-avx512", "-march=haswell"):
        monkeypatch.setattr(row_kernels, "instruction_set", lambda compiler, flags, cpu=cpu: cpu)
        machines[cpu] = row_kernels.library_name(COMPILER, native)
    assert len({real, *machines.values()}) == 3
    # The source part of the name is the same: only the instruction set tells the libraries apart.
    assert len({name.rsplit("_", 1)[1] for name in (real, *machines.values())}) == 1


def test_an_unknown_target_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QINFER_KERNEL_TARGET", "avx1024")
    with pytest.raises(UserError, match="QINFER_KERNEL_TARGET='avx1024'.*native, no-amx, avx2, scalar"):
        row_kernels.kernel()


def test_without_a_compiler_the_torch_path_runs(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    assert row_kernels.kernel() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "native row kernels not built" in err and "torch" in err
    g = torch.Generator().manual_seed(0)
    gate, up, down_t = (torch.randn(40, 64, generator=g).half() for _ in range(3))
    x, ids = torch.randn(1, 64, generator=g), torch.arange(0, 40, 2)
    llama = ARCHITECTURES["llama"].ffn
    assert row_kernels.sparse_ffn(llama, x, gate, up, down_t, ids) is None
    out = sparse_rows(llama, x, gate, up, down_t, ids, None)
    x64 = x.double()
    act = torch.relu(x64 @ gate[ids].double().T) * (x64 @ up[ids].double().T)
    ref = act @ down_t[ids].double()
    assert (out.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
    assert not list(fresh_kernel.glob("*.tmp"))


def test_a_failed_build_is_reported_when_the_model_opens(
    gguf_files: dict[str, Path],
    fresh_kernel: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not at the first decode step, where the line would land inside the generated text."""
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    Engine.open(gguf_files["pi-f16"], ctx_size=32)
    assert "native row kernels not built" in capsys.readouterr().err


def _planted(fresh_kernel: Path, uid: int, mode: int) -> Path:
    """A working library at the name the loader looks for, owned by `uid` with `mode`: what another local user who
    can write the cache could leave there."""
    flags = row_kernels.TARGETS["native"][0]
    fresh_kernel.mkdir(parents=True, mode=0o700)
    path = fresh_kernel / row_kernels.library_name(COMPILER, flags)
    source = row_kernels.SOURCES[0]
    subprocess.run([COMPILER, UNOPTIMISED, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def _loaded_from(lib: object) -> Path:
    return Path(lib._name)  # type: ignore[attr-defined]


@needs_compiler
@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another owner needs root")
@pytest.mark.parametrize(("uid", "mode"), [(4242, 0o755), (None, 0o666), (None, 0o775)])
def test_a_library_planted_in_the_cache_is_never_loaded(
    fresh_kernel: Path, capsys: pytest.CaptureFixture[str], uid: int | None, mode: int
) -> None:
    """Another user's file, or one that others may write, is not loaded: the kernels are built in a private
    directory instead, and the planted file is left as it was."""
    planted = _planted(fresh_kernel, os.getuid() if uid is None else uid, mode)
    before = planted.read_bytes()
    lib = row_kernels.kernel()
    assert lib is not None and _loaded_from(lib) != planted and not _loaded_from(lib).is_relative_to(fresh_kernel)
    assert "not this user's alone" in capsys.readouterr().err
    assert planted.read_bytes() == before


@needs_compiler
def test_an_own_cache_directory_others_may_write_is_made_private(fresh_kernel: Path) -> None:
    """What an older build made under umask 002: this user's, so it is made 0700 and used."""
    fresh_kernel.mkdir(parents=True)
    fresh_kernel.chmod(0o777)
    lib = row_kernels.kernel()
    assert lib is not None and _loaded_from(lib).parent == fresh_kernel
    assert stat.S_IMODE(fresh_kernel.stat().st_mode) == 0o700


@needs_compiler
@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another owner needs root")
def test_another_users_cache_directory_is_not_used(fresh_kernel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh_kernel.mkdir(parents=True)
    os.chown(fresh_kernel, 4242, 4242)
    lib = row_kernels.kernel()
    assert lib is not None and not _loaded_from(lib).is_relative_to(fresh_kernel)
    assert not list(fresh_kernel.iterdir()) and "not this user's alone" in capsys.readouterr().err


@needs_compiler
def test_under_umask_000_the_cache_stays_private(fresh_kernel: Path) -> None:
    old = os.umask(0)
    try:
        lib = row_kernels.kernel()
    finally:
        os.umask(old)
    assert lib is not None and _loaded_from(lib).parent == fresh_kernel
    for path in (fresh_kernel.parent, fresh_kernel):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert not stat.S_IMODE(_loaded_from(lib).stat().st_mode) & 0o022


@needs_compiler
@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner needs root")
def test_only_this_users_stale_builds_are_removed(fresh_kernel: Path) -> None:
    name = row_kernels.library_name(COMPILER, row_kernels.TARGETS["native"][0])
    fresh_kernel.mkdir(parents=True, mode=0o700)
    ours, theirs = (fresh_kernel / (name.rsplit("_", 1)[0] + f"_{tag}.so") for tag in ("0" * 12, "1" * 12))
    ours.write_bytes(b"older")
    theirs.write_bytes(b"older, another user's")
    os.chown(theirs, 4242, 4242)
    assert row_kernels.kernel() is not None
    assert not ours.exists() and theirs.exists()


@needs_compiler
@x86
def test_a_cpu_with_amx_gets_the_tile_unit_in_its_native_build_alone() -> None:
    """The blocked quantized product's tile form (AMX) is in the native build where the compiler targets AMX for
    this CPU, used where Linux grants the tile registers (a virtual machine may not), and in no other build: not in
    the no-amx build, and not in the native build of a CPU without AMX."""
    isa = row_kernels.instruction_set(COMPILER, row_kernels.TARGETS["native"][0]).split()
    targets_amx = "-mamx-int8" in isa or "+amx-int8" in isa
    for target, tile_unit in (("native", targets_amx), ("no-amx", False)):
        lib = row_kernels.load(target)
        assert lib is not None
        assert (lib.qinfer_tile_unit() > 0) == tile_unit, target
