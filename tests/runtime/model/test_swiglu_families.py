"""Llama-3, Mistral and Qwen2 (SwiGLU) through convert and the runtime, against transformers: logits, tokenizer
ids, what the file says, and each family's own feature (llama3 rope scaling, a sliding window, q/k/v biases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, Qwen2Tokenizer

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.errors import UserError
from qinfer.core.kv_policy import F32_KV, KVPolicy
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.swiglu import FAMILIES
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kernels.decode_layer import PROMPT_TOKENS
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache, make_kv_cache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.support.cli_in_process import run_in_process
from tests.support.gguf_rewrite import rewrite_gguf
from tests.support.native_placement import placement_of
from tests.support.runtime_logits import hf_ids, last_logits, our_logits, reference_logits

TEXT = "Once upon a time, Lily found a red ball in the park. She was happy and played with it all day long."
TRICKY = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "Pi is 3.14159265358979, e is 2.718; 1234567890 and 0x7FFF_FFFF.",
    "東京都は日本の首都であり、北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🙂🚀👍🏽 and a family 👨‍👩‍👧‍👦, flags 🇯🇵.",
    "Spaces   run\t\ttabs\n\n\n  and trailing   ",
    " leading space, CamelCaseWords, don't, we'll, I'M, <|im_start|> literal",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_ids_equal_transformers(swiglu: dict[str, dict[str, Path]], family: str) -> None:
    tokenizer = GGUFTokenizer(open_model(swiglu[family]["dense-f32"]).metadata)
    for text in TRICKY:
        expected = hf_ids(swiglu[family]["model"], text)
        assert tokenizer.encode(text) == tokenizer.encode(text, keep_gil=True) == expected, text


def test_a_control_token_outside_the_byte_alphabet_is_matched_whole(swiglu: dict[str, dict[str, Path]]) -> None:
    """llama.cpp writes a control token in plain text; DeepSeek-R1's distillations of Qwen2 have `<｜User｜>`,
    which the byte alphabet cannot spell: text naming it gets its id, as in llama.cpp."""
    meta = dict(open_model(swiglu["qwen2"]["dense-f32"]).metadata)
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    control = types.index(3)
    tokens[control] = "<｜User｜>"
    ours = GGUFTokenizer({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    plain = ours.encode("hi", add_bos=False)
    assert ours.encode("hi<｜User｜>hi", add_bos=False) == [*plain, control, *plain]
    assert ours.backend.get_vocab_size() == len(tokens)


def test_qwen2_split_is_transformers_own(swiglu: dict[str, dict[str, Path]]) -> None:
    """The split we name `qwen2` (qinfer.core.vocabulary) cuts text as transformers' own Qwen2Tokenizer does, given
    the same vocabulary and merges: the synth tokenizer above is built with our expression, this one with theirs."""
    spec = json.loads((swiglu["qwen2"]["model"] / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    reference = Qwen2Tokenizer(vocab=spec["model"]["vocab"], merges=merges)
    ours = GGUFTokenizer(open_model(swiglu["qwen2"]["dense-f32"]).metadata)
    split, reference_split = ours.backend.pre_tokenizer, reference.backend_tokenizer.pre_tokenizer
    for text in [TEXT, *TRICKY[:-1], "It's 12345 o'clock;\r\n  \t done!!  "]:
        assert split.pre_tokenize_str(text) == reference_split.pre_tokenize_str(text), text
        assert ours.encode(text, add_bos=False) == reference(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(swiglu: dict[str, dict[str, Path]], family: str) -> None:
    """A prompt, then token by token through the KV cache; the text is longer than Mistral's window, and long
    enough for Llama-3's scaled frequencies."""
    ids = hf_ids(swiglu[family]["model"], TEXT)
    assert len(ids) > 24
    expected = reference_logits(swiglu[family]["model"], ids)
    assert expected.abs().max() > 1.0  # large enough that an error of 1e-3 is one in a thousand
    assert (our_logits(swiglu[family]["dense-f32"], ids, "dense") - expected).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_last_token_alone_matches_transformers(swiglu: dict[str, dict[str, Path]], family: str) -> None:
    """The last layer projects and attends the last token's query alone, over every token's keys and values (a
    sliding window's mask, q/k/v biases and each family's rope included)."""
    ids = hf_ids(swiglu[family]["model"], TEXT)
    expected = reference_logits(swiglu[family]["model"], ids)[-1]
    logits, queries = last_logits(swiglu[family]["dense-f32"], ids, "dense")
    assert (logits - expected).abs().max().item() < 1e-3
    layers = open_model(swiglu[family]["dense-f32"]).config.layers
    assert queries == [len(ids)] * (layers - 1) + [1]


