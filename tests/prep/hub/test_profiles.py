"""Model profiles load with the published models' shapes; `qinfer profiles` lists models and devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.planner.device_profiles import known_profiles
from qinfer.prep.hub import model_profiles
from qinfer.prep.hub.model_profiles import known_models, load_model_profile
from tests.support.cli_in_process import run_in_process

# (E, F, L, heads, kv heads, vocab, arch) from the models' config.json files.
EXPECTED = {
    "ReluLLaMA-7B": (4096, 11008, 32, 32, 32, 32000, "llama"),
    "ReluLLaMA-13B": (5120, 13824, 40, 40, 40, 32000, "llama"),
    "ReluLLaMA-70B": (8192, 28672, 80, 64, 8, 32000, "llama"),
    "ProSparse-LLaMA-2-7B": (4096, 11008, 32, 32, 32, 32000, "llama"),
    "ProSparse-LLaMA-2-13B": (5120, 13824, 40, 40, 40, 32000, "llama"),
    "ReluFalcon-40B": (8192, 32768, 60, 128, 8, 65024, "falcon"),
    "Bamboo-base-v0.1": (4096, 14336, 32, 32, 8, 32000, "bamboo"),
    "Bamboo-DPO-v0.1": (4096, 14336, 32, 32, 8, 32000, "bamboo"),
}


def test_every_supported_model_has_a_profile_with_its_shape() -> None:
    models = {m.name: m for m in known_models()}
    assert set(models) == set(EXPECTED)
    for name, (e, f, layers, heads, kv, vocab, arch) in EXPECTED.items():
        m = models[name]
        s = m.spec
        assert (s.hidden, s.ffn, s.layers, s.heads, s.kv_heads, s.vocab_size, s.arch) == (
            e,
            f,
            layers,
            heads,
            kv,
            vocab,
            arch,
        )
        assert m.gguf_f16 or m.gguf_q4
        for file in (m.gguf_f16, m.gguf_q4):
            assert file is None or file.endswith(".gguf")
        assert len(m.activation_files) == layers and m.activation_files[10] == "activation/activation_10.pt"


def test_lookup_ignores_case_and_lists_known_models_when_unknown() -> None:
    assert load_model_profile("relullama-7b").gguf_repo == "PowerInfer/ReluLLaMA-7B-PowerInfer-GGUF"
    with pytest.raises(UserError, match="known models: .*ReluLLaMA-7B"):
        load_model_profile("Llama-3-8B")


def test_profiles_command_lists_models_and_devices() -> None:
    result = CliRunner().invoke(app, ["profiles"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for name in [*EXPECTED, *known_profiles("gpu"), *known_profiles("cpu")]:
        assert name in result.output


@pytest.mark.parametrize("heads", [0, -4, 32.5, "32"])
def test_a_model_profile_with_a_meaningless_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: object
) -> None:
    """0 heads divided by zero in a traceback; -4, 32.5 and "32" made a shape no model has."""
    profile = json.loads((model_profiles.PROFILE_DIR / "bamboo-base-v0.1.json").read_text())
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**profile, "shape": {**profile["shape"], "heads": heads}}))
    monkeypatch.setattr(model_profiles, "PROFILE_DIR", tmp_path)
    result = run_in_process("profiles")
    assert result.returncode == 2 and result.stdout == ""
    line = f"error: model profile {mine}: shape.heads is {heads!r}, not a positive whole number; fix or delete it\n"
    assert result.stderr == line
