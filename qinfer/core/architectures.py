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
from qinfer.core.model_spec import NORM_EPS, ROPE_BASE, Experts, ModelSpec, RopeScaling
from qinfer.core.names import BIAS, WEIGHT, Key, Tensor, tensor_name
from qinfer.core.numbers import Span, real, whole

if TYPE_CHECKING:
    # Only for annotations: the table is read by commands that never touch a tensor, and torch is slow to import.
    import torch

OPT_POSITION_OFFSET = 2  # HF's OPTLearnedPositionalEmbedding reads row position + 2; the engine adds 2 too
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT uses and Falcon's configs default to

Shapes = dict[str, tuple[int, ...]]  # tensor name -> numpy shape (ggml's ne reversed), in file order
Transform = Callable[["torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class FfnForm:
    """What one neuron computes: act(gate) * up (gated), act(gate) * relu(up) (dReLU), or relu(up) alone, each row
    of down_t scaled by it; act is relu or silu (SwiGLU); `biased`: up and down carry biases (OPT).

    A neuron fires for a token where |act(gate)| exceeds its layer's gate threshold: 0 for ReLU (relu(gate) > 0),
    a calibrated one for a SwiGLU model made sparse (docs/formats.md#gate-thresholds)."""

    gated: bool
    relu_up: bool
    biased: bool = False
    act: Literal["relu", "silu"] = "relu"

    @property
    def matrices(self) -> int:
        """FFN matrices with one row per neuron."""
        return 3 if self.gated else 2


# The activations a gated family's file may declare (Key.FFN_ACTIVATION), by name: relu(gate) * up (ReluLLaMA),
# relu(gate) * relu(up) (dReLU: Bamboo, TurboSparse), silu(gate) * up (SwiGLU: Llama-3, Mistral, Qwen2).
ACTIVATIONS: dict[str, FfnForm] = {
    "relu": FfnForm(gated=True, relu_up=False),
    "drelu": FfnForm(gated=True, relu_up=True),
    "silu": FfnForm(gated=True, relu_up=False, act="silu"),
}


@dataclass(frozen=True)
class HfModules:
    """Where the profiler and the predictor trainer hook a transformers model; paths are attribute paths."""

    model_class: str  # the transformers class that loads the checkpoint
    layers: str  # the decoder layers, from the model
    ffn_norm: str  # the norm before the FFN, from a layer; its input is the predictor's input
    up: str  # from a layer
    gate: str | None = None
    llama_config: bool = False  # config.json is read as a LlamaConfig (Bamboo's model_type is unknown to transformers)
    # A model with experts: the router, from a layer, a module with `weight` [N, E] whose input is what it routes.
    router: str | None = None


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
    # A file's FFN activation where it does not say (Key.FFN_ACTIVATION), (for a PowerInfer file, for a dense one):
    # PowerInfer's llama files are ReLU, llama.cpp's are SwiGLU. None: the family has one form, `ffn`.
    unstated_activation: tuple[str, str] | None = None
    qkv_bias: bool = False  # q, k and v carry biases (Qwen2)
    qk_norm: bool = False  # q and k pass an RMSNorm over each head before rope (Qwen3)
    # Whether the FFN is a mixture of experts: never, where config.json or the file says so (llama: Mixtral), or
    # always; and whether the chosen experts' weights are rescaled to sum to 1 where the file does not say
    # (Key.EXPERT_WEIGHTS_NORM), as llama.cpp's graph for the family does.
    experts: Literal["never", "optional", "always"] = "never"
    norm_top_k: bool = True
    # A file may leave output.weight out for a tied head, as llama.cpp writes tied models; the head then reads
    # token_embd.
    output_optional: bool = False
    default_norm_eps: float = LAYER_NORM_EPS
    position_offset: int = 0  # rows of a learned position table before position 0 (OPT: 2)
    output_is_embedding: bool = False  # the head multiplies by token_embd: the file has no output tensor (OPT)
    transforms: Callable[[ModelSpec, str], Transform | None] = lambda _spec, _name: None

    def default_rope_dim(self, hidden: int, heads: int) -> int:
        """Rotated dimensions per head where the file does not say: whole heads, or none without rope."""
        return 0 if self.rope == "none" else hidden // heads

    def form(self, activation: str | None) -> FfnForm:
        """The FFN form of a model of this family with `activation` (None: the family's own)."""
        if activation is None or self.unstated_activation is None:
            if activation not in (None, "relu"):
                raise UserError(f"a {self.name} model's FFN is relu(up), not {activation!r}")
            return self.ffn
        if activation not in ACTIVATIONS:
            raise UserError(f"FFN activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[activation]

    def stated_activation(self, activation: str | None, row_layout: bool) -> str | None:
        """What a file of this layout must say of its activation (Key.FFN_ACTIVATION): None where the unstated
        reading is already right, so PowerInfer's and llama.cpp's own files are written as they write them."""
        if self.unstated_activation is None or activation is None:
            return None
        return None if activation == self.unstated_activation[0 if row_layout else 1] else activation

    def file_activation(self, stated: object, row_layout: bool, where: object) -> str | None:
        """The activation of a file of this family that states `stated` (None: nothing), checked."""
        if stated is None:
            return None if self.unstated_activation is None else self.unstated_activation[0 if row_layout else 1]
        if not isinstance(stated, str) or stated not in ACTIVATIONS:
            raise UserError(f"{where}: FFN activation {stated!r} is not one of {', '.join(ACTIVATIONS)}; re-convert it")
        self.form(stated)
        return stated

    def tensors(self, spec: ModelSpec, predictor_ranks: list[int] | None, row_layout: bool = False) -> Shapes:
        """Every tensor of a converted file in file order: a PowerInfer GGUF when `predictor_ranks` (P per layer)
        is given, else a dense GGUF; `row_layout` writes down as neuron rows (ffn_down_t) without predictors too (a
        calibrated SwiGLU model)."""
        shapes = self.global_tensors(spec)
        if spec.rope_scaling is not None:
            shapes[tensor_name(Tensor.ROPE_FREQS)] = (spec.rope_dim // 2,)
        e, f = spec.hidden, spec.ffn
        rows = row_layout or predictor_ranks is not None
        for i in range(spec.layers):
            shapes |= self.block_tensors(spec, i)
            if self.qkv_bias:
                for part, size in (
                    (Tensor.ATTN_Q, spec.q_dim),
                    (Tensor.ATTN_K, spec.kv_dim),
                    (Tensor.ATTN_V, spec.kv_dim),
                ):
                    shapes[tensor_name(part, i, BIAS)] = (size,)
            if self.qk_norm:
                shapes[tensor_name(Tensor.ATTN_Q_NORM, i)] = (spec.head_dim,)
                shapes[tensor_name(Tensor.ATTN_K_NORM, i)] = (spec.head_dim,)
            if spec.experts is not None:
                shapes |= expert_tensors(spec.experts, e, i)
                continue
            if self.ffn.gated:
                shapes[tensor_name(Tensor.FFN_GATE, i)] = (f, e)
            shapes[tensor_name(Tensor.FFN_UP, i)] = (f, e)
            if self.ffn.biased:
                shapes[tensor_name(Tensor.FFN_UP, i, BIAS)] = (f,)
            down = Tensor.FFN_DOWN_T if rows else Tensor.FFN_DOWN
            shapes[tensor_name(down, i)] = (f, e) if rows else (e, f)
            if self.ffn.biased:
                shapes[tensor_name(down, i, BIAS)] = (e,)
            if predictor_ranks is not None:
                rank = predictor_ranks[i]
                shapes[tensor_name(Tensor.FC1, i)] = (rank, e)
                shapes[tensor_name(Tensor.FC2, i)] = (f, rank)
        return shapes


def expert_tensors(experts: Experts, hidden: int, i: int) -> Shapes:
    """Layer i's router and experts, each kind of expert matrix stacked into one [N, rows, columns] tensor, as
    llama.cpp lays them out (down as [N, E, F], like a dense file's down)."""
    n, e, f = experts.count, hidden, experts.ffn
    shapes = {
        tensor_name(Tensor.FFN_GATE_INP, i): (n, e),
        tensor_name(Tensor.FFN_GATE_EXPS, i): (n, f, e),
        tensor_name(Tensor.FFN_UP_EXPS, i): (n, f, e),
        tensor_name(Tensor.FFN_DOWN_EXPS, i): (n, e, f),
    }
    if experts.shared_ffn:
        s = experts.shared_ffn
        shapes |= {
            tensor_name(Tensor.FFN_GATE_INP_SHEXP, i): (1, e),
            tensor_name(Tensor.FFN_GATE_SHEXP, i): (s, e),
            tensor_name(Tensor.FFN_UP_SHEXP, i): (s, e),
            tensor_name(Tensor.FFN_DOWN_SHEXP, i): (e, s),
        }
    return shapes


# --- reading config.json ----------------------------------------------------------------------------------------


CONFIG_FIX = "fix config.json"


def _count(cfg: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    """Whole number `key` of config.json; absent or null: `default`, and without one a KeyError that
    spec_from_hf_dir reports as the missing key."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    return whole(value, key, path, CONFIG_FIX)


def _number(cfg: dict[str, Any], key: str, path: Path, span: Span, default: float) -> float:
    value = cfg.get(key)
    return default if value is None else real(value, key, path, span, CONFIG_FIX)


def _rope_settings(cfg: dict[str, Any], section: str, path: Path) -> dict[str, Any]:
    settings = cfg.get(section) or {}
    if not isinstance(settings, dict):
        raise UserError(f"{path}: {section} is {settings!r}, not an object; {CONFIG_FIX}")
    return settings


def _rope_theta(cfg: dict[str, Any], path: Path) -> float | None:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top level.
    key, theta = "rope_theta", cfg.get("rope_theta")
    if key not in cfg:
        key, theta = "rope_parameters.rope_theta", _rope_settings(cfg, "rope_parameters", path).get(key)
    return None if theta is None else real(theta, key, path, ROPE_BASE, CONFIG_FIX)


# config.json's hidden_act -> the FFN activation it means; "drelu" declares ReLU on gate and up (dReLU) for a
# LLaMA- or Mistral-shaped checkpoint, whose transformers class has no such option.
_HIDDEN_ACTS = {"relu": "relu", "silu": "silu", "swish": "silu", "drelu": "drelu"}
# What "llama3" scaling may slow the long wavelengths by (transformers: at least 1; Llama-3.1 takes 8, 3.2 32), and
# the bounds of the band it blends across, which it divides by.
_LLAMA3_FACTOR = Span(1.0, 1e6)
_LLAMA3_BAND = Span(0.0, 1e6, low_open=True)


def _rope_scaling(cfg: dict[str, Any], path: Path) -> RopeScaling | None:
    # transformers 5 folds rope_scaling into rope_parameters, which then always names a type.
    section = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    scaling = _rope_settings(cfg, section, path)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UserError(f"{path} uses rope scaling {kind!r}; only Llama-3.1's 'llama3' scaling is supported")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f"{section}.{field}" for field in fields if field not in scaling]
    if missing:
        raise UserError(f"{path}: llama3 rope scaling lacks {', '.join(missing)}; {CONFIG_FIX}")
    low, high = (real(scaling[f], f"{section}.{f}", path, _LLAMA3_BAND, CONFIG_FIX) for f in fields[1:3])
    if low >= high:
        raise UserError(
            f"{path}: {section}.low_freq_factor {low:g} is not below high_freq_factor {high:g}, so the band "
            f"llama3 scaling blends across is empty; {CONFIG_FIX}"
        )
    return RopeScaling(
        real(scaling["factor"], f"{section}.factor", path, _LLAMA3_FACTOR, CONFIG_FIX),
        low,
        high,
        whole(scaling[fields[3]], f"{section}.{fields[3]}", path, CONFIG_FIX),
    )


QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's default: layers from this one on slide their window


def _sliding_window(cfg: dict[str, Any], context: int, path: Path) -> int | None:
    """Mistral's window (every layer), or Qwen2's where it turns it on for every layer; honoured by every stage.
    A window as long as the context changes nothing."""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg:
        # Qwen2 slides layer i's window where use_sliding_window and i >= max_window_layers.
        first = whole(cfg.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS), "max_window_layers", path, CONFIG_FIX, 0)
        if not cfg["use_sliding_window"] or first >= _count(cfg, "num_hidden_layers", path):
            return None
        if first > 0:
            raise UserError(f"{path}: a sliding window on only some layers (max_window_layers) is not supported")
    if window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= context):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(f"{path}: sliding_window {window!r} is not a positive number of tokens")
    return window


def _experts(cfg: dict[str, Any], path: Path, norm_default: bool) -> Experts | None:
    """The experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config (None: a dense FFN); `norm_default`: whether its
    transformers class rescales the top-k weights where the config has no norm_topk_prob."""
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"  # Mixtral's name, Qwen's
    if not cfg.get(key):
        return None
    count = _count(cfg, key, path)
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise UserError(
            f"{path}: dense FFNs between the expert layers (mlp_only_layers, decoder_sparse_step) are not supported "
            "yet; use a model with experts in every layer"
        )
    used = _count(cfg, "num_experts_per_tok", path)
    if not 1 <= used <= count:
        raise UserError(f"{path}: num_experts_per_tok {used} is not between 1 and the {count} experts; {CONFIG_FIX}")
    return Experts(
        count=count,
        used=used,
        ffn=_count(cfg, "moe_intermediate_size", path, _count(cfg, "intermediate_size", path)),
        shared_ffn=_count(cfg, "shared_expert_intermediate_size", path, 0),
        norm_top_k=bool(cfg.get("norm_topk_prob", norm_default)),
    )


def _gated_config(arch: str, cfg: dict[str, Any], path: Path) -> ModelSpec:
    """LLaMA-shaped configs: ReluLLaMA, Bamboo, Llama-3, Mistral, Qwen2 (whose q/k/v carry biases), and with
    experts Mixtral, Qwen2-MoE and Qwen3-MoE (a family that always has them rescales the top-k weights, in
    transformers, only where the config says so)."""
    family = architecture(arch)
    qkv_bias, experts = family.qkv_bias, family.experts == "always"
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in _HIDDEN_ACTS:
        raise UserError(f"{path} has hidden_act={act!r}; supported: {', '.join(_HIDDEN_ACTS)}")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag) and not (flag == "attention_bias" and qkv_bias):
            raise UserError(f"{path} sets {flag}; the GGUF layout of this family has no such biases")
    heads = _count(cfg, "num_attention_heads", path)
    hidden = _count(cfg, "hidden_size", path)
    head_dim = _count(cfg, "head_dim", path, hidden // heads)
    # Only the torch path reads heads of their own size: the native step and the planner take hidden / heads, and
    # the families with experts use neither yet.
    if head_dim != hidden // heads and not experts:
        raise UserError(
            f"{path}: head_dim {head_dim} is not hidden_size / num_attention_heads, which only models with experts "
            "run yet; use another model"
        )
    context = _count(cfg, "max_position_embeddings", path, 2048)
    return ModelSpec(
        arch=arch,
        name=path.parent.resolve().name,
        vocab_size=_count(cfg, "vocab_size", path),
        context_length=context,
        hidden=hidden,
        layers=_count(cfg, "num_hidden_layers", path),
        ffn=_count(cfg, "intermediate_size", path),
        heads=heads,
        kv_heads=_count(cfg, "num_key_value_heads", path, heads),
        norm_eps=_number(cfg, "rms_norm_eps", path, NORM_EPS, 1e-6),
        rope_dim=head_dim,
        rope_theta=_rope_theta(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        activation=_HIDDEN_ACTS[act] if arch != "bamboo" else "drelu",
        sliding_window=_sliding_window(cfg, context, path),
        rope_scaling=_rope_scaling(cfg, path),
        experts=_moe(cfg, path, experts),
        head_size=None if head_dim == hidden // heads else head_dim,
    )


def _moe(cfg: dict[str, Any], path: Path, always: bool) -> Experts | None:
    found = _experts(cfg, path, norm_default=not always)  # Mixtral's class always rescales, and has no flag
    if always and found is None:
        raise UserError(f"{path} has no num_experts; {CONFIG_FIX}")
    return found


def _falcon_config(cfg: dict[str, Any], path: Path) -> ModelSpec:
    """Falcon's own config keys; only the layout ReluFalcon-40B has (what llama.cpp's falcon graph runs)."""
    if cfg.get("activation", "gelu") != "relu":
        raise UserError(f"{path} has activation={cfg.get('activation', 'gelu')!r}; only ReLU Falcon models are sparse")
    required = {"new_decoder_architecture": True, "parallel_attn": True, "bias": False, "alibi": False}
    for flag, want in required.items():
        if bool(cfg.get(flag, not want)) != want:
            raise UserError(f"{path}: {flag}={cfg.get(flag)!r} is not supported; only Falcon-40B's layout is")
    hidden, heads = _count(cfg, "hidden_size", path), _count(cfg, "num_attention_heads", path)
    return ModelSpec(
        arch="falcon",
        name=path.parent.resolve().name,
        vocab_size=_count(cfg, "vocab_size", path),
        context_length=_count(cfg, "max_position_embeddings", path, 2048),
        hidden=hidden,
        layers=_count(cfg, "num_hidden_layers", path),
        ffn=_count(cfg, "ffn_hidden_size", path, 4 * hidden),
        heads=heads,
        kv_heads=_count(cfg, "num_kv_heads", path, heads),
        norm_eps=_number(cfg, "layer_norm_epsilon", path, NORM_EPS, LAYER_NORM_EPS),
        rope_dim=hidden // heads,
        rope_theta=_rope_theta(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _opt_config(cfg: dict[str, Any], path: Path) -> ModelSpec:
    """OPT as the engine runs it: pre-LayerNorm blocks, biases everywhere, learned positions, output tied to the
    token embedding."""
    if cfg.get("activation_function", "relu") != "relu":
        raise UserError(
            f"{path} has activation_function={cfg['activation_function']!r}; only ReLU OPT models are sparse"
        )
    hidden = _count(cfg, "hidden_size", path)
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
    heads = _count(cfg, "num_attention_heads", path)
    return ModelSpec(
        arch="opt",
        name=path.parent.resolve().name,
        vocab_size=_count(cfg, "vocab_size", path),
        context_length=_count(cfg, "max_position_embeddings", path, 2048),
        hidden=hidden,
        layers=_count(cfg, "num_hidden_layers", path),
        ffn=_count(cfg, "ffn_dim", path),
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
    e, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
    return {
        tensor_name(Tensor.ATTN_NORM, i): (e,),
        tensor_name(Tensor.ATTN_Q, i): (q, e),
        tensor_name(Tensor.ATTN_K, i): (kv, e),
        tensor_name(Tensor.ATTN_V, i): (kv, e),
        tensor_name(Tensor.ATTN_OUT, i): (e, q),
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


_EXPERT = re.compile(r"(.+\.experts)\.(\d+)(\..+)")


def expert_source(hf_name: str) -> tuple[str, int] | None:
    """A checkpoint's tensor of one expert (`...experts.3.w1.weight`) as the name of its stack, which the name
    tables know (`...experts.w1.weight`), and its place in the stack; None for any other tensor."""
    match = _EXPERT.fullmatch(hf_name)
    return None if match is None else (match.group(1) + match.group(3), int(match.group(2)))


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
    if spec.head_size is not None:
        writer.add_key_length(spec.head_size)
        writer.add_value_length(spec.head_size)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    _rope_freq(writer, spec)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    if spec.experts is not None:
        _expert_metadata(writer, spec.experts)


def _expert_metadata(writer: GGUFWriter, experts: Experts) -> None:
    writer.add_expert_count(experts.count)
    writer.add_expert_used_count(experts.used)
    writer.add_expert_feed_forward_length(experts.ffn)
    if experts.shared_ffn:
        writer.add_expert_shared_feed_forward_length(experts.shared_ffn)
    writer.add_expert_weights_norm(experts.norm_top_k)


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


# transformers 5 names the router of Mixtral, Qwen2-MoE and Qwen3-MoE alike (MixtralTopKRouter and its Qwen kin).
_MOE_ROUTER = "mlp.gate"
_LLAMA_HF = HfModules(
    "LlamaForCausalLM", "model.layers", "post_attention_layernorm", "mlp.up_proj", "mlp.gate_proj", llama_config=True
)
_GATED_COMMON: dict[str, Any] = dict(
    norm="rms",
    block_tensors=_llama_block,
    global_tensors=_llama_globals,
    add_metadata=_llama_metadata,
    norm_eps_key=Key.LAYERNORM_RMS_EPS,
    block="llama",
    output_optional=True,
)
_LLAMA_COMMON: dict[str, Any] = dict(
    rope="pairs", hf_names=partial(_gguf_name_map, MODEL_ARCH.LLAMA), transforms=_llama_transforms, **_GATED_COMMON
)

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        # ReluLLaMA and ProSparse (relu), Llama-3 and Mistral (SwiGLU; llama.cpp writes both as llama), and dReLU
        # models of their shape: one tensor layout, told apart by the activation.
        # Mixtral too: llama.cpp writes it as llama with experts.
        Architecture(
            name="llama",
            hf_classes=("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
            ffn=ACTIVATIONS["relu"],
            hf=replace(_LLAMA_HF, router=_MOE_ROUTER),
            read_config=partial(_gated_config, "llama"),
            unstated_activation=("relu", "silu"),
            experts="optional",
            **_LLAMA_COMMON,
        ),
        # Mistral-shaped with LLaMA's tensor names and relu on gate and up.
        Architecture(
            name="bamboo",
            hf_classes=("BambooForCausalLM",),
            ffn=ACTIVATIONS["drelu"],
            hf=_LLAMA_HF,
            read_config=partial(_gated_config, "bamboo"),
            unstated_activation=("drelu", "drelu"),
            **_LLAMA_COMMON,
        ),
        # Qwen2: LLaMA's block with biases on q, k and v, and rotate-half rope (q/k rows as Hugging Face has them).
        Architecture(
            name="qwen2",
            hf_classes=("Qwen2ForCausalLM",),
            ffn=ACTIVATIONS["silu"],
            rope="neox",
            hf=HfModules(
                "Qwen2ForCausalLM", "model.layers", "post_attention_layernorm", "mlp.up_proj", "mlp.gate_proj"
            ),
            read_config=partial(_gated_config, "qwen2"),
            hf_names=partial(_gguf_name_map, MODEL_ARCH.QWEN2),
            unstated_activation=("silu", "silu"),
            qkv_bias=True,
            **_GATED_COMMON,
        ),
        # Qwen2-MoE: Qwen2's attention, and experts beside a shared expert; llama.cpp uses the softmax's top-k
        # weights as they are.
        Architecture(
            name="qwen2moe",
            hf_classes=("Qwen2MoeForCausalLM",),
            ffn=ACTIVATIONS["silu"],
            rope="neox",
            # No dense FFN, so up is never hooked: the router stands in for it.
            hf=HfModules(
                "Qwen2MoeForCausalLM", "model.layers", "post_attention_layernorm", _MOE_ROUTER, router=_MOE_ROUTER
            ),
            read_config=partial(_gated_config, "qwen2moe"),
            hf_names=partial(_gguf_name_map, MODEL_ARCH.QWEN2MOE),
            unstated_activation=("silu", "silu"),
            qkv_bias=True,
            experts="always",
            norm_top_k=False,
            **_GATED_COMMON,
        ),
        # Qwen3-MoE: no biases but q/k norms, and experts whose top-k weights llama.cpp rescales.
        Architecture(
            name="qwen3moe",
            hf_classes=("Qwen3MoeForCausalLM",),
            ffn=ACTIVATIONS["silu"],
            rope="neox",
            hf=HfModules(
                "Qwen3MoeForCausalLM", "model.layers", "post_attention_layernorm", _MOE_ROUTER, router=_MOE_ROUTER
            ),
            read_config=partial(_gated_config, "qwen3moe"),
            hf_names=partial(_gguf_name_map, MODEL_ARCH.QWEN3MOE),
            unstated_activation=("silu", "silu"),
            qk_norm=True,
            experts="always",
            **_GATED_COMMON,
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
        raise unsupported_architecture(name, where)
    return ARCHITECTURES[name]


def unsupported_architecture(name: object, where: object) -> UserError:
    return UserError(f"{where}: architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def architecture_for_hf(classes: list[str], path: Path) -> Architecture:
    for arch in ARCHITECTURES.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    supported = ", ".join(c for arch in ARCHITECTURES.values() for c in arch.hf_classes)
    raise UserError(f"unsupported architecture {classes!r} in {path}; supported: {supported}")
