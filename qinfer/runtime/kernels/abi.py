"""What the C kernels and their Python callers share: the weight type and FFN form codes, the quantized block
layout, the block of tokens the kernels take at once, and the structures the layer step reads (decode_layer.c),
mirrored here in ctypes.

C is where these facts are used, so C states them, each under its name; this module states what Python
expects, and `disagreement` compares the two by name when the library loads (row_kernels.load): a structure, code
or layout changed on one side alone makes the library refuse to load with a line naming the fact, instead of
passing misread pointers. The block layout Python expects is gguf's own table, the one the file readers use.
"""

from __future__ import annotations

import ctypes

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qinfer.core.architectures import FfnForm

# Weight types as the kernels number them (C names them as gguf does); F16 rows are 0.
F16_CODE = 0
TYPE_CODES = {GGMLQuantizationType.Q4_0: 1, GGMLQuantizationType.Q8_0: 2}
# FFN forms by their C names, each (gated, relu on up, the gate's activation): relu(gate) * up,
# relu(gate) * relu(up), relu(up), silu(gate) * up.
FORMS = {
    "FORM_GATED": (True, False, "relu"),
    "FORM_GATED_RELU_UP": (True, True, "relu"),
    "FORM_UP": (False, True, "relu"),
    "FORM_GATED_SILU": (True, False, "silu"),
}
FORM_CODES = {form: code for code, form in enumerate(FORMS.values())}
# KV-cache element types (qinfer.core.kv_policy.CACHE_TYPES) as the layer step numbers them (C: CACHE_F32, ...).
CACHE_CODES = {"f32": 0, "f16": 1, "q8_0": 2}
EMPTY_ROW = -1  # the position of a window cache's row that holds none


def form_code(form: FfnForm) -> int:
    return FORM_CODES[form.gated, form.relu_up, form.act]
# The kernels take tokens a block at a time (each row read once per block). The sparse FFN and the weighted row sum
# take at most one block per call; products take any number of tokens (many at a time as a blocked matrix product:
# F16 rows in floats, Q4_0 and Q8_0 rows in integers against the input quantized once).
TOKEN_BLOCK = 16

i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class Matrix(ctypes.Structure):
    _fields_ = [("data", ptr), ("stride", i64), ("type", i32), ("rows", i64), ("cols", i64)]


class Stacks(ctypes.Structure):
    """A layer's experts: gate and up [experts, f, n], down [experts, n, f], with strides in bytes."""

    _fields_ = [
        ("gate", ptr), ("up", ptr), ("down", ptr),
        *((name, i64) for name in ("gate_expert", "gate_row", "up_expert", "up_row", "down_expert", "down_row")),
        ("gate_type", i32), ("up_type", i32), ("down_type", i32), ("experts", i64), ("f", i64), ("n", i64),
    ]  # fmt: skip


MATRICES = ("q", "k", "v", "o", "gate", "up", "down", "fc1", "fc2")


class Layer(ctypes.Structure):
    _fields_ = [
        *((name, Matrix) for name in MATRICES),
        ("experts", Stacks),
        ("router", ptr),
        ("shared_gate", ptr),
        ("q_norm", ptr),
        ("k_norm", ptr),
        ("attn_norm", ptr),
        ("ffn_norm", ptr),
        ("attn_norm_bias", ptr),
        ("ffn_norm_bias", ptr),
        ("q_bias", ptr),
        ("k_bias", ptr),
        ("v_bias", ptr),
        ("o_bias", ptr),
        ("up_bias", ptr),
        ("down_bias", ptr),
        ("k_cache", ptr),
        ("v_cache", ptr),
        ("pos_cache", ptr),
        ("mass_cache", ptr),
        ("gate_threshold", f32),
    ]


DIMS = (
    "hidden", "heads", "kv_heads", "head_dim", "ffn", "ctx", "predictor", "widest", "window", "tokens", "kept", "sinks",
    "recent", "experts", "used", "expert_ffn",
)  # fmt: skip


