"""Our CPU runtime on converted tiny models, compared with transformers on the original checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.kv_policy import F32_KV
from qinfer.formats.gguf_reader import open_gguf
from qinfer.prep.synth.build import SynthReport
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate
from qinfer.runtime.engine.sampling import SamplingParams, sample_next
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.llama import LlamaForward
from qinfer.runtime.model.loader import FORWARDS, gpu_profile_name
from qinfer.runtime.model.model_file import open_model
from tests.support.cli_in_process import run_in_process

PROMPT = "Once upon a time"
TEXTS = [PROMPT, "The dog ran fast,\nand the cat  slept. 42 times!", "  leading spaces", "zürich — 東京 🙂", ""]


@pytest.fixture(scope="module")
def reference(tiny: SynthReport) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).eval()


def our_logits(path: Path, ids: list[int], split: int) -> torch.Tensor:
    """Logits for `ids`, fed as a prompt of `split` tokens and then one token at a time through the KV cache."""
    forward = LlamaForward(open_model(path))
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        parts = [forward(torch.tensor(ids[:split]), 0, cache)]
        parts += [forward(torch.tensor([t]), split + j, cache) for j, t in enumerate(ids[split:])]
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["pi-f32", "dense-f32"])
def test_logits_match_transformers(gguf_files: dict[str, Path], reference: LlamaForCausalLM, kind: str) -> None:
    ids = AutoTokenizer.from_pretrained(reference.name_or_path)(TEXTS[1]).input_ids
    assert len(ids) > 12
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    ours = our_logits(gguf_files[kind], ids, split=5)
    assert (ours - expected).abs().max().item() < 1e-3


def test_f16_logits_stay_close(gguf_files: dict[str, Path], reference: LlamaForCausalLM) -> None:
    ids = AutoTokenizer.from_pretrained(reference.name_or_path)(PROMPT).input_ids
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    ours = our_logits(gguf_files["pi-f16"], ids, split=len(ids))
    assert (ours - expected).abs().max().item() < 0.05


def test_greedy_continuation_matches_transformers(gguf_files: dict[str, Path], reference: LlamaForCausalLM) -> None:
    model = open_model(gguf_files["pi-f32"])
    tokenizer = GGUFTokenizer(model.metadata)
    engine = Engine(LlamaForward(model), tokenizer, ctx_size=128)
    result = generate(engine, PROMPT, 32, SamplingParams(temperature=0.0), ignore_eos=True)
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        for _ in range(32):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert result.tokens == ids[-32:]
    # The new text continues the prompt's, leading space included.
    assert result.text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:-32])) :]
    assert result.text.startswith(" ")


def test_tokenizer_rebuilt_from_gguf_matches_the_hf_tokenizer(gguf_files: dict[str, Path], tiny: SynthReport) -> None:
    """Against transformers' tokenizer, and against SentencePiece's own where transformers agrees with it (it reads
    neither special tokens in text nor leading spaces as SentencePiece does): the merges we rebuild from the scores
    split words as the trained model does."""
    hf = AutoTokenizer.from_pretrained(tiny.model_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny.model_dir / "tokenizer.model"))
    ours = GGUFTokenizer(open_model(gguf_files["pi-f16"]).metadata)
    for text in [*TEXTS, "Tom\tsaid <s>hi</s> and <unk>\n\n  ", "naïve café, 3.14159, ÆØÅ"]:
        assert ours.encode(text) == ours.encode(text, keep_gil=True) == hf(text).input_ids, text
        if "<" not in text and not text.startswith(" "):
            assert ours.encode(text, add_bos=False) == sp.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True)
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)


def test_weights_are_mapped_not_copied(gguf_files: dict[str, Path]) -> None:
    path = gguf_files["pi-f16"]
    model = open_model(path)
    reader = open_gguf(path)
    start = model.tensors["token_embd.weight"].data_ptr() - reader.tensors[0].data_offset
    for t in reader.tensors:
        # Each tensor sits at its own offset from one common base: they all view one mapping of the file.
        assert model.tensors[t.name].data_ptr() - t.data_offset == start


def test_sampling_is_seeded_and_respects_top_k_and_top_p() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 0.5, 2.8])

    def draws(params: SamplingParams, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_next(logits, params, g) for _ in range(2000)]

    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    assert draws(hot, 1) == draws(hot, 1)
    assert draws(hot, 1) != draws(hot, 2)
    assert set(draws(hot, 1)) == {0, 1, 2, 3, 4}
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, top_p=1.0), 3)) == {1, 2}
    # The top two hold ~67% of the mass, the top three ~95%: p=0.6 keeps two, p=0.9 keeps three.
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.6), 4)) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.9), 4)) == {1, 2, 4}
    assert set(draws(SamplingParams(temperature=0.0), 5)) == {1}


def test_run_command_streams_and_summarises(gguf_files: dict[str, Path]) -> None:
    """The text on stdout, then the speeds on stderr on a line of their own, in that order also where both go to one
    pipe (a log) and stdout is buffered."""
    args = ["run", "-m", str(gguf_files["pi-f16"]), "-p", PROMPT, "-n", "12", "-t", "2", "--temp", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": ""}
    result = subprocess.run(
        [sys.executable, "-m", "qinfer", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout
    body, summary = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert summary.startswith("prompt: ") and "decode: 12 tokens" in summary and "tokens/s" in summary, summary
    assert len(body.split(PROMPT, 1)[1]) > 3


def test_run_says_where_the_context_ends_it(gguf_files: dict[str, Path]) -> None:
    model = str(gguf_files["pi-f16"])
    refused = run_in_process("run", "-m", model, "-p", PROMPT, "-c", "4", "-n", "2")
    # Refused before the prompt is echoed, which the error line would otherwise follow on the same line.
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.startswith("error: the prompt is ") and refused.stderr.count("\n") == 1
    cut = run_in_process("run", "-m", model, "-p", PROMPT, "-c", "16", "-n", "100", "--temp", "0", "--ignore-eos")
    assert cut.returncode == 0, cut.stderr
    assert cut.stderr.splitlines()[-1] == "note: stopped before -n 100: the context of 16 tokens is full (-c)"
    whole = run_in_process("run", "-m", model, "-p", PROMPT, "-c", "16", "-n", "4", "--temp", "0", "--ignore-eos")
    assert whole.returncode == 0 and "note:" not in whole.stderr


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_run_refuses_bad_model_files(gguf_files: dict[str, Path], tmp_path: Path, damage: str) -> None:
    path = tmp_path / "bad.powerinfer.gguf"
    if damage == "truncated":
        path.write_bytes(gguf_files["pi-f16"].read_bytes()[:5000])
    elif damage == "garbage":
        path.write_bytes(b"not a model at all" * 100)
    result = run_in_process("run", "-m", str(path), "-n", "4")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bamboo_converts_and_runs_with_relu_on_up(tiny: SynthReport, tmp_path: Path) -> None:
    """Bamboo is LLaMA-shaped with relu(gate) * relu(up); transformers' LLaMA with that FFN is the reference."""
    import json
    import shutil

    from qinfer.prep.convert.convert import convert

    model_dir = shutil.copytree(tiny.model_dir, tmp_path / "bamboo")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["BambooForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    path = convert(model_dir, tmp_path / "bamboo.powerinfer.gguf", tiny.predictor_dir, "f32").outfile
    model = open_model(path)
    assert model.config.arch == "bamboo"
    assert {k.split(".")[0] for k in model.metadata} == {"general", "bamboo", "tokenizer", "powerinfer"}

    reference = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).eval()
    for layer in reference.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))
    ids = GGUFTokenizer(model.metadata).encode(TEXTS[1])
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
        plain = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32)
        plain_llama = plain(torch.tensor([ids])).logits[0]
    ours = our_logits(path, ids, split=len(ids))
    assert (ours - expected).abs().max().item() < 1e-3
    assert (ours - plain_llama).abs().max().item() > 1e-2


def test_every_family_in_the_table_has_a_forward() -> None:
    assert {arch.block for arch in ARCHITECTURES.values()} <= FORWARDS.keys()


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ],
)
def test_a_gpu_is_planned_with_its_own_profile(monkeypatch: pytest.MonkeyPatch, name: str, profile: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert gpu_profile_name(torch.device("cuda")) == profile
