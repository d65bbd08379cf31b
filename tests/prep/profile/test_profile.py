"""`prep profile`: exact firing counts, the activation file format, resuming, and the corpus reader's errors."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.formats.activation_files import count_basis, read_activations, summarise, write_activations
from qinfer.prep.profile.activation_profile import STATE_FILE, profile_activations
from qinfer.prep.profile.corpus_reader import corpus_files, documents, token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text(synth_corpus(3, 12_000, "calibrate"), encoding="utf-8")
    return path


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def hand_counts(model_dir: Path, ids: torch.Tensor, bamboo: bool = False) -> torch.Tensor:
    """LLaMA's forward pass written out from the weights, independently of transformers: [L, F] counts of
    gate > 0 (Bamboo: relu(gate) * relu(up) != 0, with the ReLU on up in the FFN too)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    w = load_file(model_dir / "model.safetensors")
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim, eps, seq = hidden // heads, cfg["rms_norm_eps"], len(ids)
    inv_freq = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    causal = torch.full((seq, seq), -math.inf).triu(1)
    x = w["model.embed_tokens.weight"][ids]
    counts = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xn = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (xn @ w[p + "self_attn.q_proj.weight"].T).view(seq, heads, head_dim).transpose(0, 1)
        k = (xn @ w[p + "self_attn.k_proj.weight"].T).view(seq, kv_heads, head_dim).transpose(0, 1)
        v = (xn @ w[p + "self_attn.v_proj.weight"].T).view(seq, kv_heads, head_dim).transpose(0, 1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k, v))
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(head_dim) + causal, -1) @ v
        x = x + attn.transpose(0, 1).reshape(seq, hidden) @ w[p + "self_attn.o_proj.weight"].T
        xn = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = xn @ w[p + "mlp.gate_proj.weight"].T
        up = xn @ w[p + "mlp.up_proj.weight"].T
        up = torch.relu(up) if bamboo else up
        counts.append(((gate > 0) & (up > 0) if bamboo else gate > 0).sum(0))
        x = x + (torch.relu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return torch.stack(counts)


def test_counts_equal_a_hand_computed_count(tiny: SynthReport, tmp_path: Path) -> None:
    text = tmp_path / "one.txt"
    text.write_text('Lily found a red ball in the park. "Look, Tom!" she said, and they played until 5 o\'clock.\n')
    result = profile_activations(tiny.model_dir, text, tmp_path / "activation", seq_len=256)
    tokenizer = load_relu_model(tiny.model_dir, "f32", "cpu").tokenizer
    [ids] = token_windows(tokenizer, [text], 256)
    assert ids[0] == tokenizer.bos_token_id and result.tokens == len(ids) > 20
    expected = hand_counts(tiny.model_dir, ids)
    counts = torch.stack(read_activations(tmp_path / "activation"))
    assert counts.dtype == torch.int64 and counts.shape == (2, 256)
    assert torch.equal(counts, expected)
    assert 0 < int(counts.sum()) < counts.numel() * len(ids)  # neither all silent nor all firing


def test_bamboo_counts_need_gate_and_up_to_fire(tiny: SynthReport, tmp_path: Path) -> None:
    bamboo = tmp_path / "bamboo"
    shutil.copytree(tiny.model_dir, bamboo)
    config = json.loads((bamboo / "config.json").read_text())
    (bamboo / "config.json").write_text(json.dumps({**config, "architectures": ["BambooForCausalLM"]}))
    text = tmp_path / "one.txt"
    text.write_text("Ben and Mia baked a big cake for their grandma on a sunny day.\n")
    profile_activations(bamboo, text, tmp_path / "activation", seq_len=256)
    [ids] = token_windows(load_relu_model(bamboo, "f32", "cpu").tokenizer, [text], 256)
    counts = torch.stack(read_activations(tmp_path / "activation"))
    assert torch.equal(counts, hand_counts(bamboo, ids, bamboo=True))
    assert (counts < hand_counts(bamboo, ids)).any()  # the up ReLU silences some gate-active neurons


@pytest.mark.parametrize("command", ["profile", "train-predictor"])
def test_help_describes_every_option(command: str) -> None:
    result = CliRunner().invoke(app, ["prep", command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    options = [line for line in result.output.splitlines() if line.lstrip("│ ").startswith("--")]
    assert len(options) >= 8
    for line in options:
        if "--help" not in line:
            assert len(line.split()) > 4, line


@pytest.mark.parametrize("command", ["profile", "calibrate", "train-predictor"])
def test_a_window_longer_than_the_context_is_one_line(tiny: SynthReport, corpus: Path, tmp_path: Path, command: str):
    # OPT's learned positions end at its context: a longer window was an IndexError deep in transformers.
    out = tmp_path / "out"
    args = ["prep", command, str(tiny.model_dir), "--data", str(corpus), "--out", str(out), "--seq-len", "257"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError)  # the entry point's one line and exit 2
    assert str(result.exception) == "seq-len 257 is longer than the model's context of 256 tokens; pass at most 256"
    assert not out.exists()


@pytest.mark.parametrize("command", ["profile", "calibrate", "train-predictor"])
def test_a_cut_checkpoint_is_one_line(tiny: SynthReport, corpus: Path, tmp_path: Path, command: str) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(tiny.model_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])  # an interrupted download
    result = CliRunner().invoke(app, ["prep", command, str(cut), "--data", str(corpus), "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, UserError)
    assert str(result.exception).startswith(f"cannot load the model in {cut} (")
    assert str(result.exception).endswith("the download may be incomplete") and not (tmp_path / "o").exists()


def test_the_default_window_is_cut_to_the_context(tiny: SynthReport, corpus: Path, tmp_path: Path) -> None:
    profile_activations(tiny.model_dir, corpus, tmp_path / "activation", tokens=600)
    assert json.loads((tmp_path / "activation" / "summary.json").read_text())["seq_len"] == 256


def test_activation_files_round_trip_in_integer_layer_order(tmp_path: Path) -> None:
    counts = torch.randint(0, 50, (12, 40))
    counts[:, 0] = 1000  # one hot neuron per layer
    write_activations(tmp_path, counts, tokens=1000, meta={"arch": "llama"})
    back = read_activations(tmp_path)
    assert torch.equal(torch.stack(back), counts)  # layer 10 and 11 come after 9, not after 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    # A neuron profile names no unit: its summary.json keeps the keys it had before experts were profiled.
    assert list(summary) == ["tokens", "arch", "layers"] and count_basis(tmp_path).unit == "neuron"
    layer = summary["layers"][11]
    assert layer["layer"] == 11
    assert layer["sparsity"] == pytest.approx(1 - counts[11].sum().item() / (1000 * 40))
    top4 = counts[11].sort(descending=True).values[:4].sum().item()
    assert layer["top_share"]["10%"] == pytest.approx(top4 / counts[11].sum().item())


def test_summary_shares_on_a_known_vector() -> None:
    [layer] = summarise(torch.tensor([[6, 2, 1, 1, 0, 0, 0, 0, 0, 0]]), tokens=10)
    assert layer.sparsity == pytest.approx(0.9)
    assert layer.top_share == {"10%": pytest.approx(0.6), "20%": pytest.approx(0.8), "50%": pytest.approx(1.0)}


def test_an_interrupted_run_resumes_to_the_same_counts(tiny: SynthReport, corpus: Path, tmp_path: Path) -> None:
    args = dict(tokens=2000, seq_len=64, batch_size=2, checkpoint_every=4)
    whole = profile_activations(tiny.model_dir, corpus, tmp_path / "whole", **args)

    def stop_after_ten(tokens: int, wanted: int | None, windows: int) -> None:
        if windows >= 10:
            raise Interrupted

    with pytest.raises(Interrupted):
        profile_activations(tiny.model_dir, corpus, tmp_path / "parts", on_progress=stop_after_ten, **args)
    assert (tmp_path / "parts" / STATE_FILE).is_file()
    assert not (tmp_path / "parts" / "activation_0.pt").exists()

    with pytest.raises(UserError, match="--restart"):
        profile_activations(tiny.model_dir, corpus, tmp_path / "parts", **{**args, "seq_len": 32})
    # Nor does another model of the same config, or a corpus edited in place (its size kept), add to its counts.
    for path in (tiny.model_dir / "model.safetensors", corpus):
        times = path.stat()
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns + 1_000_000_000))  # a second: coarse clocks too
        try:
            with pytest.raises(UserError, match="--restart"):
                profile_activations(tiny.model_dir, corpus, tmp_path / "parts", **args)
        finally:
            os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))

    starts: list[int] = []
    resumed = profile_activations(
        tiny.model_dir, corpus, tmp_path / "parts", on_progress=lambda t, _n, _w: starts.append(t), **args
    )
    assert resumed.resumed_from == 8 and starts[0] == 8 * 64  # the last checkpoint, not the start
    assert resumed.tokens == whole.tokens == 2000
    assert torch.equal(
        torch.stack(read_activations(tmp_path / "parts")), torch.stack(read_activations(tmp_path / "whole"))
    )
    assert not (tmp_path / "parts" / STATE_FILE).exists()


