"""Model hyper-parameters from a Hugging Face `config.json`, for the architectures we convert."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qinfer_core.errors import UserError

# HF class name -> GGUF architecture. Bamboo is Mistral-shaped with LLaMA's tensor names and relu on gate and up.
# ReluFalcon is Falcon-40B's new decoder architecture (fused QKV, grouped kv heads, two LayerNorms per block)
# with relu as the MLP activation.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "BambooForCausalLM": "bamboo",
    "FalconForCausalLM": "falcon",
}


@dataclass(frozen=True)
class ModelParams:
    arch: str
    name: str
    vocab_size: int
    context_length: int
    embedding_length: int
    block_count: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    rms_norm_eps: float  # the norms' epsilon: RMSNorm for llama and bamboo, LayerNorm for falcon
    rope_theta: float | None
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @property
    def kv_length(self) -> int:
        return self.head_dim * self.head_count_kv


def _rope_theta(cfg: dict) -> float | None:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top level.
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    return None if theta is None else float(theta)


def read_hf_config(model_dir: Path) -> ModelParams:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {model_dir}: pass a Hugging Face model directory")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from exc
    names = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(ARCHITECTURES)
        raise UserError(
            f"unsupported architecture {names or cfg.get('model_type')!r} in {path}; supported: {supported}"
        )
    if arch == "falcon":
        return _falcon_params(cfg, model_dir, path)
    if cfg.get("hidden_act", "relu") != "relu":
        raise UserError(f"{path} has hidden_act={cfg['hidden_act']!r}; only ReLU models (hidden_act=relu) are sparse")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UserError(f"{path} sets {flag}; the GGUF layout of this family has no biases")
    rope_type = (cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UserError(f"{path} uses rope scaling {rope_type!r}, which this converter does not support")
    try:
        heads = int(cfg["num_attention_heads"])
        if cfg.get("head_dim") not in (None, int(cfg["hidden_size"]) // heads):
            raise UserError(f"{path}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads")
        return ModelParams(
            arch=arch,
            name=model_dir.resolve().name,
            vocab_size=int(cfg["vocab_size"]),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            embedding_length=int(cfg["hidden_size"]),
            block_count=int(cfg["num_hidden_layers"]),
            feed_forward_length=int(cfg["intermediate_size"]),
            head_count=heads,
            head_count_kv=int(cfg.get("num_key_value_heads") or heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise UserError(f"{path} lacks the key {exc.args[0]!r}") from exc


def _falcon_params(cfg: dict, model_dir: Path, path: Path) -> ModelParams:
    """Falcon's own config keys; only the layout ReluFalcon-40B has (what llama.cpp's falcon graph runs)."""
    if cfg.get("activation", "gelu") != "relu":
        raise UserError(f"{path} has activation={cfg.get('activation', 'gelu')!r}; only ReLU Falcon models are sparse")
    required = {"new_decoder_architecture": True, "parallel_attn": True, "bias": False, "alibi": False}
    for flag, want in required.items():
        if bool(cfg.get(flag, not want)) != want:
            raise UserError(f"{path}: {flag}={cfg.get(flag)!r} is not supported; only Falcon-40B's layout is")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return ModelParams(
            arch="falcon",
            name=model_dir.resolve().name,
            vocab_size=int(cfg["vocab_size"]),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            embedding_length=hidden,
            block_count=int(cfg["num_hidden_layers"]),
            feed_forward_length=int(cfg.get("ffn_hidden_size") or 4 * hidden),
            head_count=heads,
            head_count_kv=int(cfg.get("num_kv_heads") or heads),
            rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            rope_theta=_rope_theta(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
    except KeyError as exc:
        raise UserError(f"{path} lacks the key {exc.args[0]!r}") from exc
