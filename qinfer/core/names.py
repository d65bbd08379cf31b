"""One table of the GGUF tensor names and metadata keys we read and write (docs/formats.md#tensors and
#metadata-keys), in the manner of gguf-py's constants module: every other module names tensors and keys from here.

gguf-py's table has llama.cpp's names; PowerInfer adds `ffn_down_t`, the predictor's `fc1`/`fc2`, the sparse
threshold and the GPU index, which gguf-py does not know.
"""

from __future__ import annotations

import re
from enum import StrEnum

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFValueType, Keys


def _part(tensor: MODEL_TENSOR) -> str:
    """gguf-py's name of a block tensor, without its `blk.{bid}.` prefix."""
    return TENSOR_NAMES[tensor].removeprefix("blk.{bid}.")


class Tensor(StrEnum):
    """The part of a tensor name that says what it is: `blk.{layer}.{part}.{weight|bias}`, or `{part}.{...}`."""

    TOKEN_EMBD = "token_embd"
    POSITION_EMBD = "position_embd"
    OUTPUT_NORM = "output_norm"
    OUTPUT = "output"
    ATTN_NORM = "attn_norm"
    ATTN_NORM_2 = "attn_norm_2"
    ATTN_Q = "attn_q"
    ATTN_K = "attn_k"
    ATTN_V = "attn_v"
    ATTN_QKV = "attn_qkv"
    ATTN_OUT = "attn_output"
    FFN_NORM = "ffn_norm"
    FFN_GATE = "ffn_gate"
    FFN_UP = "ffn_up"
    FFN_DOWN = "ffn_down"  # dense GGUF: [E, F] as ggml ne
    FFN_DOWN_T = "ffn_down_t"  # PowerInfer GGUF: down transposed, so that row i of every FFN matrix is neuron i
    # Qwen3's RMSNorms over each head of q and k, before rope.
    ATTN_Q_NORM = _part(MODEL_TENSOR.ATTN_Q_NORM)
    ATTN_K_NORM = _part(MODEL_TENSOR.ATTN_K_NORM)
    # A mixture of experts: the router [N, E], every expert's matrices stacked into one 3-D tensor, and Qwen2-MoE's
    # shared expert with its sigmoid gate [1, E].
    FFN_GATE_INP = _part(MODEL_TENSOR.FFN_GATE_INP)
    FFN_GATE_EXPS = _part(MODEL_TENSOR.FFN_GATE_EXP)
    FFN_UP_EXPS = _part(MODEL_TENSOR.FFN_UP_EXP)
    FFN_DOWN_EXPS = _part(MODEL_TENSOR.FFN_DOWN_EXP)
    FFN_GATE_INP_SHEXP = _part(MODEL_TENSOR.FFN_GATE_INP_SHEXP)
    FFN_GATE_SHEXP = _part(MODEL_TENSOR.FFN_GATE_SHEXP)
    FFN_UP_SHEXP = _part(MODEL_TENSOR.FFN_UP_SHEXP)
    FFN_DOWN_SHEXP = _part(MODEL_TENSOR.FFN_DOWN_SHEXP)
    ROPE_FREQS = "rope_freqs"  # llama.cpp's per-frequency divisors of a scaled rope (Llama-3.1's "llama3" type)
    FC1 = "fc1"  # the layer's predictor, fc2(relu(fc1(h)))
    FC2 = "fc2"
    GPU_IDX = "gpu_idx"  # .gpuidx: 0/1 per neuron (no .weight suffix)
    GPU_BUCKET = "gpu_bucket"  # .gpuidx: ascending ids of the GPU neurons (no .weight suffix)


WEIGHT = "weight"
BIAS = "bias"
# The FFN matrices whose rows are neurons; the planner counts their bytes per neuron.
FFN_ROWS = (Tensor.FFN_GATE, Tensor.FFN_UP, Tensor.FFN_DOWN_T, Tensor.FFN_DOWN)
# The stacked expert matrices, [N_exp, ...]: the planner places a mixture's experts whole and counts their bytes per
# expert; a layer's other tensors (router, shared expert) run for every token with its attention.
EXPERT_STACKS = (Tensor.FFN_GATE_EXPS, Tensor.FFN_UP_EXPS, Tensor.FFN_DOWN_EXPS)
PREDICTOR = (Tensor.FC1, Tensor.FC2)
# Kept float32 in an f16 file, as llama.cpp's converter keeps them: a router rounded to f16 can pick other experts.
ROUTERS = (Tensor.FFN_GATE_INP, Tensor.FFN_GATE_INP_SHEXP)

_NAME = re.compile(r"(?:blk\.(\d+)\.)?([a-z0-9_]+)\.([a-z]+)")


