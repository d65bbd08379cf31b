"""`prep calibrate` (CATS): thresholds that skip the asked share of a SwiGLU model's activations, counts the
planner reads, and a calibrated file whose sparse logits equal transformers' with the same thresholds applied."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import F32_KV, KVPolicy
from qinfer.formats.activation_files import read_activations
from qinfer.formats.gpuidx import GpuIndex, gpuidx_path_for, write_gpuidx
from qinfer.planner.make_plan import PlanOptions, dry_run_account
from qinfer.prep.convert.convert import convert
from qinfer.prep.predictor.training import TrainSettings, train_predictors
from qinfer.prep.profile.activation_profile import profile_activations
from qinfer.prep.profile.corpus_reader import corpus_files, token_windows
from qinfer.prep.profile.gate_calibration import calibrate_gate
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.ffn.hybrid import HybridRunner
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.runtime.engine.test_mixed_step import mixed_equals_alone
from tests.support.cli_in_process import run_in_process
from tests.support.native_placement import placement_of

TEXT = "Once upon a time, Lily found a red ball in the park. She was happy and played with it all day long."
SEQ_LEN = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text(synth_corpus(5, 20_000, "calibrate"), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def calibrated(swiglu: dict[str, dict[str, Path]], corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("calibrated")
    # Named as the planner looks for the counts beside a model file.
    result = calibrate_gate(swiglu["llama3"]["model"], corpus, 0.5, out / "activation", seq_len=SEQ_LEN, device="cpu")
    files = {
        fmt: convert(swiglu["llama3"]["model"], out / f"l3-{fmt}.powerinfer.gguf", None, fmt, result.out).outfile
        for fmt in ("f32", "f16")
    }
    return {"result": result, **files}


def gate_values(model_dir: Path, corpus: Path) -> list[torch.Tensor]:
    """Every |silu(gate)| of every layer over the corpus windows, computed independently of the calibrator."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    values: list[list[torch.Tensor]] = [[] for _ in model.model.layers]

    def keep(i: int) -> Callable[..., None]:
        return lambda _m, _a, out: values[i].append(F.silu(out).abs().flatten())

    handles = [layer.mlp.gate_proj.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        for window in token_windows(tokenizer, corpus_files(corpus), SEQ_LEN):
            model.model(input_ids=window[None])
    for handle in handles:
        handle.remove()
    return [torch.cat(v) for v in values]


def test_thresholds_skip_the_asked_share(calibrated: dict, swiglu: dict[str, dict[str, Path]], corpus: Path) -> None:
    result = calibrated["result"]
    thresholds = result.calibration.thresholds
    for layer, values in enumerate(gate_values(swiglu["llama3"]["model"], corpus)):
        assert result.calibration.tokens * 192 == values.numel()
        # A threshold from a sample of the values: its share within a percent of the asked one, on all of them.
        assert abs((values <= thresholds[layer]).float().mean().item() - 0.5) < 0.01
        assert result.achieved[layer] == pytest.approx((values <= thresholds[layer]).float().mean().item(), abs=1e-6)
    counts = read_activations(result.out)
    assert [int(c.sum()) for c in counts] == [round((1 - a) * result.calibration.tokens * 192) for a in result.achieved]
    saved = json.loads((result.out / "gate_thresholds.json").read_text())
    tokens = result.calibration.tokens
    assert saved == {
        "activation": "silu",
        "sparsity": 0.5,
        "tokens": tokens,
        "thresholds": thresholds,
        "arch": "llama",
        "hidden": 64,
        "ffn": 192,
        "vocab": 640,
    }


def cats_reference(model_dir: Path, thresholds: list[float], ids: list[int]) -> torch.Tensor:
    """transformers' Llama with every MLP computing only the neurons whose |silu(gate)| passes its threshold."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for layer, threshold in zip(model.model.layers, thresholds, strict=True):
        mlp = layer.mlp

        def forward(x: torch.Tensor, mlp=mlp, t=threshold) -> torch.Tensor:
            g = F.silu(mlp.gate_proj(x))
            return mlp.down_proj(g * (g.abs() > t) * mlp.up_proj(x))

        mlp.forward = forward
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def decode(
    path: Path, ids: list[int], options: RuntimeOptions, native: bool = True, in_kernel: bool = False
) -> torch.Tensor:
    forward = load_forward(open_model(path), options).forward
    if not native:
        forward.native = None
    if in_kernel:
        assert isinstance(forward.ffn, HybridRunner)
        forward.ffn.in_kernel = True
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        return torch.cat([forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)])


def test_sparse_decode_equals_transformers_with_the_thresholds(
    calibrated: dict, swiglu: dict[str, dict[str, Path]]
) -> None:
    model_dir = swiglu["llama3"]["model"]
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    thresholds = calibrated["result"].calibration.thresholds
    sparse = decode(calibrated["f32"], ids, RuntimeOptions())  # auto: the file's thresholds select
    expected = cats_reference(model_dir, thresholds, ids)
    assert (sparse - expected).abs().max().item() < 1e-3
    dense = decode(calibrated["f32"], ids, RuntimeOptions(ffn="dense"))  # every neuron: the model itself
    assert (dense - cats_reference(model_dir, [0.0, 0.0], ids)).abs().max().item() < 1e-3
    assert (dense - sparse).abs().max().item() > 0.05  # the thresholds do change the logits


@pytest.mark.usefixtures("kernel_build")
def test_native_step_skips_the_same_neurons(calibrated: dict, swiglu: dict[str, dict[str, Path]]) -> None:
    ids = AutoTokenizer.from_pretrained(swiglu["llama3"]["model"])(TEXT)["input_ids"]
    forward = load_forward(open_model(calibrated["f16"]), RuntimeOptions()).forward
    assert forward.native is not None and forward.native.dims.sparse == 0  # the gate, not a predictor, selects
    native, torch_path = (decode(calibrated["f16"], ids, RuntimeOptions(), native) for native in (True, False))
    assert (native - torch_path).abs().max().item() < 1e-3


def test_gpu_split_of_a_calibrated_model(calibrated: dict, swiglu: dict[str, dict[str, Path]]) -> None:
    """The planner places a calibrated model from its counts, and the split (a simulated GPU) gives the CPU's
    sparse logits."""
    ids = AutoTokenizer.from_pretrained(swiglu["llama3"]["model"])(TEXT)["input_ids"]
    split = RuntimeOptions(vram_budget_gib=0.2505, device="cpu", reset_gpu_index=True)
    loaded = load_forward(open_model(calibrated["f32"]), split)
    assert loaded.plan is not None and 0 < loaded.plan.gpu_activation_share < 1
    cpu = decode(calibrated["f32"], ids, RuntimeOptions())
    assert (decode(calibrated["f32"], ids, split) - cpu).abs().max().item() < 1e-4
    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        # The device side selecting by its gate inside the hot-FFN kernels (kernels/hot_ffn.py), in the interpreter;
        # compiled for a GPU, they take its tensors alone (tests/runtime/kernels/test_hot_ffn.py checks them there).
        assert (decode(calibrated["f32"], ids, split, in_kernel=True) - cpu).abs().max().item() < 1e-4


def test_the_spare_fills_every_layer_of_a_model_its_gates_select(calibrated: dict, tmp_path: Path) -> None:
    """A calibrated model's gate selects its neurons on the GPU too, so a layer the plan gave no neuron still takes
    slots from the budget's spare under the dynamic schedule (a predictor model's would not: test_hybrid_split)."""
    model = tmp_path / "calibrated.gguf"
    shutil.copy(calibrated["f32"], model)
    shutil.copytree(calibrated["result"].out, tmp_path / "activation")
    ffn = open_model(model).config.ffn
    first = np.zeros(ffn, np.int32)
    first[:8] = 1
    write_gpuidx(gpuidx_path_for(model), GpuIndex(1, (first, np.zeros(ffn, np.int32))))
    options = RuntimeOptions(vram_budget_gib=1.0, device="cpu", schedule="dynamic")
    runner = load_forward(open_model(model), options).forward.ffn
    assert isinstance(runner, HybridRunner)
    assert [(c.resident, c.capacity) for c in runner.caches] == [(8, ffn), (0, ffn)]


def test_refusals(swiglu: dict[str, dict[str, Path]], corpus: Path, calibrated: dict, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="calibrate"):
        profile_activations(swiglu["qwen2"]["model"], corpus, tmp_path / "act", device="cpu")
    with pytest.raises(UserError, match="sparsity"):
        calibrate_gate(swiglu["qwen2"]["model"], corpus, 1.0, tmp_path / "cal")
    # Thresholds of a 2-layer model for a model of other shape are refused before anything is written.
    other = calibrated["result"].out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "gate_thresholds.json").write_text(json.dumps(
        {"activation": "silu", "sparsity": 0.5, "tokens": 1, "thresholds": [0.1]}
    ))  # fmt: skip
    with pytest.raises(UserError, match=r"is from another model \(layers 1, this model 2\); calibrate"):
        convert(swiglu["qwen2"]["model"], tmp_path / "x.gguf", None, "f32", tmp_path / "bad")
    assert not (tmp_path / "x.gguf").exists()
    # Nor are a model's thresholds put in another model's file (Llama-3-8B's in Mistral-7B's: both llama models of 32
    # layers of 4096 and 14336, told apart by their vocabularies), nor given to its predictors.
    written = json.loads((other / "gate_thresholds.json").read_text())
    assert (written["arch"], written["hidden"], written["ffn"], written["vocab"]) == ("llama", 64, 192, 640)
    with pytest.raises(UserError, match=r"is from another model \(architecture llama, this model qwen2\)"):
        convert(swiglu["qwen2"]["model"], tmp_path / "x.gguf", None, "f32", other)
    shape = {"neurons per layer": "ffn", "vocabulary": "vocab"}
    for label, key in shape.items():
        (tmp_path / "bad" / "gate_thresholds.json").write_text(json.dumps({**written, "arch": "qwen2", key: 512}))
        with pytest.raises(UserError, match=rf"another model \({label} 512, this model [0-9]+\)"):
            convert(swiglu["qwen2"]["model"], tmp_path / "x.gguf", None, "f32", tmp_path / "bad")
    settings = TrainSettings(rank=64, calibration=other, device="cpu")
    with pytest.raises(UserError, match="architecture llama, this model qwen2"):
        train_predictors(swiglu["qwen2"]["model"], corpus, tmp_path / "predictor", settings)
    # A directory written before the model was recorded is taken as it was.
    legacy = {key: value for key, value in written.items() if key not in ("arch", "hidden", "ffn", "vocab")}
    (tmp_path / "bad" / "gate_thresholds.json").write_text(json.dumps(legacy))
    assert convert(swiglu["qwen2"]["model"], tmp_path / "x.gguf", None, "f32", tmp_path / "bad").outfile.is_file()
    result = run_in_process("prep", "convert", str(swiglu["qwen2"]["model"]), "--outfile", str(tmp_path / "y.gguf"))
    assert result.returncode != 0 and "--calibration" in result.stderr and "Traceback" not in result.stderr
    assert other.is_dir()


def test_predictors_learn_the_thresholded_mask(
    calibrated: dict, swiglu: dict[str, dict[str, Path]], corpus: Path, tmp_path: Path
) -> None:
    model_dir = swiglu["llama3"]["model"]
    settings = TrainSettings(rank=64, train_tokens=6000, heldout_tokens=1500, seq_len=64, epochs=4, device="cpu")
    with pytest.raises(UserError, match="--calibration"):
        train_predictors(model_dir, corpus, tmp_path / "none", settings)
    cal = calibrated["result"].out
    report = train_predictors(model_dir, corpus, tmp_path / "predictor", replace(settings, calibration=cal))
    # The mask they learn is the calibrated one: half the neurons, whatever the predictor makes of it.
    assert all(abs(q.true_sparsity - 0.5) < 0.05 for q in report.layers)
    assert all(q.recall > 0.9 for q in report.layers)
    both = convert(model_dir, tmp_path / "both.powerinfer.gguf", tmp_path / "predictor", "f16", cal).outfile
    forward = load_forward(open_model(both), RuntimeOptions()).forward
    assert forward.native is not None and forward.native.dims.sparse == 1  # the predictor selects
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    expected = cats_reference(model_dir, calibrated["result"].calibration.thresholds, ids)
    # An untrained model's mask is hard to predict: its misses and extras move the logits about as far as the
    # thresholds themselves do (0.16 on average here), not more.
    assert (decode(both, ids, RuntimeOptions()) - expected).abs().mean().item() < 0.3


def test_a_dense_layout_file_skips_the_same_neurons(
    calibrated: dict, swiglu: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    """convert-dense --calibration: llama.cpp's layout with the thresholds beside it, sparse in our runtime (the
    native step's dense-layout down product) with the PowerInfer file's logits."""
    model_dir = swiglu["llama3"]["model"]
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    path = convert(model_dir, tmp_path / "d.gguf", None, "f16", calibrated["result"].out, dense=True).outfile
    model = open_model(path)
    assert not model.powerinfer and model.gate_thresholds == calibrated["result"].calibration.thresholds
    forward = load_forward(model, RuntimeOptions()).forward
    assert forward.native is not None and forward.native.dims.down_rows == 0
    assert (decode(path, ids, RuntimeOptions()) - decode(calibrated["f16"], ids, RuntimeOptions())).abs().max() < 1e-3


def test_dense_runner_ignores_thresholds_on_both_paths(calibrated: dict) -> None:
    """A forward built with the default (dense) runner on a calibrated file computes every neuron, natively and in
    torch alike."""
    from qinfer.runtime.model.llama import LlamaForward

    ids = list(range(5, 25))
    logits = []
    for native in (True, False):
        forward = LlamaForward(open_model(calibrated["f16"]))
        assert forward.native is not None
        forward.native = forward.native if native else None
        cache = KVCache(forward.cfg, 64, types=F32_KV)
        with torch.inference_mode():
            steps = [forward.forward(TokenBatch.decode([t], [j], [0]), cache) for j, t in enumerate(ids)]
        logits.append(torch.cat(steps))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-3


def test_a_calibrated_models_prompts_keep_the_torch_path(calibrated: dict) -> None:
    """The layer kernel skips the quiet neurons of every token it takes, so it takes the decode tokens alone: a
    prompt, alone or beside them, runs its FFN dense in torch."""
    forward = load_forward(open_model(calibrated["f16"]), RuntimeOptions(ffn="sparse")).forward
    cache = KVCache(forward.cfg, 64, slots=2)
    decode, prompt = TokenBatch.decode([5], [3], [0]), TokenBatch.prompt(torch.arange(3, 7), 0, 1)
    for batch, placement in ((decode, "decode"), (prompt, None), (TokenBatch.join([decode, prompt]), None)):
        assert placement_of(forward, batch, cache) == placement


def test_a_mixed_step_keeps_the_decode_tokens_sparse(calibrated: dict) -> None:
    """In a step that also carries a prompt's chunk, the chunk's FFN runs dense and the decode tokens' through the
    calibrated gate, each as it would alone: a stream's tokens do not depend on the prompts that share its steps.
    (Skipping gated neurons changes the logits, unlike a ReLU model's predictor that misses no firing neuron.)"""
    mixed_equals_alone(calibrated["f32"], ffn="sparse")


def test_the_planner_refuses_a_kv_window_for_a_sliding_window_model_as_the_runtime_does(
    calibrated: dict, swiglu: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    # Mistral's sliding window, calibrated with the Llama-3 model's thresholds (the same shapes): a file to plan.
    model = convert(swiglu["mistral"]["model"], tmp_path / "mis.powerinfer.gguf", None, "f32", calibrated["result"].out)
    window = KVPolicy("window", 8)
    with pytest.raises(UserError, match="attends to its last 16 tokens itself") as planned:
        dry_run_account(model.outfile, 2**30, PlanOptions(kv_policy=window))
    with pytest.raises(UserError) as loaded:
        Engine.open(model.outfile, kv_policy=window)
    assert str(planned.value) == str(loaded.value)
