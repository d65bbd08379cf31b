"""Mixtral, Qwen2-MoE and Qwen3-MoE through convert-dense and the runtime, against transformers: a prompt and then
token-by-token decode, several sequences in one batch each routed on its own, and what a MoE file is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qinfer.core.expert_routing import route
from qinfer.core.kv_policy import F32_KV
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.moe import MOE_FAMILIES
from qinfer.runtime.ffn.experts import ExpertRunner
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.kernels.weight_rows import linear
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.support.cli_in_process import run_in_process
from tests.support.gguf_rewrite import rewrite_gguf
from tests.support.native_placement import counting_runs
from tests.support.runtime_logits import hf_ids, our_logits, reference_logits

TEXT = "Once upon a time, Lily found a red ball in the park. She was happy and played with it all day long."
OTHERS = ("The dog ran fast and the cat slept under a tree.", "A small bird sang on the old wall every morning.")
DECODE_STEPS = 4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prompt_then_decode_equals_transformers(moe: dict[str, dict[str, Path]], family: str) -> None:
    ids = hf_ids(moe[family]["model"], TEXT)[:16]
    expected = reference_logits(moe[family]["model"], ids)
    assert expected.abs().max() > 1.0  # large enough that an error of 1e-4 is small beside it
    ours = our_logits(moe[family]["dense-f32"], ids, "dense", split=len(ids) - DECODE_STEPS)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tokens_choose_different_experts(moe: dict[str, dict[str, Path]], family: str) -> None:
    """The parity above means something only where the router's choice varies from token to token."""
    forward = load_forward(open_model(moe[family]["dense-f32"]), RuntimeOptions()).forward
    assert isinstance(forward.ffn, ExpertRunner)
    x = forward.embed[torch.tensor(hf_ids(moe[family]["model"], TEXT))].float()
    experts = forward.cfg.experts
    assert experts is not None
    chosen, weights = route(linear(x, forward.ffn.layers[0].router), experts.used, experts.norm_top_k)
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 2
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == (family != "qwen2moe")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_sequences_in_one_batch_decode_each_as_alone(moe: dict[str, dict[str, Path]], family: str) -> None:
    """Three prompts of different lengths, then decode steps with one token of each at its own position: each
    sequence's logits are transformers' for it alone."""
    model = moe[family]["model"]
    sequences = [hf_ids(model, text)[: 6 + 3 * k + DECODE_STEPS] for k, text in enumerate((TEXT, *OTHERS))]
    forward = load_forward(open_model(moe[family]["dense-f32"]), RuntimeOptions()).forward
    cache = KVCache(forward.cfg, 64, slots=len(sequences), types=F32_KV)
    ours: list[list[torch.Tensor]] = []
    with torch.inference_mode():
        for slot, ids in enumerate(sequences):
            prompt = ids[:-DECODE_STEPS]
            ours.append([forward.forward(TokenBatch.prompt(torch.tensor(prompt), 0, slot), cache)])
        for step in range(DECODE_STEPS):
            tokens = [ids[len(ids) - DECODE_STEPS + step] for ids in sequences]
            positions = [len(ids) - DECODE_STEPS + step for ids in sequences]
            logits = forward.forward(TokenBatch.decode(tokens, positions, list(range(len(sequences)))), cache)
            for slot in range(len(sequences)):
                ours[slot].append(logits[slot : slot + 1])
    for slot, ids in enumerate(sequences):
        assert (torch.cat(ours[slot]) - reference_logits(model, ids)).abs().max().item() < 1e-4