def tensor_name(part: Tensor, layer: int | None = None, kind: str = WEIGHT) -> str:
    """`blk.3.ffn_up.weight` for (FFN_UP, 3), `output.weight` for (OUTPUT, None); kind "" for the GPU index's
    tensors, which have no suffix."""
    base = part if layer is None else f"blk.{layer}.{part}"
    return f"{base}.{kind}" if kind else str(base)


def split_tensor_name(name: str) -> tuple[int | None, str, str] | None:
    """(layer or None, part, kind) of a tensor name, or None when it does not have that form."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    return (None if layer is None else int(layer)), part, kind


class Key:
    """Metadata keys. `{arch}` is filled with `general.architecture`'s value, as in gguf-py's `Keys.LLM`."""

    ARCHITECTURE = Keys.General.ARCHITECTURE
    NAME = Keys.General.NAME
    FILE_TYPE = Keys.General.FILE_TYPE
    QUANTIZATION_VERSION = Keys.General.QUANTIZATION_VERSION
    ALIGNMENT = Keys.General.ALIGNMENT

    CONTEXT_LENGTH = Keys.LLM.CONTEXT_LENGTH
    EMBEDDING_LENGTH = Keys.LLM.EMBEDDING_LENGTH
    BLOCK_COUNT = Keys.LLM.BLOCK_COUNT
    FEED_FORWARD_LENGTH = Keys.LLM.FEED_FORWARD_LENGTH
    EXPERT_COUNT = Keys.LLM.EXPERT_COUNT
    EXPERT_USED_COUNT = Keys.LLM.EXPERT_USED_COUNT
    EXPERT_FEED_FORWARD_LENGTH = Keys.LLM.EXPERT_FEED_FORWARD_LENGTH
    EXPERT_SHARED_FEED_FORWARD_LENGTH = Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH
    EXPERT_WEIGHTS_NORM = Keys.LLM.EXPERT_WEIGHTS_NORM
    HEAD_COUNT = Keys.Attention.HEAD_COUNT
    HEAD_COUNT_KV = Keys.Attention.HEAD_COUNT_KV
    KEY_LENGTH = Keys.Attention.KEY_LENGTH  # a head's dimensions where they are not embedding_length / head_count
    VALUE_LENGTH = Keys.Attention.VALUE_LENGTH
    LAYERNORM_EPS = Keys.Attention.LAYERNORM_EPS
    LAYERNORM_RMS_EPS = Keys.Attention.LAYERNORM_RMS_EPS
    ROPE_DIMENSION_COUNT = Keys.Rope.DIMENSION_COUNT
    ROPE_FREQ_BASE = Keys.Rope.FREQ_BASE
    # Linear or YaRN scaling as llama.cpp reads it: scale_linear is the older name of scaling.factor.
    ROPE_SCALING_TYPE = Keys.Rope.SCALING_TYPE
    ROPE_SCALING_FACTOR = Keys.Rope.SCALING_FACTOR
    ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"
    SLIDING_WINDOW = Keys.Attention.SLIDING_WINDOW

    TOKENIZER_MODEL = Keys.Tokenizer.MODEL
    TOKENIZER_PRE = Keys.Tokenizer.PRE
    TOKENS = Keys.Tokenizer.LIST
    BOS_ID = Keys.Tokenizer.BOS_ID
    EOS_ID = Keys.Tokenizer.EOS_ID
    ADD_BOS = Keys.Tokenizer.ADD_BOS
    MERGES = Keys.Tokenizer.MERGES
    SCORES = Keys.Tokenizer.SCORES
    TOKEN_TYPE = Keys.Tokenizer.TOKEN_TYPE
    UNK_ID = Keys.Tokenizer.UNK_ID
    PAD_ID = Keys.Tokenizer.PAD_ID
    EOT_ID = Keys.Tokenizer.EOT_ID
    CHAT_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE

    # PowerInfer's own keys.
    SPARSE_THRESHOLD = "powerinfer.sparse_threshold"
    GPU_INDEX_ARCH = "generic.gpu_index"  # general.architecture of a .gpuidx
    GPU_INDEX_BLOCK_COUNT = "generic.gpu_index.block_count"
    VRAM_CAPACITY = "split.vram_capacity"
    # Ours: a .gpuidx's provenance, after the engine's keys so that its reader is unaffected.
    PLAN_PREFIX = "qinfer.plan."
    # Ours, in a model file (docs/formats.md#metadata-keys): what the FFN's neurons compute, and the per-layer
    # thresholds on |act(gate)| below which a calibrated model's neuron is skipped.
    FFN_ACTIVATION = "qinfer.feed_forward.activation"
    GATE_THRESHOLDS = "qinfer.feed_forward.gate_thresholds"


# Special token ids, each naming a token of the vocabulary.
TOKEN_ID_KEYS = (
    Keys.Tokenizer.BOS_ID,
    Keys.Tokenizer.EOS_ID,
    Keys.Tokenizer.UNK_ID,
    Keys.Tokenizer.SEP_ID,
    Keys.Tokenizer.PAD_ID,
    Keys.Tokenizer.EOT_ID,
)

_S, _U32, _F32 = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32
_U64, _BOOL, _ARRAY = GGUFValueType.UINT64, GGUFValueType.BOOL, GGUFValueType.ARRAY
# A `.gpuidx`'s provenance keys (after Key.PLAN_PREFIX), in the order they are written (qinfer.formats.gpuidx's
# Provenance has a field of each name): the value type, and the words that tell a user which of them went stale;
# attention_on_gpu and output_on_gpu record what the plan chose rather than what it was made from, so never do.
PLAN_KEYS: dict[str, tuple[GGUFValueType, str | None]] = {
    "model_size": (_U64, "model size"),
    "model_mtime_ns": (_U64, "model mtime"),
    "vram_budget": (_U64, "vram budget"),
    "activation_sha256": (_S, "activation files"),
    "group_size": (_U32, "group size"),
    "objective": (_S, "objective"),
    "ctx_size": (_U32, "ctx size"),
    "batch": (_U32, "batch"),
    "gpu": (_S, "gpu profile"),
    "cpu": (_S, "cpu profile"),
    "dense": (_S, "dense placement"),
    "attention_on_gpu": (_S, None),
    "output_on_gpu": (_BOOL, None),
    "kv_policy": (_S, "kv policy"),
    "kv_rows": (_U32, "kv window rows"),
}
# The value type (and an array's item type) of every key we read, as the format gives them; a file whose key has
# another type is refused (qinfer.formats.gguf_layout).
KEY_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    Key.ARCHITECTURE: (_S, None),
    Key.NAME: (_S, None),
    Key.FILE_TYPE: (_U32, None),
    Key.QUANTIZATION_VERSION: (_U32, None),
    Key.ALIGNMENT: (_U32, None),
    Key.CONTEXT_LENGTH: (_U32, None),
    Key.EMBEDDING_LENGTH: (_U32, None),
    Key.BLOCK_COUNT: (_U32, None),
    Key.FEED_FORWARD_LENGTH: (_U32, None),
    Key.EXPERT_COUNT: (_U32, None),
    Key.EXPERT_USED_COUNT: (_U32, None),
    Key.EXPERT_FEED_FORWARD_LENGTH: (_U32, None),
    Key.EXPERT_SHARED_FEED_FORWARD_LENGTH: (_U32, None),
    Key.EXPERT_WEIGHTS_NORM: (_BOOL, None),
    Key.HEAD_COUNT: (_U32, None),
    Key.HEAD_COUNT_KV: (_U32, None),
    Key.KEY_LENGTH: (_U32, None),
    Key.VALUE_LENGTH: (_U32, None),
    Key.LAYERNORM_EPS: (_F32, None),
    Key.LAYERNORM_RMS_EPS: (_F32, None),
    Key.ROPE_DIMENSION_COUNT: (_U32, None),
    Key.ROPE_FREQ_BASE: (_F32, None),
    Key.ROPE_SCALING_TYPE: (_S, None),
    Key.ROPE_SCALING_FACTOR: (_F32, None),
    Key.ROPE_SCALE_LINEAR: (_F32, None),
    Key.TOKENS: (_ARRAY, _S),
    Key.MERGES: (_ARRAY, _S),
    Key.SCORES: (_ARRAY, _F32),
    Key.TOKEN_TYPE: (_ARRAY, GGUFValueType.INT32),
    **{key: (_U32, None) for key in TOKEN_ID_KEYS},
    **{
        key: (_BOOL, None)
        for key in (Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.ADD_EOS, Keys.Tokenizer.ADD_SEP, Keys.Tokenizer.ADD_PREFIX)
    },
    Key.TOKENIZER_MODEL: (_S, None),
    Key.TOKENIZER_PRE: (_S, None),
    Keys.Tokenizer.CHAT_TEMPLATE: (_S, None),
    Key.SLIDING_WINDOW: (_U32, None),
    Key.SPARSE_THRESHOLD: (_F32, None),
    Key.FFN_ACTIVATION: (_S, None),
    Key.GATE_THRESHOLDS: (_ARRAY, _F32),
    Key.GPU_INDEX_BLOCK_COUNT: (_U32, None),
    Key.VRAM_CAPACITY: (_U64, None),
    **{Key.PLAN_PREFIX + name: (kind, None) for name, (kind, _) in PLAN_KEYS.items()},
}


def arch_key(template: str, arch: str) -> str:
    return template.format(arch=arch)
