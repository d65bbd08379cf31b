"""Sparse FFN: oracle selection reproduces the dense FFN in every FFN form; the predictor path runs sparse."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from qinfer.core.architectures import ARCHITECTURES
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.ffn import runners as ffn_runners
from qinfer.runtime.ffn.runners import SparseRunner, select
from qinfer.runtime.ffn.sparse import FFNWeights, active_ids, dense_ffn, sparse_rows
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.forward import ffn_weights
from qinfer.runtime.model.llama import LlamaForward
from qinfer.runtime.model.model_file import open_model

PROMPT = "Once upon a time"


def _weights(variant: str, dtype: torch.dtype, seed: int = 0) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    e, f = 32, 96

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    return FFNWeights(ARCHITECTURES[variant].ffn, rand(f, e), rand(f, e), None if variant == "falcon" else rand(f, e))


@pytest.mark.parametrize("variant", ["llama", "bamboo", "falcon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_oracle_sparse_equals_dense_for_each_variant(variant: str, dtype: torch.dtype) -> None:
    w = _weights(variant, dtype)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    mask = select(w, x, x, 0.0, "oracle")
    ids = active_ids(mask)
    # f32: only the summation order of the down projection differs. f16: the torch path rounds x and products to
    # half (up to ~2.5e-3 here) while the native kernel sums in float32 (within 1e-6 of float64).
    tol = 1e-6 if dtype == torch.float32 else 5e-3
    assert 0 < ids.numel() < w.neurons  # some neurons idle, so the sparse path really skips rows
    for t in range(3):
        one = sparse_rows(w.form, x[t : t + 1], w.gate, w.up, w.down_t, torch.nonzero(mask[t]).flatten(), None)
        assert torch.allclose(one, dense_ffn(w, x[t : t + 1]), rtol=0, atol=tol)
    batched = sparse_rows(w.form, x, w.gate, w.up, w.down_t, ids, mask[:, ids])
    assert torch.allclose(batched, dense_ffn(w, x), rtol=0, atol=tol)


def test_falcon_variant_ignores_gate_and_bamboo_relus_up() -> None:
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    llama, bamboo = _weights("llama", torch.float32), _weights("bamboo", torch.float32)
    falcon = FFNWeights(ARCHITECTURES["falcon"].ffn, llama.up, llama.down_t)
    assert torch.allclose(dense_ffn(falcon, x), torch.relu(x @ llama.up.T) @ llama.down_t, atol=1e-5)
    gate, up = torch.relu(x @ bamboo.gate.T), torch.relu(x @ bamboo.up.T)  # type: ignore[union-attr]
    assert torch.allclose(dense_ffn(bamboo, x), (gate * up) @ bamboo.down_t, atol=1e-5)


def _greedy(forward: LlamaForward, path: Path) -> list[int]:
    tokenizer = GGUFTokenizer(open_model(path).metadata)
    engine = Engine(forward, tokenizer, ctx_size=128)
    return generate(engine, PROMPT, 24, SamplingParams(temperature=0.0), ignore_eos=True).tokens


def test_oracle_model_matches_dense_model(gguf_files: dict[str, Path]) -> None:
    model = open_model(gguf_files["pi-f32"])
    layers = [ffn_weights(model, i) for i in range(model.config.layers)]
    dense, oracle = LlamaForward(model), LlamaForward(model, SparseRunner(layers, 0.0, "oracle"))
    ids = torch.tensor(GGUFTokenizer(model.metadata).encode(PROMPT + " there was a dog"))
    a, b = KVCache(dense.cfg, 64), KVCache(dense.cfg, 64)
    with torch.inference_mode():
        dense(ids[:3], 0, a), oracle(ids[:3], 0, b)
        for j in range(3, len(ids)):
            # Float32 sums in other orders: logits of about 5 moved by up to 1.2e-5 with AVX2's kernels, 1e-6
            # with AVX-512's (AMD EPYC Zen 5).
            assert torch.allclose(oracle(ids[j : j + 1], j, b), dense(ids[j : j + 1], j, a), rtol=0, atol=5e-5)
    assert _greedy(oracle, gguf_files["pi-f32"]) == _greedy(dense, gguf_files["pi-f32"])


def test_predictor_sparse_model_computes_few_neurons_and_stays_on_track(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = open_model(gguf_files["pi-f32"])
    layers = [ffn_weights(model, i) for i in range(model.config.layers)]
    computed: list[int] = []

    def counting(*args: Any) -> torch.Tensor:
        computed.append(args[5].numel())
        return sparse_rows(*args)

    monkeypatch.setattr(ffn_runners, "sparse_rows", counting)
    tokens = _greedy(LlamaForward(model, SparseRunner(layers, model.sparse_threshold)), gguf_files["pi-f32"])
    assert computed and sum(computed) / len(computed) < 0.5 * model.config.ffn  # the synth model fires ~10%
    # The synth predictors are exact (recall 1.0), so predictor-sparse decoding is dense decoding.
    assert tokens == _greedy(LlamaForward(model), gguf_files["pi-f32"])


def test_gather_scratch_works_in_and_out_of_inference_mode() -> None:
    w = _weights("llama", torch.float32)
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(5))
    ids = torch.arange(0, 96, 2)

    def inside_then_outside() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            inside = sparse_rows(w.form, x, w.gate, w.up, w.down_t, ids, None)
        return inside, sparse_rows(w.form, x, w.gate, w.up, w.down_t, ids, None)

    # Scratch buffers are per thread: a fresh thread makes the first one under inference mode.
    with ThreadPoolExecutor(1) as pool:
        inside, outside = pool.submit(inside_then_outside).result()
    assert torch.equal(inside, outside)