def test_restart_discards_a_checkpoint_of_other_arguments(tiny: SynthReport, corpus: Path, tmp_path: Path) -> None:
    def stop(tokens: int, wanted: int | None, windows: int) -> None:
        if windows >= 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        profile_activations(
            tiny.model_dir, corpus, tmp_path, tokens=600, seq_len=64, checkpoint_every=1, on_progress=stop
        )
    fresh = profile_activations(tiny.model_dir, corpus, tmp_path, tokens=300, seq_len=64, restart=True)
    assert fresh.resumed_from == 0 and fresh.tokens == 300
    assert int(torch.stack(read_activations(tmp_path)).sum()) <= 300 * 256


def test_corpus_reader_orders_files_and_reads_jsonl(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 3}\n')
    (tmp_path / "a.txt").write_text("first\n\nfirst again\n")
    (tmp_path / "notes.md").write_text("ignored")
    files = corpus_files(tmp_path)
    assert [p.name for p in files] == ["a.txt", "x.jsonl"]
    assert list(documents(files)) == ["first", "first again", "second", "third"]


def test_corpus_errors_are_one_line_prep_errors(tiny: SynthReport, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        corpus_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no corpus files"):
        corpus_files(tmp_path / "empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2 has no string field 'text'"):
        list(documents([bad]))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    with pytest.raises(UserError, match="is empty"):
        profile_activations(tiny.model_dir, blank, tmp_path / "out")


def test_profile_command(tiny: SynthReport, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "activation"
    result = CliRunner().invoke(
        app,
        ["prep", "profile", str(tiny.model_dir), "--data", str(corpus), "--tokens", "500", "--seq-len", "100"]
        + ["--out", str(out), "--device", "cpu", "--dtype", "bf16"],
    )
    assert result.exit_code == 0, result.output
    assert "layer 1: sparsity" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == 500 and summary["dtype"] == "bfloat16"
    assert [layer["sparsity"] for layer in summary["layers"]] == pytest.approx(tiny.per_layer_sparsity, abs=0.05)
