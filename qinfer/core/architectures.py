"""One `Architecture` per model family: everything a stage must know about it, so that adding a family means adding
an entry here and a forward block in the runtime (docs/formats.md#tensors).

An entry holds its tensor list and shapes, the HF-to-GGUF name map and tensor transforms, its FFN form, its metadata,
which HF modules the profiler hooks, how its `config.json` reads, and the runtime class that computes its blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map

from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import BIAS, WEIGHT, Key, Tensor, tensor_name

if TYPE_CHECKING:
    # Only for annotations: the table is read by commands that never touch a tensor, and torch is slow to import.
    import torch

OPT_POSITION_OFFSET = 2  # HF's OPTLearnedPositionalEmbedding reads row position + 2; the engine adds 2 too
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT uses and Falcon's configs default to

Shapes = dict[str, tuple[int, ...]]  # tensor name -> numpy shape (ggml's ne reversed), in file order
Transform = Callable[["torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class FfnForm:
    """What one neuron computes: relu(gate) * up (gated), relu(gate) * relu(up), or relu(up) alone, each row of
    down_t scaled by it; `biased`: up and down carry biases (OPT)."""

    gated: bool
    relu_up: bool
    biased: bool = False

    @property
    def matrices(self) -> int:
        """FFN matrices with one row per neuron."""
        return 3 if self.gated else 2


@dataclass(frozen=True)
class HfModules:
    """Where the profiler and the predictor trainer hook a transformers model; paths are attribute paths."""

    model_class: str  # the transformers class that loads the checkpoint
    layers: str  # the decoder layers, from the model
    ffn_norm: str  # the norm before the FFN, from a layer; its input is the predictor's input
    up: str  # from a layer
    gate: str | None = None
    llama_config: bool = False  # config.json is read as a LlamaConfig (Bamboo's model_type is unknown to transformers)
    relu_up_hook: bool = False  # the transformers class lacks the ReLU on up that the family applies


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    hf_classes: tuple[str, ...]  # config.json `architectures` entries that mean this family
    ffn: FfnForm
    norm: Literal["rms", "layer"]
    rope: Literal["pairs", "neox", "none"]  # pairs: ggml's default rope on adjacent pairs; neox: rotate-half
    hf: HfModules
    read_config: Callable[[dict[str, Any], Path], ModelSpec]
    block_tensors: Callable[[ModelSpec, int], Shapes]  # a block's attention and norm tensors, without the FFN
    global_tensors: Callable[[ModelSpec], Shapes]
    hf_names: Callable[[ModelSpec], Callable[[str], str | None]]  # HF tensor name -> GGUF name (None: unknown)
    add_metadata: Callable[[GGUFWriter, ModelSpec], None]  # the {arch}.* keys after feed_forward_length
    norm_eps_key: str | None  # metadata key template of the norms' epsilon; None: not written (default_norm_eps)
    block: str  # the decoder block's layout; the runtime maps it to its forward (runtime/model/loader.py)
    default_norm_eps: float = LAYER_NORM_EPS
    position_offset: int = 0  # rows of a learned position table before position 0 (OPT: 2)
    output_is_embedding: bool = False  # the head multiplies by token_embd: the file has no output tensor (OPT)
    transforms: Callable[[ModelSpec, str], Transform | None] = lambda _spec, _name: None

    def default_rope_dim(self, hidden: int, heads: int) -> int:
        """Rotated dimensions per head where the file does not say: whole heads, or none without rope."""
        return 0 if self.rope == "none" else hidden // heads

    def tensors(self, spec: ModelSpec, predictor_ranks: list[int] | None) -> Shapes:
        """Every tensor of a converted file in file order: a PowerInfer GGUF when `predictor_ranks` (P per layer)
        is given, else a dense GGUF."""
        shapes = self.global_tensors(spec)
        e, f = spec.hidden, spec.ffn
        for i in range(spec.layers):
            shapes |= self.block_tensors(spec, i)
            if self.ffn.gated:
                shapes[tensor_name(Tensor.FFN_GATE, i)] = (f, e)
            shapes[tensor_name(Tensor.FFN_UP, i)] = (f, e)
            if self.ffn.biased:
                shapes[tensor_name(Tensor.FFN_UP, i, BIAS)] = (f,)
            down = Tensor.FFN_DOWN if predictor_ranks is None else Tensor.FFN_DOWN_T
            shapes[tensor_name(down, i)] = (e, f) if predictor_ranks is None else (f, e)
            if self.ffn.biased:
                shapes[tensor_name(down, i, BIAS)] = (e,)
            if predictor_ranks is not None:
                rank = predictor_ranks[i]
                shapes[tensor_name(Tensor.FC1, i)] = (rank, e)
                shapes[tensor_name(Tensor.FC2, i)] = (f, rank)
        return shapes


# --- reading config.json ----------------------------------------------------------------------------------------


def _rope_theta(cfg: dict[str, Any]) -> float | None:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top level.
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    return None if theta is None else float(theta)


def _llama_config(arch: str, cfg: dict[str, Any], path: Path) -> ModelSpec:
    if cfg.get("hidden_act", "relu") != "relu":
        raise UserError(f"{path} has hidden_act={cfg['hidden_act']!r}; only ReLU models (hidden_act=relu) are sparse")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UserError(f"{path} sets {flag}; the GGUF layout of this family has no biases")
    rope_type = (cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UserError(f"{path} uses rope scaling {rope_type!r}, which this converter does not support")
    heads = int(cfg["num_attention_heads"])
    if cfg.get("head_dim") not in (None, int(cfg["hidden_size"]) // heads):
        raise UserError(f"{path}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads")
    hidden = int(cfg["hidden_size"])
    return ModelSpec(
        arch=arch,
        name=path.parent.resolve().name,
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        ffn=int(cfg["intermediate_size"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_dim=hidden // heads,
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _falcon_config(cfg: dict[str, Any], path: Path) -> ModelSpec:
    """Falcon's own config keys; only the layout ReluFalcon-40B has (what llama.cpp's falcon graph runs)."""
    if cfg.get("activation", "gelu") != "relu":
        raise UserError(f"{path} has activation={cfg.get('activation', 'gelu')!r}; only ReLU Falcon models are sparse")
    required = {"new_decoder_architecture": True, "parallel_attn": True, "bias": False, "alibi": False}
    for flag, want in required.items():
        if bool(cfg.get(flag, not want)) != want:
            raise UserError(f"{path}: {flag}={cfg.get(flag)!r} is not supported; only Falcon-40B's layout is")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelSpec(
        arch="falcon",
        name=path.parent.resolve().name,
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        ffn=int(cfg.get("ffn_hidden_size") or 4 * hidden),
        heads=heads,
        kv_heads=int(cfg.get("num_kv_heads") or heads),
        norm_eps=float(cfg.get("layer_norm_epsilon", LAYER_NORM_EPS)),
        rope_dim=hidden // heads,
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _opt_config(cfg: dict[str, Any], path: Path) -> ModelSpec:
    """OPT as the engine runs it: pre-LayerNorm blocks, biases everywhere, learned positions, output tied to the
    token embedding."""
    if cfg.get("activation_function", "relu") != "relu":
        raise UserError(
            f"{path} has activation_function={cfg['activation_function']!r}; only ReLU OPT models are sparse"
        )
    hidden = int(cfg["hidden_size"])
    required = {
        "do_layer_norm_before": True,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "_remove_final_layer_norm": False,
        "word_embed_proj_dim": hidden,
    }
    for flag, want in required.items():
        if cfg.get(flag, want) != want:
            raise UserError(f"{path}: {flag}={cfg.get(flag)!r} is not supported; only pre-LayerNorm OPT models are")
    heads = int(cfg["num_attention_heads"])
    return ModelSpec(
        arch="opt",
        name=path.parent.resolve().name,
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        ffn=int(cfg["ffn_dim"]),
        heads=heads,
        kv_heads=heads,
        norm_eps=LAYER_NORM_EPS,
        tie_word_embeddings=True,
    )


# --- tensors ----------------------------------------------------------------------------------------------------


def _llama_globals(spec: ModelSpec) -> Shapes:
    v, e = spec.vocab_size, spec.hidden
    return {
        tensor_name(Tensor.TOKEN_EMBD): (v, e),
        tensor_name(Tensor.OUTPUT_NORM): (e,),
        tensor_name(Tensor.OUTPUT): (v, e),
    }


def _llama_block(spec: ModelSpec, i: int) -> Shapes:
    e, kv = spec.hidden, spec.kv_dim
    return {
        tensor_name(Tensor.ATTN_NORM, i): (e,),
        tensor_name(Tensor.ATTN_Q, i): (e, e),
        tensor_name(Tensor.ATTN_K, i): (kv, e),
        tensor_name(Tensor.ATTN_V, i): (kv, e),
        tensor_name(Tensor.ATTN_OUT, i): (e, e),
        tensor_name(Tensor.FFN_NORM, i): (e,),
    }


def _falcon_globals(spec: ModelSpec) -> Shapes:
    v, e = spec.vocab_size, spec.hidden
    return {
        tensor_name(Tensor.TOKEN_EMBD): (v, e),
        tensor_name(Tensor.OUTPUT_NORM): (e,),
        tensor_name(Tensor.OUTPUT_NORM, None, BIAS): (e,),
        tensor_name(Tensor.OUTPUT): (v, e),
    }


def _falcon_block(spec: ModelSpec, i: int) -> Shapes:
    """LayerNorms with biases (attn_norm feeds the FFN, attn_norm_2 attention) and the fused QKV."""
    e, kv = spec.hidden, spec.kv_dim
    return {
        tensor_name(Tensor.ATTN_NORM, i): (e,),
        tensor_name(Tensor.ATTN_NORM, i, BIAS): (e,),
        tensor_name(Tensor.ATTN_NORM_2, i): (e,),
        tensor_name(Tensor.ATTN_NORM_2, i, BIAS): (e,),
        tensor_name(Tensor.ATTN_QKV, i): (e + 2 * kv, e),
        tensor_name(Tensor.ATTN_OUT, i): (e, e),
    }


def _opt_globals(spec: ModelSpec) -> Shapes:
    v, e = spec.vocab_size, spec.hidden
    return {
        tensor_name(Tensor.TOKEN_EMBD): (v, e),
        tensor_name(Tensor.POSITION_EMBD): (spec.context_length + OPT_POSITION_OFFSET, e),
        tensor_name(Tensor.OUTPUT_NORM): (e,),
        tensor_name(Tensor.OUTPUT_NORM, None, BIAS): (e,),
    }


def _opt_block(spec: ModelSpec, i: int) -> Shapes:
    e = spec.hidden
    shapes: Shapes = {}
    for part, shape in (
        (Tensor.ATTN_NORM, None),
        (Tensor.ATTN_Q, (e, e)),
        (Tensor.ATTN_K, (e, e)),
        (Tensor.ATTN_V, (e, e)),
        (Tensor.ATTN_OUT, (e, e)),
        (Tensor.FFN_NORM, None),
    ):
        shapes[tensor_name(part, i)] = shape or (e,)
        shapes[tensor_name(part, i, BIAS)] = (e,)
    return shapes


# --- HF names and transforms ------------------------------------------------------------------------------------


def _gguf_name_map(model_arch: MODEL_ARCH, spec: ModelSpec) -> Callable[[str], str | None]:
    """llama.cpp's own HF-to-GGUF name table, from gguf-py."""
    table = get_tensor_name_map(model_arch, spec.layers)
    return lambda hf_name: table.get_name(hf_name, try_suffixes=(".weight", ".bias"))


