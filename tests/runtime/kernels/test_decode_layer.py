"""The native decode step of a whole layer (decode_layer.c): the logits it gives equal the torch path's, which the
runtime's other tests hold against transformers, for one sequence and for a batch of sequences at their own
positions, whose every sequence gets what it gets alone; the f16 cache holds what torch's conversion gives, the q8_0
cache the torch path's Q8_0 blocks; the window cache's rows, positions and masses evolve as the torch path's; it runs
exactly where it applies and steps aside elsewhere; a sparse step with every neuron selected is the dense step; a
description that does not fit is refused."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KVPolicy, KVTypes
from qinfer.formats.predictor_dir import FC1, FC2
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.build import SynthReport, SynthShape, build_synth
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.moe import MOE_FAMILIES
from qinfer.runtime.engine.perplexity import perplexity
from qinfer.runtime.engine.sampling import greedy_rows
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.ffn.runners import DenseRunner, SparseRunner
from qinfer.runtime.kernels import decode_layer, row_kernels
from qinfer.runtime.kernels.decode_layer import MIXED_PROMPT_TOKENS, PROMPT_TOKENS, DecodeLayers
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache, make_kv_cache
from qinfer.runtime.kv.q8_rows import dequantize_rows
from qinfer.runtime.kv.window import WindowKVCache
from qinfer.runtime.model.forward import TransformerForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.support.native_placement import counting_runs, placement_of

# Every test here runs on each kernel build: native, AVX2 and plain C (tests/conftest.py).
pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the kernel"),
    pytest.mark.usefixtures("kernel_build"),
]
CTX = 64
IDS = [5, 17, 300, 42, 9, 77, 128, 3, 250, 61, 19, 400]
F32 = KVTypes("f32", "f32")


@pytest.fixture(scope="module")
def q8(gguf_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's PowerInfer and dense files in Q8_0."""
    out = tmp_path_factory.mktemp("q8")
    return {
        "pi": quantize_gguf(gguf_files["pi-f16"], out / "tiny.q8.powerinfer.gguf", "Q8_0").outfile,
        "dense": quantize_gguf(gguf_files["dense-f16"], out / "tiny.q8.gguf", "Q8_0").outfile,
    }


