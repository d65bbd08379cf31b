"""A `ModelSpec` from a Hugging Face `config.json` or from GGUF metadata: the two places a model's shape is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qinfer.core.architectures import CONFIG_FIX, architecture, architecture_for_hf
from qinfer.core.errors import UserError
from qinfer.core.json_object import read_json_object
from qinfer.core.model_spec import NORM_EPS, ROPE_BASE, Experts, ModelSpec
from qinfer.core.names import Key, arch_key
from qinfer.core.numbers import real, whole


def spec_from_hf_dir(model_dir: Path) -> ModelSpec:
    """The spec of the checkpoint in `model_dir`, for the families of qinfer.core.architectures."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {model_dir}: pass a Hugging Face model directory")
    cfg = read_json_object(path, CONFIG_FIX)
    arch = architecture_for_hf(cfg.get("architectures") or [cfg.get("model_type")], path)
    try:
        spec = arch.read_config(cfg, path)
    except KeyError as exc:
        raise UserError(f"{path} lacks the key {exc.args[0]!r}") from exc
    _check_shape(spec, path, CONFIG_FIX)
    return spec


_CORRUPT = "the file is corrupt, re-convert it"


def _count(value: Any, key: str, path: Path) -> int:
    return whole(value, key, path, _CORRUPT)


def _check_shape(spec: ModelSpec, path: Path, fix: str) -> None:
    if (spec.head_size is None and spec.hidden % spec.heads) or spec.heads % spec.kv_heads:
        raise UserError(
            f"{path}: {spec.hidden} embedding dimensions, {spec.heads} heads and {spec.kv_heads} kv heads do not "
            f"divide evenly; {fix}"
        )
    if spec.rope_dim and (spec.rope_dim > spec.head_dim or spec.rope_dim % 2):
        raise UserError(f"{path}: rope dimension {spec.rope_dim} does not fit heads of {spec.head_dim}; {fix}")


def _refuse_rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> None:
    """llama.cpp scales a file's rope by its rope.scaling.factor (or the older rope.scale_linear) unless its type is
    none; this engine would not, and so would read every position wrong without a sign. Llama-3.1's scaling is no
    such key but the rope_freqs tensor, which it applies."""
    if meta.get(arch_key(Key.ROPE_SCALING_TYPE, arch)) == "none":
        return
    keys = [arch_key(template, arch) for template in (Key.ROPE_SCALING_FACTOR, Key.ROPE_SCALE_LINEAR)]
    key = next((k for k in keys if meta.get(k) is not None), None)  # llama.cpp: scaling.factor wins
    if key is None or meta[key] in (0.0, 1.0):  # llama.cpp reads 0 as no scaling
        return
    kind = meta.get(arch_key(Key.ROPE_SCALING_TYPE, arch), "linear")
    raise UserError(
        f"{path}: {key} is {meta[key]:g}, asking for {kind} rope scaling, which qinfer does not apply; only "
        "unscaled rope and Llama-3.1's rope_freqs run"
    )


def _head_size(meta: dict[str, Any], arch: str, even: int, experts: bool, path: Path) -> int | None:
    """A head's dimensions where the file gives them other than embedding_length / head_count (key_length, and
    value_length the same, as llama.cpp writes them for Qwen3); None where it does not."""
    keys = [arch_key(template, arch) for template in (Key.KEY_LENGTH, Key.VALUE_LENGTH)]
    sizes = {_count(meta[key], key, path) for key in keys if key in meta}
    if not sizes or sizes == {even}:
        return None
    if len(sizes) > 1:
        raise UserError(f"{path}: keys and values of different sizes ({', '.join(keys)}) do not run; use another model")
    if not experts:
        raise UserError(
            f"{path}: heads of {sizes.pop()} dimensions, not embedding_length / head_count, run only in models with "
            "experts yet; use another model"
        )
    return sizes.pop()


def spec_from_metadata(meta: dict[str, Any], path: Path, row_layout: bool) -> ModelSpec:
    """The spec a GGUF's metadata declares, every value checked for its type and range; the vocabulary size is the
    token list's length (0 when absent). `row_layout`: a PowerInfer file (PWRI magic), whose unstated activation is
    PowerInfer's (Architecture.unstated_activation)."""
    arch = architecture(meta.get(Key.ARCHITECTURE), path)
    _refuse_rope_scaling(meta, arch.name, path)

    def key(template: str, default: Any = None) -> Any:
        name = arch_key(template, arch.name)
        value = meta.get(name, default)
        if value is None:
            raise UserError(f"{path} lacks the metadata key {name}; re-convert it")
        return value

    def count(template: str, default: Any = None) -> int:
        return _count(key(template, default), arch_key(template, arch.name), path)

    experts, shared = None, arch_key(Key.EXPERT_SHARED_FEED_FORWARD_LENGTH, arch.name)
    if arch.experts == "always" or meta.get(arch_key(Key.EXPERT_COUNT, arch.name)):
        if arch.experts == "never":
            raise UserError(f"{path}: a {arch.name} model has no experts; re-convert it")
        experts = Experts(
            count(Key.EXPERT_COUNT),
            count(Key.EXPERT_USED_COUNT),
            count(Key.EXPERT_FEED_FORWARD_LENGTH, meta.get(arch_key(Key.FEED_FORWARD_LENGTH, arch.name))),
            count(Key.EXPERT_SHARED_FEED_FORWARD_LENGTH) if shared in meta else 0,
            bool(key(Key.EXPERT_WEIGHTS_NORM, arch.norm_top_k)),
        )
        if not 1 <= experts.used <= experts.count:
            raise UserError(f"{path}: {experts.used} of {experts.count} experts per token; {_CORRUPT}")

    heads = count(Key.HEAD_COUNT)
    hidden = count(Key.EMBEDDING_LENGTH)
    head_size = _head_size(meta, arch.name, hidden // heads, experts is not None, path)
    tokens = meta.get(Key.TOKENS)
    theta_key = arch_key(Key.ROPE_FREQ_BASE, arch.name)
    theta = meta.get(theta_key)
    window = meta.get(arch_key(Key.SLIDING_WINDOW, arch.name))
    eps = arch.default_norm_eps
    if arch.norm_eps_key is not None:
        eps = real(key(arch.norm_eps_key), arch_key(arch.norm_eps_key, arch.name), path, NORM_EPS, _CORRUPT)
    spec = ModelSpec(
        arch=arch.name,
        name=str(meta.get(Key.NAME, path.stem)),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
        context_length=count(Key.CONTEXT_LENGTH) - arch.position_offset,
        hidden=hidden,
        layers=count(Key.BLOCK_COUNT),
        ffn=count(Key.FEED_FORWARD_LENGTH),
        heads=heads,
        kv_heads=count(Key.HEAD_COUNT_KV, heads),
        norm_eps=eps,
        rope_dim=0
        if arch.rope == "none"
        else count(Key.ROPE_DIMENSION_COUNT, head_size or arch.default_rope_dim(hidden, heads)),
        rope_theta=None
        if theta is None
        else real(theta, arch_key(Key.ROPE_FREQ_BASE, arch.name), path, ROPE_BASE, _CORRUPT),
        tie_word_embeddings=arch.output_is_embedding,
        activation=arch.file_activation(meta.get(Key.FFN_ACTIVATION), row_layout, path),
        sliding_window=None if window is None else _count(window, arch_key(Key.SLIDING_WINDOW, arch.name), path),
        experts=experts,
        head_size=head_size,
    )
    if spec.context_length <= 0:
        raise UserError(f"{path}: the context length leaves no position; {_CORRUPT}")
    _check_shape(spec, path, _CORRUPT)
    return spec
