"""Throughput and peak memory of `qinfer prep quantize` against gguf's plain quantize, on 7B-shaped tensors.

    .venv/bin/python bench/quantize_throughput.py [--layers 2] [--type Q4_0] [--work DIR]

Writes a random F16 PowerInfer-style GGUF with `--layers` 7B-shaped layers (E=4096, F=11008, vocab 32000),
then quantizes it twice, each in a fresh process: with our streaming quantizer, and the plain way (gguf's
reader maps the file, gguf.quants.quantize every tensor, GGUFWriter.add_tensor holds them all until the file
is written). Prints MB/s of input and peak RSS for both, side by side.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import PREDICTOR, split_tensor_name
from qinfer.formats.gguf_writer import TensorPlan, write_gguf
from qinfer.prep.convert.quantize import TARGETS, tensor_type

E, F, V = 4096, 11008, 32000


def write_input(path: Path, layers: int) -> int:
    rng = np.random.default_rng(0)
    spec = ModelSpec(
        arch="llama",
        name="bench",
        vocab_size=V,
        context_length=4096,
        hidden=E,
        layers=layers,
        ffn=F,
        heads=32,
        kv_heads=32,
        norm_eps=1e-6,
        rope_dim=E // 32,
    )
    # A PowerInfer file without its predictors: the tensors whose quantization is timed.
    shapes = ARCHITECTURES["llama"].tensors(spec, [32] * layers)
    shapes = {n: s for n, s in shapes.items() if (split_tensor_name(n) or (0, "", ""))[1] not in PREDICTOR}

    def make(shape: tuple[int, ...]) -> np.ndarray:
        dtype = np.float32 if len(shape) == 1 else np.float16
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    plans = [
        TensorPlan(n, s, np.dtype(np.float32 if len(s) == 1 else np.float16), lambda s=s: make(s))
        for n, s in shapes.items()
    ]
    write_gguf(path, "llama", lambda w: w.add_file_type(1), plans, powerinfer=True)
    return path.stat().st_size


def plain_quantize(src: Path, dst: Path, target: str) -> None:
    """The straightforward way with the gguf package alone: every quantized tensor held until the write."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, "llama")
    writer.add_file_type(TARGETS[target][1])
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        qtype = tensor_type(t.name, shape, TARGETS[target][0])
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32))
        else:
            writer.add_tensor(t.name, quantize(np.asarray(t.data), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def peak_rss() -> int:
    """This process's peak resident memory in bytes. Not getrusage: its ru_maxrss survives exec, so a child
    would report the parent's peak (which wrote the input) whenever that is the larger."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def child(mode: str, src: Path, dst: Path, target: str) -> None:
    started = time.perf_counter()
    if mode == "ours":
        from qinfer.prep.convert.quantize import quantize_gguf

        quantize_gguf(src, dst, target)
    else:
        plain_quantize(src, dst, target)
    seconds = time.perf_counter() - started
    print(f"{seconds} {peak_rss()}")


def run(mode: str, src: Path, dst: Path, target: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(src), str(dst), target],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[-2]), int(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--type", default="Q4_0", choices=sorted(TARGETS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--child", nargs=4, metavar=("MODE", "SRC", "DST", "TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, src, dst, target = args.child
        child(mode, Path(src), Path(dst), target)
        return
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        src = Path(tmp) / "in.powerinfer.gguf"
        size = write_input(src, args.layers)
        # gguf's reader refuses the PWRI magic; the baseline reads a GGUF-magic twin made before timing starts.
        twin = src.with_suffix(".gguf-magic")
        twin.write_bytes(b"GGUF")
        with open(src, "rb") as fin, open(twin, "r+b") as fout:
            fin.seek(4)
            fout.seek(4)
            while chunk := fin.read(1 << 26):
                fout.write(chunk)
        print(f"input: {args.layers} layers of E={E} F={F} + embedding/output (V={V}), {size / 1e6:.0f} MB F16")
        results = {}
        for mode in ("ours", "plain"):
            src_for = src if mode == "ours" else twin
            results[mode] = run(mode, src_for, Path(tmp) / f"{mode}.gguf", args.type)
            (Path(tmp) / f"{mode}.gguf").unlink()
        print(f"{'':8}{'MB/s':>8}{'peak RSS MB':>14}{'seconds':>10}")
        for mode, (seconds, peak) in results.items():
            print(f"{mode:8}{size / 1e6 / seconds:8.0f}{peak / 1e6:14.0f}{seconds:10.1f}")
        (ours_s, ours_rss), (plain_s, plain_rss) = results["ours"], results["plain"]
        print(f"ours / plain: throughput x{plain_s / ours_s:.2f}, peak RSS x{ours_rss / plain_rss:.2f}")


if __name__ == "__main__":
    main()