@pytest.fixture(scope="module")
def mixed_ranks(tiny: SynthReport, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with layer 1's predictor widened from rank 32 to 64 by zero rows of fc1 and zero columns of
    fc2: a file whose layers have different ranks, and whose predictions are unchanged."""
    out = tmp_path_factory.mktemp("ranks")
    predictor = shutil.copytree(tiny.predictor_dir, out / "predictor")
    state = torch.load(predictor / "model_1.pt")
    state[FC1] = torch.cat([state[FC1], torch.zeros_like(state[FC1])])
    state[FC2] = torch.cat([state[FC2], torch.zeros_like(state[FC2])], dim=1)
    torch.save(state, predictor / "model_1.pt")
    return convert(tiny.model_dir, out / "tiny.powerinfer.gguf", predictor, "f16").outfile


def forward_for(path: Path, ffn: str) -> TransformerForward:
    forward = load_forward(open_model(path), RuntimeOptions(ffn=ffn)).forward
    assert isinstance(forward, TransformerForward)
    return forward


def decode(
    forward: TransformerForward, native: bool, slot: int = 0, slots: int = 1, types: KVTypes = F32
) -> torch.Tensor:
    """Logits of a 3-token prompt, then one decode step per remaining token of IDS, in `slot` of a cache of `slots`,
    with or without the layer kernel; the other slots must stay untouched."""
    kept = forward.native  # type: ignore[attr-defined]
    forward.native = kept if native else None  # type: ignore[attr-defined]
    cache = make_kv_cache(forward.cfg, CTX, slots, types=types)
    assert isinstance(cache, KVCache)
    try:
        with torch.inference_mode():
            logits = [forward.forward(TokenBatch.prompt(torch.tensor(IDS[:3]), 0, slot), cache)[-1:]]
            for j, t in enumerate(IDS[3:], start=3):
                logits.append(forward.forward(TokenBatch.decode([t], [j], [slot]), cache))
    finally:
        forward.native = kept  # type: ignore[attr-defined]
    others = [s for s in range(slots) if s != slot]
    assert not cache.k[:, others].any() and not cache.v[:, others].any()
    return torch.cat(logits)


def decode_together(
    forward: TransformerForward, native: bool, sequences: int, together: bool, types: KVTypes = F32
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`sequences` prompts of different lengths (2 to 5 tokens of IDS, rotated), each in its own slot, then
    STEPS decode steps of teacher-forced tokens: all sequences in one forward call per step (together), or one call
    per sequence. Each sequence's logits per step, and the cache's keys."""
    kept = forward.native  # type: ignore[attr-defined]
    forward.native = kept if native else None  # type: ignore[attr-defined]
    cache = make_kv_cache(forward.cfg, CTX, sequences, types=types)
    prompts = [(IDS[s:] + IDS[:s])[: 2 + s % 4] for s in range(sequences)]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        with torch.inference_mode():
            for slot, prompt in enumerate(prompts):
                forward.forward(TokenBatch.prompt(torch.tensor(prompt), 0, slot), cache)
            for step in range(STEPS):
                tokens = [IDS[(slot + step) % len(IDS)] for slot in range(sequences)]
                positions = [len(p) + step for p in prompts]
                if together:
                    rows = forward.forward(TokenBatch.decode(tokens, positions, list(range(sequences))), cache)
                else:
                    rows = torch.cat([
                        forward.forward(TokenBatch.decode([t], [p], [slot]), cache)
                        for slot, (t, p) in enumerate(zip(tokens, positions, strict=True))
                    ])  # fmt: skip
                for slot in range(sequences):
                    logits[slot].append(rows[slot])
    finally:
        forward.native = kept  # type: ignore[attr-defined]
    return [torch.stack(rows) for rows in logits], cache.k.clone()


STEPS = 6


def assert_native_batch_matches_torch(
    forward: TransformerForward, monkeypatch: pytest.MonkeyPatch, tolerance: float
) -> None:
    """Three sequences decoded together natively (one call a step) give the torch path's logits, to
    `tolerance` of their largest."""
    assert forward.native is not None  # type: ignore[attr-defined]
    calls, heads = counting_runs(monkeypatch), counting_heads(monkeypatch)
    native, _ = decode_together(forward, True, 3, together=True)
    layers = list(range(forward.cfg.layers))
    prompts = forward.cfg.experts is None  # a mixture's prompts keep the torch path
    assert calls == ({"prompt": layers * 3} if prompts else {}) | {"decode": layers * STEPS}
    # The head too (every prompt token's, then each step's), but where it is tied to a quantized file's embeddings
    # (OPT's), which are expanded to float32 at load: those stay in torch.
    output = forward.output  # type: ignore[attr-defined]
    float_rows = isinstance(output, torch.Tensor) and output.dtype == torch.float32
    assert heads == ([] if float_rows else ([2, 3, 4] if prompts else []) + [3] * STEPS)
    reference, _ = decode_together(forward, False, 3, together=True)
    for mine, theirs in zip(native, reference, strict=True):
        assert (mine - theirs).abs().max() <= tolerance * theirs.abs().max()


def counting_heads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each head the native step computed (DecodeLayers.step giving logits)."""
    tokens: list[int] = []
    real = DecodeLayers.step

    def step(self: DecodeLayers, *args: Any) -> torch.Tensor | None:
        logits = real(self, *args)
        if logits is not None:
            tokens.append(logits.shape[0])
        return logits

    monkeypatch.setattr(DecodeLayers, "step", step)
    return tokens


@pytest.mark.parametrize("n", [1, 7, 8, 16, 45, 300])
def test_softmax_exponentials_match_float64(n: int) -> None:
    """The attention's exponentials (exp of each score less the largest) and their sum, a vector at a time and the
    rest one by one: within 2 ulp of float64 over scores spread across float's exponent range, 0 where the exact
    value is below float's normal range, NaN kept."""
    g = torch.Generator().manual_seed(n)
    x = -torch.rand(n, generator=g) * torch.tensor([1.0, 10.0, 80.0, 100.0, 1e-3])[torch.arange(n) % 5]
    x[0] = 0.0  # the largest
    exp = row_kernels.kernel().qinfer_exp_shifted  # type: ignore[union-attr]
    exp.argtypes, exp.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float], ctypes.c_float
    shifted = (x + 0.5).contiguous()
    total = exp(shifted.data_ptr(), n, 0.5)
    exact = (x.double()).exp()
    normal = exact >= torch.finfo(torch.float32).tiny
    assert ((shifted.double() - exact).abs() <= 2 * torch.finfo(torch.float32).eps * exact)[normal].all()
    assert (shifted[~normal] <= torch.finfo(torch.float32).tiny).all()
    assert abs(total - exact.sum().item()) <= 1e-6 * exact.sum().item()
    nan = torch.tensor([0.0, float("nan")] * 8)
    exp(nan.data_ptr(), 16, 0.0)
    assert nan[1::2].isnan().all() and (nan[::2] == 1.0).all()


