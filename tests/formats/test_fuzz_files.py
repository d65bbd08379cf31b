"""Mutated model and `.gpuidx` files: every reader either refuses them with one UserError line or gives exactly the
unmutated file's result. Never another exception (a traceback at the CLI), a hang, a crash or a silently different
answer. Seeded: the same mutations every run.

Mutations hit the header's structure (counts, value types, lengths, tensor shapes, types and offsets) and the
values the model's shape is read from; bytes inside strings and tensor data are left alone, since changing a
token's text or a weight legitimately changes the answer.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.formats.activation_files import read_activations
from qinfer.formats.gpuidx import gpuidx_path_for, read_gpuidx
from qinfer.formats.predictor_dir import load_layer
from qinfer.planner.make_plan import PlanOptions, dry_run_account, load_or_make_gpuidx
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams
from tests.support.fake_activation import write_power_law_activation

SEED = 15
CASE_TIMEOUT_S = 20
PLAN_BUDGET = 270_000_000  # the tiny model's dense parts and scratch, and room for part of its FFN
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class Field:
    """A structural number in the header: where it is, its width, and what it is."""

    offset: int
    size: int
    kind: str
    key: str = ""


def header_fields(data: bytes) -> list[Field]:
    """Walk a well-formed GGUF header and note every count, type, length, dimension and offset."""
    pos = 8
    fields = [Field(4, 4, "version"), Field(8, 8, "tensor count"), Field(16, 8, "key count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(kind: str) -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", data, pos)
        fields.append(Field(pos, 8, kind))
        text = data[pos + 8 : pos + 8 + length].decode()
        pos += 8 + length
        return text

    for _ in range(n_kv):
        key = string("key length")
        (kind,) = struct.unpack_from("<I", data, pos)
        fields.append(Field(pos, 4, "value type", key))
        pos += 4
        if kind == 8:
            string("string length")
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields += [Field(pos, 4, "array type", key), Field(pos + 4, 8, "array length", key)]
            pos += 12
            for _ in range(count):
                if item == 8:
                    (length,) = struct.unpack_from("<Q", data, pos)
                    pos += 8 + length
                else:
                    pos += _VALUE_SIZES[item]
        else:
            fields.append(Field(pos, _VALUE_SIZES[kind], f"value {kind}", key))
            pos += _VALUE_SIZES[kind]
    for _ in range(n_tensors):
        name = string("tensor name length")
        (dims,) = struct.unpack_from("<I", data, pos)
        fields.append(Field(pos, 4, "dimension count", name))
        pos += 4
        fields += [Field(pos + 8 * d, 8, "dimension", name) for d in range(dims)]
        pos += 8 * dims
        fields += [Field(pos, 4, "tensor type", name), Field(pos + 4, 8, "tensor offset", name)]
        pos += 12
    return fields


def mutate(data: bytes, field: Field, rng: random.Random) -> bytes:
    """One number changed to a value a hostile or broken file could hold. A structural number may take any other
    value; a metadata value only one that no model has (zero, huge, NaN, infinite, negative), since another
    plausible value (a context length of 257 for 256) makes a different but valid model."""
    old = int.from_bytes(data[field.offset : field.offset + field.size], "little")
    top = (1 << (8 * field.size)) - 1
    candidates = [old + 1, old - 1, old + 32, 0, 1, top, top - 31, old * 2, old // 2, 1 << (8 * field.size - 1)]
    if field.kind.startswith("value "):
        # Zero is a valid token id, and a count of nothing.
        candidates = [top, 1 << (8 * field.size - 1), *([] if field.key.endswith("_token_id") else [0])]
    if field.kind == "value 6":  # a float: NaN or infinite (a negative threshold is a valid one)
        candidates = [0x7FC00000, 0x7F800000, 0xFF800000]
    new = rng.choice([c for c in candidates if 0 <= c <= top and c != old] or [old ^ 1])
    return data[: field.offset] + new.to_bytes(field.size, "little") + data[field.offset + field.size :]


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """A hang fails the case instead of the whole suite."""

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(action: Callable[[], object]) -> tuple[str, object]:
    """("error", one line) for a UserError, ("ok", result) otherwise; anything else propagates and fails."""
    with time_limit(CASE_TIMEOUT_S):
        try:
            return "ok", action()
        except UserError as exc:
            message = str(exc)
            assert message and "\n" not in message, f"a user error of {len(message.splitlines())} lines"
            return "error", message


def run_tokens(path: Path) -> tuple[int, ...]:
    engine = Engine.open(path, ctx_size=32)
    return tuple(generate(engine, "Once upon a time", 3, SamplingParams(temperature=0.0)).tokens)


def plan_account(path: Path) -> tuple[float, ...]:
    _, acct = dry_run_account(path, 1 << 40, PlanOptions())
    return (acct.dense, acct.ffn_total, *acct.neuron_bytes)


def quantized_sha(path: Path) -> str:
    out = path.with_name(path.name + ".q4")
    try:
        return hashlib.sha256(quantize_gguf(path, out, "Q4_0").outfile.read_bytes()).hexdigest()
    finally:
        out.unlink(missing_ok=True)


def reused_plan(path: Path) -> tuple[bytes, ...]:
    """`qinfer plan` finding the index beside its model: read, checked against the model, and reused."""
    model = path.with_name(path.name.removesuffix(".generated.gpuidx"))
    plan = load_or_make_gpuidx(model, PLAN_BUDGET, options=PlanOptions())
    index = read_gpuidx(path)
    return (str(index.vram_capacity).encode(), *(m.tobytes() for m in plan.placement.gpu_neurons))


@pytest.fixture(scope="module")
def samples(gguf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fuzz")
    files = {kind: Path(shutil.copy(gguf_files[kind], out / f"{kind}.gguf")) for kind in ("pi-f16", "dense-f16")}
    files["pi-q4"] = quantize_gguf(files["pi-f16"], out / "pi-q4.gguf", "Q4_0").outfile
    plan_dir = out / "plan"
    write_power_law_activation(plan_dir / "activation")
    model = Path(shutil.copy(files["pi-f16"], plan_dir / "m.powerinfer.gguf"))
    load_or_make_gpuidx(model, PLAN_BUDGET, options=PlanOptions(), reset=True)
    files["gpuidx"] = gpuidx_path_for(model)
    return files


READERS: dict[str, list[Callable[[Path], object]]] = {
    "pi-f16": [run_tokens, plan_account, quantized_sha],
    "dense-f16": [run_tokens, quantized_sha],
    "pi-q4": [run_tokens, plan_account],
    "gpuidx": [reused_plan],
}
CASES = {"pi-f16": 150, "dense-f16": 60, "pi-q4": 60, "gpuidx": 60}


@pytest.mark.parametrize("kind", list(CASES))
def test_mutated_files_are_refused_in_one_line_or_read_as_before(
    samples: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    original = samples[kind].read_bytes()
    readers = READERS[kind]
    expected = [outcome(lambda r=r: r(samples[kind])) for r in readers]
    assert all(status == "ok" for status, _ in expected)
    rng = random.Random(f"{SEED}-{kind}")
    # Booleans are left alone (any byte reads as true or false, each a valid setting), and so are the special ids
    # nothing reads (llama.cpp ignores one outside the vocabulary; so do we).
    unread = ("tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id")
    fields = [
        f
        for f in header_fields(original)
        if f.kind != "value 7" and not (f.kind.startswith("value") and f.key in unread)
    ]
    tally = {"refused": 0, "same": 0}
    for case in range(CASES[kind]):
        field = rng.choice(fields)
        mutated = mutate(original, field, rng) if case % 10 else original[: rng.randrange(8, len(original))]
        # A .gpuidx is read beside its model, so it is mutated in place (and restored below).
        path = samples[kind] if kind == "gpuidx" else tmp_path / samples[kind].name
        path.write_bytes(mutated)
        for reader, (_, want) in zip(readers, expected, strict=True):
            status, got = outcome(lambda r=reader, p=path: r(p))
            where = f"case {case}: {field.kind} {field.key!r} of {kind} through {reader.__name__}"
            assert status == "error" or got == want, f"{where} was accepted with a different result"
            tally["refused" if status == "error" else "same"] += 1
    samples[kind].write_bytes(original)
    print(f"{kind}: {CASES[kind]} mutated files, {len(readers)} readers: {tally}")
    assert tally["refused"] > 0


def test_the_cli_turns_a_hostile_file_into_one_line_and_exit_2(samples: dict[str, Path], tmp_path: Path) -> None:
    """The hang of old (a value type changed from string to array) and a tensor moved past the end of the file."""
    data = samples["pi-f16"].read_bytes()
    fields = header_fields(data)
    arch_type = next(f for f in fields if f.kind == "value type" and f.key == "general.architecture")
    down = next(f for f in fields if f.kind == "tensor offset" and f.key == "blk.1.ffn_down_t.weight")
    cases = {"array": (arch_type, 9, "run"), "offset": (down, len(data), "plan")}
    for name, (field, value, command) in cases.items():
        path = tmp_path / f"{name}.powerinfer.gguf"
        path.write_bytes(
            data[: field.offset] + value.to_bytes(field.size, "little") + data[field.offset + field.size :]
        )
        args = ["run", "-m", str(path), "-p", "Once", "-n", "2"] if command == "run" else ["plan", "-m", str(path)]
        args += [] if command == "run" else ["--vram-budget", "1"]
        done = subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr and "not a valid GGUF file" in done.stderr


class _Payload:
    """An object whose unpickling would run code: weights_only loading must refuse it."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickled code ran",))


def test_damaged_torch_files_are_one_line_without_torchs_advice(tmp_path: Path) -> None:
    """A predictor or activation file that is not a tensor file (or hides a pickled object) is refused in one
    line; torch's own message, which advises weights_only=False, is never passed on."""
    torch.save({"fc1.weight": _Payload()}, tmp_path / "model_0.pt")
    (tmp_path / "activation_0.pt").write_bytes(b"not a torch file at all")
    for read in (lambda: load_layer(tmp_path / "model_0.pt"), lambda: read_activations(tmp_path)):
        with pytest.raises(UserError) as info:
            read()
        assert "\n" not in str(info.value) and "weights_only" not in str(info.value)