def decode_logits(path: Path, ids: list[int], native: bool) -> torch.Tensor:
    forward = load_forward(open_model(path), RuntimeOptions(ffn="dense")).forward
    assert forward.native is not None
    forward.native = forward.native if native else None
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


@pytest.mark.usefixtures("kernel_build")
@pytest.mark.parametrize("family", FAMILIES)
def test_native_step_gives_the_torch_paths_logits(
    swiglu: dict[str, dict[str, Path]], family: str, tmp_path: Path
) -> None:
    """f16 rows, one native call a step (biases, rotate-half rope, the window, silu) against the torch path, token
    by token and in prompt chunks (from the second on, past Mistral's window of 16)."""
    f16 = convert(swiglu[family]["model"], tmp_path / "f16.gguf", None, "f16").outfile
    ids = hf_ids(swiglu[family]["model"], TEXT)
    reference = decode_logits(f16, ids, native=False)
    assert (decode_logits(f16, ids, native=True) - reference).abs().max().item() < 1e-3
    assert (chunked_logits(f16, ids, PROMPT_TOKENS - 4) - reference).abs().max().item() < 1e-3


def chunked_logits(path: Path, ids: list[int], chunk: int) -> torch.Tensor:
    """Every token's logits, the text fed `chunk` tokens at a time, each chunk of several in the native layer step."""
    forward = load_forward(open_model(path), RuntimeOptions(ffn="dense")).forward
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    logits = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            batch = TokenBatch.prompt(torch.tensor(ids[start : start + chunk]), start)
            assert placement_of(forward, batch, cache) == ("prompt" if batch.tokens.shape[0] > 1 else "decode")
            logits.append(forward.forward(batch, cache))
    return torch.cat(logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_slots_match_transformers(swiglu: dict[str, dict[str, Path]], family: str) -> None:
    """Two sequences decoded together, one token of each per step (the torch path's masks), each as alone."""
    model = swiglu[family]["model"]
    first, second = hf_ids(model, TEXT)[:30], hf_ids(model, "The dog ran fast and the cat slept under a tree.")
    n = min(len(first), len(second))
    forward = load_forward(open_model(swiglu[family]["dense-f32"]), RuntimeOptions()).forward
    cache = KVCache(forward.cfg, 64, slots=2, types=F32_KV)
    with torch.inference_mode():
        steps = [forward.forward(TokenBatch.decode([first[j], second[j]], [j, j], [0, 1]), cache) for j in range(n)]
    ours = torch.stack(steps, dim=1)
    for slot, ids in enumerate((first[:n], second[:n])):
        assert (ours[slot] - reference_logits(model, ids)).abs().max().item() < 1e-3


def test_each_family_writes_what_llama_cpp_reads(swiglu: dict[str, dict[str, Path]]) -> None:
    metas = {family: open_model(files["dense-f32"]).metadata for family, files in swiglu.items()}
    assert {f: m["general.architecture"] for f, m in metas.items()} == {
        "llama3": "llama", "mistral": "llama", "qwen2": "qwen2"
    }  # fmt: skip
    assert metas["llama3"]["tokenizer.ggml.pre"] == "llama-bpe"
    assert metas["qwen2"]["tokenizer.ggml.pre"] == "qwen2"
    assert {f: m["tokenizer.ggml.model"] for f, m in metas.items()} == {
        "llama3": "gpt2", "mistral": "llama", "qwen2": "gpt2"
    }  # fmt: skip
    assert metas["mistral"]["llama.attention.sliding_window"] == 16
    # SwiGLU is what llama.cpp reads into a dense llama or qwen2 file that says nothing of its FFN.
    assert not any("qinfer.feed_forward.activation" in m for m in metas.values())
    model = open_model(swiglu["llama3"]["dense-f32"])
    hf = AutoModelForCausalLM.from_pretrained(swiglu["llama3"]["model"])
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    factors = model.tensors["rope_freqs.weight"].float()
    np.testing.assert_allclose(base / factors, hf.model.rotary_emb.inv_freq, rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 8.0  # short wavelengths kept, long ones slowed by the factor
    qwen = open_model(swiglu["qwen2"]["dense-f32"])
    np.testing.assert_array_equal(
        qwen.tensors["blk.0.attn_q.bias"], hf_state(swiglu["qwen2"]["model"])["model.layers.0.self_attn.q_proj.bias"]
    )


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_0_native_step_stays_close(swiglu: dict[str, dict[str, Path]], family: str, tmp_path: Path) -> None:
    """Q4_0 rows through the native step (its input quantized to Q8_0 blocks, as ggml does) against the torch path
    over the same rows expanded to floats: apart only by the input's rounding."""
    q4 = quantize_gguf(swiglu[family]["dense-f32"], tmp_path / "q4.gguf", "Q4_0").outfile
    ids = hf_ids(swiglu[family]["model"], TEXT)
    diff = (decode_logits(q4, ids, native=True) - decode_logits(q4, ids, native=False)).abs()
    assert 0 < diff.mean().item() < 0.03 and diff.max().item() < 0.3


@pytest.mark.parametrize("divisor", [-8.0, 0.0, float("nan")])
def test_rope_divisors_that_are_not_finite_and_positive_are_refused(
    swiglu: dict[str, dict[str, Path]], tmp_path: Path, divisor: float
) -> None:
    """A negative divisor would turn the longest wavelengths backwards unseen; 0 and NaN would make NaN logits."""
    path = Path(shutil.copy(swiglu["llama3"]["dense-f32"], tmp_path / "bent.gguf"))
    rope = next(t for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    with path.open("r+b") as f:
        f.seek(int(rope.data_offset) + 4 * (int(rope.n_elements) - 1))
        f.write(np.float32(divisor).tobytes())
    ran = run_in_process("run", "-m", str(path), "-p", "Once upon a time", "-n", "2", "--temp", "0")
    assert ran.returncode == 2 and ran.stdout == "", ran.stderr
    assert (
        ran.stderr
        == f"error: {path}: rope_freqs.weight holds a divisor that is not a finite positive number; re-convert it\n"
    )


def test_a_windowed_cache_is_refused_for_a_sliding_window_model(swiglu: dict[str, dict[str, Path]]) -> None:
    cfg = open_model(swiglu["mistral"]["dense-f32"]).config
    with pytest.raises(UserError, match="sliding window"):
        make_kv_cache(cfg, 64, policy=KVPolicy("window", 32))


def test_run_and_perplexity_commands(swiglu: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """The commands take the new families as they take the old: text out, a perplexity near the vocabulary's
    size for an untrained model."""
    ran = run_in_process("run", "-m", str(swiglu["qwen2"]["dense-f32"]), "-p", "Once upon a time", "-n", "8",
                         "--temp", "0")  # fmt: skip
    assert ran.returncode == 0 and "decode: 8 tokens" in ran.stderr, ran.stderr
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 8, encoding="utf-8")
    scored = run_in_process("perplexity", "-m", str(swiglu["mistral"]["dense-f32"]), "-f", str(text), "-c", "64")
    assert scored.returncode == 0, scored.stderr
    ppl = float(scored.stdout.split("PPL = ")[1].split()[0])
    assert 50 < ppl < 100_000


def test_a_tied_model_without_an_output_tensor_runs(swiglu: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """llama.cpp writes a tied model (Qwen2-0.5B, Llama-3.2-1B) without output.weight: the head is the embedding."""
    path = swiglu["qwen2"]["dense-f32"]
    tied = rewrite_gguf(path, tmp_path / "tied.gguf", drop_tensors={"output.weight"})
    ids = hf_ids(swiglu["qwen2"]["model"], TEXT)
    assert "output.weight" not in open_model(tied).tensors
    assert torch.equal(our_logits(tied, ids, "dense"), our_logits(path, ids, "dense"))


@pytest.mark.parametrize(
    ("keys", "window"),
    [
        ({"use_sliding_window": False, "sliding_window": 16}, None),
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, None),  # no layer slides
        ({"use_sliding_window": True, "sliding_window": 16}, None),  # Qwen2's default: layers from 28 on
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),  # every layer
    ],
)
def test_which_qwen2_configs_slide_a_window(swiglu: dict[str, dict[str, Path]], keys: dict, window: int | None) -> None:
    config = json.loads((swiglu["qwen2"]["model"] / "config.json").read_text())
    spec = ARCHITECTURES["qwen2"].read_config({**config, **keys}, swiglu["qwen2"]["model"] / "config.json")
    assert spec.sliding_window == window


def test_config_refusals(swiglu: dict[str, dict[str, Path]]) -> None:
    config = json.loads((swiglu["qwen2"]["model"] / "config.json").read_text())
    where = swiglu["qwen2"]["model"] / "config.json"
    for keys, message in (
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "only some layers"),
        ({"hidden_act": ["silu"]}, "hidden_act"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ):
        with pytest.raises(UserError, match=message):
            ARCHITECTURES["qwen2"].read_config({**config, **keys}, where)