_OPT_GLOBAL_NAMES = {
    "decoder.embed_tokens": Tensor.TOKEN_EMBD,
    "decoder.embed_positions": Tensor.POSITION_EMBD,
    "decoder.final_layer_norm": Tensor.OUTPUT_NORM,
    "lm_head": Tensor.OUTPUT,  # tied to the token embedding: the engine's OPT file has no output tensor
}
_OPT_LAYER_NAMES = {
    "self_attn_layer_norm": Tensor.ATTN_NORM,
    "self_attn.q_proj": Tensor.ATTN_Q,
    "self_attn.k_proj": Tensor.ATTN_K,
    "self_attn.v_proj": Tensor.ATTN_V,
    "self_attn.out_proj": Tensor.ATTN_OUT,
    "final_layer_norm": Tensor.FFN_NORM,
    "fc1": Tensor.FFN_UP,
    "fc2": Tensor.FFN_DOWN,
}


_OPT_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _opt_name_map(_spec: ModelSpec) -> Callable[[str], str | None]:
    """The engine's OPT names (gguf-py has no OPT); checkpoints name tensors with or without a `model.` prefix."""

    def name(hf_name: str) -> str | None:
        base, _, kind = hf_name.removeprefix("model.").rpartition(".")
        if kind not in (WEIGHT, BIAS):
            return None
        if base in _OPT_GLOBAL_NAMES:
            return tensor_name(_OPT_GLOBAL_NAMES[base], None, kind)
        match = _OPT_LAYER_NAME.fullmatch(base)
        part = None if match is None else _OPT_LAYER_NAMES.get(match.group(2))
        return None if match is None or part is None else tensor_name(part, int(match.group(1)), kind)

    return name