class Dims(ctypes.Structure):
    _fields_ = [
        *((name, i64) for name in DIMS),
        ("eps", f32),
        ("threshold", f32),
        ("decay", f32),
        ("form", i32),
        ("sparse", i32),
        ("down_rows", i32),
        ("rope_neox", i32),
        ("k_type", i32),
        ("v_type", i32),
        ("layer_norm", i32),
        ("parallel", i32),
        ("norm_top_k", i32),
    ]


# The layer step's scratch buffers, in decode_layer.c's order, with their C element types (whose counts the
# library computes: qinfer_scratch_sizes).
SCRATCH = (
    ("x", ctypes.c_float), ("q", ctypes.c_float), ("k", ctypes.c_float), ("v", ctypes.c_float),
    ("att", ctypes.c_float), ("scores", ctypes.c_float), ("pred", ctypes.c_float), ("g", ctypes.c_float),
    ("out", ctypes.c_float), ("held", ctypes.c_float), ("probs", ctypes.c_float), ("weights", ctypes.c_float),
    ("chosen", ctypes.c_int64), ("ids", ctypes.c_int64), ("xq", ctypes.c_int8),
    ("xd", ctypes.c_float), ("xs", ctypes.c_int32),
)  # fmt: skip


class Scratch(ctypes.Structure):
    _fields_ = [(name, ptr) for name, _ in SCRATCH]


class Call(ctypes.Structure):
    """One forward call of every layer and the head (qinfer_decode_step)."""

    _fields_ = [
        ("k_cache", ptr), ("v_cache", ptr), ("k_stride", i64), ("v_stride", i64), ("pos_cache", ptr),
        ("mass_cache", ptr), ("pos_stride", i64), ("mass_stride", i64), ("freq", ptr), ("sparse", ptr), ("read", ptr),
        ("output", ptr), ("norm", ptr), ("norm_bias", ptr), ("rows", ptr), ("n_rows", i64), ("logits", ptr),
        ("steps", i64), ("embed", ptr), ("embed_stride", i64), ("embed_rows", i64), ("embed_half", i32), ("ids", ptr),
        ("ends", ptr), ("n_ends", i64), ("next", ptr), ("stop", ptr),
    ]  # fmt: skip


STRUCTS: tuple[type[ctypes.Structure], ...] = (Matrix, Stacks, Layer, Dims, Scratch, Call)


class Fact(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", i64)]


def expected() -> dict[str, int]:
    """Every shared fact under its C name (C's structures are the mirrors' names in lower case)."""
    facts = {"F16": F16_CODE, "TOKEN_BLOCK": TOKEN_BLOCK, "EMPTY_ROW": EMPTY_ROW}
    facts |= {f"CACHE_{name.upper()}": code for name, code in CACHE_CODES.items()}
    for qtype, code in TYPE_CODES.items():
        block, size = GGML_QUANT_SIZES[qtype]
        facts |= {qtype.name: code, "QK": block, f"{qtype.name}_BYTES": size}
    facts |= {name: FORM_CODES[form] for name, form in FORMS.items()}
    for struct in STRUCTS:
        c_name = struct.__name__.lower()
        facts[f"sizeof {c_name}"] = ctypes.sizeof(struct)
        facts |= {f"{c_name}.{name}": getattr(struct, name).offset for name, *_ in struct._fields_}
    facts |= {f"scratch.{name} element": ctypes.sizeof(kind) for name, kind in SCRATCH}
    return facts


def stated(lib: ctypes.CDLL) -> dict[str, int]:
    """The facts as the library states them (qinfer_abi)."""
    table = ctypes.POINTER(Fact)()
    count = lib.qinfer_abi(ctypes.byref(table))
    return {table[i].name.decode(): table[i].value for i in range(count)}


def disagreement(lib: ctypes.CDLL) -> str | None:
    """The first fact (by name) the library states otherwise than Python expects, or None where all agree."""
    ours, theirs = expected(), stated(lib)
    for name in sorted(ours.keys() | theirs.keys()):
        if name not in theirs:
            return f"{name}: the library does not state it, Python expects {ours[name]}"
        if name not in ours:
            return f"{name}: the library says {theirs[name]}, Python does not mirror it"
        if ours[name] != theirs[name]:
            return f"{name}: the library says {theirs[name]}, Python expects {ours[name]}"
    return None