@pytest.mark.parametrize(("file", "ffn"), [("pi-f16", "sparse"), ("pi-f16", "dense"), ("dense-f16", "dense")])
def test_f16_layers_give_the_torch_paths_logits(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, file: str, ffn: str
) -> None:
    """Grouped kv heads (4 heads over 2), rope, the cache, the predictor and both down layouts ([F, E] rows of a
    PowerInfer file, the dense file's [E, F] matrix); every decode step of every layer runs natively."""
    forward = forward_for(gguf_files[file], ffn)
    assert forward.native is not None  # type: ignore[attr-defined]
    calls, heads = counting_runs(monkeypatch), counting_heads(monkeypatch)
    native = decode(forward, True)
    layers = list(range(forward.cfg.layers))
    assert calls == {"prompt": layers, "decode": layers * (len(IDS) - 3)}
    assert heads == [3] + [1] * (len(IDS) - 3)  # the prompt's tokens, then each decode step's
    reference = decode(forward, False)
    assert (native - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.fixture(scope="module")
def heads_of_160(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer dense f16 model with two heads of 160 over one kv head: wider than one pass of the attention's
    value sums (eight vectors), ending in a part of one (AVX2: 8 + 8 + 4 vectors; AVX-512: 8 + 2)."""
    out = tmp_path_factory.mktemp("heads160")
    shape = SynthShape(layers=1, hidden=320, ffn=256, heads=2, kv_heads=1, vocab=512, context=128, predictor_rank=32)
    model = build_synth(out / "synth", shape, seed=3, train_steps=0)
    return convert(model.model_dir, out / "wide.gguf", None, "f16").outfile


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_wide_heads_give_the_torch_paths_logits(heads_of_160: Path, kv: str) -> None:
    forward = forward_for(heads_of_160, "dense")
    types = KVTypes(kv, kv)
    native, _ = decode_together(forward, True, 3, together=True, types=types)
    reference, _ = decode_together(forward, False, 3, together=True, types=types)
    for mine, theirs in zip(native, reference, strict=True):
        assert (mine - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_a_later_slot_and_mixed_predictor_ranks(gguf_files: dict[str, Path], mixed_ranks: Path) -> None:
    """Slot 2 of three (the others untouched), and a file whose layers' predictors have ranks 32 and 64."""
    forward = forward_for(gguf_files["pi-f16"], "sparse")
    reference = decode(forward, False, slot=2, slots=3)
    assert (decode(forward, True, slot=2, slots=3) - reference).abs().max() <= 1e-4 * reference.abs().max()
    mixed = forward_for(mixed_ranks, "sparse")
    assert mixed.native is not None and mixed.native.dims.predictor == 64  # type: ignore[attr-defined]
    assert [w.fc1.shape[0] for w in mixed.ffn.layers] == [32, 64]  # type: ignore[attr-defined]
    assert (decode(mixed, True) - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.mark.parametrize(("file", "ffn"), [("pi-f16", "sparse"), ("pi-f16", "dense"), ("dense-f16", "dense")])
def test_a_batch_of_sequences_gets_what_each_gets_alone(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, file: str, ffn: str
) -> None:
    """Three sequences at different positions decode in one native call a step; each one's logits
    are those it gets decoding alone, natively, and those of the torch path's batch."""
    forward = forward_for(gguf_files[file], ffn)
    calls = counting_runs(monkeypatch)
    together, _ = decode_together(forward, True, 3, together=True)
    assert calls["decode"] == list(range(forward.cfg.layers)) * STEPS
    alone, _ = decode_together(forward, True, 3, together=False)
    torch_batch, _ = decode_together(forward, False, 3, together=True)
    for mine, single, reference in zip(together, alone, torch_batch, strict=True):
        assert (mine - single).abs().max() <= 1e-4 * single.abs().max()
        assert (mine - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_a_batch_wider_than_a_token_block(gguf_files: dict[str, Path]) -> None:
    """18 sequences (past the kernels' block of 16 tokens, so the products go in two blocks) on the sparse file."""
    forward = forward_for(gguf_files["pi-f16"], "sparse")
    together, _ = decode_together(forward, True, 18, together=True)
    alone, _ = decode_together(forward, True, 18, together=False)
    for mine, single in zip(together, alone, strict=True):
        assert (mine - single).abs().max() <= 1e-4 * single.abs().max()


@pytest.mark.parametrize("types", [KVTypes("f16", "f16"), KVTypes("f16", "f32"), KVTypes("f32", "f16")])
def test_an_f16_cache_holds_what_torch_writes(gguf_files: dict[str, Path], types: KVTypes) -> None:
    """With f16 keys or values the kernel rounds each one as torch's conversion does (to nearest, ties to even):
    the caches of the two paths agree to an f16 step, and the logits to f16 rounding."""
    forward = forward_for(gguf_files["pi-f16"], "dense")
    native, native_k = decode_together(forward, True, 3, together=True, types=types)
    reference, reference_k = decode_together(forward, False, 3, together=True, types=types)
    assert native_k.dtype == (torch.float16 if types.k == "f16" else torch.float32)
    step = reference_k.float().abs() * 2**-10 + 2**-24
    assert ((native_k.float() - reference_k.float()).abs() <= step).all()
    for mine, theirs in zip(native, reference, strict=True):
        assert (mine - theirs).abs().max() <= 2e-3 * theirs.abs().max()
    exact, _ = decode_together(forward, True, 3, together=True)
    assert 0 < (native[0] - exact[0]).abs().max() <= 2e-2 * exact[0].abs().max()


@pytest.mark.parametrize(
    ("types", "ffn"),
    [(KVTypes("q8_0", "q8_0"), "sparse"), (KVTypes("q8_0", "q8_0"), "dense"), (KVTypes("q8_0", "f32"), "dense"),
     (KVTypes("f16", "q8_0"), "dense")],
)  # fmt: skip
def test_a_q8_cache_holds_the_torch_paths_blocks(
    wide_heads: Path, monkeypatch: pytest.MonkeyPatch, types: KVTypes, ffn: str
) -> None:
    """q8_0 keys or values (heads of 32, one block): every decode step runs natively; the kernel writes the Q8_0
    blocks the torch path writes (a value whose product rounds otherwise may land one step away) and reads them in
    place, so the logits are the torch path's over the dequantized rows to float rounding; both stay within 2% of
    the f32 cache's logits."""
    forward = forward_for(wide_heads, ffn)
    calls = counting_runs(monkeypatch)
    native, native_k = decode_together(forward, True, 3, together=True, types=types)
    assert calls["decode"] == list(range(forward.cfg.layers)) * STEPS
    reference, reference_k = decode_together(forward, False, 3, together=True, types=types)
    if types.k == "q8_0":
        assert native_k.dtype == torch.uint8 and (native_k == reference_k).float().mean() > 0.99
        step = reference_k.view(*reference_k.shape[:-1], -1, 34)[..., :2].contiguous().view(torch.float16).float()
        apart = (dequantize_rows(native_k) - dequantize_rows(reference_k)).abs()
        assert (apart.view(*step.shape[:-1], 32) <= 1.01 * step + 1e-6).all()
    exact, _ = decode_together(forward, True, 3, together=True)
    for mine, theirs, f32 in zip(native, reference, exact, strict=True):
        assert (mine - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        assert (mine - f32).abs().max() <= 0.02 * f32.abs().max()


@pytest.fixture(scope="module")
def moe_files(moe: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Each mixture's f32 file and its f16, Q4_0 and Q8_0 conversions."""
    out = tmp_path_factory.mktemp("moe-types")
    files = {}
    for family in MOE_FAMILIES:
        files[family] = {
            "f32": moe[family]["dense-f32"],
            "f16": convert(moe[family]["model"], out / f"{family}.f16.gguf", None, "f16").outfile,
            **{
                qtype.lower(): quantize_gguf(moe[family]["dense-f32"], out / f"{family}.{qtype}.gguf", qtype).outfile
                for qtype in ("Q4_0", "Q8_0")
            },
        }
    return files


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixtures_layers_give_the_torch_paths_logits(
    moe_files: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Mixtral, Qwen2-MoE (its sigmoid-gated shared expert) and Qwen3-MoE (q/k norms, heads wider than hidden /
    heads) over f16 rows: the router, each token's top experts and their SwiGLU run in the layer step, for one
    sequence and for three decoded together, each token routed on its own; the logits are the torch path's. A
    float32 file's rows are not rows the kernels read: it keeps the torch path."""
    forward = forward_for(moe_files[family]["f16"], "dense")
    assert forward.native is not None and forward.native.dims.experts > 0  # type: ignore[attr-defined]
    calls = counting_runs(monkeypatch)
    native = decode(forward, True)
    assert calls == {"decode": list(range(forward.cfg.layers)) * (len(IDS) - 3)}  # a mixture's prompt stays in torch
    reference = decode(forward, False)
    assert (native - reference).abs().max() <= 1e-4 * reference.abs().max()
    assert_native_batch_matches_torch(forward, monkeypatch, 1e-4)
    assert forward_for(moe_files[family]["f32"], "dense").native is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixtures_quantized_layers_stay_within_input_rounding_of_the_torch_path(
    moe_files: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch, family: str, qtype: str
) -> None:
    """Q4_0 or Q8_0 experts and attention, three sequences decoded together: both paths quantize each product's
    input to Q8_0 blocks, the layer step after norms computed in its own order, so an input can round to the
    neighbouring step; the logits agree as test_moe_families.py's Q4_0 experts do (which decode one sequence,
    natively too). Where a token's router nearly ties two experts, that rounding may choose the other one, and the
    token's logits then differ by far more: the one sequence `decode` runs meets such a tie in Qwen3-MoE's Q4_0 file
    (0.1372 against 0.1370), and one step 16% apart; these prompts meet none."""
    forward = forward_for(moe_files[family][qtype], "dense")
    calls = counting_runs(monkeypatch)
    together, _ = decode_together(forward, True, 3, together=True)
    assert calls["decode"] == list(range(forward.cfg.layers)) * STEPS
    batch, _ = decode_together(forward, False, 3, together=True)
    for mine, theirs in zip(together, batch, strict=True):
        scale = theirs.abs().max()
        assert (mine - theirs).abs().max() < 0.03 * scale and (mine - theirs).abs().mean() < 0.005 * scale


def decode_window(
    forward: TransformerForward, native: bool, rows: int, steps: int
) -> tuple[torch.Tensor, WindowKVCache]:
    """Three prompts of 3 to 5 tokens in slots of a window cache of `rows` rows, then `steps` decode steps of the
    three together: the logits of every step, and the cache."""
    kept = forward.native  # type: ignore[attr-defined]
    forward.native = kept if native else None  # type: ignore[attr-defined]
    cache = make_kv_cache(forward.cfg, CTX, 3, policy=KVPolicy("window", rows))
    assert isinstance(cache, WindowKVCache)
    ids = torch.randint(3, 500, (steps + 8,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    try:
        with torch.inference_mode():
            for slot in range(3):
                forward.forward(TokenBatch.prompt(torch.tensor(ids[: 3 + slot]), 0, slot), cache)
            for j in range(steps):
                step = TokenBatch.decode(ids[5 + j : 8 + j], [3 + j, 4 + j, 5 + j], [0, 1, 2])
                logits.append(forward.forward(step, cache))
    finally:
        forward.native = kept  # type: ignore[attr-defined]
    return torch.stack(logits), cache


@pytest.mark.parametrize(("file", "ffn"), [("pi-f16", "sparse"), ("dense-f16", "dense")])
def test_the_window_cache_decodes_natively(
    gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, file: str, ffn: str
) -> None:
    """Three sequences over windows of 8 rows (2 sinks, 1 recent, 5 heavy hitters) for 24 steps, well past the
    window: one native call a step, whose logits are the torch path's, and after which every slot keeps
    the same positions in the same rows, with the same masses, keys and values."""
    forward = forward_for(gguf_files[file], ffn)
    calls = counting_runs(monkeypatch)
    native, mine = decode_window(forward, True, 8, 24)
    assert calls == {"decode": list(range(forward.cfg.layers)) * 24}  # a window cache's prompts stay in torch
    reference, theirs = decode_window(forward, False, 8, 24)
    assert (native - reference).abs().max() <= 1e-4 * reference.abs().max()
    assert torch.equal(mine.pos, theirs.pos) and int(mine.pos.min()) >= 0 and int(mine.pos.max()) == 5 + 23
    assert ((mine.mass - theirs.mass).abs() <= 1e-5 * theirs.mass.abs().max()).all()
    for rows, reference_rows in ((mine.k, theirs.k), (mine.v, theirs.v)):
        assert (rows - reference_rows).abs().max() <= 1e-4 * reference_rows.abs().max()


@pytest.mark.parametrize(("file", "ffn"), [("pi", "sparse"), ("dense", "dense")])
def test_q8_layers_stay_within_input_rounding_of_the_torch_path(q8: dict[str, Path], file: str, ffn: str) -> None:
    """Q8_0 rows (with the dense file's down as a quantized [E, F] matrix, whose input is the activations): both
    paths quantize each product's input to Q8_0 blocks, but the layer computes its norms and attention in its own
    order, so an input can round to the neighbouring step: the logits agree to ~1%."""
    forward = forward_for(q8[file], ffn)
    assert forward.native is not None  # type: ignore[attr-defined]
    native, reference = decode(forward, True), decode(forward, False)
    assert (native - reference).abs().max() <= 0.02 * reference.abs().max()
    assert (native - reference).abs().mean() <= 0.002 * reference.abs().max()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize(("file", "ffn"), [("dense-f16", "dense"), ("pi-f16", "sparse")])
def test_a_quantized_batch_stays_within_input_rounding_of_the_torch_path(
    gguf_files: dict[str, Path], tmp_path: Path, qtype: str, file: str, ffn: str
) -> None:
    """Three sequences decoded together on a quantized file, where AVX-512 VNNI takes the selected neurons' rows
    sixteen at a time for every token of the batch (up's on the dense file, the predicted neurons' gate and up on
    the PowerInfer one), and the other builds row by row: each sequence's logits agree with the torch path's to
    input rounding, as a single sequence's do."""
    path = quantize_gguf(gguf_files[file], tmp_path / f"{file}.{qtype}.gguf", qtype).outfile
    forward = forward_for(path, ffn)
    assert forward.native is not None  # type: ignore[attr-defined]
    native, _ = decode_together(forward, True, 3, together=True)
    reference, _ = decode_together(forward, False, 3, together=True)
    for mine, theirs in zip(native, reference, strict=True):
        assert (mine - theirs).abs().max() <= 0.02 * theirs.abs().max()
        assert (mine - theirs).abs().mean() <= 0.002 * theirs.abs().max()


def test_every_neuron_selected_gives_the_dense_perplexity(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    """A threshold no predictor output falls below selects every neuron: the sparse layer is then the dense one."""
    tokenizer = GGUFTokenizer(open_model(gguf_files["pi-f16"]).metadata)
    ids = tokenizer.encode(synth_corpus(seed=7, n_chars=3000))
    dense = forward_for(gguf_files["pi-f16"], "dense")
    everything = forward_for(gguf_files["pi-f16"], "sparse")
    assert isinstance(everything.ffn, SparseRunner)
    everything.ffn.threshold = -float("inf")
    everything.native = everything.native_layers()  # type: ignore[attr-defined]
    dense_ppl = perplexity(dense, ids, CTX, tokenizer.bos_id, token_by_token=True).perplexity
    sparse_ppl = perplexity(everything, ids, CTX, tokenizer.bos_id, token_by_token=True).perplexity
    assert sparse_ppl == pytest.approx(dense_ppl, rel=1e-4)


def test_other_steps_keep_the_torch_path(gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than PROMPT_TOKENS, a mixed step whose decode tokens take the predictor, a window cache's
    prompt, QINFER_NATIVE=0, a runner swapped in after the layers were described, the oracle and float32 weights
    take the torch path."""
    forward = forward_for(gguf_files["pi-f16"], "sparse")
    calls = counting_runs(monkeypatch)
    cache = make_kv_cache(forward.cfg, CTX, slots=2)
    long = (IDS * 2)[: PROMPT_TOKENS + 1]
    with torch.inference_mode():
        forward.forward(TokenBatch.prompt(torch.tensor(long), 0, 0), cache)
        beside = TokenBatch.join(
            [TokenBatch.decode([1], [len(long)], [0]), TokenBatch.prompt(torch.tensor(IDS[:4]), 0, 1)]
        )
        forward.forward(beside, cache)
        window = make_kv_cache(forward.cfg, CTX, policy=KVPolicy("window", 8))
        forward.forward(TokenBatch.prompt(torch.tensor(IDS[:4]), 0), window)
        monkeypatch.setenv("QINFER_NATIVE", "0")
        forward.forward(TokenBatch.decode([1], [len(long) + 1], [0]), cache)
        forward.ffn = DenseRunner(forward.ffn.layers)  # type: ignore[attr-defined]
        monkeypatch.setenv("QINFER_NATIVE", "1")
        forward.forward(TokenBatch.decode([1], [len(long) + 2], [0]), cache)
    assert calls == {}
    assert forward_for(gguf_files["pi-f16"], "oracle").native is None  # type: ignore[attr-defined]
    assert forward_for(gguf_files["pi-f32"], "sparse").native is None  # type: ignore[attr-defined]


def test_prompt_tokens_run_natively_up_to_a_bound(gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the full cache, a prompt's chunk alone up to PROMPT_TOKENS tokens, and chunks beside other chunks, or
    beside decode tokens where those get a prompt's FFN (no predictor), up to MIXED_PROMPT_TOKENS each, up to
    STEP_TOKENS in all, and attention scores up to PROMPT_SCORES; never a window cache's, nor two tokens for one row
    of the cache, which the kernel refuses too, writing nothing."""
    dense, sparse = forward_for(gguf_files["dense-f16"], "dense"), forward_for(gguf_files["pi-f16"], "sparse")
    cache = make_kv_cache(dense.cfg, 2 * MIXED_PROMPT_TOKENS, slots=4)
    window = make_kv_cache(dense.cfg, CTX, slots=4, policy=KVPolicy("window", 8))
    decode = TokenBatch.decode([5, 6], [9, 4], [0, 1])
    twice = TokenBatch(torch.tensor([5, 6]), torch.tensor([3, 3]), torch.tensor([2, 2]))

    def prompt(n: int, slot: int = 2) -> TokenBatch:
        return TokenBatch.prompt(torch.arange(3, 3 + n), 0, slot)

    for forward, mixed in ((dense, "mixed"), (sparse, None)):
        half = PROMPT_TOKENS // 2
        assert placement_of(forward, decode, cache) == placement_of(forward, decode, window) == "decode"
        assert placement_of(forward, prompt(PROMPT_TOKENS), cache) == "prompt"
        assert placement_of(forward, TokenBatch.join([prompt(half, 1), prompt(half)]), cache) == "prompt"
        assert placement_of(forward, prompt(PROMPT_TOKENS + 1), cache) is None
        most = TokenBatch.join([prompt(MIXED_PROMPT_TOKENS, 1), prompt(MIXED_PROMPT_TOKENS)])
        assert placement_of(forward, most, cache) == "prompt"
        assert placement_of(forward, TokenBatch.join([prompt(2, 1), prompt(MIXED_PROMPT_TOKENS + 1)]), cache) is None
        assert placement_of(forward, TokenBatch.join([decode, prompt(MIXED_PROMPT_TOKENS)]), cache) == mixed
        assert placement_of(forward, TokenBatch.join([decode, prompt(MIXED_PROMPT_TOKENS + 1)]), cache) is None
        chunks = TokenBatch.join([decode, prompt(MIXED_PROMPT_TOKENS), prompt(MIXED_PROMPT_TOKENS, 3)])
        assert placement_of(forward, chunks, cache) == mixed
        assert placement_of(forward, prompt(4), window) is None
        assert placement_of(forward, twice, cache) is None
    monkeypatch.setattr(decode_layer, "STEP_TOKENS", 2 * MIXED_PROMPT_TOKENS - 1)
    assert placement_of(dense, most, cache) is None
    fits = TokenBatch.join([prompt(MIXED_PROMPT_TOKENS - 1, 1), prompt(MIXED_PROMPT_TOKENS)])
    assert placement_of(dense, fits, cache) == "prompt"
    monkeypatch.setattr(decode_layer, "PROMPT_SCORES", PROMPT_TOKENS * dense.cfg.heads * (cache.ctx + 1) - 1)
    assert placement_of(dense, prompt(PROMPT_TOKENS), cache) is None
    assert placement_of(dense, prompt(PROMPT_TOKENS - 1), cache) == "prompt"
    native = dense.native  # type: ignore[attr-defined]
    assert native is not None
    with torch.inference_mode(), pytest.raises(UserError):
        native.step(dense.embed_tokens(twice), twice, cache, "prompt", dense.inv_freq)
    assert not cache.k.any() and not cache.v.any()


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_the_native_head_gives_a_float64_heads_logits(gguf_files: dict[str, Path], tmp_path: Path, qtype: str) -> None:
    """The final RMSNorm and the output rows after the last layer, for three of five tokens asked in another order:
    F16 rows to float rounding of a float64 head over the last layer's output; Q8_0 rows (a quantized file's output,
    as llama.cpp keeps it), whose products take the normalised input in Q8_0 blocks, to that rounding (~1%)."""
    path = gguf_files["dense-f16"]
    if qtype != "F16":
        path = quantize_gguf(path, tmp_path / f"tiny.{qtype}.gguf", qtype).outfile
    forward = forward_for(path, "dense")
    native = forward.native  # type: ignore[attr-defined]
    assert native is not None
    output = forward.output  # type: ignore[attr-defined]
    assert (output.qtype.name if isinstance(output, QuantizedMatrix) else "F16") == qtype
    h = torch.randn(5, forward.cfg.hidden, generator=torch.Generator().manual_seed(0)) * 3
    cache = make_kv_cache(forward.cfg, CTX, slots=5)
    picked = [4, 1, 3]
    with torch.inference_mode():
        logits = native.step(h, TokenBatch.decode([1] * 5, [0] * 5, list(range(5))), cache, "decode",
                             forward.inv_freq, picked)  # fmt: skip
    assert logits is not None and logits.shape == (3, forward.cfg.vocab_size)
    rows = output.row_range(0, output.shape[0]) if isinstance(output, QuantizedMatrix) else output
    x = h[picked].double()  # the last layer's output: the step updates h in place
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + forward.cfg.norm_eps)
    reference = (normed * forward.norm.double()) @ rows.double().T  # type: ignore[attr-defined]
    tolerance = 1e-5 if qtype == "F16" else 0.02
    assert (logits.double() - reference).abs().max() <= tolerance * reference.abs().max()
    if qtype != "F16":
        assert (logits.double() - reference).abs().mean() <= 0.002 * reference.abs().max()


def test_a_step_that_asks_for_no_logits_gets_none(gguf_files: dict[str, Path]) -> None:
    """A prompt's one-token chunk that does not end it (the server's, beside no decode token) is a step the layer
    kernel takes; it asks for no row's logits and gets an empty [0, V]."""
    forward = forward_for(gguf_files["dense-f16"], "dense")
    cache = make_kv_cache(forward.cfg, CTX)
    with torch.inference_mode():
        logits = forward.forward(TokenBatch.decode([IDS[0]], [0], [0]), cache, rows=[])
    assert logits.shape == (0, forward.cfg.vocab_size)


def test_a_description_that_does_not_fit_is_refused(gguf_files: dict[str, Path]) -> None:
    """The kernel checks every matrix against the dimensions before it reads: a wrong row count is an error, and
    so is a head whose rows are narrower than the hidden size."""
    forward = forward_for(gguf_files["pi-f16"], "sparse")
    native = forward.native  # type: ignore[attr-defined]
    assert native is not None
    cache = make_kv_cache(forward.cfg, CTX)
    with torch.inference_mode():
        forward.forward(TokenBatch.prompt(torch.tensor(IDS[:3]), 0), cache)
        native.layers[1].o.rows -= 1
        before = cache.k.clone()
        with pytest.raises(UserError, match="corrupt"):
            forward.forward(TokenBatch.decode([1], [3], [0]), cache)
    assert torch.equal(cache.k[1], before[1])  # layer 1 wrote nothing
    native.layers[1].o.rows += 1
    assert native.output is not None
    native.output.cols -= 1  # the head's rows checked likewise
    with torch.inference_mode(), pytest.raises(UserError, match="corrupt"):
        forward.forward(TokenBatch.decode([1], [3], [0]), cache)


@pytest.mark.parametrize("cache", ["f16", "f32", "window"])
def test_greedy_steps_are_single_steps(gguf_files: dict[str, Path], cache: str) -> None:
    """Five greedy steps of two sequences in one native call: each step's tokens the argmax (greedy_rows) of the
    logits a single step gives, the last step's logits and the cache (a window's positions and masses too) bit for
    bit those of single steps; a token of `ends` ends the steps after the one that gives it."""
    forward = forward_for(gguf_files["dense-f16"], "dense")
    policy = KVPolicy("window", 8) if cache == "window" else None
    types = F32 if cache == "f32" else KVTypes("f16", "f16")
    single, grouped, ended = (
        make_kv_cache(forward.cfg, CTX, slots=2, policy=policy, types=types) for _ in range(3)
    )  # fmt: skip
    first = TokenBatch.decode([IDS[3], IDS[8]], [3, 3], [0, 1])
    expected = []
    with torch.inference_mode():
        for cache in (single, grouped, ended):
            for slot, prompt in enumerate((IDS[:3], IDS[5:8])):
                forward.forward(TokenBatch.prompt(torch.tensor(prompt), 0, slot), cache)
        batch = first
        for step in range(5):
            logits = forward.forward(batch, single)
            expected.append(greedy_rows(logits))
            batch = TokenBatch.decode(expected[-1], [4 + step] * 2, [0, 1])
        taken = forward.greedy_steps(first, grouped, 5, [])
        assert taken is not None
        tokens, last = taken
        end = expected[2][1]
        stopped = forward.greedy_steps(first, ended, 5, [end])
    assert tokens == expected and torch.equal(last, logits)
    parts = ("k", "v", "pos", "mass") if cache == "window" else ("k", "v")
    assert all(torch.equal(getattr(grouped, part), getattr(single, part)) for part in parts)
    assert stopped is not None and stopped[0] == expected[: 1 + [end in row for row in expected].index(True)]


def test_greedy_steps_take_greedy_rows_argmax(gguf_files: dict[str, Path]) -> None:
    """The kernel's argmax is greedy_rows': -1 where a row holds NaN (which ends the steps), and the first of equal
    largest logits. Output rows all zero but two equal ones give each token two equal logits, and zeros."""
    forward = forward_for(gguf_files["dense-f16"], "dense")
    native = forward.native  # type: ignore[attr-defined]
    assert native is not None and native.output is not None
    rows = torch.zeros_like(forward.output)  # type: ignore[attr-defined]
    rows[3] = rows[5] = torch.randn(forward.cfg.hidden, generator=torch.Generator().manual_seed(1))
    nan = forward.output.clone()  # type: ignore[attr-defined]
    nan[7] = float("nan")
    batch = TokenBatch.decode([IDS[3], IDS[8]], [0, 0], [0, 1])
    for table, steps in ((rows, 4), (nan, 1)):
        native.output.data = table.data_ptr()
        with torch.inference_mode():
            taken = forward.greedy_steps(batch, make_kv_cache(forward.cfg, CTX, slots=2), 4, [])
        assert taken is not None
        tokens, logits = taken
        assert len(tokens) == steps and tokens[-1] == greedy_rows(logits)
        if table is rows:
            assert torch.equal(logits[:, 3], logits[:, 5])
            assert tokens[-1] == [3 if top > 0 else 0 for top in logits[:, 3].tolist()]
    assert tokens == [[-1, -1]]