def permute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows as llama.cpp's converter does (docs/formats.md#qk-permutation-and-falcons-qkv-regrouping).

    HF rotates the two halves of each head's dimensions against each other; ggml's rope rotates
    adjacent pairs, so each head's rows are interleaved half by half.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def jploski_qkv(weight: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """Falcon's fused QKV rows regrouped as llama.cpp's converter does ("jploski" layout).

    HF stores n_head_kv groups, each n_head/n_head_kv query heads then one key and one value head; ggml wants
    all query heads, then all key heads, then all value heads.
    """
    per_group = n_head // n_head_kv + 2
    head_dim = weight.shape[0] // (n_head_kv * per_group)
    groups = range(n_head_kv)
    order = [g * per_group + j for g in groups for j in range(per_group - 2)]
    order += [g * per_group + per_group - 2 for g in groups] + [g * per_group + per_group - 1 for g in groups]
    return weight.reshape(n_head_kv * per_group, head_dim, -1)[order].reshape(weight.shape)


def _part(name: str) -> str:
    return name.split(".")[-2]


def _llama_transforms(spec: ModelSpec, name: str) -> Transform | None:
    n_head = {Tensor.ATTN_Q: spec.heads, Tensor.ATTN_K: spec.kv_heads}.get(_part(name))
    return None if n_head is None else partial(permute_rotary, n_head=n_head)


def _falcon_transforms(spec: ModelSpec, name: str) -> Transform | None:
    # Falcon keeps rotate-half (ggml's NeoX rope), so only the fused QKV is regrouped.
    if _part(name) == Tensor.ATTN_QKV:
        return partial(jploski_qkv, n_head=spec.heads, n_head_kv=spec.kv_heads)
    return None


# --- metadata ---------------------------------------------------------------------------------------------------


def _rope_freq(writer: GGUFWriter, spec: ModelSpec) -> None:
    if spec.rope_theta is not None:
        writer.add_rope_freq_base(spec.rope_theta)


def _llama_metadata(writer: GGUFWriter, spec: ModelSpec) -> None:
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    _rope_freq(writer, spec)


def _falcon_metadata(writer: GGUFWriter, spec: ModelSpec) -> None:
    # As llama.cpp's falcon converter: the QKV layout tag instead of a rope dimension, LayerNorm epsilon.
    writer.add_tensor_data_layout("jploski")
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_eps(spec.norm_eps)
    _rope_freq(writer, spec)


def _opt_metadata(writer: GGUFWriter, spec: ModelSpec) -> None:
    # The engine's OPT converter writes the head count only: no kv heads, epsilon or rope keys.
    writer.add_head_count(spec.heads)


_LLAMA_HF = HfModules(
    "LlamaForCausalLM", "model.layers", "post_attention_layernorm", "mlp.up_proj", "mlp.gate_proj", llama_config=True
)
_LLAMA_COMMON: dict[str, Any] = dict(
    norm="rms",
    rope="pairs",
    block_tensors=_llama_block,
    global_tensors=_llama_globals,
    hf_names=partial(_gguf_name_map, MODEL_ARCH.LLAMA),
    add_metadata=_llama_metadata,
    norm_eps_key=Key.LAYERNORM_RMS_EPS,
    block="llama",
    transforms=_llama_transforms,
)

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            name="llama",
            hf_classes=("LlamaForCausalLM",),
            ffn=FfnForm(gated=True, relu_up=False),
            hf=_LLAMA_HF,
            read_config=partial(_llama_config, "llama"),
            **_LLAMA_COMMON,
        ),
        # Mistral-shaped with LLaMA's tensor names and relu on gate and up.
        Architecture(
            name="bamboo",
            hf_classes=("BambooForCausalLM",),
            ffn=FfnForm(gated=True, relu_up=True),
            hf=replace(_LLAMA_HF, relu_up_hook=True),
            read_config=partial(_llama_config, "bamboo"),
            **_LLAMA_COMMON,
        ),
        # ReluFalcon-40B: Falcon-40B's new decoder (fused QKV, grouped kv heads, two LayerNorms feeding attention
        # and FFN in parallel) with relu as the MLP activation.
        Architecture(
            name="falcon",
            hf_classes=("FalconForCausalLM",),
            ffn=FfnForm(gated=False, relu_up=True),
            norm="layer",
            rope="neox",
            hf=HfModules("FalconForCausalLM", "transformer.h", "ln_mlp", "mlp.dense_h_to_4h"),
            read_config=_falcon_config,
            block_tensors=_falcon_block,
            global_tensors=_falcon_globals,
            hf_names=partial(_gguf_name_map, MODEL_ARCH.FALCON),
            add_metadata=_falcon_metadata,
            norm_eps_key=Key.LAYERNORM_EPS,
            block="falcon",
            transforms=_falcon_transforms,
        ),
        Architecture(
            name="opt",
            hf_classes=("OPTForCausalLM",),
            ffn=FfnForm(gated=False, relu_up=True, biased=True),
            norm="layer",
            rope="none",
            hf=HfModules("OPTForCausalLM", "model.decoder.layers", "final_layer_norm", "fc1"),
            read_config=_opt_config,
            block_tensors=_opt_block,
            global_tensors=_opt_globals,
            hf_names=_opt_name_map,
            add_metadata=_opt_metadata,
            norm_eps_key=None,
            block="opt",
            position_offset=OPT_POSITION_OFFSET,
            output_is_embedding=True,
        ),
    )
}


def architecture(name: object, where: object = "the model file") -> Architecture:
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise UserError(f"{where}: architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def architecture_for_hf(classes: list[str], path: Path) -> Architecture:
    for arch in ARCHITECTURES.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    supported = ", ".join(c for arch in ARCHITECTURES.values() for c in arch.hf_classes)
    raise UserError(f"unsupported architecture {classes!r} in {path}; supported: {supported}")
