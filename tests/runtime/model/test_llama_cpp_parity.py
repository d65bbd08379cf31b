"""Our dense files are the ecosystem's: llama.cpp (the `peers` extra, llama-cpp-python) loads each SwiGLU and
mixture-of-experts family's convert-dense output, tokenizes text to the ids transformers gives, and computes the
logits we and transformers compute, within the rounding of its f16 products. Skipped where the extra is not
installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.moe import MOE_FAMILIES
from qinfer.prep.synth.swiglu import FAMILIES
from qinfer.runtime.model.model_file import open_model
from tests.support.gguf_rewrite import rewrite_gguf
from tests.support.runtime_logits import our_logits, reference_logits

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "Once upon a time, Lily found a red ball in the park. She was happy and played with it all day long."
CODE = "def f(x):\n    return x ** 2  # 12345 東京 🙂   spaces"


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_our_dense_file(swiglu: dict[str, dict[str, Path]], family: str, tmp_path: Path) -> None:
    model_dir = swiglu[family]["model"]
    f16 = convert(model_dir, tmp_path / f"{family}.f16.gguf", None, "f16").outfile
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = llama_cpp.Llama(model_path=str(f16), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    for text in (TEXT, CODE):
        assert llm.tokenize(text.encode(), add_bos=tokenizer.bos_token_id is not None, special=False) == tokenizer(
            text
        )["input_ids"], text
    ids = tokenizer(TEXT)["input_ids"]
    theirs, ours, reference = three_logits(llm, f16, model_dir, ids)
    scale = reference.abs().max().item()
    # llama.cpp runs a llama file's attention over every position: it ignores Mistral's window, which we honour,
    # so only the positions inside the first window compare; past it llama.cpp equals our run without the window.
    window = open_model(f16).config.sliding_window or len(ids)
    # f16 weights on both sides; llama.cpp also rounds each product's input to f16 (ggml's CPU path), we keep f32.
    assert (theirs - ours)[:window].abs().max().item() < 0.01 * scale
    assert (theirs - reference)[:window].abs().max().item() < 0.01 * scale
    assert (ours - reference).abs().max().item() < 0.002 * scale
    if window < len(ids):
        assert (theirs - ours)[window:].abs().max().item() > 0.1 * scale
        unwindowed = our_logits(without_window(f16, tmp_path), ids, "dense")
        assert (theirs - unwindowed).abs().max().item() < 0.01 * scale


def three_logits(llm: Any, path: Path, model_dir: Path, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """llama.cpp's, our runtime's and transformers' logits for `ids`."""
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)
    return theirs, our_logits(path, ids, "dense"), reference_logits(model_dir, ids)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llama_cpp_runs_our_moe_file(moe: dict[str, dict[str, Path]], family: str, tmp_path: Path) -> None:
    """llama.cpp finds the router, the stacked experts, Qwen2-MoE's shared expert and Qwen3-MoE's q/k norms where we
    put them, and routes each token as transformers and we do."""
    model_dir = moe[family]["model"]
    f16 = convert(model_dir, tmp_path / f"{family}.f16.gguf", None, "f16").outfile
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT)["input_ids"]
    llm = llama_cpp.Llama(model_path=str(f16), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    assert llm.tokenize(TEXT.encode(), add_bos=tokenizer.bos_token_id is not None, special=False) == ids
    theirs, ours, reference = three_logits(llm, f16, model_dir, ids)
    scale = reference.abs().max().item()
    assert (theirs - ours).abs().max().item() < 0.01 * scale
    assert (theirs - reference).abs().max().item() < 0.01 * scale


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llama_cpp_runs_our_q4_0_moe_file(moe: dict[str, dict[str, Path]], family: str, tmp_path: Path) -> None:
    """llama.cpp reads our quantized expert stacks, and the float32 routers beside them, as its own files hold them,
    and computes our logits: both sides multiply Q4_0 blocks with the input rounded to Q8_0 blocks."""
    q4 = quantize_gguf(moe[family]["dense-f32"], tmp_path / "q4.gguf", "Q4_0").outfile
    # Eight tokens: from the ninth on, the random Qwen3-MoE's tokens come within 0.002 of a tie between their 2nd
    # and 3rd expert (the ninth's layer 1: 0.1425 against 0.1404), which the two sides' slightly different roundings
    # (ggml keeps the input's block scales in f16, we in float32; our layer step computes its norms in its own
    # order) break differently, and the logits part from there on.
    ids = AutoTokenizer.from_pretrained(moe[family]["model"])(TEXT)["input_ids"][:8]
    llm = llama_cpp.Llama(model_path=str(q4), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)
    ours = our_logits(q4, ids, "dense")
    scale = ours.abs().max().item()
    diff = (theirs - ours).abs()
    assert diff.max().item() < 0.03 * scale and diff.mean().item() < 0.005 * scale


def without_window(path: Path, tmp_path: Path) -> Path:
    """The file with its sliding-window key dropped: the same model, attending to every position."""
    out = tmp_path / "no-window.gguf"
    rewrite_gguf(path, out, drop_keys={"llama.attention.sliding_window"})
    return out