def test_an_f16_file_runs_close(moe: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    f16 = convert(moe["qwen2moe"]["model"], tmp_path / "f16.gguf", None, "f16").outfile
    ids = hf_ids(moe["qwen2moe"]["model"], TEXT)[:12]
    f32 = our_logits(moe["qwen2moe"]["dense-f32"], ids, "dense")
    assert (our_logits(f16, ids, "dense") - f32).abs().max().item() < 0.01 * f32.abs().max().item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_one_native_call_computes_a_tokens_experts(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode token's chosen experts over f16 stacks in one native call give what the loop over experts gives, and
    so do the logits of a whole decode."""
    f16 = convert(moe[family]["model"], tmp_path / "f16.gguf", None, "f16").outfile
    runner = load_forward(open_model(f16), RuntimeOptions()).forward.ffn
    assert isinstance(runner, ExpertRunner)
    w = runner.layers[1]
    x = torch.randn(1, w.gate.shape[2], generator=torch.Generator().manual_seed(0))
    chosen, weights = route(linear(x, w.router), runner.experts.used, runner.experts.norm_top_k)
    native = row_kernels.moe_ffn(x, w.gate, w.up, w.down, chosen, weights)
    assert native is not None
    loop = sum(weights[0, i] * w.expert(int(j))(x) for i, j in enumerate(chosen[0]))
    assert (native - loop).abs().max().item() < 1e-5 * loop.abs().max().item()
    ids = hf_ids(moe[family]["model"], TEXT)[:12]
    fast = our_logits(f16, ids, "dense", split=len(ids) - DECODE_STEPS)
    monkeypatch.setenv("QINFER_NATIVE", "0")
    slow = our_logits(f16, ids, "dense", split=len(ids) - DECODE_STEPS)
    assert (fast - slow).abs().max().item() < 1e-4 * slow.abs().max().item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_q4_0_experts_decode_as_their_dequantized_weights(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q4_0 file's experts, read per expert from the stacked blocks by the native layer step (their input rounded
    to Q8_0 blocks, as ggml does), against the torch path over the same blocks expanded to float32."""
    q4 = quantize_gguf(moe[family]["dense-f32"], tmp_path / "q4.gguf", "Q4_0").outfile
    ids = hf_ids(moe[family]["model"], TEXT)[:12]
    steps = counting_runs(monkeypatch)
    native = our_logits(q4, ids, "dense", split=len(ids) - DECODE_STEPS)
    # Every decode step of every layer ran in the native layer step.
    assert steps == {"decode": list(range(open_model(q4).config.layers)) * DECODE_STEPS}
    monkeypatch.setenv("QINFER_NATIVE", "0")
    expanded = our_logits(q4, ids, "dense", split=len(ids) - DECODE_STEPS)
    f32 = our_logits(moe[family]["dense-f32"], ids, "dense", split=len(ids) - DECODE_STEPS)
    scale = expanded.abs().max().item()
    diff = (native - expanded).abs()
    assert diff.max().item() < 0.03 * scale and diff.mean().item() < 0.005 * scale
    # Against the float32 file the quantization shows: the file's experts are Q4_0, not float carried through.
    assert (expanded - f32).abs().max().item() > 0.05 * scale


def test_run_command_generates(moe: dict[str, dict[str, Path]]) -> None:
    ran = run_in_process("run", "-m", str(moe["qwen3moe"]["dense-f32"]), "-p", "Once upon a time", "-n", "6",
                         "--temp", "0")  # fmt: skip
    assert ran.returncode == 0 and "decode: 6 tokens" in ran.stderr, ran.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--ffn", "sparse"), "experts are not made sparse yet; run without --ffn sparse"),
        (("--vram-budget", "1", "--schedule", "dynamic"), "experts stay where the plan puts them; run without "
         "--schedule dynamic"),
    ],
)  # fmt: skip
def test_a_sparse_or_dynamic_run_is_refused_in_one_line(
    moe: dict[str, dict[str, Path]], option: tuple[str, str], message: str
) -> None:
    ran = run_in_process("run", "-m", str(moe["mixtral"]["dense-f32"]), "-p", "Once", "-n", "2", *option)
    assert ran.returncode == 2 and ran.stdout == "", ran.stderr
    assert ran.stderr == f"error: {message}\n"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_file_that_does_not_say_is_routed_as_llama_cpp_routes_it(
    moe: dict[str, dict[str, Path]], family: str, tmp_path: Path
) -> None:
    """llama.cpp's own converter writes no expert_weights_norm, and its graphs rescale Mixtral's and Qwen3-MoE's
    top-k weights but not Qwen2-MoE's: the synth models are built so, and read without the key they decode the same."""
    path = moe[family]["dense-f32"]
    arch = open_model(path).metadata["general.architecture"]
    unsaid = rewrite_gguf(path, tmp_path / "unsaid.gguf", drop_keys={f"{arch}.expert_weights_norm"})
    ids = hf_ids(moe[family]["model"], TEXT)[:10]
    assert torch.equal(our_logits(unsaid, ids, "dense"), our_logits(path, ids, "dense"))


def test_more_experts_per_token_than_there_are_is_refused(moe: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    bent = rewrite_gguf(
        moe["qwen3moe"]["dense-f32"], tmp_path / "bent.gguf", replace={"qwen3moe.expert_used_count": (9, None)}
    )
    ran = run_in_process("run", "-m", str(bent), "-p", "Once", "-n", "2")
    assert ran.returncode == 2 and ran.stdout == "", ran.stderr
    assert ran.stderr == f"error: {bent}: 9 of 8 experts per token; the file is corrupt, re-convert it\n"


def test_keys_and_values_of_different_sizes_are_refused(moe: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    bent = rewrite_gguf(
        moe["qwen3moe"]["dense-f32"], tmp_path / "bent.gguf", replace={"qwen3moe.attention.value_length": (16, None)}
    )
    ran = run_in_process("run", "-m", str(bent), "-p", "Once", "-n", "2")
    assert ran.returncode == 2 and ran.stdout == "", ran.stderr
    assert ran.stderr == (
        f"error: {bent}: keys and values of different sizes (qwen3moe.attention.key_length, "
        "qwen3moe.attention.value_length) do not run; use another model\n"
    )
